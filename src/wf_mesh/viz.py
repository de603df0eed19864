"""Text views of a parallel topology (no processes needed).

:func:`format_plan` renders a resolved :class:`~wf_mesh.topology.ParallelDims` the way ``wf-mesh plan``
prints it: a header with the degrees, order and rank formula; the rank grid, one cp x tp table of global
ranks per (dp, pp) pair; and the rank groups of every base and derived axis. Large worlds are truncated
with a note, so the output stays a screenful at any size::

    >>> print(format_plan(ParallelDims(tp=2, cp=2, pp=2).resolve(16)))   # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from wf_mesh.topology import AXES, DERIVED_AXES, ParallelDims, parse_axes

__all__ = ["PLAN_AXES", "format_plan", "format_ranks"]

PLAN_AXES: tuple[str, ...] = (*AXES, *DERIVED_AXES)
"""Axes whose groups :func:`format_plan` lists: the four base axes, then the derived ones."""

_AXIS_NOTES = {"dp_cp": "FSDP", "tp_pp": "model parallel"}


def format_ranks(ranks: Sequence[int], *, max_ranks: int = 16) -> str:
    """Compact rank list: runs of 3+ consecutive ranks as ``a-b``, e.g. ``[0-3,8,9]``.

    More than ``max_ranks`` ranks keeps the first ``max_ranks - 1`` and the last, with ``...`` between.
    """
    ranks = list(ranks)
    tail: list[int] = []
    if len(ranks) > max_ranks:
        ranks, tail = ranks[: max_ranks - 1], ranks[-1:]
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(ranks), key=lambda item: item[1] - item[0]):
        values = [r for _, r in run]
        parts += [f"{values[0]}-{values[-1]}"] if len(values) >= 3 else [str(v) for v in values]
    if tail:
        parts += ["...", str(tail[0])]
    return "[" + ",".join(parts) + "]"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
    blocks = [_block(dims, dp, pp, max_side) for dp, pp in shown]
    out = [f"rank grid: one cp x tp table per (dp, pp) pair ({_plural(n_pairs, 'pair')})"]
    row: list[list[str]] = []

    def flush() -> None:
        height = max(len(b) for b in row)
        for i in range(height):
            out.append(("  " + "   ".join(b[i] if i < len(b) else " " * len(b[0]) for b in row)).rstrip())
        out.append("")

    for block in blocks:
        if row and 2 + sum(len(b[0]) + 3 for b in row) + len(block[0]) > width:
            flush()
            row = []
        row.append(block)
    flush()
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
