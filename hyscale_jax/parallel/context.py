"""Context parallelism with `jax.shard_map`: the sequence split over a mesh axis, ops run per shard.

Each device holds a shard of the queries. Keys are small next to the queries' work (the indexer's
D = 128 per token, MLA's one 576-wide row per token), so each op all-gathers them over the axis and
runs the single-device op on its query rows with the right absolute positions. Selections stay
local to the query's device and name global key positions; under autodiff the all-gather's
transpose reduce-scatters dk/dv back to the devices that own those keys.

Layouts of the sequence over the `n` devices of the axis:
- "contiguous": device i holds rows [i*T/n, (i+1)*T/n): causal work grows with i.
- "zigzag": the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i, so every
  device sees about the same number of visible (query, key) pairs (`causal_work`).
`to_layout` / `from_layout` move [B, T, ...] arrays between the natural order and a layout's order
(the order in which the sequence axis is split over the devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hyscale_jax import ops
from hyscale_jax.ops import _context

LAYOUTS = ("contiguous", "zigzag")


def _chunk_order(n: int, layout: str) -> list[int]:
  """The natural-order chunk held at each layout position (n chunks, or 2n for zigzag)."""
  if layout == "contiguous":
    return list(range(n))
  if layout == "zigzag":
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]
  raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")


def _check_divisible(T: int, n: int, layout: str):
  chunks = n if layout == "contiguous" else 2 * n
  if T % chunks:
    raise ValueError(f"sequence length {T} must be divisible by {chunks} for the {layout!r} layout "
                     f"over {n} devices.")


def to_layout(x, n: int, layout: str, axis: int = 1):
  """x in natural order -> x in `layout` order along `axis` (a static permutation of chunks)."""
  if layout == "contiguous":
    return x
  order = _chunk_order(n, layout)
  chunks = jnp.split(x, len(order), axis=axis)
  return jnp.concatenate([chunks[c] for c in order], axis=axis)


def from_layout(x, n: int, layout: str, axis: int = 1):
  """The inverse of `to_layout`."""
  if layout == "contiguous":
    return x
  order = _chunk_order(n, layout)
  chunks = jnp.split(x, len(order), axis=axis)
  natural = [None] * len(order)
  for position, c in enumerate(order):
    natural[c] = chunks[position]
  return jnp.concatenate(natural, axis=axis)


def causal_work(T: int, n: int, layout: str, compress_ratio: int = 1) -> np.ndarray:
  """Visible (query, key) pairs per device for a causal sequence of T queries: int64[n]."""
  _check_divisible(T, n, layout)
  visible = np.minimum(T // compress_ratio, (np.arange(T, dtype=np.int64) + 1) // compress_ratio)
  per_chunk = visible.reshape(len(_chunk_order(n, layout)), -1).sum(1)
  order = _chunk_order(n, layout)
  per_position = per_chunk[order]
  return per_position.reshape(n, -1).sum(1)


def context_parallel_flash_topk(q, k, weights=None, *, mesh, topk, layout: str = "contiguous",
                                compress_ratio: int = 1, segment_ids=None, scale: float = 1.0,
                                backend: str = "auto", q_scale=None, k_scale=None,
                                sorted: bool = True):  # noqa: A002 - the op's name
  """`ops.flash_topk` with the sequence split over `mesh`'s `context` axis; bit-identical results.

  With the contiguous layout this is what `ops.flash_topk` does by itself under
  `jax.set_mesh(mesh)`; this function takes the mesh explicitly and can be called inside `jax.jit`.

  Args:
    q, k, weights, segment_ids, q_scale, k_scale: as in `ops.flash_topk` (the scales with fp8 q and
      k), in `layout` order along the sequence (see `to_layout`); query positions and key indices
      are those of the natural order.
    mesh: a mesh with a `context` axis (and optionally `data`/`fsdp` for the batch).
    topk, compress_ratio, scale, backend, sorted: as in `ops.flash_topk`.
    layout: "contiguous" or "zigzag" (causally balanced).

  Returns:
    TopK(indices, scores) in `layout` order; indices are global key positions.
  """
  n = mesh.shape[_context.CONTEXT_AXIS]
  _check_divisible(q.shape[1], n, layout)
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)

  def per_shard(row_offset, local, full, replicated):
    del replicated
    (q, w, q_seg, q_sc), (k, kv_seg, k_sc) = local, full
    k, kv_seg, k_sc = (None if x is None else from_layout(x, n, layout) for x in (k, kv_seg, k_sc))
    parts = []
    for start, position, rows in _local_rows(q.shape[1], n, layout, row_offset):
      sl = lambda x: None if x is None else jax.lax.slice_in_dim(x, start, start + rows, axis=1)
      parts.append(ops.flash_topk(
          sl(q), k, sl(w), topk=topk, compress_ratio=compress_ratio, q_offset=position,
          segment_ids=None if q_seg is None else (sl(q_seg), kv_seg), scale=scale, q_scale=sl(q_sc),
          k_scale=k_sc, backend=backend, sorted=sorted))
    return tuple(jnp.concatenate(x, axis=1) for x in zip(*parts))

  return ops.TopK(*_context.run_sequence_sharded(
      per_shard, mesh, sharded=(q, weights, q_seg, q_scale), gathered=(k, kv_seg, k_scale), n_out=2))


def context_parallel_sparse_attention(q, k, v, indices, *, mesh, scale: float, sinks=None,
                                      layout: str = "contiguous", backend: str = "auto", deterministic: bool = False):
  """`ops.sparse_attention` with q, k, v and indices split over `mesh`'s `context` axis.

  All in `layout` order; `indices` name natural-order key positions. Each device all-gathers k
  and v, restores their natural order and attends its own queries; dk and dv are
  reduce-scattered back to their owners by the all-gather's transpose (`deterministic` as in
  `ops.sparse_attention`: each device's sums are bit-identical; the reduce-scatter adds in the
  collective's order).

  Returns:
    (out [B, T, H, Dv], lse f32[B, T, H]) in `layout` order.
  """
  n = mesh.shape[_context.CONTEXT_AXIS]
  _check_divisible(q.shape[1], n, layout)

  def per_shard(row_offset, local, full, replicated):
    del row_offset
    (q, indices), (k, v), (sinks,) = local, full, replicated
    return ops.sparse_attention(q, from_layout(k, n, layout), from_layout(v, n, layout), indices,
                                scale=scale, sinks=sinks, backend=backend, deterministic=deterministic)

  return _context.run_sequence_sharded(per_shard, mesh, sharded=(q, indices), gathered=(k, v),
                                       replicated=(sinks,), n_out=2)


def _local_rows(T_local: int, n: int, layout: str, row_offset):
  """[(local row start, absolute position, rows)] of this device's chunks of the sequence."""
  if layout == "contiguous":
    return [(0, row_offset, T_local)]
  i = jax.lax.axis_index(_context.CONTEXT_AXIS)
  half = T_local // 2
  return [(0, i * half, half), (half, (2 * n - 1 - i) * half, half)]
