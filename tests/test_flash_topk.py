"""Tests for `hyscale_jax.ops.flash_topk` against the float64 oracle in tests/oracles.py.

Integer-valued inputs must give the oracle's indices bit for bit; random real inputs may differ only
at keys whose scores are within float32 rounding of the k-th score (DESIGN.md, "What exact means").
"""

import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops import flash_topk
from hyscale_jax.ops.flash_topk import api as flash_topk_api
from hyscale_jax.ops.flash_topk import flash_topk_reference
from hyscale_jax.ops.flash_topk.pallas import flash_topk_pallas
from pallas_kernels.flash_topk import Config as PallasConfig

try:
  from tests.jaxpr_tools import largest_intermediate
  from tests.oracles import index_scores as oracle_scores
  from tests.oracles import topk_oracle, visibility
  from tests.topk_checks import assert_topk_near_exact, packed_segments
except ImportError:  # tests/ itself is on sys.path (pytest rootdir-less import mode)
  from jaxpr_tools import largest_intermediate
  from oracles import index_scores as oracle_scores
  from oracles import topk_oracle, visibility
  from topk_checks import assert_topk_near_exact, packed_segments

# Small and odd (query_block, key_chunk) pairs: multi-chunk merging, chunk skipping and padding.
_SMALL_BLOCKS = ((8, 16), (5, 7))


@functools.partial(
    jax.jit, static_argnames=("topk", "compress_ratio", "scale", "query_block", "key_chunk")
)
def _reference_jit(q, k, w, q_offset, segment_ids, *, topk, compress_ratio, scale, query_block,
                   key_chunk):
  return flash_topk_reference(
      q, k, w, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset,
      segment_ids=segment_ids, scale=scale, query_block=query_block, key_chunk=key_chunk,
  )


# Pallas configs for tiny shapes: the default (every key fits the buffer), a sampled threshold with
# recursion, and buffers so small that rows overflow and the exact rescue runs; that one also scores
# with keys as the matmul's rows (several queries per program, so the head sum's transpose runs).
_PALLAS_CONFIGS = {
    "pallas[threshold]": PallasConfig(block_rows=16, block_k=8, candidates=8, min_candidates=8,
                                      sample_rank=2, chunk_bytes=2048),
    "pallas[overflow,keys_as_rows]": PallasConfig(block_rows=32, block_k=16, candidates=2, min_candidates=2,
                                                  sample_rank=1, oversample=1.0, keys_as_rows=True),
}


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale", "config"))
def _pallas_jit(q, k, w, q_offset, segment_ids, *, topk, compress_ratio, scale, config):
  return flash_topk_pallas(q, k, w, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset,
                           segment_ids=segment_ids, scale=scale, config=config)


def _all_backends(q, k, w, **kw):
  """{name: (indices, scores)}: every public backend, the reference at tiny block sizes, and the
  Pallas kernel (interpret mode) under configs that force its threshold and rescue paths."""
  results = {}
  for backend in ("reference", "xla_baseline", "pallas"):
    results[backend] = tuple(flash_topk(q, k, w, backend=backend, **kw))
  kw = dict(kw)
  q_offset = kw.pop("q_offset", 0)
  segment_ids = kw.pop("segment_ids", None)
  kw.setdefault("compress_ratio", 1)
  kw.setdefault("scale", 1.0)
  for qb, kc in _SMALL_BLOCKS:
    results[f"reference[{qb}x{kc}]"] = _reference_jit(
        q, k, w, q_offset, segment_ids, query_block=qb, key_chunk=kc, **kw)
  for name, config in _PALLAS_CONFIGS.items():
    results[name] = _pallas_jit(q, k, w, q_offset, segment_ids, config=config, **kw)
  return results


def _ints(rng, shape, lo, hi, dtype):
  return jnp.asarray(rng.integers(lo, hi + 1, size=shape).astype(np.float32), dtype)


