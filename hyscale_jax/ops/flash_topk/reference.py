"""Pure-jnp references for `flash_topk`: a streaming exact top-k, and the materializing XLA baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _streaming as st

_HIGHEST = jax.lax.Precision.HIGHEST
_NO_INDEX = jnp.iinfo(jnp.int32).max  # sorts after every real key index
FP8 = jnp.float8_e4m3fn  # the fp8 path's dtype (DeepSeek-V3.2's indexer)


def index_scores(
    q: Float[Array, "B Tq H D"],
    k: Float[Array, "B Tk D"],
    weights: Float[Array, "B Tq H"] | None,
    scale: float,
    k_scale: Float[Array, "B Tk"] | None = None,
) -> Float[Array, "B Tq Tk"]:
  """The lightning-indexer score `sum_h w[t,h] * relu(<q[t,h], k[s]>)`, times `key_factor`.

  Products accumulate in f32 and the head sum is in f32; returns f32. The head sum is multiplied by
  `scale`, or, with `k_scale` (the fp8 path), by the f32 `key_factor(k_scale, scale)[s]`. Signed zeros
  are folded to +0 so that the ReLU plateau is one tie class for the (score desc, index asc) order.
  fp8 operands are widened to bf16 for XLA's dot: every e4m3 value is a bf16 value, and products of
  two of them are exact in f32, so the score is that of the fp8 values.
  """
  q, k = (x.astype(jnp.bfloat16) if x.dtype == FP8 else x for x in (q, k))
  dots = jnp.einsum("bthd,bsd->bths", q, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
  factor = scale if k_scale is None else key_factor(k_scale, scale)[:, None, :]
  score = _weighted_relu_head_sum(dots, weights, factor)
  return jnp.where(score == 0.0, 0.0, score)


def fold_q_scale(
    weights: Float[Array, "B Tq H"] | None, q_scale: Float[Array, "B Tq H"] | None
) -> Float[Array, "B Tq H"] | None:
  """The fp8 path's head weights: the f32 product `weights * q_scale` (a missing factor is 1).

  As in DeepSeek-V3.2's `fp8_index`, a query row's scale multiplies its head weight rather than its
  dot: for q_scale >= 0, `w * relu(q_scale * d) == (w * q_scale) * relu(d)`.
  """
  if q_scale is None:
    return weights
  q_scale = q_scale.astype(jnp.float32)
  return q_scale if weights is None else weights.astype(jnp.float32) * q_scale


def key_factor(k_scale: Float[Array, "B Tk"], scale: float) -> Float[Array, "B Tk"]:
  """The fp8 path's factor on key s's head sum: the f32 product `k_scale[s] * scale`.

  One multiply per (query, key) after the head sum, where DeepSeek-V3.2's `fp8_index` applies k's
  scale: for k_scale >= 0 it equals scaling the dots before the ReLU.
  """
  return k_scale.astype(jnp.float32) * jnp.float32(scale)


def index_scores_at(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S D"],
    weights: Float[Array, "B T H"] | None,
    indices: Int[Array, "B T K"],
    scale: float,
) -> Float[Array, "B T K"]:
  """`index_scores` at listed keys only: entry j of row t scores key `indices[t, j]` (clamped)."""
  safe = jnp.clip(indices, 0, k.shape[1] - 1)
  # Gathered from an f32 copy so that the gather's transpose (k's gradient) adds the rows' parts in
  # f32: a bf16 scatter-add over T * K parts drifts with T (QSA's block keys: 11% at T = 4K).
  k_sel = jax.vmap(lambda kb, ib: kb[ib])(k.astype(jnp.float32), safe).astype(k.dtype)  # [B, T, K, D]
  dots = jnp.einsum(
      "bthd,btjd->bthj", q, k_sel, preferred_element_type=jnp.float32, precision=_HIGHEST
  )
  return _weighted_relu_head_sum(dots, weights, scale)


def _weighted_relu_head_sum(dots, weights, factor):
  """f32 `(sum_h w[b,t,h] * relu(dots[b,t,h,s])) * factor` over axis 2 of dots [B, T, H, S]; factor is
  a float or an f32 array broadcasting against [B, T, S]."""
  relu = jax.nn.relu(dots)  # relu'(0) = 0: exact zero dots get no gradient
  if weights is not None:
    relu = relu * weights.astype(jnp.float32)[..., None]
  return relu.sum(axis=2) * jnp.asarray(factor, jnp.float32)


def _rank_score(score):
  """NaN (f32 overflow: inf - inf, 0 * inf) ranks as -inf, the lowest visible score."""
  return jnp.where(jnp.isnan(score), -jnp.inf, score)


def _merge_topk(best, cand, topk: int):
  """Exact top-k of the union of two (hidden, score, index) sets.

  Order: visible keys first (hidden = 0), then score descending, then index ascending, so a visible
  key whose f32 score is -inf still outranks every invisible one.
  """
  hidden, scores, idx = (jnp.concatenate([b, c], axis=-1) for b, c in zip(best, cand))
  hidden, neg, idx = jax.lax.sort((hidden, -scores, idx), dimension=-1, num_keys=3)
  return hidden[..., :topk], -neg[..., :topk], idx[..., :topk]


def _finish(hidden, scores, idx):
  """Slots holding no visible key get index -1 and score -inf."""
  hidden = hidden.astype(bool)
  return jnp.where(hidden, -1, idx).astype(jnp.int32), jnp.where(hidden, -jnp.inf, scores)


def default_key_chunk(topk: int) -> int:
  """Keys per merge step: each merge sorts topk + chunk candidates, so about topk keys (>= 256)."""
  return max(256, 1 << (topk - 1).bit_length())


def pad_keys(key_chunk: int, k, *per_key):
  """Pads k [B, Tk, D] and the per-key arrays [B, Tk] (kv_seg, k_scale; None stays None) along keys to
  a multiple of `key_chunk` for `topk_rows`."""
  size = st.cdiv(k.shape[1], key_chunk) * key_chunk
  return tuple(None if x is None else st.pad_axis(x, 1, size) for x in (k, *per_key))


def topk_rows(
    q_rows: Float[Array, "B R H D"],
    k_padded: Float[Array, "B Tk_pad D"],
    w_rows: Float[Array, "B R H"] | None,
    q_pos: Int[Array, "R"],
    q_seg_rows: Int[Array, "B R"] | None,
    kv_seg_padded: Int[Array, "B Tk_pad"] | None,
    *,
    num_keys: int,
    topk: int,
    compress_ratio: int,
    scale: float,
    key_chunk: int,
    k_scale_padded: Float[Array, "B Tk_pad"] | None = None,
) -> tuple[Int[Array, "B R topk"], Float[Array, "B R topk"]]:
  """Exact top-k for R query rows at arbitrary absolute positions `q_pos`, streaming key chunks.

  `k_padded`, `kv_seg_padded` and `k_scale_padded` come from `pad_keys(key_chunk, ...)`; `num_keys` is
  the unpadded Tk.
  Chunks past the last key visible to `max(q_pos)` are skipped. Empty slots hold (-1, -inf).
  """
  B, R = q_rows.shape[:2]
  n_chunks = k_padded.shape[1] // key_chunk

  def key_chunk_step(j, best):
    start = j * key_chunk
    k_pos = start + jnp.arange(key_chunk, dtype=jnp.int32)
    k_blk = jax.lax.dynamic_slice_in_dim(k_padded, start, key_chunk, axis=1)
    seg, k_scale = (None if x is None else jax.lax.dynamic_slice_in_dim(x, start, key_chunk, axis=1)
                    for x in (kv_seg_padded, k_scale_padded))
    vis = st.key_visible(q_pos, k_pos, compress_ratio, q_seg_rows, seg) & (k_pos < num_keys)
    score = _rank_score(index_scores(q_rows, k_blk, w_rows, scale, k_scale))
    hidden = jnp.broadcast_to(~vis, score.shape).astype(jnp.int32)
    return _merge_topk(best, (hidden, score, jnp.broadcast_to(k_pos, score.shape)), topk)

  best = (jnp.ones((B, R, topk), jnp.int32), jnp.full((B, R, topk), -jnp.inf),
          jnp.full((B, R, topk), _NO_INDEX, jnp.int32))
  n_visible = st.visible_key_chunks(jnp.max(q_pos), compress_ratio, key_chunk, n_chunks)
  return _finish(*jax.lax.fori_loop(0, n_visible, key_chunk_step, best))


def flash_topk_reference(
    q: Float[Array, "B Tq H D"],
    k: Float[Array, "B Tk D"],
    weights: Float[Array, "B Tq H"] | None,
    *,
    topk: int,
    compress_ratio: int = 1,
    q_offset: int | Int[Array, ""] = 0,
    segment_ids: tuple[Int[Array, "B Tq"], Int[Array, "B Tk"]] | None = None,
    scale: float = 1.0,
    k_scale: Float[Array, "B Tk"] | None = None,
    query_block: int = 64,
    key_chunk: int | None = None,
    sorted: bool = True,  # noqa: A002 - the op's name
    with_stats: bool = False,
) -> tuple[Int[Array, "B Tq topk"], Float[Array, "B Tq topk"]]:
  """Exact streaming top-k: query blocks x key chunks with a running (score desc, index asc) merge.

  The merge keeps the sorted order, so `sorted=False` (any order allowed) returns it too.

  Memory is O(Tq * (key_chunk + topk) + query_block * H * key_chunk); the [Tq, Tk] table is never
  built. Key chunks that are entirely in the causal future of a query block are skipped. Each
  merge sorts topk + key_chunk candidates, so the default chunk is about topk keys (at least 256).
  `k_scale` (the fp8 path) multiplies each key's head sum as `index_scores` says.

  Returns:
    (indices i32[B, Tq, topk], scores f32[B, Tq, topk]); empty slots hold (-1, -inf). With `with_stats`,
    also None for the rescued rows: this path has no fallback to take.
  """
  del sorted
  Tq, Tk = q.shape[1], k.shape[1]
  bq, ck = min(query_block, Tq), min(key_chunk or default_key_chunk(topk), Tk)
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  k, kv_seg, k_scale = pad_keys(ck, k, kv_seg, k_scale)
  q_offset = jnp.asarray(q_offset, jnp.int32)

  def query_block_topk(xs):
    i, q_blk, w_blk, seg_blk = xs  # [B, bq, H, D], [B, bq, H] | None, [B, bq] | None
    q_pos = q_offset + i * bq + jnp.arange(bq, dtype=jnp.int32)
    return topk_rows(q_blk, k, w_blk, q_pos, seg_blk, kv_seg, num_keys=Tk, topk=topk,
                     compress_ratio=compress_ratio, scale=scale, key_chunk=ck, k_scale_padded=k_scale)

  n_blocks = st.cdiv(Tq, bq)
  xs = (
      jnp.arange(n_blocks, dtype=jnp.int32),
      st.to_blocks(q, 1, bq),
      None if weights is None else st.to_blocks(weights, 1, bq),
      None if q_seg is None else st.to_blocks(q_seg, 1, bq),
  )
  idx, scores = jax.lax.map(query_block_topk, xs)
  idx, scores = st.from_blocks(idx, 1, Tq), st.from_blocks(scores, 1, Tq)
  return (idx, scores, None) if with_stats else (idx, scores)


def flash_topk_xla_baseline(
    q: Float[Array, "B Tq H D"],
    k: Float[Array, "B Tk D"],
    weights: Float[Array, "B Tq H"] | None,
    *,
    topk: int,
    compress_ratio: int = 1,
    q_offset: int | Int[Array, ""] = 0,
    segment_ids: tuple[Int[Array, "B Tq"], Int[Array, "B Tk"]] | None = None,
    scale: float = 1.0,
    k_scale: Float[Array, "B Tk"] | None = None,
    query_rows: int | None = None,
    bytes_budget: int = 1 << 31,
    sorted: bool = True,  # noqa: A002 - the op's name
    with_stats: bool = False,
) -> tuple[Int[Array, "B Tq topk"], Float[Array, "B Tq topk"]]:
  """The baseline we beat: materialize full score rows, then `lax.top_k` (sorted, whatever `sorted` says).

  Rows are processed `query_rows` at a time (by default as many as fit `bytes_budget` of the
  [rows, H, Tk] f32 intermediate), like Megatron's row-chunked indexer; each chunk's [rows, Tk]
  score table is written out in full before selection. `with_stats`: as `flash_topk_reference`.
  """
  del sorted
  B, Tq, H, _ = q.shape
  Tk = k.shape[1]
  if query_rows is None:
    query_rows = max(1, min(Tq, bytes_budget // (4 * B * H * Tk)))
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  q_offset = jnp.asarray(q_offset, jnp.int32)
  kk = min(topk, Tk)

  def rows_topk(xs):
    i, q_blk, w_blk, seg_blk = xs
    q_pos = q_offset + i * query_rows + jnp.arange(query_rows, dtype=jnp.int32)
    vis = st.key_visible(q_pos, jnp.arange(Tk, dtype=jnp.int32), compress_ratio, seg_blk, kv_seg)
    score = _rank_score(index_scores(q_blk, k, w_blk, scale, k_scale))
    # top_k sees -inf only for invisible keys: a visible -inf score competes as the lowest finite value.
    order = jnp.where(vis, jnp.where(score == -jnp.inf, jnp.finfo(jnp.float32).min, score), -jnp.inf)
    vals, idx = jax.lax.top_k(order, kk)
    scores = jnp.take_along_axis(score, idx, axis=-1)
    hidden = (vals == -jnp.inf).astype(jnp.int32)
    if kk < topk:
      hidden = st.pad_axis(hidden, 2, topk, 1)
      scores = st.pad_axis(scores, 2, topk, -jnp.inf)
      idx = st.pad_axis(idx, 2, topk, -1)
    return _finish(hidden, scores, idx)

  xs = (
      jnp.arange(st.cdiv(Tq, query_rows), dtype=jnp.int32),
      st.to_blocks(q, 1, query_rows),
      None if weights is None else st.to_blocks(weights, 1, query_rows),
      None if q_seg is None else st.to_blocks(q_seg, 1, query_rows),
  )
  idx, scores = jax.lax.map(rows_topk, xs)
  idx, scores = st.from_blocks(idx, 1, Tq), st.from_blocks(scores, 1, Tq)
  return (idx, scores, None) if with_stats else (idx, scores)
