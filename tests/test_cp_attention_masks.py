"""cp_attention with a mask plan (``plan_cp_attention(mask=RangeMask...)``) on real gloo clusters, compared with
single-process ``F.scaled_dot_product_attention(attn_mask=mask.dense())``: forward and backward (dq, dk, dv).

Block-causal, packed, packed token-causal, packed block-causal and chunk-window masks; every method (ring,
ulysses, usp 2x2 / 2x4, allgather); work-balanced, contiguous and zigzag layouts; uneven chunks, GQA, a key
padding mask on top; float64 to 1e-10, fp32 to 1e-5 and bf16 to 3e-2 (the tolerances tests/test_cp_attention.py
documents). Every world size runs its whole case list in ONE ``run_distributed`` call (session fixtures).

Skips: the counts of :meth:`CPAttentionPlan.ring_skips` and the P2P messages a ring sends (``c10d_ops``) are
pinned against counts derived here from the dense mask: a block is needed by a ring rank iff some of its
queries see some of its keys; block j travels to the last rank that needs it; its dK/dV travel the same ranks
and from the last one straight back to the owner.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import wf_mesh
from wf_mesh.attention import cp_attention
from wf_mesh.attention_ops import RingSkips, merge_full_pieces, ring_last_steps
from wf_mesh.context_parallel import sequence_dtensor
from wf_mesh.testing import c10d_ops, counting_backend, run_distributed

from helpers import raised_everywhere

USP = ("cp_ring", "cp_ulysses")
TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}

MASKS = {
    "block_causal": lambda: wf_mesh.RangeMask.block_causal([4] * 8),
    "block_causal_uneven": lambda: wf_mesh.RangeMask.block_causal([3, 6, 2, 5, 7, 1, 4, 3]),
    "block_causal_16": lambda: wf_mesh.RangeMask.block_causal([4] * 16),
    "packed": lambda: wf_mesh.RangeMask.packed([7, 12, 5, 9]),
    "packed_causal": lambda: wf_mesh.RangeMask.packed([9, 7, 11, 6], causal=True),
    "packed_block": lambda: wf_mesh.RangeMask.packed([10, 8, 13], causal="block", chunk_size=3),
    "window": lambda: wf_mesh.RangeMask.chunk_window([3, 5, 4, 4, 6, 2, 4, 4], window=1),
}


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    method: str
    mask: str
    balance: str | None = "work"
    usp: tuple[int, int] | None = None
    dtype: str = "float64"
    heads: int = 4
    kv_heads: int = 4
    layout: str = "bhsd"
    pad: bool = False

    @property
    def id(self) -> str:
        method = self.method + (f"{self.usp[0]}x{self.usp[1]}" if self.usp else "")
        parts = [f"cp{self.world}", method, self.mask, str(self.balance), self.dtype, self.layout]
        return "-".join(parts + [f"h{self.heads}kv{self.kv_heads}"] + ["pad"] * self.pad)


def methods(world):
    return [("ring", None), ("ulysses", None), ("allgather", None), ("usp", (2, world // 2))]


def cases_for(world):
    heads = max(4, world)
    out = []
    for method, usp in methods(world):
        base = {"world": world, "method": method, "usp": usp, "heads": heads, "kv_heads": heads}
        if world == 8:
            out += [Case(mask="block_causal", **base), Case(mask="packed_causal", **{**base, "kv_heads": 2})]
            continue
        out += [
            Case(mask="block_causal", **base),
            Case(mask="block_causal_uneven", layout="bshd", **{**base, "kv_heads": heads // 2}),
            Case(mask="packed", balance=None, **base),
            Case(mask="packed_causal", pad=True, **{**base, "kv_heads": 1}),
            Case(mask="packed_block", balance="zigzag", **base),
            Case(mask="window", dtype="float32", **base),
            Case(mask="block_causal", dtype="bfloat16", layout="bshd", **base),
        ]
    if world == 4:
        out.append(Case(world=4, method="ring", mask="block_causal_16", balance=None))
        out.append(Case(world=4, method="ring", mask="window", balance=None, pad=True))
    return out


CASES = {w: cases_for(w) for w in (2, 4, 8)}


def make_inputs(case):
    """Global q, k, v, dout (B, H, S, D) and a key padding mask (B, S), the same on every process."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    seq, dtype = MASKS[case.mask]().seq_len, getattr(torch, case.dtype)

    def sample(h):
        return torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64).to(dtype)

    q, k, v, dout = sample(case.heads), sample(case.kv_heads), sample(case.kv_heads), sample(case.heads)
    pad = None
    if case.pad:
        pad = torch.rand(2, seq, generator=g) < 0.3
        pad[:, list(MASKS[case.mask]().boundaries()[:-1])] = False  # every query sees its chunk's first key
    return q, k, v, dout, pad


