"""DeepSeek-V4 attention (architectures.md §3): shared-KV MQA with sinks, window + compressed entries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import ops
from hyscale_jax import sharding as shd
from hyscale_jax.layers.compressor import Compressor, rope_tail
from hyscale_jax.layers.indexer import LightningIndexer
from hyscale_jax.layers.mla import AttentionOutput
from hyscale_jax.layers.norms import rms_normalize
from hyscale_jax.model_config import ModelConfig


def window_indices(segment_ids: Int[Array, "B T"], window: int) -> Int[Array, "B T W"]:
  """i32[B, T, W]: token t's sliding-window keys t-W+1 .. t of its own document, -1 elsewhere."""
  T = segment_ids.shape[1]
  keys = jnp.arange(T)[:, None] - window + 1 + jnp.arange(window)[None, :]  # [T, W]
  safe = jnp.clip(keys, 0, T - 1)
  same = jnp.take_along_axis(segment_ids[:, None, :], safe[None], axis=2) == segment_ids[:, :, None]
  return jnp.where((keys >= 0)[None] & same, keys[None], -1).astype(jnp.int32)


def visible_entry_indices(segment_ids, entry_segments, ratio: int) -> Int[Array, "B T S"]:
  """i32[B, T, S]: every compressed entry w visible to t ((w+1)*ratio <= t+1, same document), else -1.

  O(T * T / ratio) indices: HCA's dense path (ratio 128) and the CSA warm-up at short lengths.
  """
  T, S = segment_ids.shape[1], entry_segments.shape[1]
  w = jnp.arange(S)
  causal = (w[None, :] + 1) * ratio <= jnp.arange(T)[:, None] + 1  # [T, S]
  visible = causal[None] & (entry_segments[:, None, :] == segment_ids[:, :, None])
  return jnp.where(visible, w[None, None, :], -1).astype(jnp.int32)


