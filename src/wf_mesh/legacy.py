"""Legacy rank predicates of ``worldfoundry.core.distributed`` that are not plain accessors.

The rest of the 20 legacy names live with the concept they belong to (``parallel_state``, ``runtime``,
``log``, ...) and are all re-exported from :mod:`wf_mesh`.
"""

from __future__ import annotations

import torch.distributed as dist

from wf_mesh.mesh import get_parallel_mesh

__all__ = ["is_last_rank", "is_last_tp_cp_rank"]


def is_last_rank() -> bool:
    """True on global rank ``world_size - 1`` (and in a non-distributed process)."""
    if not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def is_last_tp_cp_rank() -> bool:
    """True on the last rank of this rank's tp x cp group (and in a non-distributed process)."""
    if not dist.is_initialized():
        return True
    mesh = get_parallel_mesh()
    return mesh.rank("tp_cp") == mesh.size("tp_cp") - 1
