"""Property tests: every public op on drawn shapes, dtypes, odd lengths, extreme values and bad input.

Hypothesis draws the cases; each op must match the float64 oracle of tests/oracles.py as DESIGN.md
("What exact means") promises, or raise a ValueError that names the bad argument: never another
exception, a hang or a silent NaN. Runs are derandomized and keep no example database, so every run
checks the same cases. Shapes come from small ranges because JAX compiles once per shape, and there
is no shrink phase (it would recompile per candidate); a failure prints the case as drawn.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hyscale_jax.ops import flash_topk, indexer_loss, sparse_attention

try:
  from tests.oracles import indexer_loss_oracle, sparse_attention_oracle, topk_oracle, visibility
except ImportError:  # tests/ itself is on sys.path (pytest rootdir-less import mode)
  from oracles import indexer_loss_oracle, sparse_attention_oracle, topk_oracle, visibility

TOPK_BACKENDS = ("reference", "xla_baseline")


def _settings(max_examples):
  return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                  phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _jax(x):
  """NumPy arrays (also inside a pair) to JAX arrays; None and Python scalars pass through."""
  if isinstance(x, tuple):
    return tuple(_jax(a) for a in x)
  return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def _small_ints(draw, shape):
  return draw(hnp.arrays(np.int8, shape, elements=st.integers(-3, 3))).astype(np.float32)


def _segments(draw, B, Tq, Tk):
  if not draw(st.booleans()):
    return None
  ids = lambda n: draw(hnp.arrays(np.int32, (B, n), elements=st.integers(0, 2)))
  return ids(Tq), ids(Tk)


def _normal(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# flash_topk


@st.composite
def _topk_case(draw, max_len=20):
  B, Tq, Tk = draw(st.integers(1, 2)), draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
  H, D = draw(st.integers(1, 3)), draw(st.integers(1, 8))
  weighted = draw(st.booleans())
  return dict(
      q=_small_ints(draw, (B, Tq, H, D)), k=_small_ints(draw, (B, Tk, D)),
      weights=_small_ints(draw, (B, Tq, H)) if weighted else None,
      topk=draw(st.integers(1, Tk + 3)), compress_ratio=draw(st.integers(1, 4)),
      q_offset=draw(st.integers(0, 10)), segment_ids=_segments(draw, B, Tq, Tk), scale=1.0,
  )


def _run_topk(case, backend, dtype=jnp.float32, q_offset_as_array=False):
  args = {n: case[n] if case[n] is None else jnp.asarray(case[n], dtype) for n in ("q", "k", "weights")}
  q_offset = jnp.int32(case["q_offset"]) if q_offset_as_array else case["q_offset"]
  got = flash_topk(**args, topk=case["topk"], compress_ratio=case["compress_ratio"], q_offset=q_offset,
                   segment_ids=_jax(case["segment_ids"]), scale=case["scale"], backend=backend)
  assert got.indices.dtype == jnp.int32 and got.scores.dtype == jnp.float32
  assert got.indices.shape == got.scores.shape == case["q"].shape[:2] + (case["topk"],)
  return np.asarray(got.indices), np.asarray(got.scores)


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@_settings(20)
@given(case=_topk_case(), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), q_offset_as_array=st.booleans())
def test_flash_topk_integer_inputs_match_the_oracle_bit_for_bit(backend, case, dtype, q_offset_as_array):
  indices, scores = _run_topk(case, backend, dtype, q_offset_as_array)
  want_indices, want_scores = topk_oracle(**case)
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(scores.astype(np.float64), want_scores)  # -inf tail included
  assert not np.isnan(scores).any()


# Inputs are small integers times 2**e. f32 is then exact unless a stage leaves the normal range:
# 2**-140 is subnormal (XLA on CPU reads it as 0), and 2**64 * 2**64 overflows to inf.
_EXPONENTS = (-140, -70, 0, 64, 100)
_NORMAL = range(-126, 111)  # exponents for which int * 2**e and every partial sum stay normal


@st.composite
def _extreme_topk_case(draw):
  case = draw(_topk_case(max_len=8))
  exps = {n: draw(st.sampled_from(_EXPONENTS)) for n in ("q", "k", "weights")}
  scale_exp = draw(st.sampled_from((0, -60, 60)))
  case["scale"] = draw(st.sampled_from((1.0, -1.0))) * 2.0**scale_exp
  exact = exps["q"] in _NORMAL and exps["k"] in _NORMAL
  stage = exps["q"] + exps["k"]
  for name in ("q", "k", "weights"):
    if case[name] is not None:
      case[name] = (case[name] * 2.0 ** exps[name]).astype(np.float32)
  if case["weights"] is not None:
    exact &= exps["weights"] in _NORMAL and stage in _NORMAL
    stage += exps["weights"]
  exact &= stage in _NORMAL and stage + scale_exp in _NORMAL
  return case, bool(exact)


def _overflow_case(weights, scale):
  """One query, one visible key, |<q, k>| = 2**128 (inf in f32): the score is +-inf or NaN in f32."""
  H = 1 if weights is None else len(weights)
  return dict(q=np.full((1, 1, H, 1), 2.0**64, np.float32), k=np.full((1, 1, 1), 2.0**64, np.float32),
              weights=None if weights is None else np.array([[weights]], np.float32), topk=1,
              compress_ratio=1, q_offset=0, segment_ids=None, scale=scale), False


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@_settings(25)
@example(drawn=_overflow_case(None, -1.0))  # score -inf: the visible key must still be listed
@example(drawn=_overflow_case([1.0, 0.0], 1.0))  # 0 * inf in the head sum: no NaN, key listed
@given(drawn=_extreme_topk_case())
def test_flash_topk_extreme_values_keep_the_contract(backend, drawn):
  case, exact = drawn
  indices, scores = _run_topk(case, backend)
  if exact:  # no f32 stage leaves the normal range: the f32 scores are the f64 scores
    want_indices, want_scores = topk_oracle(**case)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(scores.astype(np.float64), want_scores)
    return
  # Overflow or subnormals: the f32 scores may differ from f64 (+inf ties go index ascending),
  # but every row must still be a valid, ordered selection of visible keys, and NaN-free.
  assert not np.isnan(scores).any(), f"NaN score from finite inputs: {scores.tolist()}"
  B, Tq, Tk = case["q"].shape[0], case["q"].shape[1], case["k"].shape[1]
  visible = visibility(B, Tq, Tk, compress_ratio=case["compress_ratio"], q_offset=case["q_offset"],
                       segment_ids=case["segment_ids"])
  for b, t in np.ndindex(B, Tq):
    row, row_scores = indices[b, t], scores[b, t]
    n = min(case["topk"], int(visible[b, t].sum()))
    assert (row[:n] >= 0).all() and (row[n:] == -1).all(), (
        f"row ({b},{t}) has {int(visible[b, t].sum())} visible keys but lists {row.tolist()} "
        f"with scores {row_scores.tolist()}")
    assert visible[b, t, row[:n]].all() and len(set(row[:n].tolist())) == n
    assert (row_scores[n:] == -np.inf).all()
    order = list(zip((-row_scores[:n]).tolist(), row[:n].tolist()))
    assert order == sorted(order), f"not (score desc, index asc): {order}"


@_settings(10)
@given(case=_topk_case(max_len=8), data=st.data())
def test_flash_topk_int64_segment_ids_are_not_wrapped_to_int32(case, data):
  """kv ids 0 and 2**32 are different documents: the key must stay invisible (or a ValueError)."""
  B, Tq, Tk = case["q"].shape[0], case["q"].shape[1], case["k"].shape[1]
  far = data.draw(hnp.arrays(np.bool_, (B, Tk)), label="kv id 2**32")
  case["segment_ids"] = (np.zeros((B, Tq), np.int64), np.where(far, 2**32, 0).astype(np.int64))
  try:
    got = flash_topk(jnp.asarray(case["q"]), jnp.asarray(case["k"]), _jax(case["weights"]),
                     topk=case["topk"], compress_ratio=case["compress_ratio"], q_offset=case["q_offset"],
                     segment_ids=case["segment_ids"], backend="reference")
  except ValueError as e:
    assert "segment_ids" in str(e)
    return
  np.testing.assert_array_equal(np.asarray(got.indices), topk_oracle(**case)[0])


# ------------------------------------------------------------------------------------------------
# sparse_attention


@st.composite
def _attention_case(draw, max_len=12):
  B, T, S = draw(st.integers(1, 2)), draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
  G = draw(st.sampled_from((1, 2)))
  H, K = G * draw(st.integers(1, 2)), draw(st.integers(1, 6))
  Dk, Dv = draw(st.integers(1, 8)), draw(st.integers(1, 8))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return dict(
      q=_normal(rng, B, T, H, Dk), k=_normal(rng, B, S, G, Dk), v=_normal(rng, B, S, G, Dv),
      indices=draw(hnp.arrays(np.int32, (B, T, K), elements=st.integers(-1, S + 1))),
      sinks=3 * _normal(rng, H) if draw(st.booleans()) else None,
  )


def _run_attention(case, scale):
  out, lse = sparse_attention(**{n: _jax(x) for n, x in case.items()}, scale=scale, backend="reference")
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert out.shape == case["q"].shape[:3] + case["v"].shape[3:] and lse.shape == case["q"].shape[:3]
  out, lse = np.asarray(out), np.asarray(lse)
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  return out, lse


def _empty_rows(case):
  """bool[B, T]: rows whose indices are all outside [0, S)."""
  idx = np.asarray(case["indices"])
  return ~((idx >= 0) & (idx < case["k"].shape[1])).any(axis=-1)


@_settings(25)
@given(case=_attention_case(), scale=st.sampled_from((0.25, 1.0, 2.0)))
def test_sparse_attention_matches_the_oracle(case, scale):
  out, lse = _run_attention(case, scale)
  want_out, want_lse = sparse_attention_oracle(**case, scale=scale)
  tol = 1e-5 * max(np.abs(want_out).max(), 1.0)
  np.testing.assert_allclose(out, want_out, rtol=0, atol=tol)
  finite = np.isfinite(want_lse)
  np.testing.assert_array_equal(np.isfinite(lse), finite)
  np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=0,
                             atol=1e-5 * max(np.abs(want_lse[finite]).max(initial=0.0), 1.0))
  empty = _empty_rows(case)
  assert (out[empty] == 0).all()
  sink_lse = np.full(lse.shape[2], -np.inf, np.float32) if case["sinks"] is None else case["sinks"]
  np.testing.assert_array_equal(lse[empty], np.broadcast_to(sink_lse, lse[empty].shape))


@_settings(15)
@given(case=_attention_case(max_len=6), scale=st.sampled_from((1e4, -1e4, 1e7)))
def test_sparse_attention_extreme_logits_stay_finite_and_convex(case, scale):
  """Huge logits from ordinary inputs: out stays a convex mix of the row's values (of 0 too, with sinks)."""
  out, lse = _run_attention(case, scale)
  assert np.isfinite(out).all()
  assert np.isfinite(lse[~_empty_rows(case)]).all()
  (B, T, H, _), (S, G) = out.shape, case["k"].shape[1:3]
  for b, t, h in np.ndindex(B, T, H):
    rows = [s for s in case["indices"][b, t] if 0 <= s < S]
    values = case["v"][b, rows, h // (H // G)]
    if case["sinks"] is not None or not rows:
      values = np.concatenate([values, np.zeros_like(case["v"][b, :1, 0])])
    tol = 1e-5 * max(np.abs(values).max(), 1e-30)
    assert (values.min(0) - tol <= out[b, t, h]).all() and (out[b, t, h] <= values.max(0) + tol).all(), (
        f"row ({b},{t},{h}) out={out[b, t, h].tolist()} outside the hull of its values {values.tolist()}")


@_settings(10)
@given(case=_attention_case(max_len=6), data=st.data())
def test_sparse_attention_skips_int64_indices_outside_int32(case, data):
  """Index i + 2**32 is outside [0, S): skipped (or a ValueError), never wrapped back onto key i."""
  far = data.draw(hnp.arrays(np.bool_, case["indices"].shape), label="add 2**32")
  case["indices"] = case["indices"].astype(np.int64) + np.where(far, 2**32, 0)
  try:
    out, lse = sparse_attention(**{n: _jax(x) for n, x in case.items() if n != "indices"},
                                indices=case["indices"], scale=1.0, backend="reference")
  except ValueError as e:
    assert "indices" in str(e)
    return
  want_out, want_lse = sparse_attention_oracle(**case, scale=1.0)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# indexer_loss


@st.composite
def _loss_case(draw):
  B, T, S = draw(st.integers(1, 2)), draw(st.integers(1, 10)), draw(st.integers(1, 12))
  HI, DI, Dk = draw(st.integers(1, 2)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
  G = draw(st.sampled_from((1, 2)))
  H = G * draw(st.integers(1, 2))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  case = dict(index_q=_normal(rng, B, T, HI, DI), index_k=_normal(rng, B, S, DI),
              index_weights=_normal(rng, B, T, HI) if draw(st.booleans()) else None,
              attn_q=_normal(rng, B, T, H, Dk), attn_k=_normal(rng, B, S, G, Dk),
              attn_scale=Dk**-0.5, index_scale=draw(st.sampled_from((1.0, 0.5))))
  if draw(st.booleans()):  # the selection, with the attention's lse or a larger one
    indices = draw(hnp.arrays(np.int32, (B, T, draw(st.integers(1, 6))), elements=st.integers(-1, S + 1)))
    _, lse = sparse_attention_oracle(case["attn_q"], case["attn_k"], np.zeros((B, S, G, 1)), indices,
                                     scale=case["attn_scale"])
    case.update(indices=indices, attn_lse=(lse + draw(st.sampled_from((0.0, 1.5)))).astype(np.float32))
  else:  # dense warm-up form over the visible keys
    lse = rng.uniform(3, 6, (B, T, H)).astype(np.float32) if draw(st.booleans()) else None
    case.update(indices=None, attn_lse=lse, compress_ratio=draw(st.integers(1, 3)),
                q_offset=draw(st.integers(0, 6)), segment_ids=_segments(draw, B, T, S))
  return case


@_settings(25)
@given(case=_loss_case())
def test_indexer_loss_matches_the_oracle(case):
  loss = indexer_loss(**{n: _jax(x) for n, x in case.items()}, backend="reference")
  assert loss.shape == () and loss.dtype == jnp.float32
  loss, want = float(loss), indexer_loss_oracle(**case)
  assert np.isfinite(loss) and loss >= -1e-6
  assert abs(loss - want) <= 1e-4 * abs(want) + 1e-6, (loss, want)


# ------------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument, never another exception type.

_BAD_SCALE = ("1", None, float("nan"), float("inf"), np.ones(1, np.float32), True)
_BAD_COUNT = (0, -2, 1.5, True, "2", None)
_BAD_OFFSET = (1.5, "0", None, True, 2**40, np.zeros(2, np.int32), np.float32(0.0))
_BAD_BACKEND = ("nope", None)


def _flash_topk_args(sparse):
  f = lambda *shape: np.ones(shape, np.float32)
  return dict(q=f(2, 3, 2, 4), k=f(2, 5, 4), weights=f(2, 3, 2), topk=2, compress_ratio=1, q_offset=0,
              segment_ids=(np.zeros((2, 3), np.int32), np.zeros((2, 5), np.int32)), scale=1.0,
              backend="reference")


def _sparse_attention_args(sparse):
  f = lambda *shape: np.ones(shape, np.float32)
  return dict(q=f(2, 3, 2, 3), k=f(2, 4, 2, 3), v=f(2, 4, 2, 2), indices=np.zeros((2, 3, 2), np.int32),
              sinks=f(2), scale=1.0, backend="reference")


def _indexer_loss_args(sparse):
  f = lambda *shape: np.ones(shape, np.float32)
  return dict(index_q=f(2, 3, 2, 3), index_k=f(2, 4, 3), index_weights=f(2, 3, 2), attn_q=f(2, 3, 2, 3),
              attn_k=f(2, 4, 1, 3), attn_lse=f(2, 3, 2) if sparse else None,
              indices=np.zeros((2, 3, 2), np.int32) if sparse else None, attn_scale=1.0, index_scale=1.0,
              compress_ratio=1, q_offset=0,
              segment_ids=(np.zeros((2, 3), np.int32), np.zeros((2, 4), np.int32)), backend="reference")


# op -> (function, valid arguments, {array: axes tied to another argument}, {scalar: bad values},
#        arguments for which None is valid).
_BAD_INPUT_OPS = {
    "flash_topk": (flash_topk, _flash_topk_args,
                   {"q": (0, 3), "k": (0, 2), "weights": (0, 1, 2), "segment_ids": (0, 1)},
                   {"topk": _BAD_COUNT, "compress_ratio": _BAD_COUNT, "q_offset": _BAD_OFFSET,
                    "scale": _BAD_SCALE, "backend": _BAD_BACKEND}, {"weights"}),
    "sparse_attention": (sparse_attention, _sparse_attention_args,
                         {"q": (0, 1, 2, 3), "k": (0, 1, 2, 3), "v": (0, 1, 2), "indices": (0, 1),
                          "sinks": (0,)},
                         {"scale": _BAD_SCALE, "backend": _BAD_BACKEND}, {"sinks", "v"}),  # v=None: k's prefix
    "indexer_loss": (indexer_loss, _indexer_loss_args,
                     {"index_q": (0, 1, 2, 3), "index_k": (0, 1, 2), "index_weights": (0, 1, 2),
                      "attn_q": (0, 1, 3), "attn_k": (0, 1, 3), "attn_lse": (0, 1, 2), "indices": (0, 1),
                      "segment_ids": (0, 1)},
                     {"attn_scale": _BAD_SCALE, "index_scale": _BAD_SCALE, "compress_ratio": _BAD_COUNT,
                      "q_offset": _BAD_OFFSET, "backend": _BAD_BACKEND}, {"index_weights", "indices"}),
}
_DENSE_ONLY = {"compress_ratio", "q_offset", "segment_ids"}  # indexer_loss ignores them in the sparse form


def _corrupt(draw, x, axes, may_be_none):
  kinds = ["rank up", "rank down", "mismatched dim", "bad dtype", "nested list"]
  kinds += [] if may_be_none else ["None"]
  kind = draw(st.sampled_from(kinds), label="corruption")
  if kind == "rank up":
    return x[..., None]
  if kind == "rank down":
    return x[0]
  if kind == "mismatched dim":
    shape, axis = list(x.shape), draw(st.sampled_from(axes), label="axis")
    changed = shape[axis] + draw(st.sampled_from((-1, 1, 2)), label="change")
    shape[axis] = changed if changed >= 1 else shape[axis] + 1
    return np.zeros(shape, x.dtype)
  if kind == "bad dtype":
    bad = (np.float32, np.bool_) if np.issubdtype(x.dtype, np.integer) else (np.int32, np.bool_, np.complex64)
    return x.astype(draw(st.sampled_from(bad), label="dtype"))
  return x.tolist() if kind == "nested list" else None


@pytest.mark.parametrize("op_name", sorted(_BAD_INPUT_OPS))
@_settings(60)
@given(data=st.data())
def test_bad_input_is_a_value_error_naming_the_argument(op_name, data):
  op, valid_args, arrays, scalars, optional = _BAD_INPUT_OPS[op_name]
  kwargs = valid_args(data.draw(st.booleans(), label="sparse form"))
  names = sorted(n for n in arrays if kwargs[n] is not None) + sorted(scalars)
  if op_name == "indexer_loss" and kwargs["indices"] is not None:
    names = [n for n in names if n not in _DENSE_ONLY]
  name = data.draw(st.sampled_from(names), label="argument")
  if name in scalars:
    kwargs[name] = data.draw(st.sampled_from(scalars[name]), label=name)
  elif name == "segment_ids":
    pair, which = list(kwargs[name]), data.draw(st.sampled_from((0, 1, "not a pair")), label="which")
    if which == "not a pair":
      kwargs[name] = pair[:1] if data.draw(st.booleans()) else pair + pair[:1]
    else:
      pair[which] = _corrupt(data.draw, pair[which], arrays[name], may_be_none=False)
      kwargs[name] = tuple(pair)
  else:
    may_be_none = name in optional or (name == "attn_lse" and kwargs["indices"] is None)
    kwargs[name] = _corrupt(data.draw, kwargs[name], arrays[name], may_be_none=may_be_none)
  with pytest.raises(ValueError) as error:  # any other exception type fails the test
    op(**kwargs)
  assert re.search(rf"(?<!\w){name}(?!\w)", str(error.value)), f"{name} not named in: {error.value}"


# ------------------------------------------------------------------------------------------------
# Zero-length axes: a well-formed (empty) result or a ValueError, never another exception type.


def _zero_case(op_name, dims, rng):
  n = lambda *shape: _normal(rng, *shape)
  B, T, S, H, G, D, K = (dims[c] for c in "BTSHGDK")
  if op_name in TOPK_BACKENDS:
    return lambda: flash_topk(n(B, T, H, D), n(B, S, D), n(B, T, H), topk=max(K, 1), backend=op_name)
  indices = rng.integers(-1, S + 1, (B, T, K)).astype(np.int32)
  if op_name == "sparse_attention":
    return lambda: sparse_attention(n(B, T, H, D), n(B, S, G, D), n(B, S, G, D), indices, scale=1.0,
                                    backend="reference")
  lse = np.zeros((B, T, H), np.float32)
  return lambda: indexer_loss(n(B, T, H, D), n(B, S, D), None, n(B, T, H, D), n(B, S, G, D), lse,
                              indices if op_name == "indexer_loss sparse" else None, attn_scale=1.0,
                              backend="reference")


_ZERO_CASES = TOPK_BACKENDS + ("sparse_attention", "indexer_loss sparse", "indexer_loss dense")


@pytest.mark.parametrize("op_name", _ZERO_CASES)
@_settings(10)
@given(zero=st.sampled_from("BTSHGDK"))
def test_zero_length_axes_give_an_empty_result_or_a_value_error(op_name, zero):
  dims = {c: 0 if c == zero else 2 for c in "BTSHGDK"}
  try:
    result = _zero_case(op_name, dims, np.random.default_rng(0))()
  except ValueError:
    return
  for x in jax.tree.leaves(result):
    assert not np.isnan(np.asarray(x)).any()
