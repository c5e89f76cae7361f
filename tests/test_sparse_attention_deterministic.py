"""The deterministic sparse-attention backward (`deterministic=True`): gradients against the float64
oracle, the key-major pass bit for bit against a sequential NumPy sum, the config flag, and the
kernels lowered for an H200; on the GPU (`-m gpu_only`), two runs bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops
from hyscale_jax.ops.sparse_attention.reference import add_rows_by_key
from pallas_kernels.sparse_attention import Config, sparse_attention_backward_pallas, sparse_attention_forward_pallas
from pallas_kernels.sparse_attention.key_major import key_major_sum, transposed_selection

try:
  from tests.attention_shapes import MLA_DK, mla_backward_inputs
  from tests.jaxpr_tools import equations, export_for_h200, lowers_to_loop
  from tests.oracles import sparse_attention_grads_oracle
  from tests.test_sparse_attention_pallas import _CASES, _VALUE_FROM_KEY_CASES, _inputs
except ImportError:  # tests/ itself is on sys.path
  from attention_shapes import MLA_DK, mla_backward_inputs
  from jaxpr_tools import equations, export_for_h200, lowers_to_loop
  from oracles import sparse_attention_grads_oracle
  from test_sparse_attention_pallas import _CASES, _VALUE_FROM_KEY_CASES, _inputs

# (B, T, S, H, G, Dk, Dv, K, sinks, config) with v=None: values are k's first Dv columns.
_ALL_CASES = {**{name: (*case, False) for name, case in _CASES.items()},
              **{name: (*case[:6], case[6] or case[5], *case[7:], True) for name, case in _VALUE_FROM_KEY_CASES.items()}}


def _chunked(config, B, H, G, Dk, Dv, K, value_is_key, rows):
  """`config` whose slab budget holds exactly `rows` query rows (see key_major.chunked_backward)."""
  block_h, block_k = (min(block, 1 << (n - 1).bit_length()) for block, n in ((config.block_h, H // G), (config.block_k, K)))
  n_blocks = G * -(-(H // G) // block_h)
  dims = Dk + (0 if value_is_key and Dv == 1 << (Dk.bit_length() - 1) else Dv)
  return dataclasses.replace(config, chunk_bytes=rows * B * n_blocks * -(-K // block_k) * block_k * dims * 4)


def _backward(case, deterministic, rows_per_chunk=None, seed=5, layout=None):
  """(grads of L = sum(out * dout) + sum(lse * dlse) from the kernels, the oracle's, inputs); `layout`
  replaces fields of the case's Config (slice_h)."""
  B, T, S, H, G, Dk, Dv, K, sinks, config, value_is_key = _ALL_CASES[case]
  rng = np.random.default_rng(seed)
  q, k, v, idx, s = _inputs(rng, B, T, S, H, G, Dk, Dv, K, sinks)
  idx[-1, 1, :] = idx[-1, 1, 0]  # one key selected K times by one row
  v = k[..., :Dv] if value_is_key else v
  dout = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
  dlse = rng.standard_normal((B, T, H)).astype(np.float32)
  if rows_per_chunk:
    config = _chunked(config, B, H, G, Dk, Dv, K, value_is_key, rows_per_chunk)
  value_kw = dict(value_dim=Dv) if value_is_key else {}
  out, lse = sparse_attention_forward_pallas(q, k, None if value_is_key else v, idx, scale=0.3, sinks=s,
                                             config=config, **value_kw)
  dlse = np.where(np.isinf(lse), 0, dlse)
  grads = sparse_attention_backward_pallas((q, k, None if value_is_key else v, idx, s, out, lse), (dout, dlse),
                                           scale=0.3, deterministic=deterministic,
                                           config=dataclasses.replace(config, **(layout or {})))
  dq, dk, dv, dsinks = sparse_attention_grads_oracle(q, k, v, idx, dout, dlse, scale=0.3, sinks=s)
  if value_is_key:  # the value gradient lands on the key's prefix
    dk = dk.copy()
    dk[..., :Dv] += dv
    dv = None
  return grads, (dq, dk, dv, dsinks)


@pytest.mark.parametrize("case", list(_ALL_CASES))
def test_deterministic_backward_matches_oracle(case):
  """Empty rows, -1, out-of-range and duplicate indices, ragged K, padded heads, sinks, GQA, v=None;
  two query rows per chunk (which divides none of the odd T)."""
  grads, want = _backward(case, True, rows_per_chunk=2)
  for name, got, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
    assert (got is None) == (w is None), name
    if w is not None:
      assert got.shape == w.shape, name
      np.testing.assert_allclose(got, w, atol=2e-6 * np.abs(w).max(), rtol=1e-4, err_msg=name)


# Head slices (issue 20): each program's heads in slices of `slice_h` (2 or 4 slices at these blocks).
_LAYOUTS = {"slices_of_2": dict(slice_h=2), "slices_of_1": dict(slice_h=1)}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", ["mla_like", "v4_like", "gqa_padded_heads", "gqa_sinks"])
def test_head_slices_match_oracle(case, deterministic, layout):
  """Sliced heads, atomic and deterministic, on MLA-like (v = the key prefix), V4-like (K = V, sinks),
  GQA with padded heads and a ragged K, and GQA with an explicit v."""
  rows = 2 if deterministic else None
  grads, want = _backward(case, deterministic, rows_per_chunk=rows, layout=_LAYOUTS[layout])
  for name, got, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
    assert (got is None) == (w is None), name
    if w is not None:
      np.testing.assert_allclose(got, w, atol=2e-6 * np.abs(w).max(), rtol=1e-4, err_msg=name)


def test_bits_do_not_depend_on_the_chunk_size_and_dq_equals_the_atomic_dq():
  """Chunks continue one sequential sum per key, so 1, 3 or all 7 rows per chunk give the same bits."""
  runs = [_backward("gqa_sinks", True, rows_per_chunk=r)[0] for r in (1, 3, None)]
  for run in runs[1:]:
    for a, b in zip(runs[0], run):
      np.testing.assert_array_equal(a, b)
  atomic = _backward("gqa_sinks", False)[0]
  np.testing.assert_array_equal(atomic[0], runs[0][0])  # dq: the same kernel code either way
  for a, b in zip(atomic[1:], runs[0][1:]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_key_major_sum_is_the_sequential_f32_sum_in_the_documented_order():
  """Per key: the running sum, then each entry's rows in ascending (token, slot), within an entry the
  group's head blocks in ascending order; one f32 add at a time (np.float32 here), bit for bit."""
  rng = np.random.default_rng(0)
  B, T, G, bpg, K_pad, S, S_pad, dims = 2, 5, 2, 2, 8, 11, 16, (16, 8)
  idx = rng.integers(-2, S + 2, (B, T, K_pad)).astype(np.int32)  # -2, -1, S, S + 1 are skipped
  idx[0, :, :4] = 3  # one key selected 20 times
  magnitudes = lambda shape: 10.0 ** rng.uniform(-6, 6, shape)  # wide range: the order shows in the bits
  slabs = [(rng.standard_normal((B, T, G * bpg, K_pad, d)) * magnitudes((B, T, G * bpg, K_pad, 1))).astype(np.float32)
           for d in dims]
  accs = [rng.standard_normal((B, S_pad, G, d)).astype(np.float32) for d in dims]
  assert not lowers_to_loop(lambda i: transposed_selection(i, S, S_pad, G * bpg), jnp.asarray(idx))
  got = key_major_sum([jnp.asarray(x) for x in slabs], *transposed_selection(jnp.asarray(idx), S, S_pad, G * bpg),
                      [jnp.asarray(a) for a in accs], blocks_per_group=bpg, key_block=4, interpret=True)
  want, backwards = [a.copy() for a in accs], [a.copy() for a in accs]
  for b in range(B):
    entries = [(t, j) for t in range(T) for j in range(K_pad) if 0 <= idx[b, t, j] < S]
    for i, slab in enumerate(slabs):
      for g in range(G):
        terms = [(idx[b, t, j], slab[b, t, g * bpg + h, j]) for t, j in entries for h in range(bpg)]
        for s, row in terms:
          want[i][b, s, g] = want[i][b, s, g] + row  # float32 + float32: one rounding per add
        for s, row in reversed(terms):
          backwards[i][b, s, g] = backwards[i][b, s, g] + row
  for g, w, r in zip(got, want, backwards):
    assert np.array_equal(np.asarray(g), w)
    assert not np.array_equal(w, r)  # another order gives other bits: the comparison can tell


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_op_gradients_with_deterministic_match_oracle(backend):
  """Through `ops.sparse_attention(..., deterministic=True)`: v=None with a value_dim prefix and sinks."""
  B, T, S, H, G, Dk, Dv, K = 1, 6, 13, 8, 1, 16, 8, 9
  q, k, _, idx, s = _inputs(np.random.default_rng(7), B, T, S, H, G, Dk, Dv, K, True)
  dout = np.random.default_rng(8).standard_normal((B, T, H, Dv)).astype(np.float32)

  def loss(q, k, s):
    out, _ = ops.sparse_attention(q, k, None, idx, scale=0.3, sinks=s, value_dim=Dv, backend=backend,
                                  deterministic=True)
    return jnp.sum(out * dout)

  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, s)
  dq, dk, dv, dsinks = sparse_attention_grads_oracle(q, k, k[..., :Dv], idx, dout, None, scale=0.3, sinks=s)
  dk = dk.copy()
  dk[..., :Dv] += dv
  for got, want in zip(grads, (dq, dk, dsinks)):
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-4)


