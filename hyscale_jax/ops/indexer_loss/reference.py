"""Pure-jnp reference for `indexer_loss`: the DSA KL distillation, sparse and dense (streamed) forms.

Both forms use a custom_vjp with the closed-form logit gradient `softmax(I) - p`; the backward
recomputes the indexer logits tile by tile and backpropagates them to q, k and weights. The teacher
is a constant: no gradient reaches the attention inputs. Each form returns (loss, rows counted), so
that context parallelism can weight the shards' means into the global one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax import remat
from hyscale_jax.ops import _streaming as st
from hyscale_jax.ops.flash_topk.reference import index_scores, index_scores_at
from hyscale_jax.ops.sparse_attention.reference import (
    attention_logits_at,
    probs_from_lse,
    valid_indices,
)

_HIGHEST = jax.lax.Precision.HIGHEST


class SparseKernels(NamedTuple):
  """What the sparse form computes with (a static argument of its custom_vjp).

  teacher_mass: `(attn_q, attn_k, attn_lse, indices, *, scale) -> f32[B, t, K]`, the teacher.
  pool: "sum" or "max", how QSA pools the teacher over each index key's attention keys.
  scores_at: `(index_q, index_k, index_weights, indices, index_scale) -> f32[B, t, K]`, the student's
    scores at the selected keys; differentiable in the first three.
  """

  teacher_mass: Callable
  pool: str
  scores_at: Callable


def _row_mean(row_kl, row_valid):
  n_valid = jnp.sum(row_valid)
  return jnp.sum(jnp.where(row_valid, row_kl, 0.0)) / jnp.maximum(n_valid, 1), n_valid


# ------------------------------------------------------------------------------------------------
# Sparse form: the support of row t is its listed indices.


def teacher_mass_reference(
    attn_q: Float[Array, "B T H Dk"],
    attn_k: Float[Array, "B S G Dk"],
    attn_lse: Float[Array, "B T H"],
    indices: Int[Array, "B T K"],
    *,
    scale: float,
) -> Float[Array, "B T K"]:
  """f32 `sum_h exp(scale <attn_q[t,h], attn_k[indices[t,j], g(h)]> - attn_lse[t,h])`, 0 where invalid."""
  return probs_from_lse(attention_logits_at(attn_q, attn_k, indices, scale), attn_lse).sum(axis=2)


def _teacher_at(kernels, attn_q, attn_k, attn_lse, indices, key_tokens, valid, scale):
  """f32[B, t, K] teacher mass at each selected index key, by `kernels.teacher_mass` and `kernels.pool`.

  Without `key_tokens` an index key is an attention key (`teacher_mass` gives 0 at invalid
  indices). With them (QSA), index key j stands for the attention keys key_tokens[..., j, :], and
  its mass is the pool (sum or max) of theirs, 0 where index key j itself is invalid (`valid`).
  """
  teacher_mass, pool = kernels.teacher_mass, kernels.pool
  if key_tokens is None:
    return teacher_mass(attn_q, attn_k, attn_lse, indices, scale=scale)
  B, t, K, P = key_tokens.shape
  per_key = teacher_mass(attn_q, attn_k, attn_lse, key_tokens.reshape(B, t, K * P), scale=scale)
  per_key = per_key.reshape(B, t, K, P)
  pooled = per_key.max(axis=-1) if pool == "max" else per_key.sum(axis=-1)
  return jnp.where(valid, pooled, 0.0)


def _sparse_chunk(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens, scales, kernels,
                  scores=None):
  """Student log-probs, teacher probs and row validity for a chunk of rows: [B, t, K] x2, [B, t].

  `scores`: the indexer scores at `indices` when the caller has them (from its `jax.vjp`).
  """
  index_scale, attn_scale = scales
  valid = valid_indices(indices, index_k.shape[1])
  if scores is None:
    scores = kernels.scores_at(index_q, index_k, index_weights, indices, index_scale)
  logits = jnp.where(valid, scores, -jnp.inf)
  teacher = _teacher_at(kernels, attn_q, attn_k, attn_lse, indices, key_tokens, valid, attn_scale)
  mass = teacher.sum(axis=-1)
  row_valid = valid.any(axis=-1) & (mass > 0)
  target = teacher / jnp.where(row_valid, mass, 1.0)[..., None]
  log_student = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  return log_student, target, row_valid


def _kl_rows(log_student, target):
  """sum_j p_j (log p_j - log q_j) over entries with p_j > 0."""
  safe_target = jnp.where(target > 0, target, 1.0)
  terms = jnp.where(target > 0, target * (jnp.log(safe_target) - log_student), 0.0)
  return terms.sum(axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _sparse_loss(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens, scales, chunk,
                 kernels, rescore=False):
  """(f32[] mean KL over counted rows, i32[] rows counted); `rescore`: see `_chunk_grads`."""
  return _sparse_loss_fwd(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens, scales,
                          chunk, kernels, rescore)[0]


def _sparse_row_chunks(index_q, index_weights, attn_q, attn_lse, indices, key_tokens, chunk):
  """The per-row inputs split into [n, B, chunk, ...] blocks (padded rows select nothing), and join."""
  split, join = st.row_chunks(chunk, index_q.shape[1])
  return (split(index_q), split(index_weights), split(attn_q), split(attn_lse), split(indices, -1),
          split(key_tokens, -1)), join


def _sparse_loss_fwd(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens, scales, chunk,
                     kernels, rescore=False):
  del rescore  # only the backward pass differs

  def chunk_rows(xs):
    iq, iw, aq, alse, idx, tok = xs
    log_student, target, row_valid = _sparse_chunk(iq, index_k, iw, aq, attn_k, alse, idx, tok, scales, kernels)
    return _kl_rows(log_student, target), row_valid

  xs, _ = _sparse_row_chunks(index_q, index_weights, attn_q, attn_lse, indices, key_tokens, chunk)
  row_kl, row_valid = jax.lax.map(chunk_rows, xs)
  loss, n_valid = _row_mean(row_kl, row_valid)
  residuals = (index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens, n_valid)
  return (loss, n_valid), residuals


def _chunk_grads(index_k, attn_k, scales, kernels, coef, rescore, xs):
  """One row chunk: (dq, dk, dw) of `coef * sum of the rows' KL`, and the rows' (KL, validity).

  The logit gradient is the closed form `softmax(I) - p` on the support. `rescore` (the
  Megatron-style baseline, `xla_baseline`) pulls it back through the dense score rows of the chunk
  against every key, as Megatron's FusedDSAIndexerLoss backward does; otherwise through the scores
  at the selected keys only (O(K) per row, `kernels.scores_at`, computed once for the loss and its
  pullback).
  """
  iq, iw, aq, alse, idx, tok = xs
  valid = valid_indices(idx, index_k.shape[1])
  if rescore:
    log_student, target, row_valid = _sparse_chunk(iq, index_k, iw, aq, attn_k, alse, idx, tok, scales, kernels)
    scores = lambda q_, k_, w_: index_scores(q_, k_, w_, scales[0])  # [B, c, S]: every key, rescored
    _, pullback = jax.vjp(scores, iq, index_k, iw)
  else:
    at = lambda q_, k_, w_: kernels.scores_at(q_, k_, w_, idx, scales[0])
    scores, pullback = jax.vjp(at, iq, index_k, iw)
    log_student, target, row_valid = _sparse_chunk(iq, index_k, iw, aq, attn_k, alse, idx, tok, scales, kernels,
                                                   scores=scores)
  g = jnp.where(row_valid[..., None] & valid, jnp.exp(log_student) - target, 0.0) * coef  # [B, c, K]
  if rescore:
    safe = jnp.where(valid, idx, 0)
    g = jax.vmap(lambda gb, ib: jnp.zeros((ib.shape[0], index_k.shape[1]), jnp.float32).at[
        jnp.arange(ib.shape[0])[:, None], ib].add(gb))(g, safe)
  dq, dk, dw = pullback(g)
  return (dq, dk.astype(jnp.float32), dw), (_kl_rows(log_student, target), row_valid)


def _sparse_loss_bwd(scales, chunk, kernels, rescore, residuals, cts):
  ct = cts[0]  # the row count is an integer: no cotangent
  index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens, n_valid = residuals
  coef = ct / jnp.maximum(n_valid, 1).astype(jnp.float32)

  def chunk_grads(dk, xs):
    (dq, dk_chunk, dw), _ = _chunk_grads(index_k, attn_k, scales, kernels, coef, rescore, xs)
    return dk + dk_chunk, (dq, dw)

  xs, join = _sparse_row_chunks(index_q, index_weights, attn_q, attn_lse, indices, key_tokens, chunk)
  dk, (dq, dw) = jax.lax.scan(chunk_grads, jnp.zeros(index_k.shape, jnp.float32), xs)
  dq = join(dq).astype(index_q.dtype)
  dw = None if index_weights is None else join(dw).astype(index_weights.dtype)
  return dq, dk.astype(index_k.dtype), dw, None, None, None, None, None


def _sparse_loss_grad_in_forward(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, key_tokens,
                                 scales, chunk, kernels, grads_out=False):
  """The sparse loss with its gradient computed in the same pass over the rows, and saved.

  One scan computes each chunk's KL and its gradient at unit cotangent (the teacher once); the
  loss is then `loss + <dq, q - sg(q)> + <dk, k - sg(k)> + <dw, w - sg(w)>`, whose value is the
  loss and whose gradient is (dq, dk, dw) times the cotangent. The saved gradients are tagged
  `remat.INDEXER_GRADS`, so under the `"selection_replay"` policy neither the backward pass nor
  the rematerialization reruns the teacher. Costs [T, HI, DI] + [S, DI] + [T, HI] saved values.
  With `grads_out` the gradients are returned instead, f32 (dq, dk, dw) as a third output, and the
  loss carries none: a caller that runs the loss over query chunks sums the chunks' key gradients
  (and pulls the query gradients back to the indexer's weights) and saves those once, not
  [S, DI] + [T, HI, DI] per layer and per chunk.
  """
  sg = jax.lax.stop_gradient
  iq0, ik0, iw0, aq, ak, alse = sg((index_q, index_k, index_weights, attn_q, attn_k, attn_lse))

  def chunk_grads(dk, xs):
    (dq, dk_chunk, dw), rows = _chunk_grads(ik0, ak, scales, kernels, jnp.float32(1), False, xs)
    return dk + dk_chunk, (dq, dw, rows)

  xs, join = _sparse_row_chunks(iq0, iw0, aq, alse, indices, key_tokens, chunk)
  dk, (dq, dw, (row_kl, row_valid)) = jax.lax.scan(chunk_grads, jnp.zeros(ik0.shape, jnp.float32), xs)
  loss, n_valid = _row_mean(row_kl, row_valid)
  inv = 1.0 / jnp.maximum(n_valid, 1).astype(jnp.float32)
  if grads_out:
    return loss, n_valid, (join(dq) * inv, dk * inv, None if index_weights is None else join(dw) * inv)
  grads = [(join(dq) * inv, index_q), (dk * inv, index_k)]
  if index_weights is not None:
    grads.append((join(dw) * inv, index_weights))
  for g, x in grads:
    g = remat.tag(g.astype(x.dtype), remat.INDEXER_GRADS)
    loss = loss + jnp.sum((g * (x - sg(x))).astype(jnp.float32))
  return loss, n_valid


_sparse_loss.defvjp(_sparse_loss_fwd, _sparse_loss_bwd)


# ------------------------------------------------------------------------------------------------
# Dense form: the support of row t is every visible key; streamed over key chunks.


def _dense_attention_logits(attn_q, attn_k, attn_scale):
  """f32[B, bq, H, ck] logits of every query head against every key of a chunk."""
  B, bq, H, Dk = attn_q.shape
  G = attn_k.shape[2]
  logits = jnp.einsum(
      "btgnd,bsgd->btgns", attn_q.reshape(B, bq, G, H // G, Dk), attn_k,
      preferred_element_type=jnp.float32, precision=_HIGHEST,
  )
  return logits.reshape(B, bq, H, -1) * jnp.float32(attn_scale)


def _online_lse(state, x, axis=-1):
  """Merges logsumexp state (max, sum) with the entries of x along `axis`."""
  m, s = state
  m_new = jnp.maximum(m, jnp.max(x, axis=axis))
  shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - jnp.expand_dims(shift, axis)), axis=axis)
  return m_new, s


def _lse_value(state):
  m, s = state
  return jnp.where(s > 0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)


class _DenseSpec:
  """The static layout shared by the dense passes: block sizes, padding and the tile function."""

  def __init__(self, index_k, attn_k, segment_ids, q_offset, compress_ratio, scales, blocks):
    self.Tk = index_k.shape[1]
    self.bq, ck = blocks
    self.ck = min(ck, self.Tk)
    self.n_chunks = st.cdiv(self.Tk, self.ck)
    self.index_k = st.pad_axis(index_k, 1, self.n_chunks * self.ck)
    self.attn_k = st.pad_axis(attn_k, 1, self.n_chunks * self.ck)
    q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
    self.kv_seg = None if kv_seg is None else st.pad_axis(kv_seg, 1, self.n_chunks * self.ck)
    self.q_seg = q_seg
    self.q_offset = q_offset
    self.compress_ratio = compress_ratio
    self.index_scale, self.attn_scale = scales

  def q_positions(self, i):
    return self.q_offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)

  def n_visible(self, q_pos):
    return st.visible_key_chunks(q_pos[-1], self.compress_ratio, self.ck, self.n_chunks)

  def key_chunk(self, j):
    start = j * self.ck
    take = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, start, self.ck, axis=1)
    return start + jnp.arange(self.ck, dtype=jnp.int32), take(self.index_k), take(self.attn_k), take(self.kv_seg)

  def tile(self, j, q_pos, seg_blk, iq, iw, aq):
    """Visibility [B, bq, ck], indexer logits [B, bq, ck] and attention logits [B, bq, H, ck]."""
    k_pos, ik, ak, kseg = self.key_chunk(j)
    vis = st.key_visible(q_pos, k_pos, self.compress_ratio, seg_blk, kseg) & (k_pos < self.Tk)
    logits = jnp.where(vis, index_scores(iq, ik, iw, self.index_scale), -jnp.inf)
    attn = jnp.where(vis[:, :, None, :], _dense_attention_logits(aq, ak, self.attn_scale), -jnp.inf)
    return vis, logits, attn

  def blocks(self, x, fill=0):
    return None if x is None else st.to_blocks(x, 1, self.bq, fill)


def _dense_block_stats(spec: _DenseSpec, i, iq, iw, aq, alse, seg_blk):
  """Per-row streamed statistics of one query block: lse of I, teacher lse, mass Z and sum u(log u - I)."""
  B, bq, H, _ = aq.shape
  q_pos = spec.q_positions(i)
  n_visible = spec.n_visible(q_pos)
  neg = lambda *shape: jnp.full(shape, -jnp.inf, jnp.float32)
  zero = lambda *shape: jnp.zeros(shape, jnp.float32)

  def stats_pass(j, state):
    lse_i, lse_a = state
    _, logits, attn = spec.tile(j, q_pos, seg_blk, iq, iw, aq)
    return _online_lse(lse_i, logits), (None if alse is not None else _online_lse(lse_a, attn))

  init = ((neg(B, bq), zero(B, bq)), None if alse is not None else (neg(B, bq, H), zero(B, bq, H)))
  lse_i, lse_a = jax.lax.fori_loop(0, n_visible, stats_pass, init)
  lse_i = _lse_value(lse_i)
  alse = alse if alse is not None else _lse_value(lse_a)

  def mass_pass(j, acc):
    mass, cross = acc
    _, logits, attn = spec.tile(j, q_pos, seg_blk, iq, iw, aq)
    u = probs_from_lse(attn, alse).sum(axis=2)  # [B, bq, ck]
    term = jnp.where(u > 0, u * (jnp.log(jnp.where(u > 0, u, 1.0)) - logits), 0.0)
    return mass + u.sum(axis=-1), cross + term.sum(axis=-1)

  mass, cross = jax.lax.fori_loop(0, n_visible, mass_pass, (zero(B, bq), zero(B, bq)))
  return lse_i, alse, mass, cross


def dense_stats_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, *, q_offset, segment_ids,
                          compress_ratio, scales, blocks):
  """Per-row statistics of the dense form, streamed in jnp: (lse_I, attn_lse, Z, cross), lse_I, Z and
  cross f32[B, T] (see `DenseKernels`), attn_lse f32[B, T, H] (computed here when None)."""
  spec = _DenseSpec(index_k, attn_k, segment_ids, q_offset, compress_ratio, scales, blocks)
  T = index_q.shape[1]

  def block_rows(xs):
    i, iq, iw, aq, alse, seg = xs
    return _dense_block_stats(spec, i, iq, iw, aq, alse, seg)

  xs = (jnp.arange(st.cdiv(T, spec.bq), dtype=jnp.int32), spec.blocks(index_q), spec.blocks(index_weights),
        spec.blocks(attn_q), spec.blocks(attn_lse), spec.blocks(spec.q_seg))
  return tuple(st.from_blocks(x, 1, T) for x in jax.lax.map(block_rows, xs))


def dense_grads_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, lse_i, inv_mass, coef, *,
                          q_offset, segment_ids, compress_ratio, scales, blocks):
  """f32 gradients (d index_q, d index_k, d index_weights or None) of `sum_t coef[t] KL_t`, streamed in jnp."""
  spec = _DenseSpec(index_k, attn_k, segment_ids, q_offset, compress_ratio, scales, blocks)
  T = index_q.shape[1]

  def block_grads(dk, xs):
    i, iq, iw, aq, seg, alse_b, lse_b, inv_mass_b, coef_b = xs
    q_pos = spec.q_positions(i)
    seen = jnp.isfinite(lse_b)

    def chunk_grads(j, acc):
      dq, dw, dk = acc
      vis, logits, attn = spec.tile(j, q_pos, seg, iq, iw, aq)
      target = probs_from_lse(attn, alse_b).sum(axis=2) * inv_mass_b[..., None]
      student = jnp.exp(logits - jnp.where(seen, lse_b, 0.0)[..., None])
      g = jnp.where(vis & seen[..., None], student - target, 0.0) * coef_b[..., None]
      _, ik, _, _ = spec.key_chunk(j)
      _, pullback = jax.vjp(lambda q_, k_, w_: index_scores(q_, k_, w_, spec.index_scale), iq, ik, iw)
      dq_j, dk_j, dw_j = pullback(g)
      dk = jax.lax.dynamic_update_slice_in_dim(
          dk, jax.lax.dynamic_slice_in_dim(dk, j * spec.ck, spec.ck, axis=1) + dk_j, j * spec.ck, axis=1
      )
      dw = None if dw is None else dw + dw_j
      return dq + dq_j, dw, dk

    zeros = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
    dq, dw, dk = jax.lax.fori_loop(0, spec.n_visible(q_pos), chunk_grads, (zeros(iq), zeros(iw), dk))
    return dk, (dq, dw)

  blocks_of = lambda x, fill=0.0: spec.blocks(x.astype(jnp.float32), fill)
  xs = (jnp.arange(st.cdiv(T, spec.bq), dtype=jnp.int32), spec.blocks(index_q), spec.blocks(index_weights),
        spec.blocks(attn_q), spec.blocks(spec.q_seg), spec.blocks(attn_lse), blocks_of(lse_i, -jnp.inf),
        blocks_of(inv_mass), blocks_of(coef))
  dk, (dq, dw) = jax.lax.scan(block_grads, jnp.zeros(spec.index_k.shape, jnp.float32), xs)
  dq = st.from_blocks(dq, 1, T)
  dw = None if index_weights is None else st.from_blocks(dw, 1, T)
  return dq, dk[:, : spec.Tk], dw


class DenseKernels(NamedTuple):
  """What the dense form computes with (a static argument of its custom_vjp).

  stats: `(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, *, q_offset, segment_ids,
    compress_ratio, scales) -> (lse_I, attn_lse, Z, cross)`: per row, the student's log-sum-exp over
    the support, the attention's (given, or computed when None), the teacher's mass
    `Z = sum_s u` and `cross = sum_s u (log u - I)`.
  grads: `(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, lse_I, inv_mass, coef, *, q_offset,
    segment_ids, compress_ratio, scales) -> f32 (dq, dk, dw)`: the gradients of `sum_t coef[t] KL_t`,
    `inv_mass` = 1 / Z (0 for rows left out).
  """

  stats: Callable
  grads: Callable


def reference_dense_kernels(query_chunk: int, key_chunk: int) -> DenseKernels:
  """The jnp streaming in [query_chunk, H, key_chunk] tiles."""
  blocks = (int(query_chunk), int(key_chunk))
  return DenseKernels(functools.partial(dense_stats_reference, blocks=blocks),
                      functools.partial(dense_grads_reference, blocks=blocks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _dense_loss(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, positions, compress_ratio, scales,
                kernels):
  """(f32[] mean KL over counted rows, i32[] rows counted)."""
  return _dense_loss_fwd(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, positions, compress_ratio,
                         scales, kernels)[0]


def _dense_loss_fwd(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, positions, compress_ratio, scales,
                    kernels):
  q_offset, segment_ids = positions
  lse_i, attn_lse, mass, cross = kernels.stats(index_q, index_k, index_weights, attn_q, attn_k, attn_lse,
                                               q_offset=q_offset, segment_ids=segment_ids,
                                               compress_ratio=compress_ratio, scales=scales)
  row_valid = jnp.isfinite(lse_i) & (mass > 0)
  safe_mass = jnp.where(row_valid, mass, 1.0)
  # KL(p || softmax I) = E_p[log u - I] - log Z + lse(I), with p = u / Z.
  row_kl = cross / safe_mass - jnp.log(safe_mass) + jnp.where(row_valid, lse_i, 0.0)
  loss, n_valid = _row_mean(row_kl, row_valid)
  residuals = (index_q, index_k, index_weights, attn_q, attn_k, positions, n_valid, row_valid, lse_i, attn_lse, mass)
  return (loss, n_valid), residuals


def _dense_loss_bwd(compress_ratio, scales, kernels, residuals, cts):
  ct = cts[0]  # the row count is an integer: no cotangent
  index_q, index_k, index_weights, attn_q, attn_k, positions, n_valid, row_valid, lse_i, attn_lse, mass = residuals
  q_offset, segment_ids = positions
  coef = jnp.where(row_valid, ct / jnp.maximum(n_valid, 1).astype(jnp.float32), 0.0)
  inv_mass = jnp.where(row_valid, 1.0 / jnp.where(row_valid, mass, 1.0), 0.0)
  dq, dk, dw = kernels.grads(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, lse_i, inv_mass, coef,
                             q_offset=q_offset, segment_ids=segment_ids, compress_ratio=compress_ratio, scales=scales)
  dw = None if index_weights is None else dw.astype(index_weights.dtype)
  return dq.astype(index_q.dtype), dk.astype(index_k.dtype), dw, None, None, None, None


_dense_loss.defvjp(_dense_loss_fwd, _dense_loss_bwd)


def indexer_loss_reference(
    index_q: Float[Array, "B T HI DI"],
    index_k: Float[Array, "B S DI"],
    index_weights: Float[Array, "B T HI"] | None,
    attn_q: Float[Array, "B T H Dk"],
    attn_k: Float[Array, "B S G Dk"],
    attn_lse: Float[Array, "B T H"] | None,
    indices: Int[Array, "B T K"] | None = None,
    *,
    attn_scale: float,
    index_scale: float = 1.0,
    compress_ratio: int = 1,
    q_offset: int | Int[Array, ""] = 0,
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    key_tokens: Int[Array, "B T K P"] | None = None,
    key_pool: str = "sum",
    query_chunk: int = 64,
    key_chunk: int = 256,
    teacher_mass=teacher_mass_reference,
    scores_at=index_scores_at,
    with_row_count: bool = False,
    grad_in_forward: bool = False,
    rescore: bool = False,
    grads_out: bool = False,
    dense_kernels: DenseKernels | None = None,
) -> Float[Array, ""] | tuple[Float[Array, ""], Int[Array, ""]]:
  """Mean over valid query rows of KL(teacher || softmax(indexer logits)) on each row's support.

  Sparse form (`indices` given): the support is the listed indices, and memory is
  O(query_chunk * K * (H + HI)). Dense form (`indices=None`): the support is every visible key,
  streamed `key_chunk` keys at a time (no [T, S] table); `attn_lse=None` computes each head's LSE
  over the same support. With `with_row_count`, returns (loss, i32[] rows counted in the mean).
  `key_tokens` (sparse form, QSA): the attention keys behind each selected index key, whose
  teacher masses are pooled by `key_pool` (see `ops.indexer_loss`).
  `teacher_mass` computes the sparse form's teacher and `scores_at` the indexer's scores at the
  selected keys (the Pallas backend passes its kernels for both); the teacher is recomputed in the
  backward pass rather than saved, since [T, K] f32 per layer is 8.6 GB at 1M tokens. `dense_kernels`
  computes the dense form's row statistics and gradients (default: the jnp streaming in
  `query_chunk` x `key_chunk` tiles; the Pallas backend passes its kernels).

  Sparse-form variants (same value and gradient, different cost):
    grad_in_forward: compute the gradient with the loss and save it (`_sparse_loss_grad_in_forward`).
      With `grads_out` the result ends with the gradients instead, f32 (dq, dk, dw) (see there).
    rescore: the Megatron-style backward that rescores every key of each row (`_chunk_grads`); the
      `xla_baseline` backend.
  """
  scales = (float(index_scale), float(attn_scale))
  kernels = SparseKernels(teacher_mass, str(key_pool), scores_at)
  if key_tokens is not None:
    if indices is None:
      raise NotImplementedError("indexer_loss: key_tokens covers the sparse form (indices given).")
    key_tokens = key_tokens.astype(jnp.int32)
  if grads_out and (indices is None or not grad_in_forward):
    raise ValueError("indexer_loss: grads_out needs the sparse form with grad_in_forward=True.")
  if indices is not None and grad_in_forward:
    out = _sparse_loss_grad_in_forward(index_q, index_k, index_weights, attn_q, attn_k, attn_lse,
                                       indices.astype(jnp.int32), key_tokens, scales, int(query_chunk), kernels,
                                       bool(grads_out))
    if grads_out:
      return out if with_row_count else (out[0], out[2])
  elif indices is not None:
    out = _sparse_loss(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices.astype(jnp.int32),
                       key_tokens, scales, int(query_chunk), kernels, bool(rescore))
  else:
    positions = (jnp.asarray(q_offset, jnp.int32), segment_ids)
    kernels = dense_kernels or reference_dense_kernels(query_chunk, key_chunk)
    out = _dense_loss(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, positions,
                      int(compress_ratio), scales, kernels)
  return out if with_row_count else out[0]
