"""The notebooks under notebooks/: each runs top to bottom without an error, and is committed without outputs."""

import pathlib
import shutil
import subprocess
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


def _execute(path, figures_dir, monkeypatch) -> str:
  """Runs the notebook as Jupyter would (a fresh python3 kernel in notebooks/); any cell error raises.

  Returns its printed text. The kernel inherits this process's environment (conftest's CPU
  platform), with the figures sent to `figures_dir`, not over the committed ones.
  """
  monkeypatch.setenv("HYSCALE_FIGURES_DIR", str(figures_dir))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  notebook = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}).execute()
  print(f"{path.name}: {time.perf_counter() - start:.1f} s")
  figure = figures_dir / FIGURES[path.stem]
  assert figure.stat().st_size > 10_000, f"{path.name} did not save {figure.name}"
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} showed no figure"
  return "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")


# CI time: 03_train_tiny trains what train.py trains (tests/test_train_cli.py); it runs with SLOW=1.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem == "03_train_tiny" else p
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  _execute(path, tmp_path, monkeypatch)


def _has_cuda_device() -> bool:
  nvidia_smi = shutil.which("nvidia-smi")
  return bool(nvidia_smi) and subprocess.run([nvidia_smi, "-L"], capture_output=True).returncode == 0


@pytest.mark.gpu_only
def test_selection_replay_notebook_times_both_step_modes_on_gpu(tmp_path, monkeypatch):
  if not _has_cuda_device():
    pytest.skip("needs a CUDA device")
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # the kernel leaves conftest's CPU platform
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  text = _execute(NOTEBOOKS_DIR / "02_selection_replay.ipynb", tmp_path, monkeypatch)
  assert "on gpu" in text and "megatron_style" in text and "ms per step" in text, text[-2000:]
  assert "hyscale is" in text, text[-2000:]
