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
from jax.sharding import PartitionSpec as P

from hyscale_jax import ops

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


def _local_offsets(T_local: int, n: int, layout: str, axis: str):
  """[(row start within the local shard, absolute position of that row, rows)] for this device."""
  i = jax.lax.axis_index(axis)
  if layout == "contiguous":
    return [(0, i * T_local, T_local)]
  half = T_local // 2
  return [(0, i * half, half), (half, (2 * n - 1 - i) * half, half)]


def context_parallel_flash_topk(q, k, weights=None, *, mesh, topk, axis: str = "context",
                                batch_axis: str | None = None, layout: str = "contiguous",
                                compress_ratio: int = 1, segment_ids=None, scale: float = 1.0,
                                backend: str = "auto"):
  """`ops.flash_topk` with q (and k) split over `axis`; bit-identical to the single-device call.

  Args:
    q, k, weights, segment_ids: as in `ops.flash_topk`, in `layout` order along the sequence
      (see `to_layout`); query positions and key indices are those of the natural order.
    mesh: a mesh with `axis` (and `batch_axis`, when given, for the batch dimension).
    topk, compress_ratio, scale, backend: as in `ops.flash_topk`.
    layout: "contiguous" or "zigzag" (see the module docstring).

  Returns:
    TopK(indices, scores) in `layout` order, sharded like q; indices are global key positions.
  """
  n = mesh.shape[axis]
  T = q.shape[1]
  _check_divisible(T, n, layout)
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  spec = P(batch_axis, axis)

  def per_device(q, k, w, q_seg, kv_seg):
    k = from_layout(jax.lax.all_gather(k, axis, axis=1, tiled=True), n, layout)
    if kv_seg is not None:
      kv_seg = from_layout(jax.lax.all_gather(kv_seg, axis, axis=1, tiled=True), n, layout)
    parts = []
    for start, position, rows in _local_offsets(q.shape[1], n, layout, axis):
      sl = lambda x: None if x is None else jax.lax.slice_in_dim(x, start, start + rows, axis=1)
      parts.append(ops.flash_topk(
          sl(q), k, sl(w), topk=topk, compress_ratio=compress_ratio, q_offset=position,
          segment_ids=None if q_seg is None else (sl(q_seg), kv_seg), scale=scale, backend=backend))
    return tuple(jnp.concatenate(x, axis=1) for x in zip(*parts))

  none_or = lambda x: None if x is None else spec
  fn = jax.shard_map(per_device, mesh=mesh, out_specs=(spec, spec), check_vma=False,
                     in_specs=(spec, spec, none_or(weights), none_or(q_seg), none_or(kv_seg)))
  return ops.TopK(*fn(q, k, weights, q_seg, kv_seg))


def context_parallel_sparse_attention(q, k, v, indices, *, mesh, scale: float, sinks=None,
                                      axis: str = "context", batch_axis: str | None = None,
                                      layout: str = "contiguous", backend: str = "auto"):
  """`ops.sparse_attention` with q, k, v and indices split over `axis` (all in `layout` order).

  Each device all-gathers k and v (MQA: one row per token), restores the natural key order that
  `indices` name, and attends its own queries. Differentiable: dk and dv are reduce-scattered back
  to their owners by the all-gather's transpose.

  Returns:
    (out [B, T, H, Dv], lse f32[B, T, H]) in `layout` order, sharded like q.
  """
  n = mesh.shape[axis]
  _check_divisible(q.shape[1], n, layout)
  spec = P(batch_axis, axis)

  def per_device(q, k, v, indices, sinks):
    gather = lambda x: from_layout(jax.lax.all_gather(x, axis, axis=1, tiled=True), n, layout)
    return ops.sparse_attention(q, gather(k), gather(v), indices, scale=scale, sinks=sinks,
                                backend=backend)

  fn = jax.shard_map(per_device, mesh=mesh, out_specs=(spec, spec), check_vma=False,
                     in_specs=(spec, spec, spec, spec, None if sinks is None else P()))
  return fn(q, k, v, indices, sinks)
