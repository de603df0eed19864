"""Views of a parallel topology and of tensor placements: text for terminals, HTML for notebooks.

- :func:`format_table`: THE fixed-width text table of wf_mesh (the views, the demo's report, the benchmarks).
- :class:`TopologyView`: the rank grid of a ParallelDims or ParallelMesh, each axis's groups told apart
  (group numbers in text, one background colour per group in HTML), and the groups of every axis. It is what
  ``wf-mesh plan`` prints.
- :class:`PlacementView`: which rank holds which slice of every tensor dim, for a DTensor or a planned sharding
  (no processes); uneven shards follow ``torch.chunk`` sizing (:mod:`wf_mesh.sizing`), as DTensor does.

Everything here is pure arithmetic on what is shown (a million-rank world renders in milliseconds) and this
module does not import torch: only :class:`PlacementView` of a real DTensor and :func:`parse_placement` (which
returns torch placements) do, when called. Every cut says what was left out. A view as the last expression of
a notebook cell renders as HTML (``_repr_html_``); the HTML sets a text colour wherever it sets a background,
so it reads on light and dark notebook themes::

    >>> print(TopologyView(ParallelDims(tp=2, cp=2, pp=2).resolve(16)))                 # doctest: +SKIP
    >>> PlacementView.plan((2, 16, 8, 44, 80), (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"))  # doctest: +SKIP
"""

from __future__ import annotations

import html
import itertools
import math
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from wf_mesh.sizing import chunk_range
from wf_mesh.topology import AXES, AXIS_TABLE, DERIVED_AXES, FSDP_AXIS, SUB_AXES, ParallelDims, parse_axes

__all__ = [
    "PLAN_AXES",
    "PlacementSpec",
    "PlacementView",
    "RankSlice",
    "TopologyView",
    "format_ranks",
    "format_table",
    "mesh_axes",
    "parse_placement",
    "plural",
    "show_topology",
]

PLAN_AXES: tuple[str, ...] = ParallelDims().shown_axes
"""The axes every ParallelMesh shows: the base axes that are not optional, then the derived ones made of them."""

_AXIS_NOTES = {
    "tp_pp": "model parallel",
    "cp_ulysses": "Ulysses all-to-all",
    "cp_ring": "ring",
    "cfg": "guidance branches",
}


def mesh_axes(dims: ParallelDims) -> tuple[str, ...]:
    """Every axis a mesh of ``dims`` shows (:attr:`~wf_mesh.topology.ParallelDims.shown_axes`).

    Returns:
        The axis names: :data:`PLAN_AXES`, plus cfg and ``dp_cfg_cp`` when cfg is 2, and ``cp_ulysses`` and
        ``cp_ring`` when cp is split.
    """
    return dims.shown_axes


# ---- the one table formatter ------------------------------------------------------------------------
def format_table(
    header: Sequence[Any] | None,
    rows: Iterable[Sequence[Any]],
    *,
    align: str = "",
    sep: str = "  ",
    rule: bool = False,
    indent: str = "",
) -> str:
    """A fixed-width text table: the one table formatter of wf_mesh.

    Args:
        header: column titles, or None for a table without a header row.
        rows: one sequence of cells per row (``str()`` of each); short rows are padded with empty cells.
        align: one letter per column, ``"l"`` (left) or ``"r"`` (right); columns past its end are left-aligned.
        sep: text between columns.
        rule: a line of dashes under the header.
        indent: text before every line.

    Returns:
        The table's lines joined by newlines; trailing spaces are stripped from every line.

    Raises:
        ValueError: an ``align`` letter other than ``"l"`` or ``"r"``.

    >>> print(format_table(["name", "n"], [["a", 1], ["bb", 22]], align="lr"))
    name   n
    a      1
    bb    22
    """
    table = [[str(c) for c in row] for row in rows]
    if header is not None:
        table.insert(0, [str(c) for c in header])
    if not table:
        return ""
    ncols = max(map(len, table))
    table = [row + [""] * (ncols - len(row)) for row in table]
    bad = set(align) - {"l", "r"}
    if bad:
        raise ValueError(f"align {align!r}: use one 'l' or 'r' per column")
    widths = [max(len(row[i]) for row in table) for i in range(ncols)]
    right = [i < len(align) and align[i] == "r" for i in range(ncols)]

    def line(cells: list[str]) -> str:
        return (indent + sep.join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right))).rstrip()

    lines = [line(row) for row in table]
    if rule and header is not None:
        lines.insert(1, line(["-" * w for w in widths]))
    return "\n".join(lines)


