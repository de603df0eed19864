"""Re-execute ``placements.ipynb`` and write its outputs back into it (they are committed), or check them.

    .venv/bin/python notebooks/refresh.py            # execute, write the fresh outputs into the notebook
    .venv/bin/python notebooks/refresh.py --check    # execute, exit 1 (naming the cells) if the committed
                                                     # outputs are stale; the notebook file is not touched

``tests/test_notebook.py`` runs the same comparison (:func:`stale_cells`): outputs are compared after masking
what changes from run to run (timings, memory addresses, PIDs, ports), and stderr output counts as an error.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().with_name("placements.ipynb")
TIMEOUT = 120  # seconds per cell

_MASKS = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x..."),  # memory addresses
    (re.compile(r"\b\d+(?:\.\d+)?(?:e[-+]?\d+)? ?(?:s|ms|us|µs|ns)\b"), "<time>"),  # timings
    (re.compile(r"\b(pid|PID|process) \d+"), r"\1 <pid>"),
    (re.compile(r"(127\.0\.0\.1|localhost|0\.0\.0\.0):\d+"), r"\1:<port>"),
    (re.compile(r"\bport \d+"), "port <port>"),
]


def mask(text: str) -> str:
    """``text`` with what changes between runs replaced by placeholders."""
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text


def execute(path: Path = NOTEBOOK) -> nbformat.NotebookNode:
    """The notebook at ``path``, executed top to bottom in its own folder (raises on the first failing cell)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=TIMEOUT,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def outputs(nb: nbformat.NotebookNode) -> list[list[str]]:
    """Per code cell, its outputs as masked text (text/plain and text/html of rich outputs, stream text; the
    consecutive chunks of one stream joined, since how a kernel chunks stdout depends on timing)."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        shown = []
        last_was_stream = False
        for out in cell.get("outputs", []):
            if out.output_type == "stream":  # one print may arrive in several chunks: join a stream's run
                head = f"[{out.name}]\n"
                if shown and shown[-1].startswith(head) and last_was_stream:
                    shown[-1] += out.text
                else:
                    shown.append(head + out.text)
            elif out.output_type in ("execute_result", "display_data"):
                for mime in ("text/plain", "text/html"):
                    if mime in out.get("data", {}):
                        shown.append(f"[{mime}]\n{out.data[mime]}")
            else:  # error
                shown.append(f"[{out.output_type}] {out.get('ename')}: {out.get('evalue')}")
            last_was_stream = out.output_type == "stream"
        cells.append([mask(s) for s in shown])
    return cells


def stderr_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indexes (among code cells) of cells that printed to stderr: warnings are noise in a committed notebook."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    return [i for i, c in enumerate(code) if any(o.get("name") == "stderr" for o in c.get("outputs", []))]


def stale_cells(committed: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list[str]:
    """One message (with a diff) per code cell whose committed outputs differ from the fresh ones."""
    problems = []
    old, new = outputs(committed), outputs(fresh)
    if len(old) != len(new):
        return [f"{len(old)} code cells committed, {len(new)} executed"]
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            diff = difflib.unified_diff(
                "\n".join(a).splitlines(), "\n".join(b).splitlines(), "committed", "fresh", lineterm="", n=1
            )
            lines = [line if len(line) <= 160 else line[:157] + "..." for line in list(diff)[:40]]
            problems.append(f"code cell {i}:\n" + "\n".join(lines))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the committed outputs are stale")
    parser.add_argument("path", nargs="?", type=Path, default=NOTEBOOK, help="the notebook (default: placements)")
    args = parser.parse_args(argv)
    committed = nbformat.read(args.path, as_version=4)
    fresh = execute(args.path)
    noisy = stderr_cells(fresh)
    if noisy:
        print(f"{args.path.name}: code cells {noisy} print to stderr (warnings); fix them first", file=sys.stderr)
        return 1
    problems = stale_cells(committed, fresh)
    if args.check:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{args.path.name}: {'stale outputs in ' + str(len(problems)) + ' cells' if problems else 'up to date'}")
        return 1 if problems else 0
    nbformat.write(fresh, args.path)
    print(f"{args.path.name}: outputs written ({len(problems)} code cells changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
