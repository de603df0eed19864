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
usual case for a gathered output); choose ``grad="partial"`` when ranks use the gathered tensor
DIFFERENTLY (e.g. all-gathered K/V in attention), so the true gradient of a shard is the sum of every
rank's contribution.

Shards are plain local tensors by default, so the obvious loop works with ordinary modules::

    x_local = shard_sequence(x, seq_dim=1)          # this rank's block, no collective
    y = gather_sequence(model(x_local), seq_dim=1)  # nn.Linear, attention, ... on local tokens

DTensor-aware models pass ``as_dtensor=True`` and get ``Shard(seq_dim)`` DTensors; ``gather_sequence`` then
needs no ``seq_dim``. (An ordinary module cannot mix a DTensor input with its plain parameters, which is why
plain tensors are the default.)

Uneven lengths follow ``torch.chunk`` sizing (:mod:`wf_mesh.sizing`; trailing ranks may get nothing). The
global shape is always passed to ``DTensor.from_local``; it is never inferred. A plain shard remembers its
``seq_dim`` (an attribute of the returned tensor), so gathering that tensor along another dim raises.

Every call that communicates agrees first (:mod:`wf_mesh.agreement`): ranks exchange ``seq_dim``, the
global length, DTensor-or-plain, dtype and shape in one small all-gather, so a bad or mismatched argument on
one rank raises the same error on every rank instead of hanging or silently mixing rows and columns.

``mesh`` arguments take a 1-D DeviceMesh, a :class:`~wf_mesh.mesh.ParallelMesh` (its ``cp`` axis), or None
(the current mesh's ``cp`` axis).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from wf_mesh import _compat, agreement, waits
from wf_mesh.collectives import bytes_of, tensor_from_bytes
from wf_mesh.errors import ShapeMismatchError, StateError
from wf_mesh.faults import FaultSequence
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh
from wf_mesh.sizing import chunk_range, chunk_sizes
from wf_mesh.topology import as_int

__all__ = ["BYTE_DTYPES", "GradRule", "broadcast_shard", "gather_sequence", "sequence_dtensor", "shard_sequence"]

GradRule = Literal["replicate", "partial"]
_GRAD_RULES = ("replicate", "partial")


# ---- meshes and dims --------------------------------------------------------------------------------
def cp_mesh(mesh: DeviceMesh | ParallelMesh | None = None) -> DeviceMesh:
    """Resolve a ``mesh`` argument (see the module docstring) to a live 1-D DeviceMesh."""
    if mesh is None:
        mesh = get_parallel_mesh()
    if isinstance(mesh, ParallelMesh):
        return mesh["cp"]
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, a ParallelMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"context parallel needs a 1-D mesh, got {mesh.ndim}-D {mesh}; pass e.g. mesh['cp']")
    require_live(mesh, "the mesh")
    return mesh


def require_live(mesh: DeviceMesh, what: str) -> None:
    """StateError, naming ``what``, if ``mesh``'s process groups were destroyed."""
    if not _compat.mesh_is_live(mesh):
        raise StateError(
            f"{what} ({mesh}) belongs to a destroyed mesh (ParallelMesh.destroy); build tensors on the current mesh"
        )


