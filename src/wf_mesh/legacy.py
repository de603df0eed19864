"""Legacy functions of ``worldfoundry.core.distributed`` layered on the native API: rank predicates and the
context-parallel helpers that take a ProcessGroup (None = parallelism off: the input comes back as is).

The rest of the 20 legacy names live with the concept they belong to (``parallel_state``, ``runtime``,
``log``, ``collectives``, ``context_parallel``, ...) and are all re-exported from :mod:`wf_mesh`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from wf_mesh.context_parallel import (
    broadcast_shard,
    check_divisible,
    check_shards,
    gather_sequence,
    mesh_for_group,
    normalize_dim,
    shard_sequence,
)
from wf_mesh.mesh import get_parallel_mesh

__all__ = [
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_with_grad",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "split_inputs_cp",
]


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


# ---- context parallel (legacy names over wf_mesh.context_parallel) ----------------------------------
def split_inputs_cp(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous block of ``x`` along ``seq_dim`` (block r for group rank r); no collective.

    ``cp_group=None`` or a one-rank group returns ``x`` itself. The length must divide evenly:
    IndivisibleSequenceError (an AssertionError and a ValueError) names the length, dim and cp size.
    Not idempotent: splitting a split tensor shrinks it again.
    """
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return x
    mesh = mesh_for_group(cp_group)
    check_divisible(x.shape[normalize_dim(seq_dim, x.ndim)], seq_dim, mesh.size(), "split_inputs_cp")
    return shard_sequence(x, seq_dim, mesh=mesh, as_dtensor=False)


def _cat(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup, grad: bool) -> torch.Tensor:
    mesh = mesh_for_group(cp_group)
    dim = normalize_dim(seq_dim, x.ndim)
    check_shards(x, dim, None, mesh, "cat_outputs_cp")  # equal shapes, else ShapeMismatchError on every rank
    try:
        return gather_sequence(x if grad else x.detach(), dim, mesh=mesh, grad="replicate", check=False)
    except RuntimeError as e:
        raise RuntimeError("Failed to gather tensors") from e


def cat_outputs_cp(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's equal-shape ``x`` along ``seq_dim`` in group-rank order; no gradient.

    ``cp_group=None`` or a one-rank group returns ``x`` itself. Shapes or dtypes that differ across ranks
    raise ShapeMismatchError (a RuntimeError and a ValueError) on every rank; a failed collective raises
    ``RuntimeError("Failed to gather tensors")`` chained to its cause.
    """
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return x
    return _cat(x, seq_dim, cp_group, grad=False)


def cat_outputs_cp_with_grad(
    x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """:func:`cat_outputs_cp` whose result keeps this rank's autograd graph: the gradient of ``x`` is this
    rank's slice of the upstream gradient (no collective in backward; ``grad="replicate"``)."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return x
    return _cat(x, seq_dim, cp_group, grad=True)


def broadcast_split_tensor(
    tensor: torch.Tensor | None, seq_dim: int, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """The group's first rank's ``tensor``, reaching every rank as that rank's CP shard along ``seq_dim``.

    Each rank receives only its shard (a scatter), not the whole tensor. Receivers may pass None.
    ``process_group=None`` or a one-rank group returns ``tensor`` itself. The length must divide evenly by
    the group size (IndivisibleSequenceError on every rank).
    """
    if process_group is None or dist.get_world_size(process_group) == 1:
        return tensor
    mesh = mesh_for_group(process_group)
    return broadcast_shard(tensor, seq_dim, mesh=mesh, as_dtensor=False, require_even=True)
