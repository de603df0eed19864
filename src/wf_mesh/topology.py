"""Pure parallel topology: degrees, rank order, validation and rank arithmetic.

Nothing here touches ``torch.distributed``: the same object plans 100,000 ranks in a notebook, drives the
CLI's ``plan`` command, and is what :class:`wf_mesh.mesh.ParallelMesh` builds its DeviceMesh from.

Rank layout (Megatron / MAGI-1): in ``order="tp-cp-pp-dp"`` axes listed EARLIER vary FASTEST::

    rank = tp_r + cp_r * tp + pp_r * tp * cp + dp_r * tp * cp * pp

A group over several axes (token ``"dp-cp"``) holds the ranks that share every OTHER axis's coordinate,
listed with the group's axes enumerated in ``order`` order, fastest first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

__all__ = ["AXES", "DERIVED_AXES", "ParallelDims", "parse_axes"]

AXES: tuple[str, ...] = ("tp", "cp", "pp", "dp")
"""The four base axes, in the default order."""

DERIVED_AXES: dict[str, tuple[str, ...]] = {
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("dp", "cp"),  # the FSDP axis: CP ranks hold the same weights
    "tp_pp": ("tp", "pp"),  # Megatron's "model parallel" group; it excludes cp
    "tp_cp_dp": ("tp", "cp", "dp"),
    "tp_dp": ("tp", "dp"),
}
"""Flattened axes every :class:`~wf_mesh.mesh.ParallelMesh` creates up front, by name."""


def parse_axes(token: str | Iterable[str]) -> tuple[str, ...]:
    """Split an axis token (``"tp-cp"``, ``"tp_cp"``, ``"dp"``, or a sequence of names) into base axis names.

    Raises ValueError for unknown or repeated names.
    """
    if isinstance(token, str):
        names = tuple(token.replace("_", "-").split("-"))
    else:
        names = tuple(token)
    unknown = [n for n in names if n not in AXES]
    if unknown or not names:
        raise ValueError(f"unknown axis {unknown or [token]!r} in {token!r}; axes are {list(AXES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"axis token {token!r} repeats an axis")
    return names


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of tensor (tp), context (cp), pipeline (pp) and data (dp) parallelism and their rank order.

    ``dp=-1`` is inferred by :meth:`resolve`. ``order`` is any permutation of the four axes joined by
    ``"-"``; an axis may be left out of it only if its degree is 1 (it is then appended).

    Example::

        >>> dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
        >>> dims.dp, dims.mesh_dim_names, dims.mesh_shape
        (2, ('dp', 'pp', 'cp', 'tp'), (2, 2, 2, 2))
        >>> dims.groups("tp-cp")[0]
        [0, 1, 2, 3]
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = -1
    order: str = "tp-cp-pp-dp"

    def __post_init__(self) -> None:
        for axis in AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool):
                raise TypeError(f"{axis} must be an int, got {type(degree).__name__} {degree!r}")
            if degree < 1 and not (axis == "dp" and degree == -1):
                raise ValueError(f"{axis}={degree} must be >= 1 (dp may be -1 to infer it); {self._factors()}")
        if not isinstance(self.order, str):
            raise TypeError(f"order must be a str like 'tp-cp-pp-dp', got {self.order!r}")
        names = self.order.split("-") if self.order else []
        unknown = [n for n in names if n not in AXES]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if unknown or repeated:
            raise ValueError(
                f"bad order {self.order!r}: unknown axes {unknown}, repeated axes {repeated}; "
                f"use a permutation of {'-'.join(AXES)}"
            )
        missing = [a for a in AXES if a not in names]
        bad_missing = [f"{a}={getattr(self, a)}" for a in missing if getattr(self, a) not in (1, -1)]
        if bad_missing:
            raise ValueError(
                f"order {self.order!r} leaves out {', '.join(bad_missing)}; an axis may be left out "
                f"only if its degree is 1"
            )
        object.__setattr__(self, "order", "-".join(names + missing))

    # ---- construction -------------------------------------------------------------------------------
    def _factors(self) -> str:
        return f"tp={self.tp}, cp={self.cp}, pp={self.pp}, dp={self.dp}"

    def resolve(self, world_size: int) -> ParallelDims:
        """Return a copy with ``dp`` inferred (if -1) and the product checked against ``world_size``."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        model = self.tp * self.cp * self.pp
        if self.dp == -1:
            if world_size % model:
                raise ValueError(
                    f"world_size={world_size} is not divisible by tp*cp*pp={model} "
                    f"(tp={self.tp}, cp={self.cp}, pp={self.pp}); cannot infer dp"
                )
            return dataclasses.replace(self, dp=world_size // model)
        if model * self.dp != world_size:
            raise ValueError(
                f"tp*cp*pp*dp = {model * self.dp} != world_size={world_size} ({self._factors()})"
            )
        return self

    @property
    def resolved(self) -> bool:
        return self.dp != -1

    def _require_resolved(self) -> None:
        if not self.resolved:
            raise ValueError(f"dp is still -1 ({self._factors()}); call .resolve(world_size) first")

    # ---- cheap facts --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        self._require_resolved()
        return self.tp * self.cp * self.pp * self.dp

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
        """Size of one group of ``axes`` (a base or derived axis, or a token like ``"tp-cp"``)."""
        return math.prod(getattr(self, a) for a in parse_axes(axes))

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
    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (omitted axes are 0): ``dims.rank_of(tp=1, pp=1)``."""
        self._require_resolved()
        unknown = [a for a in coords if a not in AXES]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; axes are {list(AXES)}")
        rank = 0
        for axis, stride in self.strides().items():
            c = coords.get(axis, 0)
            if not 0 <= c < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {c} out of range for {axis}={getattr(self, axis)}")
            rank += c * stride
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank, fastest axis first: ``{"tp": .., "cp": .., "pp": .., "dp": ..}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size={self.world_size} ({self._factors()})")
        out = {}
        for axis in self.axis_order:
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return out

    def rank_grid(self) -> torch.Tensor:
        """All global ranks as a tensor of shape :attr:`mesh_shape` (the root DeviceMesh's layout)."""
        return torch.arange(self.world_size, dtype=torch.int64).reshape(self.mesh_shape)

    def group_tensor(self, axes: str | Iterable[str]) -> torch.Tensor:
        """Groups of ``axes`` as a ``(num_groups, group_size)`` tensor; see :meth:`groups`."""
        names = parse_axes(axes)
        dims = self.mesh_dim_names
        inside = sorted((dims.index(a) for a in names))  # root order: last = fastest
        outside = [i for i in range(len(dims)) if i not in inside]
        grid = self.rank_grid().permute(*outside, *inside)
        return grid.reshape(-1, self.degree(names))

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Rank groups of ``axes`` (``"tp"``, ``"tp-cp"``, ``"dp_cp"``, ...) exactly as Megatron builds them.

        Groups are sorted by first rank; inside a group, the group's axes are enumerated in ``order``
        order, fastest first.
        """
        return self.group_tensor(axes).tolist()

    def group_of(self, axes: str | Iterable[str], rank: int) -> list[int]:
        """The group of ``axes`` that contains ``rank``."""
        c = self.coords(rank)
        names = parse_axes(axes)
        base = self.rank_of(**{a: v for a, v in c.items() if a not in names})
        strides = self.strides()
        members = [base]
        for axis in self.axis_order:  # fastest first, so later axes multiply the list outward
            if axis in names:
                members = [m + i * strides[axis] for i in range(getattr(self, axis)) for m in members]
        return members

    def __str__(self) -> str:
        return f"ParallelDims({self._factors()}, order={self.order!r})"
