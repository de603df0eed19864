"""dist_init (the legacy wrapper over init_from_env): config and environment validation, CPU/gloo
initialization, idempotence."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.testing import run_distributed

from helpers import raised_everywhere

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


# ---- no silently ignored setting ----------------------------------------------------------------------
ACCEPTED = (
    "dist_init reads distributed_backend, distributed_timeout_minutes, tp_size, cp_size, pp_size, dp_size, order, "
    "cp_ulysses_size, dp_replicate; Megatron's tensor_model_parallel_size (tp_size), context_parallel_size "
    "(cp_size), pipeline_model_parallel_size (pp_size), data_parallel_size (dp_size); MAGI-1's cp_strategy, "
    "ulysses_overlap_degree (checked, not applied); other keys are ignored"
)


@dataclasses.dataclass
class EngineConfig:
    """MAGI-1's engine config (its fields as MAGI-1 declares them), the distributed ones and the others."""

    distributed_backend: str = "gloo"
    distributed_timeout_minutes: int = 10
    pp_size: int = 1
    cp_size: int = 1
    cp_strategy: str = "none"
    ulysses_overlap_degree: int = 1
    fp8_quant: bool = False
    distill_nearly_clean_chunk_threshold: float = 0.3
    shortcut_mode: str = "8,16,16"
    distill: bool = False
    kv_offload: bool = False
    enable_cuda_graph: bool = False

    @property
    def cp_sizes(self):  # a property (a near-miss of cp_size by name) is not a setting
        return [self.cp_size]

    def tp_sizes(self):  # nor is a method
        return 1


class ClassLevelConfig:
    """A config whose settings are class attributes (read by getattr, so checked too)."""

    cp_size = 2
    tp_szie = 2


@pytest.mark.parametrize(
    "config, message",
    [
        ({"cp_sizee": 1}, "'cp_sizee' is not a key dist_init reads (did you mean 'cp_size'?)"),
        (SimpleNamespace(cp_szie=2), "'cp_szie' is not a key dist_init reads (did you mean 'cp_size'?)"),
        ({"CP_SIZE": 2}, "'CP_SIZE' is not a key dist_init reads (did you mean 'cp_size'?)"),
        ({"dp_replicas": 2}, "'dp_replicas' is not a key dist_init reads (did you mean 'dp_replicate'?)"),
        (ClassLevelConfig(), "'tp_szie' is not a key dist_init reads (did you mean 'tp_size'?)"),
        ({"tensor_parallel_degree": 2}, "tensor_parallel_degree=2 is not read by dist_init: use tp_size"),
        ({"ulysses_degree": 2}, "ulysses_degree=2 is not read by dist_init: use cp_ulysses_size (with cp_size"),
        (SimpleNamespace(cp=2), "cp=2 is not read by dist_init: use cp_size"),
        ({"ep_size": 2}, "ep_size=2 asks for expert parallelism, which wf_mesh does not shard; only None or 1"),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            "virtual_pipeline_model_parallel_size=2 asks for a virtual pipeline: use initialize_model_parallel(",
        ),
    ],
)
def test_near_misses_and_foreign_settings_raise_naming_the_key(config, message):
    with pytest.raises(ValueError) as raised:
        wf_mesh.dist_init(config)
    assert str(raised.value).startswith(f"dist_init: config {message}")
    assert str(raised.value).endswith(f". {ACCEPTED}")
    assert not dist.is_initialized()


def test_every_bad_key_is_named_at_once():
    config = {"cp_sizee": 1, "tensor_parallel_degree": 2, "fp8_quant": True, "expert_model_parallel_size": 1}
    with pytest.raises(ValueError) as raised:
        wf_mesh.dist_init(config)
    assert str(raised.value) == (
        "dist_init: config 'cp_sizee' is not a key dist_init reads (did you mean 'cp_size'?); "
        f"tensor_parallel_degree=2 is not read by dist_init: use tp_size. {ACCEPTED}"
    )


@pytest.mark.parametrize(
    "config, error, message",
    [
        (
            {"cp_size": 2, "context_parallel_size": 4},
            ValueError,
            "dist_init: config cp_size=2 and context_parallel_size=4 are two spellings of cp_size with different "
            "values; give one",
        ),
        (
            {"tensor_model_parallel_size": "2"},
            TypeError,
            "dist_init: config tensor_model_parallel_size must be an int, got str '2'",
        ),
        ({"data_parallel_size": 0}, ValueError, "dist_init: config data_parallel_size=0 must be >= 1"),
        (
            {"cp_strategy": 2},
            TypeError,
            "dist_init: config cp_strategy must be a str (one of none, cp_ulysses, cp_shuffle_overlap), got int 2",
        ),
        (
            {"ulysses_overlap_degree": 0},
            ValueError,
            "dist_init: config ulysses_overlap_degree=0 must be >= 1",
        ),
    ],
)
def test_aliases_and_magi_settings_are_checked(config, error, message):
    with pytest.raises(error) as raised:
        wf_mesh.dist_init(config)
    assert str(raised.value) == message
    assert not dist.is_initialized()


def dist_init_dims(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = wf_mesh.dist_init(config)
    return mesh.dims, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_megatron_spellings_are_applied():
    """The issue's case: {"context_parallel_size": 2} on 4 processes built dp=4, cp=1."""
    results = run_distributed(4, dist_init_dims, {"context_parallel_size": 2})
    assert [dims for dims, _ in results] == [wf_mesh.ParallelDims(cp=2, dp=2).resolve(4)] * 4
    megatron = SimpleNamespace(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=1,
                               data_parallel_size=1, expert_model_parallel_size=1,
                               virtual_pipeline_model_parallel_size=None, cp_size=2, seq_length=4096)  # fmt: skip
    results = run_distributed(4, dist_init_dims, megatron)
    assert [dims for dims, _ in results] == [wf_mesh.ParallelDims(tp=2, cp=2, dp=1).resolve(4)] * 4
    assert all(caught == [] for _, caught in results)


def test_magi_engine_config_builds_its_mesh_and_says_what_it_does_not_apply():
    results = run_distributed(2, dist_init_dims, EngineConfig(cp_size=2, cp_strategy="cp_ulysses",
                                                              ulysses_overlap_degree=2, fp8_quant=True))  # fmt: skip
    assert [dims for dims, _ in results] == [wf_mesh.ParallelDims(cp=2).resolve(2)] * 2
    assert results[0][1] == [
        "dist_init: MAGI-1's attention settings are not applied (wf_mesh chooses the CP attention method per call): "
        "cp_strategy='cp_ulysses': pass method='ulysses' to cp_attention / CPSelfAttention; "
        "ulysses_overlap_degree=2: wf_mesh has no such setting"
    ]
    assert results[1][1] == []  # rank 0 says it once
    quiet = run_distributed(2, dist_init_dims, SimpleNamespace(engine_config=EngineConfig(cp_size=2)))  # "none", 1
    assert [caught for _, caught in quiet] == [[], []]


def test_a_bad_key_raises_on_every_rank_before_any_collective():
    outcomes = run_distributed(4, wf_mesh.dist_init, {"cp_size": 2, "cp_sizee": 1}, return_exceptions=True)
    raised_everywhere(outcomes, ValueError, re.escape("'cp_sizee' is not a key dist_init reads (did you mean"))
