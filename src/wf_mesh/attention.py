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
           hops of dK, dV (accumulation dtype) back         ``2/n`` of the full K/V
           to their owners
ulysses    4 ``all_to_all_single`` (q, k, v in, out back;  the whole sequence of    q heads divisible by
           +1 for the mask); backward 4                     ``H/n`` heads: ``1/n``   ``n`` (GQA: see below)
usp        Ulysses inside ``cp_ulysses`` (4 all-to-all),    the all-to-all output    q heads divisible by U;
           ring across ``cp_ring`` on the head shards       + ring blocks:           a 2-D mesh (``mesh``)
                                                            ``(1 + min(2, R-1))/n``
allgather  1 all-gather of k, v (+1 mask); backward 1       the full K/V (padded to  none; the baseline
           reduce-scatter of dK, dV                         ``n`` x longest shard)   ("today's pattern")
=========  ===============================================  =======================  ========================

Backward holds, besides the saved inputs, the same K/V blocks plus the dK/dV blocks in flight (accumulation
dtype). What is kept from forward to backward: ring only its local k, v, out and the lse; ulysses/usp the head
shards of q, k, v (``1/n`` of the full K/V); allgather the full K/V.

Every call on plain tensors first runs one :func:`~wf_mesh.agreement.agree` exchange (one small all-gather on
the cp group): it validates the call on every rank and tells every rank every shard's length. A plan agreed
once per step (:func:`~wf_mesh.plan_cp_attention`, ``plan=``) removes it: the call then issues its data
collectives only, no host sync. DTensor inputs carry the lengths in their global shape: they run the exchange
only while checks are on.

Under ``torch.compile(fullgraph=True, dynamic=False)``: pass a plan (or DTensor inputs, with checks off). The
host-side work (validation, the plan's arithmetic, the kernel choice) runs once while dynamo traces, and the
graph holds custom ops (:mod:`wf_mesh.attention_ops`) for the ring core (its hop/compute overlap kept
inside), the all-to-alls and the all-gather; equal plans of later steps reuse the graph, a new resolution
recompiles once. A planless plain call, or planless DTensors with checks on, raise at trace time: the
per-call exchange is a host sync and stays eager (checks on => pass a plan to compile).

Which to pick: ``ulysses`` when the heads divide by the cp size and the all-to-all runs on a fast
intra-node link (least traffic: ``(n-1)/n`` of q, k, v, out once, and a single local attention call);
``ring`` when they do not, or the cp axis spans nodes (only neighbour traffic, hidden behind compute when
the blocks are large enough); ``usp`` for both at once (Ulysses inside a node, ring across nodes, e.g.
``ParallelDims(cp=16, cp_ulysses=8)``); ``allgather`` only as a reference (its K/V memory grows with the
full sequence). For causal attention use ``balance="zigzag"`` with ring/usp (blocks whose keys all follow
the queries are skipped): with contiguous shards the last rank does ``2n-1`` times the work of the first;
zigzag gives every rank the same amount. (Ulysses attends over the whole sequence on every rank, so its
work is balanced either way.)

Precision: softmax statistics (log-sum-exp), the merge of partial results, the gradient accumulators and
the ring's travelling dK/dV are in the accumulation dtype, ``torch.promote_types(dtype, float32)``: fp32 for
fp32/bf16/fp16 inputs, float64 for float64 (float64 end to end: every method equals float64 SDPA to 1e-10,
forward and backward, and ``torch.autograd.gradcheck`` passes through a distributed call). The output is cast
to the input dtype once. Other dtypes (integer, complex, float8) are refused on every rank before data moves.
Local attention runs a fused SDPA kernel with log-sum-exp output, picked per call by
:func:`wf_mesh.attention_kernels.choose_kernel`: on CUDA flash (no key padding), memory-efficient (key padding
as an expanded bias, float32) or cuDNN; on CPU the CPU flash kernel (float64 included). The math kernel,
which materializes each block's scores, is the last resort and warns once naming why (dtype, head dim, mask
kind, disabled): on CUDA that is every float64 call (no fused CUDA kernel takes float64).

