"""The real gloo mesh equals the pure plan; lookups, errors, and destroy/init cycles that leak nothing."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.errors import DegreeError, DisagreementError, StateError
from wf_mesh.testing import process_group_counts, run_distributed
from wf_mesh.topology import AXES, DERIVED_AXES, FSDP_AXIS

from helpers import raised_everywhere


def checked_axes(plan):
    """Every axis a mesh of ``plan`` has: what it shows, and every derived axis (the FSDP axis is one)."""
    return list(dict.fromkeys([*plan.shown_axes, *DERIVED_AXES]))


def mesh_report(tp, cp, pp, order, cfg=1):
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, order=order, cfg=cfg))
    rank = dist.get_rank()
    report = {"coords": mesh.coords(), "names": mesh.root.mesh_dim_names, "axes": mesh.axes}
    report["single"] = {a: (mesh.size(a), mesh.rank(a), mesh.ranks(a), a in mesh) for a in AXES if a not in mesh.axes}
    report["fsdp_is_dp_cp"] = mesh.fsdp_mesh() is mesh["dp_cp"]
    for axis in checked_axes(mesh.dims):
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
    # cfg=2: the guidance branches on different ranks, with the other axes too
    (2, (1, 1, 1, "tp-cp-pp-dp", 2)),
    (4, (2, 1, 1, "tp-cp-pp-dp", 2)),
    (4, (1, 1, 1, "tp-cp-pp-dp", 2)),
    (8, (2, 2, 1, "tp-cp-pp-cfg-dp", 2)),
    (8, (1, 2, 2, "cfg-tp-cp-pp-dp", 2)),
    (8, (2, 1, 1, "tp-cp-dp-pp", 2)),
]


# one 8-process world in the fast lane, the other seven in the slow lane (0.5 s each on 2 cores)
FIRST_W8 = next(i for i, (w, _) in enumerate(CONFIGS) if w == 8)
MESH_CASES = [
    pytest.param(w, c, id=f"w{w}-{c}", marks=[pytest.mark.slow] * (w == 8 and i != FIRST_W8))
    for i, (w, c) in enumerate(CONFIGS)
]


@pytest.mark.parametrize("world_size, config", MESH_CASES)
def test_real_mesh_equals_plan(world_size, config):
    tp, cp, pp, order, cfg = (*config, 1)[:5]
    plan = wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, order=order, cfg=cfg).resolve(world_size)
    reports = run_distributed(world_size, mesh_report, tp, cp, pp, order, cfg)
    for rank, report in enumerate(reports):
        assert report["coords"] == plan.coords(rank)
        assert report["names"] == plan.mesh_dim_names
        assert set(checked_axes(plan)) <= set(report["axes"])
        # cfg=1: no cfg dim and no cfg group, yet size/rank/ranks answer; the FSDP axis is the dp_cp mesh
        assert report["single"] == ({} if cfg == 2 else {"cfg": (1, 0, [rank], False)})
        assert report["fsdp_is_dp_cp"] == (cfg == 1)
        for axis in checked_axes(plan):
            group = plan.group_of(axis, rank)
            got = report[axis]
            assert got["ranks"] == group, (rank, axis)
            assert got["pg_ranks"] == sorted(group)
            assert got["rank"] == group.index(rank) and got["size"] == len(group)
            assert got["sum"] == sum(group)


def lookups():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    out = {
        "token_equals_name": mesh["dp-cp"] is mesh["dp_cp"] and mesh["cp-tp"] is mesh["tp_cp"],
        "contains": ("tp_cp" in mesh, "ep" in mesh, None in mesh),
        "current": wf_mesh.get_parallel_mesh() is mesh,
        "repr": repr(mesh),
    }
    mesh.destroy()
    mesh.destroy()  # idempotent
    out["after_destroy"] = wf_mesh.parallel_mesh_or_none()
    return out


def test_lookups():
    for rank, out in enumerate(run_distributed(4, lookups)):
        assert out["token_equals_name"] and out["contains"] == (True, False, False) and out["current"]
        assert "ParallelMesh(ParallelDims(tp=1, cp=2, pp=1, dp=2" in out["repr"] and f"rank={rank}" in out["repr"]
        assert out["after_destroy"] is None


def mesh_misuse(case):
    rank = dist.get_rank()
    if case == "dims_differ":  # before: every rank hung in subgroup creation
        return wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=4) if rank == 0 else wf_mesh.ParallelDims(cp=4))
    if case == "order_differs":
        return wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2, order="tp-cp-pp-dp" if rank else "dp-tp-cp-pp"))
    if case == "timeout_differs":
        return wf_mesh.init_parallel(timeout=datetime.timedelta(seconds=30 + rank))
    if case == "cfg_differs":
        return wf_mesh.init_parallel(wf_mesh.ParallelDims(cfg=2 if rank == 0 else 1))
    if case == "indivisible":
        return wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=3))
    if case == "bad_on_one_rank":
        return wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2), dp_replicate=3 if rank == 2 else 1)
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    if case == "double":
        return wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    if case == "unknown_axis":
        return mesh["ep"]
    if case == "cfg_axis":
        return mesh.group("cfg")
    if case == "none_axis":
        return mesh[None]
    if case == "int_axis":
        return mesh[3]
    mesh.destroy()
    if case == "destroyed":
        return mesh.group("cp")


MESH_MISUSE = {
    "dims_differ": (
        DisagreementError,
        r"^init_parallel: ranks disagree on tp \(rank 0: 4; ranks \[1, 2, 3\]: 1\); every rank must build the same mesh$",
    ),
    "order_differs": (
        DisagreementError,
        r"ranks disagree on order \(rank 0: dp-tp-cp-pp; ranks \[1, 2, 3\]: tp-cp-pp-dp\)",
    ),
    "timeout_differs": (
        DisagreementError,
        r"ranks disagree on timeout \(rank 0: 30 s; rank 1: 31 s; rank 2: 32 s; rank 3: 33 s\)",
    ),
    "indivisible": (
        DegreeError,
        r"^init_parallel: world_size=4 is not divisible by tp\*cp\*pp = 3\*1\*1 = 3; cannot infer dp$",
    ),
    "bad_on_one_rank": (
        ValueError,
        r"^init_parallel: rank 2: dp_replicate=3 does not divide dp=2 .*\(raised on every rank of the group \[0, 1, 2, 3\]\)$",
    ),
    "double": (
        StateError,
        r"a ParallelMesh is already initialized \(ParallelDims\(tp=1, cp=2, pp=1, dp=2.*destroy it first "
        r"\(wf_mesh.get_parallel_mesh\(\).destroy\(\), or close the DistributedSession that built it\)",
    ),
    "unknown_axis": (KeyError, r"unknown mesh axis 'ep'; valid axes are \['tp', 'cp', 'pp', 'dp', 'tp_cp'"),
    "cfg_axis": (KeyError, r"mesh axis 'cfg' is not in this mesh: its group is one rank \(ParallelDims\(tp=1, cp=2"),
    "cfg_differs": (
        DisagreementError,
        r"^init_parallel: ranks disagree on cfg \(rank 0: 2; ranks \[1, 2, 3\]: 1\); every rank must build the same mesh$",
    ),
    "none_axis": (TypeError, r"^a mesh axis is a str such as 'cp' or 'dp_cp', got NoneType None$"),
    "int_axis": (TypeError, r"^a mesh axis is a str such as 'cp' or 'dp_cp', got int 3$"),
    "destroyed": (
        StateError,
        r"^this ParallelMesh \(ParallelDims\(tp=1, cp=2, pp=1, dp=2, order='tp-cp-pp-dp'\)\) was destroyed; initialize a new one$",
    ),
}


@pytest.mark.parametrize("case", list(MESH_MISUSE))
def test_mesh_misuse_raises_on_every_rank(case):
    error, match = MESH_MISUSE[case]
    raised_everywhere(run_distributed(4, mesh_misuse, case, return_exceptions=True), error, match)


def groups_created(timeout_seconds):
    before = process_group_counts()[0]
    timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=dist.get_world_size()), timeout=timeout)
    reused = mesh.group("tp") is dist.group.WORLD and mesh.group("tp_cp_dp") is dist.group.WORLD
    return process_group_counts()[0] - before, reused


def test_axes_spanning_the_world_reuse_the_default_group():
    # tp, tp_cp, tp_pp, tp_cp_dp, tp_dp span the world; cp, pp, dp, dp_cp (a rank each) are groups of their own
    assert run_distributed(2, groups_created, None) == [(4, True)] * 2
    assert run_distributed(2, groups_created, 60) == [(4, True)] * 2  # 60 s is the default group's timeout
    assert run_distributed(2, groups_created, 7) == [(9, False)] * 2  # another timeout: every axis its own group


def cp_sub_axes():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2, cp=4, cp_ulysses=2))
    return {axis: mesh.ranks(axis) for axis in ("cp", "cp_ulysses", "cp_ring")}


def test_cp_sub_axes_come_from_the_one_mesh():
    plan = wf_mesh.ParallelDims(tp=2, cp=4, cp_ulysses=2).resolve(8)
    for rank, groups in enumerate(run_distributed(8, cp_sub_axes)):
        for axis, ranks in groups.items():
            assert ranks == plan.group_of(axis, rank), (rank, axis)


def test_requires_torch_distributed():
    assert not dist.is_initialized()  # the pytest process itself never joins a group
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized: call wf_mesh.init_from_env\(dims\)"):
        wf_mesh.init_parallel()
    with pytest.raises(RuntimeError, match="no ParallelMesh is initialized: call wf_mesh.init_from_env"):
        wf_mesh.get_parallel_mesh()


def destroy_init_cycles(cycles):
    fds, groups = [], []
    for _ in range(cycles):
        wf_mesh.initialize_model_parallel(tp_size=2)
        wf_mesh.destroy_model_parallel()
        fds.append(len(os.listdir("/proc/self/fd")))
        groups.append(process_group_counts()[0])
    return fds, groups


@pytest.mark.slow
def test_destroy_init_50_cycles_leaks_nothing():
    for fds, groups in run_distributed(2, destroy_init_cycles, 50):
        assert fds[-1] == fds[4], fds  # flat after warm-up: the groups' sockets are really closed
        assert set(groups) == {1}, groups  # only the default group is left after every destroy


def default_group_survives():
    wf_mesh.initialize_model_parallel(tp_size=dist.get_world_size())  # tp spans the whole world
    wf_mesh.destroy_model_parallel()
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.is_initialized(), t.item()


def test_destroy_leaves_default_group_alive():
    assert run_distributed(2, default_group_survives) == [(True, 2.0), (True, 2.0)]


def timeout_then_recover():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2), timeout=datetime.timedelta(seconds=2))
    error = None
    if dist.get_rank() == 0:  # rank 1 never joins: the subgroup's own timeout must fire
        try:
            dist.all_reduce(torch.ones(1), group=mesh.group("tp"))
        except RuntimeError as e:
            error = str(e)
    dist.barrier()
    wf_mesh.destroy_model_parallel()
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.group("tp"))
    return error, t.item()


@pytest.mark.slow  # waits out a 2 s subgroup timeout
def test_subgroup_timeout_raises_and_destroy_init_recovers():
    (error, total), (none, total1) = run_distributed(2, timeout_then_recover)
    assert error is not None and "Timed out waiting 2000ms" in error  # the subgroup's 2 s, not the default 30 min
    assert none is None and total == total1 == 2.0


@pytest.mark.parametrize("kw, rep", [(dict(tp=2, cfg=2), 1), (dict(cp=2, cfg=2), 2), (dict(tp=2, cfg=2, cp=2), 1)])
def test_hsdp_shard_groups_span_the_fsdp_axis(kw, rep):
    """Pure: the HSDP shard groups are dp_shard x cfg x cp (the cfg branches hold the same weights); with one
    replica they are exactly the FSDP axis's groups."""
    from wf_mesh.mesh import hsdp_rank_grid

    dims = wf_mesh.ParallelDims(**kw).resolve(16)
    grid = hsdp_rank_grid(dims, rep)
    assert grid.shape == (dims.tp * dims.pp, rep, dims.degree(FSDP_AXIS) // rep)
    shards = sorted(sorted(row) for view in grid.tolist() for row in view)
    if rep == 1:
        assert shards == sorted(sorted(g) for g in dims.groups(FSDP_AXIS))
    assert sorted(r for view in grid.tolist() for row in view for r in row) == list(range(16))


# ---- randomness per axis --------------------------------------------------------------------------------
def draws(tp, cp, cfg, vary_over):
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=tp, cp=cp, cfg=cfg))
    noise = torch.randn(6, generator=mesh.generator(7, vary_over))
    return mesh.coords(), noise


