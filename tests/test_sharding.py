"""Logical axis rules on 8 fake CPU devices: parameter placement, errors, checkpoints across meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import glm5_1
from hyscale_jax import models, parallel
from hyscale_jax import sharding as shd
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training.checkpoints import Checkpointer


def _config(**mesh):
  config = glm5_1.get_config("tiny")
  config.model.update(d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4,
                      experts_per_token=2, moe_inter=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8,
                      index_topk=8, vocab_size=512)
  config.mesh.update(mesh)
  return config


def _state(config):
  """Params and AdamW state of the small GLM-5.1, unplaced."""
  model = models.build(ModelConfig.from_config(config.model), rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  return {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jnp.int32(3)}


def _placed(config):
  mesh = parallel.make_mesh(config.mesh)
  rules = shd.rules_from_config(config.mesh)
  state = _state(config)
  return jax.device_put(state, shd.state_shardings(state, mesh, rules))


def test_parameters_and_optimizer_state_are_split_by_the_rules():
  state = _placed(_config(fsdp=2, expert=2, tensor=2))
  spec = lambda *path: state["params"][path[0]][path[1]][path[2]][path[3]][path[4]].sharding.spec
  assert spec("layers", 0, "self_attn", "q_a_proj", "kernel") == P("fsdp", None)  # q_lora: fsdp already used
  assert spec("layers", 0, "self_attn", "q_b_proj", "kernel") == P("fsdp", "tensor")
  assert spec("layers", 0, "self_attn", "o_proj", "kernel") == P("tensor", "fsdp")
  assert spec("layers", 0, "mlp", "gate_proj", "kernel") == P("fsdp", "tensor")
  moe = state["params"]["layers"][1]["mlp"]
  assert moe["experts_gate_proj"].sharding.spec == P("expert", "fsdp", "tensor")
  assert moe["experts_down_proj"].sharding.spec == P("expert", "tensor", "fsdp")
  assert state["params"]["embed_tokens"]["embedding"].sharding.spec == P("tensor", "fsdp")
  assert state["params"]["norm"]["scale"].sharding.spec == P(None)
  # A device holds a quarter of a dense kernel, and the AdamW moments are split the same way.
  kernel = state["params"]["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
  assert kernel.addressable_shards[0].data.size == kernel.size // 4
  mu = state["opt_state"][0].mu["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
  assert mu.sharding.spec == P("fsdp", "tensor")


def test_a_mesh_axis_that_does_not_divide_a_parameter_is_named():
  class Tiny(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros((6, 4)), **shd.param(shd.EMBED, shd.MLP))

  mesh = parallel.make_mesh(_config(fsdp=4, data=2).mesh)
  with pytest.raises(ValueError, match=r"parameter .*w.* of shape \(6, 4\): dimension 0 \(6\) does not divide over "
                                       r"mesh axes \('fsdp',\) of size 4"):
    shd.state_shardings(nnx.state(Tiny()), mesh, shd.rules_from_config(_config().mesh))


@pytest.mark.parametrize("target", [dict(fsdp=8), dict(data=1)])
def test_a_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path, target):
  source = _placed(_config(data=2, fsdp=4))
  assert source["params"]["lm_head"]["kernel"][...].sharding.spec == P("fsdp", "tensor")  # tensor has size 1
  saver = Checkpointer(str(tmp_path), every_steps=1)
  saver.maybe_save(3, source, {"step": 3})
  saver.close()

  abstract = _placed(_config(**target))  # the target layout; its values are overwritten
  step, restored, meta = Checkpointer(str(tmp_path), every_steps=1).restore_latest(abstract)
  assert step == 3 and meta == {"step": 3}
  want, got = jax.tree.leaves(source), jax.tree.leaves(restored)
  assert len(want) == len(got) > 20
  for w, g, a in zip(want, got, jax.tree.leaves(abstract)):
    assert g.sharding == a.sharding  # laid out for the new mesh
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