def test_reference_backward_has_no_scatter_add_when_deterministic():
  q, k, v, idx, _ = _inputs(np.random.default_rng(9), 1, 4, 9, 2, 1, 8, 8, 5, False)
  for deterministic, scatters in ((False, True), (True, False)):
    f = lambda q, k, v: jnp.sum(ops.sparse_attention(q, k, v, idx, scale=0.5, backend="reference",
                                                     deterministic=deterministic)[0])
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(1, 2)))(q, k, v)
    assert any(e.primitive.name == "scatter-add" for e in equations(jaxpr)) == scatters
  rng = np.random.default_rng(10)
  keys, rows = rng.integers(-1, 8, 50).astype(np.int32), rng.standard_normal((50, 2, 3)).astype(np.float32)
  want = np.zeros((7, 2, 3), np.float32)
  np.add.at(want, keys[(keys >= 0) & (keys < 7)], rows[(keys >= 0) & (keys < 7)])
  np.testing.assert_allclose(add_rows_by_key(jnp.zeros((7, 2, 3)), keys, rows), want, rtol=1e-6, atol=1e-6)


def _kernel_names(jaxpr):
  return [e.params.get("name") for e in equations(jaxpr) if e.primitive.name == "pallas_call"]


def test_config_flag_reaches_the_op():
  """`model.sparse_attention_deterministic` puts the key-major kernel (and no atomic add) in the MLA layer's backward."""
  import types  # noqa: PLC0415

  from flax import nnx  # noqa: PLC0415

  from hyscale_jax.layers.mla import MLASparseAttention  # noqa: PLC0415

  try:
    from tests.test_query_chunk import _TINY, _inputs as layer_inputs
  except ImportError:
    from test_query_chunk import _TINY, _inputs as layer_inputs
  backends = types.SimpleNamespace(sparse_attention="pallas")
  for flag in (False, True):
    cfg = dataclasses.replace(_TINY, sparse_attention_deterministic=flag)
    graphdef, params = nnx.split(MLASparseAttention(cfg, has_indexer=True, rngs=nnx.Rngs(0)))
    x, positions, segment_ids = layer_inputs()
    f = lambda p: jnp.mean(nnx.merge(graphdef, p)(x, positions, segment_ids, backends=backends).out ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(f))(params)
    assert ("hyscale_sparse_attention_bwd_key_major" in _kernel_names(jaxpr)) == flag
    assert any(e.primitive.name == "hyscale_relaxed_atomic_add" for e in equations(jaxpr)) != flag


