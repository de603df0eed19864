"""ParallelMesh: ONE DeviceMesh over the axes of the table, plus the derived axes, created once, up front.

Every process group wf_mesh uses comes from here. The root mesh is built by a single ``init_device_mesh`` call
over the axes in use (:attr:`~wf_mesh.topology.ParallelDims.axis_order`: tp, cp, pp, dp always, the optional
cfg only when it is 2) whose dim names are the order reversed (``("dp", "pp", "cp", "tp")`` for the default,
``("dp", "cfg", "pp", "cp", "tp")`` with cfg=2), so that its row-major layout matches Megatron/MAGI's ranks.
An optional axis of degree 1 makes no dim and no group: a mesh without cfg costs exactly what a four-axis mesh
costs; its ``size``/``rank``/``ranks`` still answer (1, 0, this rank), ``mesh["cfg"]`` is a KeyError saying why.
Derived axes (``tp_cp``, ``dp_cp``, ``tp_pp``, ``tp_cp_dp``, ``tp_dp``, ``dp_cfg_cp``) are flattened views
created collectively at construction and kept in the mesh's own registry; they are never re-sliced from the
root by name. A derived axis whose members in use are another's IS that axis's mesh (``dp_cfg_cp`` at cfg=1 is
``dp_cp``: no extra group).

FSDP2 (``fully_shard``) takes :meth:`ParallelMesh.fsdp_mesh`: the 1-D :data:`~wf_mesh.topology.FSDP_AXIS`
``dp_cfg_cp`` (the cfg branches and the CP ranks hold the same weights). For HSDP, ``init_parallel(dims,
dp_replicate=R)`` also builds, up front, a 2-D view with dim names ``("replicate", "shard")``
(:meth:`ParallelMesh.hsdp_mesh`): dp splits into R replicas of ``dp_shard = dp // R`` ranks, and a shard group
holds dp_shard x cfg x cp ranks. Rank order: a rank's dp coordinate is ``replicate * dp_shard +
dp_shard_index`` (dp_shard fastest, torchtitan's convention); a shard group lists its coordinates in ``order``
order, fastest first, so with ``dp_replicate=1`` it is exactly the FSDP group. Its 1-D axes are also
registered as ``mesh["replicate"]`` and ``mesh["shard"]``.

With ``ParallelDims(cp=C, cp_ulysses=U)`` (U > 1) the cp axis is also split into ``mesh["cp_ulysses"]`` (U consecutive
cp ranks) and ``mesh["cp_ring"]`` (C / U ranks, stride U) for USP attention; see :mod:`wf_mesh.topology`.

Creation is collective and agreed: before any subgroup exists, the ranks exchange their degrees (one per
table axis), order, ``dp_replicate``, timeout, device type, ``checks``, NCCL config and extra axes over the
default group, and if any rank's arguments are invalid or differ, every rank raises the same error naming each
rank's value (instead of hanging in subgroup creation). Subgroups inherit the default group's timeout unless
``timeout`` says otherwise; an axis that spans the whole world then IS the default group (no new communicator).

Example::

    session = wf_mesh.init_from_env(ParallelDims(tp=2, cp=2))   # or dist.init_process_group + init_parallel
    pm = session.mesh                                # dp inferred from the world size
    pm["cp"]                                         # 1-D DeviceMesh of this rank's cp group
    pm.group("dp_cp"), pm.rank("tp"), pm.size("pp")
    session.close()                                  # subgroups destroyed, then the default group it made
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from wf_mesh import _compat, agreement, faults, waits
from wf_mesh.errors import NotInitializedError, StateError
from wf_mesh.topology import AXES, AXIS_TABLE, DERIVED_AXES, FSDP_AXIS, SUB_AXES, ParallelDims, as_int, parse_axes

__all__ = [
    "DEVICE_TYPES",
    "ParallelMesh",
    "extensions",
    "get_parallel_mesh",
    "hsdp_rank_grid",
    "init_parallel",
    "parallel_mesh_or_none",
    "register_extension",
    "reset_extensions",
]

DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
"""The device types a mesh (and every mesh wf_mesh builds) may use."""

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
    """The process-wide mesh: a root DeviceMesh over the axes in use and a registry of derived axes.

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
        """The device type of the mesh (``"cpu"`` or ``"cuda"``)."""
        return self.root.device_type

    @property
    def device(self) -> torch.device:
        """The device this mesh's collectives use: the current CUDA device on NCCL, else CPU."""
        return agreement.comm_device(self.group(AXES[0]))

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group."""
        return self._global_rank

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this rank) on the axes in use.

        Returns:
            ``{"tp": .., "cp": .., "pp": .., "dp": ..}``, and ``"cfg"`` when it is 2.
        """
        return self.dims.coords(self._global_rank if rank is None else rank)

    def _key(self, axis: str) -> str:
        if self.destroyed:
            raise StateError(f"this ParallelMesh ({self.dims}) was destroyed; initialize a new one")
        if not isinstance(axis, str):
            raise TypeError(f"a mesh axis is a str such as 'cp' or 'dp_cp', got {type(axis).__name__} {axis!r}")
        if axis in self._axes:
            return axis
        members = self._members(axis)
        for name in self._axes:  # "dp-cp" and "cp-dp" find the derived axis "dp_cp"
            if members and members == self._members(name):
                return name
        if self._single(axis):
            raise KeyError(
                f"mesh axis {axis!r} is not in this mesh: its group is one rank ({self.dims}; an optional axis of "
                f"degree 1 has no group); size/rank/ranks still answer, valid axes are {list(self._axes)}"
            )
        raise KeyError(f"unknown mesh axis {axis!r}; valid axes are {list(self._axes)}")

    def _members(self, axis: str) -> set[str]:
        """The axes in use that token ``axis`` names (empty for names that are not tokens: "replicate")."""
        try:
            names = parse_axes(axis)
        except ValueError:
            return set()
        return {n for n in names if self.dims.in_use(SUB_AXES.get(n, n))}

    def _single(self, axis: str) -> bool:
        """Whether ``axis`` is a token of axes not in use (cfg at 1): every group is a single rank, no group."""
        if self.destroyed or not isinstance(axis, str) or axis in self._axes:
            return False
        try:
            parse_axes(axis)
        except ValueError:
            return False
        return not self._members(axis)

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
        """This rank's index inside its ``axis`` group (0 on an axis not in use)."""
        return 0 if self._single(axis) else self[axis].get_local_rank()

    def size(self, axis: str) -> int:
        """Number of ranks in one ``axis`` group (1 on an axis not in use, such as cfg at degree 1)."""
        return 1 if self._single(axis) else self[axis].size()

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in group order."""
        return [self._global_rank] if self._single(axis) else device_mesh_ranks(self[axis])

    # ---- randomness per axis -----------------------------------------------------------------------
    def generator(
        self,
        seed: int,
        vary_over: str | Sequence[str] = ("dp",),
        device: torch.device | str | None = None,
    ) -> torch.Generator:
        """A ``torch.Generator`` seeded by ``seed`` mixed with this rank's coordinates on ``vary_over`` only.

        Ranks that share their coordinates on the ``vary_over`` axes draw the same numbers, the others different
        ones: with the default ``("dp",)`` cp and tp peers (which must see the same noise, timesteps and data in
        diffusion training) draw equal streams and dp ranks independent ones, and the streams do not depend on
        the other axes' degrees (a run at dp 2 x cp 2 draws what a run at dp 2 x cp 1 draws). No collective.

        Args:
            seed: an int in ``[0, 2**64)``.
            vary_over: axes (``"dp"``, ``("dp", "cfg")``, a token ``"dp-cp"`` or a derived axis ``"dp_cp"``); an
                axis of degree 1 has coordinate 0. ``()``: every rank draws ``seed``'s own stream, exactly
                ``torch.Generator(device).manual_seed(seed)``.
            device: the generator's device (default CPU: the same numbers on every machine; move what it draws).

        Returns:
            The seeded generator. Otherwise seeded by the first 8 bytes of the SHA-256 of ``seed`` and the
            ``(axis, coordinate)`` pairs, base axes in table order.

        Raises:
            TypeError: a seed that is not an int, an axis that is not a str.
            ValueError: a seed out of range.
            KeyError: an unknown axis, or a cp sub-axis (vary over ``cp`` or not at all), naming the valid ones.
        """
        self._key(AXES[0])  # a destroyed mesh says so
        seed = as_int("seed", seed, minimum=0)
        if seed >= 2**64:
            raise ValueError(f"seed={seed} must be < 2**64")
        names: set[str] = set()
        for token in (vary_over,) if isinstance(vary_over, str) else vary_over:
            if not isinstance(token, str):
                raise TypeError(f"vary_over holds axis names (str), got {type(token).__name__} {token!r}")
            try:
                parsed = parse_axes(token)
            except ValueError:
                parsed = (token,)
            if any(name not in AXES for name in parsed):
                raise KeyError(
                    f"generator: vary_over={vary_over!r} names {token!r}; the axes to vary over are {list(AXES)} "
                    f"and their tokens or derived axes ({list(DERIVED_AXES)})"
                )
            names.update(parsed)
        coords = self.coords()
        key = [(name, coords.get(name, 0)) for name in AXES if name in names]
        if key:
            seed = int.from_bytes(hashlib.sha256(repr((seed, key)).encode()).digest()[:8], "little")
        return torch.Generator(device="cpu" if device is None else device).manual_seed(seed)

    # ---- FSDP2 views --------------------------------------------------------------------------------
    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D mesh to pass to ``fully_shard`` for plain FSDP.

        Returns:
            This rank's :data:`~wf_mesh.topology.FSDP_AXIS` mesh (``dp_cfg_cp``: the ranks holding the same
            weights; the ``dp_cp`` group while cfg is 1).
        """
        return self[FSDP_AXIS]

    @property
    def hsdp_enabled(self) -> bool:
        """True when the mesh was built with ``dp_replicate`` (see :meth:`hsdp_mesh`)."""
        return self._hsdp is not None

    def hsdp_mesh(self) -> DeviceMesh:
        """The 2-D ``("replicate", "shard")`` mesh for HSDP ``fully_shard``; shard = dp_shard x cfg x cp.

        Returns:
            The HSDP view built with the mesh.

        Raises:
            RuntimeError: the mesh was not built with ``init_parallel(..., dp_replicate=R)``.
            StateError: the mesh was destroyed.
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
            faults.set_containment(None)
            waits.name_axes(None)
        _compat.release_meshes(self.root, self._meshes, destroy_groups=destroy_process_groups)
        self._axes = {}
        self._meshes = []
        self._hsdp = None

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else f"rank={self._global_rank} coords={self.coords()}"
        return f"ParallelMesh({self.dims}, device_type={self.device_type!r}, {state})"


def _timeout_ms(timeout: datetime.timedelta | None) -> int:
    return -1 if timeout is None else round(timeout.total_seconds() * 1000)


def _all_orders() -> tuple[str, ...]:
    """Every order a resolved ParallelDims can show (the agreement sends an order as its index here).

    Returns:
        The permutations of the axes always in use plus any of the optional ones, joined by ``-``.
    """
    always = [a.name for a in AXIS_TABLE if not a.optional]
    optional = [a.name for a in AXIS_TABLE if a.optional]
    subsets = (c for n in range(len(optional) + 1) for c in itertools.combinations(optional, n))
    return tuple("-".join(p) for extra in subsets for p in itertools.permutations([*always, *extra]))


_ORDERS = _all_orders()

_CREATION_FIELDS: list[tuple[str, object, object]] = [
    ("order", str, agreement.fact(choices=_ORDERS)),
    ("dp_replicate", int | None, dataclasses.field()),
    ("timeout_ms", int, agreement.fact(label="timeout")),
    ("device_type", str, agreement.fact(choices=DEVICE_TYPES)),
    ("checks", bool, dataclasses.field()),
    ("contain_faults", bool, dataclasses.field()),
    ("nccl_config", int, agreement.fact(label="nccl_config")),  # a crc of the sorted config
    ("extra_axes", int, agreement.fact(label="extra_axes")),  # a crc of the extra flattened axes
]
"""What init_parallel agrees on besides the degrees."""

_RENDER: dict[str, Callable[[Any], object]] = {
    "timeout_ms": lambda v: "the default group's" if v < 0 else f"{v / 1000:g} s",
    "nccl_config": lambda v: f"crc {v:08x}",
    "extra_axes": lambda v: f"crc {v:08x}",
}
"""How messages show the fields that travel encoded."""


def _degree_fields() -> list[str]:
    """The degree fields of ParallelDims, from the axis table: every base axis, then every split's fast axis."""
    return [a.name for a in AXIS_TABLE] + [a.split.fast for a in AXIS_TABLE if a.split]


