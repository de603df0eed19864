"""Fault containment of the gathers: ``gather_sequence`` (forward copy-in / copy-out, the backward's local steps
under both grad rules), ``broadcast_shard`` (the source's copy-in, a receiver's copy-out) and the legacy
``cat_outputs_cp`` built on them. One rank's step raises MemoryError (injected); every rank raises it, naming
the rank and the step, within a hang bound, and the next call on the same mesh equals a single-process
reference."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.context_parallel import sequence_dtensor
from wf_mesh.testing import injected_fault, run_distributed

from helpers import caught, sample

HANG_BOUND_S = 60.0
SHAPE = (2, 7, 3)  # 7 tokens: uneven over 2 (4, 3) and 4 (2, 2, 2, 1) ranks


def weights(rank: int) -> torch.Tensor:
    return sample(SHAPE, seed=100 + rank)


def reference_grad(rule: str, world: int) -> torch.Tensor:
    """The gradient of the whole input of one process: every rank's loss for "partial", rank 0's for "replicate"."""
    x = sample(SHAPE).requires_grad_()
    ranks = range(world) if rule == "partial" else [0]
    sum((x.sin() * weights(r)).sum() for r in ranks).backward()
    assert x.grad is not None
    return x.grad


def gather_step(pm, rule: str, as_dtensor: bool):
    """Shard, gather, a loss (the same on every rank for "replicate"), backward: (full, the shard's grad)."""
    local = wf_mesh.shard_sequence(sample(SHAPE), 1, mesh=pm).detach().requires_grad_()
    x = sequence_dtensor(local, 1, SHAPE, mesh=pm) if as_dtensor else local
    full = wf_mesh.gather_sequence(x, None if as_dtensor else 1, mesh=pm, grad=rule)
    me = 0 if rule == "replicate" else dist.get_rank()
    (full.sin() * weights(me)).sum().backward()
    return full.detach(), local.grad


def contained_gather(failing_rank: int, where: str, rule: str, as_dtensor: bool):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    mine = dist.get_rank() == failing_rank
    fault = injected_fault(where, 1, MemoryError("simulated")) if mine else contextlib.nullcontext()
    outcome, took = caught(lambda: gather_step(pm, rule, as_dtensor), fault)
    full, grad = gather_step(pm, rule, as_dtensor)
    pm.destroy()
    return outcome, took, full, grad


GATHER_CASES = [
    (2, 1, "copy-in", "replicate", False),
    (2, 0, "copy-out", "replicate", True),
    (2, 1, "backward slice", "replicate", False),
    (2, 0, "backward copy-in", "partial", False),
    (2, 1, "backward copy-out", "partial", True),
    (4, 3, "copy-in", "partial", False),
    (4, 1, "copy-out", "replicate", False),
    (4, 2, "backward slice", "replicate", True),
    (4, 1, "backward copy-out", "partial", False),
]


@pytest.mark.parametrize("world, failing_rank, where, rule, as_dtensor", GATHER_CASES)
def test_a_failing_gather_step_raises_on_every_rank_and_the_next_gather_is_exact(
    world, failing_rank, where, rule, as_dtensor
):
    want = (
        f"gather_sequence: rank {failing_rank}: failed at {where} 1 of 1: MemoryError: simulated "
        f"(raised on every rank of the group {list(range(world))})"
    )
    x, expected = sample(SHAPE), torch.chunk(reference_grad(rule, world), world, 1)
    results = run_distributed(world, contained_gather, failing_rank, where, rule, as_dtensor)
    for rank, (outcome, took, full, grad) in enumerate(results):
        assert outcome == ("MemoryError", want), rank
        assert took < HANG_BOUND_S, rank
        assert torch.equal(full, x), rank
        assert torch.allclose(grad, expected[rank], rtol=1e-6, atol=1e-6), rank


def contained_broadcast_shard(failing_rank: int, where: str):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    source = dist.get_rank() == 0
    mine = dist.get_rank() == failing_rank
    fault = injected_fault(where, 1, MemoryError("simulated")) if mine else contextlib.nullcontext()
    outcome, took = caught(lambda: wf_mesh.broadcast_shard(sample(SHAPE, 1) if source else None, 1, mesh=pm), fault)
    shard = wf_mesh.broadcast_shard(sample(SHAPE, 2) if source else None, 1, mesh=pm)
    pm.destroy()
    return outcome, took, shard


@pytest.mark.parametrize("world, failing_rank, where", [(2, 0, "copy-in"), (4, 0, "copy-in"), (4, 2, "copy-out")])
def test_a_failing_broadcast_shard_step_raises_on_every_rank_and_the_next_one_is_exact(world, failing_rank, where):
    want = (
        f"broadcast_shard: rank {failing_rank}: failed at {where} 1 of 1: MemoryError: simulated "
        f"(raised on every rank of the group {list(range(world))})"
    )
    expected = torch.chunk(sample(SHAPE, 2), world, 1)
    for rank, (outcome, took, shard) in enumerate(
        run_distributed(world, contained_broadcast_shard, failing_rank, where)
    ):
        assert outcome == ("MemoryError", want), rank
        assert took < HANG_BOUND_S, rank
        assert torch.equal(shard, expected[rank]), rank


def contained_legacy_cat(failing_rank: int):
    from wf_mesh.legacy.context_parallel import cat_outputs_cp

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    local = wf_mesh.shard_sequence(sample(SHAPE), 1, mesh=pm)
    mine = dist.get_rank() == failing_rank
    fault = injected_fault("copy-out", 1, MemoryError("simulated")) if mine else contextlib.nullcontext()
    outcome, took = caught(lambda: cat_outputs_cp(local, 1, pm.group("cp")), fault)
    full = cat_outputs_cp(local, 1, pm.group("cp"))
    pm.destroy()
    return outcome, took, full


def test_the_legacy_cat_outputs_cp_is_contained_on_four_ranks():
    want = "gather_sequence: rank 3: failed at copy-out 1 of 1: MemoryError: simulated (raised on every rank of the"
    for rank, (outcome, took, full) in enumerate(run_distributed(4, contained_legacy_cat, 3)):
        assert outcome[0] == "MemoryError" and outcome[1].startswith(want), (rank, outcome)
        assert took < HANG_BOUND_S and torch.equal(full, sample(SHAPE)), rank


def uncontained_counts():
    """Containment off (the default): the agreement and ONE all-gather forward, no collective backward."""
    from torch.distributed.tensor.debug import CommDebugMode

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    local = wf_mesh.shard_sequence(sample(SHAPE), 1, mesh=pm).detach().requires_grad_()
    with CommDebugMode() as forward:
        full = wf_mesh.gather_sequence(local, 1, mesh=pm)
    with CommDebugMode() as backward:
        full.sum().backward()
    pm.destroy()
    return forward.get_total_counts(), backward.get_total_counts()


def test_without_containment_a_gather_pays_no_closing_exchange():
    assert run_distributed(2, uncontained_counts) == [(2, 0)] * 2


def compiled_gather(failing_rank: int, where: str, rule: str):
    """gather_sequence under torch.compile: the graph dynamo hands its backend, the full tensor and the shard's
    gradient, a contained failure at ``where`` on ``failing_rank``, and the next compiled call."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    targets: list[str] = []

    def recording(gm, example_inputs):  # a torch.compile backend: note the graph's calls, run it as traced
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    gather = torch.compile(lambda t: wf_mesh.gather_sequence(t, 1, mesh=pm, grad=rule), backend=recording)

    def step():
        local = wf_mesh.shard_sequence(sample(SHAPE), 1, mesh=pm).detach().requires_grad_()
        full = gather(local)
        (full.sin() * weights(0 if rule == "replicate" else dist.get_rank())).sum().backward()
        return full.detach(), local.grad

    first = step()
    mine = dist.get_rank() == failing_rank
    fault = injected_fault(where, 1, MemoryError("simulated")) if mine else contextlib.nullcontext()
    outcome, took = caught(step, fault)
    again = step()
    pm.destroy()
    return targets, first, outcome, took, again


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize(
    "world, failing_rank, where, rule",
    [(2, 1, "copy-in", "replicate"), (4, 2, "copy-out", "partial"), (4, 3, "backward copy-out", "partial")],
)
def test_gather_sequence_under_compile_is_our_contained_op_and_exact(world, failing_rank, where, rule):
    want = (
        f"gather_sequence: rank {failing_rank}: failed at {where} 1 of 1: MemoryError: simulated "
        f"(raised on every rank of the group {list(range(world))})"
    )
    x, expected = sample(SHAPE), torch.chunk(reference_grad(rule, world), world, 1)
    for rank, (targets, first, outcome, took, again) in enumerate(
        run_distributed(world, compiled_gather, failing_rank, where, rule)
    ):
        assert "wf_mesh.gather_sequence.default" in targets, (rank, targets)
        # dynamo may trace the agreement's row all-gather (then breaks the graph at its .tolist()): at most
        # that one; DTensor's full_tensor would add its own
        assert targets.count("_c10d_functional.all_gather_into_tensor") <= 1, (rank, targets)
        for full, grad in (first, again):
            assert torch.equal(full, x), rank
            assert torch.allclose(grad, expected[rank], rtol=1e-6, atol=1e-6), rank
        assert outcome == ("MemoryError", want), rank
        assert took < HANG_BOUND_S, rank
