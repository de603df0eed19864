"""ruff (configured in pyproject.toml) finds nothing to lint or to reformat: the suite is the lint gate."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


def ruff(*args):
    assert RUFF, "ruff is part of the test extra: pip install -e '.[test]'"
    return subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check():
    proc = ruff("check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = ruff("format", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr
