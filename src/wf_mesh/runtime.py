"""``dist_init(config)``: initialize torch.distributed from the launcher's environment and build the mesh.

Works the same on one laptop (CPU, gloo) and on GPU nodes (NCCL, torchrun): the launcher sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from wf_mesh import parallel_state
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh, parallel_mesh_or_none
from wf_mesh.pipeline import init_pp_scheduler, pp_scheduler_or_none
from wf_mesh.topology import ParallelDims

__all__ = ["bind_local_device", "dist_init"]

_REQUIRED = ("distributed_backend", "distributed_timeout_minutes", "cp_size", "pp_size")


def _read(config: Any, key: str, default: Any = ...) -> Any:
    value = config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
    if value is ...:
        raise ValueError(f"dist_init: config has no {key!r}; it needs {list(_REQUIRED)} (tp_size, dp_size optional)")
    return value


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise RuntimeError(
            f"dist_init: environment variable {name} is not set; launch with torchrun "
            "(or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
        ) from None
    except ValueError:
        raise ValueError(f"dist_init: {name}={os.environ[name]!r} is not an integer") from None


def bind_local_device(rank: int) -> torch.device:
    """Bind this process to its CUDA device (``LOCAL_RANK`` if set, else ``rank % device_count``);
    returns ``cpu`` when CUDA is unavailable."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def dist_init(config: Any) -> ParallelMesh:
    """Initialize torch.distributed and the tp/cp/pp/dp mesh from ``config`` (or ``config.engine_config``).

    The config (attributes or a dict) provides ``distributed_backend`` (``"nccl"``, ``"gloo"``, or None to
    pick nccl with CUDA and gloo without), ``distributed_timeout_minutes``, ``cp_size``, ``pp_size``, and
    optionally ``tp_size`` and ``dp_size`` (default 1) and ``order`` (default ``"tp-cp-pp-dp"``). Rank and world size come from ``RANK`` and
    ``WORLD_SIZE``; the rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` (``env://``).

    Safe to call again: an initialized default group is reused, and an existing mesh with the same degrees
    is returned as is. With ``pp_size > 1`` the legacy PP scheduler is created too (once). Returns the current :class:`~wf_mesh.mesh.ParallelMesh`.
    """
    config = getattr(config, "engine_config", config)
    backend = _read(config, "distributed_backend")
    timeout_minutes = _read(config, "distributed_timeout_minutes")
    cp, pp = int(_read(config, "cp_size")), int(_read(config, "pp_size"))
    tp, dp = int(_read(config, "tp_size", 1)), int(_read(config, "dp_size", 1))
    order = _read(config, "order", "tp-cp-pp-dp")
    wanted = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, order=order)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if tp * cp * pp * dp != world_size:
        raise ValueError(
            f"dist_init: tp_size*cp_size*pp_size*dp_size = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp} "
            f"!= WORLD_SIZE={world_size}"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("dist_init: distributed_backend='nccl' needs CUDA, which is not available; use 'gloo'")
    device = bind_local_device(rank) if backend == "nccl" else torch.device("cpu")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    mesh = parallel_mesh_or_none()
    if mesh is None:
        parallel_state.initialize_model_parallel(
            tp_size=tp, pp_size=pp, cp_size=cp, distributed_timeout_minutes=timeout_minutes, order=order
        )
    elif mesh.dims != wanted:
        raise RuntimeError(
            f"dist_init: a different mesh is already initialized ({mesh.dims}); asked for {wanted}; "
            "call destroy_model_parallel() first"
        )
    if pp > 1 and pp_scheduler_or_none() is None:
        init_pp_scheduler()
    return get_parallel_mesh()
