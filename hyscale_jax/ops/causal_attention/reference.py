"""Pure-jnp backends of `causal_attention`: a streaming (flash-style) reference and the dense baseline."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _streaming as st
from hyscale_jax.ops.sparse_attention.vjp import attention_with_saved_residuals

# Rows x keys of one step: [B, block_q, N, key_chunk] f32 logits (and, in the backward, p, dp, ds)
# are 128 MiB per sequence at N = 64 heads, and a 64K sequence takes ~4K steps.
QUERY_BLOCK = 512
KEY_CHUNK = 1024


def causal_attention_reference(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    scale: float,
    q_offset: int | Int[Array, ""] = 0,
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    compress_ratio: int = 1,
    return_lse: bool = False,
    query_block: int = QUERY_BLOCK,
    key_chunk: int = KEY_CHUNK,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
  """Causal attention streamed over key chunks with an online softmax; nothing is [T, S].

  Query blocks run one after another; each visits only the key chunks that hold a key visible to
  it (about half of them), so memory is O(block_q * key_chunk) per head beyond the inputs. The
  custom_vjp saves `out` and `lse` (tagged for remat) and its backward streams the same way,
  recomputing each step's probabilities.

  Args:
    q: bf16|f32[B, T, N, H]; k: bf16|f32[B, S, K, H]; v: bf16|f32[B, S, K, Hv] (N divisible by K).
    scale: logit scale.
    q_offset: absolute position of query row 0.
    segment_ids: (q_seg int[B, T], kv_seg int[B, S]) or None.
    compress_ratio: tokens per key: key s is visible at position p iff (s + 1) * ratio <= p + 1.
    return_lse: also return lse (differentiable: the backward takes its cotangent).
    query_block, key_chunk: rows and keys per step.

  Returns:
    out [B, T, N, Hv] in q.dtype (f32 logits, softmax and sums; a row that sees no key gives 0),
    and with `return_lse` also lse f32[B, T, N] (-inf for such a row).
  """
  blocks = dict(query_block=min(query_block, q.shape[1]), key_chunk=min(key_chunk, k.shape[1]))
  return attend_with_saved_residuals(functools.partial(_forward, **blocks), functools.partial(_backward, **blocks),
                                     q, k, v, scale=scale, q_offset=q_offset, segment_ids=segment_ids,
                                     compress_ratio=compress_ratio, return_lse=return_lse)


def attend_with_saved_residuals(forward, backward, q, k, v, *, scale, q_offset, segment_ids, compress_ratio=1,
                                return_lse=False):
  """A backend from its forward and backward, through `sparse_attention`'s residual-saving vjp.

  The mask travels as the glue's `indices`: (q_offset, q_seg, kv_seg), passed to `forward` as given
  (a Python int offset stays one, so a backend can tell a static 0). `compress_ratio` (static) goes
  to both as a keyword, `return_lse` to `forward`: a backend whose backward drops lse's cotangent
  declines it there.

  Args:
    forward: `(q, k, v, mask, *, scale, sinks, compress_ratio, return_lse) -> (out, lse f32[B, T, N])`.
    backward: `((q, k, v, mask, sinks, out, lse), (dout, dlse), *, scale, compress_ratio) -> (dq, dk, dv, None)`.

  Returns:
    out, or (out, lse) with `return_lse`.
  """
  mask = (q_offset, *(segment_ids if segment_ids is not None else (None, None)))
  out, lse = attention_with_saved_residuals(
      # Only a differentiable lse (True, not "detached") needs a backward that takes its cotangent.
      functools.partial(forward, compress_ratio=compress_ratio, return_lse=return_lse is True),
      functools.partial(backward, compress_ratio=compress_ratio), q, k, v, mask, scale=float(scale))
  return (out, lse) if return_lse else out


def causal_attention_xla_baseline(q, k, v, *, scale, q_offset=0, segment_ids=None, compress_ratio=1,
                                  return_lse=False):
  """The dense baseline: materialises the [B, N, T, S] f32 logits and softmax (short lengths only).

  Same arguments and result as `causal_attention_reference`; XLA differentiates it.
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  visible = st.key_visible(q_offset + jnp.arange(T), jnp.arange(S), compress_ratio, q_seg, kv_seg)  # [B|1, T, S]
  logits = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k,
                      preferred_element_type=jnp.float32) * scale
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(logits - m)
  total = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
  out = jnp.einsum("bkgts,bskv->btkgv", p, v.astype(jnp.float32)).reshape(B, T, N, -1).astype(q.dtype)
  if not return_lse:
    return out
  # A row with no key: log(0) = -inf, and its gradient is masked to 0 by the safe log's where.
  seen = total > 0
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)  # [B, K, G, T, 1]
  return out, jnp.moveaxis(lse[..., 0], 3, 1).reshape(B, T, N)


