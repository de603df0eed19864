"""Context-parallel (CP) sequence sharding as DTensor placements on a 1-D cp mesh.

==========================  =====================  ==============================================
change                      collective             backward (gradient of the input)
==========================  =====================  ==============================================
shard: Replicate -> Shard   none (local chunk)     this rank's slice of the upstream gradient
gather: Shard -> Replicate  one all-gather         ``grad="replicate"``: local chunk, no collective
                                                   ``grad="partial"``: one reduce-scatter
broadcast_shard (src rank)  one scatter            none (the source's data is not differentiable)
==========================  =====================  ==============================================

Choose ``grad="replicate"`` when every CP rank computes the SAME loss from the gathered tensor (the
usual case for a gathered output: legacy ``cat_outputs_cp_with_grad``); choose ``grad="partial"`` when
ranks use the gathered tensor DIFFERENTLY (e.g. all-gathered K/V in attention), so the true gradient of a
shard is the sum of every rank's contribution.

Uneven lengths follow ``torch.chunk`` sizing (the first ranks get one more element; trailing ranks may get
none). The global shape is always passed to ``DTensor.from_local``; it is never inferred.

``mesh`` arguments take a 1-D DeviceMesh, a :class:`~wf_mesh.mesh.ParallelMesh` (its ``cp`` axis), or None
(the current mesh's ``cp`` axis). :func:`mesh_for_group` turns a legacy ProcessGroup into a cached 1-D mesh.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from wf_mesh import parallel_state
from wf_mesh.collectives import (
    KIND_TENSOR,
    ShapeMismatchError,
    exchange_headers,
    group_device,
)
from wf_mesh.mesh import (
    ParallelMesh,
    get_parallel_mesh,
    parallel_mesh_or_none,
    register_destroy_hook,
)

__all__ = [
    "GradRule",
    "IndivisibleSequenceError",
    "broadcast_shard",
    "check_divisible",
    "check_shards",
    "chunk_sizes",
    "cp_mesh",
    "find_split",
    "gather_sequence",
    "mesh_for_group",
    "normalize_dim",
    "sequence_dtensor",
    "shard_sequence",
]

GradRule = Literal["replicate", "partial"]


class IndivisibleSequenceError(AssertionError, ValueError):
    """A length that must divide evenly does not. Both AssertionError (the legacy contract) and ValueError."""


# ---- meshes -----------------------------------------------------------------------------------------
_group_meshes: dict[str, DeviceMesh] = {}


def _forget_group_meshes() -> None:
    _group_meshes.clear()


register_destroy_hook(_forget_group_meshes)


def mesh_for_group(group: dist.ProcessGroup) -> DeviceMesh:
    """The 1-D DeviceMesh over ``group``: the current mesh's ``cp`` axis when ``group`` is its cp group,
    else a mesh built once per group (``DeviceMesh.from_group``) and cached until the mesh is destroyed."""
    current = parallel_mesh_or_none()
    if current is not None and group is current.group("cp"):
        return current["cp"]
    name = group.group_name
    if name not in _group_meshes:
        device_type = group_device(group).type
        _group_meshes[name] = DeviceMesh.from_group(group, device_type)
    return _group_meshes[name]


def cp_mesh(mesh: DeviceMesh | ParallelMesh | None = None) -> DeviceMesh:
    """Resolve a ``mesh`` argument (see the module docstring) to a 1-D DeviceMesh."""
    if mesh is None:
        mesh = get_parallel_mesh()
    if isinstance(mesh, ParallelMesh):
        return mesh["cp"]
    if mesh.ndim != 1:
        raise ValueError(f"context parallel needs a 1-D mesh, got {mesh.ndim}-D {mesh}; pass e.g. mesh['cp']")
    return mesh


# ---- sizing -----------------------------------------------------------------------------------------
def normalize_dim(dim: int, ndim: int, what: str = "seq_dim") -> int:
    """``dim`` in ``[0, ndim)``; negative dims count from the end. IndexError names the values."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"{what}={dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Per-rank lengths of ``torch.chunk(range(length), parts)``, padded with zeros to ``parts`` entries."""
    chunk = math.ceil(length / parts) if length else 0
    return [max(0, min(chunk, length - i * chunk)) for i in range(parts)]


def check_divisible(length: int, seq_dim: int, parts: int, what: str) -> None:
    """IndivisibleSequenceError naming the numbers unless ``parts`` divides ``length``."""
    if length % parts:
        raise IndivisibleSequenceError(
            f"{what}: sequence length {length} (seq_dim={seq_dim}) is not divisible by the cp size {parts}"
        )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _local_chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    sizes = chunk_sizes(x.shape[dim], parts)
    start = sum(sizes[:index])
    return x.narrow(dim, start, sizes[index]).contiguous()


def _from_shard(local: torch.Tensor, mesh: DeviceMesh, dim: int, global_shape: torch.Size) -> DTensor:
    return DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=global_shape, stride=_contiguous_stride(global_shape)
    )


def sequence_dtensor(
    local: torch.Tensor,
    seq_dim: int,
    global_shape: torch.Size | tuple[int, ...],
    *,
    mesh: DeviceMesh | ParallelMesh | None = None,
) -> DTensor:
    """Wrap this rank's CP shard as a DTensor placed ``Shard(seq_dim)`` with the given global shape (never
    inferred: inference assumes even shards). No collective."""
    return _from_shard(local, cp_mesh(mesh), normalize_dim(seq_dim, local.ndim), torch.Size(global_shape))


# ---- shard / gather ---------------------------------------------------------------------------------
def shard_sequence(
    x: torch.Tensor, seq_dim: int, *, mesh: DeviceMesh | ParallelMesh | None = None, as_dtensor: bool = True
) -> torch.Tensor:
    """This rank's CP shard of ``x`` along ``seq_dim`` (Replicate -> Shard): no collective.

    Rank r of the cp mesh gets block r in ``torch.chunk`` sizing (uneven lengths allowed). Returns a DTensor
    with placement ``Shard(seq_dim)`` and the full global shape, or its local tensor if ``as_dtensor=False``.
    Gradient: this rank's slice of the upstream gradient flows into ``x`` (no collective). Not idempotent:
    sharding a shard shards it again. A DTensor ``x`` is redistributed to ``Shard(seq_dim)`` instead.
    """
    mesh = cp_mesh(mesh)
    dim = normalize_dim(seq_dim, x.ndim)
    if isinstance(x, DTensor):
        out = x.redistribute(mesh, [Shard(dim)])
        return out if as_dtensor else out.to_local()
    local = _local_chunk(x, dim, mesh.size(), mesh.get_local_rank())
    return _from_shard(local, mesh, dim, x.shape) if as_dtensor else local


def check_shards(
    local: torch.Tensor, dim: int, expected: list[int] | None, mesh: DeviceMesh, what: str
) -> None:
    """All-gather every rank's shape and dtype; ShapeMismatchError, with the same message on EVERY rank,
    unless all shards match the group's first rank in dtype, ndim and the non-sequence dims, and rank i's
    length along ``dim`` is ``expected[i]`` (None: the first rank's length)."""
    group = mesh.get_group()
    headers = exchange_headers(local, group)
    ranks = dist.get_process_group_ranks(group)
    ref = headers[0]
    if expected is None and ref.kind == KIND_TENSOR:
        expected = [ref.shape[dim]] * len(ranks)

    def others(shape: torch.Size) -> tuple[int, ...]:
        return tuple(shape[:dim]) + tuple(shape[dim + 1 :])

    problems = []
    for r, h, length in zip(ranks, headers, expected or [None] * len(ranks)):
        if h.kind != KIND_TENSOR or (h.dtype, h.ndim) != (ref.dtype, ref.ndim) or others(h.shape) != others(ref.shape):
            problems.append(f"rank {r}: {h.describe()}")
        elif h.shape[dim] != length:
            problems.append(f"rank {r}: {h.describe()} (expected length {length} along dim {dim})")
    if problems:
        shapes = ", ".join(f"rank {r}: {h.describe()}" for r, h in zip(ranks, headers))
        raise ShapeMismatchError(f"{what}: CP shards disagree across ranks ({'; '.join(problems)}); all shards: {shapes}")


def gather_sequence(
    x: torch.Tensor,
    seq_dim: int | None = None,
    *,
    mesh: DeviceMesh | ParallelMesh | None = None,
    seq_len: int | None = None,
    grad: GradRule = "replicate",
    check: bool = True,
) -> torch.Tensor:
    """The full tensor from CP shards (Shard -> Replicate): one all-gather. Returns a plain tensor.

    ``x`` is a DTensor sharded on a 1-D mesh (its placement gives the dim and global shape), or this rank's
    local shard with ``seq_dim`` and the global ``seq_len`` (default: local length x cp size, i.e. even
    shards). ``grad`` chooses the backward rule (module docstring). For a plain ``x``, ``check=True``
    first all-gathers every rank's shape and dtype so that a mismatch raises ShapeMismatchError on every
    rank instead of corrupting data or hanging; pass ``check=False`` when shapes are known to agree.
    """
    if grad not in ("replicate", "partial"):
        raise ValueError(f"grad={grad!r}: use 'replicate' or 'partial'")
    if isinstance(x, DTensor):
        placements = x.placements
        if len(placements) != 1 or not isinstance(placements[0], Shard):
            raise ValueError(f"gather_sequence needs a DTensor with one Shard placement, got {placements}")
        if seq_dim is not None and normalize_dim(seq_dim, x.ndim) != placements[0].dim:
            raise ValueError(f"seq_dim={seq_dim} but the DTensor is sharded on dim {placements[0].dim}")
        dtensor = x
    else:
        mesh = cp_mesh(mesh)
        if seq_dim is None:
            raise TypeError("gather_sequence: a plain tensor needs seq_dim (the DTensor placement is missing)")
        dim = normalize_dim(seq_dim, x.ndim)
        parts = mesh.size()
        total = x.shape[dim] * parts if seq_len is None else seq_len
        expected = chunk_sizes(total, parts)
        if check:
            check_shards(x, dim, expected, mesh, "gather_sequence")
        elif x.shape[dim] != expected[mesh.get_local_rank()]:
            raise ValueError(
                f"gather_sequence: local length {x.shape[dim]} along dim {dim} does not match the shard "
                f"{expected[mesh.get_local_rank()]} of seq_len={total} over {parts} ranks"
            )
        dtensor = _from_shard(x, mesh, dim, x.shape[:dim] + (total,) + x.shape[dim + 1 :])
    grad_placement = Replicate() if grad == "replicate" else Partial()
    return dtensor.full_tensor(grad_placements=[grad_placement])


def broadcast_shard(
    x: torch.Tensor | None,
    seq_dim: int,
    *,
    mesh: DeviceMesh | ParallelMesh | None = None,
    as_dtensor: bool = True,
    require_even: bool = False,
) -> torch.Tensor:
    """Scatter the cp mesh's first rank's ``x`` so that every rank receives only its own shard.

    Receivers may pass None (or any tensor: it is ignored). The source's shape and dtype travel first, so
    every rank can allocate just its shard; each receiver gets ``1/cp`` of the bytes a broadcast would move.
    With ``require_even=True`` a length not divisible by the cp size raises IndivisibleSequenceError on
    every rank before any data moves.
    """
    mesh = cp_mesh(mesh)
    group = mesh.get_group()
    headers = exchange_headers(x, group)
    src = headers[0]
    if src.kind != KIND_TENSOR:
        raise TypeError(f"broadcast_shard: the source rank must pass a tensor, got {src.describe()}")
    dim = normalize_dim(seq_dim, src.ndim)
    parts, index = mesh.size(), mesh.get_local_rank()
    if require_even:
        check_divisible(src.shape[dim], seq_dim, parts, "broadcast_split_tensor")
    sizes = chunk_sizes(src.shape[dim], parts)
    shard_shape = list(src.shape)
    shard_shape[dim] = sizes[index]
    device = group_device(group)
    out = torch.empty(shard_shape, dtype=src.dtype, device=device)
    chunks = None
    if index == 0:
        chunks = [_local_chunk(x.detach().to(device), dim, parts, i) for i in range(parts)]
    if len(set(sizes)) == 1:
        dist.scatter(out, chunks, group=group, group_src=0)
    else:  # gloo's scatter needs equal sizes: pad to the largest chunk, then trim.
        padded = list(shard_shape)
        padded[dim] = sizes[0]
        buffer = torch.empty(padded, dtype=src.dtype, device=device)
        if chunks is not None:
            chunks = [torch.nn.functional.pad(c, _pad_spec(c.ndim, dim, sizes[0] - c.shape[dim])) for c in chunks]
        dist.scatter(buffer, chunks, group=group, group_src=0)
        out = buffer.narrow(dim, 0, sizes[index]).contiguous()
    return _from_shard(out, mesh, dim, src.shape) if as_dtensor else out


def _pad_spec(ndim: int, dim: int, amount: int) -> list[int]:
    spec = [0] * (2 * ndim)
    spec[2 * (ndim - 1 - dim) + 1] = amount  # F.pad lists dims from the last one
    return spec


# ---- planning ---------------------------------------------------------------------------------------
def find_split(
    shape_tensor: torch.Size | tuple[int, ...],
    cp_size: int,
    patch_values: tuple[int, int, int] = (1, 2, 2),
    view_factor: int = 1,
) -> torch.Size:
    """Per-rank ``(T', H', W)`` of a ``(B, C, T, H, W)`` latent split over ``cp_size`` ranks, time first.

    Per-view ``T = T // view_factor``. Walking T, H, W with ``remaining = cp_size``: ``g = gcd(size // patch,
    remaining)``, ``remaining //= g``, the dim becomes ``size // g``. Width is never split: anything left
    at W raises ValueError. Side effect (Megatron-compatible): sets ``wf_mesh.parallel_state.cp_size_t`` to
    the temporal share ``g`` of T; ``destroy_model_parallel`` removes it.

    >>> find_split((1, 16, 24, 88, 160), 16)
    torch.Size([3, 44, 160])
    """
    if len(shape_tensor) != 5:
        raise ValueError(f"find_split expects a (B, C, T, H, W) shape, got {tuple(shape_tensor)}")
    if cp_size < 1 or view_factor < 1:
        raise ValueError(f"find_split: cp_size={cp_size} and view_factor={view_factor} must be >= 1")
    _, _, t, h, w = (int(s) for s in shape_tensor)
    if t % view_factor:
        raise IndivisibleSequenceError(f"find_split: T={t} is not divisible by view_factor={view_factor}")
    t //= view_factor
    remaining, split = cp_size, []
    for size, patch in zip((t, h), patch_values[:2]):
        g = math.gcd(size // patch, remaining)
        remaining //= g
        split.append(size // g)
        if len(split) == 1:
            cp_size_t = g
    if remaining != 1:
        raise ValueError(
            f"find_split: cannot split (T={t}, H={h}, W={w}) with patch {tuple(patch_values)} over cp_size="
            f"{cp_size}: a factor {remaining} is left for W, which is never split"
        )
    parallel_state.cp_size_t = cp_size_t
    return torch.Size([*split, w])
