"""Qwen3.8-Flash-Next QSA (architectures.md §4): a weight-free block indexer and gated GQA attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import ops
from hyscale_jax import sharding as shd
from hyscale_jax.layers.mla import AttentionOutput
from hyscale_jax.layers.norms import ZeroCenteredRMSNorm
from hyscale_jax.layers.rope import apply_rope
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.ops import _streaming as st
from hyscale_jax.ops.flash_topk import index_scores


def partial_rope(x, positions, *, rope_dim: int, theta: float):
  """NeoX (half-split) RoPE on the first `rope_dim` dims of x [B, T, ..., D]."""
  pe = apply_rope(x[..., :rope_dim], positions, theta=theta, interleaved=False)
  return jnp.concatenate([pe, x[..., rope_dim:]], axis=-1)


def expand_blocks(blocks: Int[Array, "B T K"], segment_ids: Int[Array, "B T"], block: int
                  ) -> Int[Array, "B T W"]:
  """Token indices [B, T, K*block + block-1]: each selected block's tokens, then t's partial tail.

  The tail is tokens floor((t+1)/block)*block .. t (at most block-1 of them). Slots for an empty
  block (-1), for tail positions past t, or for tokens of another document hold -1.
  """
  B, T, K = blocks.shape
  tokens = blocks[..., None] * block + jnp.arange(block)  # [B, T, K, block]
  tokens = jnp.where(blocks[..., None] >= 0, tokens, -1).reshape(B, T, K * block)
  t = jnp.arange(T)
  tail = ((t + 1) // block * block)[:, None] + jnp.arange(block - 1)[None, :]  # [T, block-1]
  tail = jnp.broadcast_to(jnp.where(tail <= t[:, None], tail, -1)[None], (B, T, block - 1))
  tokens = jnp.concatenate([tokens, tail], axis=-1)
  token_seg = jnp.take_along_axis(segment_ids[:, None, :], jnp.clip(tokens, 0, T - 1), axis=2)
  return jnp.where((tokens >= 0) & (token_seg == segment_ids[:, :, None]), tokens, -1)


def block_tokens(tokens: Int[Array, "B T W"], block: int) -> Int[Array, "B T K block"]:
  """The selected blocks' tokens of `expand_blocks`' output [B, T, K*block + block-1], tail dropped."""
  B, T, W = tokens.shape
  K = (W - (block - 1)) // block
  return tokens[..., : K * block].reshape(B, T, K, block)


def _block_kl(teacher_blocks, student_logits, support, pool: str):
  """(sum over counted rows, i32 count) of KL(pool(teacher) normalised || softmax(student)) on `support`."""
  pooled = teacher_blocks.max(-1) if pool == "max" else teacher_blocks.sum(-1)  # [B, T, N]
  pooled = jnp.where(support, pooled, 0.0)
  mass = pooled.sum(-1, keepdims=True)
  p = pooled / jnp.where(mass > 0, mass, 1.0)
  log_q = jax.nn.log_softmax(jnp.where(support, student_logits, -jnp.inf), axis=-1)
  kl = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0).sum(-1)
  rows = (mass[..., 0] > 0) & support.any(-1)
  return jnp.sum(jnp.where(rows, kl, 0.0)), rows.sum(dtype=jnp.int32)


# Rows per step of the dense block KL: as many as keep its [B, rows, H, T] f32 logits near this size.
_DENSE_KL_BYTES = 256 * 2**20


def dense_block_indexer_loss(
    index_q: Float[Array, "B T HI DI"],
    block_keys: Float[Array, "B N DI"],
    attn_q: Float[Array, "B T H D"],
    attn_k: Float[Array, "B T G D"],
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B N"]],
    *,
    block: int,
    attn_scale: float,
    index_scale: float,
    pool: str = "sum",
    row_chunk: int | None = None,
) -> Float[Array, ""]:
  """QSA's block-level indexer KL over every visible block: the dense warm-up's form.

  The community recipe of architectures.md §4.3 (Qwen's is private). Teacher: the main attention's
  probabilities averaged over heads, pooled over each block's `block` tokens (`sum` or `max`),
  L1-normalised over the visible blocks (b+1)*block <= t+1 of t's document; detached. Student:
  `softmax(S_t)` with the weight-free block score `S = index_scale * sum_j relu(<q_j, K_b>)`. The
  sparse form (the selected blocks) is `ops.indexer_loss` with `key_tokens`. Gradients reach only
  index_q and block_keys.

  Rows are independent, so they run `row_chunk` at a time (default: as many as keep the
  [B, rows, H, T] f32 logits near 256 MiB), each rematerialised in the backward: memory is
  O(rows * T), never [T, T]. Each row still scores all T keys, the masked half included: about
  twice the causal FLOPs, on the warm-up's detached teacher only.
  """
  attn_q, attn_k = jax.lax.stop_gradient((attn_q, attn_k))
  B, T, H, _ = attn_q.shape
  G, N = attn_k.shape[2], block_keys.shape[1]
  q_seg, block_seg = segment_ids
  rows = row_chunk or max(1, min(T, _DENSE_KL_BYTES // (4 * B * H * T)))
  split, _ = st.row_chunks(rows, T)
  # Every row chunk adds to block_keys' gradient: sum it in f32, not in the keys' dtype.
  keys = st.summed_in_f32(block_keys)

  def chunk_kl(xs):
    index_q, attn_q, q_seg_rows, start = xs
    q_pos = start + jnp.arange(index_q.shape[1])
    visible_tok = st.key_visible(q_pos, jnp.arange(T), 1, q_seg_rows, q_seg)  # [B, rows, T]
    logits = jnp.einsum("btgrd,bsgd->btgrs", attn_q.reshape(*attn_q.shape[:2], G, H // G, -1), attn_k,
                        preferred_element_type=jnp.float32) * attn_scale
    probs = jax.nn.softmax(jnp.where(visible_tok[:, :, None, None], logits, -jnp.inf), axis=-1)
    probs = jnp.where(visible_tok, probs.reshape(*visible_tok.shape[:2], H, T).mean(2), 0.0)[..., : N * block]
    student = index_scores(index_q, keys(), None, index_scale)  # [B, rows, N]
    support = st.key_visible(q_pos, jnp.arange(N), block, q_seg_rows, block_seg) & (q_pos < T)[:, None]
    return _block_kl(probs.reshape(*probs.shape[:2], N, block), student, support, pool)

  starts = jnp.arange(st.cdiv(T, rows), dtype=jnp.int32) * rows
  kl_sums, counted = jax.lax.map(jax.checkpoint(chunk_kl),
                                 (split(index_q), split(attn_q), split(q_seg, -1), starts))
  return kl_sums.sum() / jnp.maximum(counted.sum(), 1)


class QSAIndexer(nnx.Module):
  """The weight-free QSA indexer: one projection to H_I query heads plus one raw key per token.

  Block key b: `RoPE_{first position}(RMSNorm_k(mean of the block's raw keys))`, the mean in f32
  over the block's tokens of its last token's document. Queries: `RoPE_t(RMSNorm_q(q))`. RoPE is
  half-split on the first `index_rope_dim` dims with the attention's θ. Inputs are detached.
  `RMSNorm_q` / `RMSNorm_k` are zero-centred (weight applied as 1 + w, as transformers' qwen4_exp
  has them) when `cfg.indexer_norm_zero_centered`, else plain RMSNorms.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    self.index_qk_proj = nnx.Linear(cfg.d_model, (HI + 1) * DI, use_bias=False, rngs=rngs, dtype=dtype,
                                    param_dtype=pdtype, kernel_metadata=shd.param(shd.EMBED, shd.INDEX))
    if cfg.indexer_norm_zero_centered:  # transformers' qwen4_exp: weight applied as 1 + w
      norm = lambda: ZeroCenteredRMSNorm(DI, eps=cfg.rms_eps, param_dtype=pdtype)
    else:
      norm = lambda: nnx.RMSNorm(DI, epsilon=cfg.rms_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                 scale_metadata=shd.param(shd.NORM))
    self.q_norm, self.k_norm = norm(), norm()

  @property
  def score_scale(self) -> float:
    return self.cfg.index_head_dim**-0.5

  def __call__(self, x, positions, segment_ids):
    """(q [B, T, HI, DI], block keys [B, T // block, DI], block segment ids i32[B, T // block])."""
    cfg = self.cfg
    x = jax.lax.stop_gradient(x)
    B, T, _ = x.shape
    m, HI, DI = cfg.qsa_block, cfg.index_n_heads, cfg.index_head_dim
    N = T // m
    rope = lambda y, pos: partial_rope(y, pos, rope_dim=cfg.index_rope_dim, theta=cfg.rope_theta)
    qk = self.index_qk_proj(x).reshape(B, T, HI + 1, DI)
    q = rope(self.q_norm(qk[:, :, :HI]), positions)
    raw = qk[:, : N * m, HI].astype(jnp.float32).reshape(B, N, m, DI)
    seg = segment_ids[:, : N * m].reshape(B, N, m)
    same = (seg == seg[:, :, -1:])[..., None]
    mean = jnp.sum(jnp.where(same, raw, 0.0), axis=2) / jnp.sum(same, axis=2)
    first = positions[:, : N * m].reshape(B, N, m)[:, :, -1] - (m - 1)
    return q, rope(self.k_norm(mean.astype(x.dtype)), first), seg[:, :, -1]


class QSAAttention(nnx.Module):
  """Gated GQA attention over QSA's selection (architectures.md §4.1-4.2).

  `q_proj` packs each head's query and sigmoid output gate; q/k get zero-centred RMSNorm and partial
  NeoX RoPE. The indexer selects `index_topk` blocks of `qsa_block` tokens (`ops.flash_topk` with
  `weights=None`, `compress_ratio=qsa_block`); they expand to tokens plus the current partial
  block's tail (`index_topk * qsa_block + qsa_block - 1` indices) for one `ops.sparse_attention`
  call with G = n_kv_heads groups. `dense=True` (the warm-up) attends every causal token through
  `ops.causal_attention`. The indexer learns from the block KL (`ops.indexer_loss` with
  `key_tokens`, pool `indexer_pool`; the dense warm-up's `dense_block_indexer_loss`) unless
  `indexer_frozen`.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    linear = lambda i, o, axes: nnx.Linear(i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                           kernel_metadata=shd.param(*axes))
    H, G, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.q_proj = linear(cfg.d_model, H * hd * 2, (shd.EMBED, shd.HEADS))  # per head: [query ; gate]
    self.k_proj = linear(cfg.d_model, G * hd, (shd.EMBED, shd.KV_HEADS))
    self.v_proj = linear(cfg.d_model, G * hd, (shd.EMBED, shd.KV_HEADS))
    self.o_proj = linear(H * hd, cfg.d_model, (shd.HEADS, shd.EMBED))
    self.q_norm = ZeroCenteredRMSNorm(hd, eps=cfg.rms_eps, param_dtype=pdtype)
    self.k_norm = ZeroCenteredRMSNorm(hd, eps=cfg.rms_eps, param_dtype=pdtype)
    self.indexer = QSAIndexer(cfg, rngs=rngs)

  @property
  def scale(self) -> float:
    return self.cfg.head_dim**-0.5

  def qkv_gate(self, x, positions):
    """(q [B, T, H, hd], k [B, T, G, hd], v [B, T, G, hd], gate [B, T, H, hd])."""
    cfg = self.cfg
    B, T, _ = x.shape
    H, G, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rope = lambda y: partial_rope(y, positions, rope_dim=cfg.qk_rope_dim, theta=cfg.rope_theta)
    q, gate = jnp.split(self.q_proj(x).reshape(B, T, H, 2 * hd), 2, axis=-1)
    k = self.k_proj(x).reshape(B, T, G, hd)
    v = self.v_proj(x).reshape(B, T, G, hd)
    return rope(self.q_norm(q)), rope(self.k_norm(k)), v, gate

  def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"],
               segment_ids: Int[Array, "B T"], *, dense: bool = False, shared_indices=None,
               backends=None) -> AttentionOutput:
    """Attention over the selection; arguments as `MLASparseAttention`'s.

    Returns AttentionOutput(out [B, T, D], the selected blocks i32[B, T, index_topk] (None when
    dense), the block KL (None when the indexer is frozen)).
    """
    del shared_indices
    cfg = self.cfg
    B, T, _ = x.shape
    backend = lambda name: getattr(backends, name, "auto") if backends is not None else "auto"
    q, k, v, gate = self.qkv_gate(x, positions)
    index_q, block_keys, block_seg = self.indexer(x, positions, segment_ids)
    segs = (segment_ids, block_seg)
    blocks = rescued = None
    if dense:  # every causal token of the document, streamed: nothing [T, T]
      out = ops.causal_attention(q, k, v, scale=self.scale, segment_ids=segment_ids,
                                 backend=backend("causal_attention"))
    else:
      blocks, rescued = ops.flash_topk(index_q, block_keys, None, topk=cfg.index_topk,
                                       compress_ratio=cfg.qsa_block, scale=self.indexer.score_scale,
                                       segment_ids=segs, sorted=False, backend=backend("flash_topk"), with_stats=True)
      blocks, rescued = blocks.indices, jnp.sum(rescued, dtype=jnp.int32)
      tokens = expand_blocks(blocks, segment_ids, cfg.qsa_block)
      out, lse = ops.sparse_attention(q, k, v, tokens, scale=self.scale, deterministic=cfg.sparse_attention_deterministic,
                                      backend=backend("sparse_attention"))
    loss = None
    if not cfg.indexer_frozen:
      index_scale = self.indexer.score_scale
      if dense:
        loss = dense_block_indexer_loss(index_q, block_keys, q, k, segs, block=cfg.qsa_block, attn_scale=self.scale,
                                        index_scale=index_scale, pool=cfg.indexer_pool)
      else:  # the selected blocks; each block's teacher is its (segment-masked) tokens'
        loss = ops.indexer_loss(index_q, block_keys, None, q, k, lse, blocks, attn_scale=self.scale,
                                index_scale=index_scale, key_tokens=block_tokens(tokens, cfg.qsa_block),
                                key_pool=cfg.indexer_pool, grad_in_forward=cfg.indexer_loss_grad_in_forward,
                                backend=backend("indexer_loss"))
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return AttentionOutput(self.o_proj(out.reshape(B, T, -1)), blocks, loss, rescued)