# name -> (B, Tq, Tk, H, D, topk, dtype, q_range, k_range, weights, extra kwargs)
_INT_CASES = {
    "ties_all_equal": (1, 20, 20, 2, 4, 6, jnp.float32, (1, 1), (1, 1), None, {}),
    "relu_plateau_neg_weights_bf16": (2, 37, 37, 3, 8, 9, jnp.bfloat16, (0, 2), (-3, 1), (-2, 2), {}),
    "rows_shorter_than_k_topk_gt_tk": (1, 12, 12, 2, 4, 16, jnp.float32, (-2, 2), (-2, 2), (0, 2), {}),
    "compress_ratio_4": (2, 37, 9, 2, 8, 5, jnp.float32, (-2, 2), (-2, 2), (-1, 2), {"compress_ratio": 4}),
    "compress4_q_offset": (1, 16, 20, 2, 8, 6, jnp.bfloat16, (-2, 2), (-2, 2), None,
                           {"compress_ratio": 4, "q_offset": 50}),
    "q_offset_shard_at_end": (2, 16, 37, 3, 8, 8, jnp.float32, (-2, 2), (-3, 3), (-2, 2), {"q_offset": 21}),
    "q_offset_scale": (1, 20, 20, 2, 4, 6, jnp.bfloat16, (-3, 3), (-3, 3), (1, 3),
                       {"q_offset": 3, "scale": 0.5}),
    "k_equals_1_bf16": (2, 37, 37, 3, 8, 1, jnp.bfloat16, (-2, 2), (-2, 2), None, {}),
    "k_equals_tk": (1, 37, 37, 2, 8, 37, jnp.float32, (-2, 2), (-2, 2), (-2, 2), {}),
    "longer_multi_chunk": (1, 80, 80, 4, 16, 10, jnp.bfloat16, (-2, 2), (-2, 2), (-2, 2), {}),
}


def _int_inputs(rng, case):
  B, Tq, Tk, H, D, topk, dtype, qr, kr, wr, extra = case
  q = _ints(rng, (B, Tq, H, D), *qr, dtype)
  k = _ints(rng, (B, Tk, D), *kr, dtype)
  w = None if wr is None else _ints(rng, (B, Tq, H), *wr, dtype)
  return q, k, w, dict(topk=topk, **extra)


def _assert_matches_oracle_exactly(results, q, k, w, kw):
  o_idx, o_sc = topk_oracle(np.asarray(q, np.float64), np.asarray(k, np.float64),
                            None if w is None else np.asarray(w, np.float64), **kw)
  for name, (idx, sc) in results.items():
    assert idx.dtype == jnp.int32 and sc.dtype == jnp.float32, name
    assert idx.shape == o_idx.shape and sc.shape == o_idx.shape, name
    np.testing.assert_array_equal(np.asarray(idx), o_idx, err_msg=f"indices, backend {name}")
    np.testing.assert_array_equal(np.asarray(sc), o_sc.astype(np.float32), err_msg=f"scores, {name}")
  return o_idx, o_sc


@pytest.mark.parametrize("case", list(_INT_CASES))
def test_integer_inputs_bit_exact(case):
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  q, k, w, kw = _int_inputs(rng, _INT_CASES[case])
  o_idx, o_sc = _assert_matches_oracle_exactly(_all_backends(q, k, w, **kw), q, k, w, kw)
  # The inputs must actually exercise something: at least one visible key somewhere.
  assert (o_idx >= 0).any()
  if case == "ties_all_equal":  # every visible score ties: lowest indices first
    assert (o_idx[0, 19] == np.arange(6)).all()
  if case == "relu_plateau_neg_weights_bf16":  # most scores sit on the exact-zero plateau
    assert (o_sc == 0).mean() > 0.3 and (o_sc < 0).any()
  if case == "compress_ratio_4":  # rows 0..2 see no compressed block
    assert (o_idx[:, :3] == -1).all() and (o_idx[:, 3, 0] == 0).all()
  if case == "rows_shorter_than_k_topk_gt_tk":
    assert (o_idx[:, -1, 12:] == -1).all() and (o_idx[:, 0, 1:] == -1).all()


