"""The fp8 path of `hyscale_jax.ops.flash_topk` (DeepSeek-V3.2's indexer) against the float64 oracle.

fp8 q and k are float8_e4m3fn with per-row f32 scales. The oracle scores the dequantized inputs
(`q8 * q_scale`, `k8 * k_scale`) in float64 with `tests/oracles.py`, which equals the op's score
`(sum_h w * q_scale * relu(<q8, k8>)) * (k_scale * scale)` for scales >= 0. Integer-valued e4m3
inputs with power-of-two scales (DeepSeek's ue8m0) make every f32 step exact, so every backend must
return the oracle's indices and scores bit for bit; random inputs from `quantize_fp8` may differ only
at keys within f32 rounding of the k-th score (DESIGN.md, "What exact means").
"""

import contextlib
import functools
import io
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from hyscale_jax import parallel
from hyscale_jax.ops import flash_topk
from hyscale_jax.ops.flash_topk import flash_topk_reference, quantize_fp8
from hyscale_jax.ops.flash_topk.pallas import flash_topk_pallas, flash_topk_pallas_with_stats
from hyscale_jax.ops.flash_topk.reference import fold_q_scale
from pallas_kernels.flash_topk import Config, flash_topk_candidates

try:
  from tests.jaxpr_tools import equations, export_for_h200
  from tests.oracles import index_scores as oracle_scores
  from tests.oracles import topk_oracle, visibility
  from tests.topk_checks import assert_reordered_selection, assert_topk_near_exact, packed_segments
except ImportError:  # tests/ itself is on sys.path (pytest rootdir-less import mode)
  from jaxpr_tools import equations, export_for_h200
  from oracles import index_scores as oracle_scores
  from oracles import topk_oracle, visibility
  from topk_checks import assert_reordered_selection, assert_topk_near_exact, packed_segments

FP8 = jnp.float8_e4m3fn

# Pallas configs for tiny shapes (as in test_flash_topk.py): a sampled threshold with recursion and
# query chunks, and buffers so small that rows overflow and the exact rescue runs.
_PALLAS_CONFIGS = {
    "pallas[threshold]": Config(block_rows=16, block_k=8, candidates=8, min_candidates=8, sample_rank=2,
                                chunk_bytes=2048),
    "pallas[overflow]": Config(block_rows=32, block_k=16, candidates=2, min_candidates=2, sample_rank=1,
                               oversample=1.0),
}


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale", "config"))
def _pallas_stats(q, k, w, k_scale, q_offset, segment_ids, *, topk, compress_ratio, scale, config):
  return flash_topk_pallas_with_stats(q, k, w, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset,
                                      segment_ids=segment_ids, scale=scale, k_scale=k_scale, config=config)


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale"))
def _reference_small_blocks(q, k, w, k_scale, q_offset, segment_ids, *, topk, compress_ratio, scale):
  return flash_topk_reference(q, k, w, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset,
                              segment_ids=segment_ids, scale=scale, k_scale=k_scale, query_block=5, key_chunk=7)


def _all_backends(q, k, w, q_scale, k_scale, **kw):
  """{name: (indices, scores)}: the public backends, the reference at odd block sizes, and the Pallas
  backend (interpret mode) under configs that force its threshold and rescue paths; plus the rows
  each Pallas config rescued."""
  results = {b: tuple(flash_topk(q, k, w, q_scale=q_scale, k_scale=k_scale, backend=b, **kw))
             for b in ("reference", "xla_baseline", "pallas")}
  kw = dict(kw)
  q_offset, segment_ids = jnp.int32(kw.pop("q_offset", 0)), kw.pop("segment_ids", None)
  kw.setdefault("compress_ratio", 1)
  kw.setdefault("scale", 1.0)
  w_eff = fold_q_scale(w, q_scale)  # what the API hands every backend
  results["reference[5x7]"] = _reference_small_blocks(q, k, w_eff, k_scale, q_offset, segment_ids, **kw)
  rescued = {}
  for name, config in _PALLAS_CONFIGS.items():
    idx, sc, stats = _pallas_stats(q, k, w_eff, k_scale, q_offset, segment_ids, config=config, **kw)
    results[name], rescued[name] = (idx, sc), int(stats["rescued"])
  return results, rescued


