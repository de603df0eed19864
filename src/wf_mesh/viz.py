"""Views of a parallel topology and of tensor placements: text for terminals, HTML for notebooks.

- :func:`format_plan`: what ``wf-mesh plan`` prints (header, rank grid, every axis's groups).
- :class:`TopologyView`: the rank grid of a ParallelDims or ParallelMesh, each axis's groups told apart
  (group numbers in text, one background colour per group in HTML).
- :class:`PlacementView`: which rank holds which slice of every tensor dim, for a DTensor or a planned sharding
  (no processes); uneven shards follow ``torch.chunk`` sizing, as DTensor does.

All views are pure arithmetic and cut large worlds with a note. A view as the last expression of a notebook
cell renders as HTML (``_repr_html_``)::

    >>> print(TopologyView(ParallelDims(tp=2, cp=2, pp=2).resolve(16)))                 # doctest: +SKIP
    >>> PlacementView.plan((2, 16, 8, 44, 80), (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"))  # doctest: +SKIP
"""

from __future__ import annotations

import html
import itertools
import math
import re
import textwrap
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from wf_mesh.topology import AXES, DERIVED_AXES, ParallelDims, parse_axes

__all__ = [
    "PLAN_AXES", "PlacementView", "RankSlice", "TopologyView", "format_plan", "format_ranks", "parse_placement",
    "show_topology",
]  # fmt: skip

PLAN_AXES: tuple[str, ...] = (*AXES, *DERIVED_AXES)
"""Axes whose groups :func:`format_plan` lists: the four base axes, then the derived ones."""

_AXIS_NOTES = {"dp_cp": "FSDP", "tp_pp": "model parallel"}


def format_ranks(ranks: Sequence[int], *, max_ranks: int = 16) -> str:
    """Compact rank list: runs of 3+ consecutive ranks as ``a-b``, e.g. ``[0-3,8,9]``.

    More than ``max_ranks`` entries (a run counts as one) keeps the first ``max_ranks - 1`` and the last,
    with ``...`` between.
    """
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(ranks), key=lambda item: item[1] - item[0]):
        values = [r for _, r in run]
        parts += [f"{values[0]}-{values[-1]}"] if len(values) >= 3 else [str(v) for v in values]
    if len(parts) > max_ranks:
        parts = [*parts[: max_ranks - 1], "...", parts[-1]]
    return "[" + ",".join(parts) + "]"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _side_by_side(blocks: list[list[str]], width: int) -> list[str]:
    """Lay out blocks (lists of equal-width lines) left to right, in rows of at most ``width``, blank-line ended."""
    out: list[str] = []
    rows: list[list[list[str]]] = []
    for block in blocks:
        if rows and rows[-1] and 2 + sum(len(b[0]) + 3 for b in rows[-1]) + len(block[0]) <= width:
            rows[-1].append(block)
        else:
            rows.append([block])
    for row in rows:
        for i in range(max(len(b) for b in row)):
            out.append(("  " + "   ".join(b[i] if i < len(b) else " " * len(b[0]) for b in row)).rstrip())
        out.append("")
    return out


def _colour(index: int) -> str:
    """Background colour of group / slice ``index``: golden-angle hues, three lightness levels."""
    return f"hsl({index * 137.508 % 360:.1f},70%,{(80, 90, 70)[index % 3]}%)"


_STYLE = (  # scoped to the views' own <div>; the highlighted rank has class "me"
    "<style>.wf-mesh-view{font-family:monospace}.wf-mesh-view table{border-collapse:collapse;margin:0}"
    ".wf-mesh-view td,.wf-mesh-view th{padding:1px 5px;text-align:right;border:1px solid #fff}"
    ".wf-mesh-view .me{outline:2px solid #000;font-weight:bold}</style>"
)


# ---- format_plan (wf-mesh plan) ---------------------------------------------------------------------
def _header(dims: ParallelDims) -> list[str]:
    strides = dims.strides()
    terms = [a if strides[a] == 1 else f"{strides[a]}*{a}" for a in dims.axis_order if getattr(dims, a) > 1]
    formula = " + ".join(terms) or "0"
    return [
        f"world size {dims.world_size} = tp {dims.tp} x cp {dims.cp} x pp {dims.pp} x dp {dims.dp}",
        f"order {dims.order} (fastest first): rank = {formula}",
        f"root mesh dims {dims.mesh_dim_names}, shape {dims.mesh_shape}",
    ]


