"""Fault containment (wf_mesh.faults) on real gloo clusters: one rank's local step raises part-way through a
sequence of collectives, the exception is caught by the caller on every rank (as a server or a notebook
would), and then

- every rank raised the failing rank's exception type, naming that rank, where it failed and its error;
- no rank waited long (a generous hang bound, not a timing assertion);
- the next call on the same mesh is exact (nothing was left unmatched on the group), and so is a mesh built
  again on the same processes.

The failure is injected by wrapping wf_mesh's own block step (``attention_ops._forward_block`` /
``_backward_block``) on the failing rank: the n-th call raises ``MemoryError``, as an allocation in the block
kernel would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import wf_mesh
from wf_mesh import attention_ops
from wf_mesh.testing import run_distributed

HANG_BOUND_S = 60.0
"""How long a contained failure may take on every rank: far above the ~0.1 s it takes, far below a timeout."""


@dataclasses.dataclass(frozen=True)
class Fault:
    method: str
    phase: str  # "forward" or "backward"
    step: int  # the block step (1-based) at which the failing rank raises
    rank: int = 1

    @property
    def id(self) -> str:
        return f"{self.method}-{self.phase}-step{self.step}-rank{self.rank}"


def steps(method: str, world: int) -> int:
    """Block steps of one call: the ring's size (a ring of one for ulysses and allgather; usp: ring of 2)."""
    return {"ring": world, "usp": world // 2, "ulysses": 1, "allgather": 1}[method]


def faults(world: int) -> list[Fault]:
    methods = ["ring", "ulysses", "allgather"] + (["usp"] if world == 4 else [])
    out = []
    for method in methods:
        n = steps(method, world)
        for phase in ("forward", "backward"):
            for step in sorted({1, (n + 1) // 2, n}):
                out.append(Fault(method, phase, step))
    return out


@contextlib.contextmanager
def failing_step(fault: Fault):
    """On the failing rank, the ``fault.step``-th block step of ``fault.phase`` raises MemoryError."""
    name = "_forward_block" if fault.phase == "forward" else "_backward_block"
    real = getattr(attention_ops, name)
    calls = [0]

    def step(*args):
        calls[0] += 1
        if dist.get_rank() == fault.rank and calls[0] == fault.step:
            raise MemoryError(f"injected at {fault.phase} step {fault.step}")
        return real(*args)

    setattr(attention_ops, name, step)
    try:
        yield
    finally:
        setattr(attention_ops, name, real)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, 4, 13, 8, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, dout


def reference(q, k, v, dout):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout)
    return out.detach(), *(x.grad for x in leaves)


def attention_call(pm, method: str, seed: int = 0):
    """One causal fp64 cp_attention call, forward and backward: ``(max error vs one process,)``."""
    q, k, v, dout = inputs(seed)
    ref = reference(q, k, v, dout)
    plan = wf_mesh.plan_cp_attention(q.shape[2], mesh=pm)
    leaves = [plan.shard(x, 2).clone().requires_grad_() for x in (q, k, v)]
    out = wf_mesh.cp_attention(*leaves, method=method, layout="bhsd", causal=True, plan=plan)
    out.backward(plan.shard(dout, 2))
    got = [out.detach(), *(x.grad for x in leaves)]
    return max((g - plan.shard(r, 2)).abs().max().item() for g, r in zip(got, ref))


def contained_failures(cases: list[Fault]):
    """Each case: the failing call (caught), then the same call exact; finally a mesh built again."""
    world = dist.get_world_size()
    dims = wf_mesh.ParallelDims(cp=world, cp_ulysses=2) if world == 4 else wf_mesh.ParallelDims(cp=world)
    pm = wf_mesh.init_parallel(dims, contain_faults=True)
    results = {}
    for fault in cases:
        start = time.monotonic()
        try:
            with failing_step(fault):
                attention_call(pm, fault.method)
            caught = None
        except Exception as exc:  # the caller catches whatever the call raised
            caught = exc
        took = time.monotonic() - start
        results[fault.id] = {
            "type": type(caught).__name__,
            "message": str(caught),
            "took": took,
            "next_error": attention_call(pm, fault.method, seed=1),
        }
    pm.destroy()
    pm = wf_mesh.init_parallel(dims, contain_faults=True)
    results["rebuilt_error"] = attention_call(pm, "ring", seed=2)
    pm.destroy()
    return results


@pytest.fixture(scope="module", params=[2, 4])
def outcomes(request):
    world = request.param
    return world, run_distributed(world, contained_failures, faults(world))


def test_a_failing_block_step_raises_on_every_rank_and_the_next_call_is_exact(outcomes):
    world, per_rank = outcomes
    for fault in faults(world):
        n = steps(fault.method, world)
        where = ("ring" if fault.method in ("ring", "usp") else "local attention") + (
            " backward" if fault.phase == "backward" else ""
        )
        where += " hop" if fault.method in ("ring", "usp") else ""
        for rank, results in enumerate(per_rank):
            got = results[fault.id]
            assert got["type"] == "MemoryError", (fault.id, rank, got)
            expected = (
                f"rank {fault.rank}: failed at {where} {fault.step} of {n}: MemoryError: injected at "
                f"{fault.phase} step {fault.step}"
            )
            assert expected in got["message"], (fault.id, rank, got["message"])
            assert got["took"] < HANG_BOUND_S, (fault.id, rank, got["took"])
            assert got["next_error"] < 1e-10, (fault.id, rank, got["next_error"])
    assert [r["rebuilt_error"] < 1e-10 for r in per_rank] == [True] * world


def off_by_default():
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    try:
        return wf_mesh.faults.containment_enabled(), attention_call(pm, "ring")
    finally:
        pm.destroy()


def test_containment_is_off_unless_asked_for():
    """The success path pays nothing by default: no verdict exchange (the mesh's setting is off)."""
    assert run_distributed(2, off_by_default)[0][0] is False
