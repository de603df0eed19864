"""Context-parallel (CP) attention: exact softmax attention over a sequence sharded on the cp axis.

Every rank passes its sequence shard of q, k, v and gets its shard of the output; the result equals
``F.scaled_dot_product_attention`` on the full sequence (forward and backward). Shards follow
``torch.chunk`` sizing over the cp ranks (uneven lengths allowed, trailing ranks may hold 0 tokens), or
the zigzag layout (``balance="zigzag"``, :func:`zigzag_shard`). Per call, with ``n`` cp ranks, ``U``
Ulysses and ``R`` ring ranks (``U * R = n``; a block is one rank's shard of k and v):

=========  ===============================================  =======================  ========================
method     communication per call (forward; backward)       peak extra K/V (forward) constraints
=========  ===============================================  =======================  ========================
ring       ``n-1`` hops of k, v (+mask) by P2P, each        ``min(2, n-1)`` blocks   none (any heads, GQA,
           posted before the current block is computed;     (the one received last   uneven, causal, zigzag)
           backward: the same ``n-1`` hops, and ``n``        + the one in flight):
           hops of fp32 dK, dV back to their owners         ``2/n`` of the full K/V
ulysses    4 ``all_to_all_single`` (q, k, v in, out back;  the whole sequence of    q heads divisible by
           +1 for the mask); backward 4                     ``H/n`` heads: ``1/n``   ``n`` (GQA: see below)
usp        Ulysses inside ``cp_ulysses`` (4 all-to-all),    the all-to-all output    q heads divisible by U;
           ring across ``cp_ring`` on the head shards       + ring blocks:           a 2-D mesh (``mesh``)
                                                            ``(1 + min(2, R-1))/n``
allgather  1 all-gather of k, v (+1 mask); backward 1       the full K/V (padded to  none; the baseline
           reduce-scatter of dK, dV                         ``n`` x longest shard)   ("today's pattern")
=========  ===============================================  =======================  ========================

Backward holds, besides the saved inputs, the same K/V blocks plus the dK/dV blocks in flight (fp32). What
is kept from forward to backward: ring only its local k, v, out and the fp32 lse; ulysses/usp the head
shards of q, k, v (``1/n`` of the full K/V); allgather the full K/V.

Every call first runs one :func:`~wf_mesh.agreement.agree` exchange (one small all-gather on the cp group):
it validates the call on every rank and tells every rank every shard's length.

Which to pick: ``ulysses`` when the heads divide by the cp size and the all-to-all runs on a fast
intra-node link (least traffic: ``(n-1)/n`` of q, k, v, out once, and a single local attention call);
``ring`` when they do not, or the cp axis spans nodes (only neighbour traffic, hidden behind compute when
the blocks are large enough); ``usp`` for both at once (Ulysses inside a node, ring across nodes, e.g.
``ParallelDims(cp=16, cp_ulysses=8)``); ``allgather`` only as a reference (its K/V memory grows with the
full sequence). For causal attention use ``balance="zigzag"`` with ring/usp (blocks whose keys all follow
the queries are skipped): with contiguous shards the last rank does ``2n-1`` times the work of the first;
zigzag gives every rank the same amount. (Ulysses attends over the whole sequence on every rank, so its
work is balanced either way.)

Precision: softmax statistics (row max / log-sum-exp), the merge of partial results and the ring's
travelling dK/dV are fp32 whatever the input dtype; the output is cast to the input dtype once.
Local attention on CPU tensors runs the fused flash kernel behind ``F.scaled_dot_product_attention``
(see ``wf_mesh._compat.flash_attention_cpu``); on other devices an fp32 math kernel that materializes one
block's scores (a fused CUDA kernel with log-sum-exp output is not wired in yet).

Key padding: ``key_padding_mask`` is bool ``(B, S_local)`` for this rank's keys, True = padding (the
``nn.MultiheadAttention`` convention); it travels with its K/V block. A query row whose keys are all
masked gets output 0 and zero gradients, as single-process ``F.scaled_dot_product_attention`` does.

GQA (k, v with ``Hkv`` heads, ``Hq % Hkv == 0``, query head ``h`` uses key head ``h // (Hq // Hkv)`` as
with ``enable_gqa=True``): ring and allgather move the compact ``Hkv`` heads. Ulysses splits heads: when
``U`` does not divide ``Hkv``, every K/V head is first replicated ``U // gcd(Hkv, U)`` times (so that each
rank receives exactly the K/V heads its query heads use), which costs K/V traffic as if ``Hkv`` were
``lcm(Hkv, U)``; only ``Hq % U == 0`` is required.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from wf_mesh import _compat
from wf_mesh.agreement import DTYPES, agree, dtype_code, float_bits
from wf_mesh.context_parallel import (
    chunk_sizes,
    cp_mesh,
    normalize_dim,
    sequence_dtensor,
)
from wf_mesh.errors import DisagreementError, ShapeMismatchError
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh

__all__ = ["CPSelfAttention", "cp_attention", "zigzag_gather", "zigzag_shard", "zigzag_sizes"]

METHODS = ("ring", "ulysses", "usp", "allgather")
LAYOUTS = ("bhsd", "bshd")
BALANCES = (None, "zigzag")
USP_DIMS = ("cp_ring", "cp_ulysses")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

MeshArg = DeviceMesh | ParallelMesh | None


# ---- layouts: which global positions each rank holds ----------------------------------------------------
def zigzag_sizes(length: int, parts: int) -> list[int]:
    """Local lengths of the zigzag layout: rank r holds chunks r and ``2*parts-1-r`` of ``2*parts``."""
    sizes = chunk_sizes(length, 2 * parts)
    return [sizes[r] + sizes[2 * parts - 1 - r] for r in range(parts)]


@dataclasses.dataclass(frozen=True)
class _Seg:
    """Rows ``[offset, offset+length)`` of a local block hold global positions ``[start, start+length)``."""

    offset: int
    start: int
    length: int


def _rank_segments(length: int, parts: int, balance: str | None) -> list[list[_Seg]]:
    """Each cp rank's segments (offsets within its own shard)."""
    if balance is None:
        sizes = chunk_sizes(length, parts)
        return [[_Seg(0, sum(sizes[:r]), sizes[r])] for r in range(parts)]
    sizes = chunk_sizes(length, 2 * parts)
    starts = [sum(sizes[:i]) for i in range(2 * parts)]
    out = []
    for r in range(parts):
        a, b = r, 2 * parts - 1 - r
        out.append([_Seg(0, starts[a], sizes[a]), _Seg(sizes[a], starts[b], sizes[b])])
    return out


