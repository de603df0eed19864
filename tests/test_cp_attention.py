"""CP attention (wf_mesh.attention) on real gloo clusters, compared with single-process
``F.scaled_dot_product_attention`` on the full sequence: forward and backward (dq, dk, dv).

Every world size runs its whole case list in ONE ``run_distributed`` call (session fixtures); the tests then
look up their case. References are computed here in fp64 from the same inputs.

Tolerances: float64 results within 1e-10 and fp32 within 1e-5 (abs + rel) of the fp64 reference. bf16 within
3e-2 and fp16 within 5e-3 (abs + rel): bf16 keeps 8 significant bits (rounding 2^-9 ~ 2e-3 relative per value), fp16 11 (2^-12), and
the kernels round q.k products, probabilities and each block's partial output to the input dtype before the
fp32 merge; single-process SDPA in those dtypes stays within half of each bound on these shapes (asserted, so
that the bounds stay meaningful).

Collective counts: ``CommDebugMode`` counts c10d collectives (it sees gloo's all_to_all_single as
``alltoall_base_``, all_gather_single as ``_allgather_base_``, reduce_scatter as ``_reduce_scatter_base_``) but
not point-to-point ops: ``c10d.send`` / ``c10d.recv_`` are dispatched but are not in its list. So
:func:`c10d_counter` (``wf_mesh.testing.c10d_ops``, on the dispatch mode CommDebugMode builds on) counts every
``c10d`` op by name, P2P included; it must agree with CommDebugMode on the collectives, and both are pinned
against counts derived from the algorithm here.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import typing
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import wf_mesh
from wf_mesh.attention import (
    CPSelfAttention,
    cp_attention,
    zigzag_gather,
    zigzag_shard,
    zigzag_sizes,
)
from wf_mesh.context_parallel import sequence_dtensor
from wf_mesh.errors import DisagreementError, ShapeMismatchError
from wf_mesh.sizing import chunk_sizes
from wf_mesh.testing import c10d_ops, run_distributed

from helpers import USP, run_cp_cases

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}


def c10d_counter():
    """``(counts, mode)``: while ``mode`` is active, every ``c10d`` op dispatched (collectives and point-to-point)
    is counted by name into ``counts``."""
    counts = collections.Counter()
    return counts, c10d_ops(lambda name, args: counts.update([name]))


# ---- cases ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    method: str
    seq: int
    causal: bool = False
    layout: str = "bhsd"
    heads: int = 4
    kv_heads: int = 4
    balance: str | None = None
    pad: bool = False
    dtype: str = "float32"
    usp: tuple[int, int] | None = None  # (ring, ulysses) of a 2-D DeviceMesh
    dtensor: bool = False

    @property
    def id(self) -> str:
        parts = [f"cp{self.world}", self.method + (f"{self.usp[0]}x{self.usp[1]}" if self.usp else ""), f"S{self.seq}"]
        parts += ["causal"] * self.causal + [self.layout, f"h{self.heads}kv{self.kv_heads}"]
        parts += [self.balance] * bool(self.balance) + ["pad"] * self.pad + [self.dtype] + ["dtensor"] * self.dtensor
        return "-".join(parts)


def methods(world):
    splits = {2: [(1, 2), (2, 1)], 4: [(2, 2)], 8: [(2, 4), (4, 2)]}[world]
    return [("ring", None), ("ulysses", None), ("allgather", None)] + [("usp", s) for s in splits]


def cases_for(world):
    heads = max(4, world)  # ulysses over all cp ranks needs heads divisible by the cp size
    even, uneven = 4 * world, 4 * world - 3  # cp 8: S=29 -> chunk sizes 4 x 7 + 1; zigzag 2 x 14 + 1 + 0
    out = []
    for method, usp in methods(world):
        base = {"world": world, "method": method, "usp": usp, "heads": heads, "kv_heads": heads}
        out += [
            Case(seq=even, **base),
            Case(seq=uneven, causal=True, balance="zigzag", **base),
            Case(seq=uneven, causal=True, pad=True, layout="bshd", **{**base, "kv_heads": heads // 2}),
        ]
        if world < 8:  # 8 processes on a small machine are slow: cp 8 runs the core of the matrix only
            out += [
                Case(seq=uneven, causal=True, layout="bshd", **base),
                Case(seq=even, causal=True, balance="zigzag", pad=True, **{**base, "kv_heads": 1}),
                Case(seq=even, causal=True, dtype="bfloat16", **base),
                Case(seq=uneven, causal=True, balance="zigzag", dtype="float16", **base),
                # float64 end to end (statistics, merges and the travelling dK/dV in float64)
                Case(seq=even, layout="bshd", dtype="float64", **base),
                Case(seq=uneven, causal=True, balance="zigzag", pad=True, dtype="float64", **{**base, "kv_heads": 2}),
            ]
        else:  # trailing ranks without tokens: chunk sizes 4 x 6 + 1 + 0
            out.append(Case(seq=25, causal=True, layout="bshd", **base))
    if world == 4:
        out += [
            Case(world=4, method=m, usp=u, seq=14, causal=c, layout=lay, dtensor=True)
            for (m, u), c, lay in zip(methods(4), (False, True, True, False), ("bhsd", "bshd", "bhsd", "bshd"))
        ]
    return out


CASES = {w: cases_for(w) for w in (2, 4, 8)}
ALL = [c for w in CASES for c in CASES[w]]


def make_inputs(case):
    """Global q, k, v, dout (B, H, S, D) and the key padding mask (B, S), the same on every process."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    dtype = getattr(torch, case.dtype)
    b, d = 2, 8

    def sample(h):
        return torch.randn(b, h, case.seq, d, generator=g, dtype=torch.float64).to(dtype)

    q, k, v, dout = sample(case.heads), sample(case.kv_heads), sample(case.kv_heads), sample(case.heads)
    pad = None
    if case.pad:
        pad = torch.rand(b, case.seq, generator=g) < 0.3
        pad[1, : case.seq // 2] = True  # with causal: the first half of batch 1's queries see no key at all
    return q, k, v, dout, pad


def to_layout(x, layout):
    return x.transpose(1, 2).contiguous() if layout == "bshd" else x


def shard_of(x, dim, world, rank, balance):
    if balance:
        sizes = chunk_sizes(x.shape[dim], 2 * world)
        starts = [sum(sizes[:i]) for i in range(2 * world)]
        a, b = rank, 2 * world - 1 - rank
        return torch.cat([x.narrow(dim, starts[a], sizes[a]), x.narrow(dim, starts[b], sizes[b])], dim)
    sizes = chunk_sizes(x.shape[dim], world)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


# ---- distributed runs ----------------------------------------------------------------------------------
def run_case(case, pm, usp_meshes):
    rank, seq_dim = pm.rank("cp"), 1 if case.layout == "bshd" else 2
    q, k, v, dout, pad = make_inputs(case)

    def shard(x, dim):
        if case.balance:
            return zigzag_shard(x, dim, mesh=pm)
        return wf_mesh.shard_sequence(x, dim, mesh=pm, as_dtensor=False)

    leaves = [shard(to_layout(x, case.layout), seq_dim).clone().requires_grad_() for x in (q, k, v)]
    inputs, mesh = leaves, usp_meshes[case.usp] if case.usp else pm
    if case.dtensor:
        shapes = [to_layout(x, case.layout).shape for x in (q, k, v)]
        inputs = [sequence_dtensor(x, seq_dim, shape, mesh=pm) for x, shape in zip(leaves, shapes)]
        mesh = usp_meshes[case.usp] if case.usp else None  # 1-D methods: the mesh comes from the DTensors
    kwargs = {
        "method": case.method,
        "mesh": mesh,
        "layout": case.layout,
        "causal": case.causal,
        "balance": case.balance,
        "key_padding_mask": None if pad is None else shard(pad, 1),
    }
    fwd, counting = c10d_counter()
    with CommDebugMode() as comm, counting:
        out = cp_attention(*inputs, **kwargs)
    result = {"comm_fwd": comm.get_total_counts(), "fwd": dict(fwd)}
    if case.dtensor:
        result.update(kind=type(out).__name__, placements=str(out.placements), global_shape=tuple(out.shape))
        out = out.to_local()
    bwd, counting = c10d_counter()
    with CommDebugMode() as comm, counting:
        out.backward(shard(to_layout(dout, case.layout), seq_dim))
    result.update(comm_bwd=comm.get_total_counts(), bwd=dict(bwd), out=out.detach())
    result["layout_ok"] = out.is_contiguous()
    result.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad, rank=rank, local_len=out.shape[seq_dim])
    return result