@pytest.mark.parametrize(
    "tp, cp, cfg, vary_over",
    [(1, 2, 1, ("dp",)), (2, 2, 1, ("dp",)), (2, 2, 1, "dp"), (1, 2, 2, ("dp", "cfg")), (2, 2, 1, "dp_cp")],
)
def test_generator_varies_over_the_named_axes_only(tp, cp, cfg, vary_over):
    results = run_distributed(8, draws, tp, cp, cfg, vary_over)
    varied = {"dp_cp": ("dp", "cp")}.get(vary_over, (vary_over,) if isinstance(vary_over, str) else vary_over)
    by_key = {}
    for coords, noise in results:
        key = tuple(coords.get(axis, 0) for axis in varied)
        by_key.setdefault(key, []).append(noise)
    assert len(by_key) > 1
    for group in by_key.values():  # peers (tp, cp, the axes not varied over) draw the same numbers
        assert all(torch.equal(noise, group[0]) for noise in group)
    firsts = [group[0] for group in by_key.values()]  # and each coordinate its own
    assert all(not torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])


def test_generator_streams_do_not_depend_on_the_other_axes():
    # dp 2 x cp 2 and dp 2 x cp 1 (and x tp 2): dp rank r draws the same numbers in all three worlds
    per_dp = {}
    for world, tp, cp in ((4, 1, 2), (2, 1, 1), (8, 2, 2)):
        for coords, noise in run_distributed(world, draws, tp, cp, 1, ("dp",)):
            per_dp.setdefault(coords["dp"], []).append(noise)
    assert sorted(per_dp) == [0, 1]
    assert all(torch.equal(noise, noises[0]) for noises in per_dp.values() for noise in noises)
    unvaried = run_distributed(2, draws, 1, 1, 1, ())
    assert all(torch.equal(noise, torch.randn(6, generator=torch.Generator().manual_seed(7))) for _, noise in unvaried)


def bad_generator(seed, vary_over):
    wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2)).generator(seed, vary_over)


@pytest.mark.parametrize(
    "seed, vary_over, error, match",
    [
        (1.5, ("dp",), TypeError, r"seed must be an int, got float 1\.5"),
        (-1, ("dp",), ValueError, r"seed=-1 must be >= 0"),
        (2**64, ("dp",), ValueError, r"seed=18446744073709551616 must be < 2\*\*64"),
        (
            0,
            ("dq",),
            KeyError,
            r"vary_over=\('dq',\) names 'dq'; the axes to vary over are \['tp', 'cp', 'pp', 'cfg', 'dp'\]",
        ),
        (0, ("cp_ring",), KeyError, r"names 'cp_ring'"),
        (0, (3,), TypeError, r"vary_over holds axis names \(str\), got int 3"),
    ],
)
def test_generator_refuses_bad_arguments_on_every_rank(seed, vary_over, error, match):
    raised_everywhere(run_distributed(2, bad_generator, seed, vary_over, return_exceptions=True), error, match)
