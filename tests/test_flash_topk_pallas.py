"""Tests for the exact top-k Pallas backend (`hyscale_jax.ops.flash_topk.pallas`).

tests/test_flash_topk.py already runs this backend on its small integer cases through the public
API. The cases here target the backend's own machinery at shapes where it actually runs: a
threshold from a strided key sample (Tk > candidate slots), the threshold recursion, the tie
buffer, the buffer overflow + rescue path, the exact finish (`_finish`) on hand-built candidates,
query chunking, and that no [Tq, Tk] table is ever built.

Every end-to-end case uses integer-valued inputs, so the result must equal the float64 oracle bit
for bit (indices, and scores cast to f32) and the streaming reference.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops
from hyscale_jax.ops.flash_topk import flash_topk_reference
from hyscale_jax.ops.flash_topk.pallas import (
    _finish, flash_topk_pallas, flash_topk_pallas_with_stats,
)
from pallas_kernels.flash_topk import Candidates, Config

try:
  from tests.jaxpr_tools import equations, largest_intermediate, lowers_to_loop
  from tests.oracles import index_scores as oracle_scores
  from tests.oracles import topk_oracle, visibility
  from tests.topk_checks import assert_reordered_selection, packed_segments
except ImportError:  # tests/ itself is on sys.path (pytest rootdir-less import mode)
  from jaxpr_tools import equations, largest_intermediate, lowers_to_loop
  from oracles import index_scores as oracle_scores
  from oracles import topk_oracle, visibility
  from topk_checks import assert_reordered_selection, packed_segments

# Small blocks and buffers so the sampled threshold and its recursion run at tiny shapes: with
# topk in 4..8 and Tk > 16 keys the threshold is the 2nd best of every topk-th key. chunk_bytes
# also splits the queries into several chunks (the last one shifted back to end at Tq).
_THRESHOLD = Config(block_rows=16, block_k=8, candidates=16, min_candidates=16, sample_rank=2,
                    chunk_bytes=4096)
# Two candidate slots and a threshold from the single best sampled key: most rows overflow.
_OVERFLOW = Config(block_rows=16, block_k=8, candidates=2, min_candidates=2, sample_rank=1,
                   oversample=1.0)


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale", "config"))
def _pallas_stats(q, k, w, q_offset, segment_ids, *, topk, compress_ratio, scale, config):
  return flash_topk_pallas_with_stats(q, k, w, topk=topk, compress_ratio=compress_ratio,
                                      q_offset=q_offset, segment_ids=segment_ids, scale=scale,
                                      config=config, interpret=True)


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale"))
def _reference(q, k, w, q_offset, segment_ids, *, topk, compress_ratio, scale):
  return flash_topk_reference(q, k, w, topk=topk, compress_ratio=compress_ratio,
                              q_offset=q_offset, segment_ids=segment_ids, scale=scale)


def _ints(rng, shape, lo, hi, dtype=jnp.float32):
  return jnp.asarray(rng.integers(lo, hi + 1, size=shape).astype(np.float32), dtype)


def _f64(x):
  return None if x is None else np.asarray(x, np.float64)


def _oracle(q, k, w, *, topk, compress_ratio=1, q_offset=0, segment_ids=None, scale=1.0):
  seg = None if segment_ids is None else tuple(np.asarray(s) for s in segment_ids)
  return topk_oracle(_f64(q), _f64(k), _f64(w), topk=topk, compress_ratio=compress_ratio,
                     q_offset=q_offset, segment_ids=seg, scale=scale)


def _assert_equal(name, got, want_idx, want_sc):
  idx, sc = got
  assert idx.dtype == jnp.int32 and sc.dtype == jnp.float32, name
  assert idx.shape == want_idx.shape and sc.shape == want_idx.shape, (name, idx.shape)
  np.testing.assert_array_equal(np.asarray(idx), want_idx, err_msg=f"indices, {name}")
  np.testing.assert_array_equal(np.asarray(sc), np.asarray(want_sc, np.float32),
                                err_msg=f"scores, {name}")


def _check(q, k, w, *, config=_THRESHOLD, topk, compress_ratio=1, q_offset=0, segment_ids=None,
           scale=1.0):
  """Runs the Pallas backend (with stats) and the reference; both must equal the f64 oracle.

  Returns (oracle indices, oracle f64 scores, stats as Python numbers).
  """
  kw = dict(topk=topk, compress_ratio=compress_ratio, scale=scale)
  idx, sc, stats = _pallas_stats(q, k, w, jnp.int32(q_offset), segment_ids, config=config, **kw)
  ref = _reference(q, k, w, jnp.int32(q_offset), segment_ids, **kw)
  o_idx, o_sc = _oracle(q, k, w, q_offset=q_offset, segment_ids=segment_ids, **kw)
  _assert_equal("pallas vs f64 oracle", (idx, sc), o_idx, o_sc)
  _assert_equal("reference vs f64 oracle", ref, o_idx, o_sc)
  rescued_rows = np.asarray(stats.pop("rescued_rows"))
  stats = {key: np.asarray(v).item() for key, v in stats.items()}
  assert stats["rows"] == q.shape[0] * q.shape[1]
  assert 0 <= stats["rescued"] <= stats["rows"]
  assert rescued_rows.shape == q.shape[:2] and rescued_rows.sum() == stats["rescued"]
  return o_idx, o_sc, stats


def test_threshold_config_really_samples():
  """The shapes below do take the sampled-threshold path (Tk > slots, Tk >= stride)."""
  for topk, Tk in ((4, 130), (6, 96), (8, 64), (1, 64)):
    assert _THRESHOLD.candidate_slots(topk, Tk) == 16 < Tk


# --------------------------------------------------------------------------------------------
# 1. Ties: every visible score equal.
# --------------------------------------------------------------------------------------------


def test_all_equal_scores_resolved_by_index_without_rescue():
  B, T, H, D, topk = 2, 96, 2, 8, 6
  q, k = jnp.ones((B, T, H, D), jnp.float32), jnp.ones((B, T, D), jnp.float32)
  w = jnp.ones((B, T, H), jnp.float32)
  o_idx, o_sc, stats = _check(q, k, w, topk=topk)
  # Lowest visible indices first, all with the one score H * D.
  n = np.minimum(np.arange(T) + 1, topk)
  for t in range(T):
    assert (o_idx[:, t, :n[t]] == np.arange(n[t])).all() and (o_idx[:, t, n[t]:] == -1).all()
  assert (o_sc[o_idx >= 0] == H * D).all()
  # The tie class at the threshold is resolved by the tie buffer, not by the rescue.
  assert stats["rescued"] == 0, stats
  # Rows with a threshold keep nothing strictly above it: few strict candidates per row.
  assert stats["candidates_per_row"] < 2 * topk, stats


# --------------------------------------------------------------------------------------------
# 2. The ReLU zero plateau: most scores exactly 0, few positive keys.
# --------------------------------------------------------------------------------------------


def test_zero_plateau_without_rescue():
  rng = np.random.default_rng(2)
  B, T, H, D, topk = 2, 96, 2, 8, 8
  q = _ints(rng, (B, T, H, D), 1, 2)  # positive queries
  w = _ints(rng, (B, T, H), 1, 3)  # positive weights
  k = -rng.integers(1, 2 + 1, size=(B, T, D)).astype(np.float32)  # negative dots: relu -> 0
  # A few positive keys per sequence. They avoid the sampled keys (every topk-th key, at
  # positions = topk - 1 mod topk) so the sample's 2nd best is exactly 0 and the threshold sits
  # on the plateau: the zeros are one tie class kept by the tie buffer.
  stride = topk
  allowed = np.array([s for s in range(T) if s % stride != stride - 1])
  for b in range(B):
    pos = rng.choice(allowed, size=6, replace=False)
    k[b, pos] = rng.integers(1, 3, size=(6, D))
  k = jnp.asarray(k)
  o_idx, o_sc, stats = _check(q, k, w, topk=topk)
  selected = o_idx >= 0
  # The plateau is real: most selected scores are exactly zero, and many rows have fewer
  # positive keys than topk.
  assert (o_sc[selected] == 0).mean() > 0.5
  n_positive = (o_sc > 0).sum(-1)
  assert (n_positive < topk).mean() > 0.8 and (n_positive > 0).any()
  assert stats["rescued"] == 0, stats


@pytest.mark.parametrize("weighted", [True, False])
def test_keys_as_rows_matches_the_oracle_with_one_query_per_program(weighted):
  """`Config.keys_as_rows` at the GPU's default program shape (16+ heads: one query per program, the
  head sum along the accumulator's columns) on integer inputs with ties, the ReLU plateau and
  negative weights: the same bits as the float64 oracle, and the same stats as the heads-as-rows pass."""
  rng = np.random.default_rng(7)
  B, T, H, D, topk = 1, 72, 16, 16, 6
  q, k = _ints(rng, (B, T, H, D), -1, 1, jnp.bfloat16), _ints(rng, (B, T, D), -1, 1, jnp.bfloat16)
  w = _ints(rng, (B, T, H), -2, 2, jnp.bfloat16) if weighted else None
  assert Config().block_q(H) == 1
  layouts = {}
  for keys_as_rows in (False, True):
    config = Config(block_k=16, candidates=16, min_candidates=16, sample_rank=2, keys_as_rows=keys_as_rows)
    o_idx, o_sc, layouts[keys_as_rows] = _check(q, k, w, config=config, topk=topk)
  assert layouts[True] == layouts[False]
  winners = [row_sc[row_idx >= 0] for row_sc, row_idx in zip(o_sc[0], o_idx[0])]
  assert any(len(np.unique(row)) < len(row) for row in winners)  # ties among the winners
  if weighted:
    assert ((o_sc == 0) & (o_idx >= 0)).any()  # and on the ReLU plateau


@functools.partial(jax.jit, static_argnames=("topk", "config", "by_score"))
def _pallas_ordered(q, k, w, segment_ids, *, topk, config, by_score):
  return flash_topk_pallas(q, k, w, topk=topk, segment_ids=segment_ids, config=config, interpret=True,
                           sorted=by_score)


@pytest.mark.parametrize("config", [_THRESHOLD, _OVERFLOW], ids=["threshold", "overflow"])
def test_unsorted_selection_is_the_sorted_one_as_a_set(config):
  """`sorted=False` returns each row's sorted entries, in another order: the same (index, score)
  pairs, the empty slots (-1, -inf) still last. Integer inputs with ties, the ReLU plateau, rows
  shorter than k (the first keys of each packed document) and masked keys across documents; the
  threshold config takes its unsorted path on most rows; the overflow one (2 slots, under topk) ranks
  by `lax.top_k` and rescues, so there the flag changes nothing."""
  rng = np.random.default_rng(11)
  B, T, H, D, topk = 2, 96, 2, 8, 6
  q, k, w = _ints(rng, (B, T, H, D), -1, 2), _ints(rng, (B, T, D), -2, 1), _ints(rng, (B, T, H), -1, 2)
  seg = jnp.asarray(packed_segments(rng, B, T, 3))
  idx, sc = _pallas_ordered(q, k, w, (seg, seg), topk=topk, config=config, by_score=True)
  u_idx, u_sc = _pallas_ordered(q, k, w, (seg, seg), topk=topk, config=config, by_score=False)
  o_idx, o_sc = _oracle(q, k, w, topk=topk, segment_ids=(seg, seg))
  _assert_equal("sorted vs f64 oracle", (idx, sc), o_idx, o_sc)
  reordered = assert_reordered_selection(*(np.asarray(x).reshape(B * T, topk) for x in (idx, sc, u_idx, u_sc)))
  assert (o_idx == -1).any()
  if config is _THRESHOLD:  # the overflow config's rows are rescued, and the rescue returns them sorted
    assert reordered > B * T // 4


# --------------------------------------------------------------------------------------------
# 3. Monotone scores: the worst case for a running threshold, and its mirror.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["increasing", "decreasing"])
def test_monotone_scores(order):
  rng = np.random.default_rng(3)
  B, T, H, D, topk = 1, 96, 2, 4, 6
  q = _ints(rng, (B, T, H, D), 1, 2)
  w = _ints(rng, (B, T, H), 1, 2)
  ramp = np.arange(1, T + 1, dtype=np.float32) if order == "increasing" else (
      np.arange(T, 0, -1, dtype=np.float32))
  k = jnp.asarray(np.broadcast_to(ramp[None, :, None], (B, T, D)))
  o_idx, _, stats = _check(q, k, w, topk=topk)
  t = T - 1  # the last row sees every key
  want = np.arange(T - 1, T - 1 - topk, -1) if order == "increasing" else np.arange(topk)
  assert (o_idx[0, t] == want).all(), o_idx[0, t]
  # A sampled threshold (unlike a running one) keeps about 2 * topk keys for either order.
  assert stats["rescued"] == 0, stats


# --------------------------------------------------------------------------------------------
# 4. Short rows, topk > Tk, topk = 1, topk = Tk.
# --------------------------------------------------------------------------------------------

# name -> (B, Tq, Tk, H, D, topk, q_offset)
_EDGE_CASES = {
    "rows_shorter_than_k": (2, 64, 64, 2, 8, 8, 0),
    "topk_gt_tk": (1, 20, 20, 2, 4, 24, 0),
    "k_equals_1": (2, 64, 64, 3, 8, 1, 0),
    "k_equals_tk": (1, 40, 40, 2, 8, 40, 0),
    "k_equals_tk_offset": (1, 24, 40, 2, 8, 40, 16),
}


@pytest.mark.parametrize("case", list(_EDGE_CASES))
def test_edge_topk_sizes(case):
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  B, Tq, Tk, H, D, topk, q_offset = _EDGE_CASES[case]
  q = _ints(rng, (B, Tq, H, D), -2, 2)
  k = _ints(rng, (B, Tk, D), -2, 2)
  w = _ints(rng, (B, Tq, H), -1, 2)
  o_idx, _, _ = _check(q, k, w, topk=topk, q_offset=q_offset)
  n_vis = visibility(B, Tq, Tk, q_offset=q_offset).sum(-1)
  assert ((o_idx >= 0).sum(-1) == np.minimum(n_vis, topk)).all()
  if case == "rows_shorter_than_k":
    assert (o_idx[:, 0, 1:] == -1).all() and (o_idx[:, topk - 2, -1] == -1).all()
  if case == "topk_gt_tk":
    assert (o_idx[:, :, Tk:] == -1).all() and (o_idx[:, -1, :Tk] >= 0).all()
  if case.startswith("k_equals_tk"):  # the last row selects every key exactly once
    assert sorted(o_idx[0, -1].tolist()) == list(range(Tk))


# --------------------------------------------------------------------------------------------
# 5. Forced overflow: the rescue recomputes every row the buffers could not prove exact.
# --------------------------------------------------------------------------------------------


def test_overflow_never_drops_a_winner():
  rng = np.random.default_rng(5)
  B, T, H, D, topk = 2, 64, 2, 8, 5
  q = _ints(rng, (B, T, H, D), -2, 2)
  k = _ints(rng, (B, T, D), -2, 2)
  w = _ints(rng, (B, T, H), -1, 2)
  assert _OVERFLOW.candidate_slots(topk, T) == 2
  _, _, stats = _check(q, k, w, topk=topk, config=_OVERFLOW)
  # Recompute the main pass's counts in float64: with oversample=1, sample_rank=1 the stride is
  # topk and the threshold is the best visible sampled key (keys topk-1, 2*topk-1, ...; -inf if
  # none), so a row overflows when more than 2 visible keys score strictly above it.
  full = oracle_scores(_f64(q), _f64(k), _f64(w), 1.0)
  vis = visibility(B, T, T)
  sampled = vis & (np.arange(T) % topk == topk - 1)
  t = np.where(sampled, full, -np.inf).max(-1, keepdims=True)
  n_above = (vis & (full > t)).sum(-1)
  overflowed = int((n_above > 2).sum())
  assert overflowed > 0, "the inputs must make some rows overflow the 2 candidate slots"
  assert stats["candidates_per_row"] == np.float32(n_above.mean()), (stats, n_above.mean())
  assert stats["rescued"] >= overflowed, (stats, overflowed)


# --------------------------------------------------------------------------------------------
# 6. `_finish` on hand-built candidates.
# --------------------------------------------------------------------------------------------


def _candidates(rows, slots, tie_slots):
  """Candidates for B=1 and one query row per dict in `rows`; unused slots hold junk."""
  R = len(rows)
  idx = np.full((1, R, slots), 999, np.int32)
  sc = np.full((1, R, slots), 1e9, np.float32)  # junk past n_above must never be selected
  tie = np.full((1, R, tie_slots), 777, np.int32)
  counts = np.zeros((3, 1, R), np.int32)
  thr = np.zeros((1, R), np.float32)
  for r, row in enumerate(rows):
    above = row.get("above", [])
    idx[0, r, :min(len(above), slots)] = [i for i, _ in above][:slots]
    sc[0, r, :min(len(above), slots)] = [s for _, s in above][:slots]
    ties = row.get("ties", [])[:tie_slots]
    tie[0, r, :len(ties)] = ties
    counts[:, 0, r] = row["n_above"], row["n_tied"], row["n_visible"]
    thr[0, r] = row["t"]
  c = Candidates(jnp.asarray(idx), jnp.asarray(sc), jnp.asarray(tie), *map(jnp.asarray, counts))
  return c, jnp.asarray(thr)


def test_finish_exactness_and_order():
  topk, slots, tie_slots = 4, 4, 4
  rows = [
      # (a) more keys above t than slots: some may be lost -> not exact.
      dict(above=[(1, 5.0), (2, 6.0), (3, 7.0), (4, 8.0)], n_above=5, n_tied=3, n_visible=20,
           t=1.0, ties=[0, 6, 7]),
      # (b) t above the row's k-th score: too few found, and fewer than visible -> not exact.
      dict(above=[(5, 9.0)], n_above=1, n_tied=1, n_visible=10, t=2.0, ties=[3]),
      # (c) enough found: strict candidates by score (equal scores: lower key first), then
      #     ties in key order; junk past n_above is ignored.
      dict(above=[(3, 5.0), (7, 3.0), (9, 5.0)], n_above=3, n_tied=5, n_visible=30, t=1.0,
           ties=[2, 4, 11, 12]),
      # (d) fewer visible keys than topk, all of them found -> exact, tail (-1, -inf).
      dict(above=[(0, 2.0), (2, 4.0)], n_above=2, n_tied=1, n_visible=3, t=1.5, ties=[1]),
      # (e) only ties, more of them than tie slots: the first tie_slots in key order.
      dict(n_above=0, n_tied=9, n_visible=40, t=0.0, ties=[1, 3, 4, 8]),
      # (f) exactly slots keys above t, no ties needed.
      dict(above=[(10, 1.0), (11, 4.0), (12, 4.0), (13, 2.0)], n_above=4, n_tied=0,
           n_visible=14, t=0.5),
      # (g) a row that sees nothing.
      dict(n_above=0, n_tied=0, n_visible=0, t=-np.inf),
  ]
  c, thr = _candidates(rows, slots, tie_slots)
  idx, sc, exact = (np.asarray(x) for x in _finish(c, thr, topk))
  assert idx.shape == (1, len(rows), topk) and sc.shape == idx.shape and exact.shape == (1, len(rows))
  assert idx.dtype == np.int32 and sc.dtype == np.float32 and exact.dtype == bool
  np.testing.assert_array_equal(exact[0], [False, False, True, True, True, True, True])
  inf = np.inf
  want = {
      2: ([3, 9, 7, 2], [5.0, 5.0, 3.0, 1.0]),
      3: ([2, 0, 1, -1], [4.0, 2.0, 1.5, -inf]),
      4: ([1, 3, 4, 8], [0.0, 0.0, 0.0, 0.0]),
      5: ([11, 12, 13, 10], [4.0, 4.0, 2.0, 1.0]),
      6: ([-1] * 4, [-inf] * 4),
  }
  for r, (w_idx, w_sc) in want.items():
    np.testing.assert_array_equal(idx[0, r], w_idx, err_msg=f"row {r}")
    np.testing.assert_array_equal(sc[0, r], np.float32(w_sc), err_msg=f"row {r}")


def test_finish_fewer_slots_than_topk():
  """slots < topk: the strict candidates fill the first slots, ties the rest (tail padding)."""
  topk, slots, tie_slots = 4, 2, 4
  rows = [
      dict(above=[(6, 2.0), (8, 3.0)], n_above=2, n_tied=3, n_visible=12, t=1.0, ties=[1, 2, 5]),
      dict(above=[(6, 2.0), (8, 3.0)], n_above=2, n_tied=1, n_visible=12, t=1.0, ties=[1]),
      dict(above=[(6, 2.0), (8, 3.0)], n_above=3, n_tied=4, n_visible=12, t=1.0, ties=[1, 2]),
  ]
  c, thr = _candidates(rows, slots, tie_slots)
  idx, sc, exact = (np.asarray(x) for x in _finish(c, thr, topk))
  np.testing.assert_array_equal(exact[0], [True, False, False])
  np.testing.assert_array_equal(idx[0, 0], [8, 6, 1, 2])
  np.testing.assert_array_equal(sc[0, 0], np.float32([3.0, 2.0, 1.0, 1.0]))


# --------------------------------------------------------------------------------------------
# 7. Compressed keys, q_offset (static and traced), packed segments, bf16, no weights, H=3.
# --------------------------------------------------------------------------------------------


def test_compressed_offset_segments_bf16_odd_heads():
  rng = np.random.default_rng(7)
  B, Tq, Tk, H, D, topk, ratio = 2, 48, 48, 3, 8, 6, 4
  q_offset = ratio * Tk - Tq  # the query shard at the end of the sequence
  q = _ints(rng, (B, Tq, H, D), -2, 2, jnp.bfloat16)
  k = _ints(rng, (B, Tk, D), -2, 2, jnp.bfloat16)
  # Packed documents over the token positions; a compressed key carries the id of its last token.
  tokens = packed_segments(rng, B, ratio * Tk, 3)
  q_seg = jnp.asarray(tokens[:, q_offset:q_offset + Tq])
  kv_seg = jnp.asarray(tokens[:, ratio - 1::ratio])
  seg = (q_seg, kv_seg)
  kw = dict(topk=topk, compress_ratio=ratio)
  o_idx, o_sc, _ = _check(q, k, None, q_offset=q_offset, segment_ids=seg, **kw)
  vis = visibility(B, Tq, Tk, compress_ratio=ratio, q_offset=q_offset,
                   segment_ids=(np.asarray(q_seg), np.asarray(kv_seg)))
  n_vis = vis.sum(-1)
  assert ((o_idx >= 0).sum(-1) == np.minimum(n_vis, topk)).all()
  assert (n_vis > 16).any(), "some rows must see more keys than the candidate slots"
  # Static q_offset (a Python int closed over) gives the same bits as the traced one above.
  static = jax.jit(lambda q, k, seg: flash_topk_pallas(
      q, k, None, q_offset=q_offset, segment_ids=seg, config=_THRESHOLD, interpret=True,
      **kw))(q, k, seg)
  _assert_equal("pallas, static q_offset", static, o_idx, o_sc)
  # A different traced offset, same compiled function: still exact.
  o_idx2, o_sc2 = _oracle(q, k, None, q_offset=q_offset - 20, segment_ids=seg, **kw)
  idx2, sc2, _ = _pallas_stats(q, k, None, jnp.int32(q_offset - 20), seg, config=_THRESHOLD,
                               scale=1.0, **kw)
  _assert_equal("pallas, traced q_offset - 20", (idx2, sc2), o_idx2, o_sc2)


# --------------------------------------------------------------------------------------------
# 8. Config validation.
# --------------------------------------------------------------------------------------------


def test_config_validation():
  with pytest.raises(ValueError, match="block_k"):
    Config(block_k=48)
  with pytest.raises(ValueError, match="oversample"):
    Config(oversample=0.5)
  with pytest.raises(ValueError, match="candidates"):
    Config(candidates=24)
  Config(block_k=64, oversample=1.0, candidates=32)  # valid: no error
  assert hash(_THRESHOLD) == hash(Config(**vars(_THRESHOLD)))  # usable as a static jit argument


# --------------------------------------------------------------------------------------------
# 9. No [Tq, Tk] table: traced only, never executed.
# --------------------------------------------------------------------------------------------


def test_pallas_never_materializes_score_table():
  B, T, H, D, topk = 1, 1024, 4, 16, 16
  q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16)
  config = Config(min_candidates=64, candidates=64)
  jaxpr = jax.make_jaxpr(lambda q, k, w: flash_topk_pallas(
      q, k, w, topk=topk, config=config, interpret=True))(q, k, w)
  seen = {e.primitive.name for e in equations(jaxpr)}
  largest = largest_intermediate(jaxpr)
  # The walker did get into the kernel and the loops (else the bound below proves nothing).
  assert {"pallas_call", "while", "dot_general"} <= seen, seen
  assert largest >= T * config.candidates  # it sees the candidate buffers
  assert largest < T * T // 4, largest


# --------------------------------------------------------------------------------------------
# The finish's selection kernel (`pallas_kernels.flash_topk.select`), interpret mode.
# --------------------------------------------------------------------------------------------


def _select_oracle(scores, n_valid, topk):
  """The topk best valid slots of each row (score descending, then slot ascending), listed in slot order."""
  out = []
  for row, n in zip(scores.astype(np.float64), n_valid):
    n = int(min(n, row.size))
    out.append(sorted(sorted(range(n), key=lambda j: (-row[j], j))[:topk]))
  return out


@pytest.mark.parametrize("topk, rows_per_program", [(6, 1), (16, 4)])
def test_select_candidates_keeps_the_topk_in_slot_order(topk, rows_per_program):
  """Ties (the zero plateau, all-equal rows, ties straddling the k-th place), +-inf, negative
  scores, and rows with fewer valid entries than topk, none, or a count past the buffer."""
  from pallas_kernels.flash_topk import select_candidates  # noqa: PLC0415

  rng = np.random.default_rng(11)
  S = 32
  scores = rng.integers(-3, 4, (9, S)).astype(np.float32)
  scores[1] = 0.0                                 # all equal: the lowest slots win
  scores[2] = np.maximum(scores[2], 0.0)          # ReLU's zero plateau under a few positives
  scores[3, ::3] = np.inf
  scores[4] = -np.inf
  scores[5] = rng.normal(size=S).astype(np.float32) * 1e-30  # denormal-sized, both signs
  scores[6] = -rng.random(S).astype(np.float32)
  n_valid = np.asarray([S, S, 25, S, 20, S, topk - 1, 0, 1000], np.int32)
  indices = rng.permutation(9 * S).astype(np.int32).reshape(9, S)
  select = functools.partial(select_candidates, topk=topk, rows_per_program=rows_per_program, interpret=True)
  got_s, got_i, got_n = jax.jit(select)(  # 9 rows: the last program's rows are partly padding
      jnp.asarray(scores), jnp.asarray(indices), jnp.asarray(n_valid))
  got_s, got_i, got_n = (np.asarray(x) for x in (got_s, got_i, got_n))
  for r, slots in enumerate(_select_oracle(scores, n_valid, topk)):
    assert got_n[r] == len(slots), r
    np.testing.assert_array_equal(got_i[r, : got_n[r]], indices[r, slots], err_msg=f"row {r}")
    np.testing.assert_array_equal(got_s[r, : got_n[r]], scores[r, slots], err_msg=f"row {r}")


def test_select_candidates_on_distinct_scores_and_shared_prefixes():
  """Distinct random scores (the search stops early once exactly topk keys are above its prefix),
  scores within one binade (a long shared prefix), huge and tiny magnitudes, and exact ties at the
  k-th place among otherwise distinct scores."""
  from pallas_kernels.flash_topk import select_candidates  # noqa: PLC0415

  rng = np.random.default_rng(12)
  S, topk = 128, 40
  scores = rng.normal(size=(6, S)).astype(np.float32)
  scores[1] = (1.0 + rng.random(S)).astype(np.float32)  # [1, 2): sign and exponent shared
  scores[2] = np.float32(3e38) * rng.random(S).astype(np.float32)
  scores[3] = np.float32(1e-40) * rng.random(S).astype(np.float32)  # denormals
  scores[4, :] = np.sort(scores[4])[::-1]
  scores[4, topk - 3 : topk + 3] = scores[4, topk - 3]  # a tie class straddling the k-th place
  scores[5] = np.abs(scores[5])
  n_valid = np.asarray([S, S, S, 100, S, topk], np.int32)
  indices = np.arange(6 * S, dtype=np.int32).reshape(6, S)
  got_s, got_i, got_n = (np.asarray(x) for x in jax.jit(functools.partial(
      select_candidates, topk=topk, interpret=True))(jnp.asarray(scores), jnp.asarray(indices), jnp.asarray(n_valid)))
  for r, slots in enumerate(_select_oracle(scores, n_valid, topk)):
    assert got_n[r] == len(slots), r
    np.testing.assert_array_equal(got_i[r, : got_n[r]], indices[r, slots], err_msg=f"row {r}")
    np.testing.assert_array_equal(got_s[r, : got_n[r]], scores[r, slots], err_msg=f"row {r}")


def test_select_candidates_rejects_a_buffer_not_wider_than_topk():
  from pallas_kernels.flash_topk import select_candidates  # noqa: PLC0415

  with pytest.raises(ValueError, match="S=8 must be a power of two above topk=8"):
    select_candidates(jnp.zeros((2, 8)), jnp.zeros((2, 8), jnp.int32), jnp.zeros((2,), jnp.int32), 8)


def test_both_finishes_agree_on_random_candidates():
  """`_finish` with the selection kernel and with lax.top_k: the same indices, scores and verdicts."""
  rng = np.random.default_rng(5)
  B, Tq, slots, tie_slots, topk = 2, 7, 32, 8, 8
  scores = rng.integers(0, 6, (B, Tq, slots)).astype(np.float32)  # many ties
  # As the main pass lists them: each row's candidates are distinct keys in ascending order.
  keys = np.sort(np.stack([rng.choice(500, slots, replace=False) for _ in range(B * Tq)]), axis=1)
  c = Candidates(jnp.asarray(keys.reshape(B, Tq, slots), jnp.int32), jnp.asarray(scores),
                 jnp.asarray(rng.integers(0, 500, (B, Tq, tie_slots)), jnp.int32),
                 jnp.asarray(rng.integers(0, 40, (B, Tq)), jnp.int32), jnp.asarray(rng.integers(0, 9, (B, Tq)), jnp.int32),
                 jnp.full((B, Tq), 500, jnp.int32))
  t = jnp.zeros((B, Tq), jnp.float32)
  want = _finish(c, t, topk, method="top_k")
  got = _finish(c, t, topk, method="select", interpret=True)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_ordered_bits_orders_like_the_scores_and_inverts():
  from pallas_kernels.flash_topk import from_ordered_bits, ordered_bits  # noqa: PLC0415

  values = np.float32([-np.inf, -3e38, -1.0, -1e-38, -1e-45, 0.0, 1e-45, 1e-38, 0.5, 1.0, 3e38, np.inf])
  keys = np.asarray(ordered_bits(jnp.asarray(values)))
  assert (np.diff(keys.astype(np.int64)) > 0).all() and keys.min() >= 1
  np.testing.assert_array_equal(np.asarray(from_ordered_bits(jnp.asarray(keys))), values)


# --------------------------------------------------------------------------------------------
# The indexer's scores at selected keys, with their custom_vjp (`pallas_kernels.flash_topk.scores_at`).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, weighted", [(jnp.float32, True), (jnp.float32, False), (jnp.bfloat16, True)])
def test_index_scores_at_kernel_matches_the_reference_and_its_gradient(dtype, weighted):
  """Scores and (dq, dk, dw) against `index_scores_at` and its XLA vjp: indices past both ends (clamped,
  as the reference), a key selected three times in one row, a cotangent with zeros (no atomics
  there), heads and head dim off powers of two, K off the step size."""
  from hyscale_jax.ops.flash_topk.reference import index_scores_at  # noqa: PLC0415
  from pallas_kernels.flash_topk import index_scores_at_pallas  # noqa: PLC0415

  rng = np.random.default_rng(21)
  B, T, H, D, S, K = 2, 5, 3, 20, 11, 7
  q, k = (jnp.asarray(rng.standard_normal(sh), dtype) for sh in ((B, T, H, D), (B, S, D)))
  w = jnp.asarray(rng.standard_normal((B, T, H)), dtype) if weighted else None
  idx = rng.integers(-2, S + 2, (B, T, K)).astype(np.int32)
  idx[0, 0, :3] = 4
  idx = jnp.asarray(idx)
  g = jnp.asarray(rng.standard_normal((B, T, K)), jnp.float32).at[:, :, 0].set(0.0)
  args = (q, k) if w is None else (q, k, w)
  got, got_vjp = jax.vjp(lambda *a: index_scores_at_pallas(*a[:2], a[2] if w is not None else None, idx, 0.3,
                                                           block_k=4), *args)
  want, want_vjp = jax.vjp(lambda *a: index_scores_at(*a[:2], a[2] if w is not None else None, idx, 0.3), *args)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)
  for a, b in zip(got_vjp(g), want_vjp(g)):
    assert a.dtype == b.dtype and a.shape == b.shape
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * np.abs(b).max())


def test_index_scores_at_kernel_rejects_a_step_that_is_not_a_power_of_two():
  from pallas_kernels.flash_topk import index_scores_at_pallas  # noqa: PLC0415

  with pytest.raises(ValueError, match="block_k=3"):
    index_scores_at_pallas(jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 3, 4)), None, jnp.zeros((1, 2, 2), jnp.int32),
                           1.0, block_k=3)


def test_segment_first_keys_is_each_querys_first_key_of_its_segment():
  """Any id layout: ids that come back later, ids absent from the keys (Tk), negative ids."""
  from pallas_kernels.flash_topk._common import segment_first_keys  # noqa: PLC0415

  kv_seg = np.array([3, 3, 1, 1, -1, 3, 2, 2, 1, 0], np.int32)
  q_seg = np.array([3, 1, 2, 0, -1, 7, 1, 2, 3, 9], np.int32)
  want = [next((s for s in range(len(kv_seg)) if kv_seg[s] == g), len(kv_seg)) for g in q_seg]
  np.testing.assert_array_equal(np.asarray(segment_first_keys(jnp.asarray(q_seg), jnp.asarray(kv_seg))), want)
  assert want == [0, 2, 6, 9, 4, 10, 2, 6, 0, 10]
  # Straight-line XLA: jnp.searchsorted's default method is a scan, a while loop whose steps the GPU
  # launches one by one (0.25 ms before each grouped matmul, docs/kernels/grouped_matmul.md).
  assert not lowers_to_loop(segment_first_keys, jnp.asarray(q_seg), jnp.asarray(kv_seg))


def test_rows_that_overflow_the_candidate_buffer_are_rescued_and_reported():
  """Every other key scores high and the strided sample sees only the low ones, so the threshold sits
  below half the keys: the buffer overflows, the rows are recomputed exactly, and `with_stats` reports
  them (what train.py counts as `topk_rescued_rows`)."""
  num_keys, topk = 2304, 8
  k = jnp.where(jnp.arange(num_keys) % 2 == 0, 2.0, 1.0)[None, :, None].astype(jnp.float32)
  q = jnp.ones((1, 4, 1, 1), jnp.float32)
  common = dict(topk=topk, q_offset=num_keys - 4)
  selection, rescued = ops.flash_topk(q, k, None, backend="pallas", with_stats=True, **common)
  reference, none_rescued = ops.flash_topk(q, k, None, backend="reference", with_stats=True, **common)
  assert rescued.tolist() == [[True] * 4] and not none_rescued.any()
  np.testing.assert_array_equal(selection.indices, reference.indices)
  np.testing.assert_array_equal(selection.indices[0, 0], np.arange(0, 2 * topk, 2))
