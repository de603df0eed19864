"""The real gloo mesh equals the pure plan; lookups, errors, and destroy/init cycles that leak nothing."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import run_distributed
from wf_mesh.topology import AXES, DERIVED_AXES

ALL_AXES = [*AXES, *DERIVED_AXES]


def mesh_report(tp, cp, pp, order):
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, order=order))
    rank = dist.get_rank()
    report = {"coords": mesh.coords(), "names": mesh.root.mesh_dim_names, "axes": mesh.axes}
    for axis in ALL_AXES:
        ranks = mesh.ranks(axis)
        total = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(total, group=mesh.group(axis))  # proves the group, not just its bookkeeping
        report[axis] = {
            "ranks": ranks,
            "rank": mesh.rank(axis),
            "size": mesh.size(axis),
            "pg_ranks": dist.get_process_group_ranks(mesh.group(axis)),
            "sum": total.item(),
        }
    return report


CONFIGS = [
    (1, (1, 1, 1, "tp-cp-pp-dp")),
    (2, (2, 1, 1, "tp-cp-pp-dp")),
    (2, (1, 1, 1, "dp-tp-cp-pp")),
    (4, (2, 2, 1, "tp-cp-pp-dp")),
    (4, (1, 2, 2, "pp-cp-tp-dp")),
    (4, (1, 1, 2, "tp-cp-pp-dp")),
    (8, (2, 2, 2, "tp-cp-pp-dp")),
    (8, (1, 2, 2, "tp-cp-pp-dp")),
    (8, (2, 2, 1, "cp-dp-tp-pp")),
    (8, (1, 4, 2, "tp-pp-cp-dp")),
]


@pytest.mark.parametrize("world_size, config", CONFIGS, ids=[f"w{w}-{c}" for w, c in CONFIGS])
def test_real_mesh_equals_plan(world_size, config):
    tp, cp, pp, order = config
    plan = wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, order=order).resolve(world_size)
    reports = run_distributed(world_size, mesh_report, tp, cp, pp, order)
    for rank, report in enumerate(reports):
        assert report["coords"] == plan.coords(rank)
        assert report["names"] == plan.mesh_dim_names
        assert set(ALL_AXES) <= set(report["axes"])
        for axis in ALL_AXES:
            group = plan.group_of(axis, rank)
            got = report[axis]
            assert got["ranks"] == group, (rank, axis)
            assert got["pg_ranks"] == sorted(group)
            assert got["rank"] == group.index(rank) and got["size"] == len(group)
            assert got["sum"] == sum(group)


def lookups_and_errors():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    out = {
        "token_equals_name": mesh["dp-cp"] is mesh["dp_cp"] and mesh["cp-tp"] is mesh["tp_cp"],
        "contains": ("tp_cp" in mesh, "ep" in mesh),
        "current": wf_mesh.get_parallel_mesh() is mesh,
        "repr": repr(mesh),
    }
    try:
        mesh["ep"]
    except KeyError as e:
        out["unknown"] = e.args[0]
    try:
        wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    except RuntimeError as e:
        out["double"] = str(e)
    mesh.destroy()
    out["after_destroy"] = wf_mesh.parallel_mesh_or_none()
    try:
        mesh.group("cp")
    except RuntimeError as e:
        out["destroyed"] = str(e)
    mesh.destroy()  # idempotent
    try:
        wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=3))
    except ValueError as e:
        out["indivisible"] = str(e)
    return out


def test_lookups_and_errors():
    out = run_distributed(4, lookups_and_errors)[1]
    assert out["token_equals_name"] and out["contains"] == (True, False) and out["current"]
    assert "ParallelMesh(ParallelDims(tp=1, cp=2, pp=1, dp=2" in out["repr"] and "rank=1" in out["repr"]
    assert out["unknown"].startswith("unknown mesh axis 'ep'; valid axes are ['tp', 'cp', 'pp', 'dp', 'tp_cp'")
    assert "model parallel is already initialized (ParallelDims(tp=1, cp=2, pp=1, dp=2" in out["double"]
    assert "call wf_mesh.destroy_model_parallel() before initializing again" in out["double"]
    assert out["after_destroy"] is None
    assert "was destroyed; initialize a new one" in out["destroyed"]
    assert "world_size=4 is not divisible by tp*cp*pp = 3*1*1 = 3" in out["indivisible"]


def test_requires_torch_distributed():
    assert not dist.is_initialized()  # the pytest process itself never joins a group
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized: call wf_mesh.dist_init"):
        wf_mesh.init_parallel()
    with pytest.raises(RuntimeError, match="model parallel is not initialized: call wf_mesh.initialize_model_parallel"):
        wf_mesh.get_parallel_mesh()


def destroy_init_cycles(cycles):
    fds, seconds = [], []
    for _ in range(cycles):
        start = time.perf_counter()
        wf_mesh.initialize_model_parallel(tp_size=2)
        wf_mesh.destroy_model_parallel()
        seconds.append(time.perf_counter() - start)
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds, seconds


def test_destroy_init_50_cycles_leaks_nothing():
    for fds, seconds in run_distributed(4, destroy_init_cycles, 50):
        assert fds[-1] == fds[4], fds  # flat after warm-up: the groups' sockets are really closed
        early, late = sorted(seconds[1:11])[5], sorted(seconds[-10:])[5]
        assert late < 3 * early, (early, late)  # medians; generous, the machine is noisy


def default_group_survives():
    wf_mesh.initialize_model_parallel(tp_size=dist.get_world_size())  # tp spans the whole world
    wf_mesh.destroy_model_parallel()
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.is_initialized(), t.item()


def test_destroy_leaves_default_group_alive():
    assert run_distributed(2, default_group_survives) == [(True, 2.0), (True, 2.0)]


def timeout_then_recover():
    import datetime

    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2), timeout=datetime.timedelta(seconds=2))
    error = None
    if dist.get_rank() == 0:  # rank 1 never joins: the subgroup's own timeout must fire
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=mesh.group("tp"))
        except RuntimeError as e:
            error = (type(e).__name__, time.perf_counter() - start)
    dist.barrier()
    wf_mesh.destroy_model_parallel()
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.group("tp"))
    return error, t.item()


def test_subgroup_timeout_raises_and_destroy_init_recovers():
    (error, total), (none, total1) = run_distributed(2, timeout_then_recover)
    assert error is not None and error[0] == "RuntimeError" and error[1] < 30  # 2 s configured, not 30 min
    assert none is None and total == total1 == 2.0
