"""Gated DeltaNet: the layer against transformers' math in float64, packed documents, context shards,
the hybrid [GDN, GDN, GDN, QSA] Qwen3.8-Flash-Next stack and its published size (the hybrid stack's
training run is tests/test_qwen_next.py's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import qwen3_8_flash_next
from hyscale_jax import models
from hyscale_jax.layers.gated_deltanet import GatedDeltaNet
from hyscale_jax.model_config import ModelConfig

try:
  from tests.oracles import gated_deltanet_oracle
except ImportError:  # tests/ itself is on sys.path
  from oracles import gated_deltanet_oracle

_HYBRID = ModelConfig(
    architecture="qwen4_exp", vocab_size=64, d_model=32, n_layers=4, first_k_dense=0,
    layer_types=("gated_deltanet",) * 3 + ("qsa",), n_heads=4, n_kv_heads=2, head_dim=16, qk_rope_dim=4,
    index_n_heads=2, index_head_dim=8, index_rope_dim=4, index_topk=3, qsa_block=4,
    n_routed_experts=4, experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="softmax",
    routed_scaling=1.0, rms_eps=1e-6, rope_theta=10000.0, linear_n_key_heads=2, linear_n_value_heads=4,
    linear_key_dim=8, linear_value_dim=6, linear_conv_kernel=4, linear_chunk=8)
B, T = 2, 29  # not a multiple of the chunk


def _segments():
  """Row 0: documents of 11, 1 and 17 tokens; row 1: one document."""
  return jnp.asarray(np.stack([np.searchsorted([11, 12], np.arange(T), side="right"), np.zeros(T, int)]), jnp.int32)


def _layer(cfg=_HYBRID, seed=0):
  layer = GatedDeltaNet(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 1)
  # Away from their initial constants, so the oracle comparison exercises them.
  for name in ("norm", "dt_bias"):
    param = getattr(layer, name)
    param[...] = param[...] + jnp.asarray(rng.normal(0, 0.3, param.shape), jnp.float32)
  return layer


def _apply(layer, x, seg):
  """The layer's output [B, T, D], jitted (eager dispatch of the chunk scan is slow on CPU)."""
  graphdef, state = nnx.split(layer)
  return jax.jit(lambda state, x, seg: nnx.merge(graphdef, state)(x, None, seg).out)(state, x, seg)


def _params(layer):
  linears = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
  params = {name: np.asarray(getattr(layer, name).kernel[...]) for name in linears}
  params.update({name: np.asarray(getattr(layer, name)[...]) for name in ("conv1d", "dt_bias", "A_log", "norm")})
  return params


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, _HYBRID.d_model), jnp.float32)


@pytest.mark.parametrize("gate", ["sigmoid", "silu"])
def test_layer_matches_transformers_math_in_float64(gate):
  cfg = dataclasses.replace(_HYBRID, linear_output_gate=gate)
  layer, seg = _layer(cfg), _segments()
  out = jax.eval_shape(lambda x: layer(x, None, seg), _x())
  assert out.indices is None and out.indexer_loss is None and out.out.shape == (B, T, cfg.d_model)
  want = gated_deltanet_oracle(_x(), _params(layer), n_key_heads=2, key_dim=8, value_dim=6, eps=cfg.rms_eps,
                               gate=gate, segment_ids=np.asarray(seg))
  np.testing.assert_allclose(_apply(layer, _x(), seg), want, rtol=1e-4, atol=1e-5)


def test_packed_documents_equal_the_documents_alone():
  layer, seg = _layer(), _segments()
  packed = _apply(layer, _x(), seg)
  for start, stop in ((0, 11), (11, 12), (12, T)):
    alone = _apply(layer, _x()[:1, start:stop], jnp.zeros((1, stop - start), jnp.int32))
    np.testing.assert_allclose(packed[:1, start:stop], alone, rtol=1e-5, atol=1e-6)


def test_a_context_mesh_gives_the_layers_values_and_gradients():
  layer, seg = _layer(), _segments()[:, :28]  # 4 shards of 7 tokens; the conv reaches across them
  x = _x()[:, :28]
  graphdef, params = nnx.split(layer)
  loss = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x, None, seg).out ** 2), (0, 1)))
  want = loss(params, x)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    got = loss(params, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_full_config_builds_at_the_published_size():
  cfg = ModelConfig.from_config(qwen3_8_flash_next.get_config("full").model)
  assert cfg.layer_types == (("gated_deltanet",) * 3 + ("qsa",)) * 12
  total, active = models.count_params(cfg)
  # About 125B total / 6B active (architectures.md §4.1) beside 51B of Engram n-gram tables (counted
  # apart, as in the published figures); the 6B leaves out the embedding and the head.
  embed_and_head = 2 * cfg.vocab_size * cfg.d_model
  ngram_tables = 320_001_536 * 160  # 16 prime tables from 20M rows, 160 features each
  assert (total, active) == (176_943_899_520, 7_306_997_120)
  assert round((total - ngram_tables) / 1e9, 1) == 125.7
  assert round((active - embed_and_head) / 1e9, 1) == 6.0


def test_tiny_config_stacks_three_gated_deltanet_layers_per_qsa_layer():
  cfg = ModelConfig.from_config(qwen3_8_flash_next.get_config("tiny").model)
  model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  kinds = [type(layer.self_attn).__name__ for layer in model.layers]
  assert kinds == ["GatedDeltaNet"] * 3 + ["QSAAttention"]


@pytest.mark.parametrize("bad, match", [
    (dict(linear_n_value_heads=3), "linear_n_value_heads=3 must be a multiple"),
    (dict(linear_output_gate="relu"), "linear_output_gate"),
    (dict(linear_chunk=0), "linear_chunk must be a positive int"),
])
def test_bad_gated_deltanet_config_is_named(bad, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(_HYBRID, **bad)



@pytest.mark.slow
def test_the_hybrid_model_on_a_context_mesh_matches_one_device():
  # [GDN x3, QSA] with packed documents: every op splits the sequence over 4 context shards.
  model = models.build(dataclasses.replace(_HYBRID, remat_policy="none"), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(2), (B, 32), 0, _HYBRID.vocab_size)
  seg = jnp.broadcast_to((jnp.arange(32) >= 13).astype(jnp.int32), (B, 32))
  positions = jnp.where(seg == 0, jnp.arange(32), jnp.arange(32) - 13).astype(jnp.int32)

  def loss(params):
    out = nnx.merge(graphdef, params, rest)(tokens, positions=positions, segment_ids=seg)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean() + out.aux["indexer_loss"]

  step = jax.jit(jax.value_and_grad(loss))
  want = step(params)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    assert str(jax.make_jaxpr(loss)(params)).count("shard_map") >= 3  # the GDN layers' ops, at least
    got = step(params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