@pytest.mark.parametrize("fully_masked", [False, True])
def test_integer_inputs_packed_segments(fully_masked):
  rng = np.random.default_rng(7 + fully_masked)
  B, T, H, D, topk = 2, 37, 2, 8, 6
  q = _ints(rng, (B, T, H, D), -2, 2, jnp.float32)
  k = _ints(rng, (B, T, D), -2, 2, jnp.float32)
  w = _ints(rng, (B, T, H), -1, 2, jnp.float32)
  q_seg = packed_segments(rng, B, T, 3)
  kv_seg = q_seg.copy()
  if fully_masked:  # segment 1 of the keys starts late: its first queries see no key at all
    start = int(np.argmax(q_seg[0] == 1))
    kv_seg[0, start:start + 5] = 0
    kv_seg[1, :] = 5  # batch 1: no key shares a segment with any query
  kw = dict(topk=topk, segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  o_idx, _ = _assert_matches_oracle_exactly(_all_backends(q, k, w, **kw), q, k, w,
                                            dict(topk=topk, segment_ids=(q_seg, kv_seg)))
  if fully_masked:
    assert (o_idx[1] == -1).all() and (o_idx[0, start] == -1).all() and (o_idx[0] >= 0).any()


# CI time: each dtype once, each of (weights, offset) once; the crossed pairs are slow.
@pytest.mark.parametrize("use_weights,q_offset,dtype", [
    (True, 0, jnp.float32), (False, 9, jnp.bfloat16),
    pytest.param(True, 0, jnp.bfloat16, marks=pytest.mark.slow), pytest.param(False, 9, jnp.float32, marks=pytest.mark.slow)])
def test_random_real_inputs_near_exact(dtype, use_weights, q_offset):
  rng = np.random.default_rng(11)
  B, Tq, Tk, H, D, topk = 2, 37, 46, 3, 8, 7
  q = jnp.asarray(rng.standard_normal((B, Tq, H, D)), dtype)
  k = jnp.asarray(rng.standard_normal((B, Tk, D)), dtype)
  w = jnp.asarray(rng.standard_normal((B, Tq, H)), dtype) if use_weights else None
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  w64 = None if w is None else np.asarray(w, np.float64)
  kw = dict(topk=topk, q_offset=q_offset, scale=0.7)
  full = oracle_scores(q64, k64, w64, 0.7)
  vis = visibility(B, Tq, Tk, q_offset=q_offset)
  o_idx, o_sc = topk_oracle(q64, k64, w64, **kw)
  for name, (idx, sc) in _all_backends(q, k, w, **kw).items():
    assert_topk_near_exact(idx, sc, full, vis, o_idx, o_sc, name)


def test_deterministic_and_backends_agree():
  rng = np.random.default_rng(3)
  q, k, w, kw = _int_inputs(rng, _INT_CASES["relu_plateau_neg_weights_bf16"])
  first = flash_topk(q, k, w, **kw)
  second = flash_topk(q, k, w, **kw)
  for a, b in zip(first, second):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  base = flash_topk(q, k, w, backend="xla_baseline", **kw)
  np.testing.assert_array_equal(np.asarray(first.indices), np.asarray(base.indices))
  np.testing.assert_array_equal(np.asarray(first.scores), np.asarray(base.scores))
  # Real-valued inputs: the same call twice gives the same bits too.
  qr = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  kr = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
  a, b = flash_topk(qr, kr, topk=5), flash_topk(qr, kr, topk=5)
  assert np.asarray(a.indices).tobytes() == np.asarray(b.indices).tobytes()
  assert np.asarray(a.scores).tobytes() == np.asarray(b.scores).tobytes()


def test_unsorted_is_the_same_selection_through_the_op():
  """`sorted=False` reaches the backend: the Pallas kernel (interpret mode) returns the sorted
  entries in its own, repeatable order; the reference backends return the sorted order itself."""
  rng = np.random.default_rng(4)
  q, k, w, kw = _int_inputs(rng, _INT_CASES["longer_multi_chunk"])
  want = flash_topk(q, k, w, backend="reference", **kw)
  for backend in ("reference", "xla_baseline"):
    got = flash_topk(q, k, w, backend=backend, sorted=False, **kw)
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices), err_msg=backend)
  config = PallasConfig(block_rows=16, block_k=8, candidates=16, min_candidates=16, sample_rank=2)  # slots > topk
  unsorted = [flash_topk_pallas(q, k, w, config=config, sorted=False, **kw) for _ in range(2)]
  assert np.asarray(unsorted[0][0]).tobytes() == np.asarray(unsorted[1][0]).tobytes()
  got, ref = np.asarray(unsorted[0][0]), np.asarray(want.indices)
  assert not np.array_equal(got, ref)
  np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(ref, axis=-1))
  op = flash_topk(q, k, w, backend="pallas", sorted=False, **kw)  # the op's default config: key order
  direct = flash_topk_pallas(q, k, w, sorted=False, **kw)
  np.testing.assert_array_equal(np.asarray(op.indices), np.asarray(direct[0]))
  assert not np.array_equal(np.asarray(op.indices), np.asarray(flash_topk(q, k, w, backend="pallas", **kw).indices))


