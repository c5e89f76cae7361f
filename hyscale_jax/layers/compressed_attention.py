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
from hyscale_jax.layers.rope import yarn_of
from hyscale_jax.model_config import ModelConfig


def window_indices(segment_ids: Int[Array, "B T"], window: int) -> Int[Array, "B T W"]:
  """i32[B, T, W]: token t's sliding-window keys t-W+1 .. t of its own document, -1 elsewhere."""
  T = segment_ids.shape[1]
  keys = jnp.arange(T)[:, None] - window + 1 + jnp.arange(window)[None, :]  # [T, W]
  safe = jnp.clip(keys, 0, T - 1)
  same = jnp.take_along_axis(segment_ids[:, None, :], safe[None], axis=2) == segment_ids[:, :, None]
  return jnp.where((keys >= 0)[None] & same, keys[None], -1).astype(jnp.int32)


def merge_attention(
    parts: list[tuple[Float[Array, "B T H D"], Float[Array, "B T H"]]],
    sinks: Float[Array, "H"],
) -> tuple[Float[Array, "B T H D"], Float[Array, "B T H"]]:
  """One softmax over disjoint key sets, each attended on its own, plus a per-head sink.

  With part i's (out_i, lse_i) normalised over its own keys: `lse = logsumexp(lse_1, .., sinks)` and
  `out = sum_i out_i * exp(lse_i - lse)`, exactly the softmax over all keys at once with the sink
  in the denominator. Differentiable in every out_i, lse_i and the sinks; a part with lse -inf (no
  key) weighs 0 and gets zero gradient.

  Args:
    parts: (out bf16|f32[B, T, H, D], lse f32[B, T, H]) pairs, as `ops.sparse_attention` (without
      sinks) and `ops.causal_attention(..., return_lse=True)` return them.
    sinks: f32[H] logits that add exp(sinks[h]) to the denominator and no value.

  Returns:
    (out [B, T, H, D] in the first part's dtype, f32 sums; lse f32[B, T, H] including the sink).
  """
  lse_parts = [lse for _, lse in parts]
  sink = jnp.broadcast_to(sinks.astype(jnp.float32), lse_parts[0].shape)
  lse = jax.nn.logsumexp(jnp.stack([*lse_parts, sink]), axis=0)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # every part and the sink -inf: all weights are 0
  out = sum(o.astype(jnp.float32) * jnp.exp(l - safe)[..., None] for o, l in parts)
  return out.astype(parts[0][0].dtype), lse


