"""The Pallas sparse-attention kernels (interpret mode on CPU) against the float64 oracle and the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops, remat
from pallas_kernels.sparse_attention import (
    Config,
    attention_teacher_pallas,
    sparse_attention_backward_pallas,
    sparse_attention_forward_pallas,
)

try:
  from tests.attention_shapes import MLA_DK, mla_backward_inputs
  from tests.jaxpr_tools import equations, export_for_h200
  from tests.oracles import sparse_attention_grads_oracle, sparse_attention_oracle
except ImportError:
  from attention_shapes import MLA_DK, mla_backward_inputs
  from jaxpr_tools import equations, export_for_h200
  from oracles import sparse_attention_grads_oracle, sparse_attention_oracle

# name -> (B, T, S, H, G, Dk, Dv, K, sinks, config)
_CASES = {
    "mqa_absorbed_like": (2, 5, 11, 4, 1, 12, 8, 6, False, Config(block_k=4)),  # Dk = 8 + 4, like 512 + 64
    "gqa_sinks": (1, 7, 16, 4, 2, 8, 8, 9, True, Config(block_h=2, block_k=4)),
    "mqa_sinks_ragged": (2, 3, 37, 8, 1, 16, 16, 19, True, Config()),
    # 3 heads per group are padded to 4 (QSA's 12 become 16 on the GPU); K = 11 pads to 12.
    "gqa_padded_heads": (1, 6, 9, 6, 2, 8, 4, 11, True, Config(block_h=2, block_k=4)),
}


def _inputs(rng, B, T, S, H, G, Dk, Dv, K, sinks, dtype=np.float32):
  q = rng.standard_normal((B, T, H, Dk)).astype(dtype)
  k = rng.standard_normal((B, S, G, Dk)).astype(dtype)
  v = rng.standard_normal((B, S, G, Dv)).astype(dtype)
  idx = rng.integers(0, S, (B, T, K)).astype(np.int32)
  idx[0, 0, :] = -1  # an empty row
  idx[0, 1, : K // 2] = -1  # skipped entries
  idx[-1, -1, :3] = idx[-1, -1, 3]  # duplicates count once per occurrence
  idx[-1, 0, 0] = S + 3  # out of range: skipped
  s = rng.standard_normal(H).astype(np.float32) if sinks else None
  return q, k, v, idx, s


@pytest.mark.parametrize("case", list(_CASES))
def test_forward_matches_oracle(case):
  B, T, S, H, G, Dk, Dv, K, sinks, config = _CASES[case]
  q, k, v, idx, s = _inputs(np.random.default_rng(0), B, T, S, H, G, Dk, Dv, K, sinks)
  out, lse = sparse_attention_forward_pallas(q, k, v, idx, scale=0.3, sinks=s, config=config)
  o_out, o_lse = sparse_attention_oracle(q, k, v, idx, scale=0.3, sinks=s)
  np.testing.assert_allclose(out, o_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(o_lse))
  np.testing.assert_allclose(np.where(np.isinf(o_lse), 0, lse), np.where(np.isinf(o_lse), 0, o_lse), rtol=1e-5)
  assert not np.isnan(np.asarray(out)).any()
  assert (np.asarray(out)[0, 0] == 0).all() if s is None else np.allclose(lse[0, 0], s)


def test_bf16_forward_matches_oracle_on_rounded_inputs():
  q, k, v, idx, s = _inputs(np.random.default_rng(1), 2, 4, 16, 8, 1, 24, 16, 10, True)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  out, lse = sparse_attention_forward_pallas(q, k, v, idx, scale=0.2, sinks=s)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  o_out, o_lse = sparse_attention_oracle(*(np.asarray(x, np.float64) for x in (q, k, v)), idx, scale=0.2, sinks=s)
  np.testing.assert_allclose(np.asarray(out, np.float32), o_out, atol=3e-2, rtol=3e-2)
  np.testing.assert_allclose(lse, o_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("sinks", [False, True])
def test_gradients_through_the_pallas_backend_match_oracle(sinks):
  q, k, v, idx, s = _inputs(np.random.default_rng(2), 1, 6, 13, 4, 2, 12, 8, 7, sinks)
  rng = np.random.default_rng(3)
  dout = rng.standard_normal((1, 6, 4, 8)).astype(np.float32)

  def loss(q, k, v, s):
    out, _ = ops.sparse_attention(q, k, v, idx, scale=0.4, sinks=s, backend="pallas")
    return jnp.sum(out * dout)

  argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
  grads = jax.grad(loss, argnums=argnums)(q, k, v, s)
  expected = sparse_attention_grads_oracle(q, k, v, idx, dout, None, scale=0.4, sinks=s)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-4)


def _live_kernel_calls(jaxpr, name="hyscale_sparse_attention_fwd"):
  """Named pallas_calls whose outputs something uses. pallas_call has no JAX-level DCE, so the
  backward's recomputation keeps a dead copy in the jaxpr; XLA drops it (a custom call without side
  effects), so only live calls run."""
  count = 0
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name == "pallas_call" and eqn.params.get("name") == name:
      used = {id(v) for later in jaxpr.eqns[i + 1 :] for v in later.invars} | {id(v) for v in jaxpr.outvars}
      count += any(id(v) in used for v in eqn.outvars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _live_kernel_calls(sub, name)
  return count


def test_kernel_runs_once_per_layer_under_selection_replay():
  import jax.extend.core  # noqa: F401

  q, k, v, idx, _ = _inputs(np.random.default_rng(4), 1, 4, 8, 2, 1, 8, 8, 4, False)

  def layer(q):
    out, _ = ops.sparse_attention(q, k, v, idx, scale=1.0, backend="pallas")
    return jnp.sum(out**2)

  for policy, expected in (("selection_replay", 1), ("full", 2), ("none", 1)):
    jaxpr = jax.make_jaxpr(jax.grad(remat.remat(layer, policy)))(q).jaxpr
    assert _live_kernel_calls(jaxpr) == expected, policy


def test_config_rejects_non_power_of_two_blocks():
  with pytest.raises(ValueError, match="block_k"):
    Config(block_k=48)
  with pytest.raises(ValueError, match="slice_h"):
    Config(slice_h=12)


def test_backward_runs_64_sliced_heads_per_program_at_the_mla_shape_and_lowers_for_the_h200():
  """bf16 absorbed MLA (64 heads of 576, v = the 512 prefix, k 2048): one program per token holds all
  64 heads (in slices of 32), and the kernel lowers to Triton IR for an abstract H200 with its relaxed
  atomic adds. f32 (64 heads of it overflow shared memory) and QSA's 12 heads per group keep 32."""
  sliced = Config(block_h=64, block_k=32, num_warps=8, num_stages=1, slice_h=32)
  assert Config.backward_heuristics(576, 512, 2, 64, value_from_key=True) == sliced
  assert Config.backward_heuristics(512, 512, 2, 128, value_from_key=True) == sliced  # V4 dims; MLA with 128 heads
  # f32, QSA's 12 heads per group, and explicit value rows (a second gathered tile) keep 32-head blocks.
  for args, from_key in (((576, 512, 4, 64), True), ((256, 256, 2, 12), True), ((576, 512, 2, 64), False),
                         ((0, 0, 0), False)):
    assert Config.backward_heuristics(*args, value_from_key=from_key) == Config(block_h=32, block_k=16, num_warps=4,
                                                                                num_stages=1)
  T = 8
  q, k, idx, out, lse = mla_backward_inputs(T)

  def backward(q, k, idx, out, lse):
    return sparse_attention_backward_pallas((q, k, None, idx, None, out, lse), (out, jnp.zeros_like(lse)),
                                            scale=MLA_DK**-0.5, interpret=False)[:2]

  eqns = list(equations(jax.make_jaxpr(backward)(q, k, idx, out, lse)))
  [call] = [e for e in eqns if e.primitive.name == "pallas_call"]
  assert call.params["grid_mapping"].grid == (1, T, 1)  # one 64-head program per token
  assert any(e.primitive.name == "hyscale_relaxed_atomic_add" for e in eqns)
  assert export_for_h200(backward, q, k, idx, out, lse).mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("case", list(_CASES))
