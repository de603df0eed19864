"""The placements notebook executes headless, top to bottom, so it never rots (outputs are not committed)."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "placements.ipynb"


def outputs(nb, mime):
    return "\n".join(
        out.get("text", "") if mime == "text" else str(out.get("data", {}).get(mime, ""))
        for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )  # fmt: skip


def test_placements_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit it without outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = outputs(nb, "text") + outputs(nb, "text/plain")
    assert "gather restores the latent: True" in text and "gather restores the latent: False" not in text
    assert "1 x all_reduce" in text and "1 x reduce_scatter_tensor" in text and "no collective" in text
    assert "correct: False" not in text
    assert "placements (R, S(0))" in text  # the HSDP weight
    assert "torch.Size([3, 44, 160]) cp_size_t = 8" in text
    assert "wf-mesh-view" in outputs(nb, "text/html")  # the HTML views rendered
