"""``init_from_env(dims)``: start torch.distributed from the launcher's environment, build the mesh, and tear
down exactly what was started.

One call replaces the usual preamble (read ``RANK`` / ``LOCAL_RANK``, pick nccl or gloo, bind the GPU,
``init_process_group``, build the mesh) and its teardown::

    with wf_mesh.init_from_env(wf_mesh.ParallelDims(tp=2, cp=2)) as session:
        mesh = session.mesh              # the ParallelMesh, also wf_mesh.get_parallel_mesh()
        ...                              # train
    # the mesh is destroyed; the default process group too, if init_from_env created it

Where rank and world size come from, first match wins (:func:`read_launch_env`):

1. an initialized default process group (a framework or test harness started it): it is used as is and
   left alive by :meth:`DistributedSession.close`;
2. torchrun (or any launcher exporting its variables): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT`` (``env://`` rendezvous). torchrun under SLURM lands here too: its
   variables describe the process, SLURM's the allocation;
3. SLURM (``srun python train.py``, one task per process): ``SLURM_PROCID``, ``SLURM_NTASKS``,
   ``SLURM_LOCALID``; the rendezvous host is ``MASTER_ADDR`` if set, else the first host of
   ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST`` (task 0 runs there), else
   ``SLURM_LAUNCH_NODE_IPADDR``; the port is ``MASTER_PORT`` if set, else ``15000`` plus the last four digits
   of ``SLURM_JOB_ID`` (every task derives the same one, and jobs sharing a node get different ones);
4. nothing: a world of one process on a private in-process store (no port, no network).

Backend: ``nccl`` when CUDA is available and the device is not ``"cpu"``, else ``gloo``. With CUDA each
process binds ``cuda:LOCAL_RANK`` (``SLURM_LOCALID`` under SLURM) before the process group exists.
Everything is validated before any network traffic, each error naming the variable or argument.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import re
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from wf_mesh.mesh import DEVICE_TYPES, ParallelMesh, init_parallel
from wf_mesh.topology import ParallelDims

__all__ = ["DistributedSession", "LaunchEnv", "first_host", "init_from_env", "read_launch_env"]

LAUNCHERS = ("torchrun", "slurm", "none")
"""What :attr:`LaunchEnv.launcher` can say: torchrun's variables, SLURM's, or none (one process)."""

BACKENDS = ("nccl", "gloo")

SLURM_PORT_BASE = 15000
"""A SLURM job without ``MASTER_PORT`` rendezvouses on this plus the last four digits of its job id."""

_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TORCHRUN = ("RANK", "WORLD_SIZE")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS")


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher said about this process (see the module docstring for the precedence).

    ``master_addr`` / ``master_port`` are None for one process without a launcher (a private store);
    ``local_rank`` is None when the launcher did not say (torchrun always does).
    """

    launcher: str
    """One of :data:`LAUNCHERS`."""
    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str | None
    master_port: int | None

    @property
    def init_method(self) -> str | None:
        """The ``init_process_group`` URL, or None for the private store of a world of one."""
        if self.master_addr is None:
            return None
        if self.launcher == "torchrun":
            return "env://"  # torchrun's agent may share its store through the environment
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr  # IPv6
        return f"tcp://{host}:{self.master_port}"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``"node[03-05,9],gpu1"`` -> ``"node03"`` (zero padding kept).

    Returns:
        The host name.

    Raises:
        ValueError: ``nodelist`` is empty or its brackets do not match.
    """
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            break
        if depth == 0 and char in ", ":
            end = i
            break
    host = re.sub(r"\[([^\[\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())
    if not host or "[" in host or "]" in host or depth < 0:
        raise ValueError(f"cannot read the first host of the SLURM host list {nodelist!r}")
    return host


def _int(environ: Mapping[str, str], name: str, what: str, *, minimum: int = 0) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{what}: environment variable {name}={value!r} is not an integer") from None
    if number < minimum:
        raise ValueError(f"{what}: environment variable {name}={number} must be >= {minimum}")
    return number


def _require(environ: Mapping[str, str], names: tuple[str, str], what: str, hint: str) -> None:
    for name, other in (names, names[::-1]):
        if name not in environ:
            raise RuntimeError(f"{what}: environment variable {name} is not set but {other} is; {hint}")


def _port(environ: Mapping[str, str], name: str, what: str) -> int:
    port = _int(environ, name, what, minimum=1)
    if port > 65535:
        raise ValueError(f"{what}: environment variable {name}={port} is not a port (1-65535)")
    return port


def _torchrun(environ: Mapping[str, str], what: str) -> LaunchEnv:
    hint = (
        "launch with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or none of them for one process)"
    )
    _require(environ, _TORCHRUN, what, hint)
    rank, world_size = _int(environ, "RANK", what), _int(environ, "WORLD_SIZE", what, minimum=1)
    if rank >= world_size:
        raise ValueError(f"{what}: RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        raise RuntimeError(
            f"{what}: RANK and WORLD_SIZE are set but {' and '.join(missing)} not: the env:// rendezvous needs "
            "MASTER_ADDR and MASTER_PORT (torchrun sets all four)"
        )
    local_rank = _int(environ, "LOCAL_RANK", what) if "LOCAL_RANK" in environ else None
    port = _port(environ, "MASTER_PORT", what)
    return LaunchEnv("torchrun", rank, world_size, local_rank, environ["MASTER_ADDR"], port)


def _slurm(environ: Mapping[str, str], what: str) -> LaunchEnv:
    rank, world_size = _int(environ, "SLURM_PROCID", what), _int(environ, "SLURM_NTASKS", what, minimum=1)
    if rank >= world_size:
        raise ValueError(f"{what}: SLURM_PROCID={rank} must be in [0, SLURM_NTASKS={world_size})")
    local_rank = _int(environ, "SLURM_LOCALID", what) if "SLURM_LOCALID" in environ else None
    if world_size == 1:  # nothing to meet: no host, no port
        return LaunchEnv("slurm", 0, 1, local_rank, None, None)
    if environ.get("MASTER_ADDR"):
        host = environ["MASTER_ADDR"]
    elif nodelist := next((environ[n] for n in _SLURM_NODELISTS if environ.get(n)), None):
        host = first_host(nodelist)
    elif environ.get("SLURM_LAUNCH_NODE_IPADDR"):
        host = environ["SLURM_LAUNCH_NODE_IPADDR"]
    else:
        raise RuntimeError(
            f"{what}: SLURM task {rank} of {world_size} cannot tell where task 0 runs: none of MASTER_ADDR, "
            f"{', '.join(_SLURM_NODELISTS)}, SLURM_LAUNCH_NODE_IPADDR is set"
        )
    if environ.get("MASTER_PORT"):
        port = _port(environ, "MASTER_PORT", what)
    else:
        job = environ.get("SLURM_JOB_ID", "")
        if not job.isdigit():
            raise RuntimeError(
                f"{what}: SLURM task {rank} of {world_size} needs MASTER_PORT or a numeric SLURM_JOB_ID to choose "
                f"the rendezvous port, got SLURM_JOB_ID={job or None!r}"
            )
        port = SLURM_PORT_BASE + int(job[-4:])
    return LaunchEnv("slurm", rank, world_size, local_rank, host, port)


def read_launch_env(environ: Mapping[str, str] | None = None, *, what: str = "init_from_env") -> LaunchEnv:
    """Rank, world size, local rank and rendezvous of this process from ``environ`` (default ``os.environ``):
    torchrun's variables if ``RANK`` or ``WORLD_SIZE`` is set, else SLURM's if ``SLURM_PROCID`` and
    ``SLURM_NTASKS`` are, else a world of one. Pure: reads, connects nothing.

    Args:
        environ: the environment to read.
        what: the caller's name, for the messages.

    Returns:
        What the launcher said.

    Raises:
        RuntimeError: a variable the launcher's set needs is missing (``RANK`` without ``WORLD_SIZE``, ...).
        ValueError: a variable is not a number, or a rank is out of range.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _TORCHRUN):
        return _torchrun(environ, what)
    if all(name in environ for name in _SLURM):
        return _slurm(environ, what)
    return LaunchEnv("none", 0, 1, None, None, None)