def _concat(blocks: Sequence[list[_Seg]], offsets: Sequence[int], positional: bool) -> list[_Seg]:
    """Segments of blocks stored at ``offsets`` of one tensor, empty ones dropped, neighbours in storage
    coalesced (if ``positional``, only when their positions continue too)."""
    out: list[_Seg] = []
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
                out[-1] = _Seg(last.offset, last.start, last.length + s.length)
            else:
                out.append(_Seg(base + s.offset, s.start, s.length))
    return out


# ---- local attention on one (query rows, key block) pair -------------------------------------------------
def _allowed(pad: torch.Tensor | None, causal: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean ``(B|1, 1, Sq|1, Sk)`` of the keys each query may see (None: all of them)."""
    allowed = None if pad is None else ~pad[:, None, None, :]
    if causal is not None:
        allowed = causal if allowed is None else allowed & causal
    return allowed


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _attend(q, k, v, pad, causal, aligned, scale, fused):
    """``(out, lse)`` of q against one key block; lse is fp32 and -inf for rows that see no key.

    ``causal``: bool ``(Sq, Sk)`` of allowed pairs or None; ``aligned``: it is the plain lower triangle.
    """
    if fused and pad is None and (causal is None or aligned):  # the kernel's causal mode skips masked tiles
        return _compat.flash_attention_cpu(q, k, v, None, causal is not None, scale)
    allowed = _allowed(pad, causal)
    if fused:
        out, lse = _compat.flash_attention_cpu(q, k, v, _bias(allowed, q.dtype), False, scale)
        return out, lse.masked_fill(~allowed.any(-1), -math.inf)  # the kernel reports 0 for such rows
    s = torch.matmul(q.float(), _expand_heads(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0)[..., None])
    return torch.matmul(p, _expand_heads(v, q.shape[1]).float()), lse


def _attend_backward(dout, q, k, v, out, lse, pad, causal, aligned, scale, fused):
    """``(dq, dk, dv)`` of one pair given the merged ``out`` and ``lse`` of the whole key range: with them
    the block's probabilities are its exact share of the full softmax."""
    lse = lse.masked_fill(lse == -math.inf, 0)  # rows that see no key anywhere: every score is -inf, p = 0
    if fused and pad is None and (causal is None or aligned):
        return _compat.flash_attention_cpu_backward(dout, q, k, v, out, lse, None, causal is not None, scale)
    allowed = _allowed(pad, causal)
    if fused:
        return _compat.flash_attention_cpu_backward(dout, q, k, v, out, lse, _bias(allowed, q.dtype), False, scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    qf, kf, vf, do = q.float(), _expand_heads(k, heads).float(), _expand_heads(v, heads).float(), dout.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    if kv_heads != heads:
        b, _, n, d = dk.shape
        dk = dk.view(b, kv_heads, heads // kv_heads, n, d).sum(2)
        dv = dv.view(b, kv_heads, heads // kv_heads, n, dv.shape[-1]).sum(2)
    return dq, dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Fold a partial result ``(o, l)`` into the running fp32 ``(out, lse)`` in place (online softmax)."""
    new = torch.logaddexp(lse, l)
    safe = new.masked_fill(new == -math.inf, 0)  # rows with no key so far keep out = 0
    out.mul_(torch.exp(lse - safe)[..., None]).add_(o.float() * torch.exp(l - safe)[..., None])
    lse.copy_(new)


# ---- the ring core (also the local attention of ulysses and allgather: a ring of one) -------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where every K/V block lives and which global positions its rows and this rank's queries hold."""

    group: dist.ProcessGroup | None  # the ring's group; None: one block, no communication
    index: int  # this rank's place in the ring (the block its queries belong to)
    q_segments: list[_Seg]
    kv_segments: list[list[_Seg]]  # per ring rank
    kv_lengths: list[int]
    causal: bool
    scale: float
    fused: bool

    @property
    def size(self) -> int:
        return len(self.kv_lengths)

    def pairs(self, j: int, device: torch.device):
        """``(query rows, key rows, causal mask or None, aligned)`` for the query segments against block j,
        leaving out pairs where every key follows every query."""
        if not self.causal:
            for ks in self.kv_segments[j]:
                yield slice(None), slice(ks.offset, ks.offset + ks.length), None, False
            return
        for qs in self.q_segments:
            for ks in self.kv_segments[j]:
                if ks.start >= qs.start + qs.length:
                    continue
                rows, cols = slice(qs.offset, qs.offset + qs.length), slice(ks.offset, ks.offset + ks.length)
                if ks.start + ks.length <= qs.start + 1:
                    yield rows, cols, None, False
                    continue
                qpos = torch.arange(qs.start, qs.start + qs.length, device=device)
                kpos = torch.arange(ks.start, ks.start + ks.length, device=device)
                yield rows, cols, qpos[:, None] >= kpos[None, :], qs.start == ks.start and qs.length == ks.length


def _empty_block(like: torch.Tensor, length: int) -> torch.Tensor:
    """Uninitialized ``like`` with a sequence of ``length`` (dim 2 of ``(B, H, S, D)``, dim 1 of a ``(B, S)``
    mask), in ``like``'s memory layout (dims ordered by stride), so that both ends send the same bytes."""
    seq = 2 if like.ndim == 4 else 1
    order = sorted(range(like.ndim), key=lambda d: like.stride(d), reverse=True)
    shape = [length if d == seq else like.shape[d] for d in order]
    buf = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buf.permute([order.index(d) for d in range(like.ndim)])


def _wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the contiguous tensor its memory is (a permuted view), for sending."""
    order = sorted(range(x.ndim), key=lambda d: x.stride(d), reverse=True)
    return x.permute(order).contiguous()


class _Hop:
    """One ring hop in flight: ``send`` to the next ring rank, ``recv`` filled from the previous one.

    Empty tensors travel nowhere (the peer sizes its buffer from the same agreed lengths). The sent
    tensors are referenced until :meth:`wait`, and nothing afterwards, so a block lives no longer than needed.
    """

    def __init__(self, plan: _Plan, send: Sequence[torch.Tensor | None], j: int) -> None:
        group = plan.group
        n, i = group.size(), group.rank()
        self.recv = tuple(None if t is None else _empty_block(t, plan.kv_lengths[j]) for t in send)
        ops = [
            dist.P2POp(op, _wire(t), group=group, group_peer=peer)
            for op, peer, tensors in ((dist.isend, (i + 1) % n, send), (dist.irecv, (i - 1) % n, self.recv))
            for t in tensors
            if t is not None and t.numel()
        ]
        self.requests = dist.batch_isend_irecv(ops) if ops else []
        self.ops = ops

    def wait(self) -> tuple[torch.Tensor | None, ...]:
        for request in self.requests:
            request.wait()
        recv = self.recv
        self.requests, self.ops, self.recv = [], [], ()
        return recv


def _forward_block(q, block, j, plan: _Plan, out, lse) -> None:
    """Fold q's attention to ring block j into ``(out, lse)`` (a function, so that no local outlives it)."""
    bk, bv, bpad = block
    for rows, cols, causal, aligned in plan.pairs(j, q.device):
        qq, kk = q[:, :, rows], bk[:, :, cols]
        if qq.shape[2] and kk.shape[2]:
            p = None if bpad is None else bpad[:, cols]
            o, l = _attend(qq, kk, bv[:, :, cols], p, causal, aligned, plan.scale, plan.fused)
            _merge(out[:, :, rows], lse[:, :, rows], o, l)


def _backward_block(dout, q, out, lse, block, j, plan: _Plan, dq, dk, dv) -> None:
    """Add ring block j's share of the gradients to ``dq`` and block j's ``dk``, ``dv`` (fp32)."""
    bk, bv, bpad = block
    for rows, cols, causal, aligned in plan.pairs(j, q.device):
        qq, kk = q[:, :, rows], bk[:, :, cols]
        if qq.shape[2] and kk.shape[2]:
            p = None if bpad is None else bpad[:, cols]
            g = _attend_backward(
                dout[:, :, rows], qq, kk, bv[:, :, cols], out[:, :, rows], lse[:, :, rows], p, causal, aligned,
                plan.scale, plan.fused,
            )  # fmt: skip
            dq[:, :, rows] += g[0]
            dk[:, :, cols] += g[1]
            dv[:, :, cols] += g[2]


class _RingAttention(torch.autograd.Function):
    """Blockwise attention of q against every ring rank's k, v block; backward without recomputing the
    forward (it keeps out and lse), dK/dV travelling the ring back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, pad, plan: _Plan):
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        block = (k, v, pad)
        for t in range(plan.size):
            j = (plan.index - t) % plan.size
            # the next block travels while this one is computed
            hop = _Hop(plan, block, (j - 1) % plan.size) if t + 1 < plan.size else None
            _forward_block(q, block, j, plan, out, lse)
            if hop is not None:
                block = hop.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pad, ctx.plan = pad, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        dq = torch.zeros_like(q, dtype=torch.float32)
        block, dkv_hop = (k, v, ctx.pad), None
        for t in range(plan.size):
            j = (plan.index - t) % plan.size
            kv_hop = _Hop(plan, block, (j - 1) % plan.size) if t + 1 < plan.size else None
            dk = torch.zeros_like(block[0], dtype=torch.float32)
            dv = torch.zeros_like(block[1], dtype=torch.float32)
            _backward_block(dout, q, out, lse, block, j, plan, dq, dk, dv)
            if dkv_hop is not None:  # block j's dK/dV from the ranks before this one
                got_dk, got_dv = dkv_hop.wait()
                dk += got_dk
                dv += got_dv
                del got_dk, got_dv
            if plan.size > 1:  # to the next rank; after the last step that is block j's owner
                dkv_hop = _Hop(plan, (dk, dv), (j - 1) % plan.size)
            if kv_hop is not None:
                block = kv_hop.wait()
        if dkv_hop is not None:
            dk, dv = dkv_hop.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# ---- Ulysses all-to-all --------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, lengths: list[int]) -> torch.Tensor:
    """``(B, H, S_r, D)`` sequence shard -> ``(B, H/U, sum(lengths), D)`` head shard (a view of
    ``(S, B, H/U, D)`` memory): one all-to-all."""
    b, h, s, d = x.shape
    u = len(lengths)
    send = x.reshape(b, u, h // u, s, d).permute(1, 3, 0, 2, 4).contiguous()
    recv = x.new_empty(sum(lengths), b, h // u, d)
    dist.all_to_all_single(recv, send.view(u * s, b, h // u, d), lengths, [s] * u, group=group)
    return recv.permute(1, 2, 0, 3)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, lengths: list[int], seq_major: bool) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`; the result is stored ``(B, S, H, D)`` if ``seq_major`` else
    ``(B, H, S, D)`` and returned as a ``(B, H, S, D)`` view."""
    b, hu, _, d = y.shape
    u, s = len(lengths), lengths[group.rank()]
    recv = y.new_empty(u * s, b, hu, d)
    dist.all_to_all_single(recv, y.permute(2, 0, 1, 3).contiguous(), [s] * u, lengths, group=group)
    recv = recv.view(u, s, b, hu, d)
    if seq_major:
        return recv.permute(2, 1, 0, 3, 4).reshape(b, s, u * hu, d).contiguous().transpose(1, 2)
    return recv.permute(2, 0, 3, 1, 4).reshape(b, u * hu, s, d).contiguous()


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, lengths):
        ctx.group, ctx.lengths, ctx.seq_major = group, lengths, x.stride(1) < x.stride(2)
        return _seq_to_heads(x, group, lengths)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.lengths, ctx.seq_major), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, lengths, seq_major):
        ctx.group, ctx.lengths = group, lengths
        return _heads_to_seq(y, group, lengths, seq_major)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.lengths), None, None, None