def _count_named(jaxpr, fragment):
  return sum(fragment in str(e.params.get("name", "")) for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("backend", ["auto", "reference", "xla_baseline"])
def test_jaxpr_has_one_named_equation_per_call(backend):
  q, k = jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 4))
  one = jax.make_jaxpr(lambda q, k: flash_topk(q, k, topk=4, backend=backend))(q, k)
  assert _count_named(one, "flash_topk") == 1
  two = jax.make_jaxpr(
      lambda q, k: (flash_topk(q, k, topk=4, backend=backend),
                    flash_topk(2 * q, k, topk=3, backend=backend)))(q, k)
  assert _count_named(two, "flash_topk") == 2


def test_reference_never_materializes_score_table():
  B, T, H, D, topk = 1, 1024, 2, 8, 32
  q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)
  ref = jax.make_jaxpr(lambda q, k: flash_topk(q, k, topk=topk, backend="reference"))(q, k)
  base = jax.make_jaxpr(lambda q, k: flash_topk(q, k, topk=topk, backend="xla_baseline"))(q, k)
  assert largest_intermediate(base) >= T * T  # the checker does see the baseline's table
  assert largest_intermediate(ref) < T * T // 4


def test_outputs_carry_no_gradient():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((1, 12, 2, 4)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 12, 4)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((1, 12, 2)), jnp.float32)
  f = lambda q, k, w: flash_topk(q, k, w, topk=4, q_offset=8).scores.sum()
  assert np.isfinite(float(f(q, k, w))) and float(jnp.abs(f(q, k, w))) > 0
  for g in jax.grad(f, argnums=(0, 1, 2))(q, k, w):
    assert not np.asarray(g).any()
  g = jax.jit(jax.grad(lambda q: flash_topk(q, k, topk=30).scores.sum()))(q)
  assert not np.asarray(g).any() and np.isfinite(np.asarray(g)).all()


