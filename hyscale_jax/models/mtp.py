"""Multi-token prediction (MTP, DeepSeek-V3 section 2.2): extra blocks that predict further-ahead tokens.

Depth d = 0, 1, ... (`model.mtp_depth` of them) at position t combines the previous stage's
representation of t (the main model's for d = 0) with the embedding of token t + 1 + d:

    x = eh_proj([enorm(embed(tok[t + 1 + d])), hnorm(prev_t)])       (D <- 2D, no bias)
    x = block(x)                      (one decoder layer of the model's own kind)
    h = norm(stream_head(x))          (the depth's own final collapse/norm)
    logits = lm_head(h)               (shared with the main model), predicting tok[t + 2 + d]

What `prev` is follows each family's reference: GLM-5.1 and Qwen3.8-Flash-Next hand over the
normalised hidden state (after the final norm / stream mixer, as vLLM's and transformers' MTP
drafters do); DeepSeek-V4 hands over the mHC residual streams [B, T, N, D] before its collapse
(`MTPBlock.forward` in DeepSeek's V4 inference code: `e_proj(e)[:, :, None] + h_proj(hnorm(x))`,
which is `eh_proj` of the concatenation with the embedding broadcast over the streams).
The embedding and LM head are the main model's; the block runs at the main positions t.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import sharding as shd
from hyscale_jax.layers.hyper_connections import expand_streams
from hyscale_jax.model_config import ModelConfig


def shift_left(x: Int[Array, "B T"] | Float[Array, "B T"], shift: int) -> jax.Array:
  """x[:, shift:] padded at the end with zeros back to T (what lies past the window is unknown)."""
  if shift < 0:
    raise ValueError(f"{shift=} must be >= 0.")
  T = x.shape[1]
  shift = min(shift, T)
  return jnp.concatenate([x[:, shift:], jnp.zeros((x.shape[0], shift), x.dtype)], axis=1)


def depth_targets(targets: Int[Array, "B T"], loss_mask: Float[Array, "B T"], depth: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(input tokens, targets, mask) of MTP depth `depth` from the next-token `targets` and `loss_mask`.

  With targets[t] = tok[t + 1]: depth d embeds tok[t + 1 + d] = targets[t + d] and predicts
  tok[t + 2 + d] = targets[t + 1 + d]. The mask is the product of loss_mask[t .. t + 1 + d]: every
  next-token pair on the way is real, so the chain stays inside one packed document (loss_mask is 0
  on each document's last token) and inside the window.

  Returns:
    i32[B, T] input tokens, i32[B, T] targets, f32[B, T] mask.
  """
  if targets.shape != loss_mask.shape or targets.ndim != 2:
    raise ValueError(f"targets {targets.shape} and loss_mask {loss_mask.shape} must both be [B, T].")
  mask = loss_mask.astype(jnp.float32)
  chain = mask
  for j in range(1, depth + 2):
    chain = chain * shift_left(mask, j)
  return shift_left(targets, depth), shift_left(targets, depth + 1), chain


class MTPLayer(nnx.Module):
  """One MTP depth: `enorm`, `hnorm`, `eh_proj` [2D, D], a decoder `block`, its `hc_head` and `norm`.

  Args:
    cfg: the model config.
    block: the depth's decoder layer (a `DecoderLayer` built by the model for layer n_layers + d).
    make_norm: builds one RMSNorm of width D (the family's kind) for `enorm`, `hnorm` and `norm`.
    stream_head: the final collapse of the residual streams (None without hyper-connections); when
      it `replaces_final_norm` the depth has no `norm`.
    streams_in: the previous stage hands over residual streams [B, T, N, D] (DeepSeek-V4) instead of
      a normalised hidden state [B, T, D].
  """

  def __init__(self, cfg: ModelConfig, block: nnx.Module, *, make_norm: Callable[[], nnx.Module],
               stream_head: nnx.Module | None, streams_in: bool, rngs: nnx.Rngs):
    if streams_in and not cfg.hc_mult:
      raise ValueError(f"MTPLayer: streams_in needs residual streams, got model.hc_mult={cfg.hc_mult}.")
    self.n_streams, self.streams_in = cfg.hc_mult, streams_in
    self.enorm, self.hnorm = make_norm(), make_norm()
    self.eh_proj = nnx.Linear(2 * cfg.d_model, cfg.d_model, use_bias=False, rngs=rngs,
                              dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                              kernel_metadata=shd.param(None, shd.EMBED))
    self.block = block
    self.hc_head = stream_head
    self.norm = None if stream_head is not None and stream_head.replaces_final_norm else make_norm()

  def __call__(self, prev, embedded: Float[Array, "B T D"], positions, segment_ids, *, dense=False, backends=None):
    """One depth.

    Args:
      prev: the previous stage's output: f32|bf16[B, T, D] (normalised) or [B, T, N, D] streams.
      embedded: [B, T, D] embeddings of tok[t + 1 + d].
      positions, segment_ids: i32[B, T], as the main model's.

    Returns:
      (what the next depth takes, h [B, T, D] for the LM head, indexer loss f32[] or None,
      expert load f32[E] or None, rows rescued i32[] or None: as `DecoderLayer`'s).
    """
    if prev.ndim != (4 if self.streams_in else 3) or prev.shape[:2] != embedded.shape[:2]:
      raise ValueError(f"MTPLayer: prev {prev.shape} must be [B, T, {'N, ' if self.streams_in else ''}D] "
                       f"over the same [B, T] as embedded {embedded.shape}.")
    e = self.enorm(embedded)
    if prev.ndim == 4:  # the embedding joins every stream
      e = jnp.broadcast_to(e[:, :, None, :], prev.shape)
    x = self.eh_proj(jnp.concatenate([e, self.hnorm(prev).astype(e.dtype)], axis=-1))
    if self.n_streams and x.ndim == 3:
      x = expand_streams(x, self.n_streams)
    x, _, indexer_loss, load, rescued = self.block(x, positions, segment_ids, dense=dense, backends=backends)
    h = x if self.hc_head is None else self.hc_head(x)
    h = h if self.norm is None else self.norm(h)
    return (x if self.streams_in else h), h, indexer_loss, load, rescued
