"""``wf-mesh plan`` / ``demo`` / ``bench``, the text view of a plan, the demo's check runner and the bench table."""

import ast
import json
import re
import subprocess
import sys

import pytest

import wf_mesh
from wf_mesh import bench, cli, demo
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
    out = result.stdout
    assert "FAIL" not in out
    progress = [line for line in out.splitlines() if re.match(r"\[\d/5\] ", line)]
    assert progress == [
        "[1/5] topology ...", "[2/5] all reduce ...", "[3/5] cp video split ...", "[4/5] fsdp ema ...",
        "[5/5] pipeline ring ...",
    ]  # fmt: skip
    timed = r" \(\d+\.\d\d s\)$"
    assert re.search(r"^ok   cp video split: \(2, 4, 4, 8, 6\) latent over cp=2 = 2 \(T\) x 1 \(H\).*" + timed, out, re.M)
    assert re.search(r"^ok   fsdp2 \+ ema: 3 AdamW steps, .* over dp_cp \(2 ranks\); .*" + timed, out, re.M)
    assert "skip pipeline ring: pp=1, a single stage has no neighbour" in out
    assert re.search(r"^demo OK: 4 ranks, 4 checks passed, 1 skipped, in \d+\.\d\d s$", out, re.M)


def test_demo_with_pp_and_another_order():
    result = run_cli("demo", "--nproc", "4", "--cp", "2", "--pp", "2", "--order", "pp-cp-tp-dp")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "order pp-cp-tp-dp" in result.stdout
    # pp-cp-tp-dp: pp varies fastest, so rank 0's ring is [0, 1]
    assert "ok   pipeline ring: a token went around 2 pp rings (0 -> 1 -> 0 here)" in result.stdout
    assert "demo OK: 4 ranks, 5 checks passed, 0 skipped" in result.stdout


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


def test_multinode_demo_command_uses_torchrun_rendezvous():
    dims = wf_mesh.ParallelDims(tp=2, cp=2).resolve(4)
    cmd = cli.demo_command(2, dims, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400", rdzv_id="job7")
    assert cmd[3:] == [
        "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
        "--rdzv-id", "job7", "--nproc-per-node", "2",
        "-m", "wf_mesh.demo", "--tp", "2", "--cp", "2", "--pp", "1", "--order", "tp-cp-pp-dp",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT (a host every node reaches), got None"),
        (["--nnodes", "2", "--rdzv-endpoint", "host"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static"],
         "--rdzv-backend static needs --node-rank in [0, 2), got None"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--tp", "8"],
         "--nnodes 2 x --nproc 2: world_size=4 is not divisible by tp*cp*pp=8"),
        (["--nnodes", "0"], "--nnodes 0 and --nproc 2 must be >= 1"),
    ],
)  # fmt: skip
def test_bad_multinode_demo_exits_2_before_launching(capsys, monkeypatch, args, message):
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: pytest.fail(f"launched {a}"))
    assert cli.main(["demo", "--nproc", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"wf-mesh demo: error: {message}"), err


def test_demo_module_outside_a_launcher(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert demo.main(["--tp", "2"]) == 2
    assert "WORLD_SIZE is not set" in capsys.readouterr().err


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
        assert echoed[0] == "[1/5] topology ..." and echoed[1] == passing[1][0] and len(echoed) == 10
        ok, lines = failing
        assert ok is False and len(lines) == 3  # stopped at the failure: check_all_reduce did not run
        assert lines[0].startswith("ok   topology")
        assert re.fullmatch(r"skip nothing to do here \(\d+\.\d\d s\)", lines[1])
        assert re.fullmatch(r"FAIL _fails_on_rank_1 on ranks \[1\] \(\d+\.\d\d s\): rank 1: wrong answer", lines[2])


# ---- bench ------------------------------------------------------------------------------------------
def test_bench_quick_topology_prints_one_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--quick", "--only", "topology", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"\[1/1\] .*benchmarks/topology\.py --quick \.\.\. done in \d+\.\d s", lines[0])
    header = next(line for line in lines if line.startswith("benchmark"))
    assert header.split() == ["benchmark", "measurement", "ratio", "target", "meets"]
    table = json.loads(out.read_text())
    assert table["quick"] is True and table["failed"] == {}
    assert {row["benchmark"] for row in table["rows"]} == {"topology"}
    assert table["rows"][0]["target"] == "< 1 (well under)" and table["rows"][0]["meets"] in (True, False)
    assert table["results"]["topology"]["mesh_build"][0]["world_size"] == 1024
    assert "mesh build, 1024 ranks: megatron new_group loop / wf_mesh" in result.stdout


def test_bench_bad_input_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: pytest.fail(f"launched {a}"))
    assert cli.main(["bench", "--only", "topology,nope"]) == 2
    assert "unknown benchmark(s) ['nope']; choose from ['topology', 'context_parallel', 'state', 'pipeline']" in (
        capsys.readouterr().err
    )
    assert cli.main(["bench", "--only", "state", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"wf-mesh bench: error: benchmark scripts ['state.py'] not found in {tmp_path}; the scripts ship with the "
        "source checkout, not the installed package: run `pip install -e .` from a checkout, or pass "
        "--dir <checkout>/benchmarks"
    )


def test_bench_reports_a_failing_script(tmp_path, capsys):
    (tmp_path / "pipeline.py").write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    assert cli.main(["bench", "--only", "pipeline", "--dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "FAILED in" in captured.out and "benchmark" not in captured.out.split("FAILED")[1]
    assert "wf-mesh bench: pipeline failed: RuntimeError: pipeline.py exited with code 3" in captured.err
    assert "boom" in captured.err


def test_bench_context_parallel_rows_and_targets():
    result = {
        "gather": {"2": {"raw": 1.0, "wf_mesh": 1.05, "legacy": 1.5}},
        "small": {"2": {"raw": 1e-4, "wf_mesh": 2e-4, "legacy": 3e-4}},
        "broadcast_split": {"2": {"broadcast_then_split": 1.0, "broadcast_split_tensor": 0.5,
                                  "bytes_per_receiver": 50, "broadcast_bytes_per_receiver": 100}},
    }  # fmt: skip
    rows = {r["measurement"]: r for r in bench.ratio_rows("context_parallel", result)}
    gather = rows["gather cp 2: wf_mesh DTensor / raw all-gather"]
    assert gather["ratio"] == pytest.approx(1.05) and gather["target"] == "<= 1.10" and gather["meets"] is True
    assert rows["small gather cp 2: wf_mesh / raw (+100 us/call)"]["meets"] is None
    share = rows["broadcast_split cp 2: bytes per receiver / broadcast"]
    assert (share["ratio"], share["target"], share["meets"]) == (0.5, "= 1/2", True)
    text = bench.format_table(rows.values())
    assert text.splitlines()[0].split() == list(bench.TABLE_HEADER)
    assert "  1.05  <= 1.10" in text and "  0.50  = 1/2" in text
