"""The notebooks under notebooks/: each runs top to bottom without an error, and is committed without outputs."""

import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# The figure each notebook saves (under notebooks/figures when run by hand; tmp_path here).
FIGURES = {"01_one_layer": "01_one_layer.png", "02_selection_replay": "02_selection_replay.png",
           "03_train_tiny": "03_train_tiny.png"}


def test_every_notebook_is_listed_here():
  assert [p.stem for p in NOTEBOOKS] == sorted(FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_carries_no_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  dirty = [i for i, cell in enumerate(notebook.cells)
           if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
  assert not dirty, f"{path.name}: code cells {dirty} carry outputs or execution counts; clear them before committing."


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  """Executed as Jupyter would (a fresh python3 kernel in notebooks/); any cell error fails the test."""
  monkeypatch.setenv("HYSCALE_FIGURES_DIR", str(tmp_path))  # leave the committed figures alone
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  notebook = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}).execute()
  print(f"{path.name}: {time.perf_counter() - start:.1f} s")
  figure = tmp_path / FIGURES[path.stem]
  assert figure.stat().st_size > 10_000, f"{path.name} did not save {figure.name}"
  images = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs if "image/png" in o.get("data", {})]
  assert images, f"{path.name} showed no figure"