def normalize_dim(dim: int, ndim: int, what: str = "seq_dim") -> int:
    """``dim`` in ``[0, ndim)``; negative dims count from the end. TypeError / IndexError name the values."""
    dim = as_int(what, dim)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{what}={dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def local_chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Block ``index`` of ``parts`` of ``x`` along ``dim`` (torch.chunk sizing): a view, no copy."""
    start, stop = chunk_range(x.shape[dim], parts, index)
    return x.narrow(dim, start, stop - start)


@dataclasses.dataclass(frozen=True)
class _ShardRecord:
    """How a plain shard was made, kept on the tensor that :func:`shard_sequence` / :func:`broadcast_shard`
    return: the dim it was sharded on, and the tensor's shape and strides then (an in-place view change such
    as ``transpose_`` voids the record rather than make it lie)."""

    seq_dim: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    made_by: str


_RECORD = "_wf_mesh_shard"  # an attribute of our own on the returned tensor: no registry, no collective


def _record_shard(local: torch.Tensor, dim: int, made_by: str) -> torch.Tensor:
    if not torch.compiler.is_compiling():  # a Python attribute is a side effect dynamo need not trace
        try:
            setattr(local, _RECORD, _ShardRecord(dim, tuple(local.shape), local.stride(), made_by))
        except (AttributeError, TypeError, RuntimeError):  # a tensor type without attributes: no record
            pass
    return local


def _shard_record(x: torch.Tensor) -> tuple[int, str] | None:
    # (seq_dim, the function) of a plain shard shard_sequence / broadcast_shard returned, still laid out as then
    record = getattr(x, _RECORD, None)
    if not isinstance(record, _ShardRecord) or (record.shape, record.stride) != (tuple(x.shape), x.stride()):
        return None
    return record.seq_dim, record.made_by


def sequence_dtensor(
    local: torch.Tensor,
    seq_dim: int,
    global_shape: torch.Size | tuple[int, ...],
    *,
    mesh: DeviceMesh | ParallelMesh | None = None,
) -> DTensor:
    """Wrap this rank's CP shard as a DTensor placed ``Shard(seq_dim)`` with the given global shape (never
    inferred: inference assumes even shards). No collective, no check against the other ranks.

    Returns:
        The DTensor on the cp mesh whose local tensor is ``local``.
    """
    global_shape = torch.Size(global_shape)
    dim = normalize_dim(seq_dim, local.ndim)
    return DTensor.from_local(
        local, cp_mesh(mesh), [Shard(dim)], run_check=False, shape=global_shape, stride=_contiguous_stride(global_shape)
    )


# ---- shard ------------------------------------------------------------------------------------------
def shard_sequence(
    x: torch.Tensor, seq_dim: int, *, mesh: DeviceMesh | ParallelMesh | None = None, as_dtensor: bool = False
) -> torch.Tensor:
    """This rank's CP shard of ``x`` along ``seq_dim`` (Replicate -> Shard): no collective.

    Rank r of the cp mesh gets block r in ``torch.chunk`` sizing (uneven lengths allowed), as a view of
    ``x`` (no copy). Gradient: this rank's slice of the upstream gradient flows into ``x``. Not idempotent:
    sharding a shard shards it again. A DTensor ``x`` on the cp mesh is redistributed to ``Shard(seq_dim)``
    (DTensor's collective, if its placement needs one, under a bounded wait: a peer that stops answering raises
    :class:`~wf_mesh.errors.CollectiveTimeoutError` naming ``shard_sequence`` and the cp axis; not contained);
    one on another mesh is an error.

    The plain shard remembers ``seq_dim`` (a Python attribute, no collective): :func:`gather_sequence` of that
    very tensor with another ``seq_dim`` raises instead of concatenating the wrong dim. A new tensor computed
    from it (a module's output) carries no record.

    Returns:
        A plain tensor, so ordinary modules can run on it; with ``as_dtensor=True`` a DTensor placed
        ``Shard(seq_dim)`` with the full global shape instead.
    """
    mesh = cp_mesh(mesh)
    dim = normalize_dim(seq_dim, x.ndim)
    if isinstance(x, DTensor):
        _require_mesh(x, mesh, "shard_sequence")
        # bounded, not contained: the collective (a reduce-scatter from Partial, an all-to-all from another
        # Shard) is DTensor's own, with no local step of wf_mesh's inside to catch; its backward is unbounded
        with waits.bounded(mesh.get_group(), "shard_sequence"):
            out = x.redistribute(mesh, [Shard(dim)])
        return out if as_dtensor else _record_shard(out.to_local(), dim, "shard_sequence")
    local = local_chunk(x, dim, mesh.size(), mesh.get_local_rank())
    return (
        sequence_dtensor(local, dim, x.shape, mesh=mesh) if as_dtensor else _record_shard(local, dim, "shard_sequence")
    )


def _require_mesh(x: DTensor, mesh: DeviceMesh, what: str) -> None:
    require_live(x.device_mesh, f"{what}: the DTensor's mesh")
    if x.device_mesh != mesh:
        raise ValueError(
            f"{what}: the DTensor lives on {x.device_mesh} (placements {x.placements}), not on the cp mesh "
            f"{mesh} given as mesh=; redistribute it onto the cp mesh first, or pass mesh=x.device_mesh"
        )


# ---- gather -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _GatherFacts(agreement.Facts):
    # fact() fields last: to mypy's dataclass plugin any call is a default, and defaults must come last
    seq_dim: int
    seq_len: int | None
    """The global length: a DTensor's, or the ``seq_len`` given (None: the sum of the local lengths)."""
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    input: str = agreement.fact(label="DTensor-or-plain input", choices=("plain tensor", "DTensor"))
    grad: str = agreement.fact(choices=_GRAD_RULES)

    @property
    def local_len(self) -> int:
        return self.local_shape[self.seq_dim]

    def other_dims(self) -> str:
        """The dtype and the dims other than seq_dim, as messages show them."""
        shape = self.local_shape
        return f"{self.dtype} {(*shape[: self.seq_dim], '*', *shape[self.seq_dim + 1 :])}"


def _gather_facts(
    x: torch.Tensor, seq_dim: int | None, seq_len: int | None, grad: str, mesh: DeviceMesh
) -> _GatherFacts:
    """This rank's checks of a gather_sequence call, as its record."""
    if grad not in _GRAD_RULES:
        raise ValueError(f"grad={grad!r}: use 'replicate' or 'partial'")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or DTensor, got {type(x).__name__}")
    if x.dtype in BYTE_DTYPES and x.requires_grad:
        raise TypeError(
            f"gather_sequence moves {x.dtype} as bytes, which carries no gradient, and x requires grad; "
            "gather it in a floating dtype (x.float()) or detach it"
        )
    if isinstance(x, DTensor):
        _require_mesh(x, mesh, "gather_sequence")
        (placement,) = x.placements
        if not isinstance(placement, Shard):
            raise ValueError(f"gather_sequence needs a DTensor placed Shard(dim), got {x.placements}")
        if seq_dim is not None and normalize_dim(seq_dim, x.ndim) != placement.dim:
            raise ValueError(f"seq_dim={seq_dim} but the DTensor is sharded on dim {placement.dim}")
        local_shape = tuple(_compat.dtensor_local(x).shape)
        return _GatherFacts(placement.dim, x.shape[placement.dim], x.dtype, local_shape, input="DTensor", grad=grad)
    if seq_dim is None:
        raise TypeError("gather_sequence: a plain tensor needs seq_dim (only a DTensor carries its placement)")
    dim = normalize_dim(seq_dim, x.ndim)
    record = _shard_record(x)
    if record is not None and record[0] != dim:
        raise ValueError(
            f"seq_dim={seq_dim} but this tensor is a shard that {record[1]} made along dim "
            f"{record[0]} (local shape {tuple(x.shape)}); gather it with seq_dim={record[0]}"
        )
    total = None if seq_len is None else as_int("seq_len", seq_len, minimum=0)
    return _GatherFacts(dim, total, x.dtype, tuple(x.shape), input="plain tensor", grad=grad)


def gather_sequence(
    x: torch.Tensor,
    seq_dim: int | None = None,
    *,
    mesh: DeviceMesh | ParallelMesh | None = None,
    seq_len: int | None = None,
    grad: GradRule = "replicate",
) -> torch.Tensor:
    """The full tensor from CP shards (Shard -> Replicate): one all-gather.

    ``x`` is this rank's local shard with ``seq_dim``, or a DTensor placed ``Shard(dim)`` on a 1-D mesh (its
    placement gives the dim and its shape the global length; ``mesh=``, if given, must be its mesh). The
    global length is ``seq_len`` if given, else the sum of every rank's local length, which must be
    ``torch.chunk`` sizing over the cp ranks. ``grad`` chooses the backward rule (module docstring).

    Ranks agree first on DTensor-or-plain, dim, global length, dtype and the other dims (one tiny
    all-gather): any disagreement or bad argument raises on every rank before data moves. A ``seq_dim`` that
    contradicts how ``x`` was sharded is a bad argument wherever that is known: a DTensor's ``Shard`` dim, or
    the record a plain shard of :func:`shard_sequence` / :func:`broadcast_shard` keeps. With checks off
    (``WF_MESH_CHECKS=0``), a plain ``x`` of an uneven split needs ``seq_len`` (the default is then local
    length x cp size).

    Contained (:mod:`wf_mesh.faults`, when on): a rank whose copy-in, copy-out or backward local step raises
    makes every rank of the cp group raise its error, and the next call is exact. Under ``torch.compile`` the
    graph holds the same all-gather and backward as custom ops (``wf_mesh::gather_sequence``), so it is
    contained and bounded there too; the agreement exchange stays eager (a graph break, none with checks off).

    Returns:
        The full tensor, a plain tensor on every rank.

    Raises:
        ShapeMismatchError: shards that disagree on dtype or the other dims, or that are not the
            ``torch.chunk`` shards of the global length.
        DisagreementError: ranks that disagree on ``seq_dim``, ``seq_len``, ``grad`` or DTensor-or-plain.
        IndexError, TypeError, ValueError: a bad argument on any rank (ValueError: ``seq_dim`` contradicts the
            DTensor's placement or the shard's record).
        CollectiveTimeoutError: a peer did not answer within the cp group's timeout.
    """
    group_mesh = cp_mesh(mesh if mesh is not None or not isinstance(x, DTensor) else x.device_mesh)
    agreed = agreement.agree(
        group_mesh.get_group(), lambda: _gather_facts(x, seq_dim, seq_len, grad, group_mesh), what="gather_sequence"
    )
    parts, index = group_mesh.size(), group_mesh.get_local_rank()
    total = _agreed_length(agreed, parts) if agreed.exchanged else None
    dim = agreed.mine.seq_dim
    if isinstance(x, DTensor):
        total = x.shape[dim]
    elif total is None:  # checks off: trust seq_len, or even shards
        total = seq_len if seq_len is not None else x.shape[dim] * parts
        if x.shape[dim] != chunk_sizes(total, parts)[index]:
            raise ShapeMismatchError(
                f"gather_sequence: local length {x.shape[dim]} along dim {dim} is not shard {index} of "
                f"seq_len={total} over {parts} ranks ({chunk_sizes(total, parts)})"
            )
    shard = _compat.wait_if_async(x.to_local()) if isinstance(x, DTensor) else x
    layout = _Layout(group_mesh.get_group(), dim, tuple(chunk_sizes(total, parts)), index)
    if shard.dtype in BYTE_DTYPES:  # each element's bytes along one more trailing dim: seq_dim keeps its meaning
        raw = shard.detach().unsqueeze(-1).view(torch.uint8)
        return _gather_any(raw, layout, grad).view(shard.dtype).squeeze(-1)
    return _gather_any(shard, layout, grad)


def _gather_any(shard: torch.Tensor, layout: _Layout, rule: str) -> torch.Tensor:
    """The gather of :func:`gather_sequence`, eager or compiled: under ``torch.compile`` the graph holds
    :func:`gather_sequence_op` (the same contained, bounded all-gather, run eagerly inside the op).

    Returns:
        The full tensor.
    """
    if torch.compiler.is_compiling():
        return gather_sequence_op(shard, layout.group.group_name, layout.dim, list(layout.sizes), layout.index, rule)
    return typing.cast(torch.Tensor, _Gather.apply(shard, layout, rule))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where every rank's shard lies in a gather: the cp group, the dim, each rank's length, this rank."""

    group: dist.ProcessGroup
    dim: int
    sizes: tuple[int, ...]
    index: int

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.index])

    def padded(self, shape: torch.Size) -> torch.Size:
        """``shape`` with the seq dim as long as the longest shard (what every rank sends)."""
        return shape[: self.dim] + (self.sizes[0],) + shape[self.dim + 1 :]


class _Gather(torch.autograd.Function):
    """gather_sequence's data path: one all-gather forward; backward by the grad rule (module docstring)."""

    @staticmethod
    def forward(ctx: typing.Any, shard: torch.Tensor, layout: _Layout, rule: str) -> torch.Tensor:
        ctx.layout, ctx.rule = layout, rule
        return _gather(shard, layout)

    @staticmethod
    def backward(ctx: typing.Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        return _gather_backward(grad, ctx.layout, ctx.rule), None, None


def _gather_backward(grad: torch.Tensor, layout: _Layout, rule: str) -> torch.Tensor:
    """This rank's shard of the gradient of a gather's output, by the grad rule, contained."""
    seq = FaultSequence(layout.group, "gather_sequence")
    if rule == "replicate":  # every rank holds the same gradient: this rank's slice, no collective
        mine = seq.step(("backward slice", 1, 1), _slice, grad, layout)
    else:  # each rank's gradient of the whole: the sum of every rank's, sliced
        send = seq.step(("backward copy-in", 1, 1), _stacked, grad, layout)
        if send is None:  # the peers still expect this rank's part of the sum
            send = grad.new_zeros(_flat_shape(layout.padded(grad.shape), len(layout.sizes)))
        summed = grad.new_empty(layout.padded(grad.shape))
        with waits.bounded(layout.group, "gather_sequence backward"):
            _compat.reduce_scatter_single(summed, send, group=layout.group)
        mine = seq.step(("backward copy-out", 1, 1), _unpadded, summed, layout)
    seq.close()
    return typing.cast(torch.Tensor, mine)


@torch.library.custom_op("wf_mesh::gather_sequence", mutates_args=())
def gather_sequence_op(
    shard: torch.Tensor, group: str, dim: int, sizes: list[int], index: int, rule: str
) -> torch.Tensor:
    """:func:`gather_sequence`'s all-gather on the group named ``group`` (what a compiled graph holds)."""
    return _gather(shard, _Layout(_compat.resolve_group(group), dim, tuple(sizes), index))


@gather_sequence_op.register_fake
def _(shard, group, dim, sizes, index, rule):
    return shard.new_empty((*shard.shape[:dim], sum(sizes), *shard.shape[dim + 1 :]))


@torch.library.custom_op("wf_mesh::gather_sequence_backward", mutates_args=())
def gather_sequence_backward_op(
    grad: torch.Tensor, group: str, dim: int, sizes: list[int], index: int, rule: str
) -> torch.Tensor:
    """:func:`gather_sequence_op`'s backward by the grad rule ``rule``."""
    return _gather_backward(grad, _Layout(_compat.resolve_group(group), dim, tuple(sizes), index), rule)


@gather_sequence_backward_op.register_fake
def _(grad, group, dim, sizes, index, rule):
    return grad.new_empty((*grad.shape[:dim], sizes[index], *grad.shape[dim + 1 :]))


def _gather_op_setup(ctx: typing.Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.args = inputs[1:]


gather_sequence_op.register_autograd(
    lambda ctx, grad: (gather_sequence_backward_op(grad, *ctx.args), None, None, None, None, None),
    setup_context=_gather_op_setup,
)


def _gather(shard: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The all-gather of every rank's shard, padded to the longest, contained (:mod:`wf_mesh.faults`)."""
    seq = FaultSequence(layout.group, "gather_sequence")
    padded = layout.padded(shard.shape)
    flat = shard.new_empty(_flat_shape(padded, len(layout.sizes)))
    received = flat.view(len(layout.sizes), *padded)
    send = seq.step(("copy-in", 1, 1), _padded_shard, shard, layout)
    if send is None:  # the peers still expect this rank's block: send the buffer already held
        send = received[layout.index]
    with waits.bounded(layout.group, "gather_sequence"):
        _compat.all_gather_single(flat, send, group=layout.group)
    full = seq.step(("copy-out", 1, 1), _joined, received, flat, layout)
    seq.close()
    return typing.cast(torch.Tensor, full)


def _padded_shard(shard: torch.Tensor, layout: _Layout) -> torch.Tensor:
    if shard.shape[layout.dim] == layout.sizes[0]:
        return shard.contiguous()
    out = shard.new_zeros(layout.padded(shard.shape))
    out.narrow(layout.dim, 0, shard.shape[layout.dim]).copy_(shard)
    return out


def _joined(received: torch.Tensor, flat: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The blocks of ``received`` (one per rank, padded) cut to their lengths and joined along the seq dim."""
    dim, sizes = layout.dim, layout.sizes
    if dim == 0 and all(n == sizes[0] for n in sizes):  # already in order: no copy
        return flat
    return torch.cat([received[r].narrow(dim, 0, n) for r, n in enumerate(sizes)], dim)


def _slice(grad: torch.Tensor, layout: _Layout) -> torch.Tensor:
    # a copy, not a view: the shard's gradient must not keep the whole one alive
    mine = grad.narrow(layout.dim, layout.start, layout.sizes[layout.index])
    return mine.clone(memory_format=torch.contiguous_format)


def _stacked(grad: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Every rank's block of ``grad``, padded to the longest, one after the other along dim 0."""
    dim, sizes = layout.dim, layout.sizes
    if dim == 0 and all(n == sizes[0] for n in sizes):
        return grad.contiguous()
    padded = layout.padded(grad.shape)
    flat = grad.new_zeros(_flat_shape(padded, len(sizes)))
    blocks, start = flat.view(len(sizes), *padded), 0
    for r, n in enumerate(sizes):
        blocks[r].narrow(dim, 0, n).copy_(grad.narrow(dim, start, n))
        start += n
    return flat


def _flat_shape(padded: torch.Size, parts: int) -> tuple[int, ...]:
    """The shape of ``parts`` blocks of shape ``padded`` one after the other along dim 0 (the backends' layout)."""
    return (parts * padded[0], *padded[1:])


def _unpadded(summed: torch.Tensor, layout: _Layout) -> torch.Tensor:
    n = layout.sizes[layout.index]
    return summed if n == layout.sizes[0] else summed.narrow(layout.dim, 0, n).contiguous()


BYTE_DTYPES = frozenset(
    {
        torch.int16,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)
"""Dtypes :func:`gather_sequence` moves as bytes: gloo (and, for 16-bit integers, NCCL) has no reduction type
for them ("Invalid scalar type"); a gather needs none."""


def _agreed_length(agreed: agreement.Agreed[_GatherFacts], parts: int) -> int:
    """The global length every rank agreed on; ShapeMismatchError (on every rank) if shards do not fit it."""
    for name in ("input", "seq_dim", "seq_len", "grad"):
        agreed.require_same(name)
    agreed.require_same(
        key=_GatherFacts.other_dims, label="dtype and the dims other than seq_dim", error=ShapeMismatchError
    )
    lengths = [row.local_len for row in agreed.all_rows]
    total = agreed.mine.seq_len if agreed.mine.seq_len is not None else sum(lengths)
    expected = chunk_sizes(total, parts)
    if lengths != expected:
        shards = ", ".join(f"rank {r}: {n}" for r, n in zip(agreed.ranks, lengths))
        raise ShapeMismatchError(
            f"gather_sequence: local lengths along dim {agreed.mine.seq_dim} ({shards}) are not torch.chunk shards "
            f"of a sequence of {total} over {parts} ranks, which are {expected}"
        )
    return total


# ---- broadcast shard --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ScatterFacts(agreement.Facts):
    seq_dim: int
    dtype: torch.dtype | None = None
    """The source's tensor (None: the source passes None); receivers leave it out."""
    shape: tuple[int, ...] = ()


def _scatter_facts(x: torch.Tensor | None, seq_dim: int, source: bool) -> _ScatterFacts:
    seq = as_int("seq_dim", seq_dim)
    if not source or x is None:
        return _ScatterFacts(seq)
    if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
        raise TypeError(f"broadcast_shard: the source must pass a plain tensor or None, got {type(x).__name__}")
    normalize_dim(seq, x.ndim)
    return _ScatterFacts(seq, x.dtype, tuple(x.shape))


def broadcast_shard(
    x: torch.Tensor | None,
    seq_dim: int,
    *,
    mesh: DeviceMesh | ParallelMesh | None = None,
    as_dtensor: bool = False,
) -> torch.Tensor | None:
    """Scatter the cp mesh's first rank's ``x`` so that every rank receives only its own shard.

    Receivers may pass None (or any tensor: it is ignored). The source's shape and dtype travel in the
    agreement exchange, so every rank allocates just its shard: each receiver gets ``1/cp`` of the bytes a
    broadcast would move. Any dtype. If the source passes None, every rank gets None.

    Returns:
        This rank's shard as a plain tensor (a DTensor ``Shard(seq_dim)`` with ``as_dtensor=True``), on the
        group's device; None if the source passed None.

    Raises:
        TypeError: (on every rank) the source passes something else than a plain tensor or None, or a
            ``seq_dim`` that is not an int.
        IndexError: ``seq_dim`` out of range for the source's tensor on any rank.
        DisagreementError: ranks that name different dims.
    """
    mesh = cp_mesh(mesh)
    group = mesh.get_group()
    parts, index = mesh.size(), mesh.get_local_rank()
    source = index == 0
    agreed = agreement.agree(group, lambda: _scatter_facts(x, seq_dim, source), what="broadcast_shard", required=True)
    src = agreed.all_rows[0]
    if src.dtype is None:
        return None
    dtype, shape, ndim = src.dtype, torch.Size(src.shape), len(src.shape)
    bad = [(rank, r.seq_dim) for rank, r in zip(agreed.ranks, agreed.all_rows) if not -ndim <= r.seq_dim < ndim]
    if bad:
        raise IndexError(f"broadcast_shard: seq_dim out of range for the source's {ndim}-D tensor on ranks {bad}")
    agreed.require_same(key=lambda r: r.seq_dim % ndim, label="seq_dim")
    dim = src.seq_dim % ndim
    sizes = chunk_sizes(shape[dim], parts)
    device = agreement.comm_device(group)
    padded_shape = shape[:dim] + (sizes[0],) + shape[dim + 1 :]
    buffer = torch.empty(padded_shape.numel() * dtype.itemsize, dtype=torch.uint8, device=device)
    seq = FaultSequence(group, "broadcast_shard")  # contained: the source's copy-in, a receiver's copy-out
    chunks = None
    if source:  # equal-size byte buffers (gloo's scatter needs equal sizes): pad, then trim on receipt
        assert x is not None, "the source's facts carry its tensor"
        chunks = seq.step(("copy-in", 1, 1), _scatter_chunks, x, dim, sizes, device)
        if chunks is None:  # the receivers still expect their bytes
            chunks = [torch.zeros_like(buffer)] * parts
    with waits.bounded(group, "broadcast_shard"):
        dist.scatter(buffer, chunks, group=group, group_src=0)
    out = seq.step(("copy-out", 1, 1), _received_shard, buffer, dtype, padded_shape, dim, sizes[index])
    seq.close()
    return sequence_dtensor(out, dim, shape, mesh=mesh) if as_dtensor else _record_shard(out, dim, "broadcast_shard")


def _scatter_chunks(x: torch.Tensor, dim: int, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    parts = len(sizes)
    return [_padded_bytes(local_chunk(x.detach(), dim, parts, i), dim, sizes[0]).to(device) for i in range(parts)]


def _received_shard(
    buffer: torch.Tensor, dtype: torch.dtype, padded_shape: torch.Size, dim: int, length: int
) -> torch.Tensor:
    out = tensor_from_bytes(buffer, dtype, padded_shape).narrow(dim, 0, length)
    return out if length == padded_shape[dim] else out.contiguous()


def _padded_bytes(chunk: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if chunk.shape[dim] < length:
        pad = list(chunk.shape)
        pad[dim] = length - chunk.shape[dim]
        chunk = torch.cat([chunk, chunk.new_zeros(pad)], dim)
    return bytes_of(chunk)
