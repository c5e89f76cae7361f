"""Tests for `hyscale_jax.ops.sparse_attention` against the float64 oracles in tests/oracles.py."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops import sparse_attention
from hyscale_jax.ops.sparse_attention import sparse_attention_reference

try:
  from tests.jaxpr_tools import equations, largest_intermediate
  from tests.oracles import sparse_attention_grads_oracle, sparse_attention_oracle
except ImportError:  # tests/ itself is on sys.path
  from jaxpr_tools import equations, largest_intermediate
  from oracles import sparse_attention_grads_oracle, sparse_attention_oracle

# name -> (B, T, S, H, G, Dk, Dv, K, with_sinks)
_CASES = {
    "mqa_dk_ne_dv": (2, 13, 20, 2, 1, 12, 8, 6, False),
    "mqa_dk_ne_dv_sinks": (2, 13, 20, 2, 1, 12, 8, 6, True),
    "gqa_t_gt_s_sinks": (1, 10, 7, 4, 2, 8, 8, 9, True),
    "gqa_t_lt_s": (1, 10, 23, 4, 2, 8, 4, 5, False),
}
# None = the public op with its default chunk; ints = the reference at that query chunk (ragged T).
_CHUNKS = (None, 3, 4)


def _make_inputs(rng, B, T, S, H, G, Dk, Dv, K, with_sinks, dtype=jnp.float32):
  """Random q/k/v/sinks and indices with duplicates, -1, out-of-range entries and an empty row."""
  q = jnp.asarray(rng.standard_normal((B, T, H, Dk)), dtype)
  k = jnp.asarray(rng.standard_normal((B, S, G, Dk)), dtype)
  v = jnp.asarray(rng.standard_normal((B, S, G, Dv)), dtype)
  idx = rng.integers(0, S, size=(B, T, K)).astype(np.int32)
  idx[:, :, 1] = idx[:, :, 0]  # duplicates
  idx[:, ::2, -1] = -1  # skipped
  idx[:, 1::3, -2] = S + rng.integers(0, 3, size=idx[:, 1::3, -2].shape)  # out of range
  idx[0, 1, :] = -1  # an empty row
  sinks = jnp.asarray(rng.standard_normal((H,)), jnp.float32) if with_sinks else None
  return q, k, v, jnp.asarray(idx), sinks


@functools.partial(jax.jit, static_argnames=("scale", "chunk"))
def _attend(q, k, v, idx, sinks, *, scale, chunk):
  if chunk is None:
    return sparse_attention(q, k, v, idx, scale=scale, sinks=sinks)
  return sparse_attention_reference(q, k, v, idx, scale=scale, sinks=sinks, query_chunk=chunk)


def _np(x):
  return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("case", list(_CASES))
def test_forward_matches_oracle_f32(case):
  B, T, S, H, G, Dk, Dv, K, with_sinks = _CASES[case]
  q, k, v, idx, sinks = _make_inputs(np.random.default_rng(0), *_CASES[case])
  scale = Dk**-0.5
  o_out, o_lse = sparse_attention_oracle(_np(q), _np(k), _np(v), np.asarray(idx), scale=scale,
                                         sinks=_np(sinks))
  assert np.isinf(o_lse).any() != with_sinks  # the empty row is really there
  for chunk in _CHUNKS:
    out, lse = _attend(q, k, v, idx, sinks, scale=scale, chunk=chunk)
    assert out.shape == (B, T, H, Dv) and out.dtype == jnp.float32 and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), o_out, rtol=1e-5, atol=1e-5, err_msg=str(chunk))
    np.testing.assert_allclose(np.asarray(lse), o_lse, rtol=1e-5, atol=1e-5, err_msg=str(chunk))


@pytest.mark.parametrize("case", ["mqa_dk_ne_dv_sinks", "gqa_t_lt_s"])
def test_forward_bf16_matches_oracle_on_rounded_inputs(case):
  B, T, S, H, G, Dk, Dv, K, _ = _CASES[case]
  q, k, v, idx, sinks = _make_inputs(np.random.default_rng(1), *_CASES[case], dtype=jnp.bfloat16)
  scale = Dk**-0.5
  o_out, o_lse = sparse_attention_oracle(_np(q), _np(k), _np(v), np.asarray(idx), scale=scale,
                                         sinks=_np(sinks))
  for chunk in (None, 4):
    out, lse = _attend(q, k, v, idx, sinks, scale=scale, chunk=chunk)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(_np(out), o_out, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), o_lse, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_empty_row_gives_zero_out_and_no_nan(with_sinks):
  B, T, S, H, G, Dk, Dv, K = 1, 5, 6, 4, 2, 8, 4, 3
  q, k, v, idx, sinks = _make_inputs(np.random.default_rng(2), B, T, S, H, G, Dk, Dv, K, with_sinks)
  idx = idx.at[0, 3].set(jnp.array([-1, S, S + 7]))  # a second empty row, out of range only
  out, lse = sparse_attention(q, k, v, idx, scale=0.3, sinks=sinks)
  for t in (1, 3):
    assert (np.asarray(out[0, t]) == 0).all()
    want = np.asarray(sinks) if with_sinks else np.full((H,), -np.inf, np.float32)
    np.testing.assert_array_equal(np.asarray(lse[0, t]), want)
  assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
  assert np.isfinite(np.asarray(lse[0, 0])).all() and np.abs(np.asarray(out[0, 0])).sum() > 0

  def loss(q, k, v, sinks):
    out, lse = sparse_attention(q, k, v, idx, scale=0.3, sinks=sinks)
    return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  grads = jax.grad(loss, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2))(q, k, v, sinks)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  assert (np.asarray(grads[0][0, 1]) == 0).all() and (np.asarray(grads[0][0, 3]) == 0).all()


def _grad_fn(chunk, scale, with_sinks):
  def loss(q, k, v, sinks, idx, dout, dlse):
    out, lse = _attend.__wrapped__(q, k, v, idx, sinks, scale=scale, chunk=chunk)
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2)))


@pytest.mark.parametrize("lse_cotangent", [True, False])
@pytest.mark.parametrize("case", list(_CASES))
def test_gradients_match_oracle(case, lse_cotangent):
  B, T, S, H, G, Dk, Dv, K, with_sinks = _CASES[case]
  rng = np.random.default_rng(4)
  q, k, v, idx, sinks = _make_inputs(rng, *_CASES[case])
  scale = Dk**-0.5
  dout = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
  dlse = rng.standard_normal((B, T, H)).astype(np.float32) * lse_cotangent
  _, o_lse = sparse_attention_oracle(_np(q), _np(k), _np(v), np.asarray(idx), scale=scale,
                                     sinks=_np(sinks))
  dlse = np.where(np.isfinite(o_lse), dlse, 0.0).astype(np.float32)
  want = sparse_attention_grads_oracle(_np(q), _np(k), _np(v), np.asarray(idx), dout,
                                       dlse if lse_cotangent else None, scale=scale, sinks=_np(sinks))
  for chunk in _CHUNKS:
    got = _grad_fn(chunk, scale, with_sinks)(q, k, v, sinks, idx, dout, dlse)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
      assert g.shape == w.shape and np.isfinite(np.asarray(g)).all(), (name, chunk)
      assert _rel_err(g, w) < 1e-4, (name, chunk, _rel_err(g, w))


def test_is_custom_vjp():
  q, k, v, idx, _ = _make_inputs(np.random.default_rng(5), 1, 4, 5, 2, 1, 4, 4, 3, False)
  jaxpr = jax.make_jaxpr(lambda q, k, v: sparse_attention(q, k, v, idx, scale=1.0))(q, k, v)
  assert any("custom_vjp" in e.primitive.name for e in equations(jaxpr))


def test_reference_chunks_the_gather():
  B, T, S, H, G, Dk, Dv, K = 1, 64, 64, 2, 1, 8, 8, 16
  q = jax.ShapeDtypeStruct((B, T, H, Dk), jnp.float32)
  k = jax.ShapeDtypeStruct((B, S, G, Dk), jnp.float32)
  v = jax.ShapeDtypeStruct((B, S, G, Dv), jnp.float32)
  idx = jax.ShapeDtypeStruct((B, T, K), jnp.int32)
  full_gather = B * T * K * Dk

  def fwd_and_grad(chunk):
    f = lambda q, k, v, i: sparse_attention_reference(q, k, v, i, scale=1.0, query_chunk=chunk)
    g = jax.grad(lambda q, k, v, i: f(q, k, v, i)[0].sum(), argnums=(0, 1, 2))
    return jax.make_jaxpr(f)(q, k, v, idx), jax.make_jaxpr(g)(q, k, v, idx)

  unchunked_fwd, _ = fwd_and_grad(T)
  assert largest_intermediate(unchunked_fwd) >= full_gather  # the checker sees the full gather
  for jaxpr in fwd_and_grad(8):
    assert largest_intermediate(jaxpr) < full_gather


_B, _T, _S, _H, _G, _Dk, _Dv, _K = 2, 4, 6, 4, 2, 8, 4, 3
_GOOD = dict(
    q=jnp.ones((_B, _T, _H, _Dk)), k=jnp.ones((_B, _S, _G, _Dk)), v=jnp.ones((_B, _S, _G, _Dv)),
    indices=jnp.zeros((_B, _T, _K), jnp.int32), sinks=jnp.zeros((_H,)),
)
# name -> (overrides, argument name, offending shape/dtype fragment)
_BAD_INPUTS = {
    "q_rank": (dict(q=jnp.ones((_B, _T, _H * _Dk))), "q", "q.shape=(2, 4, 32)"),
    "k_rank": (dict(k=jnp.ones((_B, _S, _Dk))), "k", "k.shape=(2, 6, 8)"),
    "v_rank": (dict(v=jnp.ones((_B, _S, _G, _Dv, 1))), "v", "v.shape=(2, 6, 2, 4, 1)"),
    "indices_rank": (dict(indices=jnp.zeros((_B, _T), jnp.int32)), "indices", "indices.shape=(2, 4)"),
    "k_batch_1_broadcast": (dict(k=jnp.ones((1, _S, _G, _Dk))), "k", "k.shape=(1, 6, 2, 8)"),
    "k_dk": (dict(k=jnp.ones((_B, _S, _G, _Dk + 1))), "k", "k.shape=(2, 6, 2, 9)"),
    "v_seq": (dict(v=jnp.ones((_B, _S + 1, _G, _Dv))), "v", "v.shape=(2, 7, 2, 4)"),
    "v_groups": (dict(v=jnp.ones((_B, _S, 1, _Dv))), "v", "v.shape=(2, 6, 1, 4)"),
    "h_not_divisible": (dict(k=jnp.ones((_B, _S, 3, _Dk)), v=jnp.ones((_B, _S, 3, _Dv))), "G", "G=3"),
    "indices_float": (dict(indices=jnp.zeros((_B, _T, _K), jnp.float32)), "indices", "indices.dtype=float32"),
    "indices_batch": (dict(indices=jnp.zeros((1, _T, _K), jnp.int32)), "indices", "indices.shape=(1, 4, 3)"),
    "indices_len": (dict(indices=jnp.zeros((_B, _T + 1, _K), jnp.int32)),
        "indices", "indices.shape=(2, 5, 3)"),
    "sinks_shape": (dict(sinks=jnp.zeros((_H + 1,))), "sinks", "sinks.shape=(5,)"),
    "sinks_2d": (dict(sinks=jnp.zeros((1, _H))), "sinks", "sinks.shape=(1, 4)"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
def test_bad_input_raises_value_error(case):
  overrides, arg, fragment = _BAD_INPUTS[case]
  a = dict(_GOOD, **overrides)
  with pytest.raises(ValueError, match=re.escape(arg)) as info:
    sparse_attention(a["q"], a["k"], a["v"], a["indices"], scale=1.0, sinks=a["sinks"])
  assert fragment in str(info.value), str(info.value)


def test_bad_backend_names():
  a = _GOOD
  with pytest.raises(ValueError, match="backend"):
    sparse_attention(a["q"], a["k"], a["v"], a["indices"], scale=1.0, backend="bogus")
  v_odd = jnp.ones(a["v"].shape[:3] + (6,))  # the Pallas kernel declines a non-power-of-two Dv
  with pytest.raises(NotImplementedError, match="pallas"):
    sparse_attention(a["q"], a["k"], v_odd, a["indices"], scale=1.0, backend="pallas")