def run_world(cases):
    return run_cp_cases(run_case, cases)


@pytest.fixture(scope="session")
def world_results():
    cache = {}

    def get(world):
        if world not in cache:
            per_rank = run_distributed(world, run_world, CASES[world])
            cache[world] = {c.id: [per_rank[r][i] for r in range(world)] for i, c in enumerate(CASES[world])}
        return cache[world]

    return get


# ---- the reference -------------------------------------------------------------------------------------
def reference(case, dtype=torch.float64):
    """Full-sequence SDPA in ``dtype``: (out, dq, dk, dv) in (B, H, S, D)."""
    q, k, v, dout, pad = make_inputs(case)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    mask = None
    if case.causal or pad is not None:
        mask = torch.ones(case.seq, case.seq, dtype=torch.bool)
        mask = (mask.tril() if case.causal else mask)[None, None]
        if pad is not None:
            mask = mask & ~pad[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout.to(dtype))
    return [x.detach() for x in (out, q.grad, k.grad, v.grad)]


def close(got, want, tol):
    return torch.allclose(got.double(), want.double(), atol=tol, rtol=tol)


def ring_p2p(lengths, index, tensors, steps, skip_last=True):
    """(sends, receives) of one ring rank: ``tensors`` per non-empty block, for ``steps`` hops."""
    n = len(lengths)
    sends = sum(tensors for t in range(steps) if lengths[(index - t) % n])
    recvs = sum(tensors for t in range(steps) if lengths[(index - t - 1) % n])
    return sends, recvs