def test_backward_kernel_matches_oracle(case):
  """dq, dk, dv and dsinks from the kernel for L = sum(out * dout) + sum(lse * dlse)."""
  B, T, S, H, G, Dk, Dv, K, sinks, config = _CASES[case]
  rng = np.random.default_rng(5)
  q, k, v, idx, s = _inputs(rng, B, T, S, H, G, Dk, Dv, K, sinks)
  idx[-1, 1, :] = idx[-1, 1, 0]  # a row that selects one key K times: K atomic adds to one row
  dout = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
  dlse = rng.standard_normal((B, T, H)).astype(np.float32)
  out, lse = sparse_attention_forward_pallas(q, k, v, idx, scale=0.3, sinks=s, config=config)
  grads = sparse_attention_backward_pallas((q, k, v, idx, s, out, lse), (dout, dlse), scale=0.3, config=config)
  expected = sparse_attention_grads_oracle(q, k, v, idx, dout, dlse, scale=0.3, sinks=s)
  assert (grads[3] is None) == (s is None)
  for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected):
    if want is None:
      continue
    assert got.shape == want.shape, name
    np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max(), rtol=1e-4, err_msg=name)


def test_backward_kernel_leaves_unselected_keys_at_zero():
  q, k, v, idx, _ = _inputs(np.random.default_rng(6), 1, 4, 32, 4, 1, 8, 8, 5, False)
  idx[:] = np.clip(idx, -1, 15)  # keys 16.. are never selected
  dout = np.ones((1, 4, 4, 8), np.float32)
  out, lse = sparse_attention_forward_pallas(q, k, v, idx, scale=0.5)
  _, dk, dv, _ = sparse_attention_backward_pallas((q, k, v, idx, None, out, lse), (dout, np.zeros_like(lse)),
                                                  scale=0.5)
  assert not np.asarray(dk[:, 16:]).any() and not np.asarray(dv[:, 16:]).any()
  assert np.asarray(dv[:, :16]).any()


