"""The benchmarks: the one row schema (``benchmarks/_report.py``), the runner (``benchmarks/run.py``), and one
quick run of every script through the runner (no timing is asserted: benchmarks are not timed tests).

Tests marked ``slow`` start processes of their own; the rest are pure.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PLANNING = "planning 100,000 ranks (groups of 9 axes) / 1 s"  # every axis of a mesh without cfg
MINE = ("topology", "context_parallel", "state", "pipeline")  # cp_attention.py has a test of its own


def load(name):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load("_report")
runner = load("run")


# ---- the row schema ---------------------------------------------------------------------------------
def test_ratio_row_is_judged_on_the_median_and_spread_over_the_trials():
    row = report.ratio_row("state", "EMA / copy_", [1.5, 0.9, 1.05], report.at_most(1.10), quick=False)
    assert row == {
        "benchmark": "state",
        "measurement": "EMA / copy_",
        "ratio": 1.05,
        "low": 0.9,
        "high": 1.5,
        "target": "<= 1.10",
        "meets": "yes",
    }
    assert report.ratio_row("s", "m", [1.2, 1.0, 1.3], report.at_most(1.10), quick=False)["meets"] == "NO"
    assert report.ratio_row("s", "m", [1.2, 1.3], report.at_most(1.10), quick=True)["meets"] == "not judged"
    assert report.ratio_row("s", "m", 0.25, report.equals(0.25, "= 1/4"), quick=False)["meets"] == "yes"
    assert (
        report.ratio_row("s", "m", [2.0], report.above(1, "> 1 (well ahead)"), quick=False)["target"]
        == "> 1 (well ahead)"
    )
    unjudged = report.ratio_row("s", "m", [3.0, 1.0], quick=False)
    assert (unjudged["ratio"], unjudged["low"], unjudged["high"], unjudged["target"], unjudged["meets"]) == (
        2.0,
        1.0,
        3.0,
        "",
        "",
    )
    assert report.per_trial([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError, match="per-trial ratios need as many trials on both sides, got 2 and 1"):
        report.per_trial([2.0, 3.0], [1.0])


def test_rows_outside_the_schema_are_refused(tmp_path):
    good = report.ratio_row("pipeline", "a / b", [1.0, 2.0], quick=True)
    with pytest.raises(
        ValueError,
        match=r"pipeline row 0: expected the keys \['benchmark', 'measurement', 'ratio', "
        r"'low', 'high', 'target', 'meets'\], got \['benchmark', 'ratio'\]",
    ):
        report.write_json(str(tmp_path / "x.json"), "pipeline", True, [{"benchmark": "pipeline", "ratio": 1}], {})
    with pytest.raises(ValueError, match=r"meets must be one of \['yes', 'NO', 'not judged', ''\], got 'maybe'"):
        report.check_row({**good, "meets": "maybe"})
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"gather": {}}))
    with pytest.raises(
        ValueError,
        match=r"^cp_attention: its --json output has no 'rows' list \(the schema of "
        r"benchmarks/_report.py\)$",
    ):
        report.read_rows(str(path), "cp_attention")
    report.write_json(str(path), "pipeline", True, [good], {"raw": 1})
    assert report.read_rows(str(path), "pipeline") == (
        [good],
        {"benchmark": "pipeline", "quick": True, "rows": [good], "results": {"raw": 1}},
    )


def test_format_rows():
    rows = [
        report.ratio_row("state", "EMA update / copy_", [0.93, 0.97, 1.02], report.at_most(1.10), quick=False),
        report.ratio_row("context_parallel", "bytes / broadcast", 0.5, report.equals(0.5, "= 1/2"), quick=True),
        report.ratio_row("topology", "planning / 1 s", [0.0123, 0.0131], report.below(1), quick=False),
    ]
    assert report.format_rows(rows) == (
        "benchmark         measurement          ratio       low-high  target   meets\n"
        "----------------  ------------------  ------  -------------  -------  ----------\n"
        "state             EMA update / copy_    0.97      0.93-1.02  <= 1.10  yes\n"
        "context_parallel  bytes / broadcast     0.50                 = 1/2    not judged\n"
        "topology          planning / 1 s      0.0127  0.0123-0.0131  < 1      yes"
    )


# ---- the runner -------------------------------------------------------------------------------------
def test_runner_finds_scripts_and_refuses_unknown_names(tmp_path, capsys):
    for name in ["_report", "run", "gpu_check", "zeta", "pipeline", "cp_attention", "topology", "alpha"]:
        (tmp_path / f"{name}.py").write_text("")
    names = runner.available(tmp_path)
    assert names == ["topology", "pipeline", "cp_attention", "alpha", "zeta"]
    assert runner.selected("zeta, pipeline.py,cp-attention", names) == ["pipeline", "cp_attention", "zeta"]
    assert runner.main(["--only", "topology,nope"], folder=tmp_path) == 2
    assert capsys.readouterr().err == (
        "benchmarks/run.py: error: --only 'topology,nope': unknown benchmark(s) ['nope']; choose from "
        "['topology', 'pipeline', 'cp_attention', 'alpha', 'zeta']\n"
    )


@pytest.mark.slow
def test_runner_reports_failing_scripts_and_rows_outside_the_schema(tmp_path, capsys):
    (tmp_path / "pipeline.py").write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    (tmp_path / "cp_attention.py").write_text(
        "import json, sys\njson.dump({'cp': {}}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    )
    assert runner.main(["--quick"], folder=tmp_path) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("[1/2] pipeline --quick ... FAILED in ")
    assert lines[1].startswith("[2/2] cp_attention --quick ... FAILED in ")
    assert len(lines) == 2  # no table: no rows
    assert captured.err == (
        "benchmarks/run.py: pipeline failed: exited with code 3; the end of its output:\n  | boom\n"
        "benchmarks/run.py: cp_attention failed: ValueError: cp_attention: its --json output has no 'rows' list "
        "(the schema of benchmarks/_report.py)\n"
    )


# ---- the GPU check (benchmarks/gpu_check.py): here it can only refuse ------------------------------------
def test_gpu_check_refuses_cleanly_without_cuda(capsys):
    gpu_check = load("gpu_check")
    with pytest.raises(SystemExit) as helped:
        gpu_check.main(["--help"])
    assert helped.value.code == 0 and capsys.readouterr().out.startswith("usage: benchmarks/gpu_check.py")
    assert gpu_check.main([]) == 2
    assert capsys.readouterr() == (
        "",
        f"benchmarks/gpu_check.py: needs a CUDA device; torch {torch.__version__} sees none "
        f"(torch.cuda.is_available() is False, built with CUDA {torch.version.cuda})\n",
    )


@pytest.mark.slow  # local clusters of 2 and 4 processes
def test_gpu_check_value_checks_run_on_cpu():
    """The script a lent GPU runs, tried out on CPU (--device cpu): every method, dtype and mask (the mask plan
    included, and KV-cache decoding) right at cp 4 (usp 2 x 2 too), so that the day a GPU is lent the script itself is known to work."""
    script = BENCHMARKS / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--seq", "32", "--world-sizes", "4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert (
        out.rstrip().endswith("26 of 26 cases right")
        and out.count("block-causal-plan") == 8
        and out.count("kv_cache") == 2
    )


# ---- every benchmark, quick, through the runner (one process tree per script) -------------------------
EXPECTED = {
    "topology": [
        PLANNING,
        "mesh build, 1024 ranks: megatron new_group loop / wf_mesh",
    ],
    "context_parallel": [
        f"{what}"
        for cp in (2, 4)
        for what in (
            f"gather cp {cp}: wf_mesh DTensor / raw all-gather",
            f"gather cp {cp}: wf_mesh DTensor, checks off / raw",
            f"gather cp {cp}: legacy cat_outputs_cp / raw",
            f"gather cp {cp}: contain_faults on / off",
            f"gather cp {cp}: wf_mesh / raw reusing its gather buffer",
        )
    ]
    + [
        f"small {what}"
        for cp in (2, 4)
        for what in (
            f"gather cp {cp}: wf_mesh / raw",
            f"gather cp {cp}: checks on / off (agreement",
            f"gather cp {cp}: contain_faults on / off (close",
            f"broadcast cp {cp}: wf_mesh.broadcast / dist.broadcast",
        )
    ]
    + [
        f"broadcast_split cp {cp}: {what}"
        for cp in (2, 4)
        for what in ("bytes per receiver / broadcast", "time scatter / broadcast-then-split")
    ],
    "state": [
        "EMA update / copy_ of the same bytes",
        "bare _foreach_lerp_ / copy_ (the floor)",
        "EMA update, bf16 model / copy_",
        "many small tensors: lerp_ loop / EMA update",
        "state broadcast w2: collectives / (buckets + 1 check), 250 tensors",
        "state broadcast w2: time per-tensor / bucketed",
    ],
    "pipeline": [
        f"{label} / raw isend+irecv, {size} round trip"
        for label in ("PPScheduler", "PipelineP2P", "PipelineP2P irecv_into", "PipelineP2P checked")
        for size in ("16 B", "8 MiB")
    ],
}
TARGETS = {
    PLANNING: "< 1 (well under 1 s)",
    "gather cp 2: wf_mesh DTensor / raw all-gather": "<= 1.10",
    "gather cp 4: wf_mesh DTensor / raw all-gather": "<= 1.10",
    "broadcast_split cp 2: bytes per receiver / broadcast": "= 1/2",
    "broadcast_split cp 4: bytes per receiver / broadcast": "= 1/4",
    "EMA update / copy_ of the same bytes": "<= 1.10",
    "state broadcast w2: collectives / (buckets + 1 check), 250 tensors": "≈ 1 (collectives ≈ buckets)",
    "state broadcast w2: time per-tensor / bucketed": "> 1 (well ahead)",
}


@pytest.mark.slow
def test_every_benchmark_runs_quick_and_writes_rows_in_the_schema(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--quick", "--only", ",".join(MINE), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["failed"] == {} and list(data["results"]) == list(MINE)
    rows = data["rows"]
    assert all(tuple(row) == report.ROW_KEYS and row["low"] <= row["ratio"] <= row["high"] for row in rows)
    by_benchmark = {name: [r["measurement"] for r in rows if r["benchmark"] == name] for name in MINE}
    for name, measurements in EXPECTED.items():  # small gathers carry their overhead in us: match the start
        assert len(by_benchmark[name]) == len(measurements), by_benchmark[name]
        assert all(got.startswith(want) for got, want in zip(by_benchmark[name], measurements)), by_benchmark[name]
    for row in rows:  # quick runs cannot judge: never "NO"
        target = TARGETS.get(row["measurement"], "")
        assert (row["target"], row["meets"]) == (target, "not judged" if target else ""), row
    exact = {
        r["measurement"]: r for r in rows if r["measurement"].startswith(("broadcast_split cp", "state broadcast"))
    }
    assert exact["broadcast_split cp 4: bytes per receiver / broadcast"]["ratio"] == 0.25  # each receiver gets 1/cp
    assert exact["state broadcast w2: collectives / (buckets + 1 check), 250 tensors"]["ratio"] == 1.0
    # each script's raw results come along
    topology, state = data["results"]["topology"]["results"], data["results"]["state"]["results"]
    (build,) = topology["mesh_build"]
    assert build["world_size"] == 1024 and build["wf_mesh"]["groups_held"] == build["megatron"]["groups_held"] == 9
    assert build["wf_mesh"]["new_group_calls"] == build["megatron"]["new_group_calls"]
    broadcast = state["broadcast"]["2"]
    assert broadcast["tensors"] == broadcast["collectives_per_tensor"] == 250  # 100 Linear (w, b) + 50 buffers
    assert broadcast["collectives_bucketed"] == 2 and broadcast["buckets"] == 1  # one fp32 bucket + the layout check
    # one table of every row
    lines = proc.stdout.splitlines()
    assert [line.split(" ... ")[0] for line in lines[:4]] == [f"[{i}/4] {n} --quick" for i, n in enumerate(MINE, 1)]
    header = next(i for i, line in enumerate(lines) if line.startswith("benchmark "))
    assert lines[header].split() == ["benchmark", "measurement", "ratio", "low-high", "target", "meets"]
    assert len([line for line in lines if line.startswith(MINE)]) == len(rows)


def run_quick(tmp_path, name):
    """``run.py --quick --only name``: its --json output (the run must succeed)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--quick", "--only", name, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow  # 4 processes, ~15 s