@dataclasses.dataclass(eq=False)
class DistributedSession:
    """What :func:`init_from_env` started: the mesh, and whether it created the default process group.

    A context manager; :meth:`close` (also on leaving the ``with`` block) tears down exactly what was
    started: the mesh, and the default process group only if ``owns_process_group``.
    """

    mesh: ParallelMesh
    env: LaunchEnv | None
    """What was read from the environment; None when the default group already existed (nothing was read)."""
    backend: str
    device: torch.device
    """This process's compute device: ``cuda:LOCAL_RANK`` (bound) with CUDA, else CPU."""
    owns_process_group: bool
    closed: bool = False
    _default_group: Any = dataclasses.field(default=None, repr=False)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.mesh.global_rank

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return self.mesh.dims.world_size

    def close(self) -> None:
        """Destroy the mesh, then the default process group if this session created it (and it is still the
        default group). Idempotent; a mesh or group destroyed meanwhile by someone else is skipped."""
        if self.closed:
            return
        self.closed = True
        self.mesh.destroy()
        if self.owns_process_group and dist.is_initialized() and dist.group.WORLD is self._default_group:
            dist.destroy_process_group()
        self._default_group = None

    def __enter__(self) -> DistributedSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_MESH_OPTIONS = tuple(
    name for name in inspect.signature(init_parallel).parameters if name not in ("dims", "device_type", "timeout")
)