def test_bf16_backward_matches_reference():
  q, k, v, idx, s = _inputs(np.random.default_rng(7), 1, 6, 24, 8, 1, 24, 16, 10, True)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  dout = jnp.asarray(np.random.default_rng(8).standard_normal((1, 6, 8, 16)), jnp.bfloat16)

  def grads(backend):
    f = lambda q, k, v, s: jnp.sum(ops.sparse_attention(q, k, v, idx, scale=0.2, sinks=s, backend=backend)[0]
                                   .astype(jnp.float32) * dout.astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, s)

  for got, want in zip(grads("pallas"), grads("reference")):
    assert got.dtype == want.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)


@pytest.mark.parametrize("case", ["mqa_absorbed_like", "gqa_sinks", "gqa_padded_heads"])
def test_teacher_kernel_matches_oracle(case):
  """sum_h exp(s - lse) at every selected key, from the forward's lse (float64 oracle)."""
  B, T, S, H, G, Dk, Dv, K, sinks, config = _CASES[case]
  q, k, v, idx, s = _inputs(np.random.default_rng(9), B, T, S, H, G, Dk, Dv, K, sinks)
  _, lse = sparse_attention_forward_pallas(q, k, v, idx, scale=0.3, sinks=s, config=config)
  got = np.asarray(attention_teacher_pallas(q, k, lse, idx, scale=0.3, config=config))
  q64, k64 = np.asarray(q, np.float64), np.asarray(np.repeat(k, H // G, axis=2), np.float64)
  safe = np.clip(idx, 0, S - 1)
  k_sel = np.take_along_axis(k64[:, None], safe[:, :, :, None, None], axis=2)  # [B, T, K, H, Dk]
  logits = 0.3 * np.einsum("bthd,btkhd->bthk", q64, k_sel)
  lse64 = np.asarray(lse, np.float64)
  probs = np.exp(logits - np.where(np.isfinite(lse64), lse64, 0.0)[..., None])
  want = np.where((idx >= 0) & (idx < S), probs.sum(axis=2), 0.0)
  assert got.shape == (B, T, K)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert (got[0, 0] == 0).all()  # the empty row


def test_indexer_loss_pallas_backend_matches_reference():
  rng = np.random.default_rng(10)
  B, T, S, HI, DI, H, Dk, K = 1, 9, 12, 2, 8, 4, 8, 5
  iq, ik, iw = (jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in ((B, T, HI, DI), (B, S, DI), (B, T, HI)))
  aq, ak = jnp.asarray(rng.standard_normal((B, T, H, Dk)), jnp.float32), jnp.asarray(rng.standard_normal((B, S, 1, Dk)), jnp.float32)
  idx = rng.integers(0, S, (B, T, K)).astype(np.int32)
  idx[0, 0, :] = -1
  idx[0, 1, 1] = idx[0, 1, 0]
  _, lse = ops.sparse_attention(aq, ak, ak, idx, scale=0.3)

  def loss(backend, grad_in_forward, weights):
    f = lambda iq, ik, iw: ops.indexer_loss(iq, ik, iw, aq, ak, lse, idx, attn_scale=0.3, index_scale=0.5,
                                            grad_in_forward=grad_in_forward, backend=backend)
    return jax.value_and_grad(f, argnums=(0, 1) if weights is None else (0, 1, 2))(iq, ik, weights)

  # Both kernels (teacher, and the indexer's scores at the selected keys with their gradient), with
  # the gradient in the backward pass or in the forward, with and without head weights.
  for grad_in_forward, weights in ((False, iw), (True, iw), (False, None)):
    (got, got_grads), (want, want_grads) = loss("pallas", grad_in_forward, weights), loss("reference", False, weights)
    assert float(want) > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * np.abs(w).max())


# v=None: the values are k's first `value_dim` columns. (B, T, S, H, G, Dk, value_dim, K, sinks, config)
_VALUE_FROM_KEY_CASES = {
    "mla_like": (2, 5, 11, 4, 1, 12, 8, 6, False, Config(block_k=4)),  # 8 of 8 + 4, like 512 of 576
    "v4_like": (1, 6, 13, 8, 1, 16, None, 9, True, Config(block_h=4, block_k=4)),  # K = V, sinks
    "gqa_other_prefix": (1, 4, 9, 4, 2, 12, 4, 5, True, Config(block_h=2, block_k=4)),  # 4 of 8 + 4: sliced
}


@pytest.mark.parametrize("case", list(_VALUE_FROM_KEY_CASES))
def test_values_from_the_key_prefix_match_the_oracle(case):
  """`v=None` through the pallas backend: out, lse and the gradients (dk carries the value part)."""
  B, T, S, H, G, Dk, value_dim, K, sinks, config = _VALUE_FROM_KEY_CASES[case]
  Dv = Dk if value_dim is None else value_dim
  q, k, _, idx, s = _inputs(np.random.default_rng(7), B, T, S, H, G, Dk, Dv, K, sinks)
  dout = np.random.default_rng(8).standard_normal((B, T, H, Dv)).astype(np.float32)
  dlse = np.random.default_rng(9).standard_normal((B, T, H)).astype(np.float32)

  def loss(q, k, s):
    out, lse = ops.sparse_attention(q, k, None, idx, scale=0.3, sinks=s, value_dim=value_dim, backend="pallas")
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse), (out, lse)

  argnums = (0, 1, 2) if sinks else (0, 1)
  grads, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, s)
  v = k[..., :Dv]
  o_out, o_lse = sparse_attention_oracle(q, k, v, idx, scale=0.3, sinks=s)
  np.testing.assert_allclose(out, o_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.where(np.isinf(o_lse), 0, lse), np.where(np.isinf(o_lse), 0, o_lse), rtol=1e-5)
  o_dlse = np.where(np.isinf(o_lse), 0, dlse)
  dq, dk, dv, dsinks = sparse_attention_grads_oracle(q, k, v, idx, dout, o_dlse, scale=0.3, sinks=s)
  dk = dk.copy()
  dk[..., :Dv] += dv  # the value gradient lands on the key's prefix
  for got, want in zip(grads, (dq, dk, dsinks)):
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-4)


