"""Every notebook in examples/ runs top to bottom (nbclient, a fresh kernel each), and is stored
without outputs."""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "examples").glob("*.ipynb"))


def test_all_five_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == [
        "01_kernels.ipynb",
        "02_surrogate_and_attribution.ipynb",
        "03_layer_importance.ipynb",
        "04_nas_proxies.ipynb",
        "05_text_classifier.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    book = nbformat.read(path, as_version=4)
    code = [cell for cell in book.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code), (
        f"{path.name} is stored with outputs; strip them"
    )
    # The kernel is this interpreter (kernel specs may name a bare `python`).
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # One thread per kernel: on a busy 2-core machine torch's spinning worker threads make these
    # small models many times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    NotebookClient(
        book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors
    assert any(o.output_type == "stream" for cell in code for o in cell.outputs)
