"""Pure parallel topology: degrees, rank order, validation and rank arithmetic.

Nothing here touches ``torch.distributed`` (or imports torch): the same object plans a million ranks in a
notebook, drives ``wf-mesh plan``, and is what :class:`wf_mesh.mesh.ParallelMesh` builds its DeviceMesh from.
It is also the ONE place where degrees are validated; every other entry point (``init_parallel``,
``initialize_model_parallel``, ``dist_init``, the CLI) builds a ParallelDims and lets it judge.

Rank layout (Megatron / MAGI-1): in ``order="tp-cp-pp-dp"`` axes listed EARLIER vary FASTEST::

    rank = tp_r + cp_r * tp + pp_r * tp * cp + dp_r * tp * cp * pp

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
from typing import Any

from wf_mesh.errors import DegreeError

__all__ = ["AXES", "DERIVED_AXES", "SUB_AXES", "ParallelDims", "parse_axes"]

AXES: tuple[str, ...] = ("tp", "cp", "pp", "dp")
"""The four base axes, in the default order."""

SUB_AXES: dict[str, str] = {"cp_ulysses": "cp", "cp_ring": "cp"}
"""Sub-axes of a base axis (``cp = cp_ring x cp_ulysses``, see the module docstring)."""

DERIVED_AXES: dict[str, tuple[str, ...]] = {
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("dp", "cp"),  # the FSDP axis: CP ranks hold the same weights
    "tp_pp": ("tp", "pp"),  # Megatron's "model parallel" group; it excludes cp
    "tp_cp_dp": ("tp", "cp", "dp"),
    "tp_dp": ("tp", "dp"),
}
"""Flattened axes every :class:`~wf_mesh.mesh.ParallelMesh` creates up front, by name."""

MAX_GROUP_LISTING = 10_000_000
"""Most ranks :meth:`ParallelDims.groups` lists at once; larger worlds use ``group``/``group_of``/``iter_groups``."""

_NAMES = {*AXES, *SUB_AXES, *DERIVED_AXES}


def as_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int: ints (and numpy integers) pass; bool, float, str raise TypeError naming ``name``.

    ``minimum``: ValueError below it.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def parse_axes(token: str | Iterable[str]) -> tuple[str, ...]:
    """Split an axis token into axis names, expanding derived axes: ``"tp-cp"``, ``"tp_cp"`` and
    ``("tp", "cp")`` -> ``("tp", "cp")``; ``"dp_cp_ring"`` -> ``("dp", "cp_ring")``.

    Names are matched longest first among the base axes, the cp sub-axes and the derived axes.
    ValueError for unknown or repeated names.
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
    if len(set(names)) != len(names) or ("cp" in names and not SUB_AXES.keys().isdisjoint(names)):
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


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of tensor (tp), context (cp), pipeline (pp) and data (dp) parallelism and their rank order.

    ``dp=-1`` is inferred by :meth:`resolve`. ``order`` is any permutation of the four axes joined by
    ``"-"``; an axis may be left out of it only if its degree is 1 (it is then appended). ``cp_ulysses``
    (default 1) splits cp for USP attention; it must divide cp. Degrees must be ints (TypeError otherwise);
    bad values raise :class:`~wf_mesh.errors.DegreeError` (a ValueError and a RuntimeError) naming every factor.

    Example::

        >>> dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
        >>> dims.dp, dims.mesh_dim_names, dims.mesh_shape
        (2, ('dp', 'pp', 'cp', 'tp'), (2, 2, 2, 2))
        >>> dims.groups("tp-cp")[0]
        [0, 1, 2, 3]
        >>> dims.coords(13)
        {'tp': 1, 'cp': 0, 'pp': 1, 'dp': 1}
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = -1
    order: str = "tp-cp-pp-dp"
    cp_ulysses: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "cp_ulysses"):
            value = as_int(axis, getattr(self, axis))
            object.__setattr__(self, axis, value)
            if value < 1 and not (axis == "dp" and value == -1):
                raise DegreeError(f"{axis}={value} must be >= 1 (dp may be -1 to infer it); {self._factors()}")
        if self.cp % self.cp_ulysses:
            raise DegreeError(f"cp_ulysses={self.cp_ulysses} must divide cp={self.cp} (cp = cp_ring x cp_ulysses)")
        if not isinstance(self.order, str):
            raise TypeError(f"order must be a str like 'tp-cp-pp-dp', got {type(self.order).__name__} {self.order!r}")
        names = self.order.split("-") if self.order else []
        unknown = [n for n in names if n not in AXES]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if unknown or repeated:
            raise DegreeError(
                f"bad order {self.order!r}: unknown axes {unknown}, repeated axes {repeated}; "
                f"use a permutation of {'-'.join(AXES)}"
            )
        missing = tuple(a for a in AXES if a not in names)
        object.__setattr__(self, "_left_out", missing)
        self._check_left_out()
        object.__setattr__(self, "order", "-".join(names + list(missing)))

    def _check_left_out(self) -> None:
        bad = [f"{a}={getattr(self, a)}" for a in self._left_out if getattr(self, a) not in (1, -1)]
        if bad:
            given = "-".join(a for a in self.order.split("-") if a not in self._left_out)
            raise DegreeError(
                f"order {given!r} leaves out {', '.join(bad)}; an axis may be left out only if its degree is 1"
            )

    # ---- construction -------------------------------------------------------------------------------
    def _factors(self) -> str:
        ulysses = f", cp_ulysses={self.cp_ulysses}" if self.cp_ulysses != 1 else ""
        return f"tp={self.tp}, cp={self.cp}, pp={self.pp}, dp={self.dp}{ulysses}"

    def resolve(self, world_size: int) -> ParallelDims:
        """Return a copy with ``dp`` inferred (if -1) and the product checked against ``world_size``."""
        world_size = as_int("world_size", world_size)
        if world_size < 1:
            raise DegreeError(f"world_size={world_size} must be >= 1")
        model = self.tp * self.cp * self.pp
        if self.dp == -1:
            if world_size % model:
                raise DegreeError(
                    f"world_size={world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = "
                    f"{model}; cannot infer dp"
                )
            resolved = dataclasses.replace(self, dp=world_size // model, order=self._given_order())
            resolved._check_left_out()
            return resolved
        if model * self.dp != world_size:
            raise DegreeError(
                f"tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {model * self.dp} != world_size={world_size}"
            )
        return self

    def _given_order(self) -> str:
        return "-".join(a for a in self.order.split("-") if a not in self._left_out)

    @property
    def resolved(self) -> bool:
        return self.dp != -1

    def _require_resolved(self) -> None:
        if not self.resolved:
            raise DegreeError(f"dp is still -1 ({self._factors()}); call .resolve(world_size) first")

    # ---- cheap facts --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        self._require_resolved()
        return self.tp * self.cp * self.pp * self.dp

    @property
    def cp_ring(self) -> int:
        """Ranks of one ring in USP attention: ``cp // cp_ulysses``."""
        return self.cp // self.cp_ulysses

    @property
    def axis_order(self) -> tuple[str, ...]:
        """Base axes fastest-varying first, e.g. ``("tp", "cp", "pp", "dp")``."""
        return tuple(self.order.split("-"))

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Names of the root DeviceMesh (row-major, last fastest): the order reversed."""
        return self.axis_order[::-1]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        self._require_resolved()
        return tuple(getattr(self, a) for a in self.mesh_dim_names)

    def degree(self, axes: str | Iterable[str]) -> int:
        """Size of one group of ``axes`` (a base, sub- or derived axis, or a token like ``"tp-cp"``)."""
        sizes = self._atom_sizes()
        return math.prod(sizes[a] for a in self._atoms(axes))

    def strides(self) -> dict[str, int]:
        """Global-rank stride of each base axis."""
        strides, stride = {}, 1
        for axis in self.axis_order:
            strides[axis] = stride
            stride *= max(getattr(self, axis), 1)
        return strides

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    # ---- rank arithmetic ----------------------------------------------------------------------------
    def _atoms(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        """``axes`` as indivisible axes (cp becomes ``cp_ulysses, cp_ring``), in rank order, fastest first."""
        names = set()
        for name in parse_axes(axes):
            names |= {"cp_ulysses", "cp_ring"} if name == "cp" else {name}
        return tuple(a for a in self._atom_order() if a in names)

    def _atom_order(self) -> tuple[str, ...]:
        return tuple(
            itertools.chain.from_iterable(("cp_ulysses", "cp_ring") if a == "cp" else (a,) for a in self.axis_order)
        )

    def _atom_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp_ulysses": self.cp_ulysses, "cp_ring": self.cp_ring, "pp": self.pp, "dp": self.dp}

    def _atom_strides(self) -> dict[str, int]:
        sizes, strides, stride = self._atom_sizes(), {}, 1
        for atom in self._atom_order():
            strides[atom] = stride
            stride *= sizes[atom]
        return strides

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (omitted axes are 0): ``dims.rank_of(tp=1, pp=1)``.

        Takes base axes (``cp``) or the cp sub-axes (``cp_ring``, ``cp_ulysses``), not both.
        """
        self._require_resolved()
        unknown = [a for a in coords if a not in AXES and a not in SUB_AXES]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; axes are {list(AXES)} (or the sub-axes {list(SUB_AXES)})")
        if "cp" in coords and coords.keys() & SUB_AXES.keys():
            raise ValueError(f"give cp or its sub-axes {list(SUB_AXES)}, not both: {coords}")
        sizes = self._atom_sizes() | {"cp": self.cp}
        rank, strides = 0, self._atom_strides() | {"cp": self._atom_strides()["cp_ulysses"]}
        for axis, c in coords.items():
            c = as_int(f"{axis} coordinate", c)
            if not 0 <= c < sizes[axis]:
                raise ValueError(f"{axis} coordinate {c} out of range for {axis}={sizes[axis]}")
            rank += c * strides[axis]
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank, fastest axis first: ``{"tp": .., "cp": .., "pp": .., "dp": ..}``."""
        rank = as_int("rank", rank)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size={self.world_size} ({self._factors()})")
        out = {}
        for axis in self.axis_order:
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return out

    def sub_coords(self, rank: int) -> dict[str, int]:
        """``{"cp_ulysses": .., "cp_ring": ..}`` of a global rank (see the module docstring)."""
        ring, ulysses = divmod(self.coords(rank)["cp"], self.cp_ulysses)
        return {"cp_ulysses": ulysses, "cp_ring": ring}

    def rank_grid(self):
        """All global ranks as a torch tensor of shape :attr:`mesh_shape` (the root DeviceMesh's layout)."""
        import torch

        return torch.arange(self.world_size, dtype=torch.int64).reshape(self.mesh_shape)

    def num_groups(self, axes: str | Iterable[str]) -> int:
        """How many groups of ``axes`` there are: ``world_size // degree(axes)``."""
        return self.world_size // self.degree(axes)

    def group(self, axes: str | Iterable[str], index: int) -> list[int]:
        """Group number ``index`` of ``axes`` (groups are numbered by their first rank, ascending)."""
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
        """Rank groups of ``axes`` (``"tp"``, ``"tp-cp"``, ``"dp_cp"``, ``"cp_ring"``, ...) exactly as Megatron
        builds them: sorted by first rank; inside a group, its axes enumerated in ``order`` order, fastest first.

        Lists every rank, so it refuses worlds over :data:`MAX_GROUP_LISTING` ranks (ValueError): use
        :meth:`group`, :meth:`group_of` or :meth:`iter_groups` there.
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
        return f"ParallelDims({self._factors()}, order={self.order!r})"
