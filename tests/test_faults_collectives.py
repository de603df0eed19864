"""Fault containment of ``wf_mesh.broadcast`` of typed values: the source's tensor payload or a receiver's
decode raises MemoryError on one rank (injected); every rank raises it, naming the rank, within a hang bound,
and the next broadcast on the same group is exact."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import injected_fault, run_distributed

HANG_BOUND_S = 60.0


def value(step: int) -> dict:
    return {"step": step, "latents": torch.arange(6.0).reshape(2, 3) + step, "name": "clip"}


def contained(failing_rank: int, where: str):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    group = pm.group("cp")
    fault = injected_fault(where, 1, MemoryError("simulated")) if dist.get_rank() == failing_rank else None
    start = time.monotonic()
    try:
        if fault is None:
            wf_mesh.broadcast(value(0) if dist.get_rank() == 0 else None, group)
        else:
            with fault:
                wf_mesh.broadcast(value(0) if dist.get_rank() == 0 else None, group)
        caught = ("returned", "")
    except Exception as exc:
        caught = (type(exc).__name__, str(exc))
    took = time.monotonic() - start
    got = wf_mesh.broadcast(value(1) if dist.get_rank() == 0 else None, group)
    pm.destroy()
    return caught, took, got


@pytest.mark.parametrize(
    "world, failing_rank, where",
    [(2, 0, "tensor payload"), (2, 1, "decode"), (4, 0, "tensor payload"), (4, 3, "decode")],
)
def test_a_failing_local_step_raises_on_every_rank_and_the_next_broadcast_is_exact(world, failing_rank, where):
    want = (
        f"broadcast: rank {failing_rank}: failed at {where} 1 of 1: MemoryError: simulated "
        f"(raised on every rank of the group {list(range(world))})"
    )
    for rank, ((kind, message), took, got) in enumerate(run_distributed(world, contained, failing_rank, where)):
        assert (kind, message) == ("MemoryError", want), rank
        assert took < HANG_BOUND_S
        assert got["step"] == 1 and got["name"] == "clip" and torch.equal(got["latents"], value(1)["latents"])
