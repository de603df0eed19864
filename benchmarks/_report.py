"""The ONE schema of benchmark results, shared by every script in ``benchmarks/`` and by ``run.py``.

Each script measures paths side by side and reduces them to ratio rows::

    {"benchmark": "state", "measurement": "EMA update / copy_ of the same bytes",
     "ratio": 0.97, "low": 0.93, "high": 1.02, "target": "<= 1.10", "meets": "yes"}

- ``ratio``: the median over the trials of the per-trial ratio (first named / second named, both measured in the
  same trial, so machine noise hits them alike); ``low`` / ``high``: the smallest and largest per-trial ratio
  (the spread; equal to ``ratio`` for counts such as bytes or collectives).
- ``target``: the docs/design.md section 10 target as text (``""``: reported only, no target).
- ``meets``: the target judged on the median: ``"yes"`` or ``"NO"``; ``"not judged"`` in ``--quick`` runs (small
  sizes and few trials cannot judge a target); ``""`` without a target.

A script parses :func:`benchmark_parser`'s arguments, and :func:`report` prints :func:`format_rows` of its rows
and writes ``{"benchmark", "quick", "rows", "results"}`` with :func:`write_json` (``results``: its raw
numbers); ``run.py`` reads every script's rows with :func:`read_rows` and prints them as one table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from wf_mesh.viz import format_table

__all__ = [
    "NOT_JUDGED",
    "ROW_KEYS",
    "Target",
    "above",
    "at_most",
    "below",
    "benchmark_parser",
    "equals",
    "format_rows",
    "per_trial",
    "ratio_row",
    "read_rows",
    "report",
    "write_json",
]

ROW_KEYS = ("benchmark", "measurement", "ratio", "low", "high", "target", "meets")
"""The keys of a ratio row, in table order."""

MEETS = ("yes", "NO", "not judged", "")
NOT_JUDGED = "not judged"

Row = dict[str, Any]


class Target(NamedTuple):
    """A target on a ratio: its text and the test the median must pass."""

    text: str
    ok: Callable[[float], bool]


def benchmark_parser(doc: str, quick: str = "small sizes and few iterations (smoke test)") -> argparse.ArgumentParser:
    """The arguments every script takes, ``--quick`` (a smoke run: ``quick`` says what it shrinks) and
    ``--json PATH``; a script adds its own before ``parse_args()``.

    Args:
        doc: the script's module docstring (its first line describes the script).
        quick: the help text of ``--quick``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", metavar="PATH", help="also write the ratio rows and results as JSON to PATH")
    return parser


def at_most(limit: float) -> Target:
    return Target(f"<= {limit:.2f}", lambda r: r <= limit)


def below(limit: float, text: str | None = None) -> Target:
    return Target(text or f"< {limit:g}", lambda r: r < limit)


def above(limit: float, text: str | None = None) -> Target:
    return Target(text or f"> {limit:g}", lambda r: r > limit)


def equals(value: float, text: str) -> Target:
    return Target(text, lambda r: math.isclose(r, value, rel_tol=1e-9))


def per_trial(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Trial-by-trial ratios of two paths measured in the same trials."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"per-trial ratios need as many trials on both sides, got {len(numerator)} and {len(denominator)}"
        )
    return [a / b for a, b in zip(numerator, denominator)]


def ratio_row(
    benchmark: str, measurement: str, ratios: float | Sequence[float], target: Target | None = None, *, quick: bool
) -> Row:
    """One row: ``ratios`` is one ratio per trial (or a single value, e.g. a count), judged on the median."""
    values = [float(ratios)] if isinstance(ratios, (int, float)) else [float(r) for r in ratios]
    if not values:
        raise ValueError(f"{benchmark}: {measurement}: no trials")
    median = statistics.median(values)
    if target is None:
        meets = ""
    elif quick:
        meets = NOT_JUDGED
    else:
        meets = "yes" if target.ok(median) else "NO"
    return {
        "benchmark": benchmark,
        "measurement": measurement,
        "ratio": median,
        "low": min(values),
        "high": max(values),
        "target": target.text if target else "",
        "meets": meets,
    }


def check_row(row: Any, where: str = "row") -> Row:
    """``row`` if it follows the schema; ValueError naming what is wrong otherwise."""
    if not isinstance(row, dict) or tuple(row) != ROW_KEYS:
        keys = list(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: expected the keys {list(ROW_KEYS)}, got {keys}")
    for key in ("ratio", "low", "high"):
        if not isinstance(row[key], (int, float)):
            raise ValueError(f"{where}: {key} must be a number, got {row[key]!r}")
    if row["meets"] not in MEETS:
        raise ValueError(f"{where}: meets must be one of {list(MEETS)}, got {row['meets']!r}")
    return row


def write_json(path: str, benchmark: str, quick: bool, rows: list[Row], results: dict) -> None:
    """Write a script's ``--json`` file: its rows (checked against the schema) and its raw results."""
    for i, row in enumerate(rows):
        check_row(row, f"{benchmark} row {i}")
    with open(path, "w") as f:
        json.dump({"benchmark": benchmark, "quick": quick, "rows": rows, "results": results}, f, indent=2, default=str)


def report(benchmark: str, args: argparse.Namespace, rows: list[Row], results: dict) -> None:
    """Print a script's rows as a table and, with ``--json PATH``, write them and its results there."""
    print(format_rows(rows))
    if args.json:
        write_json(args.json, benchmark, args.quick, rows, results)


def read_rows(path: str, benchmark: str) -> tuple[list[Row], dict]:
    """The rows and the whole JSON a script wrote; ValueError if it does not follow the schema."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{benchmark}: its --json output has no 'rows' list (the schema of benchmarks/_report.py)")
    rows = [check_row(row, f"{benchmark} row {i}") for i, row in enumerate(data["rows"])]
    if any(row["benchmark"] != benchmark for row in rows):
        raise ValueError(f"{benchmark}: rows name another benchmark: {sorted({r['benchmark'] for r in rows})}")
    return rows, data


def _number(x: float) -> str:
    if x == 0 or 0.1 <= abs(x) < 1000:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_rows(rows: Iterable[Row]) -> str:
    """The rows as one text table: ratio (median), its spread over the trials, target, meets."""
    body = []
    for r in rows:
        spread = "" if r["low"] == r["high"] else f"{_number(r['low'])}-{_number(r['high'])}"
        body.append([r["benchmark"], r["measurement"], _number(r["ratio"]), spread, r["target"], r["meets"]])
    return format_table(
        ["benchmark", "measurement", "ratio", "low-high", "target", "meets"], body, align="llrr", rule=True
    )
