"""wf_mesh.testing: the pooled local cluster itself (errors, hangs, dead workers, clean-up between runs)."""

import os
import time

import pytest
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import LocalCluster, RemoteTraceback, get_cluster, run_distributed


def whoami():
    return dist.get_rank(), dist.get_world_size(), wf_mesh.model_parallel_is_initialized()


def raise_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"bad value on rank {rank}")
    return "fine"


def leave_state_behind():
    wf_mesh.initialize_model_parallel(tp_size=2)
    dist.new_group([0, 1])
    return len(dist.distributed_c10d._world.pg_map)


def sleep_for(seconds):
    time.sleep(seconds)


def die():
    os._exit(3)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_runs_on_every_rank(world_size):
    assert run_distributed(world_size, whoami) == [(r, world_size, False) for r in range(world_size)]


def test_exception_reraised_with_remote_traceback():
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        run_distributed(2, raise_on, 1)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "in raise_on" in str(info.value.__cause__)
    assert "(raised on rank 1 of 2; ranks that raised: [1])" in info.value.__notes__[0]
    assert run_distributed(2, raise_on, 5) == ["fine", "fine"]  # the cluster carries on


def test_state_is_cleaned_between_runs():
    first = run_distributed(2, leave_state_behind)
    assert run_distributed(2, whoami) == [(0, 2, False), (1, 2, False)]
    assert run_distributed(2, leave_state_behind) == first  # no process group piles up from run to run


def test_hang_times_out_and_cluster_restarts():
    cluster = LocalCluster(2, timeout=60)
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish sleep_for within 1s"):
            cluster.run(sleep_for, 30, timeout=1)
        assert not cluster.alive
        assert cluster.run(whoami) == [(0, 2, False), (1, 2, False)]
    finally:
        cluster.shutdown()


def test_dead_worker_is_respawned():
    cluster = get_cluster(2)
    with pytest.raises(RuntimeError, match=r"rank \d of 2 died during die \(exit code 3\)"):
        cluster.run(die)
    assert cluster.run(whoami) == [(0, 2, False), (1, 2, False)]
