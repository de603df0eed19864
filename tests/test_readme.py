"""Every fenced Python block of README.md runs as written, at the world size its first line states, and its
asserts hold; the README's `wf-mesh plan` commands run. (`.ci/run` runs the two install commands.)

First-line conventions: ``# single process`` (run in a 1-rank cluster worker), ``# torchrun --nproc-per-node N
name.py`` (run on every rank of an N-rank cluster, where ``init_from_env`` finds torch.distributed initialized
as torchrun would have it; one block also runs under a real torchrun), ``# python name.py`` (written to a file
and run as a script). Blocks are judged by their own asserts: a block passes when it runs to its end (a script:
exit code 0), and the commands by their exit code.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from wf_mesh.testing import run_distributed

from helpers import exec_block

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    text = README.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    out = []
    for source in blocks:
        first = source.splitlines()[0]
        if m := re.match(r"# torchrun --nproc-per-node (\d+) (\S+\.py)", first):
            out.append((m[2], int(m[1]), "torchrun", source))
        elif m := re.match(r"# python (\S+\.py)", first):
            out.append((m[1], 1, "script", source))
        elif first.startswith("# single process"):
            out.append((f"block{len(out)}", 1, "single", source))
        else:
            raise AssertionError(f"README block without a run line: {first!r}")
    return out


BLOCKS = python_blocks()
CLUSTER = [b for b in BLOCKS if b[2] != "script"]
SCRIPTS = [b for b in BLOCKS if b[2] == "script"]


def test_every_block_says_how_it_runs():
    assert len(BLOCKS) >= 10 and SCRIPTS and any(b[1] == 4 for b in BLOCKS)


@pytest.mark.parametrize("name, world, kind, source", CLUSTER, ids=[b[0] for b in CLUSTER])
def test_block_runs_as_written(name, world, kind, source):
    run_distributed(world, exec_block, source, f"README.md: {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name, world, kind, source", SCRIPTS, ids=[b[0] for b in SCRIPTS])
def test_script_block_runs_as_a_script(name, world, kind, source, tmp_path):
    script = tmp_path / name
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE") and not k.startswith("SLURM_")}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_torchrun_block_runs_under_torchrun(tmp_path):
    name, world, _, source = next(b for b in CLUSTER if b[0] == "mesh_tour.py")
    script = tmp_path / name
    script.write_text(source)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(script)]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # every rank ran the block's asserts to the end


PLAN_COMMANDS = re.findall(r"^(wf-mesh plan .*)$", README.read_text(), flags=re.M)


@pytest.mark.parametrize("command", PLAN_COMMANDS)
def test_plan_commands_run(command):
    args = shlex.split(command)[1:]
    proc = subprocess.run([sys.executable, "-m", "wf_mesh.cli", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_ci_runs_the_readme_commands_as_written():
    commands = re.findall(r"^(python3 -m venv \.venv && .*)$", README.read_text(), flags=re.M)
    ci = (README.parent / ".ci" / "run").read_text()
    assert len(commands) == 2 and ci.index(commands[0]) < ci.index(commands[1])
    assert "[test]" not in commands[0] and "demo" in commands[0]  # the first runs before any test extra


def test_the_dit_recipe_is_under_15_changed_lines_as_the_readme_says():
    source = next(b[3] for b in CLUSTER if b[0] == "dit_tour.py")
    marked = [line for line in source.splitlines() if "# CP" in line]
    stated = re.search(r"the lines marked `# CP` \((\d+)\) are the whole\s+change", README.read_text())
    assert stated and int(stated[1]) == len(marked) < 15, marked