Masks: with a plan built for a :class:`~wf_mesh.RangeMask` (``plan_cp_attention(mask=...)``; the shards are
``plan.shard``'s) every method evaluates the mask from global positions block by block: key blocks fully
masked for a query block are not computed, a ring hop whose K/V no later ring rank needs is not sent, and in
backward dK/dV go from the last ring rank that needs them straight back to their owner (all decided from the
plan alone, the same on every rank: no extra message; ``plan.ring_skips()`` counts them). ``key_padding_mask``
combines with it; ``causal=True`` does not (the mask says the pattern).

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
import functools
import math
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from wf_mesh import _compat, waits
from wf_mesh.agreement import Agreed, Facts, agree, checks_enabled, fact
from wf_mesh.attention_kernels import Kernel, choose_kernel
from wf_mesh.attention_ops import (
    GatherKV,
    HeadsToSeq,
    RingAttention,
    RingPlan,
    Segment,
    SeqToHeads,
    concat_segments,
    gather_kv_op,
    gather_mask,
    gather_mask_op,
    gather_mask_padded,
    gather_mask_padded_op,
    heads_to_seq_op,
    mask_pieces,
    rank_segments,
    register_ring_plan,
    ring_attention_op,
    seq_to_heads_op,
    zigzag_segments,
)
from wf_mesh.attention_plan import BALANCES, MASK_BALANCES, METHODS, CPAttentionPlan, MeshArg, dtensor_plan, planned
from wf_mesh.attention_plan import cp_of as _cp_of
from wf_mesh.attention_plan import usp_axes as _usp_axes
from wf_mesh.context_parallel import _contiguous_stride as contiguous_stride
from wf_mesh.context_parallel import normalize_dim, sequence_dtensor
from wf_mesh.errors import ShapeMismatchError
from wf_mesh.masks import RangeMask
from wf_mesh.mesh import device_mesh_ranks, get_parallel_mesh
from wf_mesh.ring_schedule import ring_last_steps, ring_needs
from wf_mesh.sizing import chunk_sizes

__all__ = ["CPSelfAttention", "Layout", "cp_attention", "zigzag_gather", "zigzag_shard", "zigzag_sizes"]

Layout = Literal["bhsd", "bshd"]
"""How q, k, v and the output are laid out: ``(B, H, S, D)`` (SDPA's) or ``(B, S, H, D)`` (flash-attn's and
diffusers' processors')."""

LAYOUTS: tuple[str, ...] = get_args(Layout)
_SEQ_DIM = {"bhsd": 2, "bshd": 1}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---- layouts: which global positions each rank holds ----------------------------------------------------
def zigzag_sizes(length: int, parts: int) -> list[int]:
    """Local lengths of the zigzag layout: rank r holds chunks r and ``2*parts-1-r`` of ``2*parts``."""
    return [sum(s.length for s in segments) for segments in zigzag_segments(length, parts)]


# ---- the call, validated and agreed --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _AttentionCall(Facts):
    """One rank's cp_attention call: its settings and shapes (exchanged), and the local tensors (kept)."""

    causal: bool
    scale: float
    batch: int
    dtype: torch.dtype
    local_len: int
    method: str = fact(choices=METHODS)  # fact() fields after the plain ones (dataclass default order)
    layout: str = fact(choices=LAYOUTS)
    balance: str | None = fact(choices=MASK_BALANCES)
    mask: bool = fact(label="key_padding_mask presence")
    q_heads: int = fact(label="query heads")
    kv_heads: int = fact(label="kv heads")
    head_dim: int = fact(label="head dim")
    tensors: tuple = fact(local=True)
    """``(q, k, v, key_padding_mask)``: local tensors, DTensors unwrapped."""
    usp_axes: tuple[DeviceMesh, DeviceMesh] | None = fact(local=True, default=None)
    """``(cp_ring, cp_ulysses)`` for method ``"usp"``."""


def _validate(q, k, v, pad, method, layout, causal, scale, balance, mesh, group_mesh, plan=None) -> _AttentionCall:
    """This rank's checks of a cp_attention call (what only this rank can see), as its record (``plan``: its
    usp axes, already checked against its mesh).

    Returns:
        This rank's :class:`_AttentionCall`.

    Raises:
        ValueError: a bad method, layout, balance, mesh, or heads not divisible by the Ulysses size.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {list(METHODS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {list(LAYOUTS)}")
    masked = plan is not None and plan.mask is not None
    if balance not in (MASK_BALANCES if masked else BALANCES):
        raise ValueError(f"balance={balance!r}: use None or 'zigzag'")
    if masked and causal:
        raise ValueError(
            f"cp_attention: causal=True with a mask plan (plan_cp_attention(mask={plan.mask!r})): the mask says "
            "which keys each query sees; pass causal=False (a token-causal pattern is a RangeMask, e.g. "
            "RangeMask.packed(lengths, causal=True))"
        )
    tensors = (q, k, v, pad)
    if isinstance(q, DTensor):
        tensors = _unwrap(*tensors, layout, balance, mesh, group_mesh)
    lq, lk, lv, lpad = tensors
    _check_local(lq, lk, lv, lpad, layout)
    batch, length, q_heads, head_dim = _dims(lq, layout)
    usp_axes, ulysses = None, 1
    if method == "ulysses":
        ulysses = group_mesh.size()
    elif method == "usp":
        usp_axes = _usp_axes(mesh) if plan is None else _planned_usp_axes(plan)
        ring_mesh, uly_mesh = usp_axes
        if (
            plan is None
            and mesh is None
            and device_mesh_ranks(get_parallel_mesh()["cp"]) != device_mesh_ranks(group_mesh)
        ):
            raise ValueError("the DTensors' mesh is not the current ParallelMesh's cp axis")
        if ring_mesh.size() * uly_mesh.size() != group_mesh.size():
            raise ValueError(
                f"usp: cp_ring {ring_mesh.size()} x cp_ulysses {uly_mesh.size()} != cp {group_mesh.size()}"
            )
        ulysses = uly_mesh.size()
    if q_heads % ulysses:
        raise ValueError(f"method={method!r}: {q_heads} query heads are not divisible by the Ulysses size {ulysses}")
    return _AttentionCall(
        method=method,
        layout=layout,
        causal=bool(causal),
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        balance=balance,
        mask=lpad is not None,
        batch=batch,
        q_heads=q_heads,
        kv_heads=_dims(lk, layout)[2],
        head_dim=head_dim,
        dtype=lq.dtype,
        local_len=length,
        tensors=tensors,
        usp_axes=usp_axes,
    )


def _planned_usp_axes(plan: CPAttentionPlan) -> tuple[DeviceMesh, DeviceMesh]:
    if plan.usp_axes is None:
        raise ValueError(
            "method='usp' with a plan built on a mesh without 'cp_ring' and 'cp_ulysses' axes: build the plan "
            "on a ParallelMesh with them (ParallelDims(cp=..., cp_ulysses=...)) or a 2-D DeviceMesh named "
            "('cp_ring', 'cp_ulysses')"
        )
    return plan.usp_axes


def _agreed_lengths(agreed: Agreed[_AttentionCall]) -> list[int]:
    """Every rank's shard length, once the ranks are known to make the same call (else raise on every rank)."""
    for name in ("method", "layout", "causal", "scale", "balance", "mask"):
        agreed.require_same(name)
    agreed.require_same("batch", "q_heads", "kv_heads", "head_dim", error=ShapeMismatchError)
    agreed.require_same("dtype", error=ShapeMismatchError)
    lengths = agreed.values("local_len")
    total, n = sum(lengths), len(lengths)
    zigzag = agreed.mine.balance == "zigzag"
    expected = zigzag_sizes(total, n) if zigzag else chunk_sizes(total, n)
    if lengths != expected:
        sizing = "zigzag sizing" if zigzag else "torch.chunk sizing"
        raise ShapeMismatchError(
            f"cp_attention: seq shards inconsistent with the mesh: local lengths {lengths} (sum {total}) over "
            f"{n} cp ranks; {sizing} of {total} gives {expected}"
        )
    return lengths


# ---- the public entry point ------------------------------------------------------------------------------
def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    method: str = "ring",
    mesh: MeshArg = None,
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    balance: str | None = None,
    plan: CPAttentionPlan | None = None,
) -> torch.Tensor:
    """Attention of this rank's query shard against the whole sequence's keys; returns this rank's output shard.

    Args:
        q: this rank's query shard, ``(B, H, S_r, D)`` (``layout="bhsd"``) or ``(B, S_r, H, D)`` (``"bshd"``).
            A plain tensor, or a DTensor placed ``Shard(seq_dim)`` on the 1-D cp mesh (the output is then such
            a DTensor too; k and v must then be DTensors as well).
        k: this rank's key shard, laid out as q; it may have fewer heads (GQA, see the module docstring).
        v: this rank's value shard, shaped as k.
        layout: required: ``"bhsd"`` or ``"bshd"``, the layout of q, k, v and the output. There is no default:
            a ``(B, S, H, D)`` shard read as ``(B, H, S, D)`` takes its heads for tokens, and at cp 2 with 2
            heads that even passes the shard-length check (wrong values, no error). DTensor inputs must be
            sharded on the layout's sequence dim (else ValueError naming both).
        method: ``"ring"``, ``"ulysses"``, ``"usp"`` or ``"allgather"`` (module docstring).
        mesh: a ParallelMesh (its ``cp`` axis; for usp its ``cp_ring`` and ``cp_ulysses`` axes), a 1-D cp
            DeviceMesh, a 2-D DeviceMesh named ``("cp_ring", "cp_ulysses")`` (cp rank = ring * U + ulysses),
            or None: the plan's mesh, else the DTensor inputs' mesh, else the current ParallelMesh.
        causal: each query sees the keys at the same or an earlier GLOBAL position.
        scale: softmax scale, default ``1/sqrt(D)``.
        key_padding_mask: bool ``(B, S_r)`` for this rank's keys, True = padding (ignored keys).
        balance: None (``torch.chunk`` shards) or ``"zigzag"`` (shards from :func:`zigzag_shard`); with a
            plan, None or the plan's.
        plan: every rank's shard length, agreed once (:func:`~wf_mesh.plan_cp_attention`): the call then
            issues its data collectives only (no agreement, no host sync). Without one, plain tensors run one
            agreement exchange per call; DTensor inputs (whose global shape gives the lengths) run it only
            while checks are on (:func:`wf_mesh.agreement.checks_enabled`).

    Returns:
        This rank's shard of the output, in ``layout`` (a ``Shard(seq_dim)`` DTensor for DTensor inputs).

    Raises:
        DisagreementError: ranks that differ in method, layout, causal, scale, balance or mask presence.
        ShapeMismatchError: ranks that differ in batch, heads, head dim or dtype, or shard lengths that are
            not the chunk (or zigzag) sizes of their sum; with a plan or DTensors, a local shard length that
            is not the planned one (names both).
        ValueError, TypeError: a bad argument on any rank (heads not divisible by the Ulysses size, DTensors
            sharded on another dim than the layout's sequence dim, a dtype no kernel takes, a plan with another
            mesh or balance, ...).
        TypeError: (from Python, on the ranks that make the call) no ``layout=``.

    Without a plan every error is raised on every cp rank, before any data moves. With a plan (or DTensors
    and checks off) there is no exchange: what this rank can check it still checks, and raises on this rank.

    Gradients: the backward gives each rank the exact gradients of its own q, k, v shards. Weights that
    produce them (projections, norms) are replicated over cp and see only this rank's tokens, so their
    gradients are per-rank partial sums: sum them over cp, or let FSDP2 over ``dp_cp`` sum them.
    """
    if torch.compiler.is_compiling():
        return _compiled_call(q, k, v, key_padding_mask, method, layout, causal, scale, balance, mesh, plan)
    seq_dim = _SEQ_DIM.get(layout, 2)  # a bad layout is refused by _validate
    with _compat.outside_fake_mode():  # meshes and the agreed facts are host-side: real even under FakeTensorMode
        if plan is not None:
            group_mesh, mesh, balance = _plan_settings(plan, mesh, balance)
            call = _validate(q, k, v, key_padding_mask, method, layout, causal, scale, balance, mesh, group_mesh, plan)
            plan.check_local_len(call.local_len)
            lengths = list(plan.lengths)
        else:
            group_mesh = q.device_mesh if isinstance(q, DTensor) and mesh is None else _cp_of(mesh)
            agreed = agree(
                group_mesh.get_group(),
                lambda: _validate(q, k, v, key_padding_mask, method, layout, causal, scale, balance, mesh, group_mesh),
                what="cp_attention",
                required=not isinstance(q, DTensor),  # DTensors: the global shape gives the lengths
            )
            call = agreed.mine
            if agreed.exchanged:
                lengths = _agreed_lengths(agreed)
            else:
                lengths = chunk_sizes(q.shape[seq_dim], group_mesh.size())
                _check_dtensor_len(call.local_len, lengths, group_mesh.get_local_rank())
    out = _run(call, group_mesh, lengths, plan)
    if not isinstance(q, DTensor):
        return out
    global_shape = list(out.shape)
    global_shape[seq_dim] = sum(lengths)
    return sequence_dtensor(out, seq_dim, tuple(global_shape), mesh=q.device_mesh)