def to_layout(x, layout):
    return x.transpose(1, 2).contiguous() if layout == "bshd" else x


def c10d_counter():
    counts = collections.Counter()
    return counts, c10d_ops(lambda name, args: counts.update([name]))


# ---- distributed runs ----------------------------------------------------------------------------------
def run_case(case, pm, usp_meshes):
    mask = MASKS[case.mask]()
    mesh = usp_meshes[case.usp] if case.method == "usp" else pm
    plan = wf_mesh.plan_cp_attention(mask=mask, mesh=mesh, balance=case.balance)
    seq_dim = 1 if case.layout == "bshd" else 2
    q, k, v, dout, pad = make_inputs(case)
    leaves = [plan.shard(to_layout(x, case.layout), seq_dim).clone().requires_grad_() for x in (q, k, v)]
    local_pad = None if pad is None else plan.shard(pad, 1)
    fwd, counting = c10d_counter()
    with counting:
        out = cp_attention(*leaves, method=case.method, layout=case.layout, key_padding_mask=local_pad, plan=plan)
    bwd, counting = c10d_counter()
    with counting:
        out.backward(plan.shard(to_layout(dout, case.layout), seq_dim))
    grads = [x.grad for x in leaves]
    result = {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2], "fwd": dict(fwd), "bwd": dict(bwd)}
    return {**result, "segments": plan.segments}


def run_world(cases):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    splits = sorted({c.usp for c in cases if c.usp})
    usp_meshes = {s: init_device_mesh("cpu", s, mesh_dim_names=USP) for s in splits}
    return [run_case(case, pm, usp_meshes) for case in cases]


@pytest.fixture(scope="session")
def mask_results():
    cache = {}

    def get(world):
        if world not in cache:
            per_rank = run_distributed(world, run_world, CASES[world])
            cache[world] = {c.id: [per_rank[r][i] for r in range(world)] for i, c in enumerate(CASES[world])}
        return cache[world]

    return get


# ---- the reference: single-process SDPA with the dense mask -------------------------------------------
def reference(case):
    q, k, v, dout, pad = make_inputs(case)
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    dense = MASKS[case.mask]().dense()[None, None]
    if pad is not None:
        dense = dense & ~pad[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    out.backward(dout.double())
    return [x.detach() for x in (out, q.grad, k.grad, v.grad)]


def shard(x, dim, segments):
    return torch.cat([x.narrow(dim, a, b - a) for a, b in segments], dim)


def check_case(case, results):
    ranks = results(case.world)[case.id]
    seq_dim = 1 if case.layout == "bshd" else 2
    tol = TOL[case.dtype]
    for name, want in zip(("out", "dq", "dk", "dv"), reference(case)):
        want = to_layout(want, case.layout)
        for rank, r in enumerate(ranks):
            expected = shard(want, seq_dim, r["segments"][rank])
            got = r[name]
            assert got.dtype == getattr(torch, case.dtype) and got.shape == expected.shape, (name, rank)
            assert torch.allclose(got.double(), expected, atol=tol, rtol=tol), (name, rank)


FAST = [c for c in CASES[2] + CASES[4] if c.world == 2 or (c.dtype == "float64" and c.mask != "packed_block")]
SLOW = [c for c in CASES[2] + CASES[4] + CASES[8] if c not in FAST]


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.id)
def test_matches_single_process_sdpa_with_the_dense_mask(case, mask_results):
    check_case(case, mask_results)


