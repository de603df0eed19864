"""ParallelMesh: ONE DeviceMesh with axes tp/cp/pp/dp, plus the derived axes, created once, up front.

Every process group wf_mesh uses comes from here. The root mesh is built by a single
``init_device_mesh`` call whose dim names are the order reversed (``("dp", "pp", "cp", "tp")`` for the
default ``"tp-cp-pp-dp"``), so that its row-major layout matches Megatron/MAGI's ranks. Derived axes
(``tp_cp``, ``dp_cp``, ``tp_pp``, ``tp_cp_dp``, ``tp_dp``) are flattened views created collectively at
construction and kept in the mesh's own registry; they are never re-sliced from the root by name.

FSDP2 (``fully_shard``) takes :meth:`ParallelMesh.fsdp_mesh` (the 1-D ``dp_cp`` axis: CP ranks hold the same
weights). For HSDP, ``init_parallel(dims, dp_replicate=R)`` also builds, up front, a 2-D view with dim names
``("replicate", "shard")`` (:meth:`ParallelMesh.hsdp_mesh`): dp splits into R replicas of
``dp_shard = dp // R`` ranks, and a shard group holds dp_shard x cp ranks. Rank order: a rank's dp
coordinate is ``replicate * dp_shard + dp_shard_index`` (dp_shard fastest, torchtitan's convention); a shard
group lists its dp_shard and cp coordinates in ``order`` order, fastest first, so with ``dp_replicate=1`` it
is exactly the ``dp_cp`` group. Its 1-D axes are also registered as ``mesh["replicate"]`` and ``mesh["shard"]``.

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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from wf_mesh import _compat
from wf_mesh.topology import AXES, DERIVED_AXES, ParallelDims, parse_axes

__all__ = [
    "DEFAULT_TIMEOUT",
    "ParallelMesh",
    "get_parallel_mesh",
    "hsdp_rank_grid",
    "init_parallel",
    "parallel_mesh_or_none",
    "register_destroy_hook",
    "run_destroy_hooks",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# Companion gloo groups for CPU-side work (Megatron's ``get_data_parallel_group_gloo``), created only when
# the main backend is NCCL.
GLOO_COMPANIONS: dict[str, str] = {"dp_gloo": "dp", "dp_cp_gloo": "dp_cp"}

_AXIS_BY_MEMBERS = {frozenset([a]): a for a in AXES} | {frozenset(m): n for n, m in DERIVED_AXES.items()}

_current: ParallelMesh | None = None
_destroy_hooks: list[Callable[[], None]] = []


def register_destroy_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever the current mesh is destroyed, before its groups are (modules reset their
    per-mesh state here: the PP scheduler, cached CP meshes, ``parallel_state.cp_size_t``)."""
    if hook not in _destroy_hooks:
        _destroy_hooks.append(hook)


def run_destroy_hooks() -> None:
    """Reset every module's per-mesh state (what destroying the current mesh does first)."""
    for hook in _destroy_hooks:
        hook()


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
        hsdp: DeviceMesh | None = None,
    ) -> None:
        self.dims = dims
        self.root = root
        self.backend = backend
        self.timeout = timeout
        self._axes = axes
        self._flattened = flattened
        self._hsdp = hsdp
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

    # ---- FSDP2 views --------------------------------------------------------------------------------
    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D mesh to pass to ``fully_shard`` for plain FSDP: this rank's ``dp_cp`` axis."""
        return self["dp_cp"]

    @property
    def hsdp_enabled(self) -> bool:
        """True when the mesh was built with ``dp_replicate`` (see :meth:`hsdp_mesh`)."""
        return self._hsdp is not None

    def hsdp_mesh(self) -> DeviceMesh:
        """The 2-D ``("replicate", "shard")`` mesh for HSDP ``fully_shard``; shard = dp_shard x cp.

        Raises RuntimeError unless the mesh was built with ``init_parallel(..., dp_replicate=R)``.
        """
        if self._hsdp is None:
            self._key("dp")  # a destroyed mesh says so
            raise RuntimeError(
                f"this ParallelMesh ({self.dims}) has no HSDP view: build it with "
                "init_parallel(dims, dp_replicate=R), R dividing dp"
            )
        return self._hsdp

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
        if _current is self:
            _current = None
            run_destroy_hooks()
        _compat.release_meshes(self.root, self._flattened, destroy_groups=destroy_process_groups)
        self._axes = {}
        self._flattened = []
        self._hsdp = None

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else f"rank={self._global_rank} coords={self.coords}"
        return f"ParallelMesh({self.dims}, device_type={self.device_type!r}, {state})"


