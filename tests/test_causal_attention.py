"""`ops.causal_attention` (the dense warm-up's attention): every backend against the float64 oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops
from hyscale_jax.ops.causal_attention import REGISTRY, causal_attention_reference

try:
  from tests.jaxpr_tools import equations
  from tests.oracles import sparse_attention_grads_oracle, sparse_attention_oracle, visibility
except ImportError:
  from jaxpr_tools import equations
  from oracles import sparse_attention_grads_oracle, sparse_attention_oracle, visibility

# name -> (B, T, N, K, H, Hv, packed segments)
_CASES = {
    "gqa_packed": (2, 37, 4, 2, 8, 6, True),
    "mqa_packed": (1, 21, 3, 1, 8, 8, True),
    "mha_one_document": (1, 19, 2, 2, 6, 10, False),
}
# Small blocks so that T = 37 spans several query blocks and key chunks, neither dividing T.
_SMALL_BLOCKS = functools.partial(causal_attention_reference, query_block=8, key_chunk=16)
_BACKENDS = {
    "reference": functools.partial(ops.causal_attention, backend="reference"),
    "reference_small_blocks": _SMALL_BLOCKS,
    "xla_baseline": functools.partial(ops.causal_attention, backend="xla_baseline"),
    # JAX's Triton kernel, in Pallas interpret mode off the GPU.
    "pallas": functools.partial(ops.causal_attention, backend="pallas"),
}


def _inputs(rng, B, T, N, K, H, Hv, packed):
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, Hv)))
  seg = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32) if packed else None
  return q, k, v, seg


def _oracle_indices(B, T, seg):
  """Every visible key of each query, as the sparse oracle's index lists ([B, T, T], -1 = none)."""
  vis = visibility(B, T, T, segment_ids=None if seg is None else seg)
  return np.where(vis, np.arange(T), -1)


def _call(name, q, k, v, seg, scale):
  kwargs = {} if seg is None else {"segment_ids": seg if name != "reference_small_blocks" else (seg, seg)}
  return _BACKENDS[name](q, k, v, scale=scale, **kwargs)


@pytest.mark.parametrize("name", list(_BACKENDS))
@pytest.mark.parametrize("case", list(_CASES))
def test_values_and_gradients_match_oracle(name, case):
  B, T, N, K, H, Hv, packed = _CASES[case]
  rng = np.random.default_rng(0)
  q, k, v, seg = _inputs(rng, B, T, N, K, H, Hv, packed)
  dout = rng.standard_normal((B, T, N, Hv)).astype(np.float32)
  idx = _oracle_indices(B, T, None if seg is None else (seg, seg))
  out, vjp = jax.vjp(lambda q, k, v: _call(name, q, k, v, seg, 0.4), q, k, v)
  np.testing.assert_allclose(out, sparse_attention_oracle(q, k, v, idx, scale=0.4)[0], rtol=1e-5, atol=1e-5)
  expected = sparse_attention_grads_oracle(q, k, v, idx, dout, scale=0.4)[:3]
  for got, want in zip(vjp(jnp.asarray(dout)), expected):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["reference", "reference_small_blocks", "xla_baseline"])
def test_a_query_that_sees_nothing_gets_zero_and_no_nan(name):
  B, T, N, K, H, Hv = 1, 20, 2, 1, 4, 4
  q, k, v, _ = _inputs(np.random.default_rng(1), B, T, N, K, H, Hv, False)
  q_seg = np.zeros((B, T), np.int32)
  q_seg[:, 0] = 7  # no key is in segment 7: the first token is fully masked
  kv_seg = np.zeros((B, T), np.int32)
  call = ops.causal_attention if name != "reference_small_blocks" else _SMALL_BLOCKS
  kwargs = {"backend": name} if name != "reference_small_blocks" else {}
  loss = lambda q, k, v: call(q, k, v, scale=0.5, segment_ids=(q_seg, kv_seg), **kwargs).sum()
  out = call(q, k, v, scale=0.5, segment_ids=(q_seg, kv_seg), **kwargs)
  grads = jax.grad(loss, (0, 1, 2))(q, k, v)
  assert (np.asarray(out)[:, 0] == 0).all()
  np.testing.assert_allclose(out, sparse_attention_oracle(q, k, v, _oracle_indices(B, T, (q_seg, kv_seg)),
                                                          scale=0.5)[0], rtol=1e-5, atol=1e-5)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  assert (np.asarray(grads[0])[:, 0] == 0).all()