def test_value_from_key_kernels_match_explicit_values():
  """The fused-value kernels against the same kernels given `k[..., :Dv]` explicitly, bf16 included."""
  B, T, S, H, G, Dk, Dv, K = 1, 4, 10, 4, 1, 24, 16, 7
  q, k, _, idx, s = _inputs(np.random.default_rng(10), B, T, S, H, G, Dk, Dv, K, True)
  q, k = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
  dout = jnp.asarray(np.random.default_rng(11).standard_normal((B, T, H, Dv)), jnp.bfloat16)
  config = Config(block_h=4, block_k=4)
  fused = sparse_attention_forward_pallas(q, k, None, idx, scale=0.2, sinks=s, value_dim=Dv, config=config)
  plain = sparse_attention_forward_pallas(q, k, k[..., :Dv], idx, scale=0.2, sinks=s, config=config)
  for a, b in zip(fused, plain):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  out, lse = plain
  cot = (dout, jnp.zeros_like(lse))
  dq_f, dk_f, dv_f, ds_f = sparse_attention_backward_pallas((q, k, None, idx, s, out, lse), cot, scale=0.2,
                                                            config=config)
  dq_p, dk_p, dv_p, ds_p = sparse_attention_backward_pallas((q, k, k[..., :Dv], idx, s, out, lse), cot, scale=0.2,
                                                            config=config)
  assert dv_f is None
  np.testing.assert_array_equal(np.asarray(dq_f, np.float32), np.asarray(dq_p, np.float32))
  np.testing.assert_array_equal(ds_f, ds_p)
  # f32 accumulation, one bf16 rounding of each sum: the fused row adds dv before rounding.
  want = np.asarray(dk_p, np.float32)
  want[..., :Dv] += np.asarray(dv_p, np.float32)
  np.testing.assert_allclose(np.asarray(dk_f, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_value_dim_is_checked():
  q, k, v, idx, _ = _inputs(np.random.default_rng(12), 1, 3, 5, 2, 1, 8, 8, 4, False)
  with pytest.raises(ValueError, match="value_dim=9"):
    ops.sparse_attention(q, k, None, idx, scale=1.0, value_dim=9)
  with pytest.raises(ValueError, match="value_dim=4 is for v=None"):
    ops.sparse_attention(q, k, v, idx, scale=1.0, value_dim=4)
  out, _ = ops.sparse_attention(q, k, None, idx, scale=1.0, value_dim=4, backend="reference")
  want, _ = ops.sparse_attention(q, k, k[..., :4], idx, scale=1.0, backend="reference")
  np.testing.assert_array_equal(out, want)