def _gather_pad(pad: torch.Tensor, group: dist.ProcessGroup, lengths: list[int]) -> torch.Tensor:
    """Every rank's ``(B, S_r)`` mask concatenated along the sequence: one all-to-all (exact uneven sizes)."""
    u = len(lengths)
    recv = pad.new_empty(sum(lengths), pad.shape[0])
    dist.all_to_all_single(recv, pad.t().repeat(u, 1), lengths, [pad.shape[1]] * u, group=group)
    return recv.t()


# ---- all-gather (the baseline) ---------------------------------------------------------------------------
class _GatherKV(torch.autograd.Function):
    """k, v shards -> every rank's, each padded to the longest shard: one all-gather; backward one
    reduce-scatter. Outputs are ``(B, Hkv, n * longest, D)`` views of one ``(S, 2, B, Hkv, D)`` buffer."""

    @staticmethod
    def forward(ctx, k, v, group, longest):
        b, h, s, d = k.shape
        send = k.new_zeros(longest, 2, b, h, d)
        send[:s, 0] = k.permute(2, 0, 1, 3)
        send[:s, 1] = v.permute(2, 0, 1, 3)
        recv = k.new_empty(group.size() * longest, 2, b, h, d)
        dist.all_gather_single(recv, send, group=group)
        ctx.group, ctx.local = group, s
        return recv[:, 0].permute(1, 2, 0, 3), recv[:, 1].permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, dk, dv):
        grads = torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1)
        recv = grads.new_empty(grads.shape[0] // ctx.group.size(), *grads.shape[1:])
        dist.reduce_scatter_single(recv, grads, group=ctx.group)
        recv = recv[: ctx.local]
        return recv[:, 0].permute(1, 2, 0, 3), recv[:, 1].permute(1, 2, 0, 3), None, None


def _gather_pad_padded(pad: torch.Tensor, group: dist.ProcessGroup, longest: int) -> torch.Tensor:
    send = pad.new_ones(longest, pad.shape[0])
    send[: pad.shape[1]] = pad.t()
    recv = pad.new_empty(group.size() * longest, pad.shape[0])
    dist.all_gather_single(recv, send, group=group)
    return recv.t()


# ---- meshes --------------------------------------------------------------------------------------------
def _cp_of(mesh: MeshArg) -> DeviceMesh:
    """The 1-D mesh over all cp ranks in cp-rank order; a 2-D ``("cp_ring", "cp_ulysses")`` mesh is flattened
    (its process group is created once, on the first call, collectively over the mesh's root)."""
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        if mesh.mesh_dim_names != USP_DIMS:
            raise ValueError(f"cp_attention: a 2-D mesh must have mesh_dim_names {USP_DIMS}, got {mesh.mesh_dim_names}")
        return _compat.flatten(mesh, "_".join(USP_DIMS))
    return cp_mesh(mesh)


def _usp_axes(mesh: MeshArg) -> tuple[DeviceMesh, DeviceMesh]:
    """``(cp_ring, cp_ulysses)`` 1-D meshes of this rank."""
    if mesh is None:
        mesh = get_parallel_mesh()
    if isinstance(mesh, ParallelMesh):
        try:
            return mesh["cp_ring"], mesh["cp_ulysses"]
        except KeyError:
            raise ValueError(
                f"method='usp' needs 'cp_ring' and 'cp_ulysses' axes; this ParallelMesh has {list(mesh.axes)} "
                "(build it with ParallelDims(cp=..., cp_ulysses=...), or pass a 2-D DeviceMesh named "
                f"{USP_DIMS})"
            ) from None
    if mesh.ndim == 2 and mesh.mesh_dim_names == USP_DIMS:
        return mesh["cp_ring"], mesh["cp_ulysses"]
    raise ValueError(
        f"method='usp' needs a ParallelMesh with 'cp_ring' and 'cp_ulysses' axes or a 2-D DeviceMesh named "
        f"{USP_DIMS}, got a {mesh.ndim}-D mesh named {mesh.mesh_dim_names}"
    )


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


# ---- the public entry point ------------------------------------------------------------------------------
def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str = "ring",
    mesh: MeshArg = None,
    layout: str = "bhsd",
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    balance: str | None = None,
) -> torch.Tensor:
    """Attention of this rank's query shard against the whole sequence's keys; returns this rank's output shard.

    Args:
        q, k, v: this rank's shards, ``(B, H, S_r, D)`` (``layout="bhsd"``) or ``(B, S_r, H, D)`` (``"bshd"``);
            k and v may have fewer heads (GQA, see the module docstring). Plain tensors, or DTensors placed
            ``Shard(seq_dim)`` on the 1-D cp mesh (the output is then such a DTensor too).
        method: ``"ring"``, ``"ulysses"``, ``"usp"`` or ``"allgather"`` (module docstring).
        mesh: a ParallelMesh (its ``cp`` axis; for usp its ``cp_ring`` and ``cp_ulysses`` axes), a 1-D cp
            DeviceMesh, a 2-D DeviceMesh named ``("cp_ring", "cp_ulysses")`` (cp rank = ring * U + ulysses),
            or None: the DTensor inputs' mesh, else the current ParallelMesh.
        causal: each query sees the keys at the same or an earlier GLOBAL position.
        scale: softmax scale, default ``1/sqrt(D)``.
        key_padding_mask: bool ``(B, S_r)`` for this rank's keys, True = padding (ignored keys).
        balance: None (``torch.chunk`` shards) or ``"zigzag"`` (shards from :func:`zigzag_shard`).

    Every misuse (different settings, shapes or dtypes on different ranks, shard lengths that are not the
    chunk sizes of their sum, heads not divisible by the Ulysses size, ...) raises the same exception on
    every cp rank, before any data moves.
    """
    dtensor = isinstance(q, DTensor)
    group_mesh = q.device_mesh if dtensor and mesh is None else _cp_of(mesh)
    group = group_mesh.get_group()
    state: dict = {}

    def facts() -> list[int]:
        if method not in METHODS:
            raise ValueError(f"method={method!r}: use one of {list(METHODS)}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: use one of {list(LAYOUTS)}")
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r}: use None or 'zigzag'")
        seq_dim = 1 if layout == "bshd" else 2
        tensors = (q, k, v, key_padding_mask)
        if dtensor:
            tensors = _unwrap(*tensors, seq_dim, balance, mesh, group_mesh)
        lq, lk, lv, pad = tensors
        _check_local(lq, lk, lv, pad, layout)
        bq, sq, hq, d = _dims(lq, layout)
        hkv = _dims(lk, layout)[2]
        ulysses = 1
        if method == "ulysses":
            ulysses = group_mesh.size()
        elif method == "usp":
            ring_mesh, uly_mesh = _usp_axes(mesh)
            if mesh is None and _ranks(get_parallel_mesh()["cp"]) != _ranks(group_mesh):
                raise ValueError("the DTensors' mesh is not the current ParallelMesh's cp axis")
            if ring_mesh.size() * uly_mesh.size() != group_mesh.size():
                raise ValueError(
                    f"usp: cp_ring {ring_mesh.size()} x cp_ulysses {uly_mesh.size()} != cp {group_mesh.size()}"
                )
            ulysses = uly_mesh.size()
            state["axes"] = ring_mesh, uly_mesh
        if hq % ulysses:
            raise ValueError(f"method={method!r}: {hq} query heads are not divisible by the Ulysses size {ulysses}")
        value = 1.0 / math.sqrt(d) if scale is None else float(scale)
        state.update(tensors=tensors, scale=value)
        return [
            METHODS.index(method), LAYOUTS.index(layout), int(bool(causal)), float_bits(value),
            BALANCES.index(balance), int(pad is not None), bq, hq, hkv, d, dtype_code(lq.dtype), sq,
        ]  # fmt: skip

    agreed = agree(group, facts, what="cp_attention", required=True)
    for label, index, show in (
        ("method", 0, METHODS), ("layout", 1, LAYOUTS), ("causal", 2, (False, True)), ("scale", 3, None),
        ("balance", 4, BALANCES), ("key_padding_mask presence", 5, (False, True)),
    ):  # fmt: skip
        shown = (lambda r, i=index: _float(r[i])) if show is None else (lambda r, i=index, s=show: s[r[i]])
        agreed.require_same(label, shown, error=DisagreementError)
    agreed.require_same("(batch, query heads, kv heads, head dim)", lambda r: r[6:10], error=ShapeMismatchError)
    agreed.require_same("dtype", lambda r: DTYPES[r[10]], error=ShapeMismatchError)
    lengths = [r[11] for r in agreed.rows]
    total, n = sum(lengths), len(lengths)
    expected = zigzag_sizes(total, n) if balance else chunk_sizes(total, n)
    if lengths != expected:
        sizing = "zigzag sizing" if balance else "torch.chunk sizing"
        raise ShapeMismatchError(
            f"cp_attention: seq shards inconsistent with the mesh: local lengths {lengths} (sum {total}) over "
            f"{n} cp ranks; {sizing} of {total} gives {expected}"
        )

    lq, lk, lv, pad = state["tensors"]
    seq_major = layout == "bshd"
    if seq_major:
        lq, lk, lv = (x.transpose(1, 2) for x in (lq, lk, lv))
    axes, softmax_scale = state.get("axes"), state["scale"]
    out = _run(lq, lk, lv, pad, method, group_mesh, axes, lengths, causal, balance, softmax_scale, seq_major)
    if seq_major:
        out = out.transpose(1, 2)
    if not dtensor:
        return out
    seq_dim = 1 if seq_major else 2
    global_shape = list(out.shape)
    global_shape[seq_dim] = total
    return sequence_dtensor(out, seq_dim, global_shape, mesh=q.device_mesh)


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """``(B, S, H, D)`` of a tensor in ``layout``."""
    b, a, c, d = x.shape
    return (b, a, c, d) if layout == "bshd" else (b, c, a, d)