def _plan_settings(plan: CPAttentionPlan, mesh: MeshArg, balance: str | None):
    """``(cp mesh, mesh argument, balance)`` of a call with ``plan``, after checking it agrees with them."""
    if not isinstance(plan, CPAttentionPlan):
        raise TypeError(f"plan must be a CPAttentionPlan (wf_mesh.plan_cp_attention), got {type(plan).__name__}")
    if balance is not None and balance != plan.balance:
        raise ValueError(f"balance={balance!r} contradicts the plan's balance {plan.balance!r}")
    if mesh is not None and mesh is not plan.source and device_mesh_ranks(_cp_of(mesh)) != device_mesh_ranks(plan.mesh):
        raise ValueError(
            f"mesh= (cp ranks {device_mesh_ranks(_cp_of(mesh))}) is not the plan's mesh (cp ranks "
            f"{device_mesh_ranks(plan.mesh)}); build the plan on the mesh the call uses"
        )
    return plan.mesh, plan.source if mesh is None else mesh, plan.balance


def _check_dtensor_len(local_len: int, lengths: list[int], rank: int) -> None:
    if local_len != lengths[rank]:
        raise ShapeMismatchError(
            f"cp_attention: this rank's DTensor shard holds {local_len} tokens but its global length "
            f"{sum(lengths)} gives cp rank {rank} {lengths[rank]} (torch.chunk sizes {lengths})"
        )


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