_CreationFacts: Any = dataclasses.make_dataclass(  # generated, so typed Any: its fields are the table's
    "_CreationFacts",
    [*((name, int) for name in _degree_fields()), *_CREATION_FIELDS],
    bases=(agreement.Facts,),
    frozen=True,
)
_CreationFacts.__doc__ = "What every rank asks init_parallel for: a degree per table axis and the options."


def _creation_facts(
    dims: ParallelDims,
    device_type: str | None,
    timeout: datetime.timedelta | None,
    nccl_config: Mapping[str, Mapping[str, int]] | None,
    dp_replicate: int | None,
    checks: bool | None,
    contain_faults: bool | None,
    extra_axes: tuple[str, ...],
) -> agreement.Facts:
    """This rank's validation of its init_parallel arguments, as its record (the dims resolved)."""
    if _current is not None:
        raise StateError(
            f"a ParallelMesh is already initialized ({_current.dims}); destroy it first "
            "(wf_mesh.get_parallel_mesh().destroy(), or close the DistributedSession that built it)"
        )
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"init_parallel takes a ParallelDims, got {type(dims).__name__} {dims!r}")
    resolved = dims.resolve(dist.get_world_size())
    if dp_replicate is not None:
        _check_dp_replicate(resolved, dp_replicate)
    device = device_type if device_type is not None else ("cuda" if dist.get_backend() == "nccl" else "cpu")
    if device not in DEVICE_TYPES:
        raise ValueError(f"device_type={device!r}: use one of {list(DEVICE_TYPES)}")
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    config = dict(nccl_config or {})
    unknown = sorted(set(config) - set(AXES) - set(DERIVED_AXES))
    if unknown:
        raise ValueError(f"nccl_config has unknown axes {unknown}; axes are {[*AXES, *DERIVED_AXES]}")
    extra = sorted(_extra_axes(resolved, extra_axes))
    return _CreationFacts(
        **{name: getattr(resolved, name) for name in _degree_fields()},
        order=resolved.shown_order,
        dp_replicate=dp_replicate,
        timeout_ms=_timeout_ms(timeout),
        device_type=device,
        checks=agreement.checks_enabled() if checks is None else bool(checks),
        contain_faults=faults.containment_enabled() if contain_faults is None else bool(contain_faults),
        nccl_config=zlib.crc32(repr(sorted(config.items())).encode()),
        extra_axes=zlib.crc32(repr(extra).encode()),
    )


