"""``wf-mesh plan`` / ``wf-mesh demo``, the text view of a plan, and the demo's check runner."""

import ast
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

import wf_mesh
from wf_mesh import cli, demo
from wf_mesh.testing import run_distributed
from wf_mesh.viz import PLAN_AXES, format_plan, format_ranks

TIMEOUT = 180  # seconds; the demo starts N python processes that each import torch


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "wf_mesh.cli", *args], capture_output=True, text=True, timeout=TIMEOUT
    )


def plan_groups(output: str) -> dict[str, list[list[int]]]:
    """The group lists printed for each axis by format_plan."""
    groups = {}
    for line in output.splitlines():
        words = line.split()
        if words and words[0] in PLAN_AXES and "group" in line:
            groups[words[0]] = [ast.literal_eval(g) for g in re.findall(r"\[[\d, ]+\]", line)]
    return groups


# ---- plan -------------------------------------------------------------------------------------------
def test_plan_prints_every_group(capsys):
    assert cli.main(["plan", "--world-size", "8", "--tp", "2", "--cp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    dims = wf_mesh.ParallelDims(tp=2, cp=2, pp=2).resolve(8)
    assert plan_groups(out) == {axis: dims.groups(axis) for axis in PLAN_AXES}
    assert "world size 8 = tp 2 x cp 2 x pp 2 x dp 1" in out
    assert "rank = tp + 2*cp + 4*pp" in out


def test_plan_honours_order_and_dp(capsys):
    args = ["plan", "--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--dp", "2", "--order", "dp-pp-cp-tp"]
    assert cli.main(args) == 0
    dims = wf_mesh.ParallelDims(tp=2, cp=2, pp=2, dp=2, order="dp-pp-cp-tp").resolve(16)
    assert plan_groups(capsys.readouterr().out) == {axis: dims.groups(axis) for axis in PLAN_AXES}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "12", "--tp", "2", "--cp", "2", "--pp", "2"], ["world_size=12", "tp=2", "cp=2", "pp=2"]),
        (["--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--dp", "3"], ["tp=2, cp=2, pp=2, dp=3", "world_size=16"]),
        (["--world-size", "16", "--tp", "2", "--order", "tp-xx"], ["'tp-xx'"]),
        (["--world-size", "8", "--tp", "0"], ["tp=0"]),
    ],
)
def test_bad_plan_is_one_line_exit_2(capsys, args, words):
    assert cli.main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wf-mesh plan: error: ")
    for word in words:
        assert word in lines[0]


def test_plan_as_a_process():
    ok = run_cli("plan", "--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2")
    assert ok.returncode == 0 and "tp_cp_dp" in ok.stdout
    bad = run_cli("plan", "--world-size", "12", "--tp", "2", "--cp", "2", "--pp", "2")
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        "wf-mesh plan: error: world_size=12 is not divisible by tp*cp*pp=8 (tp=2, cp=2, pp=2); cannot infer dp"
    )


# ---- text view --------------------------------------------------------------------------------------
def test_format_plan_truncates_large_worlds():
    dims = wf_mesh.ParallelDims(tp=8, cp=8, pp=16).resolve(100352)
    text = format_plan(dims)
    assert len(text.splitlines()) < 40
    assert max(len(line) for line in text.splitlines()) < 140
    assert "1567 (dp, pp) pairs more not shown (1568 in all)" in text
    assert "... (12544 groups)" in text
    groups = plan_groups(text)
    assert groups["tp"][0] == dims.groups("tp")[0]


def test_format_plan_small_world_shows_every_rank():
    dims = wf_mesh.ParallelDims(tp=4, cp=2, pp=2).resolve(64)
    text = format_plan(dims)
    assert "not shown" not in text
    grid = text.split("groups (")[0]
    cells = [int(n) for run in re.findall(r"cp\d+((?: +\d+)+)", grid) for n in run.split()]
    assert sorted(cells) == list(range(64))


def test_format_plan_needs_resolved_dims():
    with pytest.raises(ValueError, match="resolve"):
        format_plan(wf_mesh.ParallelDims(tp=2))


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 8, 9]) == "[0-3,8,9]"
    assert format_ranks([0, 4]) == "[0,4]"
    assert format_ranks(range(0, 40, 2), max_ranks=4) == "[0,2,4,...,38]"


# ---- demo -------------------------------------------------------------------------------------------
def test_demo_runs_on_local_processes():
    result = run_cli("demo", "--nproc", "4", "--tp", "2", "--cp", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo OK: 4 ranks, 9 axes checked in" in result.stdout
    assert "FAIL" not in result.stdout


def test_demo_with_pp_and_another_order():
    result = run_cli("demo", "--nproc", "4", "--cp", "2", "--pp", "2", "--order", "pp-cp-tp-dp")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "order pp-cp-tp-dp" in result.stdout
    assert "demo OK: 4 ranks" in result.stdout


def test_bad_demo_exits_2_before_launching(capsys, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError(f"launched {args}")

    monkeypatch.setattr(cli.subprocess, "run", no_launch)
    assert cli.main(["demo", "--nproc", "4", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "wf-mesh demo: error: --nproc 4: world_size=4 is not divisible by tp*cp*pp=3 (tp=3, cp=1, pp=1); "
        "cannot infer dp"
    )


def test_demo_command_uses_torch_launcher():
    dims = wf_mesh.ParallelDims(tp=2, cp=2).resolve(8)
    cmd = cli.demo_command(8, dims)
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8"]
    assert cmd[6:] == ["-m", "wf_mesh.demo", "--tp", "2", "--cp", "2", "--pp", "1", "--order", "tp-cp-pp-dp"]


def test_demo_module_outside_a_launcher(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert demo.main(["--tp", "2"]) == 2
    assert "WORLD_SIZE is not set" in capsys.readouterr().err


def _fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise demo.CheckFailed("wrong answer")
    return "fine"


def _run_checks_with_a_failure():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2))
    ctx = demo.DemoContext(mesh=mesh, dims=mesh.dims, rank=dist.get_rank(), world_size=dist.get_world_size())
    passing = demo.run_checks(ctx)
    failing = demo.run_checks(ctx, [demo.check_topology, _fails_on_rank_1, demo.check_all_reduce])
    return passing, failing


def test_run_checks_agrees_on_failures_across_ranks():
    results = run_distributed(4, _run_checks_with_a_failure)
    for passing, failing in results:
        assert passing == results[0][0] and passing[0] is True and len(passing[1]) == len(demo.CHECKS)
        assert failing == results[0][1]
        ok, lines = failing
        assert ok is False and len(lines) == 2  # stopped at the failure: check_all_reduce did not run
        assert lines[0].startswith("ok   topology")
        assert lines[1] == "FAIL _fails_on_rank_1 on ranks [1]: rank 1: wrong answer"