def _unwrap(q, k, v, pad, layout, balance, mesh, group_mesh):
    """Local tensors of DTensor inputs, after checking their placement (the layout's sequence dim) and mesh."""
    seq_dim = _SEQ_DIM[layout]
    if balance == "work":
        raise ValueError(
            "DTensor inputs are torch.chunk shards (Shard), a work-balanced plan's shards are not: pass plain "
            "tensors from plan.shard(x, seq_dim) (and plan.gather the output), or build the plan with balance=None"
        )
    if balance is not None:
        raise ValueError("DTensor inputs are torch.chunk shards (Shard); zigzag shards must be plain tensors")
    q_ranks = device_mesh_ranks(q.device_mesh)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, DTensor):
            raise TypeError(f"q is a DTensor but {name} is a {type(x).__name__}: pass all three as DTensors or none")
        placements = tuple(x.placements)
        if placements != (Shard(seq_dim),):
            sharded = placements[0].dim if len(placements) == 1 and isinstance(placements[0], Shard) else None
            if sharded is not None:  # a Shard on another dim: the layout and the DTensor read the sequence apart
                raise ValueError(
                    f"layout={layout!r} reads the sequence on dim {seq_dim}, the DTensor {name} is sharded on dim "
                    f"{sharded} {placements}: pass the layout of the tensors, or shard them on dim {seq_dim}"
                )
            raise ValueError(f"{name} must be placed (Shard({seq_dim}),) (the sequence dim), got {placements}")
        if device_mesh_ranks(x.device_mesh) != q_ranks:
            raise ValueError(f"q and {name} live on different meshes")
    if mesh is not None and device_mesh_ranks(group_mesh) != q_ranks:
        raise ValueError(
            f"the DTensors' mesh (ranks {q_ranks}) is not the mesh= argument's cp ranks {device_mesh_ranks(group_mesh)}"
        )
    if isinstance(pad, DTensor):
        pad = pad.to_local()
    return q.to_local(), k.to_local(), v.to_local(), pad