def expected_counts(case, rank):
    """c10d ops per rank for forward and backward, from the algorithm (not the implementation)."""
    n = case.world
    lengths = zigzag_sizes(case.seq, n) if case.balance else chunk_sizes(case.seq, n)
    fwd, bwd = collections.Counter({"_allgather_base_": 1}), collections.Counter()  # 1: the agreement
    if case.method == "allgather":
        fwd["_allgather_base_"] += 1 + case.pad  # k and v in one buffer; the mask
        bwd["_reduce_scatter_base_"] += 1
        return fwd, bwd
    ring, uly = {"ring": (n, 1), "ulysses": (1, n), "usp": case.usp}[case.method]
    if uly > 1:
        fwd["alltoall_base_"] += 4 + case.pad  # q, k, v (+ mask) in, out back
        bwd["alltoall_base_"] += 4  # dout in; dq, dk, dv back
    if ring > 1:
        blocks = [sum(lengths[i * uly : (i + 1) * uly]) for i in range(ring)]
        kv = 2 + case.pad
        s, r = ring_p2p(blocks, rank // uly, kv, ring - 1)
        fwd.update(send=s, recv_=r)
        s2, r2 = ring_p2p(blocks, rank // uly, 2, ring)  # fp32 dK, dV: one more hop, to their owner
        bwd.update(send=s + s2, recv_=r + r2)
    return fwd, bwd


# ---- correctness ---------------------------------------------------------------------------------------
# cp 8 (8 processes on a 2-core machine: 9 s of the fast lane) runs in the slow lane
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * (c.world == 8)) for c in ALL])
def test_matches_single_process_sdpa(case, world_results):
    ranks = world_results(case.world)[case.id]
    seq_dim = 1 if case.layout == "bshd" else 2
    tol = TOL[case.dtype]
    expected_lengths = zigzag_sizes(case.seq, case.world) if case.balance else chunk_sizes(case.seq, case.world)
    assert [r["local_len"] for r in ranks] == expected_lengths
    for name, want in zip(("out", "dq", "dk", "dv"), reference(case)):
        want = to_layout(want, case.layout)
        for r in ranks:
            got, expected = r[name], shard_of(want, seq_dim, case.world, r["rank"], case.balance)
            assert got.dtype == getattr(torch, case.dtype) and got.shape == expected.shape
            assert close(got, expected, tol), (name, r["rank"])
    assert all(r["layout_ok"] for r in ranks)  # the output is contiguous in the caller's layout


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_tolerance_is_meaningful(dtype):
    """Single-process SDPA in ``dtype`` is within half the tolerance of the fp64 reference, while a result off
    by one row (a causal off-by-one) would be far outside it: the tolerance is tight enough to catch bugs."""
    case = Case(world=2, method="ring", seq=29, causal=True, dtype=dtype)
    want = reference(case)
    got = reference(case, getattr(torch, dtype))
    errors = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
    assert max(errors) < TOL[dtype] / 2
    assert not close(want[0][:, :, 1:], want[0][:, :, :-1], TOL[dtype])


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_collective_counts_are_pinned(case, world_results):
    for r in world_results(case.world)[case.id]:
        fwd, bwd = expected_counts(case, r["rank"])
        assert collections.Counter(r["fwd"]) == fwd, r["rank"]
        assert collections.Counter(r["bwd"]) == bwd, r["rank"]
        # CommDebugMode sees the same collectives (it does not count send/recv)
        assert r["comm_fwd"] == sum(v for k, v in fwd.items() if k not in ("send", "recv_"))
        assert r["comm_bwd"] == sum(v for k, v in bwd.items() if k not in ("send", "recv_"))


