"""The LM trainer: both DSA stages, metrics, TensorBoard, checkpoints, resume and config errors."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import glm5_1
from hyscale_jax.training import lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SMALL_MODEL = dict(
    d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2, moe_inter=16,
    index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=8, vocab_size=512)


def _config(tmp_path, steps):
  config = glm5_1.get_config("tiny")
  config.model.update(_SMALL_MODEL)
  config.data.update(source="pydoc", vocab_size=512, seq_len=64, batch_size=2, cache_dir=str(tmp_path / "data"))
  config.train.update(steps=steps, warmup_steps=2, log_every=2, checkpoint_every=3, progress_bar=False)
  return config


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# CI time: tests/test_train_cli.py runs both stages and a resume, tests/test_step_metrics.py checks the rows.
@pytest.mark.slow
def test_two_stages_metrics_checkpoints_and_resume(tmp_path):
  workdir = tmp_path / "run"
  lm.train_and_evaluate(_config(tmp_path, 6), str(workdir))
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [2, 4, 6]
  assert [r["stage"] for r in rows] == [lm.DENSE_STAGE, lm.SPARSE_STAGE, lm.SPARSE_STAGE]
  for key in ("loss", "lm_loss", "indexer_loss", "tokens_per_sec", "val_lm_loss"):
    assert all(r[key] == r[key] and r[key] >= 0 for r in rows), key
  assert rows[0]["loss"] == rows[0]["indexer_loss"]  # warm-up: the indexer KL alone
  assert rows[0]["lr"] == 0.0 and rows[0]["indexer_lr"] > 0  # warm-up: only the indexer learns
  assert {p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()} == {"3", "6"}
  assert any(p.name.startswith("events.out.tfevents") for p in (workdir / "tensorboard").iterdir())

  lm.train_and_evaluate(_config(tmp_path, 8), str(workdir))  # resumes from step 6
  assert [r["step"] for r in _rows(workdir)] == [2, 4, 6, 8]


# CI time: tests/test_reliability.py kills a real save midway (SIGKILL) and resumes; this staged one is slow.
@pytest.mark.slow
def test_a_save_killed_midway_is_ignored_on_resume(tmp_path):
  workdir = tmp_path / "run"
  lm.train_and_evaluate(_config(tmp_path, 3), str(workdir))
  # What a SIGKILL during orbax's save of step 6 leaves: a temporary folder, never renamed.
  partial = workdir / "checkpoints" / "6.orbax-checkpoint-tmp-1234567"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "garbage").write_bytes(b"\x00" * 64)
  lm.train_and_evaluate(_config(tmp_path, 4), str(workdir))
  assert [r["step"] for r in _rows(workdir)] == [2, 3, 4]  # resumed from the complete step 3


def test_unwritable_workdir_fails_before_compute(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="workdir"):
    lm.train_and_evaluate(_config(tmp_path, 2), str(blocker / "run"))
  assert not (tmp_path / "data").exists()  # failed before building the data


def test_bad_model_config_fails_before_compute(tmp_path):
  config = _config(tmp_path, 2)
  config.model.index_topk = 0
  with pytest.raises(ValueError, match="index_topk"):
    lm.train_and_evaluate(config, str(tmp_path / "run"))


def test_cli_typo_in_override_names_the_key(tmp_path):
  cmd = [sys.executable, "train.py", "--config=configs/glm5_1.py:tiny", f"--workdir={tmp_path}",
         "--config.model.index_topkk=4"]
  result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=120)
  assert result.returncode != 0 and "index_topkk" in result.stderr
