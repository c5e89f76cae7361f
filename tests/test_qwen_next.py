"""Qwen3.8-Flash-Next QSA: block keys, token expansion, gated GQA against a float64 oracle, the
invariants of architectures.md §4.3, the block-level indexer KL, replay, and training with resume."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import qwen3_8_flash_next
from hyscale_jax import models, remat
from hyscale_jax.layers.qsa import QSAAttention, dense_block_indexer_loss, expand_blocks
from hyscale_jax.model_config import ModelConfig

try:
  from tests.jaxpr_tools import equations
  from tests.lm_runs import assert_trains_both_stages_and_resumes, small_lm_config
except ImportError:  # tests/ itself is on sys.path
  from jaxpr_tools import equations
  from lm_runs import assert_trains_both_stages_and_resumes, small_lm_config

_SMALL = ModelConfig(
    architecture="qwen4_exp", vocab_size=64, d_model=32, n_layers=2, first_k_dense=0,
    layer_types=("qsa", "qsa"), n_heads=4, n_kv_heads=2, head_dim=16, qk_rope_dim=4,
    index_n_heads=2, index_head_dim=8, index_rope_dim=4, index_topk=3, qsa_block=4,
    n_routed_experts=4, experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="softmax",
    routed_scaling=1.0, rms_eps=1e-6, rope_theta=10000.0)
B, T = 2, 32


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, _SMALL.d_model), jnp.float32)


def _inputs(documents=False):
  seg = (jnp.arange(T) >= 13).astype(jnp.int32) if documents else jnp.zeros(T, jnp.int32)
  positions = jnp.where(seg == 0, jnp.arange(T), jnp.arange(T) - 13).astype(jnp.int32)
  return jnp.broadcast_to(positions, (B, T)), jnp.broadcast_to(seg, (B, T))


def _layer(cfg=_SMALL, seed=0):
  layer = QSAAttention(cfg, rngs=nnx.Rngs(seed))
  for norm in (layer.q_norm, layer.k_norm):  # nonzero (1 + w) weights, so the norms are exercised
    norm.weight[...] = jax.random.normal(jax.random.key(seed + 7), norm.weight.shape) * 0.3
  return layer


def test_block_key_depends_only_on_its_tokens():
  layer = _layer()
  positions, seg = _inputs()
  _, base, _ = layer.indexer(_x(), positions, seg)
  for p in (0, 9, 30):
    _, got, _ = layer.indexer(_x().at[:, p].add(2.0), positions, seg)
    changed = np.abs(np.asarray(got - base)).max(axis=(0, 2)) > 1e-6
    assert changed.tolist() == [b == p // 4 for b in range(T // 4)], (p, changed)


def test_expanded_indices_are_causal_and_keep_the_tail():
  positions, seg = _inputs(documents=True)
  rng = np.random.default_rng(0)
  t = np.arange(T)[None, :, None]
  blocks = rng.integers(0, T // 4, (B, T, 3))
  blocks = np.where((blocks + 1) * 4 <= t + 1, blocks, -1).astype(np.int32)
  tokens = np.asarray(expand_blocks(jnp.asarray(blocks), seg, 4))
  assert tokens.shape == (B, T, 3 * 4 + 3)
  assert ((tokens == -1) | (tokens <= t)).all()
  segn = np.asarray(seg)
  for b in range(B):
    for s in range(T):
      row = set(tokens[b, s].tolist())
      tail = [u for u in range((s + 1) // 4 * 4, s + 1) if segn[b, u] == segn[b, s]]
      assert set(tail) <= row, (s, tail, row)
      assert all(segn[b, u] == segn[b, s] for u in row if u >= 0)


@pytest.mark.parametrize("documents", [False, True])
def test_gated_gqa_matches_float64_oracle(documents):
  layer = _layer()
  positions, seg = _inputs(documents)
  x = _x(1)
  out = layer(x, positions, seg, dense=True).out
  q, k, v, gate = (np.asarray(a, np.float64) for a in layer.qkv_gate(x, positions))
  G = _SMALL.n_kv_heads
  rep = lambda a: np.repeat(a, _SMALL.n_heads // G, axis=2)
  logits = np.einsum("bthd,bshd->bhts", q, rep(k)) * layer.scale
  segn = np.asarray(seg)
  visible = np.tril(np.ones((T, T), bool))[None] & (segn[:, :, None] == segn[:, None, :])
  logits = np.where(visible[:, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  core = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), rep(v)) / (1 + np.exp(-gate))
  want = layer.o_proj(jnp.asarray(core.reshape(B, T, -1), jnp.float32))
  np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("documents,pool", [(False, "sum"), (True, "sum"), (True, "max")])
def test_a_budget_covering_every_block_is_dense_causal_attention(documents, pool):
  layer = _layer(dataclasses.replace(_SMALL, index_topk=T // 4, indexer_pool=pool))
  positions, seg = _inputs(documents)
  sparse = layer(_x(2), positions, seg)
  dense = layer(_x(2), positions, seg, dense=True)
  np.testing.assert_allclose(sparse.out, dense.out, rtol=1e-5, atol=1e-6)
  # ... and the block KL's sparse form (ops.indexer_loss, block form) over every visible block
  # equals its dense form, in value and in the indexer's gradients
  np.testing.assert_allclose(float(sparse.indexer_loss), float(dense.indexer_loss), rtol=1e-5)
  graphdef, indexer_params, rest = nnx.split(layer, lambda path, _: "indexer" in path and "index_qk_proj" in path,
                                             ...)

  def loss(params, dense):
    return nnx.merge(graphdef, params, rest)(_x(2), positions, seg, dense=dense).indexer_loss

  for got, want in zip(jax.tree.leaves(jax.grad(loss)(indexer_params, False)),
                       jax.tree.leaves(jax.grad(loss)(indexer_params, True))):
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def test_selection_is_causal_and_sized_by_the_budget():
  layer = _layer()
  positions, seg = _inputs()
  blocks = np.asarray(layer(_x(3), positions, seg).indices)
  t = np.arange(T)[None, :, None]
  assert ((blocks == -1) | ((blocks + 1) * 4 <= t + 1)).all()
  assert ((blocks >= 0).sum(-1) == np.minimum((np.arange(T) + 1) // 4, _SMALL.index_topk)).all()


@pytest.mark.parametrize("pool", ["sum", "max"])
def test_block_kl_gradients_reach_only_the_indexer_inputs(pool):
  layer = _layer(dataclasses.replace(_SMALL, indexer_pool=pool))
  positions, seg = _inputs()
  x = _x(4)
  index_q, block_keys, block_seg = layer.indexer(x, positions, seg)
  q, k, _, _ = layer.qkv_gate(x, positions)

  def loss(index_q, block_keys, q, k):
    return dense_block_indexer_loss(index_q, block_keys, q, k, (seg, block_seg), block=4,
                                    attn_scale=layer.scale, index_scale=layer.indexer.score_scale, pool=pool)

  value = loss(index_q, block_keys, q, k)
  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(index_q, block_keys, q, k)
  assert float(value) > 0
  assert np.abs(np.asarray(grads[0])).max() > 0 and np.abs(np.asarray(grads[1])).max() > 0
  assert not np.asarray(grads[2]).any() and not np.asarray(grads[3]).any()


def test_dense_block_kl_streams_over_row_chunks_with_the_same_value_and_gradients():
  layer = _layer()
  positions, seg = _inputs(documents=True)
  x = _x(5)
  index_q, block_keys, block_seg = layer.indexer(x, positions, seg)
  q, k, _, _ = layer.qkv_gate(x, positions)

  def loss(index_q, block_keys, row_chunk):
    return dense_block_indexer_loss(index_q, block_keys, q, k, (seg, block_seg), block=4, attn_scale=layer.scale,
                                    index_scale=layer.indexer.score_scale, row_chunk=row_chunk)

  whole = jax.value_and_grad(loss, (0, 1))(index_q, block_keys, T)
  chunked = jax.value_and_grad(loss, (0, 1))(index_q, block_keys, 5)  # 5 does not divide T = 32
  np.testing.assert_allclose(float(chunked[0]), float(whole[0]), rtol=1e-5)
  for got, want in zip(chunked[1], whole[1]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)), static_argnums=2)(index_q, block_keys, 5)
  assert not [v.aval.shape for e in equations(jaxpr) for v in e.outvars if sum(d >= T for d in v.aval.shape) >= 2]


def test_a_frozen_indexer_adds_no_loss():
  model = models.build(dataclasses.replace(_SMALL, indexer_frozen=True), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, _SMALL.vocab_size)
  assert float(model(tokens).aux["indexer_loss"]) == 0.0


@pytest.mark.parametrize("policy, per_layer", [("selection_replay", 1), ("full", 2)])
def test_one_selection_per_qsa_layer_under_selection_replay(policy, per_layer):
  model = models.build(dataclasses.replace(_SMALL, remat_policy=policy), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, _SMALL.vocab_size)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def total(params):
    out = nnx.merge(graphdef, params, rest)(tokens)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean() + out.aux["indexer_loss"]

  jaxpr = jax.make_jaxpr(jax.grad(total))(params)
  assert remat.count_named_equations(jaxpr, "flash_topk") == per_layer * _SMALL.n_layers


def test_config_checks_name_the_field():
  with pytest.raises(ValueError, match="layer_types"):
    dataclasses.replace(_SMALL, layer_types=("qsa",))
  with pytest.raises(ValueError, match="indexer_pool"):
    dataclasses.replace(_SMALL, indexer_pool="mean")


# CI time: resuming is the same code for every model (tests/test_reliability.py).
@pytest.mark.slow
def test_hybrid_stack_trains_both_stages_and_resumes(tmp_path):
  # The published pattern: three Gated DeltaNet layers, then a QSA layer.
  hybrid = dataclasses.replace(_SMALL, n_layers=4, layer_types=("gated_deltanet",) * 3 + ("qsa",),
                               linear_n_key_heads=2, linear_n_value_heads=4, linear_key_dim=8, linear_value_dim=8,
                               linear_chunk=16)
  make = lambda steps: small_lm_config(qwen3_8_flash_next.get_config, hybrid, tmp_path, steps)
  assert_trains_both_stages_and_resumes(make, tmp_path / "run")
