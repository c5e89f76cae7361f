"""Multi-token prediction (models/mtp.py): targets, loss against a float64 oracle, gradients, training."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from configs import deepseek_v4_flash, glm5_1, qwen3_8_flash_next
from hyscale_jax import convert, models
from hyscale_jax.layers.hyper_connections import expand_streams
from hyscale_jax.convert.safetensors_dir import CheckpointReader
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.mtp import depth_targets
from hyscale_jax.training import lm, memory
from tests import lm_runs
from tests.oracles import mtp_loss_oracle
from tests.test_convert import FIXTURES, _relative_error

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


# GLM's run is the fast check; the other families' (same code path, their blocks) are slow.
def test_deepseek_v4_mtp_takes_the_streams_and_matches_the_float64_oracle():
  cfg = dataclasses.replace(_V4, remat_policy="none")
  model = models.build(cfg, rngs=nnx.Rngs(0))
  tokens, targets, mask = _batch(cfg, seed=2)
  _, aux = model.hidden_states(tokens, mtp_tokens=targets)
  loss = model.mtp_loss(aux["mtp_hidden"], targets, mask)
  positions, segments = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.zeros((B, T), jnp.int32)
  # The main model's streams before its collapse: what DeepSeek's MTPBlock takes.
  streams, *_ = model._run_layers(expand_streams(model.embed_tokens(tokens), cfg.hc_mult), positions, segments,
                                    (None,) * 4, dense=False, backends=None)
  depth = model.mtp[0]
  as_f64 = lambda f: lambda x: np.asarray(f(jnp.asarray(x, jnp.float32)), np.float64)
  depths = [dict(enorm=depth.enorm.scale[...], hnorm=depth.hnorm.scale[...], norm=depth.norm.scale[...],
                 eh_proj=depth.eh_proj.kernel[...], collapse=as_f64(depth.hc_head),
                 block=as_f64(lambda x: depth.block(x, positions, segments)[0]))]
  expected = mtp_loss_oracle(streams, targets, mask, model.embed_tokens.embedding[...], model.lm_head.kernel[...],
                             depths, eps=cfg.rms_eps)
  np.testing.assert_allclose(float(loss), expected, rtol=2e-5)


@pytest.mark.parametrize("cfg", [_GLM, pytest.param(_V4, marks=pytest.mark.slow),
                                 pytest.param(_QWEN, marks=pytest.mark.slow)], ids=lambda c: c.architecture)
def test_gradients_reach_the_mtp_depths_and_the_shared_embedding(cfg):
  model = models.build(dataclasses.replace(cfg, mtp_depth=1, remat_policy="none"), rngs=nnx.Rngs(0))
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
    assert norm(part) > 0, part  # the MTP loss also trains the main layers, through `prev`


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


@pytest.mark.parametrize("get_config, small", [
    pytest.param(glm5_1.get_config, _GLM, id="glm_moe_dsa"),
    pytest.param(deepseek_v4_flash.get_config, _V4, id="deepseek_v4", marks=pytest.mark.slow),
    pytest.param(qwen3_8_flash_next.get_config, _QWEN, id="qwen4_exp", marks=pytest.mark.slow)])
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


_FIXTURES = {"glm_moe_dsa_mtp": "num_nextn_predict_layers", "deepseek_v4_mtp": "num_nextn_predict_layers",
             "qwen4_exp_mtp": "mtp_num_hidden_layers"}


def test_glm_mtp_logits_match_transformers():
  # transformers' MTP layer (eh_proj, GLM's decoder layer, shared_head.norm, the shared head) on the
  # fixture's checkpoint: make_hf_fixtures.py `_glm_mtp_logits`, at positions t + 1 (RoPE is relative).
  source = FIXTURES / "glm_moe_dsa_mtp"
  model = convert.import_checkpoint(str(source), remat_policy="none")
  outputs = load_file(str(source / "outputs.safetensors"))
  tokens = jnp.asarray(outputs["input_ids"])
  next_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # the last column is never used
  h, aux = model.hidden_states(tokens, mtp_tokens=next_tokens)
  assert _relative_error(np.asarray(model.logits(h)), outputs["logits"]) < 1e-5
  mtp_logits = np.asarray(model.logits(aux["mtp_hidden"][0]))[:, :-1]
  assert _relative_error(mtp_logits, outputs["mtp_logits"]) < 1e-5


@pytest.mark.parametrize("name", sorted(_FIXTURES))
def test_mtp_checkpoints_import_and_export_bit_for_bit(name, tmp_path):
  source = FIXTURES / name
  model = convert.import_checkpoint(str(source), remat_policy="none")
  # The main model is its base fixture's, whose logits test_convert.py compares with transformers.
  assert model.cfg.mtp_depth == 1 and len(model.mtp) == 1
  convert.export_checkpoint(model, str(tmp_path), max_shard_bytes=100_000)
  assert json.loads((tmp_path / "config.json").read_text())[_FIXTURES[name]] == 1
  original, exported = CheckpointReader(str(source)), CheckpointReader(str(tmp_path))
  assert original.names() == exported.names()
  assert any("mtp" in n or n.startswith(f"model.layers.{model.cfg.n_layers}.") for n in original.names())
  for tensor in sorted(original.names()):
    assert np.array_equal(original.read(tensor), exported.read(tensor)), tensor
  if name == "deepseek_v4_mtp":  # e_proj and h_proj are the two halves of our eh_proj
    kernel = np.asarray(model.mtp[0].eh_proj.kernel[...])
    np.testing.assert_array_equal(kernel[:model.cfg.d_model], original.read("mtp.0.e_proj.weight").T)
    np.testing.assert_array_equal(kernel[model.cfg.d_model:], original.read("mtp.0.h_proj.weight").T)


def test_checkpoints_without_mtp_tensors_import_without_mtp(tmp_path):
  # What transformers saves: its config's MTP count (DeepSeek-V4 defaults to 1), no MTP tensors.
  assert json.loads((FIXTURES / "deepseek_v4" / "config.json").read_text())["num_nextn_predict_layers"] == 1
  assert convert.read_config(str(FIXTURES / "deepseek_v4")).mtp_depth == 0
  # GLM's MTP layer also stores the embedding and head: a copy that differs is refused, by name.
  shutil.copytree(FIXTURES / "glm_moe_dsa_mtp", tmp_path / "ckpt")
  reader = CheckpointReader(str(tmp_path / "ckpt"))
  name = "model.layers.3.embed_tokens.weight"
  path = tmp_path / "ckpt" / "model-mtp.safetensors"
  tensors = load_file(str(path))
  tensors[name] = tensors[name] + 1.0
  save_file(tensors, str(path))
  del reader
  with pytest.raises(convert.CheckpointMismatchError, match="embed_tokens"):
    convert.import_checkpoint(str(tmp_path / "ckpt"))
