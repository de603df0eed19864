"""The operations context-parallel attention is built from (:mod:`wf_mesh.attention` is the API).

- which global positions each rank's shard holds (:func:`rank_segments`, contiguous or zigzag);
- which (query rows, key block) pairs each ring step computes (:meth:`RingPlan.pairs`: only unmasked pairs
  and aligned causal squares; under a :class:`~wf_mesh.RangeMask` the mask's pieces within the block, full
  pieces merged by :func:`~wf_mesh.ring_schedule.merge_full_pieces`, fully masked blocks not computed), each on the kernel :mod:`wf_mesh.attention_kernels` chose (its log-sum-exp
  out, and a backward given the merged output and log-sum-exp of the whole key range), partial results
  merged by :func:`merge_partial` (online softmax) in the accumulation dtype (fp32; float64 for float64);
- the ring over K/V blocks as an autograd Function (:class:`RingAttention`): the next block travels while
  this one is computed, dK/dV travel back to their owners; a ring of one is plain blockwise attention. Under
  a mask a block travels only as far as the last ring rank that needs it (:func:`~wf_mesh.ring_schedule.ring_last_steps`, from the
  plan alone: every rank computes the same hops), and its dK/dV go from that rank straight to the owner
  (:class:`~wf_mesh.ring_schedule.RingSkips` counts what is skipped);
- the moves between sequence and head shards (:class:`SeqToHeads`, :class:`HeadsToSeq`: one all-to-all
  each) and the all-gather baseline (:class:`GatherKV`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from wf_mesh import _compat, p2p, waits
from wf_mesh.attention_kernels import Kernel, accumulation_dtype, attend, attend_backward
from wf_mesh.faults import FaultSequence
from wf_mesh.masks import Range
from wf_mesh.ring_schedule import Piece, merge_full_pieces
from wf_mesh.sizing import chunk_sizes

__all__ = [
    "GatherKV",
    "HeadsToSeq",
    "RingAttention",
    "RingPlan",
    "Segment",
    "SeqToHeads",
    "concat_segments",
    "gather_mask",
    "gather_mask_padded",
    "mask_pieces",
    "rank_segments",
    "zigzag_segments",
]


# ---- layouts: which global positions each rank holds ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows ``[offset, offset+length)`` of a local block hold global positions ``[start, start+length)``."""

    offset: int
    start: int
    length: int


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def zigzag_segments(length: int, parts: int) -> list[list[Segment]]:
    """The zigzag layout: the sequence cut into ``2 * parts`` ``torch.chunk`` chunks, rank r holding chunks r
    and ``2*parts-1-r``, in that order.

    Returns:
        Each rank's two segments (offsets within its own shard).
    """
    sizes = chunk_sizes(length, 2 * parts)
    starts = _starts(sizes)
    out = []
    for r in range(parts):
        a, b = r, 2 * parts - 1 - r
        out.append([Segment(0, starts[a], sizes[a]), Segment(sizes[a], starts[b], sizes[b])])
    return out


def rank_segments(length: int, parts: int, balance: str | None) -> list[list[Segment]]:
    """Each cp rank's segments (offsets within its own shard): ``torch.chunk`` shards, or zigzag."""
    if balance == "zigzag":
        return zigzag_segments(length, parts)
    sizes = chunk_sizes(length, parts)
    return [[Segment(0, start, size)] for start, size in zip(_starts(sizes), sizes)]


def concat_segments(blocks: Sequence[list[Segment]], offsets: Sequence[int], positional: bool) -> list[Segment]:
    """Segments of blocks stored at ``offsets`` of one tensor.

    Returns:
        The segments, empty ones dropped, neighbours in storage coalesced (if ``positional``, only when their
        positions continue too).
    """
    out: list[Segment] = []
    for segs, base in zip(blocks, offsets):
        for s in segs:
            if not s.length:
                continue
            last = out[-1] if out else None
            if (
                last is not None
                and last.offset + last.length == base + s.offset
                and (not positional or last.start + last.length == s.start)
            ):
                out[-1] = Segment(last.offset, last.start, last.length + s.length)
            else:
                out.append(Segment(base + s.offset, s.start, s.length))
    return out


