"""train.py end to end: trains, logs metrics, checkpoints, and resumes from the last checkpoint."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = [
    "--config.data.seq_len=64", "--config.data.batch_size=2", "--config.model.topk=8",
    "--config.train.log_every=2", "--config.train.checkpoint_every=3",
    "--config.train.warmup_steps=3", "--config.train.progress_bar=false",
]


def _train(workdir, steps, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "train.py", "--config=configs/selection_demo.py", f"--workdir={workdir}",
         f"--config.train.steps={steps}", *SMALL, *extra]
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_trains_checkpoints_and_resumes(tmp_path):
  _train(tmp_path, 6)
  rows = _metrics(tmp_path)
  assert [r["step"] for r in rows] == [2, 4, 6]
  assert all(r["indexer_loss"] > 0 and 0 <= r["recall"] <= 1 for r in rows)
  assert [r["dense_stage"] for r in rows] == [1.0, 0.0, 0.0]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]

  _train(tmp_path, 8)  # resumes at step 6: only step 8 is new
  assert [r["step"] for r in _metrics(tmp_path)] == [2, 4, 6, 8]
  assert "8" in {p.name for p in (tmp_path / "checkpoints").iterdir()}


def test_rejects_unknown_config_field(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "train.py", "--config=configs/selection_demo.py", f"--workdir={tmp_path}",
         "--config.train.stepz=3"]
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "stepz" in result.stderr
