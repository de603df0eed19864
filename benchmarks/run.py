"""Run the benchmark scripts of this folder and print their ratio rows as one table.

    python benchmarks/run.py [--quick] [--only topology,state] [--json PATH]

Runs every ``benchmarks/<name>.py`` (the known ones first: topology, context_parallel, state, pipeline,
cp_attention, cp_attention_masks, kv_cache; then any other script not starting with ``_``), each as
``<name>.py --json <tmp> [--quick]`` in a process tree of its own, and reads the ratio rows each script writes in the one schema of ``_report.py``
(``{benchmark, measurement, ratio, low, high, target, meets}``: the median of per-trial ratios, their spread,
the docs/design.md section 10 target and whether the median meets it; ``--quick`` runs are "not judged"). A script's
own output goes to a log, shown (its end) only when the script fails. ``--json PATH`` writes
``{"quick", "rows", "failed", "results": {name: the script's whole JSON}}``.

Exit code: 0, or 1 if a script failed (or wrote rows outside the schema), 2 for bad arguments; Ctrl-C /
SIGTERM stop the running script's whole process tree (its local clusters included), print one line and exit
with 130 / 143.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `import _report` also when run.py is imported rather than run
    sys.path.insert(0, str(HERE))

from wf_mesh.process_tree import Interrupted, ProcessTree, interruptible  # noqa: E402

from _report import format_rows, read_rows  # noqa: E402 (needs the sys.path line above)

KNOWN = ("topology", "context_parallel", "state", "pipeline", "cp_attention", "cp_attention_masks", "kv_cache")
"""Benchmarks in the order they run; other scripts of the folder follow, by name."""

TAIL = 20
"""Lines of a failed script's output shown."""


def available(folder: Path = HERE) -> list[str]:
    """The benchmark scripts in ``folder``: every ``*.py`` except ``run.py``, ``gpu_check.py`` (a GPU check
    with a table of its own, not ratio rows) and names starting with ``_``."""
    names = [p.stem for p in folder.glob("*.py") if not p.stem.startswith("_") and p.stem not in ("run", "gpu_check")]
    return sorted(names, key=lambda n: (KNOWN.index(n) if n in KNOWN else len(KNOWN), n))


def _parser(names: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script (smoke run: not judged)")
    parser.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and every script's JSON to PATH")
    return parser


def selected(only: str | None, names: list[str]) -> list[str]:
    """The benchmarks ``--only`` asks for, in run order; ValueError naming unknown ones."""
    if only is None:
        return names
    wanted = [n.strip().replace("-", "_").removesuffix(".py") for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted:
        raise ValueError(f"--only {only!r}: unknown benchmark(s) {unknown}; choose from {names}")
    return [n for n in names if n in wanted]


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").rstrip().splitlines()
    return "\n".join(f"  | {line}" for line in lines[-TAIL:])


def run_one(name: str, folder: Path, tmp: Path, quick: bool) -> tuple[int, Path, Path]:
    """Run one script in its own process tree; (exit code, its JSON path, its log path)."""
    out, log_path = tmp / f"{name}.json", tmp / f"{name}.log"
    cmd = [sys.executable, str(folder / f"{name}.py"), "--json", str(out), *(["--quick"] if quick else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        tree = ProcessTree(cmd, env=env, log=log)
        try:
            code = tree.wait()
        except Interrupted:
            tree.stop()
            raise
    return code, out, log_path


def main(argv: Sequence[str] | None = None, folder: Path = HERE) -> int:
    names = available(folder)
    parser = _parser(names)
    args = parser.parse_args(argv)
    try:
        chosen = selected(args.only, names)
    except ValueError as e:
        print(f"benchmarks/run.py: error: {e}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    results: dict[str, dict] = {}
    failed: dict[str, str] = {}
    try:
        with interruptible(), tempfile.TemporaryDirectory(prefix="wf-mesh-bench-") as tmp:
            for i, name in enumerate(chosen, 1):
                print(f"[{i}/{len(chosen)}] {name}{' --quick' if args.quick else ''} ...", end=" ", flush=True)
                start = time.perf_counter()
                code, out, log = run_one(name, folder, Path(tmp), args.quick)
                if code != 0:
                    failed[name] = f"exited with code {code}; the end of its output:\n{_tail(log)}"
                else:
                    try:
                        script_rows, results[name] = read_rows(str(out), name)
                        rows += script_rows
                    except (OSError, ValueError) as e:
                        failed[name] = f"{type(e).__name__}: {e}"
                status = "FAILED" if name in failed else f"done, {len(results[name]['rows'])} rows"
                print(f"{status} in {time.perf_counter() - start:.1f} s", flush=True)
    except Interrupted as e:
        print(f"\nbenchmarks/run.py: interrupted by {e}; stopped the running benchmark", file=sys.stderr)
        return e.exit_code
    if rows:
        print()
        print(format_rows(rows))
        note = "; --quick: small sizes, few trials: targets not judged" if args.quick else ""
        print(
            f"ratio = median over the trials of (first named / second named), measured side by side; low-high = "
            f"its spread over the trials; meets: the median against the docs/design.md section 10 target{note}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "rows": rows, "failed": failed, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    for name, error in failed.items():
        print(f"benchmarks/run.py: {name} failed: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