# ---- plan the method, then run it -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _MethodPlan:
    """How one call runs: the blockwise core's plan and the moves around it.

    allgather: k, v (and the mask) are first gathered from every rank, each padded to ``gather_longest``.
    ulysses / usp: q, k, v (and the mask) go from sequence to head shards over ``ulysses`` (the sequence
    lengths of its ranks are ``ulysses_lengths``), K/V heads first repeated ``kv_repeat`` times; the output
    comes back the same way.
    """

    core: RingPlan
    gather: dist.ProcessGroup | None = None
    gather_longest: int = 0
    ulysses: dist.ProcessGroup | None = None
    ulysses_lengths: tuple[int, ...] = ()
    kv_repeat: int = 1


def _plan(
    call: _AttentionCall, cp: DeviceMesh, lengths: list[int], kernel: Kernel, layout: CPAttentionPlan | None = None
) -> _MethodPlan:
    """How an agreed call on ``cp`` runs (pure arithmetic, no communication).

    Args:
        call: the agreed call.
        cp: the cp mesh.
        lengths: every cp rank's shard length.
        kernel: the local attention kernel.
        layout: the call's plan, if any: with a mask, its segments and mask are what the call follows.

    Returns:
        The :class:`_MethodPlan`.
    """
    n, me, total = len(lengths), cp.get_local_rank(), sum(lengths)
    mask = layout.mask if layout is not None else None
    if mask is not None and layout is not None:
        segments = _plan_segments(layout.segments)
    else:
        segments = rank_segments(total, n, call.balance)
    causal, scale = call.causal, call.scale
    positional = causal or mask is not None
    if call.method == "allgather":
        longest = max(lengths)
        kv_segments = concat_segments(segments, [c * longest for c in range(n)], positional)
        verdict = cp.get_group().group_name
        core = RingPlan(None, 0, segments[me], [kv_segments], [n * longest], causal, scale, kernel, verdict)
        return _MethodPlan(_masked(core, mask), gather=cp.get_group(), gather_longest=longest)
    ring: DeviceMesh | None
    uly: DeviceMesh | None
    if call.method == "usp":
        assert call.usp_axes is not None  # _validate sets them for usp
        ring, uly = call.usp_axes
    else:
        ring, uly = (cp, None) if call.method == "ring" else (None, cp)
    u = uly.size() if uly is not None else 1
    r, ring_size = me // u, n // u
    ring_lengths = [sum(lengths[i * u : (i + 1) * u]) for i in range(ring_size)]
    ring_segments = [
        concat_segments(segments[i * u : (i + 1) * u], [sum(lengths[i * u : i * u + x]) for x in range(u)], positional)
        for i in range(ring_size)
    ]
    group = ring.get_group() if ring is not None and ring_size > 1 else None
    core = RingPlan(
        group, r, ring_segments[r], ring_segments, ring_lengths, causal, scale, kernel, cp.get_group().group_name
    )
    core = _masked(core, mask)
    if uly is None or u == 1:
        return _MethodPlan(core)
    return _MethodPlan(
        core,
        ulysses=uly.get_group(),
        ulysses_lengths=tuple(lengths[r * u : (r + 1) * u]),
        kv_repeat=1 if call.kv_heads % u == 0 else u // math.gcd(call.kv_heads, u),
    )


def _plan_segments(intervals: tuple[tuple[tuple[int, int], ...], ...]) -> list[list[Segment]]:
    """A plan's per-rank global intervals as segments of each rank's shard (plan order)."""
    out = []
    for spans in intervals:
        offsets = [0]
        for a, b in spans:
            offsets.append(offsets[-1] + b - a)
        out.append([Segment(o, a, b - a) for o, (a, b) in zip(offsets, spans)])
    return out


def _masked(core: RingPlan, mask: RangeMask | None) -> RingPlan:
    """``core`` evaluating ``mask`` (its pieces per block, how far each block travels); ``core`` if no mask."""
    if mask is None:
        return core
    pieces, last_steps = _mask_core(
        mask, tuple(core.q_segments), tuple(tuple(b) for b in core.kv_segments), core.group is not None
    )
    return dataclasses.replace(core, mask=pieces, last_steps=last_steps)


