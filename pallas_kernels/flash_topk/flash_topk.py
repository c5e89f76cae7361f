"""The FlashTopK main pass in Pallas (Triton style): score key tiles, keep what beats a threshold.

Each program scores `block_q` queries (x H heads as matmul rows, so one key tile feeds every head;
with `Config.keys_as_rows` the keys are the rows and the heads the columns) against `block_k` keys
per step on the tensor cores, applies ReLU and the head weights, and sums over heads in f32.
Against a per-row threshold `t` it appends, in key order,

* every visible key with `score > t` into a buffer of `slots` (index, score) pairs per row, and
* the first `tie_slots` visible keys with `score == t` (indices only) into a tie buffer,

and counts both, plus the visible keys, so a caller can prove each row exact or recompute it: the
counts keep growing after a buffer is full. No [Tq, Tk] table is written; key tiles after the last
key visible to a query block are not computed. The scores are the kernel's own f32 arithmetic
(products in f32, head sum in f32, then `scale` or each key's `key_scale`, -0 folded to +0, NaN
ranked as -inf), which on integer-valued inputs is bit-identical to the reference.

fp8 (float8_e4m3fn) q and k go to the dot as they are, with f32 accumulation (the Triton IR's dot
takes e4m3 operands; whether Triton picks the fp8 WGMMA is not known, and the fp8 path measured
slower than bf16: docs/kernels/flash_topk.md). Their scales never touch the [rows, keys] tile before
the head sum:
the caller folds q's row scales into the head weights, and k's scales (times `scale`) come in as
`key_scale`, one multiply per (query, key) after the head sum, as DeepSeek-V3.2's `fp8_index` does.

`hyscale_jax.ops.flash_topk.pallas` builds the exact top-k on this pass (threshold from a key
sample, exact finish, rescue); see its docstring. Triton wants power-of-two blocks and matmul dims
>= 16, so `flash_topk_candidates` pads heads (with zero weight) and the head dim (with zeros) to
powers of two, the keys to a multiple of `block_k`, and the queries to a multiple of `block_q`.
Everything here is plain Pallas with BlockSpecs, so `interpret=True` runs it on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shapes import next_power_of_two
from pallas_kernels.flash_topk._common import key_visible, keys_seen, rank_folded, segment_first_keys

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning knobs. The measurements behind each default are in docs/kernels/flash_topk.md.

  Attributes:
    block_rows: matmul rows per program, block_q = block_rows // H queries (at least 1);
      None = the measured default (see `block_q`).
    block_k: keys per step (a power of two); None = the measured default (see `resolved_block_k`).
    num_warps, num_stages: Triton launch parameters.
    oversample: expected strict candidates per row, in units of topk (sets the sample stride).
    sample_rank: r, the rank of the sample score used as the threshold (more = less noisy).
    candidates: strict-candidate slots per row (a power of two); None = 4 * topk, at least
      `min_candidates`. Rows whose keys fit take every visible key (no threshold).
    min_candidates: the smallest candidate buffer.
    chunk_bytes: candidate-buffer bytes per query chunk; bounds the working memory.
    rescue_rows: rows per step of the exact fallback.
    finish: how the exact finish ranks a row's strict candidates: "select" (the k-th score by a
      bitwise search, then a sort of the `topk` winners: `pallas_kernels.flash_topk.select`) or
      "top_k" (`lax.top_k` over the whole buffer). Same result.
    keys_as_rows: the main pass's matmul as keys x heads (`k_tile @ q^T`, [block_k, block_q*H])
      instead of heads x keys. The head sum then runs along the accumulator's columns, inside each
      thread's registers and its quad, instead of across rows (warps, through shared memory). Same
      products, summed in another order: on integer-valued inputs the same bits. None = the measured
      default (see `resolved_keys_as_rows`).
    scorer: who scores the main pass: "triton" (the kernel here, which lists its candidates as it
      goes), "mosaic" (Hopper's warpgroup MMA, `mgpu_scores`, which marks them in an int8 mask that
      `candidates_from_mask` lists and `index_scores_at_prefix` rescores: `mosaic_pass`), or "auto"
      (see `scores_on_mosaic`). The Mosaic pass takes bf16 inputs without per-key scales (fp8);
      others take the Triton pass.
    mosaic_block_q, mosaic_block_k, mosaic_stages: the Mosaic pass's queries per CTA, keys per
      consumer warpgroup and key steps in flight (`score_counts_mgpu`).
    mosaic_chunk_bytes: the Mosaic pass's working memory per query chunk (mask and buffers); larger
      than `chunk_bytes` because a chunk is one kernel launch: at 128K keys a 256 MiB chunk is 1,296
      rows, 2.5 waves of CTAs, and the launches' tails measured slower than 1 GiB chunks.
    mosaic_min_keys: "auto" scores on Mosaic from this many keys on: measured faster than the Triton
      pass from 32K keys (H 32 and 64, k 512 and 2048), slower at 16K, where the rescoring of ~3,600
      candidates a row costs almost half of the main pass's FLOPs (docs/kernels/flash_topk.md).
  """

  block_rows: int | None = None
  block_k: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  oversample: float = 2.0
  sample_rank: int = 64
  candidates: int | None = None
  min_candidates: int = 1024
  chunk_bytes: int = 256 << 20
  rescue_rows: int = 16
  finish: str = "select"
  keys_as_rows: bool | None = None
  scorer: str = "auto"
  mosaic_block_q: int = 4
  mosaic_block_k: int = 64
  mosaic_stages: int = 2
  mosaic_chunk_bytes: int = 1 << 30
  mosaic_min_keys: int = 32768

  def __post_init__(self):
    if self.finish not in ("select", "top_k"):
      raise ValueError(f"Config.finish={self.finish!r} must be 'select' or 'top_k'.")
    if self.scorer not in ("auto", "triton", "mosaic"):
      raise ValueError(f"Config.scorer={self.scorer!r} must be 'auto', 'triton' or 'mosaic'.")
    for name in ("block_rows", "block_k", "candidates", "min_candidates"):
      value = getattr(self, name)
      if value is not None and (value < 1 or value & (value - 1)):
        raise ValueError(f"Config.{name}={value} must be a power of two.")
    if not self.oversample >= 1.0:
      raise ValueError(f"Config.oversample={self.oversample} must be >= 1.")
    if self.sample_rank < 1 or self.rescue_rows < 1 or self.chunk_bytes < 1:
      raise ValueError("Config.sample_rank, rescue_rows and chunk_bytes must be >= 1.")

  def candidate_slots(self, topk: int, num_keys: int) -> int:
    """Strict-candidate slots per row for this problem (a power of two)."""
    slots = self.candidates or max(self.min_candidates, next_power_of_two(4 * topk))
    return min(slots, next_power_of_two(num_keys))

  def scores_on_mosaic(self, num_keys: int, num_heads: int, head_dim: int, dtype, *, segments: bool,
                       key_scales: bool, interpret: bool) -> bool:
    """Whether the main pass scores on Mosaic GPU (`mosaic_pass`).

    "mosaic" takes it wherever the inputs allow (bf16, no per-key scales, heads and head dim within
    the kernel's MMA columns and shared memory); "auto" only where it was measured faster: compiled,
    on Hopper, from `mosaic_min_keys` keys.

    Args:
      num_keys, num_heads, head_dim: Tk, H and D.
      dtype: q's and k's dtype.
      segments: whether segment ids come (packed documents; the kernel then keeps a fourth partial).
      key_scales: whether per-key scales come (fp8), which the Mosaic pass does not take.
      interpret: whether the kernels run in interpret mode.
    """
    from pallas_kernels.flash_topk import mgpu_scores  # noqa: PLC0415 - keeps this module free of Mosaic GPU

    if (self.scorer == "triton" or dtype != jnp.bfloat16 or key_scales
        or not mgpu_scores.fits(num_heads, head_dim, block_q=self.mosaic_block_q, block_k=self.mosaic_block_k,
                                stages=self.mosaic_stages, emit_mask=True, segments=segments)):
      return False
    if self.scorer == "mosaic":
      return True
    from pallas_kernels._hopper import on_hopper  # noqa: PLC0415 - _hopper imports Mosaic GPU, as above

    return not interpret and num_keys >= self.mosaic_min_keys and on_hopper()

  def resolved_keys_as_rows(self, num_heads: int, dtype) -> bool:
    """`keys_as_rows` for `num_heads` heads of `dtype`, the default resolved.

    By default yes for bf16 and one query per program (16+ heads), where it was measured faster
    (docs/kernels/flash_topk.md); no for fp8 and f32 (not timed) and for the multi-query programs,
    whose head sum would need a transpose.
    """
    if self.keys_as_rows is None:
      return dtype == jnp.bfloat16 and self.block_q(num_heads) == 1
    return self.keys_as_rows

  def resolved_block_k(self, num_heads: int, dtype) -> int:
    """`block_k` for `num_heads` heads of `dtype`: by default 64 keys as rows (the measured best at
    H 64), else 128."""
    if self.block_k is None:
      return 64 if self.resolved_keys_as_rows(num_heads, dtype) else 128
    return self.block_k

  def block_q(self, num_heads: int) -> int:
    """Queries per program for `num_heads` heads (padded to a power of two).

    By default one query per program once its heads fill a 16-row matmul (the appends' [block_q,
    block_k] scan costs least there; docs/kernels/flash_topk.md), else 64 rows (QSA's 4 heads: 16
    queries).
    """
    heads = next_power_of_two(num_heads)
    if self.block_rows is None:
      return 1 if heads >= 16 else 64 // heads
    return max(1, self.block_rows // heads)


def _append(refs, mask, count, values, capacity):
  """Appends each row's selected entries of a [block_q, block_k] tile, in key order.

  Row r's entries go to slots count[r], count[r]+1, ... of its `capacity` slots in each flat
  [block_q * capacity] output ref; entries past the capacity are dropped (the caller's counts keep
  growing, so it can tell).
  """
  block_q = mask.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, mask.shape, 0)
  slot = count[:, None] + jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1
  keep = mask & (slot < capacity)
  # Masked-off lanes point past the block: Triton never touches them, and interpret mode (which
  # scatters every lane, masked ones with their old value) drops out-of-bounds writes instead of
  # letting them clobber a kept lane's slot.
  target = jnp.where(keep, row * capacity + slot, block_q * capacity)
  for ref, value in zip(refs, values):
    plgpu.store(ref.at[target], value, mask=keep)