def test_deterministic_must_be_a_bool():
  q, k, v, idx, _ = _inputs(np.random.default_rng(11), 1, 3, 5, 2, 1, 8, 8, 4, False)
  with pytest.raises(ValueError, match="deterministic=1"):
    ops.sparse_attention(q, k, v, idx, scale=1.0, deterministic=1)
  from hyscale_jax.model_config import ModelConfig  # noqa: PLC0415
  with pytest.raises(ValueError, match="sparse_attention_deterministic"):
    ModelConfig(sparse_attention_deterministic="yes")
  with pytest.raises(ValueError, match="chunk_bytes"):
    Config(chunk_bytes=0)


def test_both_passes_lower_for_the_h200_at_the_mla_shape():
  """Absorbed MLA (H 64, Dk 576 = 512 + 64, v = the 512 prefix, k 2048) at T = 64, compiled for the
  GPU: both kernels lower to Triton IR for an abstract H200, and no atomic add is left."""
  q, k, idx, out, lse = mla_backward_inputs(64)

  def backward(q, k, idx, out, lse):
    return sparse_attention_backward_pallas((q, k, None, idx, None, out, lse), (out, jnp.zeros_like(lse)),
                                            scale=MLA_DK**-0.5, deterministic=True, interpret=False)

  assert not any(e.primitive.name == "hyscale_relaxed_atomic_add"
                 for e in equations(jax.make_jaxpr(backward)(q, k, idx, out, lse)))
  module = export_for_h200(backward, q, k, idx, out, lse).mlir_module()
  assert module.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.gpu_only
def test_gpu_two_deterministic_runs_are_bit_identical():
  """MLA dims at T = 1024 with every row selecting among 64 keys (many duplicates per key and row)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device")
  T, H, Dk, Dv, K = 1024, 64, 576, 512, 512
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, T, H, Dk), jnp.float32)
  k = jax.random.normal(keys[1], (1, T, 1, Dk), jnp.float32)
  idx = jax.random.randint(keys[2], (1, T, K), -1, 64)
  dout = jax.random.normal(keys[3], (1, T, H, Dv), jnp.float32)
  out, lse = sparse_attention_forward_pallas(q, k, None, idx, scale=Dk**-0.5, value_dim=Dv)
  run = jax.jit(lambda det: sparse_attention_backward_pallas((q, k, None, idx, None, out, lse),
                                                             (dout, jnp.zeros_like(lse)), scale=Dk**-0.5,
                                                             deterministic=det), static_argnums=0)
  first, second, atomic = run(True), run(True), run(False)
  for a, b in zip(first[:2], second[:2]):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(first[:2], atomic[:2]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4 * float(jnp.abs(b).max()))
