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


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """`lax.ragged_all_to_all` from all_gathers (XLA:CPU lacks the op): sender s's slice
  operand_s[input_offsets_s[me] : + send_sizes_s[me]] lands at output[output_offsets_s[me] : ...]."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  gather = lambda a: jax.lax.all_gather(a, axis_name)
  operands = gather(operand)  # [n, C, D]
  start, size, dest = (gather(a)[:, me] for a in (input_offsets, send_sizes, output_offsets))  # [n] per sender
  p = jnp.arange(output.shape[0])
  inside = (p >= dest[:, None]) & (p < (dest + size)[:, None])  # [n, R]
  sender = jnp.argmax(inside, axis=0)
  src = jnp.clip(start[sender] + p - dest[sender], 0, operand.shape[0] - 1)
  return jnp.where(inside.any(0)[:, None], operands[sender, src], output)


def _assert_moe_matches_one_device(mesh):
  """Values and gradients of a skew-routed MoE under `mesh` equal the one-device MoE's; returns its jaxpr."""
  moe = MoE(D, F, E, K, n_shared_experts=0, rngs=nnx.Rngs(0))
  moe.e_score_correction_bias[...] = jnp.asarray([2.0, 1.0, 0, 0, 0, 0, 0, -1.0])
  x = jax.random.normal(jax.random.key(1), (8, 8, D))
  dy = jax.random.normal(jax.random.key(2), (8, 8, D))
  (want, _), (want_dp, want_dx) = _loss_and_grads(moe, x, dy)
  with jax.set_mesh(_mesh(**mesh)):
    jaxpr = jax.make_jaxpr(lambda x: moe(x))(x)
    (got, _), (got_dp, got_dx) = _loss_and_grads(moe, x, dy)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(got_dx, want_dx, rtol=1e-5, atol=1e-6)
  for (path, g), (_, w) in zip(nnx.to_flat_state(got_dp), nnx.to_flat_state(want_dp)):
    w = np.asarray(w[...])
    np.testing.assert_allclose(g[...], w, rtol=1e-5, atol=1e-6 * np.abs(w).max(), err_msg=str(path))
  return str(jaxpr)


@pytest.mark.parametrize("mesh", [dict(expert=8), dict(data=2, expert=4)])
def test_ragged_dispatch_matches_one_device(mesh, monkeypatch):
  """The GPU path's offsets and regrouping (values and gradients), with the exchange emulated on CPU."""
  monkeypatch.setattr(expert_parallel, "_ragged_all_to_all", _emulated_ragged_all_to_all)
  monkeypatch.setattr(expert_parallel, "_dispatch", expert_parallel._dispatch_ragged)  # what GPU chooses
  _assert_moe_matches_one_device(mesh)


@pytest.mark.gpu_only
@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() not in (2, 4, 8), reason="needs 2-8 GPUs")
def test_real_ragged_all_to_all_on_gpus_matches_one_device():
  assert "ragged_all_to_all" in _assert_moe_matches_one_device(dict(expert=jax.device_count()))


def test_ragged_dispatch_lowers_for_cuda():
  """The real ragged_all_to_all (forward and backward) lowers to StableHLO for a CUDA target."""
  moe = MoE(D, F, E, K, n_shared_experts=0, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
  x = jnp.ones((8, 8, D))

  def loss(params, x):
    experts = (params["experts_gate_proj"][...], params["experts_up_proj"][...], params["experts_down_proj"][...])
    ids = jnp.broadcast_to(jnp.arange(8 * 8 * K, dtype=jnp.int32).reshape(8, 8, K) % E, (8, 8, K))
    grouped = lambda rows, sizes, *w: nnx.merge(graphdef, params, rest)._grouped_swiglu(rows, sizes, *w,
                                                                                         backend="reference")
    out, _ = expert_parallel.expert_parallel(x, ids, experts, grouped, mesh=mesh, ragged=True)
    return jnp.square(out).sum()

  mesh = _mesh(expert=8)
  with jax.set_mesh(mesh):
    # XLA:GPU emits the op as a custom call with no export-stability promise; we only lower here.
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(
                                     params, x)
  text = exported.mlir_module()
  assert text.count("custom_call @ragged_all_to_all") == 4  # two exchanges forward, their transposes backward


def test_hash_routed_moe_matches_one_device_under_expert_parallelism():
  # DeepSeek-V4's hash layers: the fixed table picks the experts, the all-to-all dispatch is the same.
  V = 13
  moe = MoE(D, F, E, K, n_shared_experts=1, scoring="sqrtsoftplus", selection_bias=False, hash_vocab=V,
            rngs=nnx.Rngs(0))
  B, T = 8, 8
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  token_ids = jax.random.randint(jax.random.key(3), (B, T), 0, V)
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

  def loss(params, x):
    y, load = nnx.merge(graphdef, params, rest)(x, token_ids=token_ids)
    return jnp.sum(y ** 2), load

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (want, want_load), want_dp = grad(params, x)
  with jax.set_mesh(_mesh(expert=4, data=2)):
    assert "all_to_all" in str(jax.make_jaxpr(lambda x: moe(x, token_ids=token_ids))(x))
    (got, got_load), got_dp = grad(params, x)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_array_equal(got_load, want_load)
  for (path, g), (_, w) in zip(nnx.to_flat_state(got_dp), nnx.to_flat_state(want_dp)):
    w = np.asarray(w[...])
    np.testing.assert_allclose(g[...], w, rtol=1e-5, atol=1e-6 * np.abs(w).max(), err_msg=str(path))