# name -> (B, T, N, K, H, Hv, compress_ratio, K = V (v is k itself))
_COMPRESSED_CASES = {
    "hca_like_mqa_k_is_v": (2, 37, 4, 1, 8, 8, 4, True),  # DeepSeek-V4: MQA over entries, values = keys
    "gqa_ratio_3": (1, 29, 4, 2, 6, 5, 3, False),
    "ratio_1_with_lse": (1, 21, 2, 1, 4, 4, 1, False),
}


def _compressed_inputs(rng, B, T, N, K, H, Hv, ratio, k_is_v):
  """q, k, v (v = k when k_is_v) and the (q_seg, kv_seg) of packed documents: an entry carries its
  last token's document, as the DeepSeek-V4 compressor gives it."""
  S = T // ratio
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = k if k_is_v else rng.standard_normal((B, S, K, Hv)).astype(np.float32)
  q_seg = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  return q, k, v, (q_seg, q_seg[:, ratio - 1 :: ratio][:, :S])


@pytest.mark.parametrize("name", ["reference", "reference_small_blocks", "xla_baseline"])
@pytest.mark.parametrize("case", list(_COMPRESSED_CASES))
def test_compressed_keys_and_lse_match_oracle_in_values_and_gradients(name, case):
  """compress_ratio > 1 (key s seen from token t iff (s + 1) * m <= t + 1) and return_lse, with
  cotangents on both out and lse, against the float64 oracle over every visible key's index list."""
  B, T, N, K, H, Hv, ratio, k_is_v = _COMPRESSED_CASES[case]
  rng = np.random.default_rng(7)
  q, k, v, segs = _compressed_inputs(rng, B, T, N, K, H, Hv, ratio, k_is_v)
  S = k.shape[1]
  vis = visibility(B, T, S, compress_ratio=ratio, segment_ids=segs)
  if ratio > 1:
    assert not vis[:, : ratio - 1].any() and vis.any(-1).sum() < B * T  # some queries see no entry
  idx = np.where(vis, np.arange(S), -1)
  call = functools.partial(_SMALL_BLOCKS if name == "reference_small_blocks" else
                           functools.partial(ops.causal_attention, backend=name),
                           scale=0.4, segment_ids=segs, compress_ratio=ratio, return_lse=True)
  want_out, want_lse = sparse_attention_oracle(q, k, v, idx, scale=0.4)
  dout = rng.standard_normal((B, T, N, v.shape[3])).astype(np.float32)
  dlse = np.where(np.isfinite(want_lse), rng.standard_normal((B, T, N)), 0.0).astype(np.float32)
  dq, dk, dv, _ = sparse_attention_grads_oracle(q, k, v, idx, dout, dlse, scale=0.4)
  if k_is_v:
    (out, lse), vjp = jax.vjp(lambda q, k: call(q, k, k), q, k)
    want_grads = (dq, dk + dv)
  else:
    (out, lse), vjp = jax.vjp(lambda q, k, v: call(q, k, v), q, k, v)
    want_grads = (dq, dk, dv)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
  np.testing.assert_allclose(np.where(np.isfinite(want_lse), lse, 0), np.where(np.isfinite(want_lse), want_lse, 0),
                             rtol=1e-5, atol=1e-5)
  # An unseeded lse cotangent at a row that sees nothing must not turn into NaN (0 * inf).
  dlse_nan = np.where(np.isfinite(want_lse), dlse, np.nan).astype(np.float32)
  for got, want in zip(vjp((jnp.asarray(dout), jnp.asarray(dlse_nan))), want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_pallas_declines_what_the_kernel_cannot_do_and_auto_falls_back():
  q, k, v, seg = _inputs(np.random.default_rng(2), 1, 16, 2, 1, 4, 4, True)
  other = (seg, seg + 1)  # different query and key segment ids
  with pytest.raises(NotImplementedError, match="one segment-id array"):
    ops.causal_attention(q, k, v, scale=1.0, segment_ids=other, backend="pallas")
  with pytest.raises(NotImplementedError, match="head dims"):
    ops.causal_attention(np.zeros((1, 16, 1, 320), np.float32), np.zeros((1, 16, 1, 320), np.float32),
                         v[:, :, :1], scale=1.0, backend="pallas")
  with pytest.raises(NotImplementedError, match="token-causal"):
    ops.causal_attention(q, k[:, :4], v[:, :4], scale=1.0, segment_ids=(seg, seg[:, 3::4]), compress_ratio=4,
                         backend="pallas")
  with pytest.raises(NotImplementedError, match="lse cotangent"):
    ops.causal_attention(q, k, v, scale=1.0, segment_ids=seg, return_lse=True, backend="pallas")
  fallback = REGISTRY.run(("pallas", "reference"), q, k, v, scale=1.0, q_offset=0, segment_ids=other)
  np.testing.assert_allclose(fallback, ops.causal_attention(q, k, v, scale=1.0, segment_ids=other,
                                                            backend="xla_baseline"), rtol=1e-5, atol=1e-6)


def test_reference_builds_nothing_t_by_t_forward_or_backward():
  B, T, N, K, H, Hv = 1, 40, 2, 1, 4, 4  # every other dimension is below T
  q, k, v, seg = _inputs(np.random.default_rng(3), B, T, N, K, H, Hv, True)
  loss = lambda q, k, v: _SMALL_BLOCKS(q, k, v, scale=0.5, segment_ids=(seg, seg)).sum()
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
  shapes = {tuple(x.aval.shape) for e in equations(jaxpr) for x in (*e.invars, *e.outvars) if hasattr(x, "aval")}
  square = [s for s in shapes if sum(d >= T for d in s) >= 2]
  assert not square, square
  # The baseline does build [.., T, T]: the check can see it.
  base = jax.make_jaxpr(lambda q, k, v: ops.causal_attention(q, k, v, scale=0.5, backend="xla_baseline"))(q, k, v)
  assert any(sum(d >= T for d in x.aval.shape) >= 2 for e in equations(base) for x in e.outvars)


def _squares_and_lse(q, k, v, **kwargs):
  """sum(out^2), plus the finite lse's sum when the call returns it."""
  result = ops.causal_attention(q, k, v, scale=0.5, **kwargs)
  if not kwargs.get("return_lse"):
    return jnp.sum(result**2)
  out, lse = result
  return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


@pytest.mark.parametrize("ratio", [1, 4])
def test_a_context_mesh_splits_the_queries_with_the_same_values_and_gradients(ratio):
  q, k, v, seg = _inputs(np.random.default_rng(6), 2, 32, 4, 2, 8, 8, True)
  # ratio 4: 8 compressed keys (2 per context shard) and lse returned, as DeepSeek-V4's HCA calls it.
  kwargs = (dict(segment_ids=seg) if ratio == 1 else
            dict(segment_ids=(seg, seg[:, 3::4]), compress_ratio=4, return_lse=True))
  k, v = k[:, : 32 // ratio], v[:, : 32 // ratio]
  loss = jax.jit(jax.value_and_grad(lambda q, k, v: _squares_and_lse(q, k, v, **kwargs), (0, 1, 2)))
  want = loss(q, k, v)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(loss)(q, k, v))
    got = loss(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["reference", "xla_baseline", "pallas"])
def test_a_detached_lse_is_the_lse_without_a_gradient_on_every_backend(name):
  """`return_lse="detached"` (the dense indexer KL's teacher): the same out and lse as `return_lse=True`,
  no gradient through lse, and the `pallas` backend, which declines a differentiable lse, serves it."""
  q, k, v, seg = _inputs(np.random.default_rng(6), 1, 21, 2, 2, 8, 8, True)
  want_out, want_lse = ops.causal_attention(q, k, v, scale=0.4, segment_ids=seg, return_lse=True, backend="reference")
  out, lse = ops.causal_attention(q, k, v, scale=0.4, segment_ids=seg, return_lse="detached", backend=name)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
  grads = jax.grad(lambda q, k: ops.causal_attention(q, k, v, scale=0.4, segment_ids=seg, return_lse="detached",
                                                     backend=name)[1].sum(), argnums=(0, 1))(q, k)
  assert all(not np.asarray(g).any() for g in grads)
  with pytest.raises(ValueError, match="return_lse='yes' must be False, True or 'detached'"):
    ops.causal_attention(q, k, v, scale=0.4, return_lse="yes")


@pytest.mark.parametrize("bad, match", [
    (dict(q=np.zeros((2, 8, 4), np.float32)), "q must have rank 4"),
    (dict(k=np.zeros((2, 8, 2, 5), np.float32)), "k.shape"),
    (dict(v=np.zeros((2, 8, 1, 4), np.float32)), "v.shape"),
    (dict(k=np.zeros((2, 8, 3, 4), np.float32), v=np.zeros((2, 8, 3, 4), np.float32)), "divisible"),
    (dict(q=np.zeros((2, 8, 4, 4), np.int32)), "q must be a floating dtype"),
    (dict(segment_ids=np.zeros((2, 7), np.int32)), "segment_ids.shape"),
    (dict(segment_ids=np.zeros((2, 8), np.float32)), "segment_ids must be an integer"),
    (dict(scale=np.ones(2)), "scale must be"),
    (dict(backend="nope"), "unknown backend"),
    (dict(compress_ratio=0), "compress_ratio must be a positive int"),
    (dict(k=np.zeros((2, 2, 2, 4), np.float32), v=np.zeros((2, 2, 2, 4), np.float32), compress_ratio=4,
          segment_ids=np.zeros((2, 8), np.int32)), "one array needs S = T"),
    (dict(k=np.zeros((2, 2, 2, 4), np.float32), v=np.zeros((2, 2, 2, 4), np.float32), compress_ratio=4,
          segment_ids=(np.zeros((2, 8), np.int32), np.zeros((2, 3), np.int32))), "kv_seg.shape"),
])
def test_bad_input_raises_value_error_naming_the_argument(bad, match):
  args = dict(q=np.zeros((2, 8, 4, 4), np.float32), k=np.zeros((2, 8, 2, 4), np.float32),
              v=np.zeros((2, 8, 2, 4), np.float32), scale=1.0, segment_ids=None, backend="auto")
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    ops.causal_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.gpu_only
@pytest.mark.parametrize("N, K", [(8, 8), (24, 2)])  # non-absorbed MLA heads; QSA's GQA
def test_pallas_on_gpu_matches_reference_in_bf16(N, K):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device")
  B, T, H = 1, 1000, 256  # T not a multiple of the kernel's blocks; GLM-5.1's 192 + 64 and 256 dims
  q, k, v, seg = _inputs(np.random.default_rng(4), B, T, N, K, H, H, True)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  dout = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, N, H)), jnp.bfloat16)
  run = lambda backend: jax.vjp(
      lambda q, k, v: ops.causal_attention(q, k, v, scale=H**-0.5, segment_ids=seg, backend=backend), q, k, v)
  (out_p, vjp_p), (out_r, vjp_r) = run("pallas"), run("reference")
  np.testing.assert_allclose(np.float32(out_p), np.float32(out_r), atol=2e-2)
  for got, want in zip(vjp_p(dout), vjp_r(dout)):
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=5e-2, rtol=5e-2)
