"""Multi-head latent attention with DSA: absorbed (MQA 576/512-style) sparse attention over a selection."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import ops
from hyscale_jax import sharding as shd
from hyscale_jax.layers.indexer import LightningIndexer
from hyscale_jax.layers.rope import apply_rope
from hyscale_jax.model_config import ModelConfig


class AttentionOutput(NamedTuple):
  """`out` [B, T, D]; `indices` i32[B, T, K] or None (dense); `indexer_loss` f32[] or None."""

  out: jax.Array
  indices: jax.Array | None
  indexer_loss: jax.Array | None


def dense_causal_attention(q, k, v, segment_ids, scale):
  """Dense softmax attention over causal keys of the same segment (the warm-up stage's attention).

  It builds the [T, T] logits: use it for the dense warm-up at short lengths and as the
  dense-equivalence oracle, not at long context.

  Args:
    q: [B, T, H, Dk]; k: [B, T, 1, Dk]; v: [B, T, 1, Dv]; segment_ids: i32[B, T].
  Returns:
    [B, T, H, Dv] in q.dtype.
  """
  T = q.shape[1]
  logits = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], preferred_element_type=jnp.float32) * scale
  visible = jnp.tril(jnp.ones((T, T), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
  probs = jax.nn.softmax(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bsd->bthd", probs, v[:, :, 0].astype(jnp.float32)).astype(q.dtype)


class MLASparseAttention(nnx.Module):
  """GLM-5 / DeepSeek-V3.2 attention: MLA projections, a lightning indexer, and sparse attention.

  The sparse core runs in the absorbed (MQA) form: per head the query is
  `[W_UK^T q_nope (kv_lora) ; rope(q_pe)]` and every head shares one key `[c_kv ; rope(k_pe)]`
  and one value `c_kv`, so a gathered key row serves all heads. Attribute names follow the HF
  checkpoints (`q_a_proj`, `q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
  `kv_b_proj`, `o_proj`, `indexer`). Under IndexShare a layer without its own indexer reuses the
  previous full layer's selection and owns no indexer weights.
  """

  def __init__(self, cfg: ModelConfig, *, has_indexer: bool, rngs: nnx.Rngs):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    linear = lambda i, o, axes: nnx.Linear(i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                           kernel_metadata=shd.param(*axes))
    norm = lambda n: nnx.RMSNorm(n, epsilon=cfg.latent_norm_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                 scale_metadata=shd.param(shd.NORM))
    H, qk = cfg.n_heads, cfg.qk_nope_dim + cfg.qk_rope_dim
    self.cfg = cfg
    self.q_a_proj = linear(cfg.d_model, cfg.q_lora_rank, (shd.EMBED, shd.Q_LORA))
    self.q_a_layernorm = norm(cfg.q_lora_rank)
    self.q_b_proj = linear(cfg.q_lora_rank, H * qk, (shd.Q_LORA, shd.HEADS))
    # [c_kv ; k_pe]: the latent and the rope part are used whole by every head.
    self.kv_a_proj_with_mqa = linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_dim, (shd.EMBED, None))
    self.kv_a_layernorm = norm(cfg.kv_lora_rank)
    self.kv_b_proj = linear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_head_dim), (shd.KV_LORA, shd.HEADS))
    self.o_proj = linear(H * cfg.v_head_dim, cfg.d_model, (shd.HEADS, shd.EMBED))
    self.indexer = LightningIndexer(
        cfg.d_model, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
        rope_dim=cfg.index_rope_dim, rope_theta=cfg.rope_theta,
        rope_interleave=cfg.indexer_rope_interleave, rope_first=cfg.indexer_rope_first,
        scoring_relu=cfg.indexer_scoring_relu, hadamard=cfg.indexer_hadamard,
        rngs=rngs, dtype=dtype, param_dtype=pdtype) if has_indexer else None

  def _mqa_inputs(self, x, positions):
    """Absorbed q [B, T, H, L+R], shared k [B, T, 1, L+R], v [B, T, 1, L], latent c_q, and W_UV."""
    cfg = self.cfg
    B, T, _ = x.shape
    H, nope, R, L = cfg.n_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
    c_q = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, q_lora]
    q = self.q_b_proj(c_q).reshape(B, T, H, nope + R)
    q_pe = apply_rope(q[..., nope:], positions, theta=cfg.rope_theta, interleaved=True)
    kv = self.kv_a_proj_with_mqa(x)  # [B, T, L + R]
    c_kv = self.kv_a_layernorm(kv[..., :L])  # [B, T, L]
    k_pe = apply_rope(kv[..., L:], positions, theta=cfg.rope_theta, interleaved=True)
    w_kv_b = self.kv_b_proj.kernel[...].reshape(L, H, nope + cfg.v_head_dim)
    w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
    q_latent = jnp.einsum("bthn,lhn->bthl", q[..., :nope], w_uk.astype(q.dtype))  # [B, T, H, L]
    q_mqa = jnp.concatenate([q_latent, q_pe], axis=-1)  # [B, T, H, L + R]
    k_mqa = jnp.concatenate([c_kv, k_pe], axis=-1)[:, :, None, :]  # [B, T, 1, L + R]
    return q_mqa, k_mqa, c_kv[:, :, None, :], c_q, w_uv

  def __call__(
      self,
      x: Float[Array, "B T D"],
      positions: Int[Array, "B T"],
      segment_ids: Int[Array, "B T"],
      *,
      dense: bool = False,
      shared_indices: Int[Array, "B T K"] | None = None,
      backends=None,
  ) -> AttentionOutput:
    """Attention of each token over its selection (or over all causal keys when `dense`).

    Args:
      x: [B, T, D] the normalised block input.
      positions: i32[B, T] positions within each packed document (RoPE).
      segment_ids: i32[B, T] document ids; nothing attends or selects across them.
      dense: the warm-up stage: dense attention, dense indexer KL, no selection.
      shared_indices: the previous full layer's selection, for a layer without its own indexer.
      backends: an object with `flash_topk`, `sparse_attention`, `indexer_loss` backend names.

    Returns:
      AttentionOutput(out [B, T, D] in the module dtype, indices, indexer_loss).
    """
    cfg = self.cfg
    B, T, _ = x.shape
    q, k, v, c_q, w_uv = self._mqa_inputs(x, positions)
    scale, segs = cfg.attention_scale, (segment_ids, segment_ids)
    backend = lambda name: getattr(backends, name, "auto") if backends is not None else "auto"
    index_inputs = None if self.indexer is None else self.indexer(x, c_q, positions)
    indices, indexer_loss = None, None
    if dense:
      out = dense_causal_attention(q, k, v, segment_ids, scale)
      if index_inputs is not None:
        indexer_loss = ops.indexer_loss(*index_inputs, q, k, None, None, attn_scale=scale,
                                        index_scale=self.indexer.score_scale, segment_ids=segs,
                                        backend=backend("indexer_loss"))
    else:
      if index_inputs is not None:
        indices = ops.flash_topk(*index_inputs, topk=cfg.index_topk, scale=self.indexer.score_scale,
                                 segment_ids=segs, backend=backend("flash_topk")).indices
      elif shared_indices is None:
        raise ValueError("a layer without its own indexer needs shared_indices from a full layer.")
      else:
        indices = shared_indices
      # v is k's latent prefix: passing None lets the kernels gather and scatter one row for both.
      out, lse = ops.sparse_attention(q, k, None, indices, scale=scale, value_dim=v.shape[-1],
                                      backend=backend("sparse_attention"))
      if index_inputs is not None:
        indexer_loss = ops.indexer_loss(*index_inputs, q, k, lse, indices, attn_scale=scale,
                                        index_scale=self.indexer.score_scale,
                                        grad_in_forward=cfg.indexer_loss_grad_in_forward,
                                        backend=backend("indexer_loss"))
    heads = jnp.einsum("bthl,lhv->bthv", out, w_uv.astype(out.dtype))  # [B, T, H, v_head_dim]
    return AttentionOutput(self.o_proj(heads.reshape(B, T, -1)), indices, indexer_loss)