@functools.lru_cache(maxsize=64)
def _mask_core(mask: RangeMask, q_segments, kv_segments, ring: bool):
    """What a RingPlan needs of ``mask`` (cached: every layer of every step asks the same).

    Returns:
        ``(per block, the kernel calls of the mask's pieces within this rank's queries x its keys; a ring: each
        block's last step, else ())``.
    """
    pieces = tuple(
        mask_pieces(
            [
                p
                for qs in q_segments
                for ks in block
                for p in mask.block_pieces(qs.start, qs.start + qs.length, ks.start, ks.start + ks.length)
            ],
            q_segments,
            block,
        )
        for block in kv_segments
    )
    if not ring:
        return pieces, ()
    blocks = [[(s.start, s.start + s.length) for s in block] for block in kv_segments]
    return pieces, ring_last_steps(ring_needs(mask, blocks))


def _run(call: _AttentionCall, cp: DeviceMesh, lengths: list[int], layout: CPAttentionPlan | None) -> torch.Tensor:
    """The output shard of an agreed call, in its layout (``layout``: the call's plan, if any)."""
    q, k, v, pad = call.tensors
    seq_major = call.layout == "bshd"
    if seq_major:  # the engine works on (B, H, S, D) views
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    kernel = choose_kernel(q.device, q.dtype, call.head_dim, padded=pad is not None).kernel
    plan = _plan(call, cp, lengths, kernel, layout)
    if plan.gather is not None:
        k, v = GatherKV.apply(k, v, plan.gather, plan.gather_longest)
        if pad is not None:
            pad = gather_mask_padded(pad, plan.gather, plan.gather_longest)
    if plan.ulysses is not None:
        mine = list(plan.ulysses_lengths)
        if plan.kv_repeat > 1:
            k, v = (x.repeat_interleave(plan.kv_repeat, dim=1) for x in (k, v))
        q, k, v = (SeqToHeads.apply(x, plan.ulysses, mine) for x in (q, k, v))
        if pad is not None:
            pad = gather_mask(pad, plan.ulysses, mine)
    out = RingAttention.apply(q, k, v, pad, plan.core)
    if plan.ulysses is not None:
        out = HeadsToSeq.apply(out, plan.ulysses, list(plan.ulysses_lengths), seq_major)
    return out.transpose(1, 2) if seq_major else out


# ---- under torch.compile: host-side planning at trace time, custom ops in the graph ---------------------
def _compiled_call(q, k, v, pad, method, layout, causal, scale, balance, mesh, plan) -> torch.Tensor:
    """cp_attention as dynamo traces it (see the module docstring): the plan and this call's constants give
    the moves (:func:`_compiled_moves`, run eagerly at trace time, validation included); the graph holds only
    the tensor work and the custom ops of :mod:`wf_mesh.attention_ops`.

    Returns:
        This rank's output shard (a DTensor for DTensor inputs), as :func:`cp_attention`.

    Raises:
        ValueError: a ``mesh=`` the compiled path cannot take (the plan or the DTensors carry the mesh).
        TypeError: q is a DTensor but k or v is not.
    """
    dtensor = isinstance(q, DTensor)
    if plan is None:
        if mesh is not None:
            raise ValueError("cp_attention under torch.compile: pass mesh=None (the plan or DTensors carry it)")
        plan_key = _compiled_dtensor_plan(q.device_mesh if dtensor else None, q.shape[1 if layout == "bshd" else 2])
        cp = q.device_mesh
    else:
        if mesh is not None and mesh is not plan.source:
            raise ValueError("cp_attention under torch.compile: pass mesh=None (the plan carries its mesh)")
        plan_key, cp = plan.key, plan.mesh
    if dtensor:
        if not (isinstance(k, DTensor) and isinstance(v, DTensor)):
            raise TypeError("q is a DTensor but k or v is not: pass all three as DTensors or none")
        seq_dim = 1 if layout == "bshd" else 2
        if any(tuple(x.placements) != (Shard(seq_dim),) for x in (q, k, v)):
            raise ValueError(f"q, k, v must be placed (Shard({seq_dim}),) (the sequence dim of layout={layout!r})")
        q_global = tuple(q.shape)
        q, k, v = q.to_local(), k.to_local(), v.to_local()
        if isinstance(pad, DTensor):
            pad = pad.to_local()
    shapes = tuple(None if x is None else tuple(x.shape) for x in (q, k, v, pad))
    dtypes = tuple(None if x is None else str(x.dtype) for x in (q, k, v, pad))
    ring_key, gather, longest, ulysses, lengths, kv_repeat = _compiled_moves(
        plan_key, method, layout, bool(causal), scale, balance, shapes, dtypes, str(q.device)
    )
    seq_major = layout == "bshd"
    if seq_major:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if gather:
        buf = gather_kv_op(k, v, gather, longest)
        k, v = buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3)
        if pad is not None:
            pad = gather_mask_padded_op(pad, gather, longest)
    if ulysses:
        if kv_repeat > 1:
            k, v = (x.repeat_interleave(kv_repeat, dim=1) for x in (k, v))
        q, k, v = (seq_to_heads_op(x, ulysses, list(lengths)) for x in (q, k, v))
        if pad is not None:
            pad = gather_mask_op(pad, ulysses, list(lengths))
    out = ring_attention_op(q, k, v, pad, ring_key)[0]
    if ulysses:
        out = heads_to_seq_op(out, ulysses, list(lengths), seq_major)
    out = out.transpose(1, 2) if seq_major else out
    if not dtensor:
        return out
    seq_dim = 1 if seq_major else 2
    global_shape = list(out.shape)
    global_shape[seq_dim] = q_global[seq_dim]
    # DTensor.from_local directly: sequence_dtensor's liveness check of the mesh is host-side, not traceable
    shape = torch.Size(global_shape)
    return DTensor.from_local(out, cp, [Shard(seq_dim)], run_check=False, shape=shape, stride=contiguous_stride(shape))


