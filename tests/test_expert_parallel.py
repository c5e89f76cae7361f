"""Expert parallelism on 8 fake CPU devices: the all-to-all MoE equals the one-device MoE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from hyscale_jax.layers.moe import MoE
from hyscale_jax.parallel import expert as expert_parallel

D, F, E, K = 16, 8, 8, 2


def _mesh(**sizes):
  axes = ("data", "fsdp", "expert", "context", "tensor")
  shape = tuple(sizes.get(a, 1) for a in axes)
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def _loss_and_grads(moe, x, dy):
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

  def loss(params, x):
    y, load = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y * dy), load

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.mark.parametrize("mesh", [dict(expert=8), dict(data=2, expert=2, context=2), dict(fsdp=2, expert=4)])
def test_expert_parallel_moe_matches_one_device(mesh):
  # Skewed routing: a few experts get most copies, so the all-to-all blocks are uneven.
  moe = MoE(D, F, E, K, n_shared_experts=1, rngs=nnx.Rngs(0))
  moe.e_score_correction_bias[...] = jnp.asarray([2.0, 1.0, 0, 0, 0, 0, 0, -1.0])
  B, T = 8, 8
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  dy = jax.random.normal(jax.random.key(2), (B, T, D))
  (want, want_load), (want_dp, want_dx) = _loss_and_grads(moe, x, dy)
  with jax.set_mesh(_mesh(**mesh)):
    jaxpr = jax.make_jaxpr(lambda x: moe(x))(x)
    (got, got_load), (got_dp, got_dx) = _loss_and_grads(moe, x, dy)
  assert "all_to_all" in str(jaxpr)  # the copies really travelled to their experts' devices
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_array_equal(got_load, want_load)
  np.testing.assert_allclose(got_dx, want_dx, rtol=1e-5, atol=1e-6)
  for (path, g), (_, w) in zip(nnx.to_flat_state(got_dp), nnx.to_flat_state(want_dp)):
    # Weight gradients sum over tokens in another order (per device, then across): f32 rounding
    # of that sum, relative to the gradient's scale.
    w = np.asarray(w[...])
    np.testing.assert_allclose(g[...], w, rtol=1e-5, atol=1e-6 * np.abs(w).max(), err_msg=str(path))
  assert np.asarray(want_load).max() > 2 / E  # the routing really was uneven


def test_expert_axis_must_divide_the_experts():
  moe = MoE(D, F, 6, K, n_shared_experts=0, rngs=nnx.Rngs(0))
  with jax.set_mesh(_mesh(expert=4, data=2)):
    assert expert_parallel.expert_mesh() is not None
    with pytest.raises(ValueError, match="n_routed_experts=6 must divide over mesh axis 'expert' of size 4"):
      moe(jnp.ones((8, 2, D)))
