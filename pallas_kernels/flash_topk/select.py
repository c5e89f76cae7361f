"""The exact top-k of each row's candidate buffer, in slot order: a bitwise search for the k-th score.

FlashTopK's main pass leaves each row a buffer of (key, score) candidates, in key order, about twice
`topk` of them in `slots` (4 x topk) places. `lax.top_k` over that buffer sorts all `slots` entries
per row (a fifth of the whole op at 64K keys when it was the finish: docs/kernels/flash_topk.md). This kernel finds
each row's k-th largest score instead, with no sort: scores map to unsigned integers in the same
order, and passes over the row (held in registers) build the k-th one's bits from the top down,
each keeping a bit if at least `topk` entries are >= the prefix with it set (at most 32 passes;
`_kth_key` says how it skips most of them). It then writes the entries above the k-th score and
the first of those equal to it, `topk` at most, in slot order, so only the `topk` winners are left
to sort (`lax.sort` in XLA).

Ties: among entries equal to the k-th score the lower slots win, which is `lax.top_k`'s rule.
Scores are f32 and never NaN here (the main pass ranks NaN as -inf); -0 has been folded to +0.
Everything is plain Pallas with BlockSpecs, so `interpret=True` runs it on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shapes import next_power_of_two


def ordered_bits(scores: jax.Array) -> jax.Array:
  """u32 keys in the order of the f32 `scores`: a > b iff key(a) > key(b) (for non-NaN, +0 == -0 aside)."""
  bits = jax.lax.bitcast_convert_type(scores, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def from_ordered_bits(keys: jax.Array) -> jax.Array:
  """The f32 scores of `ordered_bits` keys (its inverse)."""
  positive = (keys >> 31) == 1
  return jax.lax.bitcast_convert_type(jnp.where(positive, keys & jnp.uint32(0x7FFFFFFF), ~keys), jnp.float32)


def _kth_key(key, valid, topk):
  """u32[rows]: each row's topk-th largest valid key, or 0 when fewer than topk are valid (take all).

  A bitwise search from the top: bit b is kept when at least topk keys are >= the prefix with it
  set. Two things skip most of the 32 passes a plain search makes:
  - it starts below the bits every valid key shares (the candidates sit above one threshold, so
    sign and most exponent bits agree), which max ^ min gives;
  - it stops once exactly topk keys are >= the prefix: the k-th largest is then their minimum.
  A row that never stops early ends on the k-th largest key itself, which is also the minimum of
  the keys >= it, so one reduction after the loop serves both ends.
  """
  n_valid = jnp.sum(valid.astype(jnp.int32), axis=1)
  largest = jnp.max(key, axis=1)
  smallest = jnp.min(jnp.where(valid, key, jnp.uint32(0xFFFFFFFF)), axis=1)
  differ = largest ^ smallest  # 0 when every valid key is the same
  top = 31 - jax.lax.clz(jax.lax.bitcast_convert_type(differ, jnp.int32))  # highest differing bit, or -1
  below_top = jnp.where(top >= 0, (jnp.left_shift(jnp.uint32(1), jnp.maximum(top, 0).astype(jnp.uint32)) << 1)
                        - jnp.uint32(1), jnp.uint32(0))  # top = 31 wraps to all ones, as it should
  kth = largest & ~below_top
  done = (n_valid < topk) | (top < 0)

  def searching(state):
    bit, _, done = state
    return (bit >= 0) & (jnp.min(done.astype(jnp.int32)) == 0)

  def narrow(state):
    bit, kth, done = state
    trial = kth | jnp.left_shift(jnp.uint32(1), bit.astype(jnp.uint32))
    count = jnp.sum((key >= trial[:, None]).astype(jnp.int32), axis=1)
    keep = ~done & (bit <= top) & (count >= topk)
    return bit - 1, jnp.where(keep, trial, kth), done | (keep & (count == topk))

  _, kth, _ = jax.lax.while_loop(searching, narrow, (jnp.max(top), kth, done))
  kth = jnp.min(jnp.where(valid & (key >= kth[:, None]), key, jnp.uint32(0xFFFFFFFF)), axis=1)
  return jnp.where(n_valid >= topk, kth, jnp.uint32(0))


def _select_kernel(n_ref, score_ref, index_ref, out_score_ref, out_index_ref, n_out_ref, *, rows, slots, topk,
                   width):
  # `rows` rows: n_ref [rows] valid entries; score_ref / index_ref [rows, slots]; outputs [rows * width]
  # (width >= topk places per row, flat so one scatter serves every row) and n_out [rows].
  score = score_ref[...]
  valid = jax.lax.broadcasted_iota(jnp.int32, (rows, slots), 1) < n_ref[...][:, None]
  # Valid entries have keys >= 1 (the all-ones pattern is a NaN), so 0 marks the empty slots.
  key = jnp.where(valid, ordered_bits(score), jnp.uint32(0))
  kth = _kth_key(key, valid, topk)
  above = key > kth[:, None]
  tied = valid & (key == kth[:, None])
  room = topk - jnp.sum(above.astype(jnp.int32), axis=1)
  take = above | (tied & (jnp.cumsum(tied.astype(jnp.int32), axis=1) <= room[:, None]))
  slot = jnp.cumsum(take.astype(jnp.int32), axis=1) - 1
  # Lanes not taken point past the block: Triton skips them under the mask, and interpret mode (which
  # writes every lane, masked ones with the old value) drops out-of-bounds writes.
  row = jax.lax.broadcasted_iota(jnp.int32, (rows, slots), 0)
  target = jnp.where(take, row * width + slot, rows * width)
  plgpu.store(out_score_ref.at[target], score, mask=take)
  plgpu.store(out_index_ref.at[target], index_ref[...], mask=take)
  n_out_ref[...] = jnp.sum(take.astype(jnp.int32), axis=1)


def select_candidates(scores: jax.Array, indices: jax.Array, n_valid: jax.Array, topk: int, *,
                      rows_per_program: int = 1, num_warps: int = 8,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each row's `topk` best valid entries, in slot order.

  Args:
    scores: f32[R, S] candidate scores (S a power of two, S > topk); entries at or past a row's
      `n_valid` are ignored.
    indices: i32[R, S] what each entry stands for (the key index).
    n_valid: i32[R] valid entries per row (clipped to S).
    topk: how many to keep.
    rows_per_program: rows each program searches together (a power of two; more rows share each
      pass's reduction latency, at more registers per thread).
    num_warps: Triton warps per program (8: a row's 8192 scores and keys in registers).
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    (scores f32[R, topk], indices i32[R, topk], n i32[R]): the winners in slot order in the first
    n = min(topk, n_valid) places; the places past n are unspecified (the caller masks them).
  """
  R, S = scores.shape
  if S & (S - 1) or S <= topk:
    raise ValueError(f"select_candidates: the buffer width S={S} must be a power of two above topk={topk}.")
  rows = rows_per_program
  if rows < 1 or rows & (rows - 1):
    raise ValueError(f"select_candidates: rows_per_program={rows} must be a power of two.")
  width = next_power_of_two(topk)  # Triton blocks are powers of two; the places past topk stay unwritten
  R_pad = -(-R // rows) * rows
  pad = lambda x: jnp.pad(x, ((0, R_pad - R),) + ((0, 0),) * (x.ndim - 1))
  out_score, out_index, n_out = pl.pallas_call(
      functools.partial(_select_kernel, rows=rows, slots=S, topk=topk, width=width),
      out_shape=(jax.ShapeDtypeStruct((R_pad * width,), jnp.float32),
                 jax.ShapeDtypeStruct((R_pad * width,), jnp.int32), jax.ShapeDtypeStruct((R_pad,), jnp.int32)),
      grid=(R_pad // rows,),
      in_specs=[pl.BlockSpec((rows,), lambda r: (r,)), pl.BlockSpec((rows, S), lambda r: (r, 0)),
                pl.BlockSpec((rows, S), lambda r: (r, 0))],
      out_specs=(pl.BlockSpec((rows * width,), lambda r: (r,)), pl.BlockSpec((rows * width,), lambda r: (r,)),
                 pl.BlockSpec((rows,), lambda r: (r,))),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="hyscale_flash_topk_select",
  )(pad(jnp.minimum(n_valid, S).astype(jnp.int32)), pad(scores), pad(indices))
  unflat = lambda x: x.reshape(R_pad, width)[:R, :topk]
  return unflat(out_score), unflat(out_index), n_out[:R]
