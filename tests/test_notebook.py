"""The placements notebook is committed WITH its outputs; this re-executes it and fails if it errors, prints to
stderr (warnings), or if the committed outputs are stale. Refresh them with ``.venv/bin/python notebooks/refresh.py``.
"""

import importlib.util
from pathlib import Path

import nbformat
import pytest

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


@pytest.mark.slow
def test_placements_notebook_runs_and_its_committed_outputs_are_current():
    committed = nbformat.read(NOTEBOOKS / "placements.ipynb", as_version=4)
    fresh = refresh.execute(NOTEBOOKS / "placements.ipynb")  # raises CellExecutionError if a cell fails
    assert refresh.stderr_cells(fresh) == [], "cells print to stderr (warnings)"
    stale = refresh.stale_cells(committed, fresh)
    assert not stale, f"committed outputs are stale; run `.venv/bin/python {REFRESH}`:\n" + "\n".join(stale)
    text = "\n".join("\n".join(cell) for cell in refresh.outputs(fresh))
    assert text.count("gather restores the latent: True") == 4 and "restores the latent: False" not in text
    assert "rank 1: t (0, 1), h (4, 8) -> sequence (B, positions, C) (1, 32, 4), 8 patch tokens" in text  # H split
    assert "1 x all_reduce" in text and "1 x reduce_scatter_tensor" in text and "no collective" in text
    assert "correct: False" not in text
    assert "placements (R, S(0))" in text  # the HSDP weight
    assert "torch.Size([3, 44, 160]) cp_size_t = 8" in text
    assert "each rank: T' x H' x W = (3, 44, 160) = 21120 latent positions = 5280 patch tokens" in text
    assert "cp_ulysses (4 groups of 2)" in text  # the cp sub-axes
    html = "\n".join(out for cell in refresh.outputs(fresh) for out in cell if out.startswith("[text/html]"))
    assert html.count('class="wf-mesh-view"') == 5  # 2 topology views, 2 DTensor views from the cluster, 1 plan
    assert "shape (1, 128, 4) on mesh cp=4, placements (S(1))" in html  # rank 0's DTensor, viewed on rank 0
