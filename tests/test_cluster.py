"""wf_mesh.testing: the pooled local cluster itself (errors, hangs, dead workers, clean-up between runs)."""

import os
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import LocalCluster, RemoteTraceback, get_cluster, process_group_counts, run_distributed


def whoami():
    return dist.get_rank(), dist.get_world_size(), wf_mesh.model_parallel_is_initialized()


def raise_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"bad value on rank {rank}")
    return "fine"


def leave_state_behind():
    wf_mesh.initialize_model_parallel(tp_size=2)
    dist.new_group([0, 1])
    return process_group_counts()[0]


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


@pytest.mark.slow  # waits out a 1 s run timeout and restarts the pool
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


def raise_then_peer_stuck():
    if dist.get_rank() == 0:
        raise KeyError("rank 0 found no such key")
    dist.barrier()  # rank 1 waits for rank 0 in a collective that never comes


@pytest.mark.slow  # waits out the 5 s grace period
def test_first_failing_rank_is_reraised_while_its_peer_is_stuck():
    with pytest.raises(KeyError, match="rank 0 found no such key") as info:
        run_distributed(2, raise_then_peer_stuck)
    assert "in raise_then_peer_stuck" in str(info.value.__cause__)
    assert run_distributed(2, whoami) == [(0, 2, False), (1, 2, False)]  # a fresh cluster


@pytest.mark.slow  # waits out the 5 s grace period
def test_return_exceptions_gives_every_ranks_outcome():
    out = run_distributed(4, raise_on, 2, return_exceptions=True)
    assert out[:2] == ["fine", "fine"] and out[3] == "fine"
    assert isinstance(out[2], ValueError) and str(out[2]) == "bad value on rank 2"
    assert isinstance(out[2].__cause__, RemoteTraceback) and out[2].__cause__.rank == 2
    stuck = run_distributed(2, raise_then_peer_stuck, return_exceptions=True)
    assert isinstance(stuck[0], KeyError) and isinstance(stuck[1], TimeoutError)
    assert "rank 1 of 2 did not finish raise_then_peer_stuck" in str(stuck[1])
    # stopped by the grace period after rank 0 raised, not by the cluster's timeout
    assert "it was still running when rank(s) [0] had raised" in str(stuck[1])


def draw():
    return torch.rand(3).tolist(), random.random()


def test_rng_is_reset_before_every_function():
    first = run_distributed(2, draw)
    assert run_distributed(2, draw) == first and first[0] == first[1]


@pytest.mark.slow  # starts a Python process of its own
def test_functions_the_workers_cannot_import_are_refused_with_the_reason():
    with pytest.raises(TypeError, match="cannot be sent to the workers .*define them at module level"):
        run_distributed(2, lambda: 1)
    script = "from wf_mesh.testing import run_distributed\ndef f():\n    return 1\nrun_distributed(2, f)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "f is defined in an interactive __main__ (no file)" in proc.stderr


def non_leaf_requiring_grad():
    return torch.ones(2, requires_grad=True) * 2


def test_a_result_the_pipe_cannot_carry_is_an_error_not_a_dead_worker():
    with pytest.raises(TypeError, match="the result of non_leaf_requiring_grad is not picklable: Cowardly refusing"):
        run_distributed(2, non_leaf_requiring_grad)
    assert run_distributed(2, whoami) == [(0, 2, False), (1, 2, False)]  # the same workers carry on


def break_clean_up_then(raise_on_rank):
    """Register an upper layer's per-mesh state whose reset fails (the clean-up after every run resets it)."""

    def broken_reset(destroy_process_groups):
        raise OSError("the extension's reset failed")

    wf_mesh.mesh.register_extension("test.broken_reset", broken_reset)
    if dist.get_rank() == raise_on_rank:
        raise ValueError(f"the function's own error on rank {raise_on_rank}")
    return "fine"


def test_a_failed_clean_up_never_hides_the_functions_error():
    with pytest.raises(ValueError, match="the function's own error on rank 1") as info:
        run_distributed(2, break_clean_up_then, 1)
    notes = "\n".join(info.value.__notes__)
    assert "failed to clean up after break_clean_up_then" in notes and "the extension's reset failed" in notes
    with pytest.raises(RuntimeError, match="failed to clean up after break_clean_up_then"):  # nothing else failed
        run_distributed(2, break_clean_up_then, -1)
    assert run_distributed(2, whoami) == [(0, 2, False), (1, 2, False)]  # restarted, without the broken reset


def legacy_modules_after_a_native_run():
    wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    return sorted(m for m in sys.modules if m.startswith(("wf_mesh.legacy", "wf_mesh.parallel_state", "loguru")))


def test_the_clean_up_of_a_native_run_imports_no_legacy_module():
    """A fresh pool runs a native function twice: the clean-up in between loaded neither the legacy layer nor
    loguru (a machine without loguru runs the GPU check on this path)."""
    cluster = LocalCluster(2)
    try:
        cluster.run(legacy_modules_after_a_native_run)
        assert cluster.run(legacy_modules_after_a_native_run) == [[], []]
    finally:
        cluster.shutdown()
