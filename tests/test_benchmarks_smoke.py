"""Smoke test: the benchmarks run end to end (no timing assertions; benchmarks are not timed tests), and their
JSON has what ``wf-mesh bench`` reads (:func:`wf_mesh.bench.ratio_rows`)."""

import json
import subprocess
import sys
from pathlib import Path

from wf_mesh.bench import ratio_rows

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "topology.py"


def test_topology_benchmark_quick(tmp_path):
    out = tmp_path / "topology.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wf_mesh topology benchmark | torch" in proc.stdout
    assert "ranks | wf_mesh build (ms) | megatron new_group loop (ms) | ratio (megatron / wf_mesh)" in proc.stdout
    result = json.loads(out.read_text())
    (build,) = result["mesh_build"]
    assert build["world_size"] == 1024
    assert build["wf_mesh"]["groups_held"] == build["megatron"]["groups_held"] == 9
    assert build["wf_mesh"]["new_group_calls"] == build["megatron"]["new_group_calls"]
    assert len(ratio_rows("topology", result)) == 2


def test_pipeline_benchmark_quick(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"
    out = tmp_path / "pipeline.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "latency: round trip of 16 B" in proc.stdout and "bandwidth: round trip of 8 MiB" in proc.stdout
    assert "PPScheduler / raw" in proc.stdout and "PipelineP2P / raw" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["seconds_per_round_trip"]) == {"small", "big"} and result["small_bytes"] == 16
    assert len(ratio_rows("pipeline", result)) == 6


def test_state_benchmark_quick(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "state.py"
    out = tmp_path / "state.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# wf_mesh state benchmark  torch" in proc.stdout
    assert "## EMA update, 4M fp32 parameters in 16 tensors (ratio = time / foreach copy_)" in proc.stdout
    assert "## EMA of many small tensors: 1000 x 1024 fp32" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["ema_large"]) >= {"copy_ (foreach)", "bare _foreach_lerp_", "ShardedEMA.update"}
    assert set(result["ema_small"]) == {"copy_ (foreach)", "ShardedEMA.update", "lerp_ loop"}
    broadcast = result["broadcast"]["2"]
    assert broadcast["tensors"] == broadcast["collectives_per_tensor"] == 250  # 100 Linear (w, b) + 50 buffers
    assert broadcast["collectives_bucketed"] == 2 and broadcast["buckets"] == 1  # one fp32 bucket + the layout check
    rows = {row["measurement"]: row for row in ratio_rows("state", result)}
    assert rows["state broadcast w2: collectives / (buckets + 1 check), 250 tensors"]["meets"] is True
