"""Each family's tiny model with every published feature on trains 200 steps through train.py and resumes.

GLM-5.1: DSA + IndexShare, MoE, MTP, YaRN. DeepSeek-V4: CSA/HCA, mHC, hash routing, YaRN on the
compressed layers, MTP. Qwen3.8-Flash-Next: Gated DeltaNet + QSA, gated residual streams, Engram, MTP.
Slow (minutes of CPU per family); `pytest -m slow tests/test_every_feature.py` runs them.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hyscale_jax.training import lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Per family: the config and the overrides that turn on what its tiny variant leaves off.
FAMILIES = {
    "glm_moe_dsa": ("configs/glm5_1.py:tiny", ["--config.model.mtp_depth=1", "--config.model.rope_yarn_factor=4.0",
                                               "--config.model.rope_yarn_original_max_len=32"]),
    "deepseek_v4": ("configs/deepseek_v4_flash.py:tiny", ["--config.model.mtp_depth=1"]),
    "qwen4_exp": ("configs/qwen3_8_flash_next.py:tiny", ["--config.model.mtp_depth=1"]),
}
COMMON = ["--config.data.source=pydoc", "--config.data.seq_len=64", "--config.data.batch_size=4",
          "--config.train.warmup_steps=20", "--config.train.log_every=20", "--config.train.checkpoint_every=100",
          "--config.train.progress_bar=false"]


def _train(config, extra, workdir, steps):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "train.py", f"--config={config}", f"--workdir={workdir}", f"--config.train.steps={steps}",
         f"--config.data.cache_dir={workdir.parent / 'data'}", *COMMON, *extra]
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert result.returncode == 0, result.stderr[-3000:]
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_model_with_every_feature_trains_200_steps_and_resumes(family, tmp_path):
  config, extra = FAMILIES[family]
  workdir = tmp_path / "run"
  rows = _train(config, extra, workdir, 200)
  assert [r["step"] for r in rows] == list(range(20, 201, 20))
  sparse = [r for r in rows if r["stage"] == lm.SPARSE_STAGE]
  assert all(np.isfinite(r["lm_loss"]) and np.isfinite(r["mtp_loss"]) for r in sparse)
  first, last = np.mean([r["lm_loss"] for r in sparse[:2]]), np.mean([r["lm_loss"] for r in sparse[-2:]])
  assert last < first - 0.3, [round(r["lm_loss"], 3) for r in sparse]  # nats, over 160 sparse steps
  assert sparse[-1]["mtp_loss"] < sparse[0]["mtp_loss"], [round(r["mtp_loss"], 3) for r in sparse]
  print(f"{family}: lm_loss {sparse[0]['lm_loss']:.3f} -> {sparse[-1]['lm_loss']:.3f}, "
        f"mtp_loss {sparse[0]['mtp_loss']:.3f} -> {sparse[-1]['mtp_loss']:.3f}")
  resumed = _train(config, extra, workdir, 240)  # from the step-200 checkpoint
  assert [r["step"] for r in resumed] == list(range(20, 241, 20))
  assert np.isfinite(resumed[-1]["lm_loss"])
