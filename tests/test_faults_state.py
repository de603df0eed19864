"""Fault containment of the bucketed state broadcast (``broadcast_dtensor_model_states``): the copy-in on the
source or the copy-out on a receiver raises MemoryError in one bucket; every rank raises it, naming the rank
and the bucket, within a hang bound, and the next broadcast on the same mesh is exact."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from wf_mesh import faults, state_sync
from wf_mesh.testing import run_distributed

HANG_BOUND_S = 60.0
BUCKETS = 3


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(BUCKETS)))  # 20 floats per layer


def contained(rank: int, where: str, bucket: int):
    faults.set_containment(True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("replicate",))
    net = model(dist.get_rank())
    name = "_copy_in" if where == "copy-in" else "_copy_out"
    real, calls = getattr(state_sync, name), [0]

    def failing(*args):
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] == bucket:
            raise MemoryError(f"injected in {where}")
        return real(*args)

    setattr(state_sync, name, failing)
    start = time.monotonic()
    try:
        state_sync.broadcast_dtensor_model_states(net, mesh, bucket_bytes=80)
        caught = None
    except Exception as exc:
        caught = exc
    finally:
        setattr(state_sync, name, real)
    took = time.monotonic() - start
    n = state_sync.broadcast_dtensor_model_states(net, mesh, bucket_bytes=80)
    ref = model(0)
    error = max((a - b).abs().max().item() for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
    faults.set_containment(None)
    return type(caught).__name__, str(caught), took, n, error


@pytest.mark.parametrize("bucket", [1, 2, 3])
@pytest.mark.parametrize(("rank", "where"), [(0, "copy-in"), (1, "copy-out")])
def test_a_failing_bucket_raises_on_every_rank_and_the_next_broadcast_is_exact(rank, where, bucket):
    for got in run_distributed(2, contained, rank, where, bucket):
        kind, message, took, n, error = got
        assert kind == "MemoryError", got
        expected = f"rank {rank}: failed at bucket {bucket} of {BUCKETS}: MemoryError: injected in {where}"
        assert expected in message, got
        assert took < HANG_BOUND_S, got
        assert n == BUCKETS and error == 0.0, got


def legacy_contained(failing_rank: int):
    """The legacy face (``worldfoundry``'s ``broadcast_dtensor_model_states``) over 4 ranks, bucket 2 failing
    on one rank via :func:`wf_mesh.testing.injected_fault`."""
    from wf_mesh.compat.worldfoundry.device_mesh_collectives import broadcast_dtensor_model_states
    from wf_mesh.testing import injected_fault

    faults.set_containment(True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("replicate",))
    net = model(dist.get_rank())
    start = time.monotonic()
    try:
        if dist.get_rank() == failing_rank:
            with injected_fault("bucket", 2, MemoryError("simulated")):
                broadcast_dtensor_model_states(net, mesh, bucket_bytes=80)
        else:
            broadcast_dtensor_model_states(net, mesh, bucket_bytes=80)
        caught = None
    except Exception as exc:
        caught = exc
    took = time.monotonic() - start
    broadcast_dtensor_model_states(net, mesh, bucket_bytes=80)
    ref = model(0)
    error = max((a - b).abs().max().item() for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
    faults.set_containment(None)
    return type(caught).__name__, str(caught), took, error


@pytest.mark.parametrize("failing_rank", [0, 3])
def test_the_legacy_broadcast_is_contained_on_four_ranks(failing_rank):
    for rank, (kind, message, took, error) in enumerate(run_distributed(4, legacy_contained, failing_rank)):
        assert kind == "MemoryError", (rank, kind, message)
        want = f"broadcast_dtensor_model_states: rank {failing_rank}: failed at bucket 2 of {BUCKETS}: MemoryError: "
        assert message == want + "simulated (raised on every rank of the group [0, 1, 2, 3])", (rank, message)
        assert took < HANG_BOUND_S and error == 0.0, (rank, took, error)
