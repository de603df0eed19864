"""ParallelMesh: ONE DeviceMesh with axes tp/cp/pp/dp, plus the derived axes, created once, up front.

Every process group wf_mesh uses comes from here. The root mesh is built by a single
``init_device_mesh`` call whose dim names are the order reversed (``("dp", "pp", "cp", "tp")`` for the
default ``"tp-cp-pp-dp"``), so that its row-major layout matches Megatron/MAGI's ranks. Derived axes
(``tp_cp``, ``dp_cp``, ``tp_pp``, ``tp_cp_dp``, ``tp_dp``) are flattened views created collectively at
construction and kept in the mesh's own registry; they are never re-sliced from the root by name.

Example::

    dist.init_process_group("gloo")                 # or dist_init(config) / torchrun + nccl
    pm = init_parallel(ParallelDims(tp=2, cp=2))     # dp inferred from the world size
    pm["cp"]                                         # 1-D DeviceMesh of this rank's cp group
    pm.group("dp_cp"), pm.rank("tp"), pm.size("pp")
    pm.destroy()                                     # subgroups destroyed; default group left alive
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from wf_mesh import _compat
from wf_mesh.topology import AXES, DERIVED_AXES, ParallelDims, parse_axes

__all__ = [
    "DEFAULT_TIMEOUT",
    "ParallelMesh",
    "get_parallel_mesh",
    "init_parallel",
    "parallel_mesh_or_none",
    "register_destroy_hook",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# Companion gloo groups for CPU-side work (Megatron's ``get_data_parallel_group_gloo``), created only when
# the main backend is not gloo itself.
GLOO_COMPANIONS: dict[str, str] = {"dp_gloo": "dp", "dp_cp_gloo": "dp_cp"}

_AXIS_BY_MEMBERS = {frozenset([a]): a for a in AXES} | {frozenset(m): n for n, m in DERIVED_AXES.items()}

_current: ParallelMesh | None = None
_destroy_hooks: list[Callable[[], None]] = []


def register_destroy_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever the current mesh is destroyed (modules reset their per-mesh state here)."""
    if hook not in _destroy_hooks:
        _destroy_hooks.append(hook)


