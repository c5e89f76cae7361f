"""What the FlashTopK scoring passes (Triton `flash_topk`, Mosaic GPU `mgpu_scores`) share: which keys a
query sees and how a kernel's scores rank."""

from __future__ import annotations

import jax.numpy as jnp


def keys_seen(position, compress_ratio: int, num_keys: int):
  """How many keys a query at `position` sees: key s is visible iff (s+1) * compress_ratio <= position + 1."""
  return jnp.clip((position + 1) // compress_ratio, 0, num_keys)


def key_visible(key, position, compress_ratio: int, num_keys: int):
  """Whether the query at `position` sees `key` (broadcasting), keys past `num_keys` never."""
  return ((key + 1) * compress_ratio <= position + 1) & (key < num_keys)


def rank_folded(score):
  """A kernel's f32 scores as the reference ranks them: -0 joins the zero plateau's tie class (+0), and
  NaN ranks lowest (-inf)."""
  score = jnp.where(score == 0.0, 0.0, score)
  return jnp.where(jnp.isnan(score), -jnp.inf, score)


def segment_first_keys(q_seg, kv_seg):
  """i32[Tq]: for each query, the first key whose segment id equals its own (Tk where none does).

  Keys before it can be visible to no query of that segment, whatever the ids' layout (a document's
  id may come back later): a scorer may skip them. One stable sort of kv_seg [Tk] and a search.
  """
  Tk = kv_seg.shape[0]
  order = jnp.argsort(kv_seg, stable=True)  # equal ids keep key order: the first is the smallest index
  ids = kv_seg[order]
  at = jnp.searchsorted(ids, q_seg, side="left", method="scan_unrolled")  # unrolled: no while loop on the GPU
  clipped = jnp.minimum(at, Tk - 1)
  found = (at < Tk) & (ids[clipped] == q_seg)
  return jnp.where(found, order[clipped], Tk).astype(jnp.int32)