def test_counts_of_even_cp4_calls_by_name(world_results):
    """The same counts spelled out for one even, non-causal call per method at cp 4 (rank 0)."""
    results = world_results(4)
    got = {c.method: results[c.id][0] for c in CASES[4] if c.seq == 16 and not c.causal and not c.dtensor}
    assert got["ring"]["fwd"] == {"_allgather_base_": 1, "send": 6, "recv_": 6}  # 3 hops of k and v
    assert got["ring"]["bwd"] == {"send": 6 + 8, "recv_": 6 + 8}  # 3 hops of k, v; 4 of dK, dV
    assert got["ulysses"]["fwd"] == {"_allgather_base_": 1, "alltoall_base_": 4}
    assert got["ulysses"]["bwd"] == {"alltoall_base_": 4}
    assert got["usp"]["fwd"] == {"_allgather_base_": 1, "alltoall_base_": 4, "send": 2, "recv_": 2}
    assert got["usp"]["bwd"] == {"alltoall_base_": 4, "send": 2 + 4, "recv_": 2 + 4}
    assert got["allgather"]["fwd"] == {"_allgather_base_": 2}
    assert got["allgather"]["bwd"] == {"_reduce_scatter_base_": 1}


def test_dtensor_in_dtensor_out(world_results):
    cases = [c for c in CASES[4] if c.dtensor]
    assert {c.method for c in cases} == {"ring", "ulysses", "allgather", "usp"}
    for case in cases:
        seq_dim = 1 if case.layout == "bshd" else 2
        shape = list(to_layout(make_inputs(case)[0], case.layout).shape)
        for r in world_results(4)[case.id]:
            assert r["kind"] == "DTensor"
            assert r["placements"] == f"(Shard(dim={seq_dim}),)"
            assert list(r["global_shape"]) == shape


