"""Multi-token prediction (models/mtp.py): targets, loss against a float64 oracle, gradients, training."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import deepseek_v4_flash, glm5_1, qwen3_8_flash_next
from hyscale_jax import models
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.mtp import depth_targets
from hyscale_jax.training import lm, memory
from tests import lm_runs
from tests.oracles import mtp_loss_oracle

_GLM = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2,
    n_shared_experts=1, moe_inter=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=6,
    rope_theta=10000.0, index_topk_freq=2, index_topk_offset=2, mtp_depth=2)
_V4 = ModelConfig(
    architecture="deepseek_v4", vocab_size=64, d_model=32, n_layers=2, first_k_dense=0, n_heads=4,
    head_dim=16, qk_rope_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=6,
    compress_ratios=(0, 4), index_n_heads=2, index_head_dim=16, index_rope_dim=4, index_topk=3,
    n_routed_experts=4, experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="sqrtsoftplus",
    routed_scaling=1.5, rms_eps=1e-6, rope_theta=10000.0, compress_rope_theta=40000.0, hc_mult=2, mtp_depth=1)
_QWEN = ModelConfig(
    architecture="qwen4_exp", vocab_size=64, d_model=32, n_layers=2, first_k_dense=0,
    layer_types=("gated_deltanet", "qsa"), n_heads=4, n_kv_heads=2, head_dim=16, qk_rope_dim=4,
    index_n_heads=2, index_head_dim=8, index_rope_dim=4, index_topk=3, qsa_block=4, n_routed_experts=4,
    experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="softmax", routed_scaling=1.0, rms_eps=1e-6,
    rope_theta=10000.0, hc_mult=2, hc_lowrank=4, shared_expert_gate=True, router_bias=False,
    linear_n_key_heads=2, linear_n_value_heads=4, linear_key_dim=8, linear_value_dim=8, mtp_depth=1)
B, T = 2, 24


def _batch(cfg, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, cfg.vocab_size)
  mask = np.ones((B, T), np.float32)
  mask[0, 9] = 0.0  # a document boundary: the chains through position 9 stop there
  mask[1, -3:] = 0.0  # padding at the end of a row
  return tokens[:, :-1], tokens[:, 1:], jnp.asarray(mask)


def test_depth_targets_shift_and_chain_the_mask():
  targets = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  mask = jnp.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]], jnp.float32)
  tokens, target, chain = depth_targets(targets, mask, 1)
  np.testing.assert_array_equal(tokens, [[1, 2, 3, 4, 5, 0], [7, 8, 9, 10, 11, 0]])
  np.testing.assert_array_equal(target, [[2, 3, 4, 5, 0, 0], [8, 9, 10, 11, 0, 0]])
  # loss_mask[t], [t + 1], [t + 2] all 1, inside the window.
  np.testing.assert_array_equal(chain, [[0, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
  with pytest.raises(ValueError, match="targets"):
    depth_targets(targets, mask[:, :3], 0)


def test_mtp_loss_matches_the_float64_oracle_and_leaves_the_main_model_alone():
  cfg = dataclasses.replace(_GLM, remat_policy="none")
  model = models.build(cfg, rngs=nnx.Rngs(0))
  tokens, targets, mask = _batch(cfg)
  h, aux = model.hidden_states(tokens, mtp_tokens=targets)
  h_plain, _ = model.hidden_states(tokens)
  np.testing.assert_array_equal(h, h_plain)  # MTP reads the main model, never changes it
  loss = model.mtp_loss(aux["mtp_hidden"], targets, mask)
  positions, segments = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.zeros((B, T), jnp.int32)

  def block_fn(block):
    return lambda x: np.asarray(block(jnp.asarray(x, jnp.float32), positions, segments)[0], np.float64)

  depths = [dict(enorm=d.enorm.scale[...], hnorm=d.hnorm.scale[...], norm=d.norm.scale[...],
                 eh_proj=d.eh_proj.kernel[...], block=block_fn(d.block)) for d in model.mtp]
  expected = mtp_loss_oracle(h, targets, mask, model.embed_tokens.embedding[...], model.lm_head.kernel[...],
                             depths, eps=cfg.rms_eps)
  np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
  # Depth 1 sees fewer positions than depth 0: a different, still finite loss per depth.
  per_depth = [float(model.mtp_loss(aux["mtp_hidden"][d:d + 1], targets, mask)) for d in range(2)]
  assert per_depth[0] != per_depth[1] and all(np.isfinite(per_depth))


@pytest.mark.parametrize("cfg", [_GLM, _V4, _QWEN], ids=lambda c: c.architecture)
def test_gradients_reach_the_mtp_depths_and_the_shared_embedding(cfg):
  model = models.build(dataclasses.replace(cfg, mtp_depth=1), rngs=nnx.Rngs(0))
  tokens, targets, mask = _batch(cfg, seed=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def mtp_only(params):
    m = nnx.merge(graphdef, params, rest)
    _, aux = m.hidden_states(tokens, mtp_tokens=targets)
    return m.mtp_loss(aux["mtp_hidden"], targets, mask)

  grads = dict(nnx.to_flat_state(jax.grad(mtp_only)(params)))
  norm = lambda prefix: sum(float(jnp.sum(jnp.abs(g[...]))) for p, g in grads.items()
                            if ".".join(map(str, p)).startswith(prefix))
  for part in ("mtp.0.eh_proj", "mtp.0.enorm", "mtp.0.hnorm", "mtp.0.block.mlp", "mtp.0.block.self_attn",
               "embed_tokens", "layers.0"):
    assert norm(part) > 0, part
  # The MTP loss trains the main layers through `prev`; only the main LM loss reaches nothing of MTP.
  def main_only(params):
    m = nnx.merge(graphdef, params, rest)
    h, _ = m.hidden_states(tokens)
    return m.lm_loss(h, targets, mask)

  grads = dict(nnx.to_flat_state(jax.grad(main_only)(params)))
  assert norm("mtp") == 0


def test_mtp_is_built_after_the_main_model_and_counted_by_the_memory_estimate():
  plain = models.build(dataclasses.replace(_V4, mtp_depth=0), rngs=nnx.Rngs(0))
  with_mtp = models.build(_V4, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(plain.layers[1].mlp.gate.kernel[...], with_mtp.layers[1].mlp.gate.kernel[...])
  assert with_mtp.mtp[0].hc_head is not None and with_mtp.mtp[0].streams_in  # V4: streams in, own collapse
  assert models.count_params(_V4)[0] > models.count_params(dataclasses.replace(_V4, mtp_depth=0))[0]
  for cfg in (_GLM, _V4, _QWEN):
    estimate = lambda c: memory.estimate_training_memory(c, batch_size=1, seq_len=64).components
    with_mtp, without = estimate(cfg), estimate(dataclasses.replace(cfg, mtp_depth=0))
    assert with_mtp["layer inputs"] > without["layer inputs"], cfg.architecture
    assert with_mtp["parameters"] > without["parameters"], cfg.architecture
  with pytest.raises(ValueError, match="mtp_depth"):
    ModelConfig(mtp_depth=-1)


@pytest.mark.parametrize("get_config, small", [(glm5_1.get_config, _GLM),
                                               (deepseek_v4_flash.get_config, _V4),
                                               (qwen3_8_flash_next.get_config, _QWEN)],
                         ids=["glm_moe_dsa", "deepseek_v4", "qwen4_exp"])
def test_train_py_logs_mtp_loss_trains_and_resumes(get_config, small, tmp_path):
  make = lambda steps: lm_runs.small_lm_config(get_config, small, tmp_path, steps, mtp_depth=1)
  workdir = tmp_path / "run"
  config = make(8)
  config.train.update(mtp_loss_weight=0.3, stop_at_step=6)
  lm.train_and_evaluate(config, str(workdir))
  lm.train_and_evaluate(make(8), str(workdir))  # resumes from the step-6 checkpoint
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  assert all(np.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in rows)
  sparse = [r for r in rows if r["stage"] == lm.SPARSE_STAGE]
  assert sparse[-1]["mtp_loss"] < rows[0]["mtp_loss"]
  assert all(r["loss"] > r["lm_loss"] for r in sparse)  # the weighted MTP loss is in the total


def test_bad_mtp_loss_weight_is_rejected(tmp_path):
  config = lm_runs.small_lm_config(glm5_1.get_config, _GLM, tmp_path, 2)
  config.train.mtp_loss_weight = -0.1
  with pytest.raises(ValueError, match="mtp_loss_weight"):
    lm.setup(config)
