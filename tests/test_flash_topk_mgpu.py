"""The Mosaic GPU scoring pass (`pallas_kernels.flash_topk.mgpu_scores`) against a float64 oracle.

On the CPU the kernel runs in Mosaic GPU's interpret mode (warpgroups as threads, TMA and barriers
simulated); on a Hopper GPU, compiled. Inputs are small integers, so every score is exact in f32
and the counts and maxima must equal the oracle's exactly. The thresholds hit the interesting
classes: a score of the row itself (ties), 0 on rows and keys that score 0 everywhere (the ReLU
plateau, -0 folded to +0), +inf and -inf. An export test lowers the kernel for an abstract H200 on
the CPU, which runs Mosaic GPU's lowering (layouts, the warpgroup MMA, TMA) and its shared-memory check.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_topk import mgpu_scores
from pallas_kernels.flash_topk.mgpu_scores import score_counts_mgpu
from tests.jaxpr_tools import export_for_h200

_SCALE = 0.5

# name -> (Tq, Tk, H, D, block_q, block_k, stages, nan_key, pingpong, q_offset, compress_ratio, emit_mask)
_CASES = {
    # 4 queries x 64 heads = 256 MMA columns; steps of 128 keys: unmasked steps, the masked edge, and
    # key steps past a block's last query (never loaded).
    "full_width": (256, 256, 64, 64, 4, 64, 3, False, False, 0, 1, False),
    # H padded 12 -> 16 and D 40 -> 64; queries past the last key; Tk padded to a step; a NaN key;
    # the consumers' MMAs taking turns; the candidate mask.
    "ragged": (200, 136, 12, 40, 2, 64, 2, True, True, 0, 1, True),
    # 128 keys per consumer, one query per CTA; a query chunk at position 40 (its first rows see whole
    # unmasked steps); Tk > positions, so the later key steps are never loaded; the mask.
    "block_k_128": (96, 384, 16, 64, 1, 128, 2, False, False, 40, 1, True),
    # Compressed keys (2 positions each): position 0 sees none (its counts 0, its max -inf).
    "compressed": (104, 72, 8, 64, 4, 64, 2, True, False, 0, 2, True),
}


def _visible(Tq, Tk, q_offset=0, compress_ratio=1):
  """bool[Tq, Tk]: row t (position q_offset + t) sees key s when (s+1) * compress_ratio <= position + 1."""
  return (np.arange(Tk)[None, :] + 1) * compress_ratio <= np.arange(Tq)[:, None] + q_offset + 1


def _oracle(q, k, w, threshold, scale, visible):
  """float64 (n_above, n_tied, max_score, score) over the visible keys; NaN scores rank as -inf."""
  dots = np.einsum("thd,sd->ths", q.astype(np.float64), k.astype(np.float64))
  score = (np.maximum(dots, 0) * w[:, :, None]).sum(axis=1) * scale
  score = np.where(np.isnan(score), -np.inf, score)
  t = threshold[:, None]
  return (((score > t) & visible).sum(1), ((score == t) & visible).sum(1),
          np.where(visible, score, -np.inf).max(1), score)


def _inputs(Tq, Tk, H, D, nan_key, visible, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.integers(-2, 3, (Tq, H, D)).astype(np.float64)
  k = rng.integers(-2, 3, (Tk, D)).astype(np.float64)
  w = rng.integers(-2, 3, (Tq, H)).astype(np.float64)
  q[::9] = 0.0  # rows scoring 0 at every key (some with negative weights: -0 before the fold)
  k[::7] = 0.0  # keys scoring 0 for every query
  if nan_key:
    k[5, 3] = np.nan
  *_, score = _oracle(q, k, w, np.zeros(Tq), _SCALE, visible)
  # Per row: 0 (zero rows, and two rows in five: the ReLU plateau as threshold), +inf, -inf, or a visible
  # key's own score (at least one tie).
  kind = np.where(np.arange(Tq) % 9 == 0, 0, np.arange(Tq) % 5 % 4)
  kind = np.where((kind == 3) & ~visible.any(1), 2, kind)  # no key to tie with: threshold -inf
  tie_keys = rng.integers(0, np.maximum(visible.sum(1), 1))
  threshold = np.select([kind == 0, kind == 1, kind == 2], [0.0, np.inf, -np.inf], score[np.arange(Tq), tie_keys])
  return q, k, w, threshold, kind


@pytest.mark.parametrize("case", list(_CASES))
def test_counts_and_max_match_oracle(case):
  Tq, Tk, H, D, block_q, block_k, stages, nan_key, pingpong, q_offset, compress_ratio, emit_mask = _CASES[case]
  seen = _visible(Tq, Tk, q_offset, compress_ratio)
  q, k, w, threshold, kind = _inputs(Tq, Tk, H, D, nan_key, seen)
  want_above, want_tied, want_max, score = _oracle(q, k, w, threshold, _SCALE, seen)
  fn = jax.jit(lambda *a, q_offset: score_counts_mgpu(
      *a, scale=_SCALE, q_offset=q_offset, block_q=block_q, block_k=block_k, stages=stages, pingpong=pingpong,
      compress_ratio=compress_ratio, emit_mask=emit_mask))
  got = jax.block_until_ready(fn(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
                                 jnp.asarray(w, jnp.float32), jnp.asarray(threshold, jnp.float32),
                                 q_offset=jnp.int32(q_offset)))
  above, tied, best = (np.asarray(x) for x in got[:3])
  if emit_mask:  # at every visible key: 2 above the threshold, 1 at it, 0 below
    mask = np.asarray(got[3])
    assert mask.shape == (Tq, -(-Tk // (2 * block_k)) * 2 * block_k) and mask.dtype == np.int8
    t = threshold[:, None]
    want = np.where(score > t, 2, np.where(score == t, 1, 0))
    np.testing.assert_array_equal(mask[:, :Tk][seen], want[seen])
  assert above.dtype == tied.dtype == np.int32 and best.dtype == np.float32
  np.testing.assert_array_equal(above, want_above)
  np.testing.assert_array_equal(tied, want_tied)
  np.testing.assert_array_equal(best, want_max.astype(np.float32))
  assert not np.signbit(best[best == 0]).any()  # -0 folded to +0
  # The cases exercise what they claim: ties, plateau rows tied at every visible key, +-inf rows.
  visible = seen.sum(1)
  assert (tied[kind == 3] >= 1).all() and (tied[kind == 3] > 1).any() and (tied[kind == 0] > 1).any()
  nan_seen = seen[:, 5] if nan_key else np.zeros(Tq, bool)  # key 5 scores NaN -> -inf
  zero_rows = np.arange(0, Tq, 9)  # 0 * NaN is NaN: those rows too rank key 5 as -inf
  np.testing.assert_array_equal(tied[zero_rows], (visible - nan_seen)[zero_rows])
  assert (above[kind == 1] == 0).all() and (tied[kind == 1] == 0).all()
  np.testing.assert_array_equal(above[kind == 2], (visible - nan_seen)[kind == 2])
  np.testing.assert_array_equal(tied[kind == 2], nan_seen[kind == 2])


def test_segments_see_only_their_own_keys():
  """Packed documents (segment ids, with a padding run of 0 and a segment that comes back later): every
  row's counts, max, mask and visible count equal the oracle's over the causal keys of its segment, and
  CTAs whose queries' documents start later skip the key steps before them (no key there is visible)."""
  Tq = Tk = 320  # 3 key steps of 128
  seg = np.repeat([1, 2, 3, 0, 2], [100, 160, 30, 10, 20]).astype(np.int32)  # segment 2 twice: ids, not runs
  seen = _visible(Tq, Tk) & (seg[:, None] == seg[None, :])
  q, k, w, threshold, kind = _inputs(Tq, Tk, 8, 64, False, seen, seed=3)
  want_above, want_tied, want_max, score = _oracle(q, k, w, threshold, _SCALE, seen)
  fn = jax.jit(lambda *a: score_counts_mgpu(*a[:4], scale=_SCALE, segment_ids=a[4:], block_q=4, block_k=64, stages=2,
                                            emit_mask=True))
  above, tied, best, mask, visible = (np.asarray(x) for x in jax.block_until_ready(fn(
      jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(w, jnp.float32),
      jnp.asarray(threshold, jnp.float32), jnp.asarray(seg), jnp.asarray(seg))))
  np.testing.assert_array_equal(visible, seen.sum(1))
  np.testing.assert_array_equal(above, want_above)
  np.testing.assert_array_equal(tied, want_tied)
  np.testing.assert_array_equal(best, want_max.astype(np.float32))
  first = np.asarray(mgpu_scores.first_scored_keys(jnp.asarray(seg), jnp.asarray(seg), block_q=4, block_k=64))
  np.testing.assert_array_equal(first[[0, 150, 270, 295, 310]], [0, 0, 256, 256, 0])  # doc 3 and the 0s: step 2
  scored = _visible(Tq, Tk) & (np.arange(Tk)[None, :] >= first[:, None])
  assert not (seen & ~scored).any()  # the skipped keys hold none the rows see
  t = threshold[:, None]
  want_mask = np.where(seen, np.where(score > t, 2, np.where(score == t, 1, 0)), 0)
  np.testing.assert_array_equal(mask[:, :Tk][scored], want_mask[scored])  # other segments' keys unmarked
  assert ((score > t) & scored & ~seen).any()  # keys of other segments that would have been marked
  assert (tied[kind == 0] > 1).any()  # the ReLU plateau tied at the threshold 0


