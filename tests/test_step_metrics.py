"""train.py's step metrics: honest step times, model FLOPs and MFU, FlashTopK's rescued rows, one compile
per stage, and a train step that takes the same path (no recompile) on every call."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import glm5_1
from hyscale_jax import parallel
from hyscale_jax import sharding as shd
from hyscale_jax.ops.flash_topk import api as flash_topk_api
from hyscale_jax.training import file_data, flops, lm, step_modes

_SMALL_MODEL = dict(
    d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2, moe_inter=16,
    index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=8, vocab_size=512)
B, T = 2, 64


def _config(tmp_path, steps, **train):
  config = glm5_1.get_config("tiny")
  config.model.update(_SMALL_MODEL)
  config.data.update(source="pydoc", vocab_size=512, seq_len=T, batch_size=B, cache_dir=str(tmp_path / "data"))
  config.train.update(**{**dict(steps=steps, warmup_steps=1, log_every=2, checkpoint_every=0, progress_bar=False),
                         **train})
  return config


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _rescuing_everything(monkeypatch):
  """The reference selection, reporting every row as rescued: what a FlashTopK that never proves a row
  exact would report."""
  reference = flash_topk_api.REGISTRY.implementations["reference"]

  def selection(q, k, weights, *, with_stats=False, **kwargs):
    indices, scores = reference(q, k, weights, **kwargs)
    return (indices, scores, jnp.ones(q.shape[:2], bool) | (indices[..., 0] < -2)) if with_stats else (indices, scores)

  monkeypatch.setitem(flash_topk_api.REGISTRY.implementations, "reference", selection)


def test_rows_logged_with_step_time_flops_mfu_and_rescued_rows(tmp_path, monkeypatch):
  """Every logged row has the step's device-synced time, its model FLOPs rate and MFU (against the
  configured peak), and the window's sum of FlashTopK's rescued rows, in metrics.jsonl and TensorBoard."""
  _rescuing_everything(monkeypatch)
  workdir = tmp_path / "run"
  config = _config(tmp_path, 5, peak_tflops=0.001, eval_every=4)
  lm.train_and_evaluate(config, str(workdir))
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [2, 4, 5]
  cfg = lm.setup(config)[0]
  # Steps 2..5 select; each of the 2 layers' selections rescues all B * T rows. Row 1's window is the
  # dense step 1 (no selection) and sparse step 2.
  per_step = 2 * B * T
  assert [r["topk_rescued_rows"] for r in rows] == [per_step, 2 * per_step, per_step]
  for r in rows:
    assert 0 < r["step_time_s"] <= r["step_time_max_s"]
    assert r["tokens_per_sec"] > 0
    assert r["mfu"] == pytest.approx(r["model_tflops_per_device"] / 0.001)
  # Row 2's window is two sparse steps: the model FLOPs over their summed times, on the mesh's one device.
  sparse = flops.step_flops(cfg, batch_size=B, seq_len=T, dense=False).total
  assert rows[1]["model_tflops_per_device"] == pytest.approx(sparse / rows[1]["step_time_s"] / 1e12, rel=1e-6)
  # The validation loss at eval_every and at the last step only.
  assert ["val_lm_loss" in r for r in rows] == [False, True, True]
  events = "".join(p.name for p in (workdir / "tensorboard").iterdir())
  assert "tfevents" in events


def test_the_train_step_compiles_once_and_takes_the_same_path_every_step(tmp_path):
  """With the Pallas selection (interpret mode here), the jitted train step's second and third calls
  compile nothing: a module imported lazily while the first call traced once registered a JAX config
  option, which changed the cache key and recompiled the whole step on its second call."""
  config = step_modes.apply(_config(tmp_path, 3, warmup_steps=0))
  with config.unlocked():
    config.step_mode, config.ops.flash_topk = "", "pallas"
    config.ops.sparse_attention = config.ops.indexer_loss = "pallas"
  cfg, mesh = lm.setup(config)
  rules = shd.rules_from_config(config.mesh)
  compiles = []
  # Tracing, lowering or compiling (a persistent-cache hit skips only the last).
  listener = lambda event, seconds, **kw: compiles.append(event) if event.startswith("/jax/core/compile/") else None  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    _three_steps(config, cfg, mesh, rules, compiles)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _three_steps(config, cfg, mesh, rules, compiles):
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    data = file_data.open_dataset(config.data, model_vocab_size=cfg.vocab_size, seed=0)
    rows = parallel.process_rows(mesh, B)
    training = lm.build_training(config, cfg, mesh, rules)
    state = training.state
    for step in range(3):
      batch = parallel.global_batch(mesh, data.batch(step, rows=rows), rows=rows, batch_size=B)
      before = len(compiles)
      state, metrics = training.train_step(state, batch, False)
      assert bool(metrics["finite"])
      if step:
        assert compiles[before:] == [], f"call {step + 1} of the train step traced or compiled again"