def _ints(rng, shape, lo, hi, dtype=FP8):
  return jnp.asarray(rng.integers(lo, hi + 1, size=shape).astype(np.float32), dtype)


def _pow2(rng, shape, lo=-3, hi=2):
  """Power-of-two scales (ue8m0): every product with them is exact in f32."""
  return jnp.asarray(2.0 ** rng.integers(lo, hi + 1, size=shape), jnp.float32)


def _dequantized(q, k, w, q_scale, k_scale):
  """f64 inputs of the dequantized score, for the oracle."""
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  if q_scale is not None:
    q64 = q64 * np.asarray(q_scale, np.float64)[..., None]
  if k_scale is not None:
    k64 = k64 * np.asarray(k_scale, np.float64)[..., None]
  return q64, k64, None if w is None else np.asarray(w, np.float64)


# name -> (B, Tq, Tk, H, D, topk, q_range, k_range, w_range, scales (q, k), extra kwargs)
_INT_CASES = {
    "ties_all_equal": (1, 20, 20, 2, 4, 6, (1, 1), (1, 1), None, (False, False), {}),
    "relu_plateau_neg_weights": (2, 37, 37, 3, 8, 9, (0, 2), (-3, 1), (-2, 2), (True, True), {}),
    "rows_shorter_than_k_topk_gt_tk": (1, 12, 12, 2, 4, 16, (-2, 2), (-2, 2), (0, 2), (True, True), {}),
    "compress4_q_offset": (1, 16, 20, 2, 8, 6, (-2, 2), (-2, 2), None, (True, True),
                           {"compress_ratio": 4, "q_offset": 50}),
    "q_offset_ragged_scale": (2, 16, 37, 3, 8, 8, (-3, 3), (-3, 3), (-2, 2), (True, True),
                              {"q_offset": 21, "scale": 0.5}),
    "only_q_scale_no_weights": (1, 33, 33, 4, 8, 5, (-2, 2), (-2, 2), None, (True, False), {}),
    "no_scales": (2, 37, 37, 3, 8, 1, (-4, 4), (-4, 4), (-2, 2), (False, False), {}),
    "k_equals_tk": (1, 37, 37, 2, 8, 37, (-2, 2), (-2, 2), (-2, 2), (True, True), {}),
    "longer_multi_chunk_d16": (1, 80, 80, 4, 16, 10, (-3, 3), (-3, 3), (-2, 2), (True, True), {}),
}


def _int_inputs(rng, case):
  B, Tq, Tk, H, D, topk, qr, kr, wr, (use_qs, use_ks), extra = case
  q, k = _ints(rng, (B, Tq, H, D), *qr), _ints(rng, (B, Tk, D), *kr)
  w = None if wr is None else _ints(rng, (B, Tq, H), *wr, jnp.float32)
  q_scale = _pow2(rng, (B, Tq, H)) if use_qs else None
  k_scale = _pow2(rng, (B, Tk)) if use_ks else None
  return q, k, w, q_scale, k_scale, dict(topk=topk, **extra)


def _assert_matches_oracle_exactly(q, k, w, q_scale, k_scale, kw, oracle_kw=None):
  results, rescued = _all_backends(q, k, w, q_scale, k_scale, **kw)
  o_idx, o_sc = topk_oracle(*_dequantized(q, k, w, q_scale, k_scale), **(oracle_kw or kw))
  for name, (idx, sc) in results.items():
    assert idx.dtype == jnp.int32 and sc.dtype == jnp.float32, name
    np.testing.assert_array_equal(np.asarray(idx), o_idx, err_msg=f"indices, backend {name}")
    np.testing.assert_array_equal(np.asarray(sc), o_sc.astype(np.float32), err_msg=f"scores, {name}")
  return o_idx, o_sc, rescued


