"""benchmarks/gpu_run.py, the prepared GPU run, as its dry run (``--device cpu``: the same stack minus CUDA, small
sizes), in this interpreter: CI runs it in the torch 2.11 / Python 3.12 lane, the GPU machine's stack."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_passes_every_step_and_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), "--device", "cpu", "--wheels", str(tmp_path)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "WF_MESH_GPU_RUN_OUT": str(out)}
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = json.loads((out / "results.json").read_text())
    assert set(records) == {"wheels", "gpu_check", "side_by_side", "diffusers"}
    assert all(r["ok"] for r in records.values()), records
    summary = (out / "summary.md").read_text()
    assert "66 of 66 cases right" in summary  # cp 1, 2, 4: every method, dtype and mask, and the KV cache
    assert "| cp 2 ring (zigzag plan) |" in summary and "| bf16, cp 2 ulysses | 1 |" in summary
    assert {p.name for p in out.iterdir()} >= {"summary.md", "results.json", "gpu_check.txt", "diffusers.txt"}


def test_without_cuda_the_gpu_run_says_so_and_exits_2(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # CI machines have none: the path runs there
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_run.py"),
        "--out",
        str(tmp_path),
        "--wheels",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--device cpu is the dry run" in done.stdout
