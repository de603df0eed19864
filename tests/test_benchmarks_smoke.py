"""Smoke test: the benchmarks run end to end (no timing assertions; benchmarks are not timed tests), and their
JSON has what ``wf-mesh bench`` reads (:func:`wf_mesh.bench.ratio_rows`)."""

import json
import subprocess
import sys
from pathlib import Path

from wf_mesh.bench import ratio_rows

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_quick(name, tmp_path):
    """Run ``benchmarks/<name>.py --quick --json``; return its stdout and its JSON."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_topology_benchmark_quick(tmp_path):
    stdout, result = run_quick("topology", tmp_path)
    assert "wf_mesh topology benchmark | torch" in stdout
    assert "ranks | wf_mesh build (ms) | megatron new_group loop (ms) | ratio (megatron / wf_mesh)" in stdout
    (build,) = result["mesh_build"]
    assert build["world_size"] == 1024
    assert build["wf_mesh"]["groups_held"] == build["megatron"]["groups_held"] == 9
    assert build["wf_mesh"]["new_group_calls"] == build["megatron"]["new_group_calls"]
    assert len(ratio_rows("topology", result)) == 2


def test_pipeline_benchmark_quick(tmp_path):
    stdout, result = run_quick("pipeline", tmp_path)
    assert "latency: round trip of 16 B" in stdout and "bandwidth: round trip of 8 MiB" in stdout
    assert "PPScheduler / raw" in stdout and "PipelineP2P / raw" in stdout
    assert set(result["seconds_per_round_trip"]) == {"small", "big"} and result["small_bytes"] == 16
    assert len(ratio_rows("pipeline", result)) == 6


def test_state_benchmark_quick(tmp_path):
    stdout, result = run_quick("state", tmp_path)
    assert "# wf_mesh state benchmark  torch" in stdout
    assert "## EMA update, 4M fp32 parameters in 16 tensors (ratio = time / foreach copy_)" in stdout
    assert "## EMA of many small tensors: 1000 x 1024 fp32" in stdout
    assert set(result["ema_large"]) >= {"copy_ (foreach)", "bare _foreach_lerp_", "ShardedEMA.update"}
    assert set(result["ema_small"]) == {"copy_ (foreach)", "ShardedEMA.update", "lerp_ loop"}
    broadcast = result["broadcast"]["2"]
    assert broadcast["tensors"] == broadcast["collectives_per_tensor"] == 250  # 100 Linear (w, b) + 50 buffers
    assert broadcast["collectives_bucketed"] == 2 and broadcast["buckets"] == 1  # one fp32 bucket + the layout check
    rows = {row["measurement"]: row for row in ratio_rows("state", result)}
    assert rows["state broadcast w2: collectives / (buckets + 1 check), 250 tensors"]["meets"] is True


def test_context_parallel_benchmark_quick(tmp_path):
    stdout, result = run_quick("context_parallel", tmp_path)
    assert "## gather (2, 512, 128) fp32 along dim 1 (quick)" in stdout
    assert set(result["gather"]["2"]) == {"raw", "raw_reused", "wf_mesh", "legacy"}
    split = result["broadcast_split"]["4"]
    assert split["bytes_per_receiver"] * 4 == split["broadcast_bytes_per_receiver"]  # each receiver gets 1/cp
    rows = {row["measurement"]: row for row in ratio_rows("context_parallel", result)}
    assert rows["broadcast_split cp 4: bytes per receiver / broadcast"]["meets"] is True