def test_segment_ids_are_checked():
  q, k = jnp.zeros((8, 8, 64), jnp.bfloat16), jnp.zeros((16, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="segment_ids shapes"):
    score_counts_mgpu(q, k, jnp.zeros((8, 8)), jnp.zeros(8), scale=1.0,
                      segment_ids=(jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32)))


def _export(T, H, D, segments=False, **config):
  args = [jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
          jax.ShapeDtypeStruct((T, H), jnp.float32), jax.ShapeDtypeStruct((T,), jnp.float32)]
  args += [jax.ShapeDtypeStruct((T,), jnp.int32)] * (2 * segments)
  return export_for_h200(lambda q, k, w, t, *seg: score_counts_mgpu(q, k, w, t, scale=D**-0.5,
                                                                    segment_ids=seg or None, **config), *args)


@pytest.mark.parametrize("block_q, block_k, stages, pingpong, emit_mask, segments", [
    (4, 64, 4, False, False, False), (4, 64, 4, True, False, False), (2, 128, 2, False, False, False),
    (1, 64, 2, True, False, False), (4, 64, 2, False, True, False), (4, 64, 2, False, True, True)])
def test_lowers_for_h200(block_q, block_k, stages, pingpong, emit_mask, segments, fake_hopper):
  """DeepSeek-V3.2's indexer shape (H 64, D 128) at 16K: Mosaic GPU lowers the kernel (column slices of
  the accumulator, the quad-local head sum with no reduction scratch, TMA, the mask's tile stores, the
  key tiles' segment ids in the row layout) and its shared memory fits."""
  T = 16384
  exported = _export(T, 64, 128, segments, block_q=block_q, block_k=block_k, stages=stages, pingpong=pingpong,
                     emit_mask=emit_mask)
  assert len(re.findall(r"custom_call @mosaic_gpu", exported.mlir_module())) == 1
  assert [tuple(a.shape) for a in exported.out_avals] == [(T,)] * 3 + [(T, T)] * emit_mask + [(T,)] * segments
  assert mgpu_scores.smem_bytes(block_q, 64, block_k, stages, 128, emit_mask, segments) <= mgpu_scores.SMEM_LIMIT


