"""GLM-5.1 (`glm_moe_dsa`): parameter counts, selection replay, gradient isolation, dense equivalence."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import glm5_1
from hyscale_jax import models, ops, remat
from hyscale_jax.layers.mla import MLASparseAttention
from hyscale_jax.model_config import ModelConfig

_SMALL = ModelConfig(
    vocab_size=64, d_model=32, n_layers=3, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4,
    experts_per_token=2, n_shared_experts=1, moe_inter=16, index_n_heads=2, index_head_dim=16,
    index_rope_dim=8, index_topk=6, rope_theta=10000.0)
B, T = 2, 24


def _model(**overrides):
  return models.build(dataclasses.replace(_SMALL, **overrides), rngs=nnx.Rngs(0))


def _tokens(seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, _SMALL.vocab_size)


def _losses(model, tokens, dense=False):
  """params, and lm_loss, indexer_loss and their sum (one forward) as functions of the parameters."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def run(params):
    out = nnx.merge(graphdef, params, rest)(tokens, dense=dense)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean(), out.aux["indexer_loss"]

  return params, (lambda p: run(p)[0]), (lambda p: run(p)[1]), (lambda p: sum(run(p)))


def test_full_config_parameter_counts():
  total, active = models.count_params(glm5_1.get_config("full").model)
  # Published: 744B total, about 40B active (GLM-5 report). Measured here: 743.9B / 41.8B (active
  # includes the 0.95B embedding table; 40.8B without it).
  assert abs(total - 744e9) / 744e9 < 0.03, total
  assert abs(active - 40e9) / 40e9 < 0.05, active


@pytest.mark.parametrize("policy, per_indexer_layer", [("selection_replay", 1), ("full", 2), ("none", 1)])
def test_selections_per_step_follow_the_remat_policy(policy, per_indexer_layer):
  model = _model(remat_policy=policy)
  params, _, _, total = _losses(model, _tokens())
  jaxpr = jax.make_jaxpr(jax.grad(total))(params)
  assert remat.count_named_equations(jaxpr, "flash_topk") == per_indexer_layer * _SMALL.n_layers


def test_index_share_layers_reuse_the_previous_selection():
  model = _model(n_layers=4, index_topk_freq=2, index_topk_offset=2)  # full layers 0, 1, 3
  owners = [layer.self_attn.indexer is not None for layer in model.layers]
  assert owners == [True, True, False, True]
  paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert not any(p.startswith("layers/2/") and "indexer" in p for p in paths)
  params, _, _, total = _losses(model, _tokens())
  jaxpr = jax.make_jaxpr(jax.grad(total))(params)
  assert remat.count_named_equations(jaxpr, "flash_topk") == 3


@pytest.mark.parametrize("dense", [False, True])
def test_gradient_isolation(dense):
  params, lm, kl, _ = _losses(_model(), _tokens(), dense=dense)
  g_lm, g_kl = jax.grad(lm)(params), jax.grad(kl)(params)
  for (path, a), (_, b) in zip(nnx.to_flat_state(g_lm), nnx.to_flat_state(g_kl)):
    name = "/".join(map(str, path))
    if "indexer" in name:
      assert not np.any(a[...]), f"LM loss reached {name}"
    else:
      assert not np.any(b[...]), f"indexer loss reached {name}"
  indexer_grads = [b[...] for p, b in nnx.to_flat_state(g_kl) if "indexer" in "/".join(map(str, p))]
  assert indexer_grads and any(np.any(g) for g in indexer_grads)


def test_topk_at_least_t_equals_dense_attention():
  model = _model(index_topk=T)
  tokens = _tokens(1)
  sparse, dense = model(tokens).logits, model(tokens, dense=True).logits
  np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-5)
  assert not np.allclose(_model(index_topk=4)(tokens).logits, dense, atol=1e-3)


def test_selection_never_crosses_a_packed_document():
  attention = MLASparseAttention(_SMALL, has_indexer=True, rngs=nnx.Rngs(0))
  segment_ids = jnp.asarray([[0] * 7 + [1] * 10 + [2] * 7, [0] * 24])
  positions = jnp.asarray([list(range(7)) + list(range(10)) + list(range(7)), list(range(24))])
  x = jax.random.normal(jax.random.key(2), (B, T, _SMALL.d_model))
  out = attention(x, positions, segment_ids)
  idx = np.asarray(out.indices)
  seg = np.asarray(segment_ids)
  for b in range(B):
    for t in range(T):
      chosen = idx[b, t][idx[b, t] >= 0]
      assert len(chosen) and (seg[b, chosen] == seg[b, t]).all() and (chosen <= t).all()
  assert (idx[0, 7] >= 0).sum() == 1  # the first token of document 1 sees only itself