def _check_local(q, k, v, pad, layout) -> None:
    if any(not isinstance(x, torch.Tensor) or x.ndim != 4 for x in (q, k, v)):
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in (q, k, v)]
        raise ValueError(f"q, k, v must be 4-D tensors ({layout}), got {shapes}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    bq, sq, hq, d = _dims(q, layout)
    bk, sk, hk, dk = _dims(k, layout)
    if (bq, sq, d) != (bk, sk, dk) or hq % hk:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} ({layout}) must agree on batch, sequence and head dim, "
            "and the query heads must be a multiple of the key/value heads"
        )
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k, v must share one floating dtype of {[str(t) for t in _FLOATS]}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if pad is not None and (pad.dtype != torch.bool or tuple(pad.shape) != (bq, sq)):
        raise ValueError(
            f"key_padding_mask must be bool of shape (B, S_local) = {(bq, sq)}, got {pad.dtype} {tuple(pad.shape)}"
        )


def _unwrap(q, k, v, pad, seq_dim, balance, mesh, group_mesh):
    """Local tensors of DTensor inputs, after checking their placement and mesh."""
    if balance is not None:
        raise ValueError("DTensor inputs are torch.chunk shards (Shard); zigzag shards must be plain tensors")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, DTensor):
            raise TypeError(f"q is a DTensor but {name} is a {type(x).__name__}: pass all three as DTensors or none")
        if tuple(x.placements) != (Shard(seq_dim),):
            raise ValueError(f"{name} must be placed (Shard({seq_dim}),) (the sequence dim), got {tuple(x.placements)}")
        if _ranks(x.device_mesh) != _ranks(q.device_mesh):
            raise ValueError(f"q and {name} live on different meshes")
    if mesh is not None and _ranks(group_mesh) != _ranks(q.device_mesh):
        raise ValueError(
            f"the DTensors' mesh (ranks {_ranks(q.device_mesh)}) is not the mesh= argument's cp ranks "
            f"{_ranks(group_mesh)}"
        )
    if isinstance(pad, DTensor):
        pad = pad.to_local()
    return q.to_local(), k.to_local(), v.to_local(), pad