def test_the_mask_benchmark_runs_quick_through_the_runner(tmp_path):
    data = run_quick(tmp_path, "cp_attention_masks")
    assert data["failed"] == {}
    rows = {r["measurement"]: r for r in data["rows"]}
    assert all(tuple(r) == report.ROW_KEYS for r in data["rows"])
    for mask in ("block-causal", "packed", "windowed"):
        plan = rows[f"cp 4 {mask}: imbalance, balanced plan (max / mean work)"]
        assert plan["ratio"] <= 1.10 and (plan["target"], plan["meets"]) == ("<= 1.10", "not judged")
        assert f"cp 4 {mask}: ring / allgather, same mask, fwd+bwd time" in rows
    assert rows["cp 4 block-causal: imbalance, contiguous shards"]["ratio"] == pytest.approx(58 / 34)
    # 16 equal block-causal chunks on contiguous shards: 6/16 blocks, 6/12 K/V hops, 7/16 dK/dV messages
    assert rows["cp 4 block-causal, contiguous: ring blocks skipped / all"]["ratio"] == 6 / 16
    assert rows["cp 4 block-causal, contiguous: ring K/V hops skipped / all"]["ratio"] == 6 / 12
    assert rows["cp 4 block-causal, contiguous: ring dK/dV messages skipped / all"]["ratio"] == 7 / 16


