"""Ctrl-C / SIGTERM: ``wf-mesh demo`` and ``benchmarks/run.py`` stop their whole process tree, print one line.

Each test marks the processes it starts with a unique value in the environment (inherited by every descendant,
whatever session it puts itself in) and scans /proc for survivors.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from wf_mesh.process_tree import ProcessTree

from helpers import MARKER, marked

pytestmark = pytest.mark.slow  # every test here starts processes of its own

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def start(cmd: list[str], marker: str) -> subprocess.Popen:
    env = {**os.environ, MARKER: marker}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finish(proc: subprocess.Popen, marker: str) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=60)
    finally:
        for pid in marked(marker):  # never leave anything behind, even when the test fails
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_stops_the_whole_demo_tree_with_one_line():
    marker = uuid.uuid4().hex
    proc = start([sys.executable, "-m", "wf_mesh.cli", "demo", "--nproc", "2", "--cp", "2"], marker)
    seen = []
    for line in proc.stdout:  # the workers joined and the checks are about to run
        seen.append(line)
        if line.startswith("wf-mesh demo: 2 ranks on gloo/cpu"):
            break
    running = marked(marker)
    assert len(running) >= 4, seen  # front, launcher, 2 workers
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc, marker)
    assert proc.returncode == 130, out + err
    assert err.count("\n") == 1 and err.startswith("wf-mesh demo: interrupted by SIGINT; stopped ")
    assert "Traceback" not in out
    assert marked(marker) == [], f"survivors of {running}"


def test_process_tree_stops_descendants_in_sessions_of_their_own():
    marker = uuid.uuid4().hex
    spawn = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "print('up', flush=True); time.sleep(60)"
    )  # like torchrun: the worker lives in a session of its own
    lines = []
    tree = ProcessTree([sys.executable, "-c", spawn], env={**os.environ, MARKER: marker}, on_stdout=lines.append)
    deadline = time.monotonic() + 30
    # "up" comes after the child started: on a loaded machine (two xdist workers on 2 cores) both processes can
    # be seen before the parent prints it, and stopping then would lose the line
    while (len(marked(marker)) < 2 or not lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    members = tree.members()
    assert sorted(members) == sorted(marked(marker)) and len(members) == 2
    assert tree.stop(grace=1.0) == 2
    assert marked(marker) == [] and tree.proc.returncode == -signal.SIGTERM
    assert lines == ["up\n"]


def test_sigterm_stops_the_running_benchmark_with_one_line():
    marker = uuid.uuid4().hex
    proc = start([sys.executable, "benchmarks/run.py", "--quick", "--only", "pipeline"], marker)
    deadline = time.monotonic() + TIMEOUT
    while len(marked(marker)) < 3 and time.monotonic() < deadline:  # run.py, pipeline.py, its cluster
        time.sleep(0.1)
    running = marked(marker)
    assert len(running) >= 3
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc, marker)
    assert proc.returncode == 143, out + err
    assert out == "[1/1] pipeline --quick ... "
    assert err == "\nbenchmarks/run.py: interrupted by SIGTERM; stopped the running benchmark\n"
    assert marked(marker) == [], f"survivors of {running}"