def test_smem_estimate_is_mosaics(monkeypatch, fake_hopper):
  """Past the wrapper's check, Mosaic GPU rejects the same config with the same byte count."""
  with pytest.raises(ValueError, match="stages=3 .* need 235584 bytes"):
    _export(1024, 64, 128, block_q=2, block_k=128, stages=3)
  monkeypatch.setattr(mgpu_scores, "SMEM_LIMIT", 1 << 20)
  with pytest.raises(ValueError, match="smem_bytes=235584 "):
    _export(1024, 64, 128, block_q=2, block_k=128, stages=3)
  # With segments and the mask: the fourth partial and the mask tiles, counted as Mosaic GPU counts them.
  need = mgpu_scores.smem_bytes(2, 64, 128, 3, 128, emit_mask=True, segments=True)
  assert need == 235584 + 2 * 2 * 2 * 128 + 4 * 2 * 2 * 128
  with pytest.raises(ValueError, match=f"smem_bytes={need} "):
    _export(1024, 64, 128, True, block_q=2, block_k=128, stages=3, emit_mask=True)


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((8, 4, 64), jnp.float32)), "q.dtype"),
    (dict(k=jnp.zeros((8, 32), jnp.bfloat16)), "k.shape"),
    (dict(weights=jnp.zeros((8, 3))), "weights.shape"),
    (dict(threshold=jnp.zeros((9,))), "threshold.shape"),
    (dict(block_k=32), "block_k"),
    (dict(stages=1), "stages"),
    (dict(block_q=5), "block_q"),  # 5 x 64 heads > 256 columns
])
def test_validation(change, match):
  args = dict(q=jnp.zeros((8, 64, 64), jnp.bfloat16), k=jnp.zeros((8, 64), jnp.bfloat16),
              weights=jnp.zeros((8, 64)), threshold=jnp.zeros((8,)), scale=1.0)
  if "q" in change and "weights" not in change:
    args["weights"] = jnp.zeros(change["q"].shape[:2])
  args.update(change)
  with pytest.raises(ValueError, match=match):
    score_counts_mgpu(**args)
