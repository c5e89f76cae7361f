"""One tiny GLM-5.1 train.py run per test session (all xdist workers share it) for the tests of the
workdir commands (`python -m hyscale_jax.evaluate`, `python -m hyscale_jax.generate`), and how to run them."""

import fcntl
import os
import pathlib
import subprocess
import sys

from configs import glm5_1
from hyscale_jax.training import lm, run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3


def tiny_config():
  """configs/glm5_1.py:tiny for 3 steps (1 dense warm-up) of 2 x 64 pydoc tokens; checkpoints at 2 and 3."""
  config = glm5_1.get_config("tiny")
  # The repository's .data holds the pydoc BPE of 2048 tokens: nothing is trained or downloaded.
  config.data.update(source="pydoc", cache_dir=str(ROOT / ".data"), seq_len=64, batch_size=2)
  config.train.update(steps=STEPS, warmup_steps=1, checkpoint_every=2, memory_preflight=False, progress_bar=False)
  return config


def trained_workdir(tmp_path_factory) -> pathlib.Path:
  """The workdir of `tiny_config`'s run: trained once per test session, by the first test (of any
  xdist worker) that asks; the others wait for it and share it (they only read it)."""
  base = tmp_path_factory.getbasetemp()
  # Under xdist each worker's base is popen-gwN/ inside the session's folder, which they share.
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  workdir, done = shared / "tiny_glm_run", shared / "tiny_glm_run.done"
  with open(shared / "tiny_glm_run.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      config = tiny_config()
      lm.train_and_evaluate(config, str(workdir))
      if not os.path.exists(run_config.path(str(workdir))):  # from before train.py wrote it
        run_config.save(config, str(workdir))
      done.touch()
  return workdir


def run_command(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  """`python -m <module> <args>` from the repository root, as a user runs it (on the CPU)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