def _choose(backend: str | None, device_type: str | None, existing: str | None) -> tuple[str, str]:
    """``(backend, device_type)`` from what was asked, CUDA's availability and an existing default group."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"init_from_env: backend={backend!r}: use one of {list(BACKENDS)} or None (auto)")
    if device_type is not None and device_type not in DEVICE_TYPES:
        raise ValueError(f"init_from_env: device_type={device_type!r}: use one of {list(DEVICE_TYPES)} or None")
    if existing is not None:
        if backend is not None and backend != existing:
            raise ValueError(
                f"init_from_env: backend={backend!r}, but the default process group (already initialized) uses "
                f"{existing!r}"
            )
        backend = existing
    elif backend is None:
        backend = "nccl" if torch.cuda.is_available() and device_type != "cpu" else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("init_from_env: backend='nccl' needs CUDA, which is not available; use 'gloo'")
    if backend == "nccl" and device_type == "cpu":
        raise ValueError("init_from_env: backend='nccl' with device_type='cpu': NCCL moves CUDA tensors only")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("init_from_env: device_type='cuda' needs CUDA, which is not available")
    return backend, device_type or ("cuda" if backend == "nccl" else "cpu")


def _bind_cuda(env: LaunchEnv) -> torch.device:
    """Bind this process to its GPU: ``LOCAL_RANK`` (``SLURM_LOCALID``), else the rank modulo the devices."""
    count = torch.cuda.device_count()
    index = env.local_rank if env.local_rank is not None else env.rank % count
    if index >= count:
        name = "SLURM_LOCALID" if env.launcher == "slurm" else "LOCAL_RANK"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"init_from_env: {name}={index}, but this process sees {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={visible!r}); launch at most {count} processes per node"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _start_process_group(env: LaunchEnv, backend: str, device: torch.device, timeout) -> None:
    kwargs: dict[str, Any] = {"backend": backend, "rank": env.rank, "world_size": env.world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init on the bound device
    if env.init_method is None:
        kwargs["store"] = dist.HashStore()  # a world of one meets nobody: a private store, no port
    else:
        kwargs["init_method"] = env.init_method
    dist.init_process_group(**kwargs)


def init_from_env(
    dims: ParallelDims | None = None,
    *,
    backend: str | None = None,
    device_type: str | None = None,
    timeout: datetime.timedelta | None = None,
    **options: Any,
) -> DistributedSession:
    """Start torch.distributed from the launcher's environment (torchrun, SLURM, or none: one process), build
    the mesh for ``dims`` and make it current; see the module docstring for what is read, in which order.

    Args:
        dims: degrees and order (default: pure data parallel); ``dp=-1`` is inferred from the world size.
        backend: ``"nccl"`` or ``"gloo"``; default nccl when CUDA is available and ``device_type`` is not
            ``"cpu"``, else gloo. With an initialized default group: its backend (a different one is an error).
        device_type: ``"cuda"`` or ``"cpu"``; default cuda with nccl, else cpu. With cuda the process binds
            ``cuda:LOCAL_RANK`` before the process group is created.
        timeout: timeout of the default group's collectives (when this call creates it) and of the mesh's
            subgroups; default torch's, or the existing default group's.
        **options: the other keywords of :func:`~wf_mesh.init_parallel` (``dp_replicate``, ``checks``,
            ``nccl_config``, ``extra_axes``).

    Returns:
        A :class:`DistributedSession`: ``with`` it, or call ``close()`` when done.

    Raises:
        TypeError: unknown option, a ``dims`` that is not a ParallelDims, a timeout that is not a timedelta.
        ValueError / RuntimeError: a bad environment variable (named), backend or device; raised before any
            network traffic.
        DegreeError: the degrees do not fit the world size (before any network traffic).
        StateError: a mesh is already current (the process group this call created is destroyed again).
    """
    unknown = sorted(set(options) - set(_MESH_OPTIONS))
    if unknown:
        raise TypeError(
            f"init_from_env: unknown option(s) {unknown}; the options of init_parallel are {list(_MESH_OPTIONS)}"
        )
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
        raise TypeError(f"init_from_env: timeout must be a positive datetime.timedelta or None, got {timeout!r}")
    dims = ParallelDims() if dims is None else dims
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"init_from_env takes a ParallelDims, got {type(dims).__name__} {dims!r}")
    existing = dist.get_backend() if dist.is_initialized() else None
    backend, device_type = _choose(backend, device_type, existing)
    env = None
    if existing is None:
        env = read_launch_env()
        try:
            dims.resolve(env.world_size)
        except ValueError as e:
            raise type(e)(f"init_from_env: {e} (world size {env.world_size} from {env.launcher})") from None
        device = _bind_cuda(env) if device_type == "cuda" else torch.device("cpu")
        if env.launcher == "none":
            logger.info("init_from_env: no launcher (RANK, WORLD_SIZE, SLURM_PROCID not set): a single process")
        _start_process_group(env, backend, device, timeout)
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    world = dist.group.WORLD
    try:
        mesh = init_parallel(dims, device_type=device_type, timeout=timeout, **options)
    except BaseException:
        if existing is None:
            dist.destroy_process_group()
        raise
    return DistributedSession(mesh, env, backend, device, owns_process_group=existing is None, _default_group=world)