@_compat.constant_at_trace
def _compiled_dtensor_plan(mesh: DeviceMesh | None, seq_len: int) -> str:
    """The key of the plan DTensor inputs imply (their global length, checks off), for :func:`_compiled_moves`."""
    if mesh is None:
        raise ValueError(
            "cp_attention under torch.compile needs plan= (wf_mesh.plan_cp_attention) or DTensor inputs: the "
            "per-call agreement exchange of plain tensors is a host sync that cannot be traced"
        )
    if checks_enabled():
        raise ValueError(
            "cp_attention under torch.compile with DTensor inputs and checks on: their per-call validation "
            "exchange stays eager and cannot be traced; pass plan= (wf_mesh.plan_cp_attention) or turn checks "
            "off (WF_MESH_CHECKS=0 / init_parallel(checks=False))"
        )
    return dtensor_plan(mesh, seq_len).key


@_compat.constant_at_trace
def _compiled_moves(plan_key, method, layout, causal, scale, balance, shapes, dtypes, device):
    """The moves of a call, after this rank's checks of it (on shape-only tensors: the same messages as eager).

    Returns:
        ``(ring plan key, all-gather group name, longest shard, Ulysses group name, Ulysses lengths, K/V head
        repeats)``, group names "" when unused.
    """
    plan = planned(plan_key)
    balance = _plan_settings(plan, None, balance)[2]
    with _compat.outside_fake_mode():
        metas = [
            None if s is None else torch.empty(s, dtype=getattr(torch, t[6:]), device="meta")
            for s, t in zip(shapes, dtypes)
        ]
        mq, mk, mv, mpad = metas
        call = _validate(mq, mk, mv, mpad, method, layout, causal, scale, balance, plan.source, plan.mesh, plan)
        plan.check_local_len(call.local_len)
        kernel = choose_kernel(torch.device(device), call.dtype, call.head_dim, padded=call.mask).kernel
        moves = _plan(call, plan.mesh, list(plan.lengths), kernel, plan)
    if moves.gather is not None:
        return register_ring_plan(moves.core), moves.gather.group_name, moves.gather_longest, "", (), 1
    ulysses = "" if moves.ulysses is None else moves.ulysses.group_name
    return register_ring_plan(moves.core), "", 0, ulysses, moves.ulysses_lengths, moves.kv_repeat


# ---- zigzag layout ---------------------------------------------------------------------------------------
def _cp_index(mesh: MeshArg) -> tuple[DeviceMesh, int, int]:
    m = _cp_of(mesh)
    return m, m.get_local_rank(), m.size()


def zigzag_shard(x: torch.Tensor, seq_dim: int, *, mesh: MeshArg = None) -> torch.Tensor:
    """This cp rank's zigzag shard of ``x``: the sequence is cut into ``2 * cp`` ``torch.chunk`` chunks and
    rank r holds chunks r and ``2*cp-1-r``, concatenated. No collective; differentiable (a slice).

    Args:
        x: the full sequence.
        seq_dim: its sequence dim.
        mesh: the cp mesh (as for :func:`cp_attention`).

    Returns:
        This rank's shard (a new tensor: the two chunks concatenated).
    """
    _, rank, n = _cp_index(mesh)
    dim = normalize_dim(seq_dim, x.ndim)
    segments = zigzag_segments(x.shape[dim], n)[rank]
    return torch.cat([x.narrow(dim, s.start, s.length) for s in segments], dim=dim)


@dataclasses.dataclass(frozen=True)
class _ZigzagFacts(Facts):
    dtype: torch.dtype
    seq_dim: int
    seq_len: int
    other_dims: tuple[int, ...] = fact(label="other dims")


