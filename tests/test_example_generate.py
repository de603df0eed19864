"""examples/generate_video_dit.py: the same video at cp 1, 2 and 4 (float64: within 1e-10; the printed checksum
equal to its 13 digits), with and without a chunk window, in-process on the pooled clusters and (slow) as a
script and under torchrun."""

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from wf_mesh.testing import run_distributed

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "generate_video_dit.py"
if str(SCRIPT.parent) not in sys.path:  # the workers import the example (and train_video_dit) by name
    sys.path.insert(0, str(SCRIPT.parent))
TIMEOUT = 180
LINE = re.compile(r"^generate_video_dit: cp (\d), video \(1, 4, 6, 4, 3\), checksum (\S+)$", re.M)


def generate(argv):
    import generate_video_dit

    return generate_video_dit.main(argv)


@cache
def run(world, *args):
    results = run_distributed(world, generate, ["--quiet", "--cp", str(world), *args])
    for rank, result in enumerate(results[1:], 1):
        assert torch.equal(result["video"], results[0]["video"]), rank  # gathered: the same on every rank
    return results[0]


@pytest.mark.parametrize("args", [(), ("--window", "1", "--chunk-frames", "1")], ids=["all-chunks", "window1"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_same_video_at_every_cp(world, args):
    want, got = run(1, *args), run(world, *args)
    assert got["video"].shape == (1, 4, 6, 4, 3) and got["cp"] == world
    assert torch.allclose(got["video"], want["video"], atol=1e-10, rtol=1e-10)
    assert f"{got['checksum']:.12e}" == f"{want['checksum']:.12e}"
    for lengths in got["lengths"]:
        assert max(lengths) - min(lengths) <= 1  # the cache stays balanced as it grows
    assert sum(got["lengths"][-1]) == (12 if args else 72)  # window 1: the last chunk's 12 tokens are cached


def test_the_window_changes_the_video():
    assert not torch.allclose(run(1)["video"], run(1, "--window", "1", "--chunk-frames", "1")["video"])


def clean_env():
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_script_and_torchrun_print_the_same_checksum():
    alone = subprocess.run([sys.executable, str(SCRIPT)], env=clean_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)  # fmt: skip
    assert alone.returncode == 0, alone.stdout + alone.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    both = subprocess.run([*torchrun, str(SCRIPT), "--cp", "2"], env=clean_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)  # fmt: skip
    assert both.returncode == 0, both.stdout + both.stderr
    (one,), (two,) = LINE.findall(alone.stdout), LINE.findall(both.stdout)  # one line each (rank 0)
    assert (one[0], two[0]) == ("1", "2") and one[1] == two[1] == f"{run(1)['checksum']:.12e}"