# CI time: these repeat what the other cases and the bf16 suite cover (no scales, one longer chunked
# row set, q scales alone, k = Tk); `pytest -m slow` runs them.
_SLOW_INT_CASES = {"no_scales", "longer_multi_chunk_d16", "only_q_scale_no_weights", "k_equals_tk"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_INT_CASES else c
                                  for c in _INT_CASES])
def test_integer_fp8_inputs_bit_exact(case):
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  q, k, w, q_scale, k_scale, kw = _int_inputs(rng, _INT_CASES[case])
  o_idx, o_sc, rescued = _assert_matches_oracle_exactly(q, k, w, q_scale, k_scale, kw)
  assert (o_idx >= 0).any()
  if case == "ties_all_equal":  # every visible score ties: lowest indices first
    assert (o_idx[0, 19] == np.arange(6)).all()
  if case == "relu_plateau_neg_weights":  # most scores sit on the exact-zero plateau
    assert (o_sc == 0).mean() > 0.3 and (o_sc < 0).any()
  if case == "rows_shorter_than_k_topk_gt_tk":
    assert (o_idx[:, -1, 12:] == -1).all() and (o_idx[:, 0, 1:] == -1).all()
  if case == "compress4_q_offset":
    assert ((o_idx >= 0).sum(-1) == np.minimum((50 + np.arange(16) + 1) // 4, 6)).all()
  assert rescued["pallas[overflow]"] > 0  # the rescue (the reference's rows, with k_scale) ran


def test_ties_made_by_key_scales():
  """Keys with raw dots 8 and 16 (rows of ones and twos) and scales 1/2 and 1/4: scores 4 and 8 tie
  across different raw dots (2 x 1/4 == 1 x 1/2), and each tie class is resolved by key index."""
  rng = np.random.default_rng(6)
  B, T, H, D, topk = 1, 48, 2, 8, 7
  value = rng.integers(1, 3, size=(B, T))  # each key row is all ones or all twos
  high = rng.integers(0, 2, size=(B, T))  # which of the two score classes the key falls in
  k = jnp.asarray(np.broadcast_to(value[..., None], (B, T, D)).astype(np.float32), FP8)
  k_scale = jnp.asarray(2.0 ** (high - value), jnp.float32)  # x 2 ** (1 - value): 1 -> 1/2 or 1, 2 -> 1/4 or 1/2
  q = jnp.ones((B, T, H, D), FP8)
  o_idx, o_sc, _ = _assert_matches_oracle_exactly(q, k, None, None, k_scale, dict(topk=topk))
  assert set(np.unique(o_sc[o_idx >= 0])) == {8.0, 16.0}
  last = o_idx[0, -1]
  want = [s for s in range(T) if high[0, s]][:topk]
  want += [s for s in range(T) if not high[0, s]][: topk - len(want)]
  assert last.tolist() == want
  assert len(set(value[0, want])) == 2  # both raw dots among the winners


def test_unsorted_fp8_selection_is_the_sorted_one_as_a_set():
  """fp8 q and k with row scales through the op, Pallas in interpret mode: `sorted=False` returns the
  sorted call's (index, score) pairs, reordered, the empty slots still last."""
  rng = np.random.default_rng(12)
  B, T, H, D, topk = 1, 40, 2, 8, 5
  q, k, w = _ints(rng, (B, T, H, D), -2, 2), _ints(rng, (B, T, D), -2, 2), _ints(rng, (B, T, H), -1, 2, jnp.float32)
  q_scale, k_scale = _pow2(rng, (B, T, H)), _pow2(rng, (B, T))
  kw = dict(q_scale=q_scale, k_scale=k_scale, topk=topk, backend="pallas")
  want, got = flash_topk(q, k, w, **kw), flash_topk(q, k, w, sorted=False, **kw)
  want_i, want_s, got_i, got_s = (np.asarray(x)[0] for x in (*want, *got))
  assert assert_reordered_selection(want_i, want_s, got_i, got_s) > 0 and (want_i == -1).any()


@pytest.mark.parametrize("fully_masked", [pytest.param(False, marks=pytest.mark.slow), True])  # True packs too
def test_integer_fp8_packed_segments_and_masked_rows(fully_masked):
  rng = np.random.default_rng(17 + fully_masked)
  B, T, H, D, topk = 2, 37, 2, 8, 6
  q, k = _ints(rng, (B, T, H, D), -2, 2), _ints(rng, (B, T, D), -2, 2)
  w = _ints(rng, (B, T, H), -1, 2, jnp.float32)
  q_scale, k_scale = _pow2(rng, (B, T, H)), _pow2(rng, (B, T))
  q_seg = packed_segments(rng, B, T, 3)
  kv_seg = q_seg.copy()
  if fully_masked:  # a late start of a key segment, and a batch whose queries see no key at all
    start = int(np.argmax(q_seg[0] == 1))
    kv_seg[0, start:start + 5] = 0
    kv_seg[1, :] = 5
  kw = dict(topk=topk, segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  o_idx, _, _ = _assert_matches_oracle_exactly(q, k, w, q_scale, k_scale, kw,
                                               dict(topk=topk, segment_ids=(q_seg, kv_seg)))
  if fully_masked:
    assert (o_idx[1] == -1).all() and (o_idx[0, start] == -1).all() and (o_idx[0] >= 0).any()


@pytest.mark.parametrize("power_of_two, use_weights, q_offset",
                         [pytest.param(False, True, 0, marks=pytest.mark.slow), (True, False, 9)])
def test_random_fp8_inputs_near_exact(power_of_two, use_weights, q_offset):
  rng = np.random.default_rng(11)
  B, Tq, Tk, H, D, topk = 2, 37, 46, 3, 32, 7
  q8, q_scale = quantize_fp8(jnp.asarray(rng.standard_normal((B, Tq, H, D)), jnp.float32), power_of_two=power_of_two)
  k8, k_scale = quantize_fp8(jnp.asarray(rng.standard_normal((B, Tk, D)), jnp.float32), power_of_two=power_of_two)
  w = jnp.asarray(rng.standard_normal((B, Tq, H)), jnp.float32) if use_weights else None
  kw = dict(topk=topk, q_offset=q_offset, scale=0.7)
  q64, k64, w64 = _dequantized(q8, k8, w, q_scale, k_scale)
  full, vis = oracle_scores(q64, k64, w64, 0.7), visibility(B, Tq, Tk, q_offset=q_offset)
  o_idx, o_sc = topk_oracle(q64, k64, w64, **kw)
  results, _ = _all_backends(q8, k8, w, q_scale, k_scale, **kw)
  for name, (idx, sc) in results.items():
    assert_topk_near_exact(idx, sc, full, vis, o_idx, o_sc, name)


def test_fp8_selects_from_the_fp8_score_not_the_bf16_one():
  """Keys whose bf16 scores are distinct but whose fp8 values tie: the fp8 path breaks the tie by index."""
  B, T, H, D = 1, 8, 1, 32
  k = np.ones((B, T, D), np.float32)
  k[0, 0] = 1.0625  # rounds to 1.0 in e4m3 (3 mantissa bits), so key 0 ties every other key
  q = jnp.ones((B, T, H, D), jnp.float32)
  bf16 = flash_topk(q.astype(jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), topk=2, q_offset=T)
  fp8 = flash_topk(q.astype(FP8), jnp.asarray(k, FP8), topk=2, q_offset=T, backend="pallas")
  assert np.asarray(bf16.indices)[0, -1].tolist() == [0, 1] and float(bf16.scores[0, -1, 0]) == 34.0
  assert np.asarray(fp8.indices)[0, -1].tolist() == [0, 1] and np.asarray(fp8.scores)[0, -1].tolist() == [32.0, 32.0]
  k[0, 0], k[0, 3] = 1.0, 1.0625  # the bf16 winner moves to key 3; in fp8 the lowest indices still win
  fp8 = flash_topk(q.astype(FP8), jnp.asarray(k, FP8), topk=2, q_offset=T, backend="pallas")
  bf16 = flash_topk(q.astype(jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), topk=2, q_offset=T)
  assert np.asarray(bf16.indices)[0, -1].tolist() == [3, 0]
  assert np.asarray(fp8.indices)[0, -1].tolist() == [0, 1]


def test_context_mesh_splits_fp8_rows_bit_identically():
  rng = np.random.default_rng(3)
  B, T, H, D, topk = 2, 32, 2, 8, 5
  q, k, w = _ints(rng, (B, T, H, D), -2, 2), _ints(rng, (B, T, D), -2, 2), _ints(rng, (B, T, H), -2, 2, jnp.float32)
  q_scale, k_scale = _pow2(rng, (B, T, H)), _pow2(rng, (B, T))
  select = jax.jit(lambda *a: flash_topk(*a[:3], q_scale=a[3], k_scale=a[4], topk=topk))
  want = select(q, k, w, q_scale, k_scale)
  with jax.set_mesh(jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)):
    assert "shard_map" in str(jax.make_jaxpr(select)(q, k, w, q_scale, k_scale))
    got = select(q, k, w, q_scale, k_scale)
  np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
  np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))
  o_idx, _ = topk_oracle(*_dequantized(q, k, w, q_scale, k_scale), topk=topk)
  np.testing.assert_array_equal(np.asarray(want.indices), o_idx)


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_explicit_context_parallel_call_takes_the_fp8_scales(layout):
  """`parallel.context_parallel_flash_topk` in zigzag and contiguous order: the same bits as one device."""
  rng = np.random.default_rng(5)
  n, B, T, H, D, topk = 4, 1, 32, 2, 8, 5
  q, k, w = _ints(rng, (B, T, H, D), -2, 2), _ints(rng, (B, T, D), -2, 2), _ints(rng, (B, T, H), -2, 2, jnp.float32)
  q_scale, k_scale = _pow2(rng, (B, T, H)), _pow2(rng, (B, T))
  want = flash_topk(q, k, w, q_scale=q_scale, k_scale=k_scale, topk=topk)
  lay = lambda x: parallel.to_layout(x, n, layout)
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,))
  got = parallel.context_parallel_flash_topk(lay(q), lay(k), lay(w), mesh=mesh, topk=topk, layout=layout,
                                             q_scale=lay(q_scale), k_scale=lay(k_scale))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(parallel.from_layout(a, n, layout)), np.asarray(b))