def test_jit_vmap_and_traced_q_offset():
  rng = np.random.default_rng(9)
  N, B, T, H, D, topk = 2, 1, 20, 2, 4, 5
  q = _ints(rng, (N, B, T, H, D), -2, 2, jnp.float32)
  k = _ints(rng, (N, B, T, D), -2, 2, jnp.float32)
  batched = jax.vmap(lambda q, k: flash_topk(q, k, topk=topk))(q, k)
  for n in range(N):
    o_idx, o_sc = topk_oracle(np.asarray(q[n]), np.asarray(k[n]), topk=topk)
    np.testing.assert_array_equal(np.asarray(batched.indices[n]), o_idx)
    np.testing.assert_array_equal(np.asarray(batched.scores[n]), o_sc.astype(np.float32))
  jitted = jax.jit(lambda q, k: flash_topk(q, k, topk=topk))(q[0], k[0])
  np.testing.assert_array_equal(np.asarray(jitted.indices), np.asarray(batched.indices[0]))
  for backend in ("reference", "xla_baseline"):
    static = flash_topk(q[0], k[0], topk=topk, q_offset=5, backend=backend)
    traced = jax.jit(lambda off: flash_topk(q[0], k[0], topk=topk, q_offset=off, backend=backend))(
        jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(traced.indices), np.asarray(static.indices))
    np.testing.assert_array_equal(np.asarray(traced.scores), np.asarray(static.scores))
    o_idx, _ = topk_oracle(np.asarray(q[0]), np.asarray(k[0]), topk=topk, q_offset=5)
    np.testing.assert_array_equal(np.asarray(static.indices), o_idx)


_B, _T, _H, _D = 1, 8, 2, 4
_Q, _K, _W = jnp.ones((_B, _T, _H, _D)), jnp.ones((_B, _T, _D)), jnp.ones((_B, _T, _H))
_SEG = jnp.zeros((_B, _T), jnp.int32)

# name -> (kwargs for flash_topk, argument name, offending fragment)
_BAD_INPUTS = {
    "q_rank": (dict(q=jnp.ones((_B, _T, _D))), "q", "q.shape=(1, 8, 4)"),
    "k_rank": (dict(k=jnp.ones((_B, _T, 1, _D))), "k", "k.shape=(1, 8, 1, 4)"),
    "weights_rank": (dict(weights=jnp.ones((_B, _T))), "weights", "weights.shape=(1, 8)"),
    "batch_mismatch": (dict(k=jnp.ones((2, _T, _D))), "k", "k.shape=(2, 8, 4)"),
    "head_dim_mismatch": (dict(k=jnp.ones((_B, _T, _D + 1))), "k", "k.shape=(1, 8, 5)"),
    "weights_heads": (dict(weights=jnp.ones((_B, _T, _H + 1))), "weights", "weights.shape=(1, 8, 3)"),
    "weights_batch": (dict(weights=jnp.ones((2, _T, _H))), "weights", "weights.shape=(2, 8, 2)"),
    "topk_zero": (dict(topk=0), "topk", "topk=0"),
    "topk_negative": (dict(topk=-1), "topk", "topk=-1"),
    "topk_float": (dict(topk=2.0), "topk", "topk=2.0"),
    "compress_ratio_zero": (dict(compress_ratio=0), "compress_ratio", "compress_ratio=0"),
    "segment_ids_float": (dict(segment_ids=(_SEG.astype(jnp.float32), _SEG)),
        "segment_ids", "q_seg.dtype=float32"),
    "segment_ids_shape": (dict(segment_ids=(_SEG, _SEG[:, :5])), "segment_ids", "kv_seg.shape=(1, 5)"),
    "q_not_float": (dict(q=jnp.ones((_B, _T, _H, _D), jnp.int32)), "q", "q.dtype=int32"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
def test_bad_input_raises_value_error(case):
  overrides, arg, fragment = _BAD_INPUTS[case]
  args = dict(q=_Q, k=_K, weights=_W, topk=3)
  args.update(overrides)
  with pytest.raises(ValueError, match=re.escape(arg)) as info:
    flash_topk(args.pop("q"), args.pop("k"), args.pop("weights"), **args)
  assert fragment in str(info.value), str(info.value)


def test_bad_backend_names():
  with pytest.raises(ValueError, match="backend"):
    flash_topk(_Q, _K, topk=3, backend="no_such_backend")
  assert {"pallas", "reference", "xla_baseline"} <= set(flash_topk_api.REGISTRY.implementations)
