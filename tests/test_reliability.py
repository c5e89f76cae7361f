"""Faults in training: resume determinism, corrupt checkpoints, non-finite steps, disk errors, SIGKILL."""

import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import glm5_1
from hyscale_jax.training import lm
from hyscale_jax.training.checkpoints import CheckpointError, Checkpointer
from hyscale_jax.training.text_data import PackedTextDataset

ROOT = pathlib.Path(__file__).resolve().parents[1]
_MODEL = dict(
    d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2, moe_inter=16,
    index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=8, vocab_size=512)
_DATA = dict(source="pydoc", vocab_size=512, seq_len=64, batch_size=2)
_TRAIN = dict(warmup_steps=2, log_every=2, checkpoint_every=3, progress_bar=False)


def _config(tmp_path, steps, **train):
  config = glm5_1.get_config("tiny")
  config.model.update(_MODEL)
  config.data.update(cache_dir=str(tmp_path / "data"), **_DATA)
  config.train.update(steps=steps, **{**_TRAIN, **train})
  return config


def _losses(workdir):
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: (r["loss"], r["lm_loss"], r["indexer_loss"]) for r in rows}


def test_stop_and_resume_is_bit_identical_to_a_straight_run(tmp_path):
  # The recipe: 20 steps straight against 10 steps, a resume, and 10 more (same seed and data).
  lm.train_and_evaluate(_config(tmp_path, 20, checkpoint_every=5), str(tmp_path / "straight"))
  lm.train_and_evaluate(_config(tmp_path, 20, checkpoint_every=5, stop_at_step=10), str(tmp_path / "split"))
  assert sorted(_losses(tmp_path / "split")) == [2, 4, 6, 8, 10]
  lm.train_and_evaluate(_config(tmp_path, 20, checkpoint_every=5), str(tmp_path / "split"))
  assert _losses(tmp_path / "split") == _losses(tmp_path / "straight")  # exact float equality


