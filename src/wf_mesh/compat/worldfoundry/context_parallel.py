"""``worldfoundry.core.distributed.context_parallel``: splitting and gathering along the sequence for CP.

Tensor functions are :mod:`wf_mesh.legacy.context_parallel`'s (a None or one-rank group means CP off: the input
comes back as is). ``broadcast`` is :func:`wf_mesh.broadcast` (typed and pickle-free for plain values, from the
group's smallest rank). The object-list pair splits a list into contiguous per-rank blocks whose sizes differ by at
most one (the first ``len % size`` ranks get one more item) and concatenates them back in group-rank order.
"""

from wf_mesh.collectives import broadcast
from wf_mesh.legacy.context_parallel import (
    broadcast_split_tensor,
    cat_outputs_cp,
    cat_outputs_cp_object_list,
    cat_outputs_cp_with_grad,
    find_split,
    robust_broadcast,
    split_inputs_cp,
    split_inputs_cp_object_list,
)

__all__ = [
    "broadcast",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_object_list",
    "cat_outputs_cp_with_grad",
    "find_split",
    "robust_broadcast",
    "split_inputs_cp",
    "split_inputs_cp_object_list",
]