# ---- float64: gradcheck through the whole distributed call --------------------------------------------
GRADCHECKS = {
    2: [("ring", None), ("ulysses", None), ("allgather", None), ("usp", (1, 2)), ("usp", (2, 1))],
    4: [("usp", (2, 2))],
}


class ChunkOfReplicated(torch.autograd.Function):
    """The same full tensor on every rank -> this rank's ``torch.chunk`` along the sequence (dim 2); backward
    all-gathers the chunks' gradients: the gradient of a replicated input is the sum of every rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(group.size(), dim=2)[group.rank()].clone()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.group.size())]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=2), None


class GatherChunks(torch.autograd.Function):
    """Every rank's chunk (dim 2) -> the full tensor on every rank; backward: this rank's chunk of the (same on
    every rank) gradient. (DTensor's own redistribute backward does not take gradcheck's undefined gradients.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size(), dim=2)[ctx.group.rank()], None


def gradchecks(variants):
    """``torch.autograd.gradcheck`` of the full sequence's attention computed by cp_attention (causal, GQA,
    float64): every rank holds the same full q, k, v, takes its shard and gathers the output; gradcheck
    perturbs the same elements in the same order on every rank, so every rank makes the same calls."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    group = pm.group("cp")
    g = torch.Generator().manual_seed(3)
    n = group.size()
    q = torch.randn(1, 4, 2 * n, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 2 * n, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    results = []
    for method, usp in variants:
        mesh = init_device_mesh("cpu", usp, mesh_dim_names=USP) if usp else pm

        def attention(q, k, v, method=method, mesh=mesh):
            shards = [ChunkOfReplicated.apply(x, group) for x in (q, k, v)]
            out = cp_attention(*shards, method=method, mesh=mesh, layout="bhsd", causal=True)
            return GatherChunks.apply(out, group)

        results.append(torch.autograd.gradcheck(attention, (q, k, v), atol=1e-8, rtol=1e-6))
    return results


@pytest.mark.slow  # gradcheck runs hundreds of collective forwards: 25 s of the fast lane
@pytest.mark.parametrize("world", sorted(GRADCHECKS))
def test_gradcheck_in_float64(world):
    assert run_distributed(world, gradchecks, GRADCHECKS[world]) == [[True] * len(GRADCHECKS[world])] * world


# ---- errors: raised on every rank, naming the values ---------------------------------------------------
def misuse(pm, kind):
    rank = pm.rank("cp")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 4, 8, generator=g) for _ in range(3))  # 4 tokens per rank
    kwargs = {"layout": "bhsd"}
    if kind == "method":
        kwargs["method"] = "ulysses" if rank == 1 else "ring"
    elif kind == "unknown_method":
        kwargs["method"] = "flash"
    elif kind == "causal":
        kwargs["causal"] = rank == 2
    elif kind == "lengths":
        q, k, v = (x[:, :, :3] if rank == 0 else x for x in (q, k, v))
    elif kind == "dtype":
        q, k, v = (x.to(torch.bfloat16) if rank == 3 else x for x in (q, k, v))
    elif kind == "int_dtype":  # no path computes attention in these dtypes: refused before any data moves
        q, k, v = (x.to(torch.int64) for x in (q, k, v))
    elif kind == "float8_dtype":
        q, k, v = (x.to(torch.float8_e4m3fn) if rank == 0 else x for x in (q, k, v))
    elif kind == "complex_dtype":
        q, k, v = (x.to(torch.complex128) if rank == 1 else x for x in (q, k, v))
    elif kind == "heads":
        q, k, v = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(3))
        kwargs["method"] = "ulysses"
    elif kind == "mask":
        kwargs["key_padding_mask"] = torch.zeros(2, 5 if rank == 1 else 4, dtype=torch.bool)
    elif kind == "mask_presence":
        kwargs["key_padding_mask"] = torch.zeros(2, 4, dtype=torch.bool) if rank == 0 else None
    elif kind == "qkv":
        k = k[:, :, :, :4] if rank == 2 else k
        v = v[:, :, :, :4] if rank == 2 else v
    elif kind == "usp_without_axes":
        kwargs["method"] = "usp"
    elif kind == "dtensor_mesh":
        q, k, v = (sequence_dtensor(x, 2, (2, 4, 16, 8), mesh=pm) for x in (q, k, v))
        kwargs["mesh"] = DeviceMesh("cpu", torch.tensor([3, 2, 1, 0]))  # the same ranks, another order
    elif kind == "no_layout":  # no default: the layout is always said
        del kwargs["layout"]
    elif kind == "unknown_layout":
        kwargs["layout"] = None
    elif kind == "layout":
        kwargs["layout"] = "bshd" if rank == 0 else "bhsd"
    elif kind == "dtensor_layout":  # (B, S, H, D) DTensors sharded on their sequence dim 1, called as bhsd
        q, k, v = (sequence_dtensor(x.transpose(1, 2), 1, (2, 16, 4, 8), mesh=pm) for x in (q, k, v))
    elif kind == "dtensor_layout_one_rank":  # (B, H, S, D) DTensors; rank 2 says bshd
        q, k, v = (sequence_dtensor(x, 2, (2, 4, 16, 8), mesh=pm) for x in (q, k, v))
        kwargs["layout"] = "bshd" if rank == 2 else "bhsd"
    try:
        cp_attention(q, k, v, **kwargs)
    except Exception as exc:
        return exc
    return None


ERRORS = {
    "method": (DisagreementError, ["ranks disagree on method", "rank 1: ulysses", "ranks [0, 2, 3]: ring"]),
    "unknown_method": (ValueError, ["method='flash'", "'ring', 'ulysses', 'usp', 'allgather'"]),
    "causal": (DisagreementError, ["ranks disagree on causal", "rank 2: True"]),
    "lengths": (ShapeMismatchError, ["seq shards inconsistent with the mesh", "[3, 4, 4, 4]", "gives [4, 4, 4, 3]"]),
    "dtype": (ShapeMismatchError, ["ranks disagree on dtype", "rank 3: torch.bfloat16"]),
    "int_dtype": (TypeError, ["one floating dtype of", "torch.float64", "got torch.int64"]),
    "float8_dtype": (TypeError, ["rank 0", "one floating dtype of", "got torch.float8_e4m3fn"]),
    "complex_dtype": (TypeError, ["rank 1", "one floating dtype of", "got torch.complex128"]),
    "heads": (ValueError, ["6 query heads are not divisible by the Ulysses size 4"]),
    "mask": (ValueError, ["rank 1", "key_padding_mask must be bool of shape (B, S_local) = (2, 4)", "(2, 5)"]),
    "mask_presence": (DisagreementError, ["key_padding_mask presence", "rank 0: True"]),
    "qkv": (ValueError, ["rank 2", "must agree on batch, sequence and head dim"]),
    "no_layout": (TypeError, ["missing 1 required keyword-only argument: 'layout'"]),
    "unknown_layout": (ValueError, ["layout=None: use one of ['bhsd', 'bshd']"]),
    "layout": (DisagreementError, ["ranks disagree on layout", "rank 0: bshd", "ranks [1, 2, 3]: bhsd"]),
    "dtensor_layout": (
        ValueError,
        ["layout='bhsd' reads the sequence on dim 2, the DTensor q is sharded on dim 1 (Shard(dim=1),)"],
    ),
    "dtensor_layout_one_rank": (
        ValueError,
        ["rank 2", "layout='bshd' reads the sequence on dim 1, the DTensor q is sharded on dim 2 (Shard(dim=2),)"],
    ),
    "usp_without_axes": (ValueError, ["'cp_ring' and 'cp_ulysses'"]),
    "dtensor_mesh": (ValueError, ["ranks [0, 1, 2, 3]", "cp ranks [3, 2, 1, 0]"]),
}


def test_layout_is_a_required_keyword_naming_its_two_values():
    layout = inspect.signature(cp_attention).parameters["layout"]
    assert layout.kind is inspect.Parameter.KEYWORD_ONLY and layout.default is inspect.Parameter.empty
    assert typing.get_type_hints(cp_attention)["layout"] == typing.Literal["bhsd", "bshd"]


def misuses(kinds):
    """Every kind in one run: a call that raised on every rank before any data moved leaves nothing behind."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=4))
    return [misuse(pm, kind) for kind in kinds]


