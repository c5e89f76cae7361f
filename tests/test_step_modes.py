"""Step modes (issue 9): every mode gives the same loss and gradients on a tiny GLM-5.1 and QSA model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import glm5_1
from hyscale_jax import models
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training import step_modes

_GLM = ModelConfig(vocab_size=64, d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2,
                   q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=8,
                   n_routed_experts=4, experts_per_token=2, moe_inter=16, index_n_heads=2, index_head_dim=8,
                   index_rope_dim=4, index_topk=6)
_QSA = ModelConfig(architecture="qwen4_exp", vocab_size=64, d_model=32, n_layers=1, first_k_dense=0,
                   layer_types=("qsa",), n_heads=4, n_kv_heads=2, head_dim=16, qk_rope_dim=4, index_n_heads=2,
                   index_head_dim=8, index_rope_dim=4, index_topk=3, qsa_block=4, n_routed_experts=4,
                   experts_per_token=2, moe_inter=16, scoring="softmax", routed_scaling=1.0)


def _loss_and_grads(cfg, mode):
  ops, overrides = step_modes.settings(mode)
  if overrides["attention_query_chunk"]:  # four chunks of the 32 tokens
    overrides.update(attention_query_chunk=8, ffn_token_chunk=8)
  model = models.build(dataclasses.replace(cfg, **overrides), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size)
  backends = type("Backends", (), ops)

  def loss(params):
    out = nnx.merge(graphdef, params, rest)(tokens, backends=backends)
    return jnp.mean(out.logits**2) + out.aux["indexer_loss"]

  return jax.value_and_grad(loss)(params)


# CI time: the modes switch the same ops for every layer kind; QSA's runs with SLOW=1.
@pytest.mark.parametrize("cfg", [_GLM, pytest.param(_QSA, marks=pytest.mark.slow)], ids=["glm", "qsa"])
def test_every_mode_gives_the_same_loss_and_gradients(cfg):
  want_loss, want_grads = _loss_and_grads(cfg, "megatron_style")
  for mode in step_modes.STEP_MODES[1:] + step_modes.ABLATIONS:
    loss, grads = _loss_and_grads(cfg, mode)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=mode)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
      np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6, err_msg=mode)


def test_apply_writes_the_mode_into_the_config():
  config = glm5_1.get_config("tiny")
  config.step_mode = "megatron_style"
  applied = step_modes.apply(config)
  assert applied.ops.flash_topk == "xla_baseline" and applied.model.remat_policy == "full"
  assert config.ops.flash_topk == "auto"  # the caller's config is left as it was
  config.step_mode = "hyscale"
  applied = step_modes.apply(config)
  assert applied.model.indexer_loss_grad_in_forward
  assert applied.model.attention_query_chunk == applied.model.ffn_token_chunk == 131072
  # The mode turns chunking on; a chunk size the user set is theirs.
  config.model.attention_query_chunk, config.model.ffn_token_chunk = 32768, 16384
  applied = step_modes.apply(config)
  assert (applied.model.attention_query_chunk, applied.model.ffn_token_chunk) == (32768, 16384)
  config.step_mode = "megatron_style"
  assert step_modes.apply(config).model.attention_query_chunk == 0


def test_unknown_mode_is_named():
  with pytest.raises(ValueError, match="step_mode='fast'"):
    step_modes.settings("fast")
