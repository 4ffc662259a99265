"""Notebooks under notebooks/: they execute cleanly (their last cells assert reference numbers), and are saved
with outputs stripped."""
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CLOSED_FORM = NOTEBOOKS_DIR / "02_closed_form_check.ipynb"


def test_closed_form_notebook_exists():
    assert CLOSED_FORM in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_stripped(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.get("outputs", []) == [], f"{path.name} cell {i} has saved outputs; strip them"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution_count"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("TRL_EXT_NOTEBOOK_QUICK", "1")  # the kernel inherits it: 03_quickstart runs a shortened run

    nb = nbformat.read(path, as_version=4)
    # raises CellExecutionError (failing the test) if any cell errors, including a failed assert
    resources = {"metadata": {"path": str(NOTEBOOKS_DIR)}}
    NotebookClient(nb, kernel_name="python3", timeout=300, resources=resources).execute()