def test_quantize_fp8_rows():
  rng = np.random.default_rng(4)
  x = rng.standard_normal((3, 5, 64)).astype(np.float32) * np.float32([[[1e-3]], [[1.0]], [[300.0]]])
  x[0, 0] = 0.0  # an all-zero row: scale 1, values 0
  for power_of_two in (False, True):
    values, scales = quantize_fp8(jnp.asarray(x), power_of_two=power_of_two)
    assert values.dtype == FP8 and scales.dtype == jnp.float32 and scales.shape == (3, 5)
    v, s = np.asarray(values, np.float32), np.asarray(scales)
    assert s[0, 0] == 1.0 and not v[0, 0].any()
    amax = np.abs(v).max(-1)
    assert (amax <= 448).all() and (amax[1:] > (224 if power_of_two else 447)).all()
    if power_of_two:
      assert (np.log2(s) == np.round(np.log2(s))).all()
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each row's largest value
    assert (np.abs(v * s[..., None] - x).max(-1) <= np.abs(x).max(-1) * 2.0**-4 * (1 + power_of_two)).all()


def test_the_kernel_feeds_fp8_to_the_dot():
  q, k = jax.ShapeDtypeStruct((1, 64, 4, 32), FP8), jax.ShapeDtypeStruct((1, 64, 32), FP8)
  w, ks = jax.ShapeDtypeStruct((1, 64, 4), jnp.float32), jax.ShapeDtypeStruct((1, 64), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda q, k, w, ks: flash_topk_pallas(
      q, k, w, k_scale=ks, topk=8, config=Config(candidates=16, min_candidates=16), interpret=True))(q, k, w, ks)
  in_kernel = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
  dots = [d for e in in_kernel for d in equations(e.params["jaxpr"]) if d.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == FP8 for d in dots for v in d.invars), dots