@pytest.fixture(scope="session")
def misuse_results():
    per_rank = run_distributed(4, misuses, sorted(ERRORS))
    return {kind: [per_rank[r][i] for r in range(4)] for i, kind in enumerate(sorted(ERRORS))}


@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_misuse_raises_on_every_rank(kind, misuse_results):
    error, fragments = ERRORS[kind]
    for rank, exc in enumerate(misuse_results[kind]):
        assert isinstance(exc, error), (rank, exc)
        for fragment in fragments:
            assert fragment in str(exc), (rank, str(exc))


# ---- zigzag ----------------------------------------------------------------------------------------------
def zigzag_round_trips(shapes):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    out = []
    for shape, dim in shapes:
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        local = zigzag_shard(x, dim, mesh=pm)
        with CommDebugMode() as comm:
            full = zigzag_gather(local, dim, mesh=pm, seq_len=shape[dim])
        out.append((local, torch.equal(full, x), comm.get_total_counts()))
    return out


ZIGZAG_SHAPES = [((2, 16, 3), 1), ((2, 13, 3), 1), ((5, 2), 0), ((3, 2, 3), -2), ((2, 4, 29, 8), 2)]


@pytest.mark.parametrize("world", [4, 8])
def test_zigzag_shard_gather_round_trip(world):
    results = run_distributed(world, zigzag_round_trips, ZIGZAG_SHAPES)
    for i, (shape, dim) in enumerate(ZIGZAG_SHAPES):
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        dim = dim % len(shape)
        sizes = zigzag_sizes(shape[dim], world)
        for rank, per in enumerate(results):
            local, exact, collectives = per[i]
            assert torch.equal(local, shard_of(x, dim, world, rank, "zigzag")) and local.shape[dim] == sizes[rank]
            assert exact and collectives == 2  # the agreement + one all-gather