class CompressedSparseAttention(nnx.Module):
  """One DeepSeek-V4 attention layer of kind "swa", "csa" or "hca".

  - Queries: `c_q = RMSNorm(x W_qa)`, per head `q = RMSNorm_unweighted(c_q W_qb)` (head_dim), RoPE
    on the last `qk_rope_dim` dims (interleaved) at the token position.
  - One shared KV head with K = V: `kv = RMSNorm(x W_kv)`, same RoPE.
  - Keys: the sliding window of raw kv (all kinds), plus compressed entries (`Compressor`): for
    CSA the indexer's top-k (`ops.flash_topk`, `compress_ratio=csa_ratio`), for HCA every visible
    entry. One `ops.sparse_attention` call runs over `[kv ; entries]` with concatenated index
    lists and the per-head sink `attn_sink`.
  - The output's rope slice is de-rotated (RoPE at -position), then a grouped low-rank output
    projection: `o_groups` groups of heads, each `wo_a` -> o_lora, concatenated -> `wo_b`.
  - CSA's indexer loss: the teacher is the attention mass on compressed entries under the full
    LSE (window + entries + sink), so `ops.indexer_loss` gets the compressed keys and that LSE.

  SWA layers use `rope_theta`; compressed layers `compress_rope_theta` (no YaRN scaling here).
  """

  def __init__(self, cfg: ModelConfig, kind: str, ratio: int, *, rngs: nnx.Rngs):
    if kind not in ("swa", "csa", "hca"):
      raise ValueError(f"CompressedSparseAttention: kind={kind!r} is not 'swa', 'csa' or 'hca'.")
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    linear = lambda i, o, axes: nnx.Linear(i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                           kernel_metadata=shd.param(*axes))
    norm = lambda n: nnx.RMSNorm(n, epsilon=cfg.rms_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                 scale_metadata=shd.param(shd.NORM))
    H, hd, g = cfg.n_heads, cfg.head_dim, cfg.o_groups
    self.cfg, self.kind, self.ratio = cfg, kind, ratio
    self.theta = cfg.rope_theta if kind == "swa" else cfg.compress_rope_theta
    self.wq_a = linear(cfg.d_model, cfg.q_lora_rank, (shd.EMBED, shd.Q_LORA))
    self.q_norm = norm(cfg.q_lora_rank)
    self.wq_b = linear(cfg.q_lora_rank, H * hd, (shd.Q_LORA, shd.HEADS))
    self.wkv = linear(cfg.d_model, hd, (shd.EMBED, None))  # the one shared KV head
    self.kv_norm = norm(hd)
    self.attn_sink = nnx.Param(jnp.zeros((H,), jnp.float32), **shd.param(shd.NORM))
    fan_in = H * hd // g
    # [groups, heads of the group x hd, o_lora]: whole per group, the groups are few.
    self.wo_a = nnx.Param((jax.random.normal(rngs.params(), (g, fan_in, cfg.o_lora_rank), jnp.float32)
                           * fan_in**-0.5).astype(pdtype), **shd.param(None, shd.HEADS, None))
    self.wo_b = linear(g * cfg.o_lora_rank, cfg.d_model, (None, shd.EMBED))
    compressor = lambda dim, rope: Compressor(
        cfg.d_model, dim, ratio, overlap=kind == "csa", rope_dim=rope, rope_theta=self.theta,
        rms_eps=cfg.rms_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype)
    self.compressor = None if kind == "swa" else compressor(hd, cfg.qk_rope_dim)
    self.indexer = None if kind != "csa" else LightningIndexer(
        cfg.d_model, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
        rope_dim=cfg.index_rope_dim, rope_theta=self.theta, rope_interleave=True, rope_first=False,
        hadamard=cfg.indexer_hadamard, key_compressor=compressor(cfg.index_head_dim, cfg.index_rope_dim),
        rngs=rngs, dtype=dtype, param_dtype=pdtype)

  @property
  def scale(self) -> float:
    return self.cfg.head_dim**-0.5

  def queries_and_kv(self, x, positions):
    """(c_q [B, T, q_lora], q [B, T, H, hd], kv [B, T, hd]), RoPE applied."""
    cfg = self.cfg
    B, T, _ = x.shape
    rope = lambda y: rope_tail(y, positions, rope_dim=cfg.qk_rope_dim, theta=self.theta)
    c_q = self.q_norm(self.wq_a(x))
    q = rms_normalize(self.wq_b(c_q).reshape(B, T, cfg.n_heads, cfg.head_dim), cfg.rms_eps)
    return c_q, rope(q), rope(self.kv_norm(self.wkv(x)))

  def __call__(
      self,
      x: Float[Array, "B T D"],
      positions: Int[Array, "B T"],
      segment_ids: Int[Array, "B T"],
      *,
      dense: bool = False,
      shared_indices=None,
      backends=None,
  ) -> AttentionOutput:
    """Attention over the window plus compressed entries; arguments as `MLASparseAttention`'s.

    `dense` is the warm-up stage: CSA attends every visible entry and its indexer KL is dense.
    `shared_indices` is unused (V4 has no IndexShare); the shared decoder loop passes it.

    Returns:
      AttentionOutput(out [B, T, D], CSA's selection i32[B, T, index_topk] into the compressed
      entries (or None), CSA's indexer loss (or None)).
    """
    del shared_indices
    cfg = self.cfg
    B, T, _ = x.shape
    backend = lambda name: getattr(backends, name, "auto") if backends is not None else "auto"
    c_q, q, kv = self.queries_and_kv(x, positions)
    keys, index_lists = kv, [window_indices(segment_ids, cfg.sliding_window)]
    selection = indexer_loss = None
    if self.compressor is not None:
      entries, entry_seg = self.compressor(x, positions, segment_ids)  # [B, S, hd], [B, S]
      segs = (segment_ids, entry_seg)
      index_inputs = None if self.indexer is None else self.indexer(x, c_q, positions, segment_ids)
      if index_inputs is not None and not dense:
        selection = ops.flash_topk(*index_inputs, topk=cfg.index_topk, compress_ratio=self.ratio,
                                   scale=self.indexer.score_scale, segment_ids=segs,
                                   backend=backend("flash_topk")).indices
        chosen = selection
      else:
        chosen = visible_entry_indices(segment_ids, entry_seg, self.ratio)
      keys = jnp.concatenate([kv, entries], axis=1)  # [B, T + S, hd]
      index_lists.append(jnp.where(chosen >= 0, chosen + T, -1))
    indices = jnp.concatenate(index_lists, axis=-1)
    out, lse = ops.sparse_attention(q, keys[:, :, None], None, indices, scale=self.scale,  # K = V
                                    sinks=self.attn_sink[...], backend=backend("sparse_attention"))
    if self.indexer is not None:
      indexer_loss = ops.indexer_loss(
          *index_inputs, q, entries[:, :, None], lse, None if dense else selection,
          attn_scale=self.scale, index_scale=self.indexer.score_scale, compress_ratio=self.ratio,
          segment_ids=segs, grad_in_forward=cfg.indexer_loss_grad_in_forward, backend=backend("indexer_loss"))
    # V carries RoPE: rotate the output's rope slice back to the query's frame.
    out = rope_tail(out, -positions, rope_dim=cfg.qk_rope_dim, theta=self.theta)
    groups = out.reshape(B, T, cfg.o_groups, -1)
    low_rank = jnp.einsum("btgi,gio->btgo", groups, self.wo_a[...].astype(out.dtype))
    return AttentionOutput(self.wo_b(low_rank.reshape(B, T, -1)), selection, indexer_loss)
