"""dist_init: config and environment validation, CPU/gloo initialization, idempotence."""

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import run_distributed

CONFIG = {"distributed_backend": "gloo", "distributed_timeout_minutes": 5, "cp_size": 2, "pp_size": 1}


def test_config_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"dist_init: config has no 'pp_size'; it needs \['distributed_backend', "):
        wf_mesh.dist_init({k: v for k, v in CONFIG.items() if k != "pp_size"})
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="environment variable RANK is not set; launch with torchrun"):
        wf_mesh.dist_init(CONFIG)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="dist_init: WORLD_SIZE='four' is not an integer"):
        wf_mesh.dist_init(CONFIG)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=r"tp_size\*cp_size\*pp_size\*dp_size = 1\*2\*1\*1 = 2 != WORLD_SIZE=6"):
        wf_mesh.dist_init(SimpleNamespace(engine_config=SimpleNamespace(**CONFIG)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    if not __import__("torch").cuda.is_available():
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
    same, coords, message = run_distributed(4, dist_init_twice, config)[3]
    assert same and coords == {"tp": 0, "cp": 1, "pp": 0, "dp": 1}
    assert message.startswith("dist_init: a different mesh is already initialized (ParallelDims(tp=1, cp=2, pp=1, dp=2")
    assert "asked for ParallelDims(tp=1, cp=1, pp=1, dp=4" in message


SCRIPT = """
import json, sys, wf_mesh, torch.distributed as dist
mesh = wf_mesh.dist_init(dict(distributed_backend=None, distributed_timeout_minutes=1, cp_size=1, pp_size=1))
print(json.dumps([dist.get_backend(), dist.get_world_size(), mesh.coords(), mesh.device_type]))
wf_mesh.destroy_model_parallel()
dist.destroy_process_group()
"""


def test_initializes_gloo_on_cpu_from_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["gloo", 1, {"tp": 0, "cp": 0, "pp": 0, "dp": 0}, "cpu"]