def _append_tile(above, tied, k_pos, counts, cand_refs, cand_values, tie_ref, slots, tie_slots):
  """One key tile's share of the buffers: the keys above the threshold (with `cand_values` beside their
  indices) and those tied at it, appended in key order; returns the grown counts (n_above, n_tied).

  above, tied: bool[block_q, block_k]; k_pos: i32[block_k]; counts: i32[block_q] x 2.
  """
  n_gt, n_eq = counts
  n_above, n_tied = above.astype(jnp.int32).sum(axis=1), tied.astype(jnp.int32).sum(axis=1)
  k_pos_tile = jnp.broadcast_to(k_pos[None, :], above.shape)

  # Most tiles append nothing once the threshold is good: skip the scan and the scatter there.
  @pl.when(jnp.max(n_above) > 0)
  def _():
    _append(cand_refs, above, n_gt, (k_pos_tile, *cand_values), slots)

  @pl.when(jnp.max(jnp.where(n_eq < tie_slots, n_tied, 0)) > 0)
  def _():
    _append((tie_ref,), tied, n_eq, (k_pos_tile,), tie_slots)

  return n_gt + n_above, n_eq + n_tied


def _candidates_kernel(q_offset_ref, q_ref, k_ref, t_ref, *refs, block_q, heads, block_k, num_keys,
                       compress_ratio, scale, slots, tie_slots, has_weights, has_key_scale, has_segments,
                       precise, keys_as_rows):
  # Inputs: q_offset [1], q [block_q*H, D], k [Tk_pad, D], t [block_q], then weights [block_q*H, 1]
  # ([1, block_q*H] with keys_as_rows),
  # key_scale [Tk_pad] and (q_seg [block_q], kv_seg [Tk_pad], first keys [block_q]) when present.
  # Outputs: candidate indices and scores [block_q*slots], tie indices [block_q*tie_slots], and n_gt,
  # n_eq, n_visible [block_q].
  refs = list(refs)
  w_ref = refs.pop(0) if has_weights else None
  key_scale_ref = refs.pop(0) if has_key_scale else None
  q_seg_ref, kv_seg_ref, first_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if has_segments else (None,) * 3
  cand_idx_ref, cand_score_ref, tie_idx_ref, n_gt_ref, n_eq_ref, n_vis_ref = refs

  q_pos = q_offset_ref[0] + pl.program_id(1) * block_q + jax.lax.broadcasted_iota(
      jnp.int32, (block_q,), 0)
  q = q_ref[...]
  w = w_ref[...].astype(jnp.float32) if has_weights else None
  t = t_ref[...]
  q_seg = q_seg_ref[...] if has_segments else None
  keys_visible_to_last = keys_seen(jnp.max(q_pos), compress_ratio, num_keys)
  n_tiles = (keys_visible_to_last + block_k - 1) // block_k  # later tiles are all causal-masked
  # Tiles before the first query's causal edge are visible to the whole block: no causal mask there.
  n_unmasked = keys_seen(jnp.min(q_pos), compress_ratio, num_keys) // block_k
  # With segments, tiles before the first key sharing an id with one of the block's queries hold no key
  # it sees (packed documents: the earlier documents): skipped.
  first_tile = jnp.min(first_ref[...]) // block_k if has_segments else 0

  def step(j, counts, causal_mask):
    n_gt, n_eq, n_vis = counts
    k_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    k_tile = k_ref[pl.ds(j * block_k, block_k), :]
    lhs, rhs = (k_tile, q) if keys_as_rows else (q, k_tile)
    dots = jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_HIGHEST if precise else None)  # [block_k, block_q*H] with keys as rows
    relu = jnp.maximum(dots, 0.0)
    if has_weights:
      relu = relu * w
    if not keys_as_rows:
      score = relu.reshape(block_q, heads, block_k).sum(axis=1)
    elif block_q == 1:  # the GPU's default program: no 3-D reshape, no transpose
      score = relu.sum(axis=1)[None, :]
    else:
      score = relu.reshape(block_k, block_q, heads).sum(axis=2).T
    if has_key_scale:
      score = score * key_scale_ref[pl.ds(j * block_k, block_k)][None, :]
    else:
      score = score * scale
    score = rank_folded(score)
    above, tied = score > t[:, None], score == t[:, None]
    if causal_mask or has_segments:
      visible = jnp.full((block_q, block_k), True)
      if causal_mask:
        visible = key_visible(k_pos[None, :], q_pos[:, None], compress_ratio, num_keys)
      if has_segments:
        visible &= q_seg[:, None] == kv_seg_ref[pl.ds(j * block_k, block_k)][None, :]
        n_vis = n_vis + visible.astype(jnp.int32).sum(axis=1)
      above, tied = above & visible, tied & visible
    n_gt, n_eq = _append_tile(above, tied, k_pos, (n_gt, n_eq), (cand_idx_ref, cand_score_ref), (score,),
                              tie_idx_ref, slots, tie_slots)
    return n_gt, n_eq, n_vis

  zeros = jnp.zeros((block_q,), jnp.int32)
  counts = jax.lax.fori_loop(jnp.minimum(first_tile, n_unmasked), n_unmasked,
                             functools.partial(step, causal_mask=False), (zeros, zeros, zeros))
  n_gt, n_eq, n_vis = jax.lax.fori_loop(jnp.maximum(first_tile, n_unmasked), n_tiles,
                                        functools.partial(step, causal_mask=True), counts)
  if not has_segments:
    n_vis = keys_seen(q_pos, compress_ratio, num_keys)
  n_gt_ref[...] = n_gt
  n_eq_ref[...] = n_eq
  n_vis_ref[...] = n_vis


