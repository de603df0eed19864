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

With ``ParallelDims(cp=C, cp_ulysses=U)`` (U > 1) the cp axis is also split into ``mesh["cp_ulysses"]`` (U consecutive
cp ranks) and ``mesh["cp_ring"]`` (C / U ranks, stride U) for USP attention; see :mod:`wf_mesh.topology`.

Creation is collective and agreed: before any subgroup exists, the ranks exchange their dims, order,
``dp_replicate``, timeout, device type and ``checks`` over the default group, and if any rank's arguments are
invalid or differ, every rank raises the same error naming each rank's value (instead of hanging in
subgroup creation). Subgroups inherit the default group's timeout unless ``timeout`` says otherwise; an axis
that spans the whole world then IS the default group (no new communicator).

Example::

    dist.init_process_group("gloo")                 # or dist_init(config) / torchrun + nccl
    pm = init_parallel(ParallelDims(tp=2, cp=2))     # dp inferred from the world size
    pm["cp"]                                         # 1-D DeviceMesh of this rank's cp group
    pm.group("dp_cp"), pm.rank("tp"), pm.size("pp")
    pm.destroy()                                     # subgroups destroyed; default group left alive
"""

from __future__ import annotations

import datetime
import itertools
import zlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from wf_mesh import _compat, agreement
from wf_mesh.errors import NotInitializedError, StateError
from wf_mesh.topology import AXES, DERIVED_AXES, SUB_AXES, ParallelDims, as_int, parse_axes

__all__ = [
    "ParallelMesh",
    "extensions",
    "get_parallel_mesh",
    "hsdp_rank_grid",
    "init_parallel",
    "parallel_mesh_or_none",
    "register_extension",
    "reset_extensions",
]

_ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]
_DEVICE_TYPES = ["cpu", "cuda"]

_current: ParallelMesh | None = None
_extensions: dict[str, Callable[[bool], None]] = {}


# ---- extensions: state kept by upper layers that lives as long as the current mesh --------------------
def register_extension(name: str, reset: Callable[[bool], None]) -> None:
    """Register process-wide state that an upper layer keeps per mesh (the extension point of the mesh).

    ``reset(destroy_process_groups)`` runs whenever the current mesh is destroyed, before its process groups
    are (and on :func:`reset_extensions`); it forgets the state and, when the flag is true, destroys the
    process groups the extension created itself. Extensions run in registration order; registering ``name``
    again replaces its reset. :func:`extensions` lists them.

    Args:
        name: what the state is, e.g. ``"legacy.pp_scheduler"``.
        reset: called with ``destroy_process_groups``.
    """
    _extensions[name] = reset


def extensions() -> tuple[str, ...]:
    """Names of the registered extensions, in the order their resets run."""
    return tuple(_extensions)


def reset_extensions(destroy_process_groups: bool = True) -> None:
    """Reset every registered extension (what destroying the current mesh does first)."""
    for reset in _extensions.values():
        reset(destroy_process_groups)


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
        meshes: list[DeviceMesh],
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
        self._meshes = meshes  # every mesh built besides the root (flattened, unflattened, HSDP views)
        self._hsdp = hsdp
        self._global_rank = dist.get_rank()
        self.destroyed = False

    # ---- lookups ------------------------------------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        """Names of every axis this mesh offers."""
        return tuple(self._axes)

    @property
    def device_type(self) -> str:
        return self.root.device_type

    @property
    def device(self) -> torch.device:
        """The device this mesh's collectives use: the current CUDA device on NCCL, else CPU."""
        return agreement.comm_device(self.group(AXES[0]))

    @property
    def global_rank(self) -> int:
        return self._global_rank

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates ``{"tp": .., "cp": .., "pp": .., "dp": ..}`` of ``rank`` (default: this rank)."""
        return self.dims.coords(self._global_rank if rank is None else rank)

    def _key(self, axis: str) -> str:
        if self.destroyed:
            raise StateError(f"this ParallelMesh ({self.dims}) was destroyed; initialize a new one")
        if not isinstance(axis, str):
            raise TypeError(f"a mesh axis is a str such as 'cp' or 'dp_cp', got {type(axis).__name__} {axis!r}")
        if axis in self._axes:
            return axis
        try:
            members = set(parse_axes(axis))
        except ValueError:
            members = set()
        for name in self._axes:  # "dp-cp" and "cp-dp" find the derived axis "dp_cp"
            if members and members == _members(name):
                return name
        raise KeyError(f"unknown mesh axis {axis!r}; valid axes are {list(self._axes)}")

    def __getitem__(self, axis: str) -> DeviceMesh:
        """The 1-D DeviceMesh of this rank's group on ``axis``."""
        return self._axes[self._key(axis)]

    def __contains__(self, axis: str) -> bool:
        try:
            self._key(axis)
        except (KeyError, TypeError):
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
        return device_mesh_ranks(self[axis])

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
            reset_extensions(destroy_process_groups)
            agreement.set_checks(None)
        _compat.release_meshes(self.root, self._meshes, destroy_groups=destroy_process_groups)
        self._axes = {}
        self._meshes = []
        self._hsdp = None

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else f"rank={self._global_rank} coords={self.coords()}"
        return f"ParallelMesh({self.dims}, device_type={self.device_type!r}, {state})"