def test_main_pass_lowers_for_h200_with_an_fp8_dot(monkeypatch):
  """DeepSeek-V3.2's shape (64 heads of 128): Pallas emits Triton IR whose dot takes e4m3 operands and
  accumulates in f32 (Triton's compile to PTX runs on the device)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  sd = jax.ShapeDtypeStruct
  B, T, H, D = 1, 512, 64, 128
  args = (sd((B, T, H, D), FP8), sd((B, T, D), FP8), sd((B, T, H), jnp.float32), sd((B, T), jnp.float32),
          sd((B, T), jnp.float32))

  def main_pass(q, k, w, t, key_scale):
    return flash_topk_candidates(q, k, w, t, q_offset=0, segment_ids=None, topk=64, compress_ratio=1, scale=1.0,
                                 slots=256, config=Config(), interpret=False, key_scale=key_scale, debug=True)

  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exported = export_for_h200(main_pass, *args)
  dots = re.findall(r"tt\.dot .*: (tensor<\S+>) \* (tensor<\S+>) -> (tensor<\S+>)", printed.getvalue())
  assert dots and all("f8E4M3FN" in a and "f8E4M3FN" in b and "xf32" in c for a, b, c in dots), dots
  assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1
  # The whole backend (threshold recursion, main passes, selection kernel, rescue) lowers too.
  exported = export_for_h200(lambda q, k, w, ks: flash_topk(q, k, w, k_scale=ks, topk=64, backend="pallas"),
                             *args[:3], args[4])
  assert "hyscale_flash_topk_candidates" in exported.mlir_module()


_Q8, _K8 = jnp.ones((1, 8, 2, 4), FP8), jnp.ones((1, 8, 4), FP8)

# name -> (q, k, q_scale, k_scale, offending fragment)
_BAD_FP8 = {
    "q_fp8_k_bf16": (_Q8, jnp.ones((1, 8, 4), jnp.bfloat16), None, None, "fp8 q and k come together"),
    "q_bf16_k_fp8": (jnp.ones((1, 8, 2, 4)), _K8, None, None, "fp8 q and k come together"),
    "e5m2": (jnp.ones((1, 8, 2, 4), jnp.float8_e5m2), _K8, None, None, "q.dtype=float8_e5m2"),
    "k_scale_without_fp8": (jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 4)), None, jnp.ones((1, 8)), "k_scale dequantizes"),
    "q_scale_shape": (_Q8, _K8, jnp.ones((1, 8)), None, "q_scale.shape=(1, 8) must be (1, 8, 2)"),
    "k_scale_shape": (_Q8, _K8, None, jnp.ones((1, 8, 1)), "k_scale.shape=(1, 8, 1) must be (1, 8)"),
    "k_scale_int": (_Q8, _K8, None, jnp.ones((1, 8), jnp.int32), "k_scale.dtype=int32"),
}


@pytest.mark.parametrize("case", list(_BAD_FP8))
def test_bad_fp8_inputs_raise_value_error(case):
  q, k, q_scale, k_scale, fragment = _BAD_FP8[case]
  with pytest.raises(ValueError, match=re.escape(fragment)):
    flash_topk(q, k, topk=3, q_scale=q_scale, k_scale=k_scale)


@pytest.mark.gpu_only
def test_gpu_fp8_integer_inputs_bit_exact_at_deepseek_shape():
  """Compiled on the H200 (fp8 WGMMA): 64 heads of 128, k = 256, integer e4m3 inputs with ue8m0 scales."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device")
  rng = np.random.default_rng(0)
  B, T, H, D, topk = 2, 2048, 64, 128, 256
  q, k, w = _ints(rng, (B, T, H, D), -3, 3), _ints(rng, (B, T, D), -3, 3), _ints(rng, (B, T, H), -2, 2, jnp.float32)
  q_scale, k_scale = _pow2(rng, (B, T, H), -4, 1), _pow2(rng, (B, T), -4, 1)
  kw = dict(topk=topk, scale=0.5, q_scale=q_scale, k_scale=k_scale)
  got = flash_topk(q, k, w, backend="pallas", **kw)
  for backend in ("reference", "xla_baseline"):
    want = flash_topk(q, k, w, backend=backend, **kw)
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices), err_msg=backend)
    np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores), err_msg=backend)
