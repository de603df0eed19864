"""``wf-mesh plan`` / ``demo``: the plan view, one-line errors, the demo launch and watch, the demo's checks.

Tests marked ``slow`` start processes of their own (the CLI, torchrun); ``pytest -m "not slow"`` skips them.
"""

import json
import re
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

import wf_mesh
from wf_mesh import cli, demo
from wf_mesh.testing import run_distributed
from wf_mesh.viz import TopologyView, mesh_axes

from helpers import listed_groups

TIMEOUT = 240  # seconds for a process of the CLI; the demo starts N python processes that each import torch


def run_cli(*args, timeout=TIMEOUT):
    return subprocess.run(
        [sys.executable, "-m", "wf_mesh.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


# ---- plan -------------------------------------------------------------------------------------------
def test_plan_prints_the_topology_view(capsys):
    assert cli.main(["plan", "--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    dims = wf_mesh.ParallelDims(tp=2, cp=2, pp=2).resolve(16)
    assert out == str(TopologyView(dims)) + "\n"
    assert listed_groups(out) == {axis: dims.groups(axis) for axis in mesh_axes(dims)}
    assert "world 16 = tp 2 x cp 2 x pp 2 x dp 2" in out and "rank = tp + 2*cp + 4*pp + 8*dp" in out


def test_plan_cfg_2_prints_the_cfg_groups(capsys):
    assert cli.main(["plan", "--world-size", "8", "--tp", "2", "--cfg", "2"]) == 0
    out = capsys.readouterr().out
    dims = wf_mesh.ParallelDims(tp=2, cfg=2).resolve(8)
    assert out == str(TopologyView(dims)) + "\n"
    listed = listed_groups(out)
    assert list(listed) == list(mesh_axes(dims)) and {"cfg", "dp_cfg_cp"} <= set(listed)
    assert listed == {axis: dims.groups(axis) for axis in mesh_axes(dims)}
    assert listed["cfg"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and listed["dp_cfg_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert "world 8 = tp 2 x cp 1 x pp 1 x cfg 2 x dp 2, order tp-cp-pp-cfg-dp" in out
    assert "rank = tp + 2*cfg + 4*dp" in out


def test_degree_flags_come_from_the_axis_table(monkeypatch):
    """Every table row is a flag of plan and demo; dims_from_args reads them back, and degree_args is the
    inverse; a new row (an extra test row here) is a new flag with no other change."""
    import argparse

    from wf_mesh import topology

    parser = argparse.ArgumentParser()
    cli.add_degree_flags(parser)
    flags = {a for action in parser._actions for a in action.option_strings} - {"-h", "--help"}
    assert flags == {*(a.flag for a in topology.AXIS_TABLE), "--cp-ulysses", "--order"}
    args = parser.parse_args(["--tp", "2", "--cfg", "2", "--cp", "4", "--cp-ulysses", "2", "--order", "cp-tp-pp-dp"])
    dims = cli.dims_from_args(args)
    assert dims == wf_mesh.ParallelDims(tp=2, cp=4, cp_ulysses=2, cfg=2, order="cp-tp-pp-dp")
    assert cli.degree_args(dims) == [
        *("--tp", "2", "--cp", "4", "--pp", "1", "--cfg", "2", "--cp-ulysses", "2"),
        *("--order", "cp-tp-pp-cfg-dp"),
    ]
    assert cli.dims_from_args(parser.parse_args(cli.degree_args(dims))) == dims
    assert cli.degree_args(wf_mesh.ParallelDims(tp=2)) == [
        "--tp",
        "2",
        "--cp",
        "1",
        "--pp",
        "1",
        "--order",
        "tp-cp-pp-dp",
    ]
    plan = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.values())
    assert {a.flag for a in topology.AXIS_TABLE} <= {o for action in plan._actions for o in action.option_strings}

    row = topology.Axis("ep", 1, "expert-parallel degree", optional=True)
    monkeypatch.setattr(cli, "AXIS_TABLE", (*topology.AXIS_TABLE, row))
    extra = argparse.ArgumentParser()
    cli.add_degree_flags(extra)
    assert extra.parse_args(["--ep", "4"]).ep == 4
    assert "expert-parallel degree (default 1)" in extra.format_help()


def test_plan_honours_order_dp_and_cp_ulysses(capsys):
    args = [
        "plan",
        "--world-size",
        "32",
        "--tp",
        "2",
        "--cp",
        "4",
        "--cp-ulysses",
        "2",
        "--dp",
        "4",
        "--order",
        "dp-cp-tp-pp",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    dims = wf_mesh.ParallelDims(tp=2, cp=4, dp=4, cp_ulysses=2, order="dp-cp-tp-pp").resolve(32)
    assert out == str(TopologyView(dims)) + "\n"
    listed = listed_groups(out)  # the first groups of each axis (as many as fit the width)
    assert list(listed) == list(mesh_axes(dims))
    assert all(groups and groups == dims.groups(axis)[: len(groups)] for axis, groups in listed.items())
    assert "cp 4 (cp_ring 2 x cp_ulysses 2)" in out and "cp_ulysses (16 groups of 2)" in out


@pytest.mark.parametrize(
    "world, degrees, order, layout",
    [
        (8, {"tp": 2, "cp": 2, "pp": 2}, "tp-cp-ep-dp-pp", "tp-cp-dp-pp"),  # Megatron's default
        (8, {"tp": 2, "pp": 2}, "tp-pp-dp", "tp-pp-dp-cp"),  # cp 1 may be left out, as in Megatron
        (8, {"cp": 2, "pp": 2}, "tp-cp-ep-pp-dp", "tp-cp-pp-dp"),
    ],
)
def test_plan_takes_megatrons_orders_as_initialize_model_parallel_does(capsys, world, degrees, order, layout):
    """One ParallelDims judges both (``ep``, expert parallelism of degree 1, is accepted and dropped): the plan
    printed is the groups Megatron's initialize_model_parallel builds with that order."""
    flags = [arg for axis, n in degrees.items() for arg in (f"--{axis}", str(n))]
    assert cli.main(["plan", "--world-size", str(world), *flags, "--order", order]) == 0
    dims = wf_mesh.ParallelDims(**degrees, order=order).resolve(world)
    assert dims.axis_order == tuple(layout.split("-"))
    assert capsys.readouterr().out == str(TopologyView(dims)) + "\n"
    built = run_distributed(world, _megatron_groups, order, degrees)
    assert built == [{axis: dims.group_of(axis, rank) for axis in ("tp", "cp", "pp", "dp")} for rank in range(world)]


def _megatron_groups(order, degrees):
    from wf_mesh import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=degrees.get("tp", 1),
        pipeline_model_parallel_size=degrees.get("pp", 1),
        context_parallel_size=degrees.get("cp", 1),
        order=order,
    )
    mesh = wf_mesh.get_parallel_mesh()
    return {axis: mesh.ranks(axis) for axis in ("tp", "cp", "pp", "dp")}


def test_plan_one_axis_highlight_limits_and_html(capsys, tmp_path):
    page = tmp_path / "plan.html"
    args = [
        "plan",
        "--world-size",
        "64",
        "--tp",
        "4",
        "--axis",
        "dp_cp",
        "--highlight",
        "5",
        "--max-rows",
        "2",
        "--max-cols",
        "2",
        "--html",
        str(page),
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    view = TopologyView(wf_mesh.ParallelDims(tp=4).resolve(64), "dp_cp", highlight=5, max_rows=2, max_cols=2)
    assert out == f"{view}\nwrote {page}\n"
    assert "showing 2 of 16 rows and 2 of 4 columns (4 of 64 ranks; the others are left out)" in out
    assert "dp1  4  5* ...   0 1 ..." in out
    head = "<!doctype html><meta charset='utf-8'><meta name='color-scheme' content='light dark'><title>wf-mesh plan</title>"
    assert page.read_text() == f"{head}{view._repr_html_()}\n"  # the page follows a dark scheme too


def test_plan_of_a_billion_ranks_is_cut_not_a_memory_error(capsys):
    assert cli.main(["plan", "--world-size", "1000000000", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "showing 16 of 125000000 rows and 8 of 8 columns (128 of 1000000000 ranks; the others are left out)" in out
    assert "tp_cp_dp           1  1000000000  0=[0-999999999]" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--world-size", "12", "--tp", "2", "--cp", "2", "--pp", "2"],
            "world_size=12 is not divisible by tp*cp*pp = 2*2*2 = 8; cannot infer dp",
        ),
        (
            ["--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--dp", "3"],
            "tp*cp*pp*dp = 2*2*2*3 = 24 != world_size=16",
        ),
        (
            ["--world-size", "16", "--tp", "2", "--order", "tp-xx"],
            "bad order 'tp-xx': unknown axes ['xx'], repeated axes []; use a permutation of tp-cp-pp-cfg-dp (the "
            "optional axes may be left out)",
        ),
        (["--world-size", "8", "--tp", "0"], "tp=0 must be >= 1 (dp may be -1 to infer it); tp=0, cp=1, pp=1, dp=-1"),
        (
            ["--world-size", "8", "--cp", "4", "--cp-ulysses", "3"],
            "cp_ulysses=3 must divide cp=4 (cp = cp_ring x cp_ulysses)",
        ),
        (
            ["--world-size", "8", "--axis", "nope"],
            (
                "unknown axis 'nope' in 'nope'; axes are ['tp', 'cp', 'pp', 'cfg', 'dp'], sub-axes ['cp_ulysses', "
                "'cp_ring'], derived axes ['tp_cp', 'dp_cp', 'tp_pp', 'tp_cp_dp', 'tp_dp', 'dp_cfg_cp']"
            ),
        ),
        (["--world-size", "8", "--cfg", "3"], "cfg=3 must be one of [1, 2]; tp=1, cp=1, pp=1, cfg=3, dp=-1"),
        (
            ["--world-size", "6", "--cfg", "2", "--tp", "2"],
            "world_size=6 is not divisible by tp*cp*pp*cfg = 2*1*1*2 = 4; cannot infer dp",
        ),
        (["--world-size", "8", "--highlight", "8"], "highlight rank 8 is out of range for world size 8"),
        (["--world-size", "8", "--max-rows", "0"], "argument --max-rows: must be > 0, got 0"),
        (["--world-size", "1e9"], "argument --world-size: invalid int value: '1e9'"),
        ([], "the following arguments are required: --world-size"),
        (
            ["--world-size", "8", "--html", "/nonexistent/dir/plan.html"],
            "--html /nonexistent/dir/plan.html: No such file or directory",
        ),
    ],
)
def test_bad_plan_is_one_line_exit_2(capsys, args, message):
    try:
        code = cli.main(["plan", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err == f"wf-mesh plan: error: {message}\n"


def test_plan_reports_what_the_view_cannot_do_in_one_line(capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr("wf_mesh.viz.TopologyView.__str__", out_of_memory)
    assert cli.main(["plan", "--world-size", "4"]) == 2
    assert capsys.readouterr().err == (
        "wf-mesh plan: error: cannot show this plan (ParallelDims(tp=1, cp=1, pp=1, dp=4, order='tp-cp-pp-dp')): "
        "MemoryError: no room\n"
    )


PLAN_PROBE = """
import json, sys
from wf_mesh import cli
codes = [cli.main(["plan", "--world-size", "16", "--tp", "2", "--cp", "2"])]
codes.append(cli.main(["plan", "--world-size", "1000000", "--tp", "8", "--cp", "4", "--cp-ulysses", "2"]))
codes.append(cli.main(["plan", "--world-size", "12", "--tp", "5"]))
for argv in (["plan"], ["demo", "--nproc", "4", "--tp", "3"], ["nope"]):
    try:
        codes.append(cli.main(argv))
    except SystemExit as e:
        codes.append(e.code)
from wf_mesh.viz import PlacementView
str(PlacementView.plan((2, 16, 8, 44, 80), (2, 4), ["R", "S(2)"]))
print(json.dumps({"codes": codes, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}),
      file=sys.stderr)
"""


@pytest.mark.slow
def test_plan_and_argument_errors_do_not_import_torch():
    probe = subprocess.run([sys.executable, "-c", PLAN_PROBE], capture_output=True, text=True, timeout=60, check=False)
    report = json.loads(probe.stderr.strip().splitlines()[-1])
    assert report["codes"] == [0, 0, 2, 2, 2, 2]
    assert report["torch"] == []  # plan, the views' plans, and every argument error: no torch import
    ok = run_cli("plan", "--world-size", "16", "--tp", "2", "--cp", "2", timeout=60)
    assert ok.returncode == 0 and ok.stderr == ""
    assert ok.stdout.startswith("world 16 = tp 2 x cp 2 x pp 1 x dp 4, order tp-cp-pp-dp (fastest first)\n")


# ---- demo: the command, its watch and bad input -----------------------------------------------------
def test_demo_command_uses_torch_launcher_in_process():
    dims = wf_mesh.ParallelDims(tp=2, cp=2).resolve(8)
    cmd = cli.demo_command(8, dims)
    assert cmd == [
        sys.executable,
        "-m",
        "wf_mesh.demo",
        "launch",
        "--standalone",
        "--nproc-per-node",
        "8",
        "-m",
        "wf_mesh.demo",
        "--tp",
        "2",
        "--cp",
        "2",
        "--pp",
        "1",
        "--order",
        "tp-cp-pp-dp",
    ]
    ulysses = cli.demo_command(4, wf_mesh.ParallelDims(cp=4, cp_ulysses=2).resolve(4))
    assert ulysses[-6:] == ["--pp", "1", "--cp-ulysses", "2", "--order", "tp-cp-pp-dp"]


def test_multinode_demo_command_uses_torchrun_rendezvous():
    dims = wf_mesh.ParallelDims(tp=2, cp=2).resolve(4)
    cmd = cli.demo_command(
        2, dims, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400", rdzv_id="job7", rdzv_timeout=12.5
    )
    assert cmd[4:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
        "--rdzv-id",
        "job7",
        "--rdzv-conf",
        "join_timeout=13,timeout=13",
        "--nproc-per-node",
        "2",
        "-m",
        "wf_mesh.demo",
        "--tp",
        "2",
        "--cp",
        "2",
        "--pp",
        "1",
        "--order",
        "tp-cp-pp-dp",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3"], "--nproc 2: world_size=2 is not divisible by tp*cp*pp = 3*1*1 = 3; cannot infer dp"),
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT (a host every node reaches), got None"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "host"],
            "--nnodes 2 needs --rdzv-endpoint HOST:PORT (a host every node reaches), got 'host'",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static"],
            "--rdzv-backend static needs --node-rank in [0, 2), got None",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--tp", "8"],
            "--nnodes 2 x --nproc 2: world_size=4 is not divisible by tp*cp*pp = 8*1*1 = 8; cannot infer dp",
        ),
        (["--nnodes", "0"], "--nnodes 0 and --nproc 2 must be >= 1"),
        (["--rdzv-timeout", "0"], "argument --rdzv-timeout: must be > 0, got 0"),
        (["--rdzv-timeout", "soon"], "argument --rdzv-timeout: invalid float value: 'soon'"),
    ],
)
def test_bad_demo_is_one_line_exit_2_before_launching(capsys, monkeypatch, args, message):
    monkeypatch.setattr(cli, "ProcessTree", lambda *a, **k: pytest.fail(f"launched {a}"))
    try:
        code = cli.main(["demo", "--nproc", "2", *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"wf-mesh demo: error: {message}\n"


def _watch_args(**overrides):
    args = {
        "nproc": 2,
        "nnodes": 1,
        "rdzv_timeout": 300.0,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": None,
        "rdzv_id": "job",
    }
    return Namespace(**{**args, **overrides})


def _progress(folder, stages):
    for rank, stage in enumerate(stages):
        (folder / str(rank)).write_text(stage)


def test_demo_watch_shows_progress_and_gives_up_after_the_rendezvous_timeout(tmp_path, capsys):
    watch = cli._DemoWatch(_watch_args(nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_timeout=0.05), str(tmp_path))
    watch.tick()
    assert capsys.readouterr().out == (
        "wf-mesh demo: [0 s] waiting for 2 nodes to join the c10d rendezvous at 10.0.0.1:29400 (id job); "
        "giving up after 0.05 s (--rdzv-timeout)\n"
    )
    time.sleep(0.1)
    with pytest.raises(cli._Failure) as failure:
        watch.tick()
    assert str(failure.value) == (
        "gave up after 0.05 s waiting for 2 nodes to join the c10d rendezvous at 10.0.0.1:29400 (id job); is it "
        "running on every node, with the same --rdzv-endpoint and --rdzv-id?"
    )
    # the workers started and imported torch, but the other node's never joined the gloo world
    watch = cli._DemoWatch(_watch_args(nnodes=2, rdzv_timeout=0.05), str(tmp_path))
    _progress(tmp_path, ["started", "imported"])
    watch.tick()
    _progress(tmp_path, ["imported", "imported"])
    watch.tick()
    assert capsys.readouterr().out.splitlines() == [
        "wf-mesh demo: [0 s] local workers: 2/2 started, 1/2 imported torch, 0/2 joined",
        (
            "wf-mesh demo: [0 s] local workers: 2/2 started, 2/2 imported torch, 0/2 joined; waiting for all 4 ranks "
            "to join the gloo world"
        ),
    ]
    time.sleep(0.1)
    with pytest.raises(
        cli._Failure,
        match=r"^gave up after 0.05 s waiting for all 4 ranks to join the gloo world "
        r"\(0 of the 2 local ones joined\)$",
    ):
        watch.tick()
    # once every local worker joined, rank 0 speaks: no more progress lines
    _progress(tmp_path, ["joined", "done"])
    watch.tick()
    assert capsys.readouterr().out == ""


def test_demo_module_outside_a_launcher(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert demo.main(["--tp", "2"]) == 2
    assert (
        capsys.readouterr().err
        == "wf_mesh.demo: error: WORLD_SIZE is not set; run it with `wf-mesh demo` or torchrun\n"
    )


def test_format_report():
    reports = [
        {
            "rank": r,
            "coords": {"tp": r % 2, "cp": r // 2},
            "groups": {"tp": [r - r % 2, r - r % 2 + 1], "tp_cp": [0, 1, 2, 3]},
        }
        for r in range(4)
    ]
    assert demo.format_report(reports) == (
        "each rank's coordinates and its group on every axis (as the mesh built them):\n"
        "rank  tp  cp  |  tp     tp_cp\n"
        "   0   0   0  |  [0,1]  [0-3]\n"
        "   1   1   0  |  [0,1]  [0-3]\n"
        "   2   0   1  |  [2,3]  [0-3]\n"
        "   3   1   1  |  [2,3]  [0-3]"
    )


# ---- the demo's checks on the pooled cluster: judged by their data ---------------------------------
def _fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise demo.CheckFailed("wrong answer")
    return demo.AllReduceResult({})


def _skips(ctx):
    raise demo.CheckSkipped("nothing to do here")


def _demo_outcomes(dims):
    ctx = demo.DemoContext.from_mesh(wf_mesh.init_parallel(dims))
    echoed = []
    return demo.run_checks(ctx, echo=echoed.append), echoed


def _reference_fsdp_ema(world, steps, beta):
    """The demo's MLP trained in this process on the whole batch, with a plain float32 EMA."""
    model = demo.tiny_mlp()
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        xs, ys = demo.fsdp_batch(step, world)
        torch.nn.functional.mse_loss(model(xs.flatten(0, 1)), ys.flatten(0, 1)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n] = beta * ema[n] + (1 - beta) * p
    return {n: p.detach() for n, p in model.named_parameters()}, ema


DEMO_DIMS = [
    wf_mesh.ParallelDims(cp=2, pp=2, cp_ulysses=2, order="pp-cp-tp-dp"),  # every check runs, cp split, odd order
    wf_mesh.ParallelDims(tp=2),  # dp=2: FSDP2 over 2 ranks; pp=1: the ring is skipped
]


@pytest.mark.parametrize("dims", DEMO_DIMS, ids=["cp2-pp2-ulysses2", "tp2"])
def test_demo_checks_measure_what_one_process_computes(dims):
    plan = dims.resolve(4)
    axes = mesh_axes(plan)
    weights, ema = _reference_fsdp_ema(plan.dp * plan.cp, steps=3, beta=0.9)
    for rank, (outcomes, echoed) in enumerate(run_distributed(4, _demo_outcomes, dims)):
        assert [o.check for o in outcomes] == [c.__name__ for c in demo.CHECKS]
        assert [o.status for o in outcomes] == ["ok"] * 4 + ["ok" if plan.pp > 1 else "skip"]
        assert echoed[::2] == [f"[{i}/5] {c.__name__[6:].replace('_', ' ')} ..." for i, c in enumerate(demo.CHECKS, 1)]
        assert echoed[1::2] == [o.line for o in outcomes]
        topology, all_reduce, video, fsdp, ring = (o.result for o in outcomes)
        assert topology.coords == plan.coords(rank)
        assert topology.groups == {axis: plan.group_of(axis, rank) for axis in axes}
        assert all_reduce.sums == {axis: sum(plan.group_of(axis, rank)) for axis in axes}
        latent, pos = demo.video_inputs(plan.cp)
        assert torch.equal(video.restored, latent)
        torch.testing.assert_close(video.output, torch.tanh(latent) + pos.permute(3, 0, 1, 2), atol=1e-6, rtol=0)
        t, h, w = latent.shape[2:]
        blocks = (2, 1) if plan.cp == 2 else (1, 1)  # T=4 takes gcd(4, cp) of cp
        assert (video.cp_t, video.cp_h, video.local_tokens) == (*blocks, t * h * w // plan.cp)
        assert fsdp.fsdp_size == plan.dp * plan.cp
        for name in weights:
            torch.testing.assert_close(fsdp.weights[name], weights[name], atol=1e-5, rtol=0)
            torch.testing.assert_close(fsdp.ema[name], ema[name], atol=1e-5, rtol=0)
        if plan.pp > 1:
            stage, pipeline = plan.coords(rank)["pp"], plan.group_of("pp", rank)
            assert (ring.ring, ring.stage) == (pipeline, stage)
            assert ring.received == ([plan.pp, sum(pipeline)] if stage == 0 else [stage, sum(pipeline[:stage])])
        else:
            assert ring is None and outcomes[4].message.startswith("pipeline ring: pp=1, a single stage")


def _run_checks_with_a_failure():
    ctx = demo.DemoContext.from_mesh(wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2)))
    return demo.run_checks(ctx, [demo.check_topology, _skips, _fails_on_rank_1, demo.check_all_reduce])


def test_run_checks_agrees_on_failures_across_ranks():
    results = run_distributed(4, _run_checks_with_a_failure)
    for outcomes in results:
        agreed = [(o.check, o.status, o.message, o.seconds, o.failed_ranks) for o in outcomes]
        assert agreed == [(o.check, o.status, o.message, o.seconds, o.failed_ranks) for o in results[0]]  # times too
        assert [o.status for o in outcomes] == ["ok", "skip", "fail"]  # stopped: check_all_reduce did not run
        assert (outcomes[1].message, outcomes[1].result) == ("nothing to do here", None)
        assert (outcomes[2].check, outcomes[2].failed_ranks) == ("_fails_on_rank_1", (1,))
        assert (outcomes[2].message, outcomes[2].result) == ("rank 1: wrong answer", None)


def test_console_lines_of_outcomes_and_results():
    """The demo's console format, once: each outcome's line, each result's summary."""
    assert demo.Outcome("check_x", "ok", "all good", 1.234).line == "ok   all good (1.23 s)"
    assert demo.Outcome("check_x", "skip", "nothing here", 0.004).line == "skip nothing here (0.00 s)"
    failed = demo.Outcome("check_x", "fail", "rank 1: wrong; rank 3: worse", 0.5, (1, 3))
    assert failed.line == "FAIL check_x on ranks [1, 3] (0.50 s): rank 1: wrong; rank 3: worse"
    groups = {axis: [0] for axis in ("tp", "cp", "pp")}
    assert demo.TopologyResult("pp-cp-tp-dp", {}, groups).summary == (
        "topology: coords and groups of 3 axes match ParallelDims (order pp-cp-tp-dp)"
    )
    assert demo.AllReduceResult({"tp": 1, "cp": 2}).summary == (
        "all-reduce: SUM of the global rank over each group of 2 axes = the sum of its ranks"
    )
    video = demo.VideoSplitResult((2, 4, 4, 8, 6), 2, 2, 1, (2, 8, 6), 96, torch.zeros(0), torch.zeros(0), 0.0)
    assert video.summary == (
        "cp video split: (2, 4, 4, 8, 6) latent over cp=2 = 2 (T) x 1 (H) blocks of (2, 8, 6); "
        "gather(tanh(x) + pos) = one process (err 0e+00)"
    )
    fsdp = demo.FsdpEmaResult(3, 0.9, 2, {"w": torch.zeros(16, 8), "b": torch.zeros(4)}, {}, 3e-8)
    assert fsdp.summary == (
        "fsdp2 + ema: 3 AdamW steps, 132-param MLP sharded over dp_cfg_cp (2 ranks); EMA full weights = one process "
        "(err 3e-08)"
    )
    ring = demo.PipelineRingResult([0, 1], 0, [2, 1], 2)
    assert ring.summary == "pipeline ring: a token went around 2 pp rings (0 -> 1 -> 0 here) via PipelineP2P"
    ok, skipped = demo.Outcome("check_topology", "ok", "", 1.0), demo.Outcome("check_pipeline_ring", "skip", "", 0)
    assert demo.format_summary(4, [ok, ok, ok, ok, skipped], 3.482, 16.1) == (
        "demo OK: 4 ranks, 4 of 5 checks passed, 1 skipped (pipeline ring); 3.48 s from joining to the last check, "
        "16.10 s since this worker started (torch import included)"
    )
    assert demo.format_summary(1, [ok], 0.5, 9.0).startswith("demo OK: 1 rank, 1 of 1 checks passed; 0.50 s")


def test_demo_says_how_long_the_whole_run_took(tmp_path):
    watch = cli._DemoWatch(_watch_args(), str(tmp_path))
    watch.start -= 37.04  # launched 37 s ago
    assert watch.finished(0) == "done after 37.0 s (torchrun, the workers' torch import and the checks)"
    assert watch.finished(1).startswith("exit code 1 after 37.0 s")


# ---- demo: one real run (torchrun, 4 CPU processes) -------------------------------------------------
@pytest.mark.slow
def test_demo_runs_every_check_under_torchrun():
    """pp=2 (the ring runs), cp=2 split as 2 Ulysses x 1 ring, order pp-cp-tp-dp: judged by its exit code and
    each check's status (the checks' data are compared with one process above, their lines formatted once)."""
    cmd = [sys.executable, "-m", "wf_mesh.cli", "demo", "--nproc", "4", "--cp", "2", "--pp", "2", "--cp-ulysses",
           "2", "--order", "pp-cp-tp-dp"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)  # the bound is for hangs only
    out = proc.stdout.splitlines()
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert out[0] == (
        "wf-mesh demo: launching 4 CPU processes on this machine with torchrun: "
        "ParallelDims(tp=1, cp=2, pp=2, dp=1, cp_ulysses=2, order='pp-cp-tp-dp')"
    )
    assert any("local workers: 4/4 started" in line for line in out if line.startswith("wf-mesh demo: ["))
    assert (
        "wf-mesh demo: 4 ranks on gloo/cpu, ParallelDims(tp=1, cp=2, pp=2, dp=1, cp_ulysses=2, order='pp-cp-tp-dp')"
        in out
    )
    statuses = [line.split()[0] for line in out if line.startswith(("ok ", "skip ", "FAIL "))]
    assert statuses == ["ok"] * 5
    assert "axes match ParallelDims (order pp-cp-tp-dp) (" in proc.stdout  # the order shown, cfg 1 hidden
    assert out[-2].startswith("demo OK: 4 ranks, 5 of 5 checks passed; ")
    seconds = [float(t) for t in re.findall(r"(\d+\.\d+) s", out[-2])]  # from joining; since the worker started
    total = float(re.fullmatch(r"wf-mesh demo: done after (\d+\.\d) s \(torchrun, .*\)", out[-1]).group(1))
    assert seconds[0] <= seconds[1] <= total + 0.1  # each time contains the one before (0.1: the rounding)
