"""The placements notebook is committed WITH its outputs; this re-executes it and fails if a cell raises (its
cells assert the values they show: a wrong result is an AssertionError), prints to stderr (warnings), or if the
committed outputs are stale. Refresh them with ``.venv/bin/python notebooks/refresh.py``.
"""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
REFRESH = "notebooks/refresh.py"


def _refresh_module():
    spec = importlib.util.spec_from_file_location("notebooks_refresh", NOTEBOOKS / "refresh.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refresh = _refresh_module()


def test_masking_hides_what_changes_between_runs():
    text = "took 1.25 s and 3 ms at 0x7f3a2b1c pid 4242 on 127.0.0.1:29500 port 29501; 4 ranks, 2 groups"
    assert refresh.mask(text) == (
        "took <time> and <time> at 0x... pid <pid> on 127.0.0.1:<port> port <port>; 4 ranks, 2 groups"
    )


def test_committed_notebook_shows_every_result():
    nb = nbformat.read(NOTEBOOKS / "placements.ipynb", as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code if "cluster.shutdown()" not in cell.source), "commit it with outputs"
    assert refresh.stderr_cells(nb) == []
    assert REFRESH in nb.cells[0].source  # the first markdown cell says how to refresh the outputs


def test_the_cells_check_what_they_show():
    nb = nbformat.read(NOTEBOOKS / "placements.ipynb", as_version=4)
    cluster = [c for c in nb.cells if c.cell_type == "code" and "cluster.run(" in c.source]
    assert cluster and all("assert " in c.source for c in cluster), "every cluster cell asserts its results"


def test_sections_are_numbered_in_order():
    nb = nbformat.read(NOTEBOOKS / "placements.ipynb", as_version=4)
    headings = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()]
    numbers = [int(m[1]) for m in map(re.compile(r"## (\d+)\. ").match, headings) if m]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 7, numbers


@pytest.mark.slow
def test_placements_notebook_runs_and_its_committed_outputs_are_current():
    committed = nbformat.read(NOTEBOOKS / "placements.ipynb", as_version=4)
    try:
        fresh = refresh.execute(NOTEBOOKS / "placements.ipynb")
    except CellExecutionError as e:  # an assert in a cell (a wrong value) or any other error
        pytest.fail(f"a notebook cell raised {e.ename}: {e.evalue}\n{e}")
    assert refresh.stderr_cells(fresh) == [], "cells print to stderr (warnings)"
    stale = refresh.stale_cells(committed, fresh)
    assert not stale, f"committed outputs are stale; run `.venv/bin/python {REFRESH}`:\n" + "\n".join(stale)