def _truncate_all_files(folder):
  for path in folder.rglob("*"):
    if path.is_file():
      path.write_bytes(path.read_bytes()[: max(path.stat().st_size // 2, 1) - 1])


def test_corrupt_latest_checkpoint_falls_back_without_deleting(tmp_path, capsys):
  workdir = tmp_path / "run"
  lm.train_and_evaluate(_config(tmp_path, 6), str(workdir))
  _truncate_all_files(workdir / "checkpoints" / "6")
  capsys.readouterr()
  lm.train_and_evaluate(_config(tmp_path, 8), str(workdir))
  err = capsys.readouterr().err
  assert "checkpoint step 6 is unreadable" in err and "resuming from step 3" in err
  kept = [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith("6.unreadable-")]
  assert len(kept) == 1 and any(p.is_file() for p in kept[0].rglob("*"))  # moved aside, not deleted
  assert (workdir / "checkpoints" / "8").is_dir()


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
  workdir = tmp_path / "run"
  lm.train_and_evaluate(_config(tmp_path, 3), str(workdir))
  config = _config(tmp_path, 6)
  config.model.d_model = 48  # a different model: the workdir's config.json names the difference
  with pytest.raises(ValueError, match=r"holds checkpoints of another model \(model.d_model: 32 in the workdir, 48"):
    lm.train_and_evaluate(config, str(workdir))
  (workdir / "config.json").unlink()  # without it, no checkpoint reads with this model
  with pytest.raises(CheckpointError, match="no checkpoint"):
    lm.train_and_evaluate(config, str(workdir))
  assert (workdir / "checkpoints" / "3").is_dir()


def _nan_at(step):
  original = PackedTextDataset.batch

  def batch(self, index, rows=None):
    out = original(self, index, rows)
    if index == step and self.split == "train":
      out["loss_mask"] = out["loss_mask"] * np.float32("nan")
    return out

  return batch


def test_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
  monkeypatch.setattr(PackedTextDataset, "batch", _nan_at(4))
  workdir = tmp_path / "run"
  lm.train_and_evaluate(_config(tmp_path, 6, nonfinite="skip"), str(workdir))
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["skipped_steps"] for r in rows] == [0, 0, 1]
  assert np.isfinite(rows[-1]["val_lm_loss"])
  checkpointer = Checkpointer(str(workdir / "checkpoints"), every_steps=3)
  meta_state = checkpointer._manager.restore(6, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  leaves = jax.tree.leaves(meta_state["state"])
  assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves if np.asarray(x).dtype.kind == "f")


def test_nonfinite_step_stops_with_the_tensor_named(tmp_path, monkeypatch):
  monkeypatch.setattr(PackedTextDataset, "batch", _nan_at(4))
  with pytest.raises(FloatingPointError, match=r"step 4: lm_loss is not finite.*last checkpoint is step 3"):
    lm.train_and_evaluate(_config(tmp_path, 6, nonfinite="stop"), str(tmp_path / "run"))


def test_failed_save_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  original = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step == 6:
      raise OSError(28, "No space left on device")
    return original(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(CheckpointError, match=r"step 6 .*No space left.*step 3\) is intact"):
    lm.train_and_evaluate(_config(tmp_path, 6), str(workdir))
  monkeypatch.setattr(ocp.CheckpointManager, "save", original)
  lm.train_and_evaluate(_config(tmp_path, 6), str(workdir))  # resumes from 3 and finishes
  assert (workdir / "checkpoints" / "6").is_dir()


def test_checkpoints_are_read_without_pickle(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  lm.train_and_evaluate(_config(tmp_path, 3), str(workdir))

  def refuse(*args, **kwargs):
    raise AssertionError("pickle was used to read a checkpoint")

  for name in ("load", "loads", "Unpickler"):
    monkeypatch.setattr(pickle, name, refuse)
  lm.train_and_evaluate(_config(tmp_path, 4), str(workdir))
  assert 4 in _losses(workdir)


def _cli(workdir, steps, tmp_path):
  args = [f"--config.model.{k}={v}" for k, v in _MODEL.items()]
  args += [f"--config.data.{k}={v}" for k, v in _DATA.items()] + [f"--config.data.cache_dir={tmp_path / 'data'}"]
  args += [f"--config.train.{k}={v}" for k, v in _TRAIN.items()] + [f"--config.train.steps={steps}"]
  return [sys.executable, "train.py", "--config=configs/glm5_1.py:tiny", f"--workdir={workdir}", *args]


# CI time: a kill mid-save is the harder case; the other is slow.
@pytest.mark.parametrize("kill_when", ["first_save_in_progress", pytest.param("after_first_logged_step", marks=pytest.mark.slow)])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, kill_when):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  reference, killed = tmp_path / "reference", tmp_path / "killed"
  subprocess.run(_cli(reference, 8, tmp_path), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
  proc = subprocess.Popen(_cli(killed, 8, tmp_path), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while proc.poll() is None and time.time() < deadline:
    ckpt = killed / "checkpoints"
    saving = ckpt.is_dir() and any("tmp" in p.name for p in ckpt.iterdir())
    logged = (killed / "metrics.jsonl").exists()
    if (kill_when == "first_save_in_progress" and saving) or (kill_when == "after_first_logged_step" and logged):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.005)
  proc.wait(timeout=60)
  subprocess.run(_cli(killed, 8, tmp_path), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
  final_ref, final_killed = _losses(reference), _losses(killed)
  assert final_killed[8] == final_ref[8] and final_killed[6] == final_ref[6]


def test_checkpoint_every_zero_saves_nothing(tmp_path):
  """`train.checkpoint_every=0` (benchmarks): no save on the interval, nor the forced one at the end."""
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=0)
  state = {"w": jnp.arange(4.0)}
  assert not any(checkpointer.maybe_save(step, state, {"step": step}, force=step == 3) for step in (1, 2, 3))
  assert checkpointer.restore_latest(state) is None
  checkpointer.close()
  with pytest.raises(ValueError, match="checkpoint_every"):
    lm.setup(_config(tmp_path, 4, checkpoint_every=-1))


def test_checkpoint_with_every_layer_apart_resumes_stacked(tmp_path):
  """A checkpoint from before the scanned layers were stored stacked (every layer its own arrays)
  resumes into the stacked layout and continues exactly as a run that never stopped."""
  from hyscale_jax.training import layer_stacks  # noqa: PLC0415

  def config(**train):
    config = _config(tmp_path, 4, checkpoint_every=2, **train)
    config.model.n_layers = 4  # layers 1-3 (MoE) are one scanned group
    return config

  lm.train_and_evaluate(config(), str(tmp_path / "straight"))
  lm.train_and_evaluate(config(stop_at_step=2), str(tmp_path / "old"))
  cfg, mesh = lm.setup(config())
  with jax.set_mesh(mesh):
    training = lm.build_training(config(), cfg, mesh, {})
  assert training.layer_groups, "the tiny model must have a scanned group for this test"
  saved = Checkpointer(str(tmp_path / "old" / "checkpoints"), every_steps=2)
  step, state, meta = saved.restore_latest(training.state)
  saved.close()
  legacy = Checkpointer(str(tmp_path / "legacy" / "checkpoints"), every_steps=2)
  legacy.maybe_save(step, layer_stacks.per_layer(state, training.layer_groups), meta)
  legacy.close()
  (tmp_path / "legacy" / "metrics.jsonl").write_text((tmp_path / "old" / "metrics.jsonl").read_text())
  lm.train_and_evaluate(config(), str(tmp_path / "legacy"))
  assert _losses(tmp_path / "legacy") == _losses(tmp_path / "straight")