@pytest.mark.slow  # 2 and 4 processes, 20-60 s
def test_the_kv_cache_benchmark_runs_quick_through_the_runner(tmp_path):
    data = run_quick(tmp_path, "kv_cache")
    assert data["failed"] == {} and list(data["results"]) == ["kv_cache"]
    assert all(tuple(r) == report.ROW_KEYS and r["low"] <= r["ratio"] <= r["high"] for r in data["rows"])
    rows = {r["measurement"]: r for r in data["rows"]}
    expected = {}
    for cp in (2, 4):
        for cache in (256, 1024):
            prefix = f"cp {cp}, cache {cache}, chunk 32:"
            expected[f"{prefix} KVCache.attend / all-gather-the-cache baseline, one layer call"] = "<= 1.00"
            expected[f"{prefix} bytes sent per rank per layer call, KVCache / baseline"] = "< 1"
            expected[f"{prefix} contain_faults=True / off, KVCache.attend"] = "<= 1.05"
        expected[f"cp {cp}: KVCache bytes sent per layer call, cache 1024 / cache 256"] = "= 1 (flat)"
    assert {m: (r["target"], r["meets"]) for m, r in rows.items()} == {
        m: (target, "not judged") for m, target in expected.items()
    }
    for cp in (2, 4):  # counts are exact even in a quick run: the cache's traffic does not grow with the cache
        assert rows[f"cp {cp}: KVCache bytes sent per layer call, cache 1024 / cache 256"]["ratio"] == 1.0
        small, large = (
            rows[f"cp {cp}, cache {c}, chunk 32: bytes sent per rank per layer call, KVCache / baseline"]["ratio"]
            for c in (256, 1024)
        )
        assert large < small < 1
    raw = data["results"]["kv_cache"]["results"]
    assert raw["cp"]["4"]["1024"]["lengths"] == [256, 256, 256, 256]