def _blocked(q, k, v, mask, query_block, key_chunk):
  """Queries as [nq, B, bq, K, G, H] blocks, keys/values as [nk, B, bk, K, ...] chunks, masks alike."""
  B, T, N, H = q.shape
  K = k.shape[2]
  q_offset, q_seg, kv_seg = mask
  qb = st.to_blocks(q.reshape(B, T, K, N // K, H), 1, query_block)
  kb, vb = st.to_blocks(k, 1, key_chunk), st.to_blocks(v, 1, key_chunk)
  split = lambda s, block: None if s is None else st.to_blocks(s, 1, block)
  return qb, kb, vb, split(q_seg, query_block), split(kv_seg, key_chunk)


def _chunk_logits(q_blk, q_seg_blk, q_pos, kb, kv_segb, j, *, S, scale, compress_ratio):
  """(f32 logits [B, bq, K, G, bk] with -inf at invisible keys, visible [B|1, bq, 1, 1, bk], k_j, j's keys)."""
  k_c = kb[j]
  key_chunk = k_c.shape[1]
  k_pos = j * key_chunk + jnp.arange(key_chunk)
  kv_seg_c = None if kv_segb is None else kv_segb[j]
  visible = st.key_visible(q_pos, k_pos, compress_ratio, q_seg_blk, kv_seg_c) & (k_pos < S)  # padded keys never count
  visible = visible[:, :, None, None, :]
  logits = jnp.einsum("bqkgh,bskh->bqkgs", q_blk, k_c, preferred_element_type=jnp.float32) * scale
  return jnp.where(visible, logits, -jnp.inf), visible, k_c


def _forward(q, k, v, mask, *, scale, sinks=None, compress_ratio, return_lse, query_block, key_chunk):
  """(out [B, T, N, Hv] in q.dtype, lse f32[B, T, N]; -inf where a row sees nothing)."""
  del sinks, return_lse  # the glue passes sinks (this op has none); the backward below takes dlse
  B, T, N, _ = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  qb, kb, vb, q_segb, kv_segb = _blocked(q, k, v, mask, query_block, key_chunk)
  q_offset = jnp.asarray(mask[0], jnp.int32)

  def query_rows(xs):
    i, q_blk, q_seg_blk = xs
    q_pos = q_offset + i * query_block + jnp.arange(query_block)
    n_chunks = st.visible_key_chunks(q_pos[-1], compress_ratio, key_chunk, kb.shape[0])

    def step(j, carry):
      m, l, acc = carry
      logits, _, _ = _chunk_logits(q_blk, q_seg_blk, q_pos, kb, kv_segb, j, S=S, scale=scale,
                                   compress_ratio=compress_ratio)
      m_new = jnp.maximum(m, logits.max(-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no visible key yet: avoid inf - inf
      p = jnp.exp(logits - m_safe[..., None])
      correction = jnp.exp(m - m_safe)
      pv = jnp.einsum("bqkgs,bskv->bqkgv", p, vb[j].astype(jnp.float32))
      return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

    shape = q_blk.shape[:-1]
    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, Hv)))
    m, l, acc = jax.lax.fori_loop(0, n_chunks, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out.astype(q.dtype), lse

  out, lse = jax.lax.map(query_rows, (jnp.arange(qb.shape[0]), qb, q_segb))
  out = st.from_blocks(out, 1, T).reshape(B, T, N, Hv)
  return out, st.from_blocks(lse, 1, T).reshape(B, T, N)


def _backward(residuals, cotangents, *, scale, compress_ratio, query_block, key_chunk):
  """(dq, dk, dv, None): FlashAttention-2's backward, one pass over query blocks and their key chunks.

  lse's cotangent enters as `dS = P * (dP - delta + dlse)` (zero unless the caller asked for lse).
  dq of a block is summed over its key chunks; dk and dv over the query blocks in f32 carries
  [nk, B, bk, K, ...].
  """
  q, k, v, mask, _, out, lse = residuals
  dout, dlse = cotangents
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  qb, kb, vb, q_segb, kv_segb = _blocked(q, k, v, mask, query_block, key_chunk)
  q_offset = jnp.asarray(mask[0], jnp.int32)
  to_q_blocks = lambda x: st.to_blocks(x.reshape(B, T, K, N // K, *x.shape[3:]), 1, query_block)
  # delta - dlse: the softmax Jacobian's row term with lse's own cotangent folded in; [B, T, N].
  # A row with no key: every p below is masked to 0, and a non-finite dlse there must not make 0 * inf.
  dlse = jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

  def query_rows(dkv, xs):
    i, q_blk, q_seg_blk, do_blk, lse_blk, delta_blk = xs
    q_pos = q_offset + i * query_block + jnp.arange(query_block)
    n_chunks = st.visible_key_chunks(q_pos[-1], compress_ratio, key_chunk, kb.shape[0])
    do_blk = do_blk.astype(jnp.float32)

    def step(j, carry):
      dq, dk, dv = carry
      logits, visible, k_c = _chunk_logits(q_blk, q_seg_blk, q_pos, kb, kv_segb, j, S=S, scale=scale,
                                           compress_ratio=compress_ratio)
      p = jnp.where(visible, jnp.exp(logits - lse_blk[..., None]), 0.0)  # [B, bq, K, G, bk]
      dp = jnp.einsum("bqkgv,bskv->bqkgs", do_blk, vb[j].astype(jnp.float32))
      ds = p * (dp - delta_blk[..., None]) * scale
      dq = dq + jnp.einsum("bqkgs,bskh->bqkgh", ds, k_c.astype(jnp.float32))
      dk = dk.at[j].add(jnp.einsum("bqkgs,bqkgh->bskh", ds, q_blk.astype(jnp.float32)))
      dv = dv.at[j].add(jnp.einsum("bqkgs,bqkgv->bskv", p, do_blk))
      return dq, dk, dv

    dq, dk, dv = jax.lax.fori_loop(0, n_chunks, step, (jnp.zeros(q_blk.shape, jnp.float32), *dkv))
    return (dk, dv), dq

  dkv = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
  xs = (jnp.arange(qb.shape[0]), qb, q_segb, to_q_blocks(dout), to_q_blocks(lse), to_q_blocks(delta))
  (dk, dv), dq = jax.lax.scan(query_rows, dkv, xs)
  dq = st.from_blocks(dq, 1, T).reshape(B, T, N, H).astype(q.dtype)
  return dq, st.from_blocks(dk, 1, S).astype(k.dtype), st.from_blocks(dv, 1, S).astype(v.dtype), None