@pytest.mark.slow  # cp 8 (8 processes) and the rest of the cp 4 matrix
@pytest.mark.parametrize("case", SLOW, ids=lambda c: c.id)
def test_matches_single_process_sdpa_with_the_dense_mask_more(case, mask_results):
    check_case(case, mask_results)


# ---- what is skipped ------------------------------------------------------------------------------------
def needs_of(case, segments):
    """``needs[i][j]`` from the dense mask: ring rank i's queries see some key of block j."""
    dense = MASKS[case.mask]().dense()
    ring = {"ring": case.world, "usp": case.usp[0] if case.usp else 1}.get(case.method, 1)
    u = case.world // ring
    blocks = [[p for r in range(i * u, (i + 1) * u) for a, b in segments[r] for p in range(a, b)] for i in range(ring)]
    return [
        [bool(blocks[i]) and bool(blocks[j]) and bool(dense[blocks[i]][:, blocks[j]].any()) for j in range(ring)]
        for i in range(ring)
    ]


def expected_p2p(case, rank, segments):
    """(forward sends, forward recvs, backward sends, backward recvs) of one rank's ring from the dense mask."""
    needs = needs_of(case, segments)
    n = len(needs)
    u = case.world // n
    i = rank // u
    last = [max((t for t in range(n) if needs[(j + t) % n][j]), default=0) for j in range(n)]
    kv = 2 + case.pad
    steps = {j: (i - j) % n for j in range(n)}  # the step at which block j is at this rank
    fs = kv * sum(1 for j in range(n) if steps[j] < last[j])
    fr = kv * sum(1 for j in range(n) if 1 <= steps[j] <= last[j])
    ds = 2 * sum(1 for j in range(n) if last[j] and steps[j] <= last[j])
    dr = 2 * (sum(1 for j in range(n) if 1 <= steps[j] <= last[j]) + bool(last[i]))
    return fs, fr, fs + ds, fr + dr


@pytest.mark.parametrize("case", [c for c in FAST if c.method in ("ring", "usp")], ids=lambda c: c.id)
def test_ring_sends_only_the_hops_the_mask_needs(case, mask_results):
    for rank, r in enumerate(mask_results(case.world)[case.id]):
        fs, fr, bs, br = expected_p2p(case, rank, r["segments"])
        a2a = case.method == "usp" and case.usp[1] > 1
        uly = {"alltoall_base_": 4 + case.pad} if a2a else {}
        assert r["fwd"] == {k: v for k, v in {**uly, "send": fs, "recv_": fr}.items() if v}, rank
        uly = {"alltoall_base_": 4} if a2a else {}
        assert r["bwd"] == {k: v for k, v in {**uly, "send": bs, "recv_": br}.items() if v}, rank


def ring_skips_of(world, mask, balance, ring_size):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=world))
    plan = wf_mesh.plan_cp_attention(mask=mask, mesh=pm, balance=balance)
    return plan.ring_skips(ring_size), plan.imbalance


def test_sixteen_block_causal_chunks_at_cp4_contiguous_skip_6_blocks_6_hops_7_dkv_messages(mask_results):
    skips = run_distributed(4, ring_skips_of, 4, MASKS["block_causal_16"](), None, None)
    assert {s for s, _ in skips} == {RingSkips(16, 6, 12, 6, 16, 7)}
    # the run agrees: sends summed over the ranks are the hops and messages not skipped
    case = Case(world=4, method="ring", mask="block_causal_16", balance=None)
    ranks = mask_results(4)[case.id]
    assert sum(r["fwd"].get("send", 0) for r in ranks) == 2 * (12 - 6)  # k and v per hop
    assert sum(r["bwd"].get("send", 0) for r in ranks) == 2 * (12 - 6) + 2 * (16 - 7)  # + dK and dV per message
    # the balanced plan of the same mask spreads the blocks: imbalance 1.0 but fewer blocks to skip
    (balanced, imbalance), *_ = run_distributed(4, ring_skips_of, 4, MASKS["block_causal_16"](), "work", None)
    assert imbalance == 1.0 and balanced.blocks == 16


