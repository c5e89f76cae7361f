"""Causal visibility and key-chunk streaming shared by the reference ops (no [Tq, Tk] tables)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """Pads `x` along `axis` up to `size` with `value`."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def to_blocks(x: jax.Array, axis: int, block: int, value=0) -> jax.Array:
  """[..., N, ...] -> [n_blocks, ..., block, ...]: pads `axis` to a multiple of `block` and splits it."""
  n = cdiv(x.shape[axis], block)
  x = pad_axis(x, axis, n * block, value)
  x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def from_blocks(x: jax.Array, axis: int, length: int) -> jax.Array:
  """Inverse of `to_blocks`: [n_blocks, ..., block, ...] -> [..., length, ...]."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def key_visible(q_pos, k_pos, compress_ratio: int, q_seg=None, kv_seg=None) -> jax.Array:
  """Whether key `s` is visible to query position `p`: (s + 1) * compress_ratio <= p + 1.

  Args:
    q_pos: i32[Tq] absolute query positions (q_offset + t).
    k_pos: i32[Tk] key indices.
    compress_ratio: tokens per key (1 for token keys; m for compressed blocks).
    q_seg: optional int[B, Tq] segment ids of the queries.
    kv_seg: optional int[B, Tk] segment ids of the keys; equal ids are required when given.

  Returns:
    bool[1 or B, Tq, Tk].
  """
  vis = ((k_pos[None, :] + 1) * compress_ratio <= q_pos[:, None] + 1)[None]
  if q_seg is not None:
    vis = vis & (q_seg[:, :, None] == kv_seg[:, None, :])
  return vis


def visible_key_chunks(last_q_pos, compress_ratio: int, chunk: int, n_chunks: int) -> jax.Array:
  """How many leading key chunks hold a key visible to some query at position <= `last_q_pos`.

  Chunks past this count are entirely masked for the query block and are skipped, not computed.
  """
  keys = (last_q_pos + 1) // compress_ratio  # keys 0 .. keys-1 are visible to the last query
  return jnp.clip((keys + chunk - 1) // chunk, 0, n_chunks)


def row_chunks(chunk: int, length: int):
  """(split, join) for the query axis 1: [B, T, ...] <-> [n, B, chunk, ...]; None passes through."""
  chunk = min(chunk, length)
  split = lambda x, fill=0: None if x is None else to_blocks(x, 1, chunk, fill)
  join = lambda x: None if x is None else from_blocks(x, 1, length)
  return split, join


def fresh_zeros(shape, dtype, after: jax.Array) -> jax.Array:
  """Zeros of `shape` for a loop to write into, that XLA can neither share nor make before `after`.

  XLA merges the constant zero broadcasts of a program into one and copies each loop's buffer out
  of it wherever it schedules the copy: at the start of the step, in practice, so every loop's
  [T, D] output is live from then on. A zero read through an optimization barrier tied to `after`
  (an input of the loop) is neither merged nor made early.
  """
  zero, _ = jax.lax.optimization_barrier((jnp.zeros((), dtype), after))
  return jnp.broadcast_to(zero, shape)


def summed_in_f32(tree):
  """A thunk giving `tree` back, for a row-chunk loop to call inside each chunk.

  Every chunk adds to the gradient of what the loop closes over. The thunk closes over f32 copies
  and casts them back to the original dtypes (exact), so those parts are summed in f32 rather than
  in a bf16 carry; `None` leaves pass through.
  """
  dtypes = jax.tree.map(lambda a: a.dtype, tree)
  wide = jax.tree.map(lambda a: a.astype(jnp.float32), tree)
  return lambda: jax.tree.map(lambda a, dtype: a.astype(dtype), wide, dtypes)
