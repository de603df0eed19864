"""Pure parallel topology: the axis table, degrees, rank order, validation and rank arithmetic.

Nothing here touches ``torch.distributed`` (or imports torch): the same object plans a million ranks in a
notebook, drives ``wf-mesh plan``, and is what :class:`wf_mesh.mesh.ParallelMesh` builds its DeviceMesh from.
It is also the ONE place where degrees are validated; every other entry point (``init_parallel``,
``init_from_env``, the CLI, and the layers above them) builds a ParallelDims and lets it judge.

The axes are data: :data:`AXIS_TABLE` lists every base axis (name, default degree, place in the default order,
allowed degrees, CLI flag, description, sub-axes) and everything else is derived from it: :data:`AXES`,
:data:`DEFAULT_ORDER`, :data:`SUB_AXES`, the validation and arithmetic of :class:`ParallelDims`, the mesh's
creation agreement, the ``wf-mesh`` degree flags (:func:`wf_mesh.cli.add_degree_flags`). Adding an axis is a
row here (plus its :class:`ParallelDims` field) and its feature code.

Rank layout (Megatron / MAGI-1): in ``order="tp-cp-pp-cfg-dp"`` axes listed EARLIER vary FASTEST::

    rank = tp_r + cp_r * tp + pp_r * tp * cp + cfg_r * tp * cp * pp + dp_r * tp * cp * pp * cfg

An OPTIONAL axis (``cfg``) is part of the layout only when its degree is > 1: at degree 1 it is left out of
:attr:`ParallelDims.axis_order`, the coordinates, the root DeviceMesh and everything shown, so that layouts and
outputs without it are exactly those of a four-axis world. An order may leave an optional axis out at any
degree: it then goes just before the axis that follows it in :data:`DEFAULT_ORDER` (cfg before dp; xDiT's
RankGenerator order is tp-sp-pp-cfg-dp), so every four-axis order (``"tp-cp-pp-dp"``, Megatron's) stays valid.

A group over several axes (token ``"dp-cp"``) holds the ranks that share every OTHER axis's coordinate,
listed with the group's axes enumerated in ``order`` order, fastest first.

Context parallelism may be split for USP attention (``cp_ulysses``): ``cp = cp_ring x cp_ulysses`` with
``cp_ulysses`` the faster sub-axis, so a cp index is ``cp_ring_index * cp_ulysses + cp_ulysses_index`` and a
Ulysses group is ``cp_ulysses`` consecutive cp ranks (neighbouring ranks: on one node when tp is small).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from wf_mesh.errors import DegreeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AXES",
    "AXIS_TABLE",
    "DEFAULT_ORDER",
    "DERIVED_AXES",
    "FSDP_AXIS",
    "SUB_AXES",
    "UNSHARDED_AXES",
    "Axis",
    "ParallelDims",
    "Split",
    "as_int",
    "axis_named",
    "parse_axes",
]


@dataclasses.dataclass(frozen=True)
class Split:
    """A base axis split in two sub-axes for one feature: ``axis = slow x fast``, ``fast`` varying faster.

    The degree of ``fast`` is a :class:`ParallelDims` field of that name (it must divide the axis's degree);
    ``slow`` is what is left.
    """

    fast: str
    slow: str
    description: str

    @property
    def flag(self) -> str:
        """The ``wf-mesh`` option that sets the fast sub-axis's degree, e.g. ``--cp-ulysses``."""
        return "--" + self.fast.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Axis:
    """One row of :data:`AXIS_TABLE`: a base axis of the mesh (its place in the default order is its row's)."""

    name: str
    """The axis's name: a :class:`ParallelDims` field, a mesh dim, a coordinate."""
    default: int
    """Its default degree (``-1``: inferred from the world size by :meth:`ParallelDims.resolve`)."""
    description: str
    """One line for help texts and the docs."""
    optional: bool = False
    """Part of the layout (order, coordinates, mesh, views) only when its degree is > 1."""
    degrees: tuple[int, ...] | None = None
    """The degrees it may take (None: any >= 1)."""
    split: Split | None = None
    """Its sub-axes, if a feature splits it."""

    @property
    def flag(self) -> str:
        """The ``wf-mesh`` option that sets its degree, e.g. ``--tp``."""
        return "--" + self.name.replace("_", "-")

    @property
    def inferred(self) -> bool:
        """Whether its degree may be left to :meth:`ParallelDims.resolve` (``-1``)."""
        return self.default == -1


AXIS_TABLE: tuple[Axis, ...] = (
    Axis("tp", 1, "tensor-parallel degree: a layer's weights split over the ranks"),
    Axis(
        "cp",
        1,
        "context-parallel degree: the sequence (video tokens) split over the ranks",
        split=Split(
            "cp_ulysses", "cp_ring", "split cp into cp_ring x cp_ulysses for USP attention (Ulysses the faster)"
        ),
    ),
    Axis("pp", 1, "pipeline-parallel degree: consecutive layers on consecutive stages"),
    Axis(
        "cfg",
        1,
        "classifier-free-guidance-parallel degree: the conditional and unconditional branches of a sampling "
        "step on different ranks (1 or 2)",
        optional=True,
        degrees=(1, 2),
    ),
    Axis("dp", -1, "data-parallel degree: replicas of the model on different data"),
)
"""Every base axis, in the default rank order (fastest first): the one source of what the axes are."""

AXES: tuple[str, ...] = tuple(axis.name for axis in AXIS_TABLE)
"""The base axes, in the default order."""

DEFAULT_ORDER: str = "-".join(AXES)
"""The default rank order, fastest-varying axis first: ``"tp-cp-pp-cfg-dp"`` (cfg hidden while it is 1)."""

SUB_AXES: dict[str, str] = {
    sub: axis.name for axis in AXIS_TABLE if axis.split for sub in (axis.split.fast, axis.split.slow)
}
"""Sub-axes of a base axis (``cp = cp_ring x cp_ulysses``, see the module docstring)."""

UNSHARDED_AXES: dict[str, str] = {
    "ep": "expert parallelism: Megatron's orders name it (tp-cp-ep-dp-pp); wf_mesh does not shard experts"
}
"""Axes other frameworks put in an order string that wf_mesh does not shard: accepted in ``order`` and dropped."""

DERIVED_AXES: dict[str, tuple[str, ...]] = {
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("dp", "cp"),  # CP ranks hold the same weights
    "tp_pp": ("tp", "pp"),  # Megatron's "model parallel" group; it excludes cp
    "tp_cp_dp": ("tp", "cp", "dp"),
    "tp_dp": ("tp", "dp"),
    "dp_cfg_cp": ("dp", "cfg", "cp"),  # the FSDP axis: cfg branches and CP ranks hold the same weights
}
"""Flattened axes every :class:`~wf_mesh.mesh.ParallelMesh` creates up front, by name (each name is the token
of its members). One whose members in use equal another's is the same group (``dp_cfg_cp`` is ``dp_cp`` at
cfg=1)."""

FSDP_AXIS = "dp_cfg_cp"
"""The axis FSDP shards over: every rank holding the same weights (the dp replicas, both cfg branches, the cp
ranks); :meth:`~wf_mesh.mesh.ParallelMesh.fsdp_mesh`."""

MAX_GROUP_LISTING = 10_000_000
"""Most ranks :meth:`ParallelDims.groups` lists at once; larger worlds use ``group``/``group_of``/``iter_groups``."""

_TABLE = {axis.name: axis for axis in AXIS_TABLE}
_SPLITS = tuple(axis.split for axis in AXIS_TABLE if axis.split)
_NAMES = {*AXES, *SUB_AXES, *DERIVED_AXES}


def axis_named(name: str) -> Axis:
    """The :data:`AXIS_TABLE` row of base axis ``name``.

    Returns:
        The row's :class:`Axis`.

    Raises:
        KeyError: ``name`` is not a base axis.
    """
    try:
        return _TABLE[name]
    except KeyError:
        raise KeyError(f"unknown base axis {name!r}; axes are {list(AXES)}") from None


def as_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an int: ints (and numpy integers) pass; bool, float, str raise TypeError naming ``name``.

    Args:
        name: how messages name the value.
        value: the value to check.
        minimum: ValueError below it.

    Returns:
        The value as a Python int.

    Raises:
        TypeError: not an integer.
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}={number} must be >= {minimum}")
    return int(number)


