"""Residual-stream hyper-connections (mHC, gated residual), the gated shared expert and the bias-free router.

Parity with transformers is in test_convert.py; these check the pieces on their own.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyscale_jax import models
from hyscale_jax.layers.hyper_connections import (GatedResidual, ManifoldHyperConnection, expand_streams,
                                                  sinkhorn)
from hyscale_jax.layers.moe import MoE, RouterBias, update_router_bias
from hyscale_jax.model_config import ModelConfig
from tests import jaxpr_tools

B, T, N, D = 2, 8, 3, 16


def test_sinkhorn_is_near_doubly_stochastic():
  logits = jax.random.normal(jax.random.key(0), (B, T, N, N))
  m = np.asarray(sinkhorn(logits, iters=20, eps=1e-6))
  assert (m > 0).all()
  np.testing.assert_allclose(m.sum(-2), 1.0, atol=1e-5)  # columns: normalised last
  np.testing.assert_allclose(m.sum(-1), 1.0, atol=1e-3)
  # Unrolled, forward and backward: a loop would run its 20 steps as launches one after another.
  grad = jax.grad(lambda x: sinkhorn(x, iters=20, eps=1e-6).sum())
  assert not jaxpr_tools.lowers_to_loop(grad, logits)


def test_mhc_with_identity_mixing_is_a_weighted_residual():
  hc = ManifoldHyperConnection(D, N, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6, rngs=nnx.Rngs(0))
  streams = jax.random.normal(jax.random.key(1), (B, T, N, D))
  block_input, (post, comb) = hc.enter(streams)
  assert block_input.shape == (B, T, D) and post.shape == (B, T, N) and comb.shape == (B, T, N, N)
  output = jax.random.normal(jax.random.key(2), (B, T, D))
  identity = jnp.broadcast_to(jnp.eye(N), comb.shape)
  out = hc.leave(streams, output, (post, identity))
  np.testing.assert_allclose(out, streams + post[..., None] * output[:, :, None], rtol=1e-6, atol=1e-6)


def test_gated_residual_adds_the_block_output_to_every_stream():
  hc = GatedResidual(D, N, 4, eps=1e-6, rngs=nnx.Rngs(0))
  streams = expand_streams(jax.random.normal(jax.random.key(1), (B, T, D)), N)
  block_input, inject = hc.enter(streams)
  assert block_input.shape == (B, T, D) and inject.shape == (B, T, N)
  assert ((inject > 0) & (inject < 2)).all()
  output = jnp.ones((B, T, D))
  np.testing.assert_allclose(hc.leave(streams, output, inject) - streams, jnp.broadcast_to(
      inject[..., None], (B, T, N, D)), rtol=1e-6)
  with pytest.raises(ValueError, match="inject=True"):
    GatedResidual(D, N, 4, eps=1e-6, inject=False, rngs=nnx.Rngs(0)).enter(streams)


def _moe(**kwargs):
  return MoE(D, 8, 4, 2, 1, scoring="softmax", rngs=nnx.Rngs(0), **kwargs)


def test_shared_expert_gate_scales_the_shared_expert():
  gated, plain = _moe(shared_expert_gate=True), _moe()
  gated.shared_expert_gate.kernel[...] = jnp.zeros((D, 1))  # sigmoid(0) = 1/2
  x = jax.random.normal(jax.random.key(3), (B, T, D))
  shared = plain.shared_experts(x)
  np.testing.assert_allclose(gated(x)[0], plain(x)[0] - 0.5 * shared, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="shared_expert_gate"):
    MoE(D, 8, 4, 2, 0, shared_expert_gate=True, rngs=nnx.Rngs(0))


def test_router_without_selection_bias_has_none_to_update():
  moe = _moe(selection_bias=False)
  assert not jax.tree.leaves(nnx.state(moe, RouterBias))
  update_router_bias(moe, jnp.full((4,), 0.25), rate=0.1)  # a no-op, not an error
  assert moe.e_score_correction_bias is None


_V4 = ModelConfig(architecture="deepseek_v4", vocab_size=64, d_model=32, n_layers=2, first_k_dense=0, n_heads=2,
                  head_dim=16, qk_rope_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=4,
                  compress_ratios=(0, 4), csa_ratio=4, index_n_heads=2, index_head_dim=8, index_topk=2,
                  index_rope_dim=4, n_routed_experts=4, experts_per_token=2, moe_inter=8, scoring="sqrtsoftplus",
                  hc_mult=2)
_QWEN = ModelConfig(architecture="qwen4_exp", vocab_size=64, d_model=32, n_layers=2, first_k_dense=0,
                    layer_types=("qsa", "qsa"), n_heads=2, n_kv_heads=1, head_dim=16, qk_rope_dim=8,
                    index_n_heads=2, index_head_dim=8, index_rope_dim=8, index_topk=2, qsa_block=2,
                    n_routed_experts=4, experts_per_token=2, moe_inter=8, scoring="softmax", hc_mult=2,
                    hc_lowrank=4, shared_expert_gate=True, router_bias=False, indexer_norm_zero_centered=True)


@pytest.mark.parametrize("cfg", [_V4, _QWEN], ids=["deepseek_v4", "qwen4_exp"])
def test_stream_models_give_finite_gradients_to_every_connection(cfg):
  model = models.build(cfg, rngs=nnx.Rngs(0))
  assert (model.norm is None) == (cfg.architecture == "qwen4_exp")  # the gated mixer replaces it
  tokens = jax.random.randint(jax.random.key(0), (B, 16), 0, cfg.vocab_size)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens).logits ** 2)
  grads = nnx.to_flat_state(jax.grad(loss)(params))
  connection_grads = {path: g for path, g in grads if any(str(p) in ("attn_hc", "mlp_hc", "hc_head") for p in path)}
  assert connection_grads
  for path, g in connection_grads.items():
    assert np.isfinite(np.asarray(g[...])).all() and np.abs(np.asarray(g[...])).max() > 0, path


def test_hyper_connection_fields_are_checked():
  with pytest.raises(ValueError, match="hc_lowrank"):
    dataclasses.replace(_QWEN, hc_lowrank=0)
  with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
    dataclasses.replace(_V4, hc_sinkhorn_iters=0)
  with pytest.raises(ValueError, match="hc_mult"):
    dataclasses.replace(_V4, hc_mult=-1)
