"""dist_init (the legacy wrapper over init_from_env): config and environment validation, CPU/gloo
initialization, idempotence."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import run_distributed

CONFIG = {"distributed_backend": "gloo", "distributed_timeout_minutes": 5, "cp_size": 2, "pp_size": 1}


@pytest.mark.parametrize(
    "config, error, message",
    [
        ({**CONFIG, "cp_size": "two"}, TypeError, "dist_init: config cp_size must be an int, got str 'two'"),
        ({**CONFIG, "cp_size": None}, TypeError, "dist_init: config cp_size must be an int, got NoneType None"),
        ({**CONFIG, "cp_size": 2.9}, TypeError, "dist_init: config cp_size must be an int, got float 2.9"),
        ({**CONFIG, "pp_size": 0}, ValueError, "dist_init: config pp_size=0 must be >= 1"),
        (
            {**CONFIG, "distributed_timeout_minutes": "30"},
            TypeError,
            "dist_init: config distributed_timeout_minutes must be a number of minutes, got str '30'",
        ),
        (
            {**CONFIG, "distributed_timeout_minutes": -1},
            ValueError,
            "dist_init: config distributed_timeout_minutes=-1 must be > 0",
        ),
        (
            {**CONFIG, "distributed_timeout_minutes": 0},
            ValueError,
            "dist_init: config distributed_timeout_minutes=0 must be > 0",
        ),
        (
            {**CONFIG, "distributed_backend": "mpi"},
            ValueError,
            "dist_init: config distributed_backend='mpi': use 'nccl', 'gloo' or None (auto)",
        ),
    ],
)
def test_config_errors_name_the_key(config, error, message):
    with pytest.raises(error, match=re.escape(message)):
        wf_mesh.dist_init(config)
    assert not dist.is_initialized()


def test_environment_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(
        RuntimeError, match="environment variable WORLD_SIZE is not set but RANK is; launch with torchrun"
    ):
        wf_mesh.dist_init(CONFIG)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="dist_init: environment variable WORLD_SIZE='four' is not an integer"):
        wf_mesh.dist_init(CONFIG)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")  # before: gloo failed inside while the peer waited the whole timeout
    with pytest.raises(ValueError, match=re.escape("dist_init: RANK=2 must be in [0, WORLD_SIZE=2)")):
        wf_mesh.dist_init(CONFIG)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(
        RuntimeError, match="dist_init: RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT not"
    ):
        wf_mesh.dist_init(CONFIG)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")  # never reached: the degrees are refused first
    with pytest.raises(
        ValueError,
        match=re.escape(
            "dist_init: world_size=6 is not divisible by tp*cp*pp = 1*4*1 = 4; cannot infer dp (WORLD_SIZE=6; config "
            "tp_size, cp_size, pp_size, dp_size)"
        ),
    ):
        wf_mesh.dist_init(SimpleNamespace(engine_config=SimpleNamespace(**{**CONFIG, "cp_size": 4})))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="distributed_backend='nccl' needs CUDA, which is not available"):
            wf_mesh.dist_init({**CONFIG, "distributed_backend": "nccl"})
    assert not dist.is_initialized()


def dist_init_twice(config):
    mesh = wf_mesh.dist_init(config)
    again = wf_mesh.dist_init(SimpleNamespace(**config))
    try:
        wf_mesh.dist_init({**config, "cp_size": 1, "dp_size": 4})
    except RuntimeError as e:
        message = str(e)
    return mesh is again, mesh.coords(), message


def test_idempotent_when_initialized():
    config = {**CONFIG, "dp_size": 2}
    plan = wf_mesh.ParallelDims(cp=2, dp=2).resolve(4)
    for rank, (same, coords, message) in enumerate(run_distributed(4, dist_init_twice, config)):
        assert same and coords == plan.coords(rank)
        assert message.startswith(
            "dist_init: a different mesh is already initialized (ParallelDims(tp=1, cp=2, pp=1, dp=2"
        )
        assert "asked for ParallelDims(tp=1, cp=1, pp=1, dp=4" in message


def dp_inferred_with_defaults():
    mesh = wf_mesh.dist_init({"cp_size": 2})  # no backend, timeout, pp_size or dp_size: defaults, dp inferred
    return mesh.dims.dp, dist.get_backend()


def test_dp_is_inferred_and_keys_default():
    assert run_distributed(4, dp_inferred_with_defaults) == [(2, "gloo")] * 4


SCRIPT = """
import json, sys, wf_mesh, torch.distributed as dist
mesh = wf_mesh.dist_init({})
print(json.dumps([dist.get_backend(), dist.get_world_size(), mesh.coords(), mesh.device_type]))
wf_mesh.destroy_model_parallel()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_without_a_launcher_it_runs_as_one_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["gloo", 1, {"tp": 0, "cp": 0, "pp": 0, "dp": 0}, "cpu"]
    assert "init_from_env: no launcher (RANK, WORLD_SIZE, SLURM_PROCID not set): a single process" in out.stderr