def zigzag_gather(local: torch.Tensor, seq_dim: int, *, mesh: MeshArg = None, seq_len: int) -> torch.Tensor:
    """The full sequence (original order) from zigzag shards: one all-gather (shards padded to the longest),
    then a local reorder. Returns a plain tensor that does not carry gradients back to the shards.

    Args:
        local: this rank's zigzag shard.
        seq_dim: its sequence dim.
        mesh: the cp mesh (as for :func:`cp_attention`).
        seq_len: the full sequence's length.

    Returns:
        The full sequence, on every rank.

    Raises:
        ShapeMismatchError: (on every rank) shards that disagree on dtype, ``seq_dim``, ``seq_len`` or the
            other dims, or whose lengths are not the zigzag sizes of ``seq_len``.
    """
    cp, rank, n = _cp_index(mesh)
    dim = normalize_dim(seq_dim, local.ndim)
    layout = zigzag_segments(seq_len, n)
    expected = [sum(s.length for s in segments) for segments in layout]

    def facts() -> _ZigzagFacts:
        if local.shape[dim] != expected[rank]:
            raise ShapeMismatchError(
                f"local length {local.shape[dim]} (dim {dim}) is not the zigzag shard {expected[rank]} of "
                f"seq_len={seq_len} over {n} cp ranks (all shards: {expected})"
            )
        return _ZigzagFacts(local.dtype, dim, seq_len, tuple(s for i, s in enumerate(local.shape) if i != dim))

    agreed = agree(cp.get_group(), facts, what="zigzag_gather")
    agreed.require_same("dtype", "seq_dim", "seq_len", "other_dims", error=ShapeMismatchError)
    longest = max(expected)
    moved = local.detach().movedim(dim, 0)
    send = moved.new_zeros(longest, *moved.shape[1:])
    send[: moved.shape[0]] = moved
    recv = send.new_empty(n * longest, *moved.shape[1:])
    with waits.bounded(cp.get_group(), "cp_attention"):
        _compat.all_gather_single(recv, send, group=cp.get_group())
    placed = sorted(((r, s) for r, segments in enumerate(layout) for s in segments), key=lambda rs: rs[1].start)
    pieces = [recv[r * longest + s.offset : r * longest + s.offset + s.length] for r, s in placed]
    return torch.cat(pieces, dim=0).movedim(0, dim)


# ---- a DiT block helper ------------------------------------------------------------------------------
class CPSelfAttention(nn.Module):
    """Multi-head self-attention over CP-sharded tokens: qkv projection, :func:`cp_attention`, output projection.

    Use it like an ordinary module on this rank's tokens ``(B, S_local, dim)``.

    Gradient rule: its weights are replicated over the cp ranks and each rank's backward sees only its own
    tokens, so their gradients are per-rank partial sums: sum them over cp (FSDP2 over the ``dp_cp`` axis,
    ``fully_shard(model, mesh=pm.fsdp_mesh())``, does it together with dp; without FSDP,
    ``dist.all_reduce(p.grad, group=pm.group("cp"))``). The same holds for every weight around
    :func:`cp_attention`.

    Recipe for a video DiT with a Conv3d patch embedding and a 3-D RoPE (the token grid; see
    :mod:`wf_mesh.video` for the token order: each shard natural ``(t h w)`` within its block)::

        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=4))
        split = wf_mesh.plan_video_split(latent.shape, cp_size=pm.size("cp"), patch_values=(1, 2, 2))
        tokens = patch_embed(latent).flatten(2).transpose(1, 2)    # (B, N, C), natural (t h w) order
        tokens = split.shard_tokens(tokens, mesh=pm)               # (B, N / cp, C): this rank's block
        pos = split.positions(mesh=pm)                             # (N / cp, 3): global (t, h, w) for RoPE
        attn = CPSelfAttention(C, heads=16, method="ulysses", mesh=pm)  # or "ring" / "usp"
        plan = split.attention_plan(mesh=pm, tokens=True)          # agreed once per step, for all layers
        for _ in range(depth):
            tokens = tokens + attn(norm(tokens), plan=plan)        # attention over ALL ranks' tokens
        out = split.gather_tokens(final_layer(tokens), mesh=pm)    # (B, N, C'), natural order: unpatchify
        # loss(out).backward(); then sum the parameter gradients over cp (above)

    (A model that applies RoPE inside attention builds its tables from ``pos``; :meth:`VideoSplit.shard` /
    :meth:`~VideoSplit.shard_positions` are the same recipe for per-voxel tokens.) The shards are ``Shard(1)``
    of the block-order sequence, which is exactly the layout cp_attention expects (``torch.chunk`` sizing,
    cp-rank order).
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

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, plan: CPAttentionPlan | None = None
    ) -> torch.Tensor:
        """This rank's tokens ``(B, S_local, dim)`` attended over every cp rank's tokens.

        Args:
            x: this rank's tokens.
            key_padding_mask: bool ``(B, S_local)``, True = padding.
            plan: the step's :func:`~wf_mesh.plan_cp_attention` (then no agreement per call); its mesh must be
                the module's.

        Returns:
            ``(B, S_local, dim)``.
        """
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        out = cp_attention(
            q,
            k,
            v,
            method=self.method,
            mesh=self.mesh,
            layout="bshd",
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            balance=self.balance,
            plan=plan,
        )
        return self.proj(out.reshape(b, s, c))