# ---- merging the blocks ----------------------------------------------------------------------------------
def merge_partial(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial result ``(part, part_lse)`` into the running ``(out, lse)`` (in their accumulation dtype)
    in place (online softmax)."""
    part_lse = part_lse.to(lse.dtype)
    new = torch.logaddexp(lse, part_lse)
    safe = new.masked_fill(new == -math.inf, 0)  # rows with no key so far keep out = 0
    out.mul_(torch.exp(lse - safe)[..., None]).add_(part.to(out.dtype) * torch.exp(part_lse - safe)[..., None])
    lse.copy_(new)


# ---- the ring core (also the local attention of ulysses and allgather: a ring of one) -------------------
@dataclasses.dataclass(frozen=True)
class RingPlan:
    """Where every K/V block lives and which global positions its rows and this rank's queries hold."""

    group: dist.ProcessGroup | None  # the ring's group; None: one block, no communication
    index: int  # this rank's place in the ring (the block its queries belong to)
    q_segments: list[Segment]
    kv_segments: list[list[Segment]]  # per ring rank
    kv_lengths: list[int]
    causal: bool
    scale: float
    kernel: Kernel
    verdict: str = ""  # the name of the group every rank of the call is in: where a contained failure is told
    mask: tuple[tuple[Piece, ...], ...] | None = None
    """Under a RangeMask: per block j, the kernel calls of the mask's pieces within this rank's queries x block
    j's keys, in local rows (:func:`mask_pieces`: computed once per plan, not per call); None: no mask
    (``causal`` says the pattern)."""
    last_steps: tuple[int, ...] = ()
    """Per block, the last ring step a rank needs it (:func:`~wf_mesh.ring_schedule.ring_last_steps`); empty: every block travels the
    whole ring."""

    @property
    def size(self) -> int:
        """The number of ring ranks (K/V blocks)."""
        return len(self.kv_lengths)

    def last_step(self, j: int) -> int:
        """The last ring step at which block j is needed (it travels that many hops)."""
        return self.last_steps[j] if self.last_steps else self.size - 1

    def pairs(self, j: int) -> Iterator[tuple[slice, slice, bool]]:
        """``(query rows, key rows, causal)`` for the query segments against block j: causal pairs are cut
        into keys every query sees (unmasked) and the square where query and key positions coincide (the
        kernels' causal mode); keys that follow every query are left out. So no pair needs a position mask.

        Under a mask: the mask's pieces within the block (full pieces merged), none for a fully masked block.

        Yields:
            ``(query rows, key rows, causal)`` slices of one pair.
        """
        if self.mask is not None:
            for r0, r1, c0, c1, causal in self.mask[j]:
                yield slice(r0, r1), slice(c0, c1), causal
            return
        if not self.causal:
            for ks in self.kv_segments[j]:
                yield slice(None), slice(ks.offset, ks.offset + ks.length), False
            return
        for qs in self.q_segments:
            q_end = qs.start + qs.length
            for ks in self.kv_segments[j]:
                k_end = ks.start + ks.length
                if k_end <= qs.start + 1:  # every key is at or before the first query
                    yield slice(qs.offset, qs.offset + qs.length), slice(ks.offset, ks.offset + ks.length), False
                    continue
                before = min(k_end, qs.start) - ks.start  # keys before the first query: seen by every query
                if before > 0:
                    yield slice(qs.offset, qs.offset + qs.length), slice(ks.offset, ks.offset + before), False
                lo, hi = max(qs.start, ks.start), min(q_end, k_end)
                if lo >= hi:
                    continue
                keys = slice(ks.offset + lo - ks.start, ks.offset + hi - ks.start)
                yield slice(qs.offset + lo - qs.start, qs.offset + hi - qs.start), keys, True
                if hi < q_end:  # queries after the square see all of its keys
                    yield slice(qs.offset + hi - qs.start, qs.offset + qs.length), keys, False


def mask_pieces(
    pieces: Sequence[Range], q_segments: Sequence[Segment], kv_segments: Sequence[Segment]
) -> tuple[Piece, ...]:
    """The mask's ``pieces`` (global positions, each inside one query and one key segment) as kernel calls in
    local rows of q and of the block, full ones merged (:func:`~wf_mesh.ring_schedule.merge_full_pieces`).

    Returns:
        The block's :attr:`RingPlan.mask` entry.
    """

    def local(p: Range) -> Piece:
        qs = next(s for s in q_segments if s.start <= p.q_start < s.start + s.length)
        ks = next(s for s in kv_segments if s.start <= p.k_start < s.start + s.length)
        r0, c0 = qs.offset + p.q_start - qs.start, ks.offset + p.k_start - ks.start
        return r0, r0 + p.q_end - p.q_start, c0, c0 + p.k_end - p.k_start, p.kind == "causal"

    return tuple(merge_full_pieces([local(p) for p in pieces]))


def _wire_order(ndim: int) -> list[int]:
    """The dims of a travelling block from outermost to innermost in memory: ``(B, S, H, D)`` for a ``(B, H, S, D)``
    block (the memory of ``x.view(B, S, H, D).transpose(1, 2)``, what SDPA callers and diffusers pass), row-major
    for a ``(B, S)`` mask. One fixed layout on every rank: a receiver cannot see the sender's strides.

    Returns:
        The dim order (a permutation of ``range(ndim)``).
    """
    return [0, 2, 1, 3] if ndim == 4 else list(range(ndim))


def _empty_block(like: torch.Tensor, length: int, dtype: torch.dtype | None = None, zero: bool = False) -> torch.Tensor:
    """A buffer for a block like ``like`` with a sequence of ``length`` (dim 2 of ``(B, H, S, D)``, dim 1 of a
    ``(B, S)`` mask) in the wire layout (:func:`_wire_order`).

    Returns:
        Uninitialized unless ``zero``, in ``like``'s dtype unless ``dtype``.
    """
    seq = 2 if like.ndim == 4 else 1
    order = _wire_order(like.ndim)
    shape = [length if d == seq else like.shape[d] for d in order]
    make = torch.zeros if zero else torch.empty
    buf = make(shape, dtype=dtype or like.dtype, device=like.device)
    return buf.permute([order.index(d) for d in range(like.ndim)])


def _wire(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in the wire layout as a contiguous tensor, for sending: a view when ``x`` already is in
    that layout (every received block is), else one copy (a rank's own k, v in another layout, at the first hop).

    Returns:
        The contiguous tensor to send.
    """
    return x.permute(_wire_order(x.ndim)).contiguous()


Send = tuple[int, Sequence[torch.Tensor | None]]
"""``(ring rank, tensors)`` to send."""
Recv = tuple[int, Sequence[torch.Tensor | None], int, torch.dtype | None]
"""``(ring rank, tensors shaped like the block, its length, dtype or None: the template's)`` to receive."""


class _Hop:
    """The messages of one ring step in flight: ``sends`` and ``recvs`` (in this order, the same on every rank,
    so that each pair of ranks matches them alike).

    Empty tensors travel nowhere (the peer sizes its buffer from the same agreed lengths). The sent
    tensors are referenced until :meth:`wait`, and nothing afterwards, so a block lives no longer than needed.
    """

    def __init__(self, plan: RingPlan, sends: Sequence[Send], recvs: Sequence[Recv]) -> None:
        group = plan.group
        if group is None:
            raise ValueError("a ring hop needs the ring's process group (RingPlan.group is None: a ring of one)")
        self.recv = [
            tuple(None if t is None else _empty_block(t, length, dtype) for t in like)
            for _, like, length, dtype in recvs
        ]
        ops = [
            (op, _wire(t), peer)
            for op, messages in ((dist.isend, sends), (dist.irecv, list(zip((r[0] for r in recvs), self.recv))))
            for peer, tensors in messages
            for t in tensors
            if t is not None and t.numel()
        ]
        self.requests = p2p.batch_isend_irecv(ops, group) if ops else []
        self.ops, self.group = ops, group

    def wait(self) -> list[tuple[Any, ...]]:
        """The received tensors, per receive in the order given (None where the template was None)."""
        with waits.bounded(self.group, "cp_attention ring hop"):
            for request in self.requests:
                request.wait()
        recv = self.recv
        self.requests, self.ops, self.recv = [], [], []
        return recv


def _kv_hop(plan: RingPlan, t: int, block, like) -> tuple[_Hop | None, bool]:
    """The K/V hop after step t: this rank's block (if it still travels) to the next ring rank, the next
    block (if it reaches this rank) from the previous one; decided from the plan alone.

    Returns:
        ``(the hop or None, whether it receives a block)``.
    """
    n, i = plan.size, plan.index
    j, nxt = (i - t) % n, (i - t - 1) % n
    sends: list[Send] = [((i + 1) % n, block)] if block is not None and t < plan.last_step(j) else []
    recvs: list[Recv] = [((i - 1) % n, like, plan.kv_lengths[nxt], None)] if t < plan.last_step(nxt) else []
    return (_Hop(plan, sends, recvs) if sends or recvs else None), bool(recvs)


def _forward_block(q, block, j, plan: RingPlan, out, lse) -> None:
    """Fold q's attention to ring block j into ``(out, lse)`` (a function, so that no local outlives it)."""
    if block is None:  # the block did not travel this far: no rank from here on needs it
        return
    bk, bv, bpad = block
    for rows, cols, causal in plan.pairs(j):
        qq, kk = q[:, :, rows], bk[:, :, cols]
        if qq.shape[2] and kk.shape[2]:
            p = None if bpad is None else bpad[:, cols]
            part, part_lse = attend(qq, kk, bv[:, :, cols], p, causal, plan.scale, plan.kernel)
            merge_partial(out[:, :, rows], lse[:, :, rows], part, part_lse)


def _backward_block(dout, q, out, lse, block, j, plan: RingPlan, dq, dk, dv) -> None:
    """Add ring block j's share of the gradients to ``dq`` and block j's ``dk``, ``dv`` (accumulation dtype)."""
    if block is None:
        return
    bk, bv, bpad = block
    for rows, cols, causal in plan.pairs(j):
        qq, kk = q[:, :, rows], bk[:, :, cols]
        if qq.shape[2] and kk.shape[2]:
            p = None if bpad is None else bpad[:, cols]
            g = attend_backward(
                dout[:, :, rows],
                qq,
                kk,
                bv[:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                p,
                causal,
                plan.scale,
                plan.kernel,
            )
            dq[:, :, rows] += g[0]
            dk[:, :, cols] += g[1]
            dv[:, :, cols] += g[2]


def ring_forward(q, k, v, pad, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against every ring rank's k, v block; the next block travels while this one is computed
    (under a mask only as far as the last ring rank that needs it).

    Returns:
        ``(out, lse)``: out in q's dtype, lse in the accumulation dtype.
    """
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros_like(q, dtype=acc)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
    block: tuple | None = (k, v, pad)
    seq, step = FaultSequence(plan.verdict or None, "cp_attention"), _step_name(plan)
    for t in range(plan.size):
        j = (plan.index - t) % plan.size
        hop, comes = _kv_hop(plan, t, block, (k, v, pad)) if t + 1 < plan.size else (None, False)
        seq.step((step, t + 1, plan.size), _forward_block, q, block, j, plan, out, lse)
        got = hop.wait() if hop is not None else []
        block = got[0] if comes else None
        del got
    seq.close()
    return out.to(q.dtype), lse


def _step_name(plan: RingPlan, backward: str = "") -> str:
    """How a contained failure names a block step of ``plan`` (see :mod:`wf_mesh.faults`)."""
    return f"ring{backward} hop" if plan.group is not None else f"local attention{backward}"


def ring_backward(dout, q, k, v, out, lse, pad, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`ring_forward` (no recomputation: it takes out and lse), dK/dV travelling the
    ring back to their owners in the accumulation dtype: block j's from its owner along the ranks that hold
    it, and from the last of them (``last_step(j)``) straight back to the owner.

    Returns:
        ``(dq, dk, dv)`` in the dtypes of q, k, v.
    """
    acc = accumulation_dtype(q.dtype)  # also of the travelling dK/dV: every ring rank sends and sizes alike
    n, i = plan.size, plan.index
    dq = torch.zeros_like(q, dtype=acc)
    block: tuple | None = (k, v, pad)
    dkv_hop: _Hop | None = None
    kinds: list[str] = []  # what dkv_hop receives: "chain" (this step's block) and/or "own" (the final dK/dV)
    mine: tuple | None = None  # this rank's own block's final dK/dV
    seq, step = FaultSequence(plan.verdict or None, "cp_attention backward"), _step_name(plan, " backward")
    for t in range(n):
        j, last = (i - t) % n, plan.last_step((i - t) % n)
        kv_hop, comes = _kv_hop(plan, t, block, (k, v, pad)) if t + 1 < n else (None, False)
        dk = dv = None
        if block is not None:  # in the wire layout: they travel
            dk = _empty_block(block[0], block[0].shape[2], acc, zero=True)
            dv = _empty_block(block[1], block[1].shape[2], acc, zero=True)
        seq.step((step, t + 1, n), _backward_block, dout, q, out, lse, block, j, plan, dq, dk, dv)
        if dkv_hop is not None:  # block j's dK/dV from the ranks before this one; maybe this rank's own
            mine = _fold_dkv(dkv_hop, kinds, dk, dv, mine)
        sends: list[Send] = []
        if block is not None:
            if last == 0:  # only the owner needs it: its dK/dV stay here
                mine = (dk, dv)
            else:  # on to the next rank holding the block; from the last one, back to the owner
                sends.append(((i + 1) % n if t < last else (i - t) % n, (dk, dv)))
        recvs: list[Recv] = []
        kinds = []
        if t + 1 < n and t < plan.last_step((i - 1 - t) % n):
            recvs.append(((i - 1) % n, (k, v), plan.kv_lengths[(i - 1 - t) % n], acc))
            kinds.append("chain")
        if t == plan.last_step(i) and t > 0:
            recvs.append(((i + t) % n, (k, v), plan.kv_lengths[i], acc))
            kinds.append("own")
        dkv_hop = _Hop(plan, sends, recvs) if sends or recvs else None
        del dk, dv
        got = kv_hop.wait() if kv_hop is not None else []
        block = got[0] if comes else None
        del got
    if dkv_hop is not None:
        mine = _fold_dkv(dkv_hop, kinds, None, None, mine)
    seq.close()
    assert mine is not None
    dk, dv = mine
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fold_dkv(hop: _Hop, kinds: list[str], dk, dv, mine):
    """Wait for ``hop``'s dK/dV: a "chain" one is added to this step's ``dk``, ``dv``; an "own" one is this
    rank's final dK/dV.

    Returns:
        This rank's own final dK/dV, as received or ``mine`` as it was.
    """
    for kind, got in zip(kinds, hop.wait()):
        if kind == "own":
            mine = got
        else:
            dk += got[0]
            dv += got[1]
    return mine


class RingAttention(torch.autograd.Function):
    """Blockwise attention of q ``(B, H, S_q, D)`` against every ring rank's k, v block ``(B, Hkv, S_j, D)``
    (the engine's one layout; :func:`wf_mesh.attention.cp_attention` hands it bhsd views); backward without
    recomputing the forward (it keeps out and lse), dK/dV travelling the ring back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, pad, plan: RingPlan):
        """This rank's output shard; out and lse kept for backward."""
        out, lse = ring_forward(q, k, v, pad, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pad, ctx.plan = pad, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        """dq, dk, dv from the kept out and lse (the plan and mask get no gradient)."""
        q, k, v, out, lse = ctx.saved_tensors
        return *ring_backward(dout, q, k, v, out, lse, ctx.pad, ctx.plan), None, None


# ---- Ulysses all-to-all --------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, lengths: list[int]) -> torch.Tensor:
    """A sequence shard to a head shard: one all-to-all.

    Returns:
        The ``(B, H/U, sum(lengths), D)`` head shard of ``(B, H, S_r, D)`` x (a view of ``(S, B, H/U, D)`` memory).
    """
    b, h, s, d = x.shape
    u = len(lengths)
    send = x.reshape(b, u, h // u, s, d).permute(1, 3, 0, 2, 4).contiguous()
    recv = x.new_empty(sum(lengths), b, h // u, d)
    with waits.bounded(group, "cp_attention"):
        dist.all_to_all_single(recv, send.view(u * s, b, h // u, d), lengths, [s] * u, group=group)
    return recv.permute(1, 2, 0, 3)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], seq_major: bool) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`.

    Returns:
        The sequence shard, stored ``(B, S, H, D)`` if ``seq_major`` else ``(B, H, S, D)``, as a
        ``(B, H, S, D)`` view.
    """
    b, hu, _, d = y.shape
    u, s = len(lengths), lengths[group.rank()]
    recv = y.new_empty(u * s, b, hu, d)
    with waits.bounded(group, "cp_attention"):
        dist.all_to_all_single(recv, y.permute(2, 0, 1, 3).contiguous(), [s] * u, lengths, group=group)
    recv = recv.view(u, s, b, hu, d)
    if seq_major:
        return recv.permute(2, 1, 0, 3, 4).reshape(b, s, u * hu, d).contiguous().transpose(1, 2)
    return recv.permute(2, 0, 3, 1, 4).reshape(b, u * hu, s, d).contiguous()


class SeqToHeads(torch.autograd.Function):
    """Sequence shard -> head shard over a Ulysses group (one all-to-all; backward the inverse)."""

    @staticmethod
    def forward(ctx, x, group, lengths):
        """The head shard of x."""
        ctx.group, ctx.lengths, ctx.seq_major = group, lengths, x.stride(1) < x.stride(2)
        return _seq_to_heads(x, group, lengths)

    @staticmethod
    def backward(ctx, grad):
        """The gradient back to the sequence shard, in x's memory layout."""
        return _heads_to_seq(grad, ctx.group, ctx.lengths, ctx.seq_major), None, None


class HeadsToSeq(torch.autograd.Function):
    """Head shard -> sequence shard over a Ulysses group (one all-to-all; backward the inverse)."""

    @staticmethod
    def forward(ctx, y, group, lengths, seq_major):
        """The sequence shard of y."""
        ctx.group, ctx.lengths = group, lengths
        return _heads_to_seq(y, group, lengths, seq_major)

    @staticmethod
    def backward(ctx, grad):
        """The gradient back to the head shard."""
        return _seq_to_heads(grad, ctx.group, ctx.lengths), None, None, None


def gather_mask(pad: torch.Tensor, group: dist.ProcessGroup, lengths: list[int]) -> torch.Tensor:
    """Every rank's ``(B, S_r)`` mask concatenated along the sequence: one all-to-all (exact uneven sizes)."""
    u = len(lengths)
    recv = pad.new_empty(sum(lengths), pad.shape[0])
    with waits.bounded(group, "cp_attention"):
        dist.all_to_all_single(recv, pad.t().repeat(u, 1), lengths, [pad.shape[1]] * u, group=group)
    return recv.t()


# ---- all-gather (the baseline) ---------------------------------------------------------------------------
class GatherKV(torch.autograd.Function):
    """k, v shards ``(B, Hkv, S_r, D)`` -> every rank's, each padded to the longest shard: one all-gather;
    backward one reduce-scatter. Outputs are ``(B, Hkv, n * longest, D)`` views of one ``(S, 2, B, Hkv, D)`` buffer."""

    @staticmethod
    def forward(ctx, k, v, group, longest):
        """Every rank's k, v, each padded to ``longest``, concatenated along the sequence."""
        b, h, s, d = k.shape
        send = k.new_zeros(longest, 2, b, h, d)
        send[:s, 0] = k.permute(2, 0, 1, 3)
        send[:s, 1] = v.permute(2, 0, 1, 3)
        recv = k.new_empty(group.size() * longest, 2, b, h, d)
        with waits.bounded(group, "cp_attention"):
            _compat.all_gather_single(recv, send, group=group)
        ctx.group, ctx.local = group, s
        return recv[:, 0].permute(1, 2, 0, 3), recv[:, 1].permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, dk, dv):
        """This rank's dk, dv: the gathered gradients reduce-scattered back to their owners."""
        grads = torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1)
        recv = grads.new_empty(grads.shape[0] // ctx.group.size(), *grads.shape[1:])
        with waits.bounded(ctx.group, "cp_attention"):
            _compat.reduce_scatter_single(recv, grads, group=ctx.group)
        recv = recv[: ctx.local]
        return recv[:, 0].permute(1, 2, 0, 3), recv[:, 1].permute(1, 2, 0, 3), None, None


def gather_mask_padded(pad: torch.Tensor, group: dist.ProcessGroup, longest: int) -> torch.Tensor:
    """Every rank's key padding mask, each padded to ``longest`` with True (padding), as GatherKV gathers K/V."""
    send = pad.new_ones(longest, pad.shape[0])
    send[: pad.shape[1]] = pad.t()
    recv = pad.new_empty(group.size() * longest, pad.shape[0])
    with waits.bounded(group, "cp_attention"):
        _compat.all_gather_single(recv, send, group=group)
    return recv.t()


# ---- the compiled path: custom ops that torch.compile keeps whole ----------------------------------------
# Under torch.compile every piece that communicates is one custom op with a fake (shape-only) implementation
# and its autograd formula: dynamo and AOTAutograd never look inside, so the ring keeps its overlap of hop
# and compute (the same ring_forward / ring_backward as eager), and each op appears once in the graph. Groups
# travel by name; the ring's RingPlan by a key into _RING_PLANS (a string made of the plan's contents, so
# that equal plans of later steps reuse the compiled graph). The registry holds no process group: the ring's
# group is found by name when the op runs (a graph outlives a mesh destroyed and built again alike).
_RING_PLANS: dict[str, tuple[RingPlan, str]] = {}


def register_ring_plan(plan: RingPlan) -> str:
    """The key of ``plan`` for :func:`ring_attention_op`."""
    group = "" if plan.group is None else plan.group.group_name
    key = repr(
        (
            group,
            plan.index,
            plan.q_segments,
            plan.kv_segments,
            plan.kv_lengths,
            plan.causal,
            plan.scale,
            plan.verdict,
            plan.mask,
            plan.last_steps,
        )
    )
    key = f"{key}/{plan.kernel.value}"
    _RING_PLANS[key] = (dataclasses.replace(plan, group=None), group)
    return key


def _ring_plan(key: str) -> RingPlan:
    plan, group = _RING_PLANS[key]
    return plan if not group else dataclasses.replace(plan, group=_group(group))


def _group(name: str) -> dist.ProcessGroup:
    from wf_mesh import _compat

    return _compat.resolve_group(name)


@torch.library.custom_op("wf_mesh::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None, key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_forward` with the RingPlan registered under ``key``: ``(out, lse)``."""
    return ring_forward(q, k, v, pad, _ring_plan(key))


@ring_attention_op.register_fake
def _(q, k, v, pad, key):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("wf_mesh::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pad: torch.Tensor | None,
    key: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ring_backward` with the RingPlan registered under ``key``: ``(dq, dk, dv)``."""
    return ring_backward(dout, q, k, v, out, lse, pad, _ring_plan(key))


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, pad, key):
    return torch.empty_like(q), _empty_block(k, k.shape[2]), _empty_block(v, v.shape[2])  # dK/dV: the wire layout


def _ring_setup(ctx, inputs, output):
    q, k, v, pad, key = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], pad)
    ctx.key = key


def _ring_grad(ctx, dout, _dlse):
    q, k, v, out, lse, pad = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(dout.contiguous(), q, k, v, out, lse, pad, ctx.key)
    return dq, dk, dv, None, None


ring_attention_op.register_autograd(_ring_grad, setup_context=_ring_setup)


@torch.library.custom_op("wf_mesh::seq_to_heads", mutates_args=())
def seq_to_heads_op(x: torch.Tensor, group: str, lengths: list[int]) -> torch.Tensor:
    """:func:`_seq_to_heads` on the group named ``group``."""
    return _seq_to_heads(x, _group(group), lengths)


@seq_to_heads_op.register_fake
def _(x, group, lengths):
    b, h, _, d = x.shape
    return x.new_empty(sum(lengths), b, h // len(lengths), d).permute(1, 2, 0, 3)


@torch.library.custom_op("wf_mesh::heads_to_seq", mutates_args=())
def heads_to_seq_op(y: torch.Tensor, group: str, lengths: list[int], seq_major: bool) -> torch.Tensor:
    """:func:`_heads_to_seq` on the group named ``group``."""
    return _heads_to_seq(y, _group(group), lengths, seq_major)


@heads_to_seq_op.register_fake
def _(y, group, lengths, seq_major):
    b, hu, _, d = y.shape
    u, s = len(lengths), lengths[_group(group).rank()]
    if seq_major:
        return y.new_empty(b, s, u * hu, d).transpose(1, 2)
    return y.new_empty(b, u * hu, s, d)


def _seq_to_heads_setup(ctx, inputs, output):
    x, ctx.group, ctx.lengths = inputs
    ctx.seq_major = x.stride(1) < x.stride(2)


seq_to_heads_op.register_autograd(
    lambda ctx, grad: (heads_to_seq_op(grad, ctx.group, ctx.lengths, ctx.seq_major), None, None),
    setup_context=_seq_to_heads_setup,
)


def _heads_to_seq_setup(ctx, inputs, output):
    _, ctx.group, ctx.lengths, _ = inputs


heads_to_seq_op.register_autograd(
    lambda ctx, grad: (seq_to_heads_op(grad, ctx.group, ctx.lengths), None, None, None),
    setup_context=_heads_to_seq_setup,
)


@torch.library.custom_op("wf_mesh::gather_mask", mutates_args=())
def gather_mask_op(pad: torch.Tensor, group: str, lengths: list[int]) -> torch.Tensor:
    """:func:`gather_mask` on the group named ``group``."""
    return gather_mask(pad, _group(group), lengths)


@gather_mask_op.register_fake
def _(pad, group, lengths):
    return pad.new_empty(sum(lengths), pad.shape[0]).t()


@torch.library.custom_op("wf_mesh::gather_kv", mutates_args=())
def gather_kv_op(k: torch.Tensor, v: torch.Tensor, group: str, longest: int) -> torch.Tensor:
    """:class:`GatherKV`'s forward on the group named ``group``: the ``(n * longest, 2, B, Hkv, D)`` buffer."""
    b, h, s, d = k.shape
    send = k.new_zeros(longest, 2, b, h, d)
    send[:s, 0] = k.permute(2, 0, 1, 3)
    send[:s, 1] = v.permute(2, 0, 1, 3)
    pg = _group(group)
    recv = k.new_empty(pg.size() * longest, 2, b, h, d)
    with waits.bounded(pg, "cp_attention"):
        _compat.all_gather_single(recv, send, group=pg)
    return recv


@gather_kv_op.register_fake
def _(k, v, group, longest):
    b, h, _, d = k.shape
    return k.new_empty(_group(group).size() * longest, 2, b, h, d)


@torch.library.custom_op("wf_mesh::scatter_kv_grad", mutates_args=())
def scatter_kv_grad_op(grad: torch.Tensor, group: str) -> torch.Tensor:
    """:class:`GatherKV`'s backward: the reduce-scatter of the gathered buffer's gradient."""
    pg = _group(group)
    recv = grad.new_empty(grad.shape[0] // pg.size(), *grad.shape[1:])
    with waits.bounded(pg, "cp_attention"):
        _compat.reduce_scatter_single(recv, grad.contiguous(), group=pg)
    return recv


@scatter_kv_grad_op.register_fake
def _(grad, group):
    return grad.new_empty(grad.shape[0] // _group(group).size(), *grad.shape[1:])


def _gather_kv_setup(ctx, inputs, output):
    k, _, ctx.group, _ = inputs
    ctx.local = k.shape[2]


def _gather_kv_grad(ctx, grad):
    recv = scatter_kv_grad_op(grad, ctx.group)[: ctx.local]
    return recv[:, 0].permute(1, 2, 0, 3), recv[:, 1].permute(1, 2, 0, 3), None, None


gather_kv_op.register_autograd(_gather_kv_grad, setup_context=_gather_kv_setup)


@torch.library.custom_op("wf_mesh::gather_mask_padded", mutates_args=())
def gather_mask_padded_op(pad: torch.Tensor, group: str, longest: int) -> torch.Tensor:
    """:func:`gather_mask_padded` on the group named ``group``."""
    return gather_mask_padded(pad, _group(group), longest)


@gather_mask_padded_op.register_fake
def _(pad, group, longest):
    return pad.new_empty(_group(group).size() * longest, pad.shape[0]).t()