def _run(q, k, v, pad, method, cp, axes, lengths, causal, balance, scale, seq_major):
    """The computation on ``(B, H, S_r, D)`` views, after the agreement."""
    n, me, total = len(lengths), cp.get_local_rank(), sum(lengths)
    segments = _rank_segments(total, n, balance)
    fused = q.device.type == "cpu"
    if method == "allgather":
        longest = max(lengths)
        k, v = _GatherKV.apply(k, v, cp.get_group(), longest)
        if pad is not None:
            pad = _gather_pad_padded(pad, cp.get_group(), longest)
        kv_segments = _concat(segments, [c * longest for c in range(n)], causal)
        plan = _Plan(None, 0, segments[me], [kv_segments], [n * longest], causal, scale, fused)
        return _RingAttention.apply(q, k, v, pad, plan)
    if method == "ring":
        ring, uly = cp, None
    elif method == "ulysses":
        ring, uly = None, cp
    else:
        ring, uly = axes
    u = uly.size() if uly is not None else 1
    r = me // u
    ring_size = n // u
    ring_lengths = [sum(lengths[i * u : (i + 1) * u]) for i in range(ring_size)]
    ring_segments = [
        _concat(segments[i * u : (i + 1) * u], [sum(lengths[i * u : i * u + x]) for x in range(u)], causal)
        for i in range(ring_size)
    ]
    if u > 1:
        mine = lengths[r * u : (r + 1) * u]
        ugroup = uly.get_group()
        hkv = k.shape[1]
        if hkv % u:
            k, v = (x.repeat_interleave(u // math.gcd(hkv, u), dim=1) for x in (k, v))
        q, k, v = (_SeqToHeads.apply(x, ugroup, mine) for x in (q, k, v))
        if pad is not None:
            pad = _gather_pad(pad, ugroup, mine)
    group = ring.get_group() if ring is not None and ring_size > 1 else None
    plan = _Plan(group, r, ring_segments[r], ring_segments, ring_lengths, causal, scale, fused)
    out = _RingAttention.apply(q, k, v, pad, plan)
    if u > 1:
        out = _HeadsToSeq.apply(out, ugroup, mine, seq_major)
    return out


# ---- zigzag layout ---------------------------------------------------------------------------------------
def _cp_index(mesh: MeshArg) -> tuple[DeviceMesh, int, int]:
    m = _cp_of(mesh)
    return m, m.get_local_rank(), m.size()


def zigzag_shard(x: torch.Tensor, seq_dim: int, *, mesh: MeshArg = None) -> torch.Tensor:
    """This cp rank's zigzag shard of ``x``: the sequence is cut into ``2 * cp`` ``torch.chunk`` chunks and
    rank r holds chunks r and ``2*cp-1-r``, concatenated. No collective; differentiable (a slice)."""
    _, rank, n = _cp_index(mesh)
    dim = normalize_dim(seq_dim, x.ndim)
    sizes = chunk_sizes(x.shape[dim], 2 * n)
    starts = [sum(sizes[:i]) for i in range(2 * n)]
    a, b = rank, 2 * n - 1 - rank
    return torch.cat([x.narrow(dim, starts[a], sizes[a]), x.narrow(dim, starts[b], sizes[b])], dim=dim)


def zigzag_gather(local: torch.Tensor, seq_dim: int, *, mesh: MeshArg = None, seq_len: int) -> torch.Tensor:
    """The full sequence (original order) from zigzag shards: one all-gather (shards padded to the longest),
    then a local reorder. Returns a plain tensor that does not carry gradients back to the shards.

    Raises (on every rank) unless the shards agree on dtype and the other dims and their lengths are the
    zigzag sizes of ``seq_len``.
    """
    cp, rank, n = _cp_index(mesh)
    dim = normalize_dim(seq_dim, local.ndim)
    expected = zigzag_sizes(seq_len, n)

    def facts() -> list[int]:
        if local.shape[dim] != expected[rank]:
            raise ShapeMismatchError(
                f"local length {local.shape[dim]} (dim {dim}) is not the zigzag shard {expected[rank]} of "
                f"seq_len={seq_len} over {n} cp ranks (all shards: {expected})"
            )
        other = [s for i, s in enumerate(local.shape) if i != dim]
        return [dtype_code(local.dtype), dim, seq_len, local.ndim, *other]

    agreed = agree(cp.get_group(), facts, what="zigzag_gather")
    if agreed is not None:
        agreed.require_same("(dtype, seq_dim, seq_len, ndim, other dims)", error=ShapeMismatchError)
    longest = max(expected)
    moved = local.detach().movedim(dim, 0)
    send = moved.new_zeros(longest, *moved.shape[1:])
    send[: moved.shape[0]] = moved
    recv = send.new_empty(n * longest, *moved.shape[1:])
    dist.all_gather_single(recv, send, group=cp.get_group())
    sizes = chunk_sizes(seq_len, 2 * n)
    pieces: list[torch.Tensor | None] = [None] * (2 * n)
    for r in range(n):
        a, b = r, 2 * n - 1 - r
        pieces[a] = recv[r * longest : r * longest + sizes[a]]
        pieces[b] = recv[r * longest + sizes[a] : r * longest + sizes[a] + sizes[b]]
    return torch.cat(pieces, dim=0).movedim(0, dim)


# ---- a DiT block helper ------------------------------------------------------------------------------
class CPSelfAttention(nn.Module):
    """Multi-head self-attention over CP-sharded tokens: qkv projection, :func:`cp_attention`, output projection.

    Use it like an ordinary module on this rank's tokens ``(B, S_local, dim)``; its weights are replicated
    over the cp ranks (their gradients are per-rank partial sums: FSDP2 on the ``dp_cp`` axis, or an
    all-reduce over cp, adds them). Recipe for video latents::

        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=4))
        split = wf_mesh.plan_video_split(latent.shape, cp_size=pm.size("cp"))
        tokens = patch_embed(split.shard(latent, mesh=pm))             # (B, T'*H'*W, C): this rank's block
        tokens = tokens + split.shard_positions(pos_emb, mesh=pm)      # same token order
        attn = CPSelfAttention(C, heads=16, method="ulysses", mesh=pm)  # or "ring" / "usp"
        for _ in range(depth):
            tokens = tokens + attn(norm(tokens))                       # attention over ALL ranks' tokens
        video = split.gather(unpatch(tokens), mesh=pm)                  # (B, C, T, H, W) on every rank

    The shards of ``VideoSplit.shard`` are ``Shard(1)`` of the flattened ``(t h w)`` block sequence, which
    is exactly the layout cp_attention expects (``torch.chunk`` sizing, cp-rank order).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        method: str = "ring",
        mesh: MeshArg = None,
        causal: bool = False,
        balance: str | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads, self.method, self.mesh, self.causal, self.balance = heads, method, mesh, causal, balance
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        out = cp_attention(
            q, k, v, method=self.method, mesh=self.mesh, layout="bshd", causal=self.causal,
            key_padding_mask=key_padding_mask, balance=self.balance,
        )  # fmt: skip
        return self.proj(out.reshape(b, s, c))
