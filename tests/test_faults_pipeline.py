"""Fault containment of pipeline transfers (``PipelineP2P.contained``): a stage whose step fails between its
receive and its send; every stage raises the failing stage's error, naming it, within a hang bound, and the
next microbatch on the same link is exact against one process running the stages in a row."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import injected_fault, run_distributed

HANG_BOUND_S = 60.0
SHAPE = (2, 3)


def stage_fn(stage: int, x: torch.Tensor) -> torch.Tensor:
    return x * (stage + 2) + stage


def chain(x: torch.Tensor, stages: int) -> torch.Tensor:
    for s in range(stages):
        x = stage_fn(s, x)
    return x


def microbatch(link, x0):
    """One pass through every stage; the last stage's output (None elsewhere)."""
    with link.contained("microbatch") as seq:
        x = x0 if link.is_first else link.recv(SHAPE, torch.float64)
        y = seq.step(("stage", link.stage + 1, link.num_stages), stage_fn, link.stage, x)
        if not link.is_last:
            link.send(y)
    return y if link.is_last else None


def contained(failing_stage: int):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=dist.get_world_size()), contain_faults=True)
    link = wf_mesh.PipelineP2P(pm)
    x0 = torch.arange(6, dtype=torch.float64).reshape(SHAPE)
    fault = (
        injected_fault("stage", failing_stage + 1, MemoryError("simulated")) if link.stage == failing_stage else None
    )
    start = time.monotonic()
    try:
        if fault is None:
            microbatch(link, x0)
        else:
            with fault:
                microbatch(link, x0)
        caught = ("returned", "")
    except Exception as exc:
        caught = (type(exc).__name__, str(exc))
    took = time.monotonic() - start
    out = microbatch(link, x0 + 1)  # the next microbatch on the same link
    pm.destroy()
    return caught, took, out


@pytest.mark.parametrize("world, failing_stage", [(2, 0), (2, 1), (4, 1), (4, 3)])
def test_a_failing_stage_raises_on_every_stage_and_the_next_microbatch_is_exact(world, failing_stage):
    results = run_distributed(world, contained, failing_stage)
    ranks = list(range(world))
    want = f"microbatch: rank {failing_stage}: failed at stage {failing_stage + 1} of {world}: MemoryError: simulated"
    for rank, ((kind, message), took, _) in enumerate(results):
        assert kind == "MemoryError", (rank, kind, message)
        assert message == f"{want} (raised on every rank of the group {ranks})", (rank, message)
        assert took < HANG_BOUND_S
    last = results[-1][2]
    assert torch.equal(last, chain(torch.arange(6, dtype=torch.float64).reshape(SHAPE) + 1, world))


def unchecked():
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=dist.get_world_size()))
    link = wf_mesh.PipelineP2P(pm, checked=False)
    try:
        with link.contained():
            pass
    except ValueError as exc:
        return str(exc)
    finally:
        pm.destroy()


def test_an_unchecked_link_is_refused_on_every_stage():
    for message in run_distributed(2, unchecked):
        assert message == "PipelineP2P.contained needs a checked link (checked=True)"