def _agree_on_creation(dims: ParallelDims, *options: Any) -> tuple[ParallelDims, str, bool, bool]:
    """Validate here and agree with every rank (one all-gather over the default group), or raise the same
    error on every rank.

    Returns:
        The resolved dims, the device type, the checks and the containment settings.
    """
    world: Any = dist.group.WORLD
    agreed: agreement.Agreed[Any] = agreement.agree(
        world, lambda: _creation_facts(dims, *options), what="init_parallel", required=True
    )
    hint = "; every rank must build the same mesh"
    for field in dataclasses.fields(_CreationFacts):
        name, label = field.name, _CreationFacts.label(field.name)
        if name in _RENDER:

            def shown(row: Any, name: str = name) -> object:
                return _RENDER[name](getattr(row, name))

            agreed.require_same(key=shown, label=label, hint=hint)
        else:
            agreed.require_same(name, hint=hint)
    mine: Any = agreed.mine
    resolved = dims.resolve(dist.get_world_size())
    return resolved, mine.device_type, mine.checks, mine.contain_faults


def init_parallel(
    dims: ParallelDims | None = None,
    *,
    device_type: str | None = None,
    timeout: datetime.timedelta | None = None,
    nccl_config: Mapping[str, Mapping[str, int]] | None = None,
    dp_replicate: int | None = None,
    checks: bool | None = None,
    contain_faults: bool | None = None,
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
        contain_faults: a rank whose local step fails inside a multi-step collective sequence (ring attention,
            a bucketed state broadcast, a pipeline transfer) completes the sequence, and every rank raises its
            error; costs one small all-gather per sequence (default: ``WF_MESH_CONTAIN_FAULTS``, off unless
            ``"1"``); see :mod:`wf_mesh.faults`.
        extra_axes: more flattened axes to create up front besides the derived ones, as tokens of base
            axes (``"tp-pp-dp"``); each is registered under its members in use joined by ``_`` in ``order`` order.

    Returns:
        The new current mesh.

    Raises:
        RuntimeError: torch.distributed is not initialized (this rank only).
        StateError: a mesh is already current.
        TypeError: ``dims`` is not a ParallelDims.
        DegreeError: the degrees do not multiply to the world size.
        ValueError: dp_replicate does not divide dp, an unknown device type, nccl_config axis or extra axis, or
            a timeout that is not a positive timedelta.
        DisagreementError: ranks passed different arguments.

    Every error but the first is raised on every rank, before any subgroup is created.
    """
    global _current
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call wf_mesh.init_from_env(dims) (it starts the default group "
            "and builds the mesh) or torch.distributed.init_process_group(...) before building the mesh"
        )
    dims, device_type, checks, contain = _agree_on_creation(
        dims or ParallelDims(),
        device_type,
        timeout,
        nccl_config,
        dp_replicate,
        checks,
        contain_faults,
        tuple(extra_axes),
    )
    backend = dist.get_backend()
    default_timeout = _compat.default_group_timeout()
    options = _OptionsFor(dims, backend, timeout, default_timeout, dict(nccl_config or {}))
    root = _build_root(dims, device_type, options)
    axes: dict[str, DeviceMesh] = {a: root[a] for a in dims.axis_order}
    meshes = _add_flattened_axes(dims, root, axes, extra_axes, options)
    meshes += _add_sub_axes(dims, root, axes, options)
    hsdp = None
    if dp_replicate is not None:
        hsdp = _build_hsdp(dims, dp_replicate, device_type, options("shard", 0))
        axes["replicate"], axes["shard"] = hsdp["replicate"], hsdp["shard"]
        meshes.append(hsdp)
    _current = ParallelMesh(dims, root, axes, meshes, backend=backend, timeout=timeout or default_timeout, hsdp=hsdp)
    agreement.set_checks(checks)
    faults.set_containment(contain)
    waits.name_axes({axis: _current.group(axis) for axis in _current.axes})
    return _current


@dataclasses.dataclass(frozen=True)
class _OptionsFor:
    """The backend options of each axis's groups: ``options(axis, size)``."""

    dims: ParallelDims
    backend: str
    timeout: datetime.timedelta | None
    default_timeout: datetime.timedelta
    nccl_config: dict[str, Mapping[str, int]]

    def __call__(self, axis: str, size: int) -> Any:
        # No options = the default group for an axis spanning the world (torch's rule), and torch's global
        # default timeout for the others: pass options only where they change something.
        spans_world = size == self.dims.world_size
        if spans_world and self.timeout in (None, self.default_timeout) and axis not in self.nccl_config:
            return None
        return _compat.backend_options(self.backend, self.timeout or self.default_timeout, self.nccl_config.get(axis))


def _build_root(dims: ParallelDims, device_type: str, options: _OptionsFor) -> DeviceMesh:
    """The one ``init_device_mesh`` over the axes in use (dim names: the order reversed)."""
    overrides: Any = {a: o for a in dims.axis_order if (o := options(a, dims.degree(a))) is not None}
    return init_device_mesh(
        device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names, backend_override=overrides or None
    )


def _add_flattened_axes(
    dims: ParallelDims,
    root: DeviceMesh,
    axes: dict[str, DeviceMesh],
    extra_axes: Sequence[str],
    options: _OptionsFor,
) -> list[DeviceMesh]:
    """Flatten every derived (and extra) axis into ``axes``; an axis whose members in use are those of an axis
    already there (``dp_cfg_cp`` at cfg=1 is ``dp_cp``; one member: the root's dim) is that axis's mesh.

    Returns:
        The meshes created.
    """
    built = {frozenset([a]): a for a in dims.axis_order}
    created = []
    for name, members in {**DERIVED_AXES, **_extra_axes(dims, extra_axes)}.items():
        in_use = tuple(a for a in dims.mesh_dim_names if a in members)  # slices go in root order
        same = built.get(frozenset(in_use))
        if same is not None:
            axes[name] = axes[same]
            continue
        axes[name] = _compat.flatten(root[in_use], name, options(name, dims.degree(members)))
        built[frozenset(in_use)] = name
        created.append(axes[name])
    return created


def _add_sub_axes(
    dims: ParallelDims, root: DeviceMesh, axes: dict[str, DeviceMesh], options: _OptionsFor
) -> list[DeviceMesh]:
    """Unflatten every split axis in use into its sub-axes (``cp`` into ``cp_ring`` x ``cp_ulysses``) when it
    is split.

    Returns:
        The meshes created.
    """
    created = []
    for axis in AXIS_TABLE:
        split = axis.split
        if split is None or getattr(dims, split.fast) == 1 or not dims.in_use(axis.name):
            continue
        names = (split.slow, split.fast)  # row-major: the fast sub-axis last
        sizes = (dims.degree(split.slow), dims.degree(split.fast))
        overrides = {a: o for a in names if (o := options(a, dims.degree(a))) is not None}
        unflat = _compat.unflatten(root, axis.name, sizes, names, overrides)
        for name in names:
            axes[name] = unflat[name]
        created.append(unflat)
    return created


def _extra_axes(dims: ParallelDims, tokens: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``{name: base axes in use}`` of the requested extra flattened axes that are not derived axes already."""
    out = {}
    derived = [{a for a in m if dims.in_use(a)} for m in DERIVED_AXES.values()]
    for token in tokens:
        names = parse_axes(token)
        if not set(names) <= set(AXES):
            raise ValueError(f"extra axis {token!r}: only base axes {list(AXES)} can be flattened")
        members = tuple(a for a in dims.axis_order if a in names)
        if len(members) > 1 and set(members) not in derived:
            out["_".join(members)] = members
    return out


def _check_dp_replicate(dims: ParallelDims, dp_replicate: int) -> None:
    dp_replicate = as_int("dp_replicate", dp_replicate, minimum=1)
    if dims.dp % dp_replicate:
        raise ValueError(
            f"dp_replicate={dp_replicate} does not divide dp={dims.dp} ({dims.factors()}); HSDP needs dp = dp_replicate * dp_shard"
        )


def hsdp_rank_grid(dims: ParallelDims, dp_replicate: int) -> torch.Tensor:
    """Global ranks of every HSDP view, shape ``(tp * pp, dp_replicate, dp // dp_replicate * cfg * cp)``.

    Pure (no process groups). Row ``i`` is the ``("replicate", "shard")`` mesh of one tp x pp coordinate: a
    shard group spans the dp shards and the other axes of :data:`~wf_mesh.topology.FSDP_AXIS` (cfg, cp); the
    rank order is the one in the module docstring.

    Args:
        dims: resolved dims.
        dp_replicate: the number of replicas; must divide dp.

    Returns:
        An int64 tensor of global ranks.

    Raises:
        ValueError: ``dp_replicate`` does not divide dp.
    """
    _check_dp_replicate(dims, dp_replicate)
    names = list(dims.mesh_dim_names)  # root order: last varies fastest
    d = names.index("dp")
    shape = list(dims.mesh_shape)
    shape[d : d + 1] = [dp_replicate, dims.dp // dp_replicate]
    names[d : d + 1] = ["replicate", "dp_shard"]
    rep = names.index("replicate")
    shard_axes = {"dp_shard", *DERIVED_AXES[FSDP_AXIS]} - {"dp"}
    shard = [i for i, n in enumerate(names) if n in shard_axes]
    outside = [i for i in range(len(names)) if i != rep and i not in shard]
    grid = dims.rank_grid().reshape(shape).permute(*outside, rep, *shard)
    return grid.reshape(-1, dp_replicate, dims.degree(FSDP_AXIS) // dp_replicate)


def _build_hsdp(dims: ParallelDims, dp_replicate: int, device_type: str, opts: Any) -> DeviceMesh:
    """Build every tp x pp coordinate's 2-D view (``new_group`` is collective, so every rank builds all of
    them, in the same order). Public DeviceMesh API only.

    Returns:
        The view holding this rank.
    """
    override = None if opts is None else ((None, opts), (None, opts))
    rank, mine = dist.get_rank(), None
    for grid in hsdp_rank_grid(dims, dp_replicate):
        view = DeviceMesh(device_type, grid, mesh_dim_names=("replicate", "shard"), backend_override=override)
        if bool((grid == rank).any()):
            mine = view
    assert mine is not None  # every rank is in one view
    return mine


def device_mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """Global ranks of ``mesh``, flattened in its order (row-major): group-rank order for a 1-D mesh."""
    return mesh.mesh.flatten().tolist()


def get_parallel_mesh() -> ParallelMesh:
    """The current mesh; NotInitializedError (a RuntimeError and an AssertionError) if none was initialized."""
    if _current is None:
        raise NotInitializedError(
            "no ParallelMesh is initialized: call wf_mesh.init_from_env(ParallelDims(...)) "
            "(or wf_mesh.init_parallel on an existing process group) first"
        )
    return _current


def parallel_mesh_or_none() -> ParallelMesh | None:
    """The current mesh, or None."""
    return _current
