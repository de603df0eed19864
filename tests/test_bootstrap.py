"""init_from_env: what it reads (torchrun, SLURM, nothing) and in which order, the processes it starts (one
without a launcher, torchrun at 2 and 4, srun simulated by SLURM's variables on local processes), what it tears
down (exactly what it created), and its errors (named variables, before any network traffic).

Reading the environment is pure (``read_launch_env(environ)``): those cases are dicts. The launches are real
processes; a SLURM "task" is a local process given the variables srun sets, nothing else is simulated.
"""

import json
import os
import re
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

import wf_mesh
from wf_mesh.bootstrap import LaunchEnv, first_host, read_launch_env
from wf_mesh.testing import process_group_counts, run_distributed
from wf_mesh.viz import mesh_axes

from helpers import raised_everywhere

TIMEOUT = 300  # seconds for a launch of 1-4 processes that each import torch (a hang bound, not a speed claim)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "4512345",
    "SLURM_NODELIST": "gpu[07-08,11],login1",
}


# ---- what it reads, in which order (pure) -----------------------------------------------------------
@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node01", "node01"),
        ("node01,node02", "node01"),
        ("node01 node02", "node01"),
        ("gpu[07-08,11],login1", "gpu07"),
        ("gpu[011],x", "gpu011"),
        ("rack[2-3]-node[01-04]", "rack2-node01"),
        ("127.0.0.[1-4]", "127.0.0.1"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[01-02", "node]1", "[]"])
def test_a_broken_host_list_is_refused(nodelist):
    with pytest.raises(ValueError, match=re.escape(f"cannot read the first host of the SLURM host list {nodelist!r}")):
        first_host(nodelist)


def test_torchrun_variables():
    assert read_launch_env(TORCHRUN) == LaunchEnv("torchrun", 3, 4, 1, "10.1.2.3", 29400)
    assert read_launch_env(TORCHRUN).init_method == "env://"
    no_local = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}
    assert read_launch_env(no_local).local_rank is None


