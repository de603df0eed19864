"""One CP-attention plan per step (wf_mesh.attention_plan): with ``plan=`` (or DTensor inputs and checks off)
cp_attention issues its data collectives only, no agreement exchange and no host sync; the results equal the
planless call; what contradicts the plan raises naming both.

Counts: ``c10d_counter`` (every c10d op, P2P included) and CommDebugMode; host syncs:
``wf_mesh.testing.host_syncs`` (``aten._local_scalar_dense`` and device-to-host copies; ``.tolist()`` is not
dispatched, but the agreement's all-gather in front of it is counted).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import wf_mesh
from wf_mesh import agreement
from wf_mesh.attention import CPSelfAttention, cp_attention, zigzag_shard
from wf_mesh.context_parallel import sequence_dtensor
from wf_mesh.errors import DisagreementError, ShapeMismatchError
from wf_mesh.testing import c10d_ops, host_syncs, run_distributed

from helpers import raised_everywhere, sample

METHODS = ("ring", "ulysses", "usp", "allgather")


def counted(fn):
    """``(result, c10d op counts, CommDebugMode total, host syncs)`` of ``fn()``."""
    ops, syncs = collections.Counter(), collections.Counter()
    with (
        CommDebugMode() as comm,
        c10d_ops(lambda name, args: ops.update([name])),
        host_syncs(lambda what: syncs.update([what])),
    ):
        out = fn()
    return out, dict(ops), comm.get_total_counts(), dict(syncs)


def _meshes(world):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=world))
    usp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp_ring", "cp_ulysses"))
    return pm, usp


def plan_runs(seq, causal, balance, checks):
    """Per method: the planless and the planned call's outputs and grads, and each one's counts."""
    world = dist.get_world_size()
    agreement.set_checks(checks)
    try:
        pm, usp = _meshes(world)
        g = [sample((2, 4, seq, 8), seed=i) for i in range(4)]
        shard = (
            (lambda x: zigzag_shard(x, 2, mesh=pm))
            if balance
            else (lambda x: wf_mesh.shard_sequence(x, 2, mesh=pm, as_dtensor=False))
        )
        results = {}
        for method in METHODS:
            mesh = usp if method == "usp" else pm
            plan = wf_mesh.plan_cp_attention(seq_len=seq, mesh=mesh, balance=balance)
            per = {}
            for planned in (False, True):
                q, k, v = (shard(x).clone().requires_grad_() for x in g[:3])
                kwargs = dict(method=method, mesh=mesh, layout="bhsd", causal=causal, balance=balance)
                if planned:
                    kwargs["plan"] = plan
                out, fwd, comm_fwd, sync_fwd = counted(lambda: cp_attention(q, k, v, **kwargs))
                _, bwd, comm_bwd, sync_bwd = counted(lambda: out.backward(shard(g[3])))
                per[planned] = dict(
                    out=out.detach(),
                    grads=[x.grad for x in (q, k, v)],
                    fwd=fwd,
                    bwd=bwd,
                    comm=(comm_fwd, comm_bwd),
                    syncs=(sync_fwd, sync_bwd),
                )
            results[method] = per
        return results
    finally:
        agreement.set_checks(None)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("checks", [True, False], ids=["checks_on", "checks_off"])
def test_a_plan_leaves_only_the_data_collectives(world, checks):
    seq, causal, balance = (13, True, "zigzag") if world == 4 else (9, False, None)
    per_rank = run_distributed(world, plan_runs, seq, causal, balance, checks)
    for rank, results in enumerate(per_rank):
        for method, per in results.items():
            planless, planned = per[False], per[True]
            assert torch.equal(planned["out"], planless["out"]), (rank, method)
            for a, b in zip(planned["grads"], planless["grads"]):
                assert torch.equal(a, b), (rank, method)
            # the planless call runs its agreement (one all-gather); the planned one does not
            assert planless["fwd"].get("_allgather_base_", 0) == 1 + (method == "allgather")
            fwd, bwd = collections.Counter(planned["fwd"]), collections.Counter(planned["bwd"])
            if method == "ring":
                assert set(fwd) <= {"send", "recv_"} and fwd["send"] > 0, (rank, fwd)
                assert set(bwd) <= {"send", "recv_"} and bwd["send"] > 0, (rank, bwd)
            elif method == "ulysses":
                assert fwd == {"alltoall_base_": 4} and bwd == {"alltoall_base_": 4}, (rank, fwd, bwd)
            elif method == "usp":  # (2, world // 2): at cp 2 a ring of two with Ulysses of one
                a2a = {"alltoall_base_"} if world > 2 else set()
                assert set(fwd) == a2a | {"send", "recv_"} and fwd["alltoall_base_"] == 4 * bool(a2a), fwd
                assert set(bwd) == a2a | {"send", "recv_"} and bwd["alltoall_base_"] == 4 * bool(a2a), bwd
            else:
                assert fwd == {"_allgather_base_": 1} and bwd == {"_reduce_scatter_base_": 1}, (rank, fwd, bwd)
            assert planned["comm"] == (
                sum(v for n, v in fwd.items() if n not in ("send", "recv_")),
                sum(v for n, v in bwd.items() if n not in ("send", "recv_")),
            )
            assert planned["syncs"] == ({}, {}), (rank, method, planned["syncs"])


def dtensor_runs(checks):
    """ring and ulysses on DTensor inputs without a plan: counts, and the output against the planless one."""
    world = dist.get_world_size()
    agreement.set_checks(checks)
    try:
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=world))
        g = [sample((2, 9, 4, 8), seed=i) for i in range(3)]  # bshd, 9 tokens: uneven shards
        out = {}
        for method in ("ring", "ulysses", "allgather"):
            local = [wf_mesh.shard_sequence(x, 1, mesh=pm, as_dtensor=False) for x in g]
            want = cp_attention(*local, method=method, mesh=pm, layout="bshd")
            dts = [sequence_dtensor(x, 1, tuple(y.shape), mesh=pm) for x, y in zip(local, g)]
            got, fwd, _, syncs = counted(lambda: cp_attention(*dts, method=method, layout="bshd"))
            out[method] = (torch.equal(got.to_local(), want), fwd, syncs)
        return out
    finally:
        agreement.set_checks(None)


@pytest.mark.parametrize("checks", [True, False], ids=["checks_on", "checks_off"])
def test_dtensor_inputs_need_no_plan(checks):
    data = {"ring": {"send", "recv_"}, "ulysses": {"alltoall_base_"}, "allgather": {"_allgather_base_"}}
    for rank, results in enumerate(run_distributed(2, dtensor_runs, checks)):
        for method, (equal, fwd, syncs) in results.items():
            assert equal, (rank, method)
            agreement_gathers = fwd.get("_allgather_base_", 0) - (method == "allgather")
            assert agreement_gathers == (1 if checks else 0), (rank, method, fwd)
            assert set(fwd) == data[method] | ({"_allgather_base_"} if checks else set()), (rank, method, fwd)
            assert syncs == {}, (rank, method, syncs)


def module_and_video_runs():
    """CPSelfAttention with and without the VideoSplit's plan: the same output; the plan's counts."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    split = wf_mesh.plan_video_split((1, 8, 4, 4, 2), cp_size=2)
    plan, _, _, _ = counted(lambda: split.attention_plan(mesh=pm))
    torch.manual_seed(0)
    attn = CPSelfAttention(8, heads=2, method="ulysses", mesh=pm)
    tokens = split.shard(sample((1, 8, 4, 4, 2)), mesh=pm)
    want = attn(tokens)
    got, ops, _, syncs = counted(lambda: attn(tokens, plan=plan))
    return plan.lengths, plan.seq_len, torch.equal(got, want), ops, syncs