def test_pure_helpers():
    assert ring_last_steps([[True, False], [True, True]]) == (1, 0)
    assert ring_last_steps([[True, True, False], [False, True, False], [True, False, True]]) == (2, 2, 0)
    assert RingSkips.of([[True, False], [True, True]]) == RingSkips(4, 1, 2, 1, 4, 2)
    # two full pieces on the same columns with touching rows, then the same rows: one rectangle
    assert merge_full_pieces([(0, 2, 0, 3, False), (2, 4, 0, 3, False), (0, 4, 3, 5, False)]) == [(0, 4, 0, 5, False)]
    assert merge_full_pieces([(0, 2, 0, 2, True), (2, 4, 0, 2, False)]) == [(0, 2, 0, 2, True), (2, 4, 0, 2, False)]
    assert merge_full_pieces([(0, 2, 0, 2, False), (2, 4, 2, 4, False)]) == [(0, 2, 0, 2, False), (2, 4, 2, 4, False)]


# ---- errors: on every rank --------------------------------------------------------------------------------
def misuse(kind):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    mask = wf_mesh.RangeMask.block_causal([4] * 4)
    try:
        plan = wf_mesh.plan_cp_attention(mask=mask, mesh=pm)
        q = torch.randn(1, 2, plan.local_len, 8)
        if kind == "causal":
            cp_attention(q, q, q, layout="bhsd", plan=plan, causal=True)
        elif kind == "dtensor_work":
            x = sequence_dtensor(torch.randn(1, 2, 8, 8), 2, (1, 2, 16, 8), mesh=pm)
            cp_attention(x, x, x, layout="bhsd", plan=plan)
        elif kind == "ring_size":
            plan.ring_skips(3)
    except Exception as exc:
        return exc
    return None


ERRORS = {
    "causal": (ValueError, r"causal=True with a mask plan \(plan_cp_attention\(mask=RangeMask\(\[.*pass causal=False"),
    "dtensor_work": (ValueError, r"DTensor inputs are torch.chunk shards .* a work-balanced plan's shards are not"),
    "ring_size": (ValueError, r"ring_size=3 does not divide the cp size 2"),
}


@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_misuse_raises_on_every_rank(kind):
    raised_everywhere(run_distributed(2, misuse, kind), *ERRORS[kind])


# ---- the compiled path ----------------------------------------------------------------------------------
def compiled_vs_eager(methods):
    """Per method, max |compiled - eager| over out, dq, dk, dv for 2 steps (a new, equal plan each), and the
    graphs compiled (one per method: the second step reuses it)."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    mask = MASKS["packed_causal"]()
    results = {}
    for method in methods:

        def block(q, k, v, pad, plan, method=method):
            return cp_attention(q * 2, k, v, method=method, layout="bhsd", key_padding_mask=pad, plan=plan).sin()

        backend, compiles = counting_backend()
        compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False)
        diffs = []
        for step in range(2):
            plan = wf_mesh.plan_cp_attention(mask=mask, mesh=pm)
            g = torch.Generator().manual_seed(step)
            full = [torch.randn(1, 4, mask.seq_len, 8, generator=g, dtype=torch.float64) for _ in range(4)]
            pad = plan.shard(torch.rand(1, mask.seq_len, generator=g) < 0.2, 1)
            runs = []
            for fn in (block, compiled):
                leaves = [plan.shard(x, 2).clone().requires_grad_() for x in full[:3]]
                out = fn(*leaves, pad, plan)
                out.backward(plan.shard(full[3], 2))
                runs.append([out.detach(), *(x.grad for x in leaves)])
            diffs.append(max((a - b).abs().max().item() for a, b in zip(*runs)))
        results[method] = (max(diffs), len(compiles))
    return results


@pytest.mark.slow  # dynamo + AOTAutograd on 2 processes: ~13 s
def test_compiled_path_takes_mask_plans():
    for result in run_distributed(2, compiled_vs_eager, ["ring", "allgather"]):
        assert result == {"ring": (pytest.approx(0, abs=1e-12), 1), "allgather": (pytest.approx(0, abs=1e-12), 1)}