def parse_axes(token: str | Iterable[str]) -> tuple[str, ...]:
    """Split an axis token into axis names, expanding derived axes.

    ``"tp-cp"``, ``"tp_cp"`` and ``("tp", "cp")`` give ``("tp", "cp")``; ``"dp_cp_ring"`` gives
    ``("dp", "cp_ring")``. Names are matched longest first among the base axes, the sub-axes and the derived
    axes.

    Args:
        token: names joined by ``-`` (or ``_``), or an iterable of names.

    Returns:
        The base and sub-axis names, in the token's order.

    Raises:
        ValueError: unknown or repeated names.
    """
    parts = token.split("-") if isinstance(token, str) else list(token)
    names: list[str] = []
    for part in parts:
        pieces = _segment(part.split("_")) if isinstance(part, str) else None
        if pieces is None:
            raise ValueError(
                f"unknown axis {part!r} in {token!r}; axes are {list(AXES)}, sub-axes {list(SUB_AXES)}, "
                f"derived axes {list(DERIVED_AXES)}"
            )
        for piece in pieces:
            names += DERIVED_AXES.get(piece, (piece,))
    if not names:
        raise ValueError(f"empty axis token {token!r}; axes are {list(AXES)}")
    split_and_whole = any(SUB_AXES.get(n) in names for n in names)
    if len(set(names)) != len(names) or split_and_whole:
        raise ValueError(f"axis token {token!r} repeats an axis: {names}")
    return tuple(names)


