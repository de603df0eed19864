"""``wf-mesh bench``: run the benchmark scripts of a checkout and reduce their JSON to one table of ratios.

The scripts live in ``benchmarks/`` of the source checkout (they are not part of the installed package):
``topology.py``, ``context_parallel.py``, ``state.py`` and ``pipeline.py``, each taking ``--quick`` and
``--json PATH``. :func:`run_benchmark` runs one in a subprocess and returns its JSON; :func:`ratio_rows` turns
that JSON into rows ``{benchmark, measurement, ratio, target, meets}``, with the targets of DESIGN.md §7 where
there is one (``meets`` is None where there is none); :func:`format_table` renders the rows. Ratios are
"first named / second named", measured side by side in one run; timings are never asserted anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BENCHMARKS",
    "TABLE_HEADER",
    "benchmarks_dir",
    "format_table",
    "ratio_rows",
    "run_benchmark",
]

BENCHMARKS: tuple[str, ...] = ("topology", "context_parallel", "state", "pipeline")
"""Benchmark names, in the order ``wf-mesh bench`` runs them (``benchmarks/<name>.py``)."""

TABLE_HEADER: tuple[str, ...] = ("benchmark", "measurement", "ratio", "target", "meets")

Row = dict[str, Any]


def benchmarks_dir(path: str | Path | None = None, names: Sequence[str] = BENCHMARKS) -> Path:
    """The folder holding the benchmark scripts: ``path``, or ``benchmarks/`` of the checkout this package was
    imported from. FileNotFoundError, naming where it looked, if a script of ``names`` is missing."""
    folder = Path(path) if path is not None else Path(__file__).resolve().parents[2] / "benchmarks"
    missing = [f"{name}.py" for name in names if not (folder / f"{name}.py").is_file()]
    if missing:
        where = "" if path is not None else " (wf_mesh is imported from outside a source checkout)"
        raise FileNotFoundError(
            f"benchmark scripts {missing} not found in {folder}{where}; the scripts ship with the source checkout, "
            "not the installed package: run `pip install -e .` from a checkout, or pass --dir <checkout>/benchmarks"
        )
    return folder


def run_benchmark(script: Path, json_path: Path, *, quick: bool = False, timeout: float | None = None) -> dict:
    """Run ``python script --json json_path [--quick]``; return the JSON it wrote.

    RuntimeError with the exit code and the end of the script's output if it fails.
    """
    cmd = [sys.executable, str(script), "--json", str(json_path), *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not json_path.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{script.name} exited with code {proc.returncode} (command: {' '.join(cmd)}):\n{tail}")
    return json.loads(json_path.read_text())


Ratio = tuple[str, float, str, bool | None]  # (measurement, ratio, target, meets)


def _report(measurement: str, ratio: float) -> Ratio:
    """A ratio DESIGN.md §7 sets no target for (reported only)."""
    return measurement, ratio, "", None


def _at_most(measurement: str, ratio: float, limit: float) -> Ratio:
    return measurement, ratio, f"<= {limit:.2f}", ratio <= limit


def _topology(r: dict) -> list[Ratio]:
    planning = r["planning"]
    seconds = planning["total_ms"] / 1e3
    rows = [(f"planning {planning['world_size']:,} ranks (groups of 9 axes) / 1 s", seconds, "< 1 (well under)",
             seconds < 1)]  # fmt: skip
    for b in r["mesh_build"]:
        rows.append(_report(f"mesh build, {b['world_size']} ranks: megatron new_group loop / wf_mesh", b["ratio"]))
    return rows


def _context_parallel(r: dict) -> list[Ratio]:
    rows = []
    for cp, g in r["gather"].items():
        rows.append(_at_most(f"gather cp {cp}: wf_mesh DTensor / raw all-gather", g["wf_mesh"] / g["raw"], 1.10))
        rows.append(_report(f"gather cp {cp}: legacy cat_outputs_cp / raw", g["legacy"] / g["raw"]))
        if "raw_reused" in g:
            rows.append(_report(f"gather cp {cp}: wf_mesh / raw reusing its gather buffer", g["wf_mesh"] / g["raw_reused"]))
    for cp, s in r["small"].items():
        overhead = (s["wf_mesh"] - s["raw"]) * 1e6
        rows.append(_report(f"small gather cp {cp}: wf_mesh / raw ({overhead:+.0f} us/call)", s["wf_mesh"] / s["raw"]))
    for cp, b in r["broadcast_split"].items():
        share = b["bytes_per_receiver"] / b["broadcast_bytes_per_receiver"]
        rows.append((f"broadcast_split cp {cp}: bytes per receiver / broadcast", share, f"= 1/{cp}",
                     abs(share - 1 / int(cp)) < 1e-9))  # fmt: skip
        time_ratio = b["broadcast_split_tensor"] / b["broadcast_then_split"]
        rows.append(_report(f"broadcast_split cp {cp}: time scatter / broadcast-then-split", time_ratio))
    return rows


def _state(r: dict) -> list[Ratio]:
    big, small = r["ema_large"], r["ema_small"]
    copy_ = big["copy_ (foreach)"]
    rows = [
        _at_most("EMA update / copy_ of the same bytes", big["ShardedEMA.update"] / copy_, 1.10),
        _report("bare _foreach_lerp_ / copy_ (the floor)", big["bare _foreach_lerp_"] / copy_),
        _report("EMA update, bf16 model / copy_", big["ShardedEMA.update (bf16 model)"] / copy_),
        _report("many small tensors: lerp_ loop / EMA update", small["lerp_ loop"] / small["ShardedEMA.update"]),
    ]
    for world, b in r["broadcast"].items():
        expected = b["buckets"] + 1  # one broadcast per bucket + the layout check
        rows.append((f"state broadcast w{world}: collectives / (buckets + 1 check), {b['tensors']} tensors",
                     b["collectives_bucketed"] / expected, "≈ 1 (collectives ≈ buckets)",
                     b["collectives_bucketed"] <= expected))  # fmt: skip
        speedup = b["per_tensor"] / b["bucketed"]
        rows.append((f"state broadcast w{world}: time per-tensor / bucketed", speedup, "> 1 (well ahead)", speedup > 1))
    return rows


def _pipeline(r: dict) -> list[Ratio]:
    med, raw = r["seconds_per_round_trip"], r["raw"]
    rows = []
    for label, name in (
        ("PPScheduler", "PPScheduler isend_next/recv_prev_data"),
        ("PipelineP2P", "PipelineP2P send/recv"),
        ("PipelineP2P checked", "PipelineP2P(checked=True) send/recv"),
    ):
        for size, what in (("small", f"{r['small_bytes']} B"), ("big", f"{r['big_bytes'] // 2**20} MiB")):
            rows.append(_report(f"{label} / raw isend+irecv, {what} round trip", med[size][name] / med[size][raw]))
    return rows


_EXTRACTORS: dict[str, Callable[[dict], list[Ratio]]] = {
    "topology": _topology,
    "context_parallel": _context_parallel,
    "state": _state,
    "pipeline": _pipeline,
}


def ratio_rows(benchmark: str, result: dict) -> list[Row]:
    """The table rows of one benchmark's JSON result (KeyError names a benchmark without an extractor)."""
    if benchmark not in _EXTRACTORS:
        raise KeyError(f"no ratio table for benchmark {benchmark!r}; known: {list(_EXTRACTORS)}")
    return [
        {"benchmark": benchmark, "measurement": m, "ratio": ratio, "target": target, "meets": meets}
        for m, ratio, target, meets in _EXTRACTORS[benchmark](result)
    ]


def _cells(row: Row) -> list[str]:
    ratio = f"{row['ratio']:.3f}" if row["ratio"] < 0.1 else f"{row['ratio']:.2f}"
    meets = {True: "yes", False: "NO", None: ""}[row["meets"]]
    return [row["benchmark"], row["measurement"], ratio, row["target"], meets]


def format_table(rows: Iterable[Row]) -> str:
    """Fixed-width text table with :data:`TABLE_HEADER` columns (ratios right-aligned)."""
    table = [list(TABLE_HEADER), *(_cells(r) for r in rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(TABLE_HEADER))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return "\n".join([line(table[0]), line(["-" * w for w in widths]), *(line(c) for c in table[1:])])