class ParallelMesh:
    """The process-wide mesh: a root DeviceMesh over tp/cp/pp/dp and a registry of derived axes.

    Build it with :func:`init_parallel`. Lookups take a base axis (``"tp"``), a derived axis
    (``"dp_cp"``), or the same as a token (``"dp-cp"``).
    """

    def __init__(
        self,
        dims: ParallelDims,
        root: DeviceMesh,
        axes: dict[str, DeviceMesh],
        flattened: list[DeviceMesh],
        *,
        backend: str,
        timeout: datetime.timedelta,
    ) -> None:
        self.dims = dims
        self.root = root
        self.backend = backend
        self.timeout = timeout
        self._axes = axes
        self._flattened = flattened
        self._global_rank = dist.get_rank()
        self.coords: dict[str, int] = dims.coords(self._global_rank)
        self.destroyed = False

    # ---- lookups ------------------------------------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        """Names of every axis this mesh offers."""
        return tuple(self._axes)

    @property
    def device_type(self) -> str:
        return self.root.device_type

    def _key(self, axis: str) -> str:
        if self.destroyed:
            raise RuntimeError(f"this ParallelMesh ({self.dims}) was destroyed; initialize a new one")
        if axis in self._axes:
            return axis
        try:
            members = frozenset(parse_axes(axis))
        except ValueError:
            members = frozenset()
        key = _AXIS_BY_MEMBERS.get(members)
        if key not in self._axes:
            raise KeyError(f"unknown mesh axis {axis!r}; valid axes are {list(self._axes)}")
        return key

    def __getitem__(self, axis: str) -> DeviceMesh:
        """The 1-D DeviceMesh of this rank's group on ``axis``."""
        return self._axes[self._key(axis)]

    def __contains__(self, axis: str) -> bool:
        try:
            self._key(axis)
        except KeyError:
            return False
        return True

    def group(self, axis: str) -> dist.ProcessGroup:
        """This rank's ProcessGroup on ``axis``."""
        return self[axis].get_group()

    def rank(self, axis: str) -> int:
        """This rank's index inside its ``axis`` group."""
        return self[axis].get_local_rank()

    def size(self, axis: str) -> int:
        """Number of ranks in one ``axis`` group."""
        return self[axis].size()

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in group order."""
        return self[axis].mesh.flatten().tolist()

    @property
    def global_rank(self) -> int:
        return self._global_rank

    # ---- lifecycle ----------------------------------------------------------------------------------
    def destroy(self, destroy_process_groups: bool = True) -> None:
        """Destroy the subgroups this mesh created (never the default group) and forget the mesh.

        With ``destroy_process_groups=False`` only references are dropped (for when a framework has
        already destroyed the groups). Idempotent.
        """
        global _current
        if self.destroyed:
            return
        self.destroyed = True
        _compat.release_meshes(self.root, self._flattened, destroy_groups=destroy_process_groups)
        self._axes = {}
        self._flattened = []
        if _current is self:
            _current = None
            for hook in _destroy_hooks:
                hook()

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else f"rank={self._global_rank} coords={self.coords}"
        return f"ParallelMesh({self.dims}, device_type={self.device_type!r}, {state})"


def init_parallel(
    dims: ParallelDims | None = None,
    *,
    device_type: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    nccl_config: Mapping[str, Mapping[str, int]] | None = None,
) -> ParallelMesh:
    """Build the mesh for ``dims`` (default: pure data parallel) over the default process group and make it
    the process-wide current mesh. Collective: every rank must call it with the same arguments.

    Args:
        dims: degrees and order; ``dp=-1`` is inferred from the world size.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` when the default group uses NCCL, else ``"cpu"``.
        timeout: timeout of every subgroup's collectives (torch's own default is not inherited).
        nccl_config: NCCL communicator options per axis (keys are axis names: ``"tp"``, ``"dp_cp"``,
            ``"tp_pp"``, ...; values map ``min_ctas``/``max_ctas``/``cga_cluster_size`` to ints). NCCL only.

    Raises:
        RuntimeError: torch.distributed is not initialized, or a mesh is already current.
        ValueError: the degrees do not multiply to the world size (every factor is named).
    """
    global _current
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call wf_mesh.dist_init(config) or "
            "torch.distributed.init_process_group(...) before building the mesh"
        )
    if _current is not None:
        raise RuntimeError(
            f"model parallel is already initialized ({_current.dims}); call "
            "wf_mesh.destroy_model_parallel() before initializing again"
        )
    dims = (dims or ParallelDims()).resolve(dist.get_world_size())
    backend = dist.get_backend()
    if device_type is None:
        device_type = "cuda" if backend == "nccl" else "cpu"
    nccl_config = dict(nccl_config or {})
    unknown = sorted(set(nccl_config) - set(AXES) - set(DERIVED_AXES))
    if unknown:
        raise ValueError(f"nccl_config has unknown axes {unknown}; axes are {[*AXES, *DERIVED_AXES]}")

    def options(axis: str):
        return _compat.backend_options(backend, timeout, nccl_config.get(axis))

    overrides = {a: options(a) for a in AXES}
    root = init_device_mesh(
        device_type,
        dims.mesh_shape,
        mesh_dim_names=dims.mesh_dim_names,
        backend_override={a: o for a, o in overrides.items() if o is not None} or None,
    )
    axes: dict[str, DeviceMesh] = {a: root[a] for a in AXES}
    flattened: list[DeviceMesh] = []

    def add_flattened(name: str, members: tuple[str, ...], opts) -> None:
        submesh = root[tuple(a for a in dims.mesh_dim_names if a in members)]  # slices go in root order
        axes[name] = _compat.flatten(submesh, name, opts)
        flattened.append(axes[name])

    for name, members in DERIVED_AXES.items():
        add_flattened(name, members, options(name))
    if backend != "gloo":
        gloo = ("gloo", _compat.backend_options("gloo", timeout))
        for name, source in GLOO_COMPANIONS.items():
            add_flattened(name, parse_axes(source), gloo)
    _current = ParallelMesh(dims, root, axes, flattened, backend=backend, timeout=timeout)
    return _current


def get_parallel_mesh() -> ParallelMesh:
    """The current mesh; RuntimeError if none was initialized."""
    if _current is None:
        raise RuntimeError(
            "model parallel is not initialized: call wf_mesh.initialize_model_parallel(...) "
            "(or wf_mesh.init_parallel / wf_mesh.dist_init) first"
        )
    return _current


def parallel_mesh_or_none() -> ParallelMesh | None:
    """The current mesh, or None."""
    return _current