def test_slurm_variables_host_and_port():
    env = read_launch_env(SLURM)
    assert env == LaunchEnv("slurm", 5, 8, 1, "gpu07", 15000 + 2345)  # port: 15000 + the job id's last 4 digits
    assert env.init_method == "tcp://gpu07:17345"
    # the step's node list first, then the job's, then SLURM_NODELIST, then the launch node's address
    step = {**SLURM, "SLURM_STEP_NODELIST": "n[4-5]", "SLURM_JOB_NODELIST": "j1"}
    assert read_launch_env(step).master_addr == "n4"
    assert read_launch_env({**SLURM, "SLURM_JOB_NODELIST": "j1"}).master_addr == "j1"
    no_list = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    assert read_launch_env({**no_list, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9"}).master_addr == "10.0.0.9"
    # MASTER_ADDR / MASTER_PORT win over what SLURM implies
    chosen = read_launch_env({**SLURM, "MASTER_ADDR": "fe80::1", "MASTER_PORT": "23456"})
    assert (chosen.master_addr, chosen.master_port, chosen.init_method) == ("fe80::1", 23456, "tcp://[fe80::1]:23456")
    # one task meets nobody: the private store, no host or port needed
    assert read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == LaunchEnv("slurm", 0, 1, None, None, None)


def test_torchrun_wins_over_slurm_and_nothing_means_one_process():
    # torchrun inside an srun allocation: torchrun's variables describe the process, SLURM's the allocation
    assert read_launch_env({**SLURM, **TORCHRUN}).launcher == "torchrun"
    assert read_launch_env({}) == LaunchEnv("none", 0, 1, None, None, None)
    # an sbatch script without srun (SLURM_PROCID alone, no task count): one process
    assert read_launch_env({"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}).launcher == "none"
    assert read_launch_env({}).init_method is None


@pytest.mark.parametrize(
    "environ, error, message",
    [
        (
            {"RANK": "0"},
            RuntimeError,
            "x: environment variable WORLD_SIZE is not set but RANK is; launch with torchrun",
        ),
        ({"WORLD_SIZE": "2"}, RuntimeError, "x: environment variable RANK is not set but WORLD_SIZE is"),
        ({**TORCHRUN, "WORLD_SIZE": "four"}, ValueError, "x: environment variable WORLD_SIZE='four' is not an integer"),
        ({**TORCHRUN, "RANK": "-1"}, ValueError, "x: environment variable RANK=-1 must be >= 0"),
        ({**TORCHRUN, "RANK": "4"}, ValueError, "x: RANK=4 must be in [0, WORLD_SIZE=4)"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, ValueError, "x: environment variable WORLD_SIZE=0 must be >= 1"),
        (
            {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"},
            RuntimeError,
            "x: RANK and WORLD_SIZE are set but MASTER_PORT not: the env:// rendezvous needs MASTER_ADDR and MASTER_PORT",
        ),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ValueError, "x: environment variable MASTER_PORT=70000 is not a port"),
        ({**TORCHRUN, "LOCAL_RANK": "one"}, ValueError, "x: environment variable LOCAL_RANK='one' is not an integer"),
        ({**SLURM, "SLURM_PROCID": "8"}, ValueError, "x: SLURM_PROCID=8 must be in [0, SLURM_NTASKS=8)"),
        ({**SLURM, "SLURM_LOCALID": "?"}, ValueError, "x: environment variable SLURM_LOCALID='?' is not an integer"),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"},
            RuntimeError,
            "x: SLURM task 5 of 8 needs MASTER_PORT or a numeric SLURM_JOB_ID to choose the rendezvous port, got "
            "SLURM_JOB_ID=None",
        ),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"},
            RuntimeError,
            "x: SLURM task 5 of 8 cannot tell where task 0 runs: none of MASTER_ADDR, SLURM_STEP_NODELIST, "
            "SLURM_JOB_NODELIST, SLURM_NODELIST, SLURM_LAUNCH_NODE_IPADDR is set",
        ),
    ],
)
def test_environment_errors_name_the_variables(environ, error, message):
    with pytest.raises(error, match=re.escape(message)):
        read_launch_env(environ, what="x")


# ---- misuse, refused before any process group exists (this process) --------------------------------
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"dp_replica": 2}, TypeError, "init_from_env: unknown option(s) ['dp_replica']; the options of init_parallel"),
        ({"timeout": 30}, TypeError, "init_from_env: timeout must be a positive datetime.timedelta or None, got 30"),
        ({"timeout": timedelta(0)}, TypeError, "timeout must be a positive datetime.timedelta or None"),
        ({"backend": "mpi"}, ValueError, "init_from_env: backend='mpi': use one of ['nccl', 'gloo'] or None (auto)"),
        ({"device_type": "tpu"}, ValueError, "init_from_env: device_type='tpu': use one of ['cpu', 'cuda'] or None"),
        ({"dims": (2, 2)}, TypeError, "init_from_env takes a ParallelDims, got tuple (2, 2)"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        wf_mesh.init_from_env(**kwargs)
    assert not dist.is_initialized()


def test_bad_environment_and_degrees_are_refused_before_anything_starts(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="init_from_env: environment variable WORLD_SIZE is not set but RANK is"):
        wf_mesh.init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")  # never contacted: the degrees are refused first
    with pytest.raises(
        wf_mesh.DegreeError,
        match=re.escape(
            "init_from_env: world_size=6 is not divisible by tp*cp*pp = 4*1*1 = 4; cannot infer dp (world size 6 "
            "from torchrun)"
        ),
    ):
        wf_mesh.init_from_env(wf_mesh.ParallelDims(tp=4))
    if not _cuda():
        with pytest.raises(RuntimeError, match=r"init_from_env: backend='nccl' needs CUDA, which is not available"):
            wf_mesh.init_from_env(backend="nccl")
        with pytest.raises(RuntimeError, match=r"init_from_env: device_type='cuda' needs CUDA, which is not available"):
            wf_mesh.init_from_env(device_type="cuda")
    assert not dist.is_initialized()


def _cuda():
    import torch

    return torch.cuda.is_available()


# ---- on a default group that exists (the pooled cluster): only the mesh is its own ------------------
def session_on_existing_group(dims):
    baseline = process_group_counts()[0]
    with wf_mesh.init_from_env(dims) as session:
        seen = {
            "owns": session.owns_process_group,
            "env": session.env,
            "backend": session.backend,
            "device": str(session.device),
            "current": wf_mesh.get_parallel_mesh() is session.mesh,
            "groups": {axis: session.mesh.ranks(axis) for axis in mesh_axes(session.mesh.dims)},
            "rank": session.rank,
            "world_size": session.world_size,
        }
    seen["after"] = (
        session.closed,
        session.mesh.destroyed,
        wf_mesh.parallel_mesh_or_none(),
        dist.is_initialized(),
        process_group_counts()[0] - baseline,
    )
    session.close()  # idempotent
    again = wf_mesh.init_from_env(dims)  # everything it made is gone: the same mesh builds again
    seen["again"] = again.mesh.coords()
    again.close()
    return seen


def test_on_an_existing_group_it_builds_and_destroys_only_the_mesh():
    dims = wf_mesh.ParallelDims(tp=2, cp=2).resolve(4)
    for rank, seen in enumerate(run_distributed(4, session_on_existing_group, wf_mesh.ParallelDims(tp=2, cp=2))):
        assert (seen["owns"], seen["env"], seen["backend"], seen["device"]) == (False, None, "gloo", "cpu")
        assert seen["current"] and (seen["rank"], seen["world_size"]) == (rank, 4)
        assert seen["groups"] == {axis: dims.group_of(axis, rank) for axis in mesh_axes(dims)}
        assert seen["after"] == (True, True, None, True, 0)  # the default group stays; no subgroup is left
        assert seen["again"] == dims.coords(rank)


def init_twice():
    first = wf_mesh.init_from_env(wf_mesh.ParallelDims(cp=2))
    try:
        wf_mesh.init_from_env(wf_mesh.ParallelDims(cp=2))
    finally:
        first.close()


def test_a_second_mesh_is_refused_on_every_rank():
    outcomes = run_distributed(2, init_twice, return_exceptions=True)
    raised_everywhere(outcomes, wf_mesh.StateError, r"a ParallelMesh is already initialized \(ParallelDims\(tp=1, cp=2")


def other_backend():
    wf_mesh.init_from_env(backend="nccl")


def test_a_backend_other_than_the_existing_groups_is_refused_on_every_rank():
    outcomes = run_distributed(2, other_backend, return_exceptions=True)
    raised_everywhere(
        outcomes, ValueError, r"init_from_env: backend='nccl', but the default process group .* uses 'gloo'"
    )


# ---- real launches ----------------------------------------------------------------------------------
SCRIPT = """
import dataclasses, json, sys
import torch, torch.distributed as dist
import wf_mesh
from wf_mesh.viz import mesh_axes

dims = wf_mesh.ParallelDims(tp=int(sys.argv[1]), cp=int(sys.argv[2]))
with wf_mesh.init_from_env(dims) as session:
    mesh = session.mesh
    total = torch.tensor([session.rank])
    dist.all_reduce(total, group=mesh.group("cp"))  # the mesh's groups work
    result = {
        "env": dataclasses.asdict(session.env), "owns": session.owns_process_group, "backend": session.backend,
        "device": str(session.device), "world": dist.get_world_size(), "coords": mesh.coords(),
        "groups": {axis: mesh.ranks(axis) for axis in mesh_axes(mesh.dims)}, "cp_sum": total.item(),
    }
result["initialized_after"] = dist.is_initialized()
if "--refuse" in sys.argv:  # the mesh is agreed after the process group exists: a refused mesh takes it down
    try:
        wf_mesh.init_from_env(dims, dp_replicate=3)
    except ValueError as e:
        result["refused"] = [str(e), dist.is_initialized()]
print("RESULT " + json.dumps(result), flush=True)
"""


def clean_env(**extra):
    """This environment without any launcher's variables, plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    kept = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    return {**kept, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def results(outputs):
    """Every rank's RESULT line, by rank."""
    found = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(found, key=lambda r: r["env"]["rank"])


def check_ranks(found, launcher, world, tp, cp, local_ranks):
    dims = wf_mesh.ParallelDims(tp=tp, cp=cp).resolve(world)
    assert [r["env"]["rank"] for r in found] == list(range(world))
    for rank, r in enumerate(found):
        assert (r["env"]["launcher"], r["env"]["world_size"], r["env"]["local_rank"]) == (
            launcher,
            world,
            local_ranks[rank],
        )
        assert (r["owns"], r["backend"], r["device"], r["world"]) == (True, "gloo", "cpu", world)
        assert r["coords"] == dims.coords(rank)
        assert r["groups"] == {axis: dims.group_of(axis, rank) for axis in mesh_axes(dims)}
        assert r["cp_sum"] == sum(dims.group_of("cp", rank))
        assert r["initialized_after"] is False  # close() destroyed the default group it had created


@pytest.mark.slow
def test_one_process_without_a_launcher(tmp_path):
    script = tmp_path / "boot.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), "1", "1", "--refuse"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = results([proc.stdout])
    assert found["env"] == {
        "launcher": "none",
        "rank": 0,
        "world_size": 1,
        "local_rank": None,
        "master_addr": None,
        "master_port": None,
    }
    check_ranks([found], "none", 1, 1, 1, [None])
    assert found["refused"] == [
        "init_parallel: dp_replicate=3 does not divide dp=1 (tp=1, cp=1, pp=1, dp=1); HSDP needs dp = dp_replicate * "
        "dp_shard",
        False,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, cp", [(2, 1, 2), (4, 2, 2)])
def test_under_torchrun(tmp_path, world, tp, cp):
    script = tmp_path / "boot.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(script)]
    proc = subprocess.run([*cmd, str(tp), str(cp)], env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = results([proc.stdout])
    check_ranks(found, "torchrun", world, tp, cp, list(range(world)))
    assert all(r["env"]["master_addr"] for r in found)


def free_port_in(low, high):
    """A port in [low, high) nobody listens on now (tried in a fixed pseudo-random order)."""
    for port in range(low + os.getpid() % 1000, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


@pytest.mark.slow
def test_under_srun_simulated_by_slurm_variables(tmp_path):
    """Two local processes with the variables srun gives its tasks: rank, task count, local id, the job id (the
    port derives from it) and a node list whose first host is this machine (no MASTER_ADDR / MASTER_PORT)."""
    script = tmp_path / "boot.py"
    script.write_text(SCRIPT)
    port = free_port_in(15000, 25000)
    job = f"31{port - 15000:04d}"
    procs = []
    for rank in range(2):
        env = clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_JOB_ID=job,
            SLURM_NODELIST="127.0.0.[1-2]",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "1", "2"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    found = results([out for out, _ in outputs])
    check_ranks(found, "slurm", 2, 1, 2, [0, 1])
    assert [(r["env"]["master_addr"], r["env"]["master_port"]) for r in found] == [("127.0.0.1", port)] * 2
