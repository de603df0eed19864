"""``dist_init(config)``: initialize torch.distributed from the launcher's environment and build the mesh, plus
the original package's runtime predicates (``is_last_rank``, ``is_last_tp_cp_rank``, ``get_device``).

Works the same on one laptop (CPU, gloo) and on GPU nodes (NCCL, torchrun): the launcher sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Without a launcher (``python train.py``)
it runs as a single process: a world of one on a free local port.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from wf_mesh.legacy.model_parallel import timeout_minutes
from wf_mesh.legacy.pipeline import init_pp_scheduler, pp_scheduler_or_none
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh, init_parallel, parallel_mesh_or_none
from wf_mesh.topology import ParallelDims, as_int

__all__ = ["dist_init", "get_device", "is_last_rank", "is_last_tp_cp_rank"]


def _read(config: Any, key: str, default: Any) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _degree(config: Any, key: str) -> int:
    return as_int(f"dist_init: config {key}", _read(config, key, 1), minimum=1)


def _dp(config: Any) -> int:
    value = _read(config, "dp_size", None)
    if value is None or value == -1:
        return -1
    return _degree(config, "dp_size")


def _timeout(config: Any) -> datetime.timedelta:
    minutes = _read(config, "distributed_timeout_minutes", 30)
    return timeout_minutes(minutes, "dist_init: config distributed_timeout_minutes")


def _backend(config: Any) -> str:
    backend = _read(config, "distributed_backend", None)
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"dist_init: config distributed_backend={backend!r}: use 'nccl', 'gloo' or None (auto)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("dist_init: distributed_backend='nccl' needs CUDA, which is not available; use 'gloo'")
    return backend


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"dist_init: environment variable {name}={value!r} is not an integer") from None


def _launch() -> tuple[int, int, str]:
    """``(rank, world_size, init_method)`` from the launcher's environment, or a world of one."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        logger.info("dist_init: RANK and WORLD_SIZE are not set (no launcher): running as a single process")
        return 0, 1, f"tcp://127.0.0.1:{port}"
    for name, other in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if name not in os.environ:
            raise RuntimeError(
                f"dist_init: environment variable {name} is not set but {other} is; launch with torchrun (or set "
                "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or none of them for a single process)"
            )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"dist_init: RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    return rank, world_size, "env://"


def bind_local_device(rank: int) -> torch.device:
    """Bind this process to its CUDA device (``LOCAL_RANK`` if set, else ``rank % device_count``)."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def dist_init(config: Any) -> ParallelMesh:
    """Initialize torch.distributed and the tp/cp/pp/dp mesh from ``config`` (or ``config.engine_config``).

    The config (attributes or a dict) may provide, all optional: ``distributed_backend`` (``"nccl"``,
    ``"gloo"``, or None: nccl with CUDA, gloo without), ``distributed_timeout_minutes`` (default 30),
    ``tp_size``, ``cp_size``, ``pp_size`` (default 1), ``dp_size`` (absent, None or -1: inferred from the world
    size), ``order`` (default ``"tp-cp-pp-dp"``), ``cp_ulysses_size`` (default 1: the Ulysses part of cp
    for USP attention) and ``dp_replicate`` (default none: also build the HSDP view with that many replicas). Rank and world size come from ``RANK`` / ``WORLD_SIZE``
    (``env://`` rendezvous through ``MASTER_ADDR`` / ``MASTER_PORT``); without them it runs as one process.
    With NCCL it binds ``cuda:LOCAL_RANK`` first.

    Everything is validated before any network traffic, each error naming the config key or the variable.
    Safe to call again: an initialized default group is reused, and an existing mesh with the same degrees
    is returned as is (a different one is an error). With ``pp_size > 1`` the legacy PP scheduler is created
    too (once). Returns the current :class:`~wf_mesh.mesh.ParallelMesh`.
    """
    config = getattr(config, "engine_config", config)
    if config is None:
        raise TypeError("dist_init: config is None; pass a dict or an object with the distributed settings")
    backend, timeout = _backend(config), _timeout(config)
    order = _read(config, "order", "tp-cp-pp-dp")
    wanted = ParallelDims(
        tp=_degree(config, "tp_size"),
        cp=_degree(config, "cp_size"),
        pp=_degree(config, "pp_size"),
        dp=_dp(config),
        order=order,
        cp_ulysses=_degree(config, "cp_ulysses_size"),
    )
    if dist.is_initialized():
        rank, world_size, init_method = dist.get_rank(), dist.get_world_size(), None
    else:
        rank, world_size, init_method = _launch()
    try:
        wanted = wanted.resolve(world_size)
    except ValueError as e:
        raise type(e)(f"dist_init: {e} (WORLD_SIZE={world_size}; config tp_size, cp_size, pp_size, dp_size)") from None
    if init_method is not None:
        device = bind_local_device(rank) if backend == "nccl" else None
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device,
        )
    dp_replicate = _read(config, "dp_replicate", None)
    mesh = parallel_mesh_or_none()
    if mesh is None:
        init_parallel(wanted, timeout=timeout, dp_replicate=dp_replicate)
    elif mesh.dims != wanted:
        raise RuntimeError(
            f"dist_init: a different mesh is already initialized ({mesh.dims}); asked for {wanted}; "
            "call destroy_model_parallel() first"
        )
    if wanted.pp > 1 and pp_scheduler_or_none() is None:
        init_pp_scheduler()
    return get_parallel_mesh()


def is_last_rank() -> bool:
    """True on global rank ``world_size - 1`` (and in a non-distributed process)."""
    if not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def is_last_tp_cp_rank() -> bool:
    """True on the last rank of this rank's tp x cp group (and in a non-distributed process)."""
    if not dist.is_initialized():
        return True
    mesh = get_parallel_mesh()
    return mesh.rank("tp_cp") == mesh.size("tp_cp") - 1


def get_device() -> torch.device:
    """This process's compute device: the current CUDA device when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