def test_zigzag_sizes_balance_causal_work():
    """Rank r holds chunks r and 2cp-1-r: causal work (keys before each query) is equal across ranks."""
    world, seq = 4, 64
    work = []
    for rank in range(world):
        positions = shard_of(torch.arange(seq), 0, world, rank, "zigzag")
        work.append(int((positions + 1).sum()))
    assert len(set(work)) == 1 and zigzag_sizes(seq, world) == [16] * 4
    assert zigzag_sizes(13, 4) == [2, 3, 4, 4]  # chunks of 13 in 8: [2] * 6 + [1, 0]


# ---- video tokens and the DiT block helper ---------------------------------------------------------------
VIDEO = [("ring", None), ("ulysses", None), ("usp", (2, 2)), ("usp", "axes"), ("allgather", None)]


def video_attentions(variants):
    results = []
    for method, usp in variants:
        results.append(video_attention(method, usp))
        wf_mesh.get_parallel_mesh().destroy()
    return results


def video_attention(method, usp):
    if usp == "axes":  # the ParallelMesh's own cp_ring x cp_ulysses sub-axes
        pm = mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size(), cp_ulysses=2))
    else:
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
        mesh = init_device_mesh("cpu", usp, mesh_dim_names=USP) if usp else pm
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(2, 16, 2, 4, 3, generator=g).requires_grad_()  # (B, C, T, H, W)
    split = wf_mesh.plan_video_split(latent.shape, cp_size=pm.size("cp"))
    torch.manual_seed(2)
    block = CPSelfAttention(16, heads=4, method=method, mesh=mesh)
    tokens = split.shard(latent, mesh=pm)  # (B, T'*H'*W, C)
    out = block(tokens)
    out.square().sum().backward()  # each rank: the loss of its own tokens (their sum is the global loss)
    grads = torch.cat([p.grad.flatten() for p in block.parameters()] + [latent.grad.flatten()])
    dist.all_reduce(grads, group=pm.group("cp"))
    return split.gather(out.detach(), mesh=pm), grads, (split.cp_t, split.cp_h)