def init_parallel(
    dims: ParallelDims | None = None,
    *,
    device_type: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    nccl_config: Mapping[str, Mapping[str, int]] | None = None,
    dp_replicate: int | None = None,
) -> ParallelMesh:
    """Build the mesh for ``dims`` (default: pure data parallel) over the default process group and make it
    the process-wide current mesh. Collective: every rank must call it with the same arguments.

    Args:
        dims: degrees and order; ``dp=-1`` is inferred from the world size.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` when the default group uses NCCL, else ``"cpu"``.
        timeout: timeout of every subgroup's collectives (torch's own default is not inherited).
        nccl_config: NCCL communicator options per axis (keys are axis names: ``"tp"``, ``"dp_cp"``,
            ``"tp_pp"``, ...; values map ``min_ctas``/``max_ctas``/``cga_cluster_size`` to ints). NCCL only.
        dp_replicate: also build the HSDP view (:meth:`ParallelMesh.hsdp_mesh`): dp splits into
            ``dp_replicate`` replicas x ``dp // dp_replicate`` shards. Must divide dp.

    Raises:
        RuntimeError: torch.distributed is not initialized, or a mesh is already current.
        ValueError: the degrees do not multiply to the world size, or dp_replicate does not divide dp
            (every factor is named).
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
    if dp_replicate is not None:
        _check_dp_replicate(dims, dp_replicate)
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
    if backend == "nccl":
        gloo = ("gloo", _compat.backend_options("gloo", timeout))
        for name, source in GLOO_COMPANIONS.items():
            add_flattened(name, parse_axes(source), gloo)
    hsdp = None
    if dp_replicate is not None:
        hsdp = _build_hsdp(dims, dp_replicate, device_type, options("shard"))
        axes["replicate"], axes["shard"] = hsdp["replicate"], hsdp["shard"]
        flattened.append(hsdp)  # released (groups destroyed) with the flattened axes
    _current = ParallelMesh(dims, root, axes, flattened, backend=backend, timeout=timeout, hsdp=hsdp)
    return _current


def _check_dp_replicate(dims: ParallelDims, dp_replicate: int) -> None:
    if not isinstance(dp_replicate, int) or isinstance(dp_replicate, bool) or dp_replicate < 1:
        raise ValueError(f"dp_replicate must be an int >= 1, got {dp_replicate!r}")
    if dims.dp % dp_replicate:
        raise ValueError(
            f"dp_replicate={dp_replicate} does not divide dp={dims.dp} (tp={dims.tp}, cp={dims.cp}, "
            f"pp={dims.pp}, dp={dims.dp}); HSDP needs dp = dp_replicate * dp_shard"
        )


def hsdp_rank_grid(dims: ParallelDims, dp_replicate: int) -> torch.Tensor:
    """Global ranks of every HSDP view, shape ``(tp * pp, dp_replicate, dp // dp_replicate * cp)``.

    Pure (no process groups). Row ``i`` is the ``("replicate", "shard")`` mesh of one tp x pp coordinate;
    the rank order is the one in the module docstring.
    """
    _check_dp_replicate(dims, dp_replicate)
    names = list(dims.mesh_dim_names)  # root order: last varies fastest
    d = names.index("dp")
    shape = list(dims.mesh_shape)
    shape[d : d + 1] = [dp_replicate, dims.dp // dp_replicate]
    names[d : d + 1] = ["replicate", "dp_shard"]
    rep = names.index("replicate")
    shard = [i for i, n in enumerate(names) if n in ("dp_shard", "cp")]
    outside = [i for i in range(len(names)) if i != rep and i not in shard]
    grid = dims.rank_grid().reshape(shape).permute(*outside, rep, *shard)
    return grid.reshape(-1, dp_replicate, dims.dp // dp_replicate * dims.cp)


def _build_hsdp(dims: ParallelDims, dp_replicate: int, device_type: str, opts) -> DeviceMesh:
    """Build every tp x pp coordinate's 2-D view (``new_group`` is collective, so every rank builds all of
    them, in the same order) and return the one holding this rank. Public DeviceMesh API only."""
    override = None if opts is None else ((None, opts), (None, opts))
    rank, mine = dist.get_rank(), None
    for grid in hsdp_rank_grid(dims, dp_replicate):
        view = DeviceMesh(device_type, grid, mesh_dim_names=("replicate", "shard"), backend_override=override)
        if bool((grid == rank).any()):
            mine = view
    return mine


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
