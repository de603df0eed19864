"""``wf-mesh plan`` / ``demo``: the plan view, one-line errors, the demo launch and watch, the demo's checks.

Tests marked ``slow`` start processes of their own (the CLI, torchrun); ``pytest -m "not slow"`` skips them.
"""

import json
import re
import resource
import subprocess
import sys
import time
from argparse import Namespace

import pytest

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
    assert "dp1  4 5* ...   0 1 ..." in out
    assert page.read_text() == f"<!doctype html><meta charset='utf-8'><title>wf-mesh plan</title>{view._repr_html_()}\n"


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
            "bad order 'tp-xx': unknown axes ['xx'], repeated axes []; use a permutation of tp-cp-pp-dp",
        ),
        (["--world-size", "8", "--tp", "0"], "tp=0 must be >= 1 (dp may be -1 to infer it); tp=0, cp=1, pp=1, dp=-1"),
        (
            ["--world-size", "8", "--cp", "4", "--cp-ulysses", "3"],
            "cp_ulysses=3 must divide cp=4 (cp = cp_ring x cp_ulysses)",
        ),
        (
            ["--world-size", "8", "--axis", "nope"],
            (
                "unknown axis 'nope' in 'nope'; axes are ['tp', 'cp', 'pp', 'dp'], sub-axes ['cp_ulysses', 'cp_ring'], "
                "derived axes ['tp_cp', 'dp_cp', 'tp_pp', 'tp_cp_dp', 'tp_dp']"
            ),
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
import json, sys, time
from wf_mesh import cli
codes = [cli.main(["plan", "--world-size", "16", "--tp", "2", "--cp", "2"])]
start = time.perf_counter()
codes.append(cli.main(["plan", "--world-size", "1000000", "--tp", "8", "--cp", "4", "--cp-ulysses", "2"]))
million = time.perf_counter() - start
codes.append(cli.main(["plan", "--world-size", "12", "--tp", "5"]))
for argv in (["plan"], ["demo", "--nproc", "4", "--tp", "3"], ["nope"]):
    try:
        codes.append(cli.main(argv))
    except SystemExit as e:
        codes.append(e.code)
from wf_mesh.viz import PlacementView
str(PlacementView.plan((2, 16, 8, 44, 80), (2, 4), ["R", "S(2)"]))
print(json.dumps({"codes": codes, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
                  "million_s": million}), file=sys.stderr)
"""


@pytest.mark.slow
def test_plan_and_argument_errors_do_not_import_torch_and_plan_is_fast():
    probe = subprocess.run([sys.executable, "-c", PLAN_PROBE], capture_output=True, text=True, timeout=60, check=False)
    report = json.loads(probe.stderr.strip().splitlines()[-1])
    assert report["codes"] == [0, 0, 2, 2, 2, 2]
    assert report["torch"] == []  # plan, the views' plans, and every argument error: no torch import
    assert report["million_s"] < 1.0  # a million ranks render well under a second
    # `wf-mesh plan` of 16 ranks as a process: well under 1 s of CPU (interpreter start included); CPU time,
    # not wall time, because other processes share this machine's cores
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    ok = run_cli("plan", "--world-size", "16", "--tp", "2", "--cp", "2", timeout=60)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert ok.returncode == 0 and ok.stderr == ""
    assert ok.stdout.startswith("world 16 = tp 2 x cp 2 x pp 1 x dp 4, order tp-cp-pp-dp (fastest first)\n")
    assert cpu < 1.0, f"wf-mesh plan took {cpu:.2f} s of CPU ({wall:.2f} s wall)"


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


# ---- the demo's checks on the pooled cluster --------------------------------------------------------
def _fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise demo.CheckFailed("wrong answer")
    return "fine"


def _skips(ctx):
    raise demo.CheckSkipped("nothing to do here")


def _run_checks_with_a_failure():
    ctx = demo.DemoContext.from_mesh(wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2)))
    echoed = []
    passing = demo.run_checks(ctx, echo=echoed.append)
    failing = demo.run_checks(ctx, [demo.check_topology, _skips, _fails_on_rank_1, demo.check_all_reduce])
    return passing, failing, echoed


def test_run_checks_agrees_on_failures_across_ranks():
    results = run_distributed(4, _run_checks_with_a_failure)
    for passing, failing, echoed in results:
        assert passing == results[0][0] and failing == results[0][1]  # times too: the slowest rank's, gathered
        assert passing[0] is True and len(passing[1]) == len(demo.CHECKS)
        # tp=2 on 4 ranks: dp=2, so FSDP2 shards over 2 ranks; pp=1, so the ring is skipped
        assert [line[:5] for line in passing[1]] == ["ok   "] * 4 + ["skip "]
        assert "sharded over dp_cp (2 ranks)" in passing[1][3]
        assert re.fullmatch(
            r"skip pipeline ring: pp=1, a single stage has no neighbour to send to \(try --pp 2\) "
            r"\(\d+\.\d\d s\)",
            passing[1][4],
        )
        assert echoed[0] == "[1/5] topology ..." and echoed[1] == passing[1][0] and len(echoed) == 10
        ok, lines = failing
        assert ok is False and len(lines) == 3  # stopped at the failure: check_all_reduce did not run
        assert lines[0].startswith("ok   topology")
        assert re.fullmatch(r"skip nothing to do here \(\d+\.\d\d s\)", lines[1])
        assert re.fullmatch(r"FAIL _fails_on_rank_1 on ranks \[1\] \(\d+\.\d\d s\): rank 1: wrong answer", lines[2])


# ---- demo: one real run (torchrun, 4 CPU processes) -------------------------------------------------
@pytest.mark.slow
def test_demo_runs_every_check_and_tears_down_quickly():
    """pp=2 (the ring runs), cp=2 split as 2 Ulysses x 1 ring, order pp-cp-tp-dp; every line rank 0 prints,
    and the time from "demo OK" to the command's exit (the issue asks for under 2 s)."""
    cmd = [
        sys.executable,
        "-m",
        "wf_mesh.cli",
        "demo",
        "--nproc",
        "4",
        "--cp",
        "2",
        "--pp",
        "2",
        "--cp-ulysses",
        "2",
        "--order",
        "pp-cp-tp-dp",
    ]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, ok_at = [], None
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if line.startswith("demo OK"):
                ok_at = time.monotonic()
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    teardown = time.monotonic() - ok_at if ok_at else None
    out = [line for _, line in lines]
    stderr = proc.stderr.read()
    assert proc.returncode == 0, "\n".join(out) + stderr
    assert stderr == ""
    assert out[0] == (
        "wf-mesh demo: launching 4 CPU processes on this machine with torchrun: "
        "ParallelDims(tp=1, cp=2, pp=2, dp=1, cp_ulysses=2, order='pp-cp-tp-dp')"
    )
    progress = [line for line in out if line.startswith("wf-mesh demo: [")]
    assert any("local workers: 4/4 started" in line for line in progress)
    assert (
        "wf-mesh demo: 4 ranks on gloo/cpu, ParallelDims(tp=1, cp=2, pp=2, dp=1, cp_ulysses=2, order='pp-cp-tp-dp')"
        in out
    )
    header = next(i for i, line in enumerate(out) if line.startswith("rank  "))
    assert out[header].split() == [
        "rank",
        "pp",
        "cp",
        "tp",
        "dp",
        "cp_ulysses",
        "cp_ring",
        "|",
        "tp",
        "cp",
        "pp",
        "dp",
        "cp_ulysses",
        "cp_ring",
        "tp_cp",
        "dp_cp",
        "tp_pp",
        "tp_cp_dp",
        "tp_dp",
    ]
    assert out[header + 3].split() == [
        "2",
        "0",
        "1",
        "0",
        "0",
        "1",
        "0",
        "|",
        "[2]",
        "[0,2]",
        "[2,3]",
        "[2]",
        "[0,2]",
        "[2]",
        "[0,2]",
        "[0,2]",
        "[2,3]",
        "[0,2]",
        "[2]",
    ]
    checks = [line for line in out if re.match(r"\[\d/5\] ", line)]
    assert checks == [
        "[1/5] topology ...",
        "[2/5] all reduce ...",
        "[3/5] cp video split ...",
        "[4/5] fsdp ema ...",
        "[5/5] pipeline ring ...",
    ]
    timed = r" \(\d+\.\d\d s\)"
    results = [line for line in out if line.startswith(("ok ", "skip ", "FAIL "))]
    patterns = [
        r"ok   topology: coords and groups of 11 axes match ParallelDims \(order pp-cp-tp-dp\)",
        r"ok   all-reduce: SUM of the global rank over each group of 11 axes = the sum of its ranks",
        (
            r"ok   cp video split: \(2, 4, 4, 8, 6\) latent over cp=2 = 2 \(T\) x 1 \(H\) blocks of \(2, 8, 6\); "
            r"gather\(tanh\(x\) \+ pos\) = one process \(err 0e\+00\)"
        ),
        (
            r"ok   fsdp2 \+ ema: 3 AdamW steps, 212-param MLP sharded over dp_cp \(2 ranks\); EMA full weights = one "
            r"process \(err \d+e[-+]\d+\)"
        ),
        r"ok   pipeline ring: a token went around 2 pp rings \(0 -> 1 -> 0 here\) via isend_next / recv_prev_data",
    ]
    assert len(results) == 5 and all(re.fullmatch(p + timed, line) for p, line in zip(patterns, results)), results
    assert re.fullmatch(r"demo OK: 4 ranks, 5 checks passed, 0 skipped, in \d+\.\d\d s", out[-1])
    # a hang check, not a timing claim (never assert wall-clock speed on a shared machine): teardown is measured
    # at ~0.2-0.5 s here and reported in the closing notes; before, the launcher's interpreter exit took ~2 s
    assert teardown < 30, f"teardown after 'demo OK' took {teardown:.2f} s"
