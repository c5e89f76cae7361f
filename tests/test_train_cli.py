"""train.py as a user meets it: a console that says what it does, and a mistake as one line with status 2."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SMALL = ["--config.data.source=pydoc", f"--config.data.cache_dir={ROOT / '.data'}", "--config.data.seq_len=32",
          "--config.data.batch_size=2", "--config.train.checkpoint_every=2", "--config.train.progress_bar=false"]


def _train(*args, workdir) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "train.py", f"--workdir={workdir}", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["--config.train.stepz=5"], "error: unknown config key train.stepz; did you mean train.steps?"),
    (["--config.data.seq_len=-8"], "error: data.seq_len=-8 must be an int >= 2"),
    (["--config.train.steps=abc"], "error: flag --config.train.steps=abc"),
    (["--config.data.source=pydoc", "--config.data.path=corpus.jsonl"],
     "error: data.path='corpus.jsonl' is set, but data.source='pydoc' reads the bundled corpus"),
    (["--config.data.path=corpus.txt"], "error: data.path='corpus.txt': cannot tell its format"),
    (["--config=configs/nope.py"], "error: --config=configs/nope.py: 'configs/nope.py' does not exist"),
    (["--config=configs/nope.py", "--config.train.steps=2"], "error: --config=configs/nope.py: 'configs/nope.py' does not"),
])
def test_a_mistake_is_one_line_and_status_2(args, message, tmp_path):
  proc = _train(*args, workdir=tmp_path / "run")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
  assert "Traceback" not in proc.stdout + proc.stderr
  assert not (tmp_path / "run" / "checkpoints").exists()  # nothing a rerun would trip over


def test_the_console_tells_the_run(tmp_path):
  """The banner, the stage change, the summary; a rerun of a finished run says there is nothing to do,
  and a run that never leaves the warm-up says why its loss stays flat."""
  workdir = tmp_path / "run"
  first = _train(*_SMALL, "--config.train.steps=2", "--config.train.warmup_steps=1", workdir=workdir)
  assert first.returncode == 0, first.stderr[-3000:]
  out = first.stderr  # the console: stderr, beside the progress bar
  for expected in ("model     glm_moe_dsa: 4 layers", "mesh ", "data      pydoc", "schedule  steps 1-1: dense warm-up",
                   "steps 2-2: sparse", "kernels   every op: reference (jnp)", "a new run",
                   "step 2: the sparse stage begins", "done: steps 1-2", "checkpoints: "):
    assert expected in out, (expected, out)
  assert (workdir / "config.json").exists()

  again = _train(*_SMALL, "--config.train.steps=2", "--config.train.warmup_steps=1", workdir=workdir)
  assert again.returncode == 0 and "resuming from the checkpoint of step 2" in again.stderr
  assert "nothing to train" in again.stderr and "raise --config.train.steps" in again.stderr, again.stderr

  warmup_only = _train(*_SMALL, "--config.train.steps=3", "--config.train.warmup_steps=40", "--config.train.stop_at_step=1",
                       workdir=tmp_path / "warmup")
  assert "the whole run is the dense warm-up" in warmup_only.stderr, warmup_only.stderr