def test_video_split_hands_out_the_plan_of_its_token_order():
    for lengths, seq_len, equal, ops, syncs in run_distributed(2, module_and_video_runs):
        assert (lengths, seq_len) == ((16, 16), 32)
        assert equal and ops == {"alltoall_base_": 4} and syncs == {}


def plan_misuse(kind):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    rank = pm.rank("cp")
    q = sample((1, 2, 4, 8))
    try:
        if kind == "seq_len":
            wf_mesh.plan_cp_attention(seq_len=8 if rank == 0 else 9, mesh=pm)
        elif kind == "balance":
            wf_mesh.plan_cp_attention(seq_len=8, mesh=pm, balance="zigzag" if rank == 1 else None)
        elif kind == "bad_seq_len":
            wf_mesh.plan_cp_attention(seq_len=0, mesh=pm)
        elif kind == "local_len":  # every rank passes 4 tokens of a planned 10-token sequence
            plan = wf_mesh.plan_cp_attention(seq_len=10, mesh=pm)
            cp_attention(q, q, q, layout="bhsd", plan=plan)
        elif kind == "plan_balance":
            plan = wf_mesh.plan_cp_attention(seq_len=8, mesh=pm)
            cp_attention(q, q, q, layout="bhsd", plan=plan, balance="zigzag")
        elif kind == "usp_without_axes":
            plan = wf_mesh.plan_cp_attention(seq_len=8, mesh=pm)
            cp_attention(q, q, q, layout="bhsd", method="usp", plan=plan)
        elif kind == "not_a_plan":
            cp_attention(q, q, q, layout="bhsd", plan=(4, 4))
    except Exception as exc:
        return exc
    return None


