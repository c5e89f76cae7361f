"""Gated DeltaNet (architectures.md §4.1): Qwen3.8-Flash-Next's linear-attention layers, 3 of every 4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import ops
from hyscale_jax import sharding as shd
from hyscale_jax.layers.mla import AttentionOutput
from hyscale_jax.layers.norms import rms_normalize
from hyscale_jax.model_config import ModelConfig

_GATES = {"sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu}


def causal_depthwise_conv(x: Float[Array, "B T C"], kernel: Float[Array, "K C"],
                          segment_ids: Int[Array, "B T"], *, dilation: int = 1) -> Float[Array, "B T C"]:
  """out[t] = sum_j kernel[j] * x[t - (K-1-j) * dilation] over the taps in t's document (others count as 0).

  transformers' `causal_conv1d_fn` (a depthwise conv1d padded by (K-1) * dilation on the left) with
  the window cut at document starts, so packed documents do not see each other. Computed in f32 as
  K shifted products: a sequence split over a mesh axis needs only a (K-1) * dilation token halo,
  which XLA inserts.
  """
  K, T = kernel.shape[0], x.shape[1]
  xf, out = x.astype(jnp.float32), jnp.zeros(x.shape, jnp.float32)
  for j in range(K):
    shift = (K - 1 - j) * dilation
    if shift >= T:
      continue
    past = jnp.pad(xf, ((0, 0), (shift, 0), (0, 0)))[:, :T]
    same = jnp.pad(segment_ids, ((0, 0), (shift, 0)), constant_values=-1)[:, :T] == segment_ids
    same = same & (jnp.arange(T) >= shift)  # the left padding is not a token, whatever its id
    out = out + jnp.where(same[..., None], past, 0.0) * kernel[j].astype(jnp.float32)
  return out.astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last dim, in f32 (flash-linear-attention's and transformers' form)."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
  """The Gated DeltaNet mixer, with transformers' `Qwen4ExpTextGatedDeltaNet` parameter names.

  x [B, T, D] -> `in_proj_qkv` -> short causal depthwise conv (`conv1d`, kernel [K, C], no bias;
  windows cut at document starts) -> SiLU -> q, k [B, T, Hk, Dk] (L2-normalised), v [B, T, Hv, Dv].
  Per value head: beta = sigmoid(`in_proj_b` x), the log decay g = -exp(`A_log`) *
  softplus(`in_proj_a` x + `dt_bias`) (f32). `ops.gated_delta_rule` (state reset at each document)
  gives o [B, T, Hv, Dv]; the gated RMSNorm `norm` (weight w, initialised to 1) makes
  `w * rms_normalize(o) * act(z)` with z = `in_proj_z` x and act sigmoid or SiLU
  (`cfg.linear_output_gate`); `out_proj` maps Hv*Dv back to D.
  """

  indexer = None  # no selection: the decoder's IndexShare bookkeeping skips this layer

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    linear = lambda i, o, axes: nnx.Linear(i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                           kernel_metadata=shd.param(*axes))
    self.cfg = cfg
    Hv = cfg.linear_n_value_heads
    key_dim, value_dim = cfg.linear_n_key_heads * cfg.linear_key_dim, Hv * cfg.linear_value_dim
    self.in_proj_qkv = linear(cfg.d_model, 2 * key_dim + value_dim, (shd.EMBED, shd.HEADS))
    self.in_proj_z = linear(cfg.d_model, value_dim, (shd.EMBED, shd.HEADS))
    self.in_proj_b = linear(cfg.d_model, Hv, (shd.EMBED, None))
    self.in_proj_a = linear(cfg.d_model, Hv, (shd.EMBED, None))
    K = cfg.linear_conv_kernel
    self.conv1d = nnx.Param(jax.random.uniform(rngs.params(), (K, 2 * key_dim + value_dim), pdtype, -1, 1) * K**-0.5,
                            **shd.param(None, shd.HEADS))
    self.dt_bias = nnx.Param(jnp.ones((Hv,), pdtype), **shd.param(shd.NORM))
    # Decay rates exp(A_log) in [1, 16], as flash-linear-attention draws them.
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (Hv,), jnp.float32, 1, 16)).astype(pdtype),
                           **shd.param(shd.NORM))
    self.norm = nnx.Param(jnp.ones((cfg.linear_value_dim,), pdtype), **shd.param(shd.NORM))
    self.out_proj = linear(value_dim, cfg.d_model, (shd.HEADS, shd.EMBED))

  def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], segment_ids: Int[Array, "B T"], *,
               dense: bool = False, shared_indices=None, backends=None) -> AttentionOutput:
    """AttentionOutput(out [B, T, D] in x.dtype, None, None): the attention layers' call and result.

    `positions`, `dense` and `shared_indices` do not apply (no RoPE, no selection).
    """
    del positions, dense, shared_indices
    cfg = self.cfg
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = cfg.linear_n_key_heads, cfg.linear_n_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    mixed = jax.nn.silu(causal_depthwise_conv(self.in_proj_qkv(x), self.conv1d[...], segment_ids))
    q, k, v = jnp.split(mixed, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q, k = l2_normalize(q.reshape(B, T, Hk, Dk)), l2_normalize(k.reshape(B, T, Hk, Dk))
    beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
    a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
    backend = getattr(backends, "gated_delta_rule", "auto") if backends is not None else "auto"
    out = ops.gated_delta_rule(q, k, v.reshape(B, T, Hv, Dv), g, beta, segment_ids=segment_ids,
                               chunk=cfg.linear_chunk, backend=backend)
    # transformers' RMSNormGated: normalise in f32, weight in the input dtype, gate in f32.
    z = self.in_proj_z(x).reshape(B, T, Hv, Dv).astype(jnp.float32)
    out = (self.norm[...].astype(out.dtype) * rms_normalize(out, cfg.rms_eps)).astype(jnp.float32)
    out = (out * _GATES[cfg.linear_output_gate](z)).astype(x.dtype)
    return AttentionOutput(self.out_proj(out.reshape(B, T, Hv * Dv)), None, None)