def _block(dims: ParallelDims, dp: int, pp: int, max_side: int) -> list[str]:
    """One (dp, pp) pair as a table: cp rows x tp columns of global ranks (truncated past ``max_side``)."""
    cols = list(range(min(dims.tp, max_side)))
    rows = list(range(min(dims.cp, max_side)))
    col_w = max(len(str(dims.world_size - 1)), *(len(f"tp{t}") for t in cols))
    row_w = max(len(f"cp{c}") for c in rows)
    more_cols = " ..." if dims.tp > max_side else ""
    lines = [" " * row_w + "".join(f" {f'tp{t}':>{col_w}}" for t in cols) + more_cols]
    for c in rows:
        cells = "".join(f" {dims.rank_of(tp=t, cp=c, pp=pp, dp=dp):>{col_w}}" for t in cols)
        lines.append(f"{f'cp{c}':<{row_w}}{cells}{more_cols}")
    if dims.cp > max_side:
        lines.append(f"{'...':<{row_w}}")
    title = f"dp{dp} pp{pp}"
    w = max(len(title), *(len(line) for line in lines))
    return [line.ljust(w) for line in [title, *lines]]


def _grid(dims: ParallelDims, *, max_grid_ranks: int, max_side: int, width: int) -> list[str]:
    # Pairs in rank order: the axis with the larger stride is the outer loop.
    strides = dims.strides()
    if strides["pp"] < strides["dp"]:
        pairs = itertools.product(range(dims.dp), range(dims.pp))
    else:
        pairs = ((dp, pp) for pp, dp in itertools.product(range(dims.pp), range(dims.dp)))
    n_pairs = dims.dp * dims.pp
    per_block = min(dims.tp, max_side) * min(dims.cp, max_side)
    shown = list(itertools.islice(pairs, max(1, max_grid_ranks // per_block)))
    out = [f"rank grid: one cp x tp table per (dp, pp) pair ({_plural(n_pairs, 'pair')})"]
    out += _side_by_side([_block(dims, dp, pp, max_side) for dp, pp in shown], width)
    if n_pairs > len(shown):
        out.append(f"  ... {_plural(n_pairs - len(shown), '(dp, pp) pair')} more not shown ({n_pairs} in all)")
        out.append("")
    return out


def _groups(dims: ParallelDims, *, max_groups: int, max_ranks: int, width: int) -> list[str]:
    tables = {axis: dims.group_tensor(axis) for axis in PLAN_AXES}  # views of one arange: cheap at any size
    labels = {axis: f"{_plural(t.shape[0], 'group')} of {t.shape[1]}" for axis, t in tables.items()}
    name_w, label_w = max(map(len, PLAN_AXES)), max(map(len, labels.values()))
    out = ["groups (ranks in group order):"]
    seen: dict[frozenset[str], str] = {}  # axes of degree > 1 -> first axis with exactly these groups
    for axis, table in tables.items():
        prefix = f"  {axis:<{name_w}}  {labels[axis]:<{label_w}}  "
        n = table.shape[0]
        parts: list[str] = []
        for group in table[:max_groups].tolist():  # as many groups as fit the width (at least one)
            text = _list(group, max_ranks)
            if parts and len(prefix) + sum(len(p) + 1 for p in parts) + len(text) > width:
                break
            parts.append(text)
        text = " ".join(parts) + (f" ... ({n} groups)" if n > len(parts) else "")
        key = frozenset(a for a in parse_axes(axis) if getattr(dims, a) > 1)
        notes = [_AXIS_NOTES[axis]] if axis in _AXIS_NOTES else []
        if key in seen:
            notes.append(f"= {seen[key]}")
        else:
            seen[key] = axis
        out.append(prefix + text + (f"  ({'; '.join(notes)})" if notes else ""))
    return out


def _list(ranks: list[int], max_ranks: int) -> str:
    if len(ranks) <= max_ranks:
        return str(ranks)
    return "[" + ", ".join(map(str, ranks[: max_ranks - 1])) + f", ..., {ranks[-1]}]"


def format_plan(
    dims: ParallelDims,
    *,
    max_grid_ranks: int = 64,
    max_side: int = 16,
    max_groups: int = 16,
    max_ranks: int = 12,
    width: int = 100,
) -> str:
    """Text view of a resolved ``dims``: header, rank grid, and the groups of every axis in :data:`PLAN_AXES`.

    Args:
        dims: a resolved ParallelDims (``dims.resolve(world_size)``); ValueError if ``dp`` is still -1.
        max_grid_ranks: ranks shown in the grid; whole (dp, pp) tables beyond it are cut with a note
            (at least one table is shown).
        max_side: tp columns / cp rows shown per table before ``...``.
        max_groups: groups listed per axis (fewer if they do not fit ``width``) before ``... (N groups)``.
        max_ranks: ranks listed per group: the first ``max_ranks - 1``, ``...``, then the last.
        width: target line width: tables are laid side by side and group lists cut to fit it.
    """
    lines = [*_header(dims), ""]
    lines += _grid(dims, max_grid_ranks=max_grid_ranks, max_side=max_side, width=width)
    lines += _groups(dims, max_groups=max_groups, max_ranks=max_ranks, width=width)
    return "\n".join(lines)


# ---- topology view ----------------------------------------------------------------------------------
def _text_block(title: str, rows: list[list[str]], more_rows: bool, more_cols: bool, labels=None) -> list[str]:
    w = max(len(c) for row in rows for c in row)
    lines = [" ".join(f"{c:>{w}}" for c in row) + (" ..." if more_cols else "") for row in rows]
    if labels and any(labels):
        lw = max(map(len, labels))
        lines = [f"{label:<{lw}}  {line}" for label, line in zip(labels, lines)]
    lines += ["..."] if more_rows else []
    w = max(len(title), *map(len, lines))
    return [line.ljust(w) for line in [title, *lines]]


class TopologyView:
    """The rank grid of a resolved ParallelDims (or a ParallelMesh: its dims, this rank highlighted) with each
    axis's groups told apart.

    Ranks are laid out row-major: the fastest axes of ``order`` across (until the grid is about square or
    ``max_cols`` wide), the others down. Text: the rank grid, then one grid per axis whose cells are each
    rank's group number on that axis (the index in ``dims.groups(axis)``). HTML: one grid of ranks per axis,
    each group its own background colour (hover a cell for its coordinates). ``axis=None`` shows every base
    axis of degree > 1; ``axis="dp_cp"`` (any base or derived axis or token such as ``"tp-cp"``) shows that
    axis alone and lists its groups. Past ``max_rows`` x ``max_cols`` ranks the grid is cut with a note.
    """

    def __init__(self, dims_or_mesh, axis: str | None = None, *, highlight: int | None = None, max_rows: int = 16,
                 max_cols: int = 16, max_groups: int = 16, width: int = 100) -> None:  # fmt: skip
        dims = getattr(dims_or_mesh, "dims", dims_or_mesh)
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"TopologyView needs a ParallelDims or a ParallelMesh, got {type(dims_or_mesh).__name__}")
        world = dims.world_size  # ValueError if dp is still -1
        self.dims = dims
        self.highlight = getattr(dims_or_mesh, "global_rank", None) if highlight is None else highlight
        if axis is not None:
            parse_axes(axis)  # ValueError for an unknown axis
        self.axes = (axis,) if axis is not None else tuple(a for a in dims.axis_order if getattr(dims, a) > 1)
        self.max_groups, self.width = max_groups, width
        self.ncols, col_axes = 1, []
        for a in dims.axis_order:
            degree = getattr(dims, a)
            if self.ncols**2 >= world or (self.ncols > 1 and self.ncols * degree > max_cols):
                break
            self.ncols *= degree
            col_axes.append(a)
        self.nrows = world // self.ncols
        self.col_axes = [a for a in col_axes if getattr(dims, a) > 1]
        self.row_axes = [a for a in dims.axis_order if a not in col_axes and getattr(dims, a) > 1]
        self.grid = torch.arange(world).reshape(self.nrows, self.ncols)[:max_rows, :max_cols]  # ranks shown

    def group_ids(self, axis: str) -> torch.Tensor:
        """Group number (index in ``dims.groups(axis)``) of every rank shown, shaped like :attr:`grid`."""
        table = self.dims.group_tensor(axis)
        ids = torch.empty(table.numel(), dtype=torch.int64)
        ids[table.flatten()] = torch.arange(table.shape[0]).repeat_interleave(table.shape[1])
        return ids[self.grid]

    def _caption(self, axis: str) -> str:
        size = self.dims.degree(axis)
        return f"{axis} ({_plural(self.dims.world_size // size, 'group')} of {size})"

    def _row_labels(self) -> list[str]:
        coords = [self.dims.coords(r) for r in self.grid[:, 0].tolist()]
        return [" ".join(f"{a}{c[a]}" for a in self.row_axes) for c in coords]

    def _notes(self) -> list[str]:
        d, (rows, cols) = self.dims, self.grid.shape
        lines = [
            f"world {d.world_size} = tp {d.tp} x cp {d.cp} x pp {d.pp} x dp {d.dp}, order {d.order} (fastest first)",
            f"{_plural(self.nrows, 'row')} ({' x '.join(self.row_axes) or '-'}) x {_plural(self.ncols, 'column')} "
            f"({' x '.join(self.col_axes) or '-'}): rank = row * {self.ncols} + column",
        ]
        ones = [a for a in d.axis_order if getattr(d, a) == 1]
        if len(self.axes) != 1 and ones:
            lines.append(f"size-1 axes (every rank is its own group): {', '.join(ones)}")
        if (rows, cols) != (self.nrows, self.ncols):
            shown = f"{rows} of {self.nrows} rows and {cols} of {self.ncols} columns"
            lines.append(f"showing {shown} ({rows * cols} of {d.world_size} ranks)")
        if self.highlight is not None:
            lines.append(f"* = rank {self.highlight}")
        return lines

    def _group_list(self) -> list[str]:
        table = self.dims.group_tensor(self.axes[0])
        parts = [f"{i}={format_ranks(g)}" for i, g in enumerate(table[: self.max_groups].tolist())]
        more = f" ... ({table.shape[0]} groups)" if table.shape[0] > len(parts) else ""
        text = f"{self.axes[0]} groups: " + " ".join(parts) + more
        return textwrap.wrap(text, self.width, subsequent_indent="  ", break_on_hyphens=False)

    def __str__(self) -> str:
        grid = self.grid.tolist()
        more = (self.grid.shape[0] < self.nrows, self.grid.shape[1] < self.ncols)
        ranks = [[f"{r}*" if r == self.highlight else str(r) for r in row] for row in grid]
        blocks = [_text_block("rank", ranks, *more, labels=self._row_labels())]
        for axis in self.axes:
            ids = [[str(g) for g in row] for row in self.group_ids(axis).tolist()]
            blocks.append(_text_block(self._caption(axis), ids, *more))
        lines = [*self._notes(), "", *_side_by_side(blocks, self.width)]
        if len(self.axes) == 1:
            lines += self._group_list()
        return "\n".join(lines).rstrip()

    __repr__ = __str__

    def _td(self, rank: int, axis: str | None, group: int | None) -> str:
        c = self.dims.coords(rank)
        title = f"rank {rank}: " + " ".join(f"{a}{c[a]}" for a in AXES) + (f", {axis} group {group}" if axis else "")
        me = ' class="me"' if rank == self.highlight else ""
        style = f' style="background:{_colour(group)}"' if axis else ""
        return f'<td{me}{style} title="{html.escape(title)}">{rank}</td>'

    def _repr_html_(self) -> str:
        grid, labels = self.grid.tolist(), self._row_labels()
        tables = []
        for axis in self.axes or (None,):
            ids = self.group_ids(axis).tolist() if axis else [[None] * len(grid[0])] * len(grid)
            rows = [
                f"<tr><th>{html.escape(label)}</th>"
                + "".join(self._td(rank, axis, g) for rank, g in zip(row, row_ids)) + "</tr>"
                for label, row, row_ids in zip(labels, grid, ids)
            ]  # fmt: skip
            caption = html.escape(self._caption(axis) if axis else "ranks")
            tables.append(f'<table><caption>{caption}</caption>{"".join(rows)}</table>')
        notes = "<br>".join(map(html.escape, self._notes()))
        groups = f"<p>{'<br>'.join(map(html.escape, self._group_list()))}</p>" if len(self.axes) == 1 else ""
        return (
            f'{_STYLE}<div class="wf-mesh-view"><p>{notes}</p>'
            f'<div style="display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start">{"".join(tables)}</div>'
            f"{groups}</div>"
        )


def show_topology(dims_or_mesh, axis: str | None = None, **options) -> TopologyView:
    """``TopologyView(dims_or_mesh, axis, **options)``: the last expression of a notebook cell renders as HTML."""
    return TopologyView(dims_or_mesh, axis, **options)


# ---- placement view ---------------------------------------------------------------------------------
def parse_placement(placement: Placement | str) -> Placement:
    """A Shard / Replicate / Partial placement, or its short form: ``"S(2)"`` (``"Shard(2)"``), ``"R"``,
    ``"P"`` (sum) or ``"P(avg)"``. ValueError for anything else (e.g. ``_StridedShard``)."""
    if isinstance(placement, (Shard, Replicate, Partial)):
        return placement
    if isinstance(placement, str):
        m = re.fullmatch(r"(S|Shard|R|Replicate|P|Partial)(?:\((?:dim=)?([^)]*)\))?", placement.replace(" ", ""))
        kind, arg = (m[1][0], m[2] or "") if m else ("", "")
        if kind == "S" and re.fullmatch(r"-?\d+", arg):
            return Shard(int(arg))
        if kind == "R" and not arg:
            return Replicate()
        if kind == "P":
            return Partial(arg or "sum")
    raise ValueError(f"unsupported placement {placement!r}: use Shard/Replicate/Partial or 'S(dim)', 'R', 'P(avg)'")


class RankSlice(NamedTuple):
    """What one rank holds: mesh coordinates, slice number (same number = same elements) and per-dim ranges."""
    rank: int
    coords: tuple[int, ...]
    slice: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.ranges)


class PlacementView:
    """Which rank holds which slice of a tensor: a DTensor (``PlacementView(dtensor)``; its mesh, placements
    and global shape) or a plan (:meth:`plan`, no processes).

    One row per rank in mesh order: the rank, its mesh coordinates, a slice number (ranks with the same number
    hold the same elements; replicas or partial terms), per tensor dim ``start:stop`` or ``:`` for the full
    dim, and the local shape. Placements apply left to right over the mesh axes; each ``Shard(d)`` splits the
    current range of dim ``d`` in ``torch.chunk`` sizing (DTensor's rule; trailing ranks may get ``n:n``,
    empty). Text via ``str``, HTML (one colour per slice) via ``_repr_html_``. Rows past ``max_rows`` are cut.
    """

    def __init__(self, dtensor: DTensor, *, dim_names: Sequence[str] | None = None, highlight: int | None = None,
                 max_rows: int = 32) -> None:  # fmt: skip
        if not isinstance(dtensor, DTensor):
            raise TypeError(f"PlacementView needs a DTensor, got {type(dtensor).__name__}; use PlacementView.plan(...)")
        mesh = dtensor.device_mesh
        if highlight is None and dist.is_initialized():
            highlight = dist.get_rank()
        self._setup(dtensor.shape, mesh.mesh, mesh.mesh_dim_names, dtensor.placements, dim_names, highlight, max_rows)

    @classmethod
    def plan(cls, shape: Sequence[int], mesh_shape: int | Sequence[int], placements: Sequence[Placement | str], *,
             mesh_dim_names: Sequence[str] | None = None, ranks: Sequence | torch.Tensor | None = None,
             dim_names: Sequence[str] | None = None, highlight: int | None = None, max_rows: int = 32) -> PlacementView:
        """The view of a tensor of ``shape`` placed on a mesh of ``mesh_shape`` (global ranks ``ranks``, default
        ``0..N-1`` row-major) with one placement per mesh axis (:func:`parse_placement` forms). Pure."""
        mesh_shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
        grid = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape) if ranks is None else torch.as_tensor(ranks)
        if tuple(grid.shape) != mesh_shape:
            raise ValueError(f"ranks have shape {tuple(grid.shape)}, but mesh_shape is {mesh_shape}")
        view = cls.__new__(cls)
        view._setup(shape, grid, mesh_dim_names, placements, dim_names, highlight, max_rows)
        return view

    def _setup(self, shape, ranks, mesh_dim_names, placements, dim_names, highlight, max_rows) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.ranks = ranks
        self.mesh_shape = tuple(ranks.shape)
        self.mesh_dim_names = tuple(mesh_dim_names or (f"axis{i}" for i in range(ranks.ndim)))
        self.dim_names = tuple(dim_names or (f"d{i}" for i in range(len(self.shape))))
        self.highlight, self.max_rows = highlight, max_rows
        parsed = [parse_placement(p) for p in placements]
        mesh, tensor = (ranks.ndim, f"mesh {self.mesh_shape}"), (len(self.shape), f"tensor {self.shape}")
        for what, names, (n, of) in [("mesh_dim_names", self.mesh_dim_names, mesh), ("placements", parsed, mesh),
                                     ("dim_names", self.dim_names, tensor)]:  # fmt: skip
            if len(names) != n:
                raise ValueError(f"{what} ({', '.join(map(str, names))}): {len(names)} given for a {n}-D {of}")
        for i, p in enumerate(parsed):
            if isinstance(p, Shard):
                if not -len(self.shape) <= p.dim < len(self.shape):
                    raise ValueError(f"{p} on mesh axis {self.mesh_dim_names[i]}: no dim {p.dim} in {self.shape}")
                parsed[i] = Shard(p.dim % len(self.shape))
        self.placements: tuple[Placement, ...] = tuple(parsed)

    def rows(self) -> list[RankSlice]:
        """What each shown rank holds (the first ``max_rows`` in mesh order)."""
        shard_axes = [i for i, p in enumerate(self.placements) if isinstance(p, Shard)]
        out = []
        coords_in_order = itertools.product(*map(range, self.mesh_shape))  # mesh order: last axis fastest
        for rank, coords in zip(self.ranks.flatten()[: self.max_rows].tolist(), coords_in_order):
            ranges = [(0, n) for n in self.shape]
            for size, p, c in zip(self.mesh_shape, self.placements, coords):
                if isinstance(p, Shard):  # torch.chunk sizing of the current range
                    start, stop = ranges[p.dim]
                    step = -(-(stop - start) // size)
                    begin = min(start + c * step, stop)
                    ranges[p.dim] = (begin, min(begin + step, stop))
            number = 0
            for i in shard_axes:
                number = number * self.mesh_shape[i] + coords[i]
            out.append(RankSlice(rank, tuple(coords), number, tuple(ranges)))
        return out

    def _notes(self) -> list[str]:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        n_slices = math.prod(s for s, p in zip(self.mesh_shape, self.placements) if isinstance(p, Shard))
        lines = [
            f"shape {self.shape} on mesh {mesh}, placements ({', '.join(map(str, self.placements))})",
            f"{_plural(self.ranks.numel(), 'rank')}, {_plural(n_slices, 'distinct slice')} "
            "(same slice = same index ranges)",
        ]
        for name, p in zip(self.mesh_dim_names, self.placements):
            if isinstance(p, Partial):
                lines.append(f"partial over {name}: each rank holds a term; the value is their {p.reduce_op}")
        return lines

    def _table(self) -> tuple[list[str], list[list[str]]]:
        head = ["rank", *self.mesh_dim_names, "slice", *self.dim_names, "local shape"]
        body = []
        for r in self.rows():
            spans = [":" if (a, b) == (0, n) else f"{a}:{b}" for (a, b), n in zip(r.ranges, self.shape)]
            rank = f"{r.rank}*" if r.rank == self.highlight else str(r.rank)
            body.append([rank, *map(str, r.coords), str(r.slice), *spans, str(r.local_shape)])
        return head, body

    def __str__(self) -> str:
        head, body = self._table()
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body]]
        if len(body) < self.ranks.numel():
            lines.append(f"... {_plural(self.ranks.numel() - len(body), 'more rank')}")
        return "\n".join([*self._notes(), "", *lines])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head, body = self._table()
        rows = ["<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
        for r, cells in zip(self.rows(), body):
            me = ' class="me"' if r.rank == self.highlight else ""
            tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            rows.append(f'<tr{me} style="background:{_colour(r.slice)}" title="slice {r.slice}">{tds}</tr>')
        notes = "<br>".join(map(html.escape, self._notes()))
        return (
            f'{_STYLE}<div class="wf-mesh-view"><p>{notes}</p><table>{"".join(rows)}</table></div>'
        )