def plural(n: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``: ``n`` and ``noun``, with an ``s`` unless ``n`` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


# ---- rank lists -------------------------------------------------------------------------------------
Part = tuple[str, int]  # (text, how many ranks it stands for)


def _run_parts(start: int, count: int, step: int) -> Iterator[Part]:
    if step == 1 and count >= 3:
        yield f"{start}-{start + count - 1}", count
    else:
        for j in range(count):
            yield str(start + j * step), 1


def _join(parts: Iterator[Part], total: int, last: Part, max_parts: int) -> str:
    """Join ``parts`` as ``[a,b,...]`` of at most ``max_parts`` parts.

    Returns:
        The list text; a cut list keeps the first ``max_parts - 1`` parts and the last one, and says how many
        ranks it left out between them.
    """
    shown = list(itertools.islice(parts, max(max_parts, 2) + 1))
    if len(shown) <= max(max_parts, 2):
        return "[" + ",".join(text for text, _ in shown) + "]"
    head = shown[: max(max_parts, 2) - 1]
    left_out = total - sum(n for _, n in head) - last[1]
    return "[" + ",".join(text for text, _ in head) + f",({left_out} more),{last[0]}]"


def format_ranks(ranks: Sequence[int], *, max_ranks: int = 16) -> str:
    """Compact rank list: runs of 3+ consecutive ranks as ``a-b``, e.g. ``[0-3,8,9]``.

    Returns:
        The text; more than ``max_ranks`` entries (a run counts as one) keep the first ``max_ranks - 1`` and
        the last, and say how many ranks are left out between them: ``[0,2,4,(16 more),38]``.
    """
    ranks = list(ranks)
    if not ranks:
        return "[]"
    parts: list[Part] = []
    for _, run in itertools.groupby(enumerate(ranks), key=lambda item: item[1] - item[0]):
        values = [r for _, r in run]
        parts += _run_parts(values[0], len(values), 1)
    return _join(iter(parts), len(ranks), parts[-1], max_ranks)


class _Atom(NamedTuple):
    name: str  # tp, cp (or cp_ulysses and cp_ring when cp is split), pp, dp
    size: int
    stride: int


def _atoms(dims: ParallelDims) -> list[_Atom]:
    """The indivisible axes of ``dims`` in use (a split axis as its sub-axes, when it is split).

    Returns:
        One atom per axis, fastest first, with its size and global-rank stride.
    """
    out, stride = [], 1
    for axis in dims.axis_order:
        split = next(a.split for a in AXIS_TABLE if a.name == axis)
        if split and getattr(dims, split.fast) > 1:
            parts = [(split.fast, getattr(dims, split.fast)), (split.slow, dims.degree(split.slow))]
        else:
            parts = [(axis, getattr(dims, axis))]
        for name, size in parts:
            out.append(_Atom(name, size, stride))
            stride *= size
    return out


def _member_names(dims: ParallelDims, axis: str) -> set[str]:
    names: set[str] = set()
    for name in parse_axes(axis):
        if name == "cp":
            names |= {"cp", "cp_ulysses", "cp_ring"}
        elif name == "cp_ring" and dims.cp_ulysses == 1:
            names.add("cp")  # an unsplit cp is all ring
        else:
            names.add(name)
    return names


def _in_use(dims: ParallelDims, axis: str) -> set[str]:
    """The base (and sub-) axes in use that token ``axis`` names."""
    return {n for n in parse_axes(axis) if dims.in_use(SUB_AXES.get(n, n))}


def _group_layout(dims: ParallelDims, axis: str, index: int) -> tuple[int, list[tuple[int, int]]]:
    """The layout of group ``index`` of ``axis``: pure arithmetic, whatever the group's size (``dims.group``
    lists every member).

    Returns:
        ``(first rank, [(size, stride), ...] of its member axes)``, fastest first, adjacent axes merged.
    """
    members = _member_names(dims, axis)
    base = 0
    inner: list[tuple[int, int]] = []
    for atom in _atoms(dims):
        if atom.name in members:
            if atom.size > 1:
                if inner and inner[-1][0] * inner[-1][1] == atom.stride:
                    inner[-1] = (inner[-1][0] * atom.size, inner[-1][1])
                else:
                    inner.append((atom.size, atom.stride))
        else:
            index, c = divmod(index, atom.size)
            base += c * atom.stride
    return base, inner


def _format_group(dims: ParallelDims, axis: str, index: int, max_ranks: int) -> str:
    """``format_ranks(dims.group(axis, index))`` without listing the group: fast for groups of any size."""
    base, inner = _group_layout(dims, axis, index)
    if not inner:
        return f"[{base}]"
    (count, step), outer = inner[0], inner[1:]  # outer: the other member axes, fastest first

    def parts() -> Iterator[Part]:
        for k in itertools.count():  # runs in group order, one mixed-radix number at a time (never listed)
            start = base
            for size, stride in outer:
                k, digit = divmod(k, size)
                start += digit * stride
            if k:
                return
            yield from _run_parts(start, count, step)

    last_start = base + sum((size - 1) * stride for size, stride in outer)
    if step == 1 and count >= 3:
        last = (f"{last_start}-{last_start + count - 1}", count)
    else:
        last = (str(last_start + (count - 1) * step), 1)
    return _join(parts(), math.prod(size for size, _ in inner), last, max_ranks)


# ---- layout helpers ---------------------------------------------------------------------------------
def _side_by_side(labels: list[str], blocks: list[list[str]], width: int) -> list[str]:
    """Lay out blocks (lists of lines, all as long as ``labels``) left to right.

    Returns:
        The lines, in rows of at most ``width`` characters; each row of blocks starts with the ``labels``
        column.
    """
    lw = max(map(len, labels), default=0)
    prefix = lw + 2 if lw else 0
    rows: list[list[list[str]]] = []
    for block in blocks:
        bw = max(map(len, block))
        block = [line.ljust(bw) for line in block]
        if rows and prefix + sum(len(b[0]) + 3 for b in rows[-1]) + bw <= width:
            rows[-1].append(block)
        else:
            rows.append([block])
    out: list[str] = []
    for row in rows:
        for i, label in enumerate(labels):
            head = f"{label:<{lw}}  " if lw else ""
            out.append((head + "   ".join(b[i] for b in row)).rstrip())
        out.append("")
    return out


def _colour(index: int, dark: bool = False) -> str:
    # golden-angle hues at three lightness levels: light ones under black text, or (dark) dark ones under white
    # text; either way a WCAG contrast of at least 4.5 (tests/test_viz.py computes it)
    hue = f"{index * 137.508 % 360:.1f}"
    return f"hsl({hue},50%,{(24, 30, 18)[index % 3]}%)" if dark else f"hsl({hue},70%,{(80, 90, 72)[index % 3]}%)"


_DARK = "--wf-mesh-dark"  # the custom property each coloured cell's inline style sets to its dark background

_STYLE = (  # scoped to the views' own <div>; the highlighted rank has class "me"
    # Colours are inline (they survive renderers that drop <style>): light backgrounds under black text. A
    # dark colour scheme swaps in each cell's dark background (its inline custom property) under white text;
    # the rest of the view inherits the page's own colours, whichever scheme it follows.
    "<style>.wf-mesh-view{font-family:monospace;line-height:1.3}"
    ".wf-mesh-view table{border-collapse:collapse;margin:0 0 .5em 0}"
    ".wf-mesh-view td,.wf-mesh-view th{padding:1px 5px;text-align:right;border:1px solid rgba(127,127,127,.35)}"
    ".wf-mesh-view th{font-weight:normal;opacity:.8}"
    ".wf-mesh-view caption{white-space:nowrap;text-align:left;font-weight:bold}"
    ".wf-mesh-view .me{outline:2px solid currentColor;outline-offset:-2px;font-weight:bold}"
    ".wf-mesh-view .cut{font-style:italic;opacity:.8}"
    f'@media (prefers-color-scheme: dark){{.wf-mesh-view [style*="{_DARK}"]'
    f"{{background:var({_DARK})!important;color:#fff!important}}}}</style>"
)


def _cell_style(index: int) -> str:
    return f"background:{_colour(index)};color:#000;{_DARK}:{_colour(index, dark=True)}"


def _html_rows(rows: Iterable[Sequence[str]], tag: str = "td", align: str = "") -> str:
    """Table rows; ``align`` as in :func:`format_table` (cells are right-aligned unless "l")."""
    left = ' style="text-align:left"'
    return "".join(
        "<tr>"
        + "".join(
            f"<{tag}{left if i < len(align) and align[i] == 'l' else ''}>{html.escape(str(c))}</{tag}>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )


def _html_table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str = "") -> str:
    return f"<table>{_html_rows([header], 'th', align)}{_html_rows(rows, 'td', align)}</table>"


def _html_notes(lines: Iterable[str]) -> str:
    return "<p>" + "<br>".join(map(html.escape, lines)) + "</p>"


# ---- topology view ----------------------------------------------------------------------------------
class TopologyView:
    """The rank grid of a resolved ParallelDims (or a ParallelMesh: its dims, this rank highlighted), each axis's
    groups told apart, and the groups of every axis: what ``wf-mesh plan`` prints.

    Ranks are laid out row-major: the fastest axes of ``order`` across (until the grid is about square or
    ``max_cols`` wide), the others down; the column axes' coordinates head the columns and the row axes'
    coordinates label the rows. Text: the rank grid, then one grid per axis whose cells are each rank's group
    number on that axis (its index in ``dims.groups(axis)``), then the groups of every axis (numbered the same
    way). HTML: one grid of ranks per axis, each group its own background colour (hover a cell for its
    coordinates), and the same group list.

    ``axis=None`` shows every base axis of degree > 1 (and, when cp is split with ``cp_ulysses``, the sub-axes
    ``cp_ulysses`` and ``cp_ring``) and lists the groups of every axis of the mesh; ``axis="dp_cp"`` (any
    base, sub- or derived axis, or a token such as ``"tp-cp"``) shows and lists that axis alone. Past
    ``max_rows`` x ``max_cols`` ranks the grids are cut, past ``max_groups`` groups (or ``width``) a group list
    is cut, and past ``max_ranks`` ranks a group is cut; each cut says what it left out. Pure arithmetic on what
    is shown: fast for any world size.
    """

    def __init__(
        self,
        dims_or_mesh: Any,
        axis: str | None = None,
        *,
        highlight: int | None = None,
        max_rows: int = 16,
        max_cols: int = 16,
        max_groups: int = 16,
        max_ranks: int = 12,
        width: int = 100,
    ) -> None:
        dims = getattr(dims_or_mesh, "dims", dims_or_mesh)
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"TopologyView needs a ParallelDims or a ParallelMesh, got {type(dims_or_mesh).__name__}")
        world = dims.world_size  # ValueError if dp is still -1
        self.dims = dims
        self.highlight = getattr(dims_or_mesh, "global_rank", None) if highlight is None else highlight
        if self.highlight is not None and not 0 <= self.highlight < world:
            raise ValueError(f"highlight rank {self.highlight} is out of range for world size {world}")
        if axis is not None:
            parse_axes(axis)  # ValueError for an unknown axis
        for name, value in (
            ("max_rows", max_rows),
            ("max_cols", max_cols),
            ("max_groups", max_groups),
            ("max_ranks", max_ranks),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if axis is not None:
            self.axes: tuple[str, ...] = (axis,)
            self.listed: tuple[str, ...] = (axis,)
        else:
            shown = []
            for a in dims.axis_order:
                if getattr(dims, a) > 1:
                    shown.append(a)
                if a == "cp" and dims.cp_ulysses > 1:
                    shown += [s for s in ("cp_ulysses", "cp_ring") if dims.degree(s) > 1]
            self.axes, self.listed = tuple(shown), mesh_axes(dims)
        self.max_groups, self.max_ranks, self.width = max_groups, max_ranks, width
        self.atoms = [a for a in _atoms(dims) if a.size > 1]
        self.ncols, col_atoms = 1, []
        for atom in self.atoms:
            if self.ncols**2 >= world or (self.ncols > 1 and self.ncols * atom.size > max_cols):
                break
            self.ncols *= atom.size
            col_atoms.append(atom)
        self.nrows = world // self.ncols
        self.col_atoms = col_atoms
        self.row_atoms = self.atoms[len(col_atoms) :]
        self.shown_rows = min(self.nrows, max_rows)
        self.shown_cols = min(self.ncols, max_cols)

    # ---- what is shown ------------------------------------------------------------------------------
    @property
    def grid(self) -> list[list[int]]:
        """The ranks shown, row by row (``rank = row * ncols + column``)."""
        return [[r * self.ncols + c for c in range(self.shown_cols)] for r in range(self.shown_rows)]

    def group_ids(self, axis: str) -> list[list[int]]:
        """Group number (index in ``dims.groups(axis)``) of every rank shown, shaped like :attr:`grid`."""
        return [[self.dims.group_index(axis, rank) for rank in row] for row in self.grid]

    @property
    def cut(self) -> bool:
        """Whether the grid shows fewer rows or columns than the mesh has."""
        return (self.shown_rows, self.shown_cols) != (self.nrows, self.ncols)

    def _row_label(self, row: int) -> str:
        rank = row * self.ncols
        return " ".join(f"{a.name}{rank // a.stride % a.size}" for a in self.row_atoms)

    def _col_coords(self) -> list[tuple[str, list[int]]]:
        return [(a.name, [c // a.stride % a.size for c in range(self.shown_cols)]) for a in self.col_atoms]

    def _caption(self, axis: str) -> str:
        size = self.dims.degree(axis)
        return f"{axis} ({plural(self.dims.num_groups(axis), 'group')} of {size})"

    def _title(self, rank: int) -> str:
        d = self.dims
        coords = " ".join(f"{a}{c}" for a, c in d.coords(rank).items() if a in AXES)
        if d.cp_ulysses > 1:
            coords += " (" + " ".join(f"{a}{c}" for a, c in d.sub_coords(rank).items()) + ")"
        return f"rank {rank}: {coords}"

    def _notes(self) -> list[str]:
        d = self.dims
        degrees = []
        for axis in AXIS_TABLE:
            if d.in_use(axis.name):
                split, text = axis.split, f"{axis.name} {getattr(d, axis.name)}"
                if split and d.enabled(split.fast):
                    text += f" ({split.slow} {d.degree(split.slow)} x {split.fast} {d.degree(split.fast)})"
                degrees.append(text)
        formula = " + ".join(a.name if a.stride == 1 else f"{a.stride}*{a.name}" for a in self.atoms) or "0"
        lines = [
            f"world {d.world_size} = {' x '.join(degrees)}, order {d.shown_order} (fastest first)",
            f"rank = {formula}",
            f"root DeviceMesh dims {d.mesh_dim_names}, shape {d.mesh_shape}",
            (
                f"grid: {plural(self.nrows, 'row')} ({' x '.join(a.name for a in self.row_atoms) or '-'}) x "
                f"{plural(self.ncols, 'column')} ({' x '.join(a.name for a in self.col_atoms) or '-'}), "
                f"rank = row * {self.ncols} + column"
            ),
        ]
        if self.axes:
            lines.append("each axis's grid: a rank's group number on that axis (its index in dims.groups(axis))")
        ones = [a for a in d.axis_order if getattr(d, a) == 1]
        if d.cp_ulysses > 1 and d.cp_ring == 1:
            ones.append("cp_ring")
        if len(self.axes) != 1 and ones:
            lines.append(f"size-1 axes (every rank is its own group): {', '.join(ones)}")
        if self.cut:
            r, c = self.shown_rows, self.shown_cols
            lines.append(
                f"showing {r} of {self.nrows} rows and {c} of {self.ncols} columns "
                f"({r * c} of {d.world_size} ranks; the others are left out)"
            )
        if self.highlight is not None:
            lines.append(f"* = rank {self.highlight}")
        return lines

    def _group_rows(self) -> list[list[str]]:
        """Per listed axis: name, groups, size, the first groups (as many as fit), a note."""
        rows: list[list[str]] = []
        counts: list[int] = []
        seen: dict[frozenset[str], str] = {}
        fsdp = _in_use(self.dims, FSDP_AXIS)  # FSDP's note goes on the listed axis of its members in use
        fsdp_axis = next((a for a in self.listed if a in DERIVED_AXES and _in_use(self.dims, a) == fsdp), None)
        for axis in self.listed:
            n, size = self.dims.num_groups(axis), self.dims.degree(axis)
            key = frozenset(a.name for a in self.atoms if a.name in _member_names(self.dims, axis))
            notes = [_AXIS_NOTES[axis]] if axis in _AXIS_NOTES else []
            if axis == fsdp_axis:
                notes.insert(0, "FSDP")
            if key in seen and len(self.listed) > 1:
                notes.append(f"= {seen[key]}")
            seen.setdefault(key, axis)
            rows.append([axis, str(n), str(size), f"  ({'; '.join(notes)})" if notes else ""])
            counts.append(n)
        name_w = sum(max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(["axis", "groups", "size"]))
        out = []
        for (axis, groups, degree, note), count in zip(rows, counts):
            room = self.width - name_w - len(note)
            parts = self._listing(axis, count, room)
            if len(parts) < count:  # cut: make room for the "(N more)" that says so
                parts = self._listing(axis, count, room - len(f" ({count} more)"))
            listing = " ".join(parts) + (f" ({count - len(parts)} more)" if count > len(parts) else "")
            out.append([axis, groups, degree, listing + note])
        return out

    def _listing(self, axis: str, count: int, budget: int) -> list[str]:
        """The first groups of ``axis`` that fit ``budget`` characters (at least one, cut to fit if need be)."""
        budget = max(24, budget)
        parts: list[str] = []
        for i in range(min(count, self.max_groups)):
            text = f"{i}={_format_group(self.dims, axis, i, self.max_ranks)}"
            for max_ranks in range(self.max_ranks - 1, 1, -1):  # the first group: fewer ranks until it fits
                if parts or len(text) <= budget:
                    break
                text = f"{i}={_format_group(self.dims, axis, i, max_ranks)}"
            if parts and sum(len(p) + 1 for p in parts) + len(text) > budget:
                break
            parts.append(text)
        return parts

    # ---- text ---------------------------------------------------------------------------------------
    @property
    def _pad(self) -> str:
        """What follows an unmarked number when a rank is highlighted: a space where the ``*`` goes, so the
        digits stay right-aligned."""
        return "" if self.highlight is None else " "

    def _marked(self, rank: int) -> str:
        return f"{rank}*" if rank == self.highlight else f"{rank}{self._pad}"

    def __str__(self) -> str:
        grid = self.grid
        more_cols = ["..."] if self.shown_cols < self.ncols else []
        more_rows = self.shown_rows < self.nrows
        headers = self._col_coords()
        labels = ["", *(name for name, _ in headers), *(self._row_label(r) for r in range(self.shown_rows))]
        labels += ["..."] if more_rows else []

        def block(title: str, cells: list[list[str]], pad: str = "") -> list[str]:
            rows = [[*(f"{c}{pad}" for c in coords), *more_cols] for _, coords in headers]
            rows += [[*row, *more_cols] for row in cells]
            table = format_table(None, rows, align="r" * (len(rows[0]) if rows else 0), sep=" ").split("\n")
            return [title, *table, *([""] if more_rows else [])]

        blocks = [block("rank", [[self._marked(r) for r in row] for row in grid], pad=self._pad)]
        for axis in self.axes:
            blocks.append(block(self._caption(axis), [[str(g) for g in row] for row in self.group_ids(axis)]))
        lines = [*self._notes(), "", *_side_by_side(labels, blocks, self.width)]
        what = "groups of every axis" if len(self.listed) > 1 else f"groups of {self.listed[0]}"
        lines.append(f"{what} (number=[ranks in group order]; a-b = a run of ranks):")
        lines.append(format_table(["axis", "groups", "size", "groups"], self._group_rows(), align="lrr"))
        return "\n".join(lines).rstrip()

    __repr__ = __str__

    # ---- HTML ---------------------------------------------------------------------------------------
    def _td(self, rank: int, axis: str | None, group: int | None) -> str:
        title = self._title(rank) + (f", {axis} group {group}" if axis else "")
        me = ' class="me"' if rank == self.highlight else ""
        style = f' style="{_cell_style(group)}"' if axis and group is not None else ""
        text = f"{rank}*" if rank == self.highlight else str(rank)
        return f'<td{me}{style} title="{html.escape(title)}">{text}</td>'

    def _repr_html_(self) -> str:
        grid = self.grid
        more_cols = self.shown_cols < self.ncols
        cut_td = '<td class="cut">…</td>' if more_cols else ""
        header = "".join(
            f"<tr><th>{html.escape(name)}</th>"
            + "".join(f"<th>{c}</th>" for c in coords)
            + ('<th class="cut">…</th>' if more_cols else "")
            + "</tr>"
            for name, coords in self._col_coords()
        )
        tables = []
        for axis in self.axes or (None,):
            ids: Sequence[Sequence[int | None]] = self.group_ids(axis) if axis else [[None] * len(grid[0])] * len(grid)
            rows = [
                f"<tr><th>{html.escape(self._row_label(r))}</th>"
                + "".join(self._td(rank, axis, g) for rank, g in zip(row, row_ids))
                + cut_td
                + "</tr>"
                for r, (row, row_ids) in enumerate(zip(grid, ids))
            ]
            if self.shown_rows < self.nrows:
                rows.append(
                    f'<tr><th class="cut">…</th><td class="cut" colspan="{len(grid[0]) + more_cols}">'
                    f"{self.nrows - self.shown_rows} more rows</td></tr>"
                )
            caption = html.escape(self._caption(axis) if axis else "ranks")
            tables.append(f"<table><caption>{caption}</caption>{header}{''.join(rows)}</table>")
        groups = _html_table(
            ["axis", "groups", "size", "groups (number=[ranks in group order])"], self._group_rows(), align="lrrl"
        )
        return (
            f'{_STYLE}<div class="wf-mesh-view">{_html_notes(self._notes())}'
            f'<div style="display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start">{"".join(tables)}</div>'
            f"{groups}</div>"
        )


def show_topology(dims_or_mesh: Any, axis: str | None = None, **options: Any) -> TopologyView:
    """``TopologyView(dims_or_mesh, axis, **options)``: the last expression of a notebook cell renders as HTML."""
    return TopologyView(dims_or_mesh, axis, **options)


# ---- placements -------------------------------------------------------------------------------------
class PlacementSpec(NamedTuple):
    """A placement as the views read it (no torch): ``kind`` is ``"S"`` (Shard ``dim``), ``"R"`` (Replicate)
    or ``"P"`` (Partial with ``reduce_op``). Prints as DTensor's short form: ``S(2)``, ``R``, ``P(sum)``."""

    kind: str
    dim: int = 0
    reduce_op: str = ""

    def __str__(self) -> str:
        return {"S": f"S({self.dim})", "R": "R", "P": f"P({self.reduce_op})"}[self.kind]


_PLACEMENT_HELP = "use Shard/Replicate/Partial or 'S(dim)', 'R', 'P', 'P(avg)'"


def _spec(placement: Any) -> PlacementSpec:
    """A PlacementSpec of a torch Shard / Replicate / Partial or of a short form; ValueError otherwise."""
    if isinstance(placement, PlacementSpec):
        return placement
    if isinstance(placement, str):
        m = re.fullmatch(
            r"(S|Shard|R|Replicate|P|Partial)(?:\((?:dim=|reduce_op=)?([^)]*)\))?", placement.replace(" ", "")
        )
        kind, arg = (m[1][0], m[2] or "") if m else ("", "")
        if kind == "S" and re.fullmatch(r"-?\d+", arg):
            return PlacementSpec("S", int(arg))
        if kind == "R" and not arg:
            return PlacementSpec("R")
        if kind == "P":
            return PlacementSpec("P", 0, arg.strip("'\"") or "sum")
    elif callable(getattr(placement, "is_shard", None)):  # a torch Placement (duck-typed: no torch import)
        if placement.is_shard() and type(placement).__name__ == "Shard":  # not _StridedShard: another layout
            return PlacementSpec("S", int(placement.dim))
        if placement.is_replicate():
            return PlacementSpec("R")
        if placement.is_partial():
            return PlacementSpec("P", 0, str(placement.reduce_op))
    raise ValueError(f"unsupported placement {placement!r}: {_PLACEMENT_HELP}")


def parse_placement(placement: Any) -> Any:
    """A torch Shard / Replicate / Partial placement from itself or a short form: ``"S(2)"`` (``"Shard(2)"``),
    ``"R"``, ``"P"`` (sum) or ``"P(avg)"``. Imports torch.

    Returns:
        The placement.

    Raises:
        ValueError: anything else (e.g. ``_StridedShard``).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    spec = _spec(placement)
    if not isinstance(placement, (str, PlacementSpec)):
        return placement  # a torch placement _spec accepts: itself
    if spec.kind == "S":
        return Shard(spec.dim)
    return Replicate() if spec.kind == "R" else Partial(spec.reduce_op)


class RankSlice(NamedTuple):
    """What one rank holds: mesh coordinates, slice number (same number = same elements) and per-dim ranges."""

    rank: int
    coords: tuple[int, ...]
    slice: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's shard."""
        return tuple(stop - start for start, stop in self.ranges)


class PlacementView:
    """Which rank holds which slice of a tensor: a DTensor (``PlacementView(dtensor)``; its mesh, placements
    and global shape) or a plan (:meth:`plan`, no processes, no torch).

    One row per rank in mesh order: the rank (``*`` marks the highlighted one: by default this process's rank),
    its mesh coordinates, a slice number (ranks with the same number hold the same elements: replicas or
    partial terms), per tensor dim ``start:stop`` or ``:`` for the full dim, and the local shape. Placements
    apply left to right over the mesh axes: ``S(d)`` (Shard) splits the current range of dim ``d`` in
    ``torch.chunk`` sizing (DTensor's rule; trailing ranks may get ``n:n``, empty), ``R`` (Replicate) keeps it,
    ``P`` (Partial) keeps it and each rank holds a term of a sum. Text via ``str``, HTML (one colour per slice)
    via ``_repr_html_``. Rows past ``max_rows`` are cut, with a line saying how many.
    """

    def __init__(
        self, dtensor: Any, *, dim_names: Sequence[str] | None = None, highlight: int | None = None, max_rows: int = 32
    ) -> None:
        is_dtensor = False
        if "torch" in sys.modules:  # a DTensor exists only once torch is imported
            from torch.distributed.tensor import DTensor

            is_dtensor = isinstance(dtensor, DTensor)
        if not is_dtensor:
            raise TypeError(f"PlacementView needs a DTensor, got {type(dtensor).__name__}; use PlacementView.plan(...)")
        import torch.distributed as dist

        mesh = dtensor.device_mesh
        if highlight is None and dist.is_initialized():
            highlight = dist.get_rank()
        ranks = mesh.mesh.flatten().tolist()
        self._setup(
            dtensor.shape,
            tuple(mesh.mesh.shape),
            ranks,
            mesh.mesh_dim_names,
            dtensor.placements,
            dim_names,
            highlight,
            max_rows,
        )

    @classmethod
    def plan(
        cls,
        shape: Sequence[int],
        mesh_shape: int | Sequence[int],
        placements: Sequence[Any],
        *,
        mesh_dim_names: Sequence[str] | None = None,
        ranks: Any = None,
        dim_names: Sequence[str] | None = None,
        highlight: int | None = None,
        max_rows: int = 32,
    ) -> PlacementView:
        """The view of a tensor of ``shape`` placed on a mesh of ``mesh_shape`` (global ranks ``ranks``: nested
        lists or a tensor of that shape, default ``0..N-1`` row-major) with one placement per mesh axis (torch
        placements or the short forms ``"S(d)"``, ``"R"``, ``"P"``). Pure.

        Returns:
            The view.

        Raises:
            ValueError: placements, mesh shape and ranks that do not fit each other or the tensor.
        """
        mesh_shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(int(s) for s in mesh_shape)
        flat = None
        if ranks is not None:
            nested = ranks.tolist() if hasattr(ranks, "tolist") else ranks
            got, flat = _shape_of(nested), []
            if got != mesh_shape:
                raise ValueError(f"ranks have shape {got}, but mesh_shape is {mesh_shape}")
            flat = list(_flatten(nested))
        view = cls.__new__(cls)
        view._setup(shape, mesh_shape, flat, mesh_dim_names, placements, dim_names, highlight, max_rows)
        return view

    def _setup(self, shape, mesh_shape, ranks, mesh_dim_names, placements, dim_names, highlight, max_rows) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.mesh_shape = tuple(mesh_shape)
        self.num_ranks = math.prod(self.mesh_shape)
        self._ranks = ranks  # None: 0..N-1
        self.mesh_dim_names = tuple(mesh_dim_names or (f"axis{i}" for i in range(len(self.mesh_shape))))
        self.dim_names = tuple(dim_names or (f"d{i}" for i in range(len(self.shape))))
        self.highlight, self.max_rows = highlight, max_rows
        parsed = [_spec(p) for p in placements]
        mesh, tensor = (len(self.mesh_shape), f"mesh {self.mesh_shape}"), (len(self.shape), f"tensor {self.shape}")
        for what, names, (n, of) in [
            ("mesh_dim_names", self.mesh_dim_names, mesh),
            ("placements", parsed, mesh),
            ("dim_names", self.dim_names, tensor),
        ]:
            if len(names) != n:
                raise ValueError(f"{what} ({', '.join(map(str, names))}): {len(names)} given for a {n}-D {of}")
        for i, p in enumerate(parsed):
            if p.kind == "S":
                if not -len(self.shape) <= p.dim < len(self.shape):
                    raise ValueError(f"{p} on mesh axis {self.mesh_dim_names[i]}: no dim {p.dim} in {self.shape}")
                parsed[i] = PlacementSpec("S", p.dim % len(self.shape))
        self.placements: tuple[PlacementSpec, ...] = tuple(parsed)

    def rank_at(self, index: int) -> int:
        """Global rank of the ``index``-th mesh position (mesh order: last axis fastest)."""
        return index if self._ranks is None else self._ranks[index]

    def rows(self) -> list[RankSlice]:
        """What each shown rank holds (the first ``max_rows`` in mesh order)."""
        shard_axes = [i for i, p in enumerate(self.placements) if p.kind == "S"]
        out = []
        positions = itertools.product(*map(range, self.mesh_shape))  # mesh order: last axis fastest
        for index, coords in enumerate(itertools.islice(positions, self.max_rows)):
            ranges = [(0, n) for n in self.shape]
            for size, p, c in zip(self.mesh_shape, self.placements, coords):
                if p.kind == "S":  # torch.chunk sizing of the current range
                    start, stop = ranges[p.dim]
                    a, b = chunk_range(stop - start, size, c)
                    ranges[p.dim] = (start + a, start + b)
            number = 0
            for i in shard_axes:
                number = number * self.mesh_shape[i] + coords[i]
            out.append(RankSlice(self.rank_at(index), tuple(coords), number, tuple(ranges)))
        return out

    def _notes(self) -> list[str]:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        n_slices = math.prod(s for s, p in zip(self.mesh_shape, self.placements) if p.kind == "S")
        lines = [
            f"shape {self.shape} on mesh {mesh}, placements ({', '.join(map(str, self.placements))})",
            (
                f"{plural(self.num_ranks, 'rank')}, {plural(n_slices, 'distinct slice')} "
                "(same slice = same index ranges)"
            ),
        ]
        for name, p in zip(self.mesh_dim_names, self.placements):
            if p.kind == "P":
                lines.append(f"partial over {name}: each rank holds a term; the value is their {p.reduce_op}")
        if self.highlight is not None:
            lines.append(f"* = rank {self.highlight}")
        return lines

    def _cut_note(self, shown: int) -> list[str]:
        if shown >= self.num_ranks:
            return []
        return [
            (
                f"... {plural(self.num_ranks - shown, 'more rank')} not shown ({shown} of {self.num_ranks}; "
                f"max_rows={self.max_rows})"
            )
        ]

    def _table(self, rows: list[RankSlice]) -> tuple[list[str], list[list[str]]]:
        head = ["rank", *self.mesh_dim_names, "slice", *self.dim_names, "local shape"]
        body = []
        for r in rows:
            spans = [":" if (a, b) == (0, n) else f"{a}:{b}" for (a, b), n in zip(r.ranges, self.shape)]
            rank = f"{r.rank}*" if r.rank == self.highlight else f"{r.rank}{'' if self.highlight is None else ' '}"
            body.append([rank, *map(str, r.coords), str(r.slice), *spans, str(r.local_shape)])
        return head, body

    def __str__(self) -> str:
        rows = self.rows()
        head, body = self._table(rows)
        table = format_table(head, body, align="r" * len(head))
        return "\n".join([*self._notes(), "", table, *self._cut_note(len(rows))])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = self.rows()
        head, body = self._table(rows)
        out = [_html_rows([head], "th")]
        for r, cells in zip(rows, body):
            me = ' class="me"' if r.rank == self.highlight else ""
            tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            out.append(f'<tr{me} style="{_cell_style(r.slice)}" title="slice {r.slice}">{tds}</tr>')
        cut = self._cut_note(len(rows))
        if cut:
            out.append(
                f'<tr><td class="cut" colspan="{len(head)}" style="text-align:left">{html.escape(cut[0])}</td></tr>'
            )
        return f'{_STYLE}<div class="wf-mesh-view">{_html_notes(self._notes())}<table>{"".join(out)}</table></div>'


def _shape_of(nested: Any) -> tuple[int, ...]:
    shape = []
    while isinstance(nested, (list, tuple)):
        shape.append(len(nested))
        nested = nested[0] if nested else None
    return tuple(shape)


def _flatten(nested: Any) -> Iterator[int]:
    if isinstance(nested, (list, tuple)):
        for item in nested:
            yield from _flatten(item)
    else:
        yield int(nested)