class Candidates(NamedTuple):
  """The main pass's output for queries [B, Tq]: buffers in key order, and exact counts.

  Entries past a row's count (or past the buffer) are unspecified.
  """

  indices: jax.Array  # i32[B, Tq, slots]: keys with score > t
  scores: jax.Array  # f32[B, Tq, slots]: their scores
  tie_indices: jax.Array  # i32[B, Tq, tie_slots]: the first keys with score == t
  n_above: jax.Array  # i32[B, Tq]: how many visible keys scored > t
  n_tied: jax.Array  # i32[B, Tq]: how many visible keys scored == t
  n_visible: jax.Array  # i32[B, Tq]: how many keys the row sees


def flash_topk_candidates(q, k, weights, threshold, *, q_offset, segment_ids, topk, compress_ratio,
                          scale, slots, config: Config, interpret: bool, key_scale=None,
                          debug: bool = False) -> Candidates:
  """Runs the main pass.

  Args:
    q: bf16|f32|float8_e4m3fn[B, Tq, H, D] queries, at absolute positions q_offset + t.
    k: bf16|f32|float8_e4m3fn[B, Tk, D] keys, same dtype as q.
    weights: bf16|f32[B, Tq, H] or None (all ones); for fp8, q's row scales already folded in.
    threshold: f32[B, Tq], the per-row t.
    q_offset: i32 scalar (may be traced).
    segment_ids: None or (q_seg int[B, Tq], kv_seg int[B, Tk]); a program starts at the key tile
      holding the first key that shares an id with one of its queries (`segment_first_keys`).
    topk: sizes the tie buffer (next power of two of min(topk, Tk)).
    compress_ratio, scale: as in `ops.flash_topk`.
    slots: strict-candidate slots per row (a power of two).
    config: block sizes and launch parameters.
    interpret: run in Pallas interpret mode (CPU).
    key_scale: f32[B, Tk] or None: each key's factor on its head sum, used instead of `scale`
      (the fp8 path: k's scale times `scale`).
    debug: print the Triton IR (Pallas's `debug`).

  Returns:
    `Candidates`.
  """
  B, Tq, H, D = q.shape
  Tk = k.shape[1]
  # Triton's dot wants K >= 16, and >= 32 for fp8 (one e4m3 WGMMA step); zero columns add nothing.
  heads, dim = next_power_of_two(H), max(16 if q.dtype.itemsize > 1 else 32, next_power_of_two(D))
  if weights is None and heads != H:
    weights = jnp.ones((B, Tq, H), jnp.float32)  # padded heads need weight 0
  block_q = config.block_q(H)
  block_k, keys_as_rows = config.resolved_block_k(H, q.dtype), config.resolved_keys_as_rows(H, q.dtype)
  Tq_pad = -(-Tq // block_q) * block_q
  Tk_pad = -(-Tk // block_k) * block_k
  tie_slots = next_power_of_two(min(topk, Tk))
  q = jnp.pad(q, ((0, 0), (0, Tq_pad - Tq), (0, heads - H), (0, dim - D)))
  k = jnp.pad(k, ((0, 0), (0, Tk_pad - Tk), (0, dim - D)))
  threshold = jnp.pad(threshold, ((0, 0), (0, Tq_pad - Tq)), constant_values=jnp.inf)
  operands = [jnp.asarray(q_offset, jnp.int32).reshape(1), q.reshape(B, Tq_pad * heads, dim), k,
              threshold]
  in_specs = [
      pl.BlockSpec((1,), lambda b, i: (0,)),
      pl.BlockSpec((None, block_q * heads, dim), lambda b, i: (b, i, 0)),
      pl.BlockSpec((None, Tk_pad, dim), lambda b, i: (b, 0, 0)),
      pl.BlockSpec((None, block_q), lambda b, i: (b, i)),
  ]
  if weights is not None:
    weights = jnp.pad(weights, ((0, 0), (0, Tq_pad - Tq), (0, heads - H)))
    if keys_as_rows:  # a row of weights, one per accumulator column
      operands.append(weights.reshape(B, 1, Tq_pad * heads))
      in_specs.append(pl.BlockSpec((None, 1, block_q * heads), lambda b, i: (b, 0, i)))
    else:
      operands.append(weights.reshape(B, Tq_pad * heads, 1))
      in_specs.append(pl.BlockSpec((None, block_q * heads, 1), lambda b, i: (b, i, 0)))
  if key_scale is not None:
    operands.append(jnp.pad(key_scale.astype(jnp.float32), ((0, 0), (0, Tk_pad - Tk))))
    in_specs.append(pl.BlockSpec((None, Tk_pad), lambda b, i: (b, 0)))
  if segment_ids is not None:
    q_seg, kv_seg = (s.astype(jnp.int32) for s in segment_ids)
    first = jax.vmap(segment_first_keys)(q_seg, kv_seg)  # padded rows never lower a block's first tile
    operands += [jnp.pad(q_seg, ((0, 0), (0, Tq_pad - Tq))), jnp.pad(kv_seg, ((0, 0), (0, Tk_pad - Tk))),
                 jnp.pad(first, ((0, 0), (0, Tq_pad - Tq)), constant_values=Tk_pad)]
    in_specs += [pl.BlockSpec((None, block_q), lambda b, i: (b, i)),
                 pl.BlockSpec((None, Tk_pad), lambda b, i: (b, 0)),
                 pl.BlockSpec((None, block_q), lambda b, i: (b, i))]
  per_row = lambda width: pl.BlockSpec((None, block_q * width), lambda b, i: (b, i))
  kernel = functools.partial(
      _candidates_kernel, block_q=block_q, heads=heads, block_k=block_k, num_keys=Tk,
      compress_ratio=compress_ratio, scale=float(scale), slots=slots, tie_slots=tie_slots,
      has_weights=weights is not None, has_key_scale=key_scale is not None,
      has_segments=segment_ids is not None,
      precise=q.dtype == jnp.float32, keys_as_rows=keys_as_rows)
  outs = pl.pallas_call(
      kernel,
      out_shape=(
          jax.ShapeDtypeStruct((B, Tq_pad * slots), jnp.int32),
          jax.ShapeDtypeStruct((B, Tq_pad * slots), jnp.float32),
          jax.ShapeDtypeStruct((B, Tq_pad * tie_slots), jnp.int32),
          *[jax.ShapeDtypeStruct((B, Tq_pad), jnp.int32)] * 3,
      ),
      grid=(B, Tq_pad // block_q),
      in_specs=in_specs,
      out_specs=(per_row(slots), per_row(slots), per_row(tie_slots), *[per_row(1)] * 3),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      debug=debug,
      name="hyscale_flash_topk_candidates",
  )(*operands)
  cand_idx, cand_score, tie_idx, n_gt, n_eq, n_vis = (o[:, : Tq * o.shape[1] // Tq_pad] for o in outs)
  return Candidates(cand_idx.reshape(B, Tq, slots), cand_score.reshape(B, Tq, slots),
                    tie_idx.reshape(B, Tq, tie_slots), n_gt, n_eq, n_vis)


def _mask_candidates_kernel(q_offset_ref, mask_ref, *refs, block_q, block_k, num_keys, compress_ratio, slots,
                            tie_slots, has_first_keys):
  # Inputs: q_offset [1], mask int8 [block_q, Tk_pad] (2 above, 1 tied, else 0 at visible keys; anything
  # at invisible ones), with first keys [block_q] (each row's bytes before its first key unwritten).
  # Outputs: candidate indices [block_q*slots], tie indices [block_q*tie_slots], n_above and n_tied [block_q].
  refs = list(refs)
  first = refs.pop(0)[...] if has_first_keys else None
  cand_idx_ref, tie_idx_ref, n_above_ref, n_tied_ref = refs
  q_pos = q_offset_ref[0] + pl.program_id(0) * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  n_tiles = (keys_seen(jnp.max(q_pos), compress_ratio, num_keys) + block_k - 1) // block_k
  first_tile = jnp.min(first) // block_k if has_first_keys else 0

  def step(j, counts):
    k_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    visible = key_visible(k_pos[None, :], q_pos[:, None], compress_ratio, num_keys)
    if has_first_keys:
      visible &= k_pos[None, :] >= first[:, None]
    tile = mask_ref[:, pl.ds(j * block_k, block_k)].astype(jnp.int32)
    return _append_tile((tile == 2) & visible, (tile == 1) & visible, k_pos, counts, (cand_idx_ref,), (),
                        tie_idx_ref, slots, tie_slots)

  zeros = jnp.zeros((block_q,), jnp.int32)
  n_above, n_tied = jax.lax.fori_loop(first_tile, n_tiles, step, (zeros, zeros))
  n_above_ref[...] = n_above
  n_tied_ref[...] = n_tied


def candidates_from_mask(mask, q_offset, *, num_keys: int, compress_ratio: int, slots: int, tie_slots: int,
                         first_keys=None, block_q: int = 16, block_k: int = 128, num_warps: int = 4,
                         interpret: bool = False):
  """The candidate buffers of a mask: each row's keys marked above, then tied, in key order.

  The compaction step of the Mosaic GPU main pass (`mgpu_scores.score_counts_mgpu(emit_mask=True)`
  marks, the kernel here lists): one program per `block_q` rows walks their keys in [block_q,
  block_k] int8 tiles up to the block's last row's causal edge, so it reads each visible mask byte
  once. A byte it reads past a row's own edge (unwritten by the scoring pass, whose CTAs stop at
  theirs) is masked by that row's visibility, never taken.

  Args:
    mask: int8[Tq, Tk_pad] with Tk_pad a multiple of block_k: at each visible key 2 (above the
      row's threshold), 1 (tied) or 0; ignored at invisible keys.
    q_offset: i32 scalar (may be traced): the position of row 0.
    num_keys: Tk, the keys that exist (the rest of each row is padding).
    compress_ratio: row t sees key s when (s+1) * compress_ratio <= q_offset + t + 1.
    slots, tie_slots: buffer widths (powers of two).
    first_keys: None, or i32[Tq]: row t's mask bytes before key first_keys[t] are unwritten (the
      scoring pass skipped keys no query of its block could see: other documents'); the program
      starts at its rows' first and never takes a byte before a row's own.
    block_q, block_k: rows per program and keys per step (powers of two).
    num_warps: Triton warps per program.
    interpret: Pallas interpret mode (CPU).

  Returns:
    (indices i32[Tq, slots], tie_indices i32[Tq, tie_slots], n_above i32[Tq], n_tied i32[Tq]): the
    first `slots` keys marked 2 and the first `tie_slots` marked 1, and how many there are; entries
    past a row's count are unspecified.
  """
  Tq, Tk_pad = mask.shape
  if mask.dtype != jnp.int8 or Tk_pad % block_k or Tk_pad < num_keys:
    raise ValueError(f"mask {mask.dtype}{list(mask.shape)} must be int8 [Tq, Tk_pad], Tk_pad >= {num_keys} keys "
                     f"and a multiple of {block_k=}.")
  Tq_pad = -(-Tq // block_q) * block_q
  if Tq_pad != Tq:  # a short chunk only: a copy of its mask rows
    mask = jnp.pad(mask, ((0, Tq_pad - Tq), (0, 0)))
  per_row = lambda width: pl.BlockSpec((block_q * width,), lambda i: (i,))
  extra_in, extra_specs = [], []
  if first_keys is not None:
    if first_keys.shape != (Tq,):
      raise ValueError(f"first_keys.shape={first_keys.shape} must be {(Tq,)}, the mask's rows.")
    extra_in = [jnp.pad(first_keys.astype(jnp.int32), (0, Tq_pad - Tq), constant_values=Tk_pad)]
    extra_specs = [per_row(1)]
  idx, tie_idx, n_above, n_tied = pl.pallas_call(
      functools.partial(_mask_candidates_kernel, block_q=block_q, block_k=block_k, num_keys=num_keys,
                        compress_ratio=compress_ratio, slots=slots, tie_slots=tie_slots,
                        has_first_keys=first_keys is not None),
      out_shape=(jax.ShapeDtypeStruct((Tq_pad * slots,), jnp.int32),
                 jax.ShapeDtypeStruct((Tq_pad * tie_slots,), jnp.int32),
                 *[jax.ShapeDtypeStruct((Tq_pad,), jnp.int32)] * 2),
      grid=(Tq_pad // block_q,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((block_q, Tk_pad), lambda i: (i, 0)), *extra_specs],
      out_specs=(per_row(slots), per_row(tie_slots), per_row(1), per_row(1)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="hyscale_flash_topk_mask_candidates",
  )(jnp.asarray(q_offset, jnp.int32).reshape(1), mask, *extra_in)
  return (idx.reshape(Tq_pad, slots)[:Tq], tie_idx.reshape(Tq_pad, tie_slots)[:Tq], n_above[:Tq], n_tied[:Tq])
