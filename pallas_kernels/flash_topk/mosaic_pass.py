"""The FlashTopK main pass with its scoring on Hopper's warpgroup MMA (`Config.scorer="mosaic"`).

Same contract as the Triton pass (`flash_topk_candidates`: per row, the keys above the threshold with
their scores, the first keys tied at it, and the counts), in three steps per batch row:

1. **Mark** (`mgpu_scores.score_counts_mgpu(emit_mask=True)`, Mosaic GPU): scores every visible key
   once and writes an int8 per (query, key): 2 above the row's threshold, 1 tied, 0 below. A Mosaic
   GPU kernel has no scatter to append with, so it writes the mask instead: one byte per score
   against the four the score itself would take, a few percent of the scoring time.
2. **List** (`candidates_from_mask`, Triton): reads each row's visible mask bytes once and appends
   the marked keys in key order, as the Triton pass does while it scores.
3. **Rescore** (`index_scores_at_prefix`, Triton, keys as the matmul's rows): the scores of the
   listed keys, each row only as far as its count. The finish ranks the candidates by these. Keys
   as rows measured faster than heads as rows here (docs/kernels/flash_topk.md).

Scores are f32 in both kernels (products, head sum, scale), summed in different orders, so a key
whose two scores straddle the threshold by a rounding may be marked on one side and ranked by the
other: the same class of difference as between any two f32 scorers. On integer-valued inputs every
order gives the same bits and the result is exactly the Triton pass's (tests/test_flash_topk_mosaic.py).
The rescored scores get the main pass's two folds (-0 to +0, NaN to -inf), so the finish ranks the
same values either pass would give it.

Segments (packed documents) are the mark kernel's: it leaves keys of other segments unmarked, skips
the steps before the first key its queries' segments hold, and counts each row's visible keys; the
listing starts each row where the marking did (`first_scored_keys`).

Memory: the mask of a query chunk, [chunk, Tk] int8, beside the candidate buffers; `_select` sizes
the chunks for both (`Config.mosaic_chunk_bytes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._shapes import next_power_of_two
from pallas_kernels.flash_topk._common import keys_seen, rank_folded
from pallas_kernels.flash_topk.flash_topk import Candidates, Config, candidates_from_mask
from pallas_kernels.flash_topk.mgpu_scores import first_scored_keys, output_bytes_per_row, score_counts_mgpu
from pallas_kernels.flash_topk.scores_at import index_scores_at_prefix

COMPACTION_ROWS = 16  # rows per program of the listing step; query chunks are a multiple of it


def bytes_per_row(num_keys: int, config: Config, segments: bool) -> int:
  """The mark kernel's outputs per query row at this config's blocks: its mask row and its partials."""
  return output_bytes_per_row(num_keys, config.mosaic_block_k, segments)


def flash_topk_candidates_mosaic(q, k, weights, threshold, *, q_offset, segment_ids, topk, compress_ratio, scale,
                                 slots, config: Config, interpret: bool, key_scale=None) -> Candidates:
  """`flash_topk_candidates` for bf16 q [B, Tq, H, D] and k [B, Tk, D] without key scales.

  Args and returns as `flash_topk_candidates` (weights None means all ones; segment_ids None or
  (q_seg int[B, Tq], kv_seg int[B, Tk])); `key_scale` must be None (`Config.scores_on_mosaic` sends
  fp8's key scales to the Triton pass).
  """
  if key_scale is not None:
    raise ValueError("The Mosaic main pass takes no key_scale (fp8): use Config(scorer='triton').")
  B, Tq, H, _ = q.shape
  Tk = k.shape[1]
  tie_slots = next_power_of_two(min(topk, Tk))
  if weights is None:
    weights = jnp.ones((B, Tq, H), jnp.float32)
  # Whole listing programs: padded here, the mask is neither sliced by the kernel's wrapper nor padded
  # again by the listing (a copy of [Tq, Tk] bytes); padded rows (threshold +inf) are sliced off below.
  extra = -Tq % COMPACTION_ROWS
  q_seg, kv_seg = (None, None) if segment_ids is None else segment_ids
  if extra:
    q, weights = (jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2)) for x in (q, weights))
    threshold = jnp.pad(threshold, ((0, 0), (0, extra)), constant_values=jnp.inf)
    if q_seg is not None:
      q_seg = jnp.pad(q_seg, ((0, 0), (0, extra)), constant_values=-1)
  rows, visible = [], []
  for b in range(B):  # Mosaic's kernel takes one batch row; long-context batches hold one or a few
    marked = score_counts_mgpu(q[b], k[b], weights[b], threshold[b], scale=scale, q_offset=q_offset,
                               compress_ratio=compress_ratio,
                               segment_ids=None if q_seg is None else (q_seg[b], kv_seg[b]),
                               block_q=config.mosaic_block_q, block_k=config.mosaic_block_k,
                               stages=config.mosaic_stages, emit_mask=True, interpret=interpret)
    mask, first_keys = marked[3], None
    if q_seg is not None:
      visible.append(marked[4][:Tq])
      first_keys = first_scored_keys(q_seg[b], kv_seg[b], block_q=config.mosaic_block_q,
                                     block_k=config.mosaic_block_k)
    idx, tie_idx, n_above, n_tied = candidates_from_mask(mask, q_offset, num_keys=Tk, compress_ratio=compress_ratio,
                                                    slots=slots, tie_slots=tie_slots, first_keys=first_keys,
                                                    block_q=COMPACTION_ROWS, interpret=interpret)
    scores = index_scores_at_prefix(q[b][None], k[b][None], weights[b][None], idx[None],
                                    jnp.minimum(n_above, slots)[None], scale, keys_as_rows=True,
                                    interpret=interpret)[0]
    rows.append((idx, rank_folded(scores), tie_idx, n_above, n_tied))
  idx, scores, tie_idx, n_above, n_tied = (jnp.stack(x)[:, :Tq] for x in zip(*rows))
  if visible:
    n_vis = jnp.stack(visible)
  else:
    positions = jnp.asarray(q_offset, jnp.int32) + jnp.arange(Tq, dtype=jnp.int32)
    n_vis = jnp.broadcast_to(keys_seen(positions, compress_ratio, Tk), (B, Tq))
  return Candidates(idx, scores, tie_idx, n_above, n_tied, n_vis)
