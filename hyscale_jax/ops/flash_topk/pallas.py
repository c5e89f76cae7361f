"""The `"pallas"` backend of `flash_topk`: one scoring pass with a threshold, then an exact finish.

1. **Threshold.** `t[row]` is the r-th best score over a strided sample of the keys: every
   `stride`-th key, which is the same problem with `compress_ratio * stride`, solved by this same
   function recursively until the keys fit the candidate buffer (then `t = -inf`, take them all).
   With `stride ~ oversample * topk / r`, about `oversample * topk` keys per row score above `t`,
   for any score order (increasing scores included), at about 1/stride of the main pass's FLOPs.
2. **Main pass** (`pallas_kernels.flash_topk`). Scores every visible key once on the tensor cores,
   keeps the keys above `t` and the first `topk` keys tied at `t`, and counts both.
3. **Finish** (XLA). `lax.top_k` over the keys above `t` (equal scores: lower slot, which is the
   lower key), then the ties in key order. With `sorted=False` and the "select" finish over a buffer
   wider than `topk`, the winners above `t` stay in key order (no sort), then the ties; the
   `lax.top_k` finish (short key axes included) and rescued rows come out sorted anyway. This is
   exact whenever the row's counts show `n_above <= slots` and `n_above + n_tied >= min(topk,
   n_visible)`: every winner is above `t` (all kept) or tied at `t` (lowest indices win, and those
   were kept first).
4. **Rescue.** Rows failing either count (buffer overflow, or `t` above the row's k-th score) are
   recomputed by the streaming reference, so an overflow never drops a winner silently.

The zero plateau of ReLU scores is just a tie class: with `t == 0` the tie buffer keeps the first
`topk` zeros and the row does not overflow. Queries run in chunks so that the candidate buffers stay
under `Config.chunk_bytes`: working memory does not grow with Tq * Tk.

fp8 (float8_e4m3fn q and k, with `k_scale`): every stage scores with the same function
(`reference.index_scores`: k's scale times `scale` on each key's head sum), the main pass on fp8
tensor cores, the threshold and the rescue through the same paths as bf16.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hyscale_jax.ops import _streaming as st
from hyscale_jax.ops.flash_topk.reference import default_key_chunk, key_factor, pad_keys, topk_rows
from pallas_kernels.flash_topk import (
    Candidates, Config, flash_topk_candidates, from_ordered_bits, next_power_of_two, ordered_bits, select_candidates,
)
from pallas_kernels.flash_topk import mosaic_pass


def flash_topk_pallas(q, k, weights, *, topk, compress_ratio=1, q_offset=0, segment_ids=None,
                      scale=1.0, k_scale=None, config: Config | None = None, interpret: bool | None = None,
                      sorted: bool = True, with_stats: bool = False):  # noqa: A002 - the op's name
  """Exact top-k as `ops.flash_topk` defines it, with the Pallas main pass.

  Args:
    q: bf16|f32|float8_e4m3fn[B, Tq, H, D]; k: the same dtypes, [B, Tk, D]; weights: bf16|f32[B, Tq, H]
      or None (for fp8, with q's scales folded in: `reference.fold_q_scale`).
    topk, compress_ratio, q_offset, segment_ids, scale, sorted: as in `ops.flash_topk`; unsorted rows
      list the winners above the row's threshold in key order, then those tied at it (rescued rows:
      sorted).
    k_scale: f32[B, Tk] or None: fp8 k's per-key scales.
    config: `pallas_kernels.flash_topk.Config`; None = the defaults.
    interpret: run the kernel in Pallas interpret mode; None = whenever JAX's backend is not a GPU.
    with_stats: also return which rows took the rescue (step 4 of the module docstring).

  Returns:
    (indices i32[B, Tq, topk], scores f32[B, Tq, topk]); empty slots hold (-1, -inf). With `with_stats`,
    also rescued bool[B, Tq]: the rows the main pass could not prove exact, recomputed by the reference.
  """
  indices, scores, stats = _run(q, k, weights, topk=topk, compress_ratio=compress_ratio,
                                q_offset=q_offset, segment_ids=segment_ids, scale=scale, k_scale=k_scale,
                                config=config, interpret=interpret, by_score=sorted)
  return (indices, scores, stats["rescued_rows"]) if with_stats else (indices, scores)


def flash_topk_pallas_with_stats(q, k, weights, *, topk, compress_ratio=1, q_offset=0,
                                 segment_ids=None, scale=1.0, k_scale=None, config: Config | None = None,
                                 interpret: bool | None = None, sorted: bool = True):  # noqa: A002
  """`flash_topk_pallas` plus how its threshold did, for tuning, benchmarks and tests.

  Returns:
    (indices, scores, stats) where stats is a dict: `rows` (B * Tq); `rescued` (i32: rows the main
    pass could not prove exact, which the reference recomputed); `rescued_rows` (bool[B, Tq]: which);
    `candidates_per_row` (f32: mean keys kept above the threshold; the threshold aims at
    `oversample * topk`).
  """
  return _run(q, k, weights, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset,
              segment_ids=segment_ids, scale=scale, k_scale=k_scale, config=config, interpret=interpret,
              by_score=sorted)


def _run(q, k, weights, *, topk, compress_ratio, q_offset, segment_ids, scale, k_scale, config,
         interpret, by_score=True):
  config = config or Config()
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  dtype = jnp.promote_types(q.dtype, k.dtype)
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  return _select(q.astype(dtype), k.astype(dtype), weights, jnp.asarray(q_offset, jnp.int32), q_seg,
                 kv_seg, k_scale, topk=topk, compress_ratio=compress_ratio, scale=scale, config=config,
                 interpret=interpret, by_score=by_score)


def _select(q, k, weights, q_offset, q_seg, kv_seg, k_scale, *, topk, compress_ratio, scale, config,
            interpret, by_score=True):
  """(indices, scores, stats) for the top level; the threshold recursion uses the same path, sorted
  (it reads the sample's rank-th score by position)."""
  B, Tq, H, _ = q.shape
  Tk = k.shape[1]
  slots = config.candidate_slots(topk, Tk)
  threshold = _threshold(q, k, weights, q_offset, q_seg, kv_seg, k_scale, topk=topk,
                         compress_ratio=compress_ratio, scale=scale, slots=slots, config=config,
                         interpret=interpret)
  key_scale = None if k_scale is None else key_factor(k_scale, scale)
  # Query chunks bound the candidate buffers. The last chunk is shifted back to end at Tq (rows it
  # shares with the previous chunk are recomputed identically), so q is never padded or copied.
  # Equal chunks keep that overlap under block_q rows per chunk; the largest chunk under the budget left
  # 3,604 of 131,072 rows (the costliest, last causal rows) to be scored twice.
  mosaic = config.scores_on_mosaic(Tk, H, q.shape[3], q.dtype, segments=q_seg is not None,
                                   key_scales=k_scale is not None, interpret=interpret)
  main_pass = mosaic_pass.flash_topk_candidates_mosaic if mosaic else flash_topk_candidates
  chunk, _ = _query_chunk(B, Tq, Tk, H, topk, config, mosaic, segments=q_seg is not None)
  rows = lambda x, start: None if x is None else jax.lax.dynamic_slice_in_dim(x, start, chunk, 1)

  def chunk_topk(c, outs):
    start = jnp.minimum(c * chunk, Tq - chunk)
    t_c = rows(threshold, start)
    candidates = main_pass(
        rows(q, start), k, rows(weights, start), t_c, q_offset=q_offset + start,
        segment_ids=None if q_seg is None else (rows(q_seg, start), kv_seg), topk=topk,
        compress_ratio=compress_ratio, scale=scale, slots=slots, config=config, interpret=interpret,
        key_scale=key_scale)
    found = (*_finish(candidates, t_c, topk, method=config.finish, interpret=interpret, by_score=by_score),
             candidates.n_above)
    return tuple(jax.lax.dynamic_update_slice_in_dim(o, f, start, 1) for o, f in zip(outs, found))

  outs = (jnp.zeros((B, Tq, topk), jnp.int32), jnp.zeros((B, Tq, topk), jnp.float32),
          jnp.zeros((B, Tq), bool), jnp.zeros((B, Tq), jnp.int32))
  indices, scores, exact, n_above = jax.lax.fori_loop(0, st.cdiv(Tq, chunk), chunk_topk, outs)
  indices, scores = _rescue(indices, scores, exact, q, k, weights, q_offset, q_seg, kv_seg, k_scale,
                            topk=topk, compress_ratio=compress_ratio, scale=scale,
                            rows_per_step=config.rescue_rows)
  stats = dict(rows=B * Tq, rescued=jnp.sum(~exact, dtype=jnp.int32), rescued_rows=~exact,
               candidates_per_row=jnp.mean(n_above.astype(jnp.float32)))
  return indices, scores, stats


def _query_chunk(B, Tq, Tk, H, topk, config, mosaic, segments):
  """(query rows per main-pass chunk, working bytes of one chunk): the candidate buffers (and the Mosaic
  pass's mask and partials) of a chunk stay under the pass's byte budget."""
  slots = config.candidate_slots(topk, Tk)
  block_q, budget = config.block_q(H), config.chunk_bytes
  row_bytes = B * (8 * slots + 4 * next_power_of_two(min(topk, Tk)))
  if mosaic:  # chunks of whole listing programs, with their mask
    block_q, budget = mosaic_pass.COMPACTION_ROWS, config.mosaic_chunk_bytes
    row_bytes += B * mosaic_pass.bytes_per_row(Tk, config, segments)
  largest = min(Tq, max(block_q, budget // row_bytes // block_q * block_q))
  chunk = min(Tq, st.cdiv(st.cdiv(Tq, st.cdiv(Tq, largest)), block_q) * block_q)
  return chunk, chunk * row_bytes


def working_bytes(batch: int, num_queries: int, num_keys: int, num_heads: int, head_dim: int, dtype, topk: int,
                  config: Config | None = None, segments: bool = True) -> int:
  """Bytes of the main pass's buffers for one query chunk (what `flash_topk(backend="pallas")` holds
  besides its inputs and outputs), for q [batch, num_queries, num_heads, head_dim] of `dtype` over
  `num_keys` keys without key scales (with segment ids unless `segments` is False): capped by
  `Config.chunk_bytes`, or by `Config.mosaic_chunk_bytes` where the pass scores on Mosaic GPU here."""
  config = config or Config()
  mosaic = config.scores_on_mosaic(num_keys, num_heads, head_dim, jnp.dtype(dtype), segments=segments,
                                   key_scales=False, interpret=False)
  return _query_chunk(batch, num_queries, num_keys, num_heads, topk, config, mosaic, segments)[1]


def _threshold(q, k, weights, q_offset, q_seg, kv_seg, k_scale, *, topk, compress_ratio, scale, slots,
               config, interpret):
  """f32[B, Tq]: the r-th best score of a strided key sample, or -inf where every key fits."""
  B, Tq = q.shape[:2]
  Tk = k.shape[1]
  stride = max(2, round(config.oversample * topk / config.sample_rank))
  if Tk <= slots or Tk < stride:
    return jnp.full((B, Tq), -jnp.inf, jnp.float32)
  rank = max(1, math.ceil(config.oversample * topk / stride))
  # Sample key j is key j*stride + stride-1: visible exactly when (j+1) * stride * compress_ratio
  # <= p + 1, which is the same problem with compress_ratio * stride.
  k_sample, kv_seg_sample, k_scale_sample = (
      None if x is None else x[:, stride - 1 :: stride] for x in (k, kv_seg, k_scale))
  _, sample_scores, _ = _select(q, k_sample, weights, q_offset, q_seg, kv_seg_sample, k_scale_sample,
                                topk=rank, compress_ratio=compress_ratio * stride, scale=scale,
                                config=config, interpret=interpret)
  return sample_scores[..., rank - 1]


def sort_winners(scores, indices, n):
  """Rows of (scores f32[R, k], indices i32[R, k]) with n i32[R] valid places, sorted by score
  descending, then index ascending; the places past n come last (their contents unspecified).

  Descending scores become ascending u32 keys (the empty places the largest): a plain integer
  compare. A row's winners are distinct keys, so (key, index) pairs are unique and an unstable
  two-key sort gives the stable order, in less time than a stable one-key sort, which XLA runs
  with an extra iota operand (docs/kernels/flash_topk.md).
  """
  kept = jnp.arange(scores.shape[-1]) < n[:, None]
  key = jnp.where(kept, ~ordered_bits(scores), jnp.uint32(0xFFFFFFFF))
  key, indices = jax.lax.sort((key, indices), num_keys=2, is_stable=False)
  return from_ordered_bits(~key), indices


def _finish(c: Candidates, threshold, topk, *, method="select", interpret=False, by_score=True):
  """(indices, scores, exact): the top-k from the candidates, and whether the counts prove it.

  `method` ranks the strict candidates (`Config.finish`): "select" keeps each row's `topk` best
  with `select_candidates` and sorts only those by (score, key index); "top_k" runs `lax.top_k`
  over the whole buffer (equal scores: lower slot). The main pass lists a row's candidates in key
  order, distinct, so both give the same result. Without `by_score`, "select" leaves its winners in
  the buffer's key order.
  """
  B, Tq, slots = c.indices.shape
  tie_slots = c.tie_indices.shape[-1]
  n_kept = jnp.minimum(c.n_above, slots)[..., None]
  if method == "select" and slots > topk:
    best, best_idx, n_best = select_candidates(c.scores.reshape(B * Tq, slots), c.indices.reshape(B * Tq, slots),
                                               n_kept.reshape(-1), topk, interpret=interpret)
    if by_score:
      best, best_idx = sort_winners(best, best_idx, n_best)
    best, best_idx = best.reshape(B, Tq, topk), best_idx.reshape(B, Tq, topk)
  else:
    score = jnp.where(jnp.arange(slots) < n_kept, c.scores, -jnp.inf)
    best, slot = jax.lax.top_k(score, min(topk, slots))  # equal scores: lower slot = lower key first
    best_idx = jnp.take_along_axis(c.indices, slot, axis=-1)
  best, best_idx = st.pad_axis(best, 2, topk, -jnp.inf), st.pad_axis(best_idx, 2, topk, -1)
  j = jnp.arange(topk)
  from_above = j < n_kept
  tie_j = j - n_kept
  from_tie = ~from_above & (tie_j < c.n_tied[..., None]) & (tie_j < tie_slots)
  tie_idx = jnp.take_along_axis(c.tie_indices, jnp.clip(tie_j, 0, tie_slots - 1), axis=-1)
  indices = jnp.where(from_above, best_idx, jnp.where(from_tie, tie_idx, -1))
  scores = jnp.where(from_above, best, jnp.where(from_tie, threshold[..., None], -jnp.inf))
  found = c.n_above + c.n_tied
  exact = (c.n_above <= slots) & ((found >= topk) | (found >= c.n_visible))
  return indices, scores, exact


def _rescue(indices, scores, exact, q, k, weights, q_offset, q_seg, kv_seg, k_scale, *, topk,
            compress_ratio, scale, rows_per_step):
  """Recomputes the rows not proven exact with the streaming reference, `rows_per_step` at a time.

  indices/scores [B, Tq, topk] and exact bool[B, Tq]; q [B, Tq, H, D], k [B, Tk, D] (k_scale [B, Tk]
  or None). One while loop
  per sequence updates the outputs in place (a vmapped loop would select between whole carries and
  double the outputs' memory); with nothing to rescue each loop runs zero steps.
  """
  B, Tq = q.shape[:2]
  Tk = k.shape[1]
  key_chunk = min(default_key_chunk(topk), Tk)
  k, kv_seg, k_scale = pad_keys(key_chunk, k, kv_seg, k_scale)
  n_steps = st.cdiv(Tq, rows_per_step)
  for b in range(B):
    todo = jnp.nonzero(~exact[b], size=n_steps * rows_per_step, fill_value=Tq)[0]
    n_todo = jnp.sum(~exact[b])
    one = lambda x, b=b: None if x is None else x[b : b + 1]

    def step(state, b=b, todo=todo, one=one):
      s, indices, scores = state
      rows = jax.lax.dynamic_slice_in_dim(todo, s * rows_per_step, rows_per_step)
      safe = jnp.minimum(rows, Tq - 1)
      take = lambda x: None if x is None else x[b][safe][None]
      new_idx, new_sc = topk_rows(
          take(q), one(k), take(weights), q_offset + safe, take(q_seg), one(kv_seg), num_keys=Tk,
          topk=topk, compress_ratio=compress_ratio, scale=scale, key_chunk=key_chunk,
          k_scale_padded=one(k_scale))
      return (s + 1, indices.at[b, rows].set(new_idx[0], mode="drop"),
              scores.at[b, rows].set(new_sc[0], mode="drop"))

    _, indices, scores = jax.lax.while_loop(
        lambda state, n_todo=n_todo: state[0] * rows_per_step < n_todo, step,
        (jnp.int32(0), indices, scores))
  return indices, scores