def video_reference():
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(2, 16, 2, 4, 3, generator=g).requires_grad_()
    split = wf_mesh.VideoSplit(t=2, h=4, w=3, cp_t=2, cp_h=2)
    torch.manual_seed(2)
    block = CPSelfAttention(16, heads=4)
    tokens = split.to_sequence(latent)
    b, s, c = tokens.shape
    q, k, v = block.qkv(tokens).view(b, s, 3, 4, c // 4).unbind(2)
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    out = block.proj(out.reshape(b, s, c))
    out.square().sum().backward()
    grads = torch.cat([p.grad.flatten() for p in block.parameters()] + [latent.grad.flatten()])
    return split.from_sequence(out.detach()), grads


@pytest.fixture(scope="session")
def video_results():
    per_rank = run_distributed(4, video_attentions, VIDEO)
    return {variant: [per_rank[r][i] for r in range(4)] for i, variant in enumerate(VIDEO)}


@pytest.mark.parametrize("method, usp", VIDEO)
def test_video_split_tokens_through_dit_attention(method, usp, video_results):
    want_video, want_grads = video_reference()
    for video, grads, grid in video_results[method, usp]:
        assert grid == (2, 2)  # the split cuts both time and height: blocks are not contiguous in the latent
        assert torch.allclose(video, want_video, atol=1e-5, rtol=1e-5)
        assert torch.allclose(grads, want_grads, atol=1e-4, rtol=1e-5)


# ---- ranks whose inputs have different memory layouts ---------------------------------------------------
MIXED = [
    Case(2, "ring", 37),
    Case(2, "ring", 37, causal=True),
    Case(4, "ring", 50, kv_heads=2),
    Case(4, "allgather", 50),
]


def mixed_layouts(cases):
    """Each case with even cp ranks passing contiguous (B, H, S, D) shards and odd ranks the same values as
    transposed (B, S, H, D) memory: the ring's blocks must travel in one wire layout whatever each rank holds."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    rank, results = pm.rank("cp"), []
    for case in [c for c in cases if c.world == dist.get_world_size()]:
        q, k, v, dout, _ = make_inputs(case)

        def local(x):
            x = wf_mesh.shard_sequence(x, 2, mesh=pm, as_dtensor=False)
            return (x.contiguous() if rank % 2 == 0 else x.transpose(1, 2).contiguous().transpose(1, 2)).detach()

        leaves = [local(x).requires_grad_() for x in (q, k, v)]
        out = cp_attention(*leaves, method=case.method, mesh=pm, layout="bhsd", causal=case.causal)
        out.backward(local(dout))
        results.append([wf_mesh.gather_sequence(t, 2, mesh=pm) for t in (out.detach(), *(x.grad for x in leaves))])
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_with_different_memory_layouts(world):
    cases = [c for c in MIXED if c.world == world]
    per_rank = run_distributed(world, mixed_layouts, cases)
    for i, case in enumerate(cases):
        want = reference(case)
        for rank in range(world):
            for got, ref, name in zip(per_rank[rank][i], want, ("out", "dq", "dk", "dv")):
                assert close(got, ref, TOL["float32"]), (case.id, rank, name, (got.double() - ref).abs().max())