PLAN_ERRORS = {
    "seq_len": (DisagreementError, r"plan_cp_attention: ranks disagree on seq_len \(rank 0: 8; rank 1: 9\)"),
    "balance": (DisagreementError, r"ranks disagree on balance \(rank 0: None; rank 1: zigzag\)"),
    "bad_seq_len": (ValueError, r"seq_len"),
    "local_len": (ShapeMismatchError, r"holds 4 tokens but the plan gives cp rank \d 5 \(seq_len=10"),
    "plan_balance": (ValueError, r"balance='zigzag' contradicts the plan's balance None"),
    "usp_without_axes": (ValueError, r"method='usp' with a plan built on a mesh without 'cp_ring'"),
    "not_a_plan": (TypeError, r"plan must be a CPAttentionPlan .* got tuple"),
}


@pytest.mark.parametrize("kind", sorted(PLAN_ERRORS))
def test_plan_misuse_raises_on_every_rank(kind):
    error, match = PLAN_ERRORS[kind]
    raised_everywhere(run_distributed(2, plan_misuse, kind), error, match)


@pytest.mark.slow  # the whole benchmark, quick: ~45 s of 2-4 processes
def test_the_benchmark_reports_the_plan_rows(tmp_path):
    out = tmp_path / "cp.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cp_attention.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["measurement"]: r for r in json.loads(out.read_text())["rows"]}
    for method, collectives in {"ring": 0, "ulysses": 8, "usp": 8, "allgather": 2}.items():
        assert rows[f"cp 4: {method} with a plan: host syncs per layer per step"]["ratio"] == 0
        assert rows[f"cp 4: {method} with a plan: collectives per layer per step"]["ratio"] == collectives
        assert rows[f"cp 4: {method} compiled: graphs over 3 steps (a new plan each)"]["ratio"] == 1
        assert rows[f"cp 4: {method}: peak bytes of one fwd+bwd at 2 S_local / at S_local"]["ratio"] < 3
    for n in (2, 4):  # what contain_faults=True adds: its two closes, timed alone, and their latency floor
        for mode in ("full", "causal"):
            closes = rows[f"cp {n} {mode}: contain_faults=True's two closing exchanges / ring fwd+bwd time"]
            assert (closes["target"], closes["meets"]) == ("<= 0.02", "not judged") and 0 < closes["ratio"] < 1
            assert f"cp {n} {mode}: a closing exchange / a bare one-word all-reduce (the backend's latency)" in rows
            assert f"cp {n} {mode}: a closing exchange / an agreement exchange (ROW-word all-gather)" in rows