class CompressedSparseAttention(nnx.Module):
  """One DeepSeek-V4 attention layer of kind "swa", "csa" or "hca".

  - Queries: `c_q = RMSNorm(x W_qa)`, per head `q = RMSNorm_unweighted(c_q W_qb)` (head_dim), RoPE
    on the last `qk_rope_dim` dims (interleaved) at the token position.
  - One shared KV head with K = V: `kv = RMSNorm(x W_kv)`, same RoPE.
  - Keys: the sliding window of raw kv (all kinds), plus compressed entries (`Compressor`): for
    CSA the indexer's top-k (`ops.flash_topk`, `compress_ratio=csa_ratio`), for HCA (and CSA's
    dense warm-up) every visible entry. All of them and the per-head sink `attn_sink` share one
    softmax:
    - SWA and sparse CSA: one `ops.sparse_attention` call over `[kv ; entries]` with concatenated
      index lists and the sink.
    - Every visible entry: `ops.sparse_attention` over the window (no sink) and
      `ops.causal_attention(compress_ratio=ratio, return_lse=True)` over the entries (MQA, K = V),
      streamed in key blocks with no [T, S] index or logit array, merged with the sink by their
      LSEs (`merge_attention`).
  - The output's rope slice is de-rotated (RoPE at -position), then a grouped low-rank output
    projection: `o_groups` groups of heads, each `wo_a` -> o_lora, concatenated -> `wo_b`.
  - CSA's indexer loss: the teacher is the attention mass on compressed entries under the full
    LSE (window + entries + sink), so `ops.indexer_loss` gets the compressed keys and that LSE.

  SWA layers use `rope_theta`; compressed layers `compress_rope_theta`, YaRN-scaled when the config
  has `rope_yarn_factor` (layers/rope.py; V4 keeps its softmax scale head_dim^{-1/2}).
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
    self.yarn = None if kind == "swa" else yarn_of(cfg)
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
        cfg.d_model, dim, ratio, overlap=kind == "csa", rope_dim=rope, rope_theta=self.theta, rope_yarn=self.yarn,
        rms_eps=cfg.rms_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype)
    self.compressor = None if kind == "swa" else compressor(hd, cfg.qk_rope_dim)
    self.indexer = None if kind != "csa" else LightningIndexer(
        cfg.d_model, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
        rope_dim=cfg.index_rope_dim, rope_theta=self.theta, rope_yarn=self.yarn, rope_interleave=True, rope_first=False,
        hadamard=cfg.indexer_hadamard, key_compressor=compressor(cfg.index_head_dim, cfg.index_rope_dim),
        rngs=rngs, dtype=dtype, param_dtype=pdtype)

  @property
  def scale(self) -> float:
    return self.cfg.head_dim**-0.5

  def queries_and_kv(self, x, positions):
    """(c_q [B, T, q_lora], q [B, T, H, hd], kv [B, T, hd]), RoPE applied."""
    cfg = self.cfg
    B, T, _ = x.shape
    rope = lambda y: rope_tail(y, positions, rope_dim=cfg.qk_rope_dim, theta=self.theta, yarn=self.yarn)
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
    T = x.shape[1]
    backend = lambda name: getattr(backends, name, "auto") if backends is not None else "auto"
    c_q, q, kv = self.queries_and_kv(x, positions)
    window = window_indices(segment_ids, cfg.sliding_window)
    sinks = self.attn_sink[...]
    # K = V: the values are the keys (v=None).
    sparse = lambda keys, indices, **kw: ops.sparse_attention(
        q, keys[:, :, None], None, indices, scale=self.scale, deterministic=cfg.sparse_attention_deterministic,
        backend=backend("sparse_attention"), **kw)
    selection = indexer_loss = rescued = None
    if self.compressor is None:
      out, lse = sparse(kv, window, sinks=sinks)
    else:
      entries, entry_seg = self.compressor(x, positions, segment_ids)  # [B, S, hd], [B, S]
      segs = (segment_ids, entry_seg)
      index_inputs = None if self.indexer is None else self.indexer(x, c_q, positions, segment_ids)
      if index_inputs is not None and not dense:
        selection, rescued = ops.flash_topk(*index_inputs, topk=cfg.index_topk, compress_ratio=self.ratio,
                                            scale=self.indexer.score_scale, segment_ids=segs, sorted=False,
                                            backend=backend("flash_topk"), with_stats=True)
        selection, rescued = selection.indices, jnp.sum(rescued, dtype=jnp.int32)
        indices = jnp.concatenate([window, jnp.where(selection >= 0, selection + T, -1)], axis=-1)
        out, lse = sparse(jnp.concatenate([kv, entries], axis=1), indices, sinks=sinks)  # [B, T + S, hd] keys
      else:  # every visible entry, streamed: nothing [T, S]
        parts = [sparse(kv, window)]
        if entries.shape[1]:  # none before the first `ratio` tokens
          e = entries[:, :, None]
          parts.append(ops.causal_attention(q, e, e, scale=self.scale, segment_ids=segs, compress_ratio=self.ratio,
                                            return_lse=True, backend=backend("causal_attention")))
        out, lse = merge_attention(parts, sinks)
    if self.indexer is not None:
      indexer_loss = ops.indexer_loss(
          *index_inputs, q, entries[:, :, None], lse, None if dense else selection,
          attn_scale=self.scale, index_scale=self.indexer.score_scale, compress_ratio=self.ratio,
          segment_ids=segs, grad_in_forward=cfg.indexer_loss_grad_in_forward, backend=backend("indexer_loss"))
    return AttentionOutput(self.project_out(out, positions), selection, indexer_loss, rescued)

  def project_out(self, out: Float[Array, "B T H hd"], positions: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    """The attention output [B, T, H, hd] de-rotated and through the grouped low-rank projection."""
    cfg = self.cfg
    B, T = out.shape[:2]
    # V carries RoPE: rotate the output's rope slice back to the query's frame.
    # With a YaRN rope_scale this scales the slice once more, as transformers' de-rotation does.
    out = rope_tail(out, -positions, rope_dim=cfg.qk_rope_dim, theta=self.theta, yarn=self.yarn)
    groups = out.reshape(B, T, cfg.o_groups, -1)
    low_rank = jnp.einsum("btgi,gio->btgo", groups, self.wo_a[...].astype(out.dtype))
    return self.wo_b(low_rank.reshape(B, T, -1))
