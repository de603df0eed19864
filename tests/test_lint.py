"""ruff (configured in pyproject.toml) finds nothing to lint or to reformat, and mypy finds no type error in
src/: the suite is the lint gate."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
RUFF = shutil.which("ruff", path=BIN) or shutil.which("ruff")
MYPY = shutil.which("mypy", path=BIN) or shutil.which("mypy")


def ruff(*args):
    assert RUFF, "ruff is part of the test extra: pip install -e '.[test]'"
    return subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check():
    proc = ruff("check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = ruff("format", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow  # mypy over src/ takes 30-60 s without a cache: the fast lane keeps ruff only
def test_mypy(tmp_path):
    assert MYPY, "mypy is part of the test extra: pip install -e '.[test]'"
    # files, flags and the strict modules come from [tool.mypy] in pyproject.toml; a fresh cache outside the tree
    proc = subprocess.run(
        [MYPY, "--cache-dir", str(tmp_path / "mypy_cache")], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
