"""``dist_init(config)``: the original package's bootstrap, a thin wrapper over :func:`wf_mesh.init_from_env`
that maps its config keys, plus the original runtime predicates (``is_last_rank``, ``is_last_tp_cp_rank``,
``get_device``).
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch
import torch.distributed as dist

from wf_mesh.bootstrap import init_from_env, read_launch_env
from wf_mesh.legacy.config_keys import attention_note, check_keys, read
from wf_mesh.legacy.model_parallel import current_mesh, timeout_minutes
from wf_mesh.legacy.pipeline import init_pp_scheduler, pp_scheduler_or_none
from wf_mesh.mesh import ParallelMesh, parallel_mesh_or_none
from wf_mesh.topology import DEFAULT_ORDER, ParallelDims, as_int

__all__ = ["dist_init", "get_device", "is_last_rank", "is_last_tp_cp_rank"]


def _degree(config: Any, key: str) -> int:
    name, value = read(config, key, 1)
    return as_int(f"dist_init: config {name}", value, minimum=1)


def _dp(config: Any) -> int:
    name, value = read(config, "dp_size", None)
    if value is None or value == -1:
        return -1
    return as_int(f"dist_init: config {name}", value, minimum=1)


def _timeout(config: Any) -> datetime.timedelta:
    _, minutes = read(config, "distributed_timeout_minutes", 30)
    return timeout_minutes(minutes, "dist_init: config distributed_timeout_minutes")


def _backend(config: Any) -> str | None:
    """The configured backend, or None: init_from_env's choice (nccl with CUDA, gloo without)."""
    _, backend = read(config, "distributed_backend", None)
    if backend is None:
        return None
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"dist_init: config distributed_backend={backend!r}: use 'nccl', 'gloo' or None (auto)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("dist_init: distributed_backend='nccl' needs CUDA, which is not available; use 'gloo'")
    return backend


def _attention_note(config: Any) -> str | None:
    """MAGI-1's cp_strategy / ulysses_overlap_degree, checked; the warning's text when they ask for something."""
    return attention_note(read(config, "cp_strategy", None)[1], read(config, "ulysses_overlap_degree", None)[1])


def dist_init(config: Any) -> ParallelMesh:
    """Initialize torch.distributed and the tp/cp/pp/dp mesh from ``config`` (or ``config.engine_config``): the
    legacy face of :func:`wf_mesh.init_from_env`, which reads the launcher's environment (torchrun, SLURM, or
    none: one process), picks the backend and binds ``cuda:LOCAL_RANK`` with NCCL.

    The config (attributes or a dict) may provide, all optional: ``distributed_backend`` (``"nccl"``,
    ``"gloo"``, or None: nccl with CUDA, gloo without), ``distributed_timeout_minutes`` (default 30),
    ``tp_size``, ``cp_size``, ``pp_size`` (default 1), ``dp_size`` (absent, None or -1: inferred from the world
    size), ``order`` (default :data:`wf_mesh.topology.DEFAULT_ORDER`, i.e. ``"tp-cp-pp-dp"`` with cfg 1),
    ``cp_ulysses_size`` (default 1: the Ulysses part of cp for USP attention) and ``dp_replicate`` (default
    none: also build the HSDP view with that many replicas).

    No setting is silently ignored (:mod:`wf_mesh.legacy.config_keys`): Megatron's spellings
    ``tensor_model_parallel_size``, ``context_parallel_size``, ``pipeline_model_parallel_size`` and
    ``data_parallel_size`` are accepted for ``tp_size`` ... ``dp_size`` (both spellings with different values
    are an error); a near-miss of a known key (``cp_sizee``, ``CP_SIZE``), another framework's spelling
    (``tensor_parallel_degree``, ``ulysses_degree``, ``cp``, ...) or expert / virtual pipeline parallelism set
    to anything but None or 1 raises, naming the key to use. Other keys are left alone: real configs carry
    model and runtime fields (MAGI-1's ``fp8_quant``, ``distill``, ``kv_offload``, ``enable_cuda_graph``).
    MAGI-1's ``cp_strategy`` and ``ulysses_overlap_degree`` are checked (a str; an int >= 1) but not applied:
    wf_mesh chooses the attention method per call (``cp_attention(method="ulysses")`` for ``"cp_ulysses"``), so
    a value other than ``"none"`` / 1 draws one UserWarning on rank 0 saying so.

    Everything is validated before any network traffic, each error naming the config key or the variable
    (every rank reads the same config, so every rank raises). Safe to call again: an initialized default group
    is reused, and an existing mesh with the same degrees is returned as is (a different one is an error).
    With ``pp_size > 1`` the legacy PP scheduler is created too (once). Teardown is the original's:
    ``destroy_model_parallel()``, then the caller destroys the default group.

    Returns:
        The current :class:`~wf_mesh.mesh.ParallelMesh`.

    Raises:
        TypeError: ``config`` is None, or a degree, the timeout, ``cp_strategy`` or ``ulysses_overlap_degree``
            has the wrong type.
        ValueError: a bad config value or key (named), two spellings of one key with different values, or
            degrees that do not fit the world size (a DegreeError naming the config keys).
        RuntimeError: ``distributed_backend="nccl"`` without CUDA, or a mesh of other degrees is already
            initialized.
    """
    config = getattr(config, "engine_config", config)
    if config is None:
        raise TypeError("dist_init: config is None; pass a dict or an object with the distributed settings")
    check_keys(config)
    backend, timeout, note = _backend(config), _timeout(config), _attention_note(config)
    wanted = ParallelDims(
        tp=_degree(config, "tp_size"),
        cp=_degree(config, "cp_size"),
        pp=_degree(config, "pp_size"),
        dp=_dp(config),
        order=read(config, "order", DEFAULT_ORDER)[1],
        cp_ulysses=_degree(config, "cp_ulysses_size"),
    )
    world_size = dist.get_world_size() if dist.is_initialized() else read_launch_env(what="dist_init").world_size
    try:
        wanted = wanted.resolve(world_size)
    except ValueError as e:
        raise type(e)(f"dist_init: {e} (WORLD_SIZE={world_size}; config tp_size, cp_size, pp_size, dp_size)") from None
    mesh = parallel_mesh_or_none()
    if mesh is None:
        _, dp_replicate = read(config, "dp_replicate", None)
        backend = None if dist.is_initialized() else backend  # an existing default group keeps its own
        mesh = init_from_env(wanted, backend=backend, timeout=timeout, dp_replicate=dp_replicate).mesh
    elif mesh.dims != wanted:
        raise RuntimeError(
            f"dist_init: a different mesh is already initialized ({mesh.dims}); asked for {wanted}; "
            "call destroy_model_parallel() first"
        )
    if wanted.pp > 1 and pp_scheduler_or_none() is None:
        init_pp_scheduler()
    if note is not None and dist.get_rank() == 0:
        warnings.warn(note, UserWarning, stacklevel=2)
    return mesh


def is_last_rank() -> bool:
    """True on global rank ``world_size - 1`` (and in a non-distributed process)."""
    if not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def is_last_tp_cp_rank() -> bool:
    """True on the last rank of this rank's tp x cp group (and in a non-distributed process)."""
    if not dist.is_initialized():
        return True
    mesh = current_mesh()
    return mesh.rank("tp_cp") == mesh.size("tp_cp") - 1


def get_device() -> torch.device:
    """This process's compute device: the current CUDA device when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