def test_every_layer_runs_alone_under_jit():
  cfg = _SMALL
  x = jax.random.normal(jax.random.key(3), (B, T, cfg.d_model))
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  segment_ids = jnp.zeros((B, T), jnp.int32)
  rngs = nnx.Rngs(0)  # a MoE layer with its own indexer
  decoder = models.DecoderLayer(cfg, 1, MLASparseAttention(cfg, has_indexer=True, rngs=rngs), rngs=rngs)

  @nnx.jit
  def forward_and_grad(layer, x):
    def loss(layer):
      y, _, indexer_loss, *_ = layer(x, positions, segment_ids)
      return jnp.mean(y**2) + indexer_loss
    return nnx.value_and_grad(loss)(layer)

  value, grads = forward_and_grad(decoder, x)
  assert np.isfinite(float(value))
  assert np.any(grads.self_attn.q_b_proj.kernel[...]) and np.any(grads.mlp.experts_up_proj[...])
  for module, args in ((decoder.self_attn.indexer, (x, x[..., :cfg.q_lora_rank], positions)),
                       (decoder.mlp, (x,)), (decoder.self_attn, (x, positions, segment_ids))):
    out = nnx.jit(lambda m, *a: m(*a))(module, *args)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(out))


@pytest.mark.parametrize("field, value, message", [
    ("index_topk", 0, "index_topk"), ("remat_policy", "sometimes", "remat_policy"),
    ("n_routed_experts", 6, "n_group"), ("first_k_dense", 9, "first_k_dense")])
def test_bad_model_config_is_rejected(field, value, message):
  kwargs = {field: value}
  if field == "n_routed_experts":
    kwargs["n_group"] = 4
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(_SMALL, **kwargs)


def test_unknown_model_config_key_is_named():
  config = glm5_1.get_config("tiny").model.to_dict()
  config["index_topkk"] = 3
  with pytest.raises(ValueError, match="index_topkk"):
    ModelConfig.from_config(config)


def test_dense_stage_equals_the_absorbed_dense_attention_it_replaced():
  """The warm-up runs non-absorbed (per-head 16-dim keys and values here) through ops.causal_attention;
  the old path was absorbed MQA attention over [c_kv ; k_pe] with the [T, T] logits, then W_UV."""
  attention = MLASparseAttention(_SMALL, has_indexer=True, rngs=nnx.Rngs(0))
  segment_ids = jnp.asarray([[0] * 7 + [1] * 10 + [2] * 7, [0] * 24])
  positions = jnp.asarray([list(range(7)) + list(range(10)) + list(range(7)), list(range(24))])
  x = jax.random.normal(jax.random.key(4), (B, T, _SMALL.d_model))
  new = attention(x, positions, segment_ids, dense=True)
  q, k, v, c_q, w_uv = attention._mqa_inputs(x, positions)
  scale = _SMALL.attention_scale
  latent = ops.causal_attention(q, k, v, scale=scale, segment_ids=segment_ids, backend="xla_baseline")
  old = attention.o_proj(jnp.einsum("bthl,lhv->bthv", latent, w_uv).reshape(B, T, -1))
  np.testing.assert_allclose(new.out, old, rtol=1e-5, atol=1e-6)
  old_kl = ops.indexer_loss(*attention.indexer(x, c_q, positions), q, k, None, None, attn_scale=scale,
                            index_scale=attention.indexer.score_scale, segment_ids=(segment_ids, segment_ids))
  np.testing.assert_allclose(float(new.indexer_loss), float(old_kl), rtol=1e-5)
  # The dense KL kernels (interpret mode here) read the attention's detached LSE: the same loss.
  kernels = attention(x, positions, segment_ids, dense=True, backends=types.SimpleNamespace(indexer_loss="pallas"))
  np.testing.assert_allclose(float(kernels.indexer_loss), float(old_kl), rtol=1e-5)