def _members(axis: str) -> set[str]:
    try:
        return set(parse_axes(axis))
    except ValueError:  # "replicate", "shard": names, not tokens
        return set()


def _timeout_ms(timeout: datetime.timedelta | None) -> int:
    return -1 if timeout is None else round(timeout.total_seconds() * 1000)


def _agree_on_creation(
    dims: ParallelDims,
    device_type: str | None,
    timeout: datetime.timedelta | None,
    nccl_config: Mapping[str, Mapping[str, int]] | None,
    dp_replicate: int | None,
    checks: bool | None,
    extra_axes: tuple[str, ...],
) -> tuple[ParallelDims, str, bool]:
    """Validate here and agree with every rank (one all-gather over the default group); returns the resolved
    dims, the device type and the checks setting, or raises the same error on every rank."""
    backend = dist.get_backend()
    resolved: list = []

    def facts() -> list[int]:
        if _current is not None:
            raise StateError(
                f"model parallel is already initialized ({_current.dims}); call "
                "wf_mesh.destroy_model_parallel() before initializing again"
            )
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"init_parallel takes a ParallelDims, got {type(dims).__name__} {dims!r}")
        d = dims.resolve(dist.get_world_size())
        if dp_replicate is not None:
            _check_dp_replicate(d, dp_replicate)
        device = device_type if device_type is not None else ("cuda" if backend == "nccl" else "cpu")
        if device not in _DEVICE_TYPES:
            raise ValueError(f"device_type={device!r}: use one of {_DEVICE_TYPES}")
        if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
            raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        config = dict(nccl_config or {})
        unknown = sorted(set(config) - set(AXES) - set(DERIVED_AXES))
        if unknown:
            raise ValueError(f"nccl_config has unknown axes {unknown}; axes are {[*AXES, *DERIVED_AXES]}")
        check = agreement.checks_enabled() if checks is None else bool(checks)
        extra = sorted(_extra_axes(d, extra_axes))
        resolved[:] = [d, device, check]
        return [
            d.tp,
            d.cp,
            d.pp,
            d.dp,
            d.cp_ulysses,
            _ORDERS.index(d.order),
            dp_replicate or 0,
            _timeout_ms(timeout),
            _DEVICE_TYPES.index(device),
            int(check),
            zlib.crc32(repr(sorted(config.items())).encode()),
            zlib.crc32(repr(extra).encode()),
        ]

    agreed = agreement.agree(dist.group.WORLD, facts, what="init_parallel", required=True)
    names = [
        "tp",
        "cp",
        "pp",
        "dp",
        "cp_ulysses",
        "order",
        "dp_replicate",
        "timeout",
        "device_type",
        "checks",
        "nccl_config",
        "extra_axes",
    ]
    render = {
        "order": lambda v: _ORDERS[v],
        "timeout": lambda v: "the default group's" if v < 0 else f"{v / 1000:g} s",
        "device_type": lambda v: _DEVICE_TYPES[v],
        "dp_replicate": lambda v: v or None,
        "checks": bool,
        "nccl_config": lambda v: f"crc {v:08x}",
        "extra_axes": lambda v: f"crc {v:08x}",
    }
    for i, name in enumerate(names):
        agreed.require_same(
            name,
            lambda row, i=i, name=name: render.get(name, int)(row[i]),
            hint="; every rank must build the same mesh",
        )
    return tuple(resolved)


