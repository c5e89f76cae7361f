"""Pure-jnp reference for `sparse_attention`: gathered keys, chunked over T, custom_vjp keeping lse."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _streaming as st
from hyscale_jax.ops.sparse_attention.vjp import attention_with_saved_residuals

_HIGHEST = jax.lax.Precision.HIGHEST


def gather_rows(x: Float[Array, "B S ..."], indices: Int[Array, "B T K"]) -> Float[Array, "B T K ..."]:
  """x[b, indices[b, t, j]] with invalid indices (outside [0, S)) clamped; mask them separately."""
  safe = jnp.clip(indices, 0, x.shape[1] - 1)
  return jax.vmap(lambda xb, ib: xb[ib])(x, safe)


def valid_indices(indices: Int[Array, "B T K"], num_keys: int) -> jax.Array:
  """bool[B, T, K]: entries that point at a key (-1 and out-of-range entries are skipped)."""
  return (indices >= 0) & (indices < num_keys)


def attention_logits_at(
    q: Float[Array, "B T H Dk"],
    k: Float[Array, "B S G Dk"],
    indices: Int[Array, "B T K"],
    scale: float,
) -> Float[Array, "B T H K"]:
  """f32 `scale * <q[b,t,h], k[b, indices[b,t,j], h // (H // G)]>`, -inf at invalid entries."""
  B, T, H, Dk = q.shape
  G = k.shape[2]
  k_sel = gather_rows(k, indices)  # [B, T, K, G, Dk]
  qg = q.reshape(B, T, G, H // G, Dk)
  logits = jnp.einsum(
      "btgnd,btjgd->btgnj", qg, k_sel, preferred_element_type=jnp.float32, precision=_HIGHEST
  )
  logits = logits.reshape(B, T, H, -1) * jnp.float32(scale)
  return jnp.where(valid_indices(indices, k.shape[1])[:, :, None, :], logits, -jnp.inf)


def probs_from_lse(logits, lse):
  """exp(logits - lse), 0 where the row is empty (lse = -inf) rather than NaN."""
  return jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])


def _chunk_forward(q, k, v, indices, sinks, scale):
  B, T, H, _ = q.shape
  G, Dv = v.shape[2], v.shape[3]
  logits = attention_logits_at(q, k, indices, scale)
  # Normalise by the max-shifted row sum rather than exp(logit - lse): exact to f32 rounding even
  # when |lse| is large (exp(logit - lse) loses |lse| * 2^-24 of relative mass).
  top = jnp.max(logits, axis=-1)
  if sinks is not None:
    top = jnp.maximum(top, sinks.astype(jnp.float32))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp(logits - top[..., None])
  total = weights.sum(axis=-1)
  if sinks is not None:
    total = total + jnp.exp(sinks.astype(jnp.float32) - top)
  p = (weights / jnp.where(total > 0, total, 1.0)[..., None]).reshape(B, T, G, H // G, -1)
  lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  out = jnp.einsum(
      "btgnj,btjgd->btgnd", p, gather_rows(v, indices).astype(jnp.float32), precision=_HIGHEST
  )
  return out.reshape(B, T, H, Dv), lse


def sparse_attention_forward_reference(q, k, v, indices, *, scale, sinks=None, query_chunk=None):
  """The forward pass alone: (out in q.dtype [B, T, H, Dv], lse f32[B, T, H]), chunked over T."""
  query_chunk = query_chunk or default_query_chunk(q, k, v, indices)
  split, join = st.row_chunks(query_chunk, q.shape[1])
  out, lse = jax.lax.map(
      lambda xs: _chunk_forward(xs[0], k, v, xs[1], sinks, scale), (split(q), split(indices, -1))
  )
  return join(out).astype(q.dtype), join(lse)


def add_rows_by_key(acc: Float[Array, "S ..."], keys: Int[Array, "N"], rows: Float[Array, "N ..."]):
  """`acc[keys[n]] += rows[n]` without a scatter-add (keys outside [0, S) are dropped), bit-identical run to run.

  XLA's scatter-add on the GPU adds colliding rows atomically, in a varying order. Here the rows are
  sorted by key (stable), summed within each key's run by a segmented `associative_scan` (elementwise
  adds in an order fixed by the positions), and each key's total is gathered back: a sort, adds and
  gathers, each deterministic on every backend.
  """
  S = acc.shape[0]
  keys = jnp.where((keys >= 0) & (keys < S), keys, S)  # S sorts last and is never read back
  order = jnp.argsort(keys, stable=True)
  keys, rows = keys[order], rows[order]

  def segmented_add(a, b):  # associative on sorted keys: a run's sum never crosses into the next key
    (a_rows, a_keys), (b_rows, b_keys) = a, b
    same = (a_keys == b_keys).reshape(a_keys.shape + (1,) * (a_rows.ndim - 1))
    return jnp.where(same, a_rows + b_rows, b_rows), b_keys

  running, _ = jax.lax.associative_scan(segmented_add, (rows, keys))
  ends = jnp.searchsorted(keys, jnp.arange(S), side="right")  # one past each key's last row
  starts = jnp.searchsorted(keys, jnp.arange(S), side="left")
  totals = jnp.where((ends > starts).reshape((S,) + (1,) * (rows.ndim - 1)), running[jnp.maximum(ends - 1, 0)], 0.0)
  return acc + totals


def sparse_attention_backward_reference(residuals, cotangents, *, scale, query_chunk=None, deterministic=False):
  """Gradients (dq, dk, dv, dsinks) from the saved (q, k, v, indices, sinks, out, lse).

  Probabilities are recomputed from the saved `lse`; dk/dv are scatter-added at the gathered
  positions (one add per occurrence, so duplicates count once each). XLA:CPU's scatter-add is
  sequential, but on the GPU colliding rows are added atomically; `deterministic=True` sums them
  with `add_rows_by_key` instead (a sort and a segmented scan: more memory and time, the same bits
  every run). The rest (gathers, einsums, reductions) is deterministic for a given compiled program.
  """
  q, k, v, indices, sinks, out, lse = residuals
  dout, dlse = cotangents
  B, T, H, Dk = q.shape
  S, G, Dv = k.shape[1], k.shape[2], v.shape[3]
  query_chunk = query_chunk or default_query_chunk(q, k, v, indices)
  split, join = st.row_chunks(query_chunk, T)

  def chunk_grads(acc, xs):
    dk_acc, dv_acc, dsink_acc = acc
    q_c, idx_c, out_c, lse_c, dout_c, dlse_c = xs
    tc = q_c.shape[1]
    logits = attention_logits_at(q_c, k, idx_c, scale)
    p = probs_from_lse(logits, lse_c)  # [B, tc, H, K]
    dout_f = dout_c.astype(jnp.float32)
    delta = jnp.sum(dout_f * out_c.astype(jnp.float32), axis=-1)  # [B, tc, H]
    k_sel = gather_rows(k, idx_c).astype(jnp.float32)  # [B, tc, K, G, Dk]
    v_sel = gather_rows(v, idx_c).astype(jnp.float32)  # [B, tc, K, G, Dv]
    dout_g = dout_f.reshape(B, tc, G, H // G, Dv)
    dp = jnp.einsum("btgnd,btjgd->btgnj", dout_g, v_sel, precision=_HIGHEST).reshape(p.shape)
    ds = p * (dp - delta[..., None] + dlse_c[..., None])
    ds_g = ds.reshape(B, tc, G, H // G, -1)
    p_g = p.reshape(ds_g.shape)
    q_g = q_c.astype(jnp.float32).reshape(B, tc, G, H // G, Dk)
    dq = scale * jnp.einsum("btgnj,btjgd->btgnd", ds_g, k_sel, precision=_HIGHEST)
    dk_sel = scale * jnp.einsum("btgnj,btgnd->btjgd", ds_g, q_g, precision=_HIGHEST)
    dv_sel = jnp.einsum("btgnj,btgnd->btjgd", p_g, dout_g, precision=_HIGHEST)
    target = jnp.where(valid_indices(idx_c, S), idx_c, S).reshape(B, -1)  # S = dropped
    if deterministic:
      scatter = jax.vmap(add_rows_by_key)
    else:
      scatter = jax.vmap(lambda acc_b, i_b, x_b: acc_b.at[i_b].add(x_b, mode="drop"))
    dk_acc = scatter(dk_acc, target, dk_sel.reshape(B, -1, G, Dk))
    dv_acc = scatter(dv_acc, target, dv_sel.reshape(B, -1, G, Dv))
    if sinks is not None:
      p_sink = jnp.exp(sinks.astype(jnp.float32) - lse_c)  # [B, tc, H]; lse is finite with sinks
      dsink_acc = dsink_acc + jnp.sum(p_sink * (dlse_c - delta), axis=(0, 1))
    return (dk_acc, dv_acc, dsink_acc), dq.reshape(B, tc, H, Dk)

  init = (
      jnp.zeros((B, S, G, Dk), jnp.float32),
      jnp.zeros((B, S, G, Dv), jnp.float32),
      jnp.zeros((H,), jnp.float32),
  )
  xs = (split(q), split(indices, -1), split(out), split(lse), split(dout), split(dlse))
  (dk, dv, dsinks), dq = jax.lax.scan(chunk_grads, init, xs)
  dsinks = None if sinks is None else dsinks.astype(sinks.dtype)
  return join(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks


def default_query_chunk(q, k, v, indices) -> int:
  """Largest power-of-two query chunk whose gathered tiles stay within about 256 MiB of f32."""
  B, T, H, Dk = q.shape
  G, Dv, K = k.shape[2], v.shape[3], indices.shape[2]
  per_row = B * (K * G * (Dk + Dv) + 3 * H * K)
  chunk = max(1, (1 << 26) // max(per_row, 1))
  return min(T, 1 << (chunk.bit_length() - 1))


def sparse_attention_reference(
    q: Float[Array, "B T H Dk"],
    k: Float[Array, "B S G Dk"],
    v: Float[Array, "B S G Dv"] | None,
    indices: Int[Array, "B T K"],
    *,
    scale: float,
    sinks: Float[Array, "H"] | None = None,
    value_dim: int | None = None,
    query_chunk: int | None = None,
    deterministic: bool = False,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B T H"]]:
  """Softmax attention of each query over its listed keys, `query_chunk` queries at a time.

  `v=None` takes the values as `k[..., :value_dim]`; the slice is differentiated by JAX.

  Memory is O(query_chunk * K * G * (Dk + Dv)) for the gathered tiles, never O(T * K * D). The
  custom_vjp keeps (indices, out, lse) as residuals (`attention_with_saved_residuals`).
  `deterministic` makes the backward's dk/dv sums bit-identical run to run on the GPU too
  (`sparse_attention_backward_reference`).

  Returns:
    (out in q.dtype [B, T, H, Dv], lse f32[B, T, H]).
  """
  if v is None:
    v = k[..., : k.shape[-1] if value_dim is None else value_dim]
  return attention_with_saved_residuals(
      functools.partial(sparse_attention_forward_reference, query_chunk=query_chunk),
      functools.partial(sparse_attention_backward_reference, query_chunk=query_chunk),
      q, k, v, indices.astype(jnp.int32), scale=float(scale), sinks=sinks, deterministic=deterministic,
  )
