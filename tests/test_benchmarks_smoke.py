"""Smoke test: the topology benchmark runs end to end (no timing assertions; benchmarks are not timed tests)."""

import json
import subprocess
import sys
from pathlib import Path

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