# ---- plans with a mask (issue 19 item 2) ------------------------------------------------------------------
PLAN_MASKS = {
    "block_causal": lambda: wf_mesh.RangeMask.block_causal([4] * 16),
    "packed": lambda: wf_mesh.RangeMask.packed([23, 5, 14, 22], causal="block", chunk_size=4),
    "windowed": lambda: wf_mesh.RangeMask.chunk_window([3, 5, 4, 6, 2, 5, 7, 4, 3, 5, 6, 4], 3),
}


def mask_plan_runs(name):
    """This rank's view of the balanced and the contiguous plan of a mask, and a shard + gather round trip
    (values and the gradient reaching the global input)."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    mask = PLAN_MASKS[name]()
    plan = wf_mesh.plan_cp_attention(mask=mask, mesh=pm)
    contiguous = wf_mesh.plan_cp_attention(mask=mask, mesh=pm, balance=None)
    x = sample((2, mask.seq_len, 3), seed=1, dtype=torch.float64).requires_grad_()
    local = plan.shard(x, 1)
    y = plan.gather(local * (1 + plan.rank), 1)  # each rank scales its own tokens: the gather must place them
    y.backward(sample(y.shape, seed=2, dtype=torch.float64))
    return dict(
        balance=plan.balance,
        segments=plan.segments,
        lengths=plan.lengths,
        work=plan.work,
        imbalance=plan.imbalance,
        contiguous=(contiguous.segments, contiguous.imbalance),
        local=local.detach(),
        y=y.detach(),
        grad=x.grad,
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(PLAN_MASKS))
def test_a_mask_plan_balances_work_and_round_trips_exactly(name, world):
    mask = PLAN_MASKS[name]()
    x, g = (
        sample((2, mask.seq_len, 3), seed=1, dtype=torch.float64),
        sample((2, mask.seq_len, 3), seed=2, dtype=torch.float64),
    )
    results = run_distributed(world, mask_plan_runs, name)
    segments = results[0]["segments"]
    scale = torch.ones(mask.seq_len, dtype=torch.float64)
    for rank, segs in enumerate(segments):
        for a, b in segs:
            scale[a:b] = 1 + rank
    for rank, r in enumerate(results):
        assert r["balance"] == "work" and r["segments"] == segments, rank  # one plan on every rank
        assert r["lengths"] == tuple(sum(b - a for a, b in s) for s in segments)
        assert r["work"] == tuple(mask.count(list(s), (0, mask.seq_len)) for s in segments)
        # within 10% of the mean; contiguous shards when they are already (then the plan is them)
        assert r["imbalance"] <= min(1.10, r["contiguous"][1]), (rank, r["imbalance"], r["contiguous"])
        if r["contiguous"][1] <= 1.10:
            assert segments == r["contiguous"][0]
        want_local = torch.cat([x[:, a:b] for a, b in segments[rank]], 1)
        assert torch.equal(r["local"], want_local)  # plan order: increasing global position
        assert torch.equal(r["y"], x * scale[None, :, None])  # the global order, exactly
        mine = torch.zeros(mask.seq_len, dtype=torch.float64)
        for a, b in segments[rank]:
            mine[a:b] = 1 + rank
        assert torch.equal(r["grad"], g * mine[None, :, None])  # replicate: this rank's tokens' gradient


def contiguous_block_causal_imbalance():
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=4))
    mask = wf_mesh.RangeMask.block_causal([4] * 16)
    plans = [wf_mesh.plan_cp_attention(mask=mask, mesh=pm, balance=b) for b in (None, "zigzag", "work")]
    return [(p.segments[p.rank], p.imbalance) for p in plans]


def test_contiguous_shards_of_sixteen_block_causal_chunks_at_cp4_are_1_71_and_the_plan_1_0():
    for rank, (contiguous, zigzag, work) in enumerate(run_distributed(4, contiguous_block_causal_imbalance)):
        assert contiguous == (((16 * rank, 16 * rank + 16),), pytest.approx(58 / 34))
        assert round(contiguous[1], 2) == 1.71
        assert zigzag[1] == 1.0 and len(zigzag[0]) == (1 if rank == 3 else 2)  # rank 3: chunks 3, 4 touch
        assert work[1] == 1.0 and all(a % 4 == 0 and b % 4 == 0 for a, b in work[0])  # whole chunks


def mask_plan_misuse(kind):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    rank = pm.rank("cp")
    bc = wf_mesh.RangeMask.block_causal([4] * 4)
    try:
        if kind == "different_masks":
            wf_mesh.plan_cp_attention(mask=bc if rank == 0 else wf_mesh.RangeMask.packed([8, 8]), mesh=pm)
        elif kind == "different_balance":
            wf_mesh.plan_cp_attention(mask=bc, mesh=pm, balance="work" if rank == 0 else None)
        elif kind == "seq_len_contradicts_mask":
            wf_mesh.plan_cp_attention(seq_len=15, mask=bc, mesh=pm)
        elif kind == "not_a_mask":
            wf_mesh.plan_cp_attention(mask=bc.dense(), mesh=pm)
        elif kind == "work_without_mask":
            wf_mesh.plan_cp_attention(seq_len=8, mesh=pm, balance="work")
        elif kind == "neither":
            wf_mesh.plan_cp_attention(mesh=pm)
        elif kind == "gather_wrong_length":  # rank 1 passes one token too many
            plan = wf_mesh.plan_cp_attention(mask=wf_mesh.RangeMask.block_causal([2, 2, 2, 2, 8]), mesh=pm)
            plan.gather(sample((1, plan.local_len + rank, 3)), 1)
        elif kind == "shard_wrong_length":
            plan = wf_mesh.plan_cp_attention(mask=bc, mesh=pm)
            plan.shard(sample((1, 15, 3)), 1)
    except Exception as exc:
        return exc
    return None


MASK_PLAN_ERRORS = {
    "different_masks": (
        DisagreementError,
        r"plan_cp_attention: ranks disagree on mask \(pieces, digest\) \(rank 0: \(4, \d+\); rank 1: \(2, \d+\)\)",
    ),
    "different_balance": (DisagreementError, r"ranks disagree on balance \(rank 0: work; rank 1: None\)"),
    "seq_len_contradicts_mask": (ValueError, r"seq_len=15 contradicts the mask's seq_len 16"),
    "not_a_mask": (TypeError, r"mask must be a wf_mesh.RangeMask, got Tensor"),
    "work_without_mask": (
        ValueError,
        r"balance='work': use None or 'zigzag' \(balance='work' balances a mask: pass mask=\)",
    ),
    "neither": (TypeError, r"plan_cp_attention needs seq_len or mask"),
    "gather_wrong_length": (ShapeMismatchError, r"plan.gather: .*shard lengths \[\d+, \d+\]\): gather_sequence"),
    "shard_wrong_length": (ShapeMismatchError, r"plan.shard: x holds 15 tokens along dim 1, the plan's seq_len is 16"),
}


@pytest.mark.parametrize("kind", sorted(MASK_PLAN_ERRORS))
def test_mask_plan_misuse_raises_on_every_rank(kind):
    error, match = MASK_PLAN_ERRORS[kind]
    raised_everywhere(run_distributed(2, mask_plan_misuse, kind), error, match)