def _segment(words: list[str]) -> list[str] | None:
    """Split ``words`` (a token cut at ``_``) into known axis names, longest first; None if impossible."""
    if not words:
        return []
    for j in range(len(words), 0, -1):
        head = "_".join(words[:j])
        if head in _NAMES:
            rest = _segment(words[j:])
            if rest is not None:
                return [head, *rest]
    return None


def _place_left_out(names: list[str]) -> list[str]:
    """Complete ``names`` (a given order) to every base axis.

    Returns:
        The completed order: a left-out axis that is not optional goes to the end (in table order); a
        left-out optional axis goes just before the axis that follows it in the default order (or to the end
        when nothing follows it).
    """
    order = names + [a.name for a in AXIS_TABLE if not a.optional and a.name not in names]
    for i in reversed(range(len(AXIS_TABLE))):  # followers first, so a follower is always placed already
        axis = AXIS_TABLE[i]
        if axis.name in order:
            continue
        follower = next((a.name for a in AXIS_TABLE[i + 1 :] if a.name in order), None)
        order.insert(order.index(follower) if follower else len(order), axis.name)
    return order


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of the :data:`AXIS_TABLE` axes (tensor, context, pipeline, classifier-free guidance and data
    parallelism) and their rank order.

    ``dp=-1`` is inferred by :meth:`resolve`. ``order`` is a permutation of the axes joined by ``"-"``; an axis
    may be left out of it only if its degree is 1 (it is then appended), except an optional axis (cfg), which
    may be left out at any degree and goes just before dp. Names of :data:`UNSHARDED_AXES` (Megatron's ``ep``)
    are accepted and dropped. The stored ``order`` names every base axis; :attr:`shown_order` hides the
    optional axes of degree 1. ``cp_ulysses`` (default 1) splits cp for USP attention; it must divide cp.
    ``cfg`` is 1 or 2. Degrees must be ints (TypeError otherwise); bad values raise
    :class:`~wf_mesh.errors.DegreeError` (a ValueError and a RuntimeError) naming every factor.

    Example::

        >>> dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
        >>> dims.dp, dims.mesh_dim_names, dims.mesh_shape
        (2, ('dp', 'pp', 'cp', 'tp'), (2, 2, 2, 2))
        >>> dims.groups("tp-cp")[0]
        [0, 1, 2, 3]
        >>> dims.coords(13)
        {'tp': 1, 'cp': 0, 'pp': 1, 'dp': 1}
        >>> ParallelDims(tp=2, cfg=2).resolve(8).groups("cfg")
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = -1
    order: str = DEFAULT_ORDER
    cp_ulysses: int = 1
    cfg: int = 1
    _placed: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    """Base axes the given order left out (placed by the rule above)."""
    _left_out: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    """The placed axes that are not optional: their degree must be 1."""

    def __post_init__(self) -> None:
        self._check_degrees()
        if not isinstance(self.order, str):
            raise TypeError(f"order must be a str like 'tp-cp-pp-dp', got {type(self.order).__name__} {self.order!r}")
        names = [n for n in (self.order.split("-") if self.order else []) if n not in UNSHARDED_AXES]
        unknown = [n for n in names if n not in AXES]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if unknown or repeated:
            raise DegreeError(
                f"bad order {self.order!r}: unknown axes {unknown}, repeated axes {repeated}; "
                f"use a permutation of {'-'.join(AXES)} (the optional axes may be left out)"
            )
        full = _place_left_out(names)
        placed = tuple(a for a in full if a not in names)
        object.__setattr__(self, "_placed", placed)
        object.__setattr__(self, "_left_out", tuple(a for a in placed if not _TABLE[a].optional))
        object.__setattr__(self, "order", "-".join(full))
        self._check_left_out()

    def _check_degrees(self) -> None:
        for axis in AXIS_TABLE:
            value = as_int(axis.name, getattr(self, axis.name))
            object.__setattr__(self, axis.name, value)
            if value < 1 and not (axis.inferred and value == -1):
                raise DegreeError(f"{axis.name}={value} must be >= 1 (dp may be -1 to infer it); {self.factors()}")
            if axis.degrees is not None and value not in axis.degrees:
                raise DegreeError(f"{axis.name}={value} must be one of {list(axis.degrees)}; {self.factors()}")
            if axis.split is not None:
                fast = as_int(axis.split.fast, getattr(self, axis.split.fast), minimum=1)
                object.__setattr__(self, axis.split.fast, fast)
                if value % fast:
                    raise DegreeError(
                        f"{axis.split.fast}={fast} must divide {axis.name}={value} "
                        f"({axis.name} = {axis.split.slow} x {axis.split.fast})"
                    )

    def _check_left_out(self) -> None:
        left_out = self._left_out
        bad = [f"{a}={getattr(self, a)}" for a in left_out if getattr(self, a) not in (1, -1)]
        if bad:
            given = "-".join(a for a in self.axis_order if a not in left_out)
            raise DegreeError(
                f"order {given!r} leaves out {', '.join(bad)}; an axis may be left out only if its degree is 1"
            )

    # ---- construction -------------------------------------------------------------------------------
    def factors(self) -> str:
        """The degrees as messages show them.

        Returns:
            E.g. ``"tp=2, cp=1, pp=1, dp=4"`` (cfg when it is 2, a split when it is not 1).
        """
        shown = [f"{a.name}={getattr(self, a.name)}" for a in AXIS_TABLE if not a.optional or getattr(self, a.name) > 1]
        splits = [f"{s.fast}={getattr(self, s.fast)}" for s in _SPLITS if getattr(self, s.fast) != 1]
        return ", ".join(shown + splits)

    def resolve(self, world_size: int) -> ParallelDims:
        """A copy with ``dp`` inferred (if -1) and the product of the degrees checked against ``world_size``.

        Args:
            world_size: the number of ranks.

        Returns:
            The resolved dims (``self`` when dp was given and fits).

        Raises:
            DegreeError: the degrees do not multiply to ``world_size`` (or cannot be completed to it).
            TypeError: ``world_size`` is not an int.
        """
        world_size = as_int("world_size", world_size)
        if world_size < 1:
            raise DegreeError(f"world_size={world_size} must be >= 1")
        inferred = next(a.name for a in AXIS_TABLE if a.inferred)
        others = [a for a in self._shown_names() if a != inferred]
        model = math.prod(getattr(self, a) for a in others)
        names, values = "*".join(others), "*".join(str(getattr(self, a)) for a in others)
        if getattr(self, inferred) == -1:
            if world_size % model:
                raise DegreeError(
                    f"world_size={world_size} is not divisible by {names} = {values} = {model}; cannot infer {inferred}"
                )
            resolved = dataclasses.replace(self, order=self._given_order(), **{inferred: world_size // model})
            resolved._check_left_out()
            return resolved
        total = model * getattr(self, inferred)
        if total != world_size:
            raise DegreeError(
                f"{names}*{inferred} = {values}*{getattr(self, inferred)} = {total} != world_size={world_size}"
            )
        return self

    def _shown_names(self) -> list[str]:
        """Base axes in table order, the optional ones only when in use."""
        return [a.name for a in AXIS_TABLE if self.in_use(a.name)]

    def _given_order(self) -> str:
        return "-".join(a for a in self.order.split("-") if a not in self._placed)

    @property
    def resolved(self) -> bool:
        """Whether dp is known (not -1)."""
        return self.dp != -1

    def _require_resolved(self) -> None:
        if not self.resolved:
            raise DegreeError(f"dp is still -1 ({self.factors()}); call .resolve(world_size) first")

    # ---- cheap facts --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the degrees (resolved dims only)."""
        self._require_resolved()
        return math.prod(getattr(self, a) for a in AXES)

    @property
    def cp_ring(self) -> int:
        """Ranks of one ring in USP attention: ``cp // cp_ulysses``."""
        return self.cp // self.cp_ulysses

    def in_use(self, axis: str) -> bool:
        """Whether base axis ``axis`` is part of the layout: not optional, or of degree > 1.

        Returns:
            True when ``axis`` is in use.

        Raises:
            KeyError: ``axis`` is not a base axis.
        """
        return not axis_named(axis).optional or getattr(self, axis) > 1

    def enabled(self, axes: str | Iterable[str]) -> bool:
        """Whether a group of ``axes`` (any axis or token) has more than one rank."""
        return self.degree(axes) > 1

    @property
    def axis_order(self) -> tuple[str, ...]:
        """Base axes in use, fastest-varying first, e.g. ``("tp", "cp", "pp", "dp")``."""
        return tuple(a for a in self.order.split("-") if self.in_use(a))

    @property
    def shown_order(self) -> str:
        """:attr:`axis_order` joined by ``-``: the order as users see it (``"tp-cp-pp-dp"`` while cfg is 1)."""
        return "-".join(self.axis_order)

    @property
    def shown_axes(self) -> tuple[str, ...]:
        """Every axis a mesh of these dims shows, by name: the base axes in use (table order), the sub-axes
        of a split axis when it is split, and the derived axes whose members are all in use."""
        subs = [
            name
            for axis in AXIS_TABLE
            if axis.split and getattr(self, axis.split.fast) > 1
            for name in (axis.split.fast, axis.split.slow)
        ]
        derived = [name for name, members in DERIVED_AXES.items() if all(self.in_use(m) for m in members)]
        return (*self._shown_names(), *subs, *derived)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Names of the root DeviceMesh (row-major, last fastest): :attr:`axis_order` reversed."""
        return self.axis_order[::-1]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of the root DeviceMesh (resolved dims only)."""
        self._require_resolved()
        return tuple(getattr(self, a) for a in self.mesh_dim_names)

    def degree(self, axes: str | Iterable[str]) -> int:
        """Size of one group of ``axes`` (a base, sub- or derived axis, or a token like ``"tp-cp"``)."""
        sizes = self._atom_sizes()
        return math.prod(sizes[a] for a in self._atoms(axes))

    def strides(self) -> dict[str, int]:
        """Global-rank stride of each base axis in use."""
        strides, stride = {}, 1
        for axis in self.axis_order:
            strides[axis] = stride
            stride *= max(getattr(self, axis), 1)
        return strides

    @property
    def tp_enabled(self) -> bool:
        """Whether tp > 1."""
        return self.enabled("tp")

    @property
    def cp_enabled(self) -> bool:
        """Whether cp > 1."""
        return self.enabled("cp")

    @property
    def pp_enabled(self) -> bool:
        """Whether pp > 1."""
        return self.enabled("pp")

    @property
    def dp_enabled(self) -> bool:
        """Whether dp > 1."""
        return self.enabled("dp")

    @property
    def cfg_enabled(self) -> bool:
        """Whether cfg = 2: the guidance branches run on different ranks."""
        return self.enabled("cfg")

    # ---- rank arithmetic ----------------------------------------------------------------------------
    def _atoms(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        """``axes`` as indivisible axes in use (a split axis becomes its sub-axes).

        Returns:
            The atoms in rank order, fastest first. An optional axis of degree 1 has no atom: its groups are
            single ranks.
        """
        names: set[str] = set()
        for name in parse_axes(axes):
            split = _TABLE[name].split if name in _TABLE else None
            names |= {split.fast, split.slow} if split else {name}
        return tuple(a for a in self._atom_order() if a in names)

    def _atom_order(self) -> tuple[str, ...]:
        return tuple(
            itertools.chain.from_iterable(
                (split.fast, split.slow) if (split := _TABLE[a].split) else (a,) for a in self.axis_order
            )
        )

    def _atom_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for axis in AXIS_TABLE:
            degree: int = getattr(self, axis.name)
            if axis.split:
                fast: int = getattr(self, axis.split.fast)
                sizes |= {axis.split.fast: fast, axis.split.slow: degree // fast}
            else:
                sizes[axis.name] = degree
        return sizes

    def _atom_strides(self) -> dict[str, int]:
        sizes, strides, stride = self._atom_sizes(), {}, 1
        for atom in self._atom_order():
            strides[atom] = stride
            stride *= sizes[atom]
        return strides

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (omitted axes are 0): ``dims.rank_of(tp=1, pp=1)``.

        Takes base axes (``cp``) or their sub-axes (``cp_ring``, ``cp_ulysses``), not both.

        Returns:
            The global rank.

        Raises:
            ValueError: an unknown axis, an axis and its sub-axes, or a coordinate out of range.
        """
        self._require_resolved()
        unknown = [a for a in coords if a not in AXES and a not in SUB_AXES]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; axes are {list(AXES)} (or the sub-axes {list(SUB_AXES)})")
        both = [a for a in coords if SUB_AXES.get(a) in coords]
        if both:
            raise ValueError(f"give {SUB_AXES[both[0]]} or its sub-axes {list(SUB_AXES)}, not both: {coords}")
        sizes, strides = self._atom_sizes(), self._atom_strides()
        for split_axis in _SPLITS:
            parent = SUB_AXES[split_axis.fast]
            sizes[parent] = getattr(self, parent)
            strides[parent] = strides.get(split_axis.fast, 0)
        rank = 0
        for axis, c in coords.items():
            c = as_int(f"{axis} coordinate", c)
            if not 0 <= c < sizes[axis]:
                raise ValueError(f"{axis} coordinate {c} out of range for {axis}={sizes[axis]}")
            rank += c * strides.get(axis, 0)  # an axis not in use has only coordinate 0
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank on the axes in use, fastest first: ``{"tp": .., "cp": .., ...}``.

        Returns:
            The coordinate of ``rank`` on each axis in use, by axis name.

        Raises:
            ValueError: ``rank`` out of range.
        """
        rank = as_int("rank", rank)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size={self.world_size} ({self.factors()})")
        out = {}
        for axis in self.axis_order:
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return out

    def sub_coords(self, rank: int) -> dict[str, int]:
        """``{"cp_ulysses": .., "cp_ring": ..}`` of a global rank (see the module docstring)."""
        out: dict[str, int] = {}
        coords = self.coords(rank)
        for split in _SPLITS:
            parent = SUB_AXES[split.fast]
            slow, fast = divmod(coords.get(parent, 0), getattr(self, split.fast))
            out |= {split.fast: fast, split.slow: slow}
        return out

    def rank_grid(self) -> torch.Tensor:
        """All global ranks as a torch tensor of shape :attr:`mesh_shape` (the root DeviceMesh's layout)."""
        import torch

        return torch.arange(self.world_size, dtype=torch.int64).reshape(self.mesh_shape)

    def num_groups(self, axes: str | Iterable[str]) -> int:
        """How many groups of ``axes`` there are: ``world_size // degree(axes)``."""
        return self.world_size // self.degree(axes)

    def group(self, axes: str | Iterable[str], index: int) -> list[int]:
        """Group number ``index`` of ``axes`` (groups are numbered by their first rank, ascending).

        Returns:
            The group's global ranks, in the order :meth:`groups` lists them.

        Raises:
            ValueError: ``index`` out of range, or a bad token.
        """
        atoms, sizes, strides = self._atoms(axes), self._atom_sizes(), self._atom_strides()
        index = as_int("group index", index)
        if not 0 <= index < self.num_groups(axes):
            raise ValueError(f"group index {index} out of range: {axes!r} has {self.num_groups(axes)} groups")
        base = 0
        for atom in self._atom_order():  # the other axes' coordinates, fastest first = least significant
            if atom not in atoms:
                index, c = divmod(index, sizes[atom])
                base += c * strides[atom]
        return self._members(base, atoms)

    def _members(self, base: int, atoms: tuple[str, ...]) -> list[int]:
        sizes, strides = self._atom_sizes(), self._atom_strides()
        members = [base]
        for atom in atoms:  # fastest first, so later axes multiply the list outward
            step = strides[atom]
            members = [m + i * step for i in range(sizes[atom]) for m in members]
        return members

    def group_index(self, axes: str | Iterable[str], rank: int) -> int:
        """The number of the group of ``axes`` that holds ``rank`` (its index in :meth:`groups`)."""
        atoms, sizes = self._atoms(axes), self._atom_sizes()
        self.coords(rank)  # range check
        index, scale = 0, 1
        for atom in self._atom_order():
            rank, c = divmod(rank, sizes[atom])
            if atom not in atoms:
                index += c * scale
                scale *= sizes[atom]
        return index

    def group_of(self, axes: str | Iterable[str], rank: int) -> list[int]:
        """The group of ``axes`` that contains ``rank``, in group order."""
        return self.group(axes, self.group_index(axes, rank))

    def iter_groups(self, axes: str | Iterable[str]) -> Iterator[list[int]]:
        """Every group of ``axes`` in order, one at a time (any world size)."""
        return (self.group(axes, i) for i in range(self.num_groups(axes)))

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Rank groups of ``axes`` (``"tp"``, ``"tp-cp"``, ``"dp_cp"``, ``"cp_ring"``, ``"cfg"``, ...) exactly as
        Megatron builds them: sorted by first rank; inside a group, its axes enumerated in ``order`` order,
        fastest first.

        Lists every rank, so it refuses worlds over :data:`MAX_GROUP_LISTING` ranks: use :meth:`group`,
        :meth:`group_of` or :meth:`iter_groups` there.

        Returns:
            Every group's global ranks.

        Raises:
            ValueError: the world is too large to list, or a bad token.
        """
        if self.world_size > MAX_GROUP_LISTING:
            raise ValueError(
                f"groups({axes!r}) would list all {self.world_size:,} ranks (limit {MAX_GROUP_LISTING:,}); use "
                "group(axes, i), group_of(axes, rank) or iter_groups(axes)"
            )
        atoms = self._atoms(axes)
        sizes, strides = self._atom_sizes(), self._atom_strides()
        bases = [0]
        for atom in self._atom_order():  # first ranks of all groups, ascending
            if atom not in atoms:
                step = strides[atom]
                bases = [b + i * step for i in range(sizes[atom]) for b in bases]
        inner = self._members(0, atoms)
        return [[b + m for m in inner] for b in bases]

    def __str__(self) -> str:
        return f"ParallelDims({self.factors()}, order={self.shown_order!r})"