def init_parallel(
    dims: ParallelDims | None = None,
    *,
    device_type: str | None = None,
    timeout: datetime.timedelta | None = None,
    nccl_config: Mapping[str, Mapping[str, int]] | None = None,
    dp_replicate: int | None = None,
    checks: bool | None = None,
    extra_axes: Sequence[str] = (),
) -> ParallelMesh:
    """Build the mesh for ``dims`` (default: pure data parallel) over the default process group and make it
    the process-wide current mesh. Collective: every rank must call it with the same arguments (they are
    agreed first; see the module docstring).

    Args:
        dims: degrees and order; ``dp=-1`` is inferred from the world size.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` when the default group uses NCCL, else ``"cpu"``.
        timeout: timeout of the subgroups' collectives; default: the default group's.
        nccl_config: NCCL communicator options per axis (keys are axis names: ``"tp"``, ``"dp_cp"``,
            ``"tp_pp"``, ...; values map ``min_ctas``/``max_ctas``/``cga_cluster_size`` to ints). NCCL only.
        dp_replicate: also build the HSDP view (:meth:`ParallelMesh.hsdp_mesh`): dp splits into
            ``dp_replicate`` replicas x ``dp // dp_replicate`` shards. Must divide dp.
        checks: run the validation-only agreement exchanges of every collective call (default: the
            ``WF_MESH_CHECKS`` environment variable, on unless it is ``"0"``); see :mod:`wf_mesh.agreement`.
        extra_axes: more flattened axes to create up front besides the derived ones, as tokens of base
            axes (``"tp-pp-dp"``); each is registered under its members joined by ``_`` in ``order`` order.

    Raises (on every rank, before any subgroup is created):
        RuntimeError: torch.distributed is not initialized (this rank only), or a mesh is already current.
        DegreeError: the degrees do not multiply to the world size, or dp_replicate does not divide dp.
        DisagreementError: ranks passed different arguments.
    """
    global _current
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call wf_mesh.dist_init(config) or "
            "torch.distributed.init_process_group(...) before building the mesh"
        )
    dims, device_type, checks = _agree_on_creation(
        dims or ParallelDims(), device_type, timeout, nccl_config, dp_replicate, checks, tuple(extra_axes)
    )
    backend = dist.get_backend()
    nccl_config = dict(nccl_config or {})
    default_timeout = _compat.default_group_timeout()
    world = dims.world_size

    def options(axis: str, size: int):
        # No options = the default group for an axis spanning the world (torch's rule), and torch's global
        # default timeout for the others: pass options only where they change something.
        if size == world and timeout in (None, default_timeout) and axis not in nccl_config:
            return None
        return _compat.backend_options(backend, timeout or default_timeout, nccl_config.get(axis))

    root = init_device_mesh(
        device_type,
        dims.mesh_shape,
        mesh_dim_names=dims.mesh_dim_names,
        backend_override={a: o for a in AXES if (o := options(a, dims.degree(a))) is not None} or None,
    )
    axes: dict[str, DeviceMesh] = {a: root[a] for a in AXES}
    meshes: list[DeviceMesh] = []

    def add_flattened(name: str, members: tuple[str, ...], opts) -> None:
        submesh = root[tuple(a for a in dims.mesh_dim_names if a in members)]  # slices go in root order
        axes[name] = _compat.flatten(submesh, name, opts)
        meshes.append(axes[name])

    for name, members in {**DERIVED_AXES, **_extra_axes(dims, extra_axes)}.items():
        add_flattened(name, members, options(name, dims.degree(members)))
    if dims.cp_ulysses > 1:
        split = _compat.unflatten(
            root,
            "cp",
            (dims.cp_ring, dims.cp_ulysses),
            ("cp_ring", "cp_ulysses"),
            {a: o for a in SUB_AXES if (o := options(a, dims.degree(a))) is not None},
        )
        axes["cp_ring"], axes["cp_ulysses"] = split["cp_ring"], split["cp_ulysses"]
        meshes.append(split)
    hsdp = None
    if dp_replicate is not None:
        hsdp = _build_hsdp(dims, dp_replicate, device_type, options("shard", 0))
        axes["replicate"], axes["shard"] = hsdp["replicate"], hsdp["shard"]
        meshes.append(hsdp)
    _current = ParallelMesh(dims, root, axes, meshes, backend=backend, timeout=timeout or default_timeout, hsdp=hsdp)
    agreement.set_checks(checks)
    return _current


def _extra_axes(dims: ParallelDims, tokens: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``{name: base axes}`` of the requested extra flattened axes that are not derived axes already."""
    out = {}
    for token in tokens:
        members = tuple(a for a in dims.axis_order if a in parse_axes(token))
        if set(members) != set(parse_axes(token)):
            raise ValueError(f"extra axis {token!r}: only base axes {list(AXES)} can be flattened")
        if len(members) > 1 and set(members) not in [set(m) for m in DERIVED_AXES.values()]:
            out["_".join(members)] = members
    return out


def _check_dp_replicate(dims: ParallelDims, dp_replicate: int) -> None:
    dp_replicate = as_int("dp_replicate", dp_replicate, minimum=1)
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


def device_mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """Global ranks of ``mesh``, flattened in its order (row-major): group-rank order for a 1-D mesh."""
    return mesh.mesh.flatten().tolist()


def get_parallel_mesh() -> ParallelMesh:
    """The current mesh; NotInitializedError (a RuntimeError and an AssertionError) if none was initialized."""
    if _current is None:
        raise NotInitializedError(
            "model parallel is not initialized: call wf_mesh.initialize_model_parallel(...) "
            "(or wf_mesh.init_parallel / wf_mesh.dist_init) first"
        )
    return _current


def parallel_mesh_or_none() -> ParallelMesh | None:
    """The current mesh, or None."""
    return _current
