"""RMS norms that `nnx.RMSNorm` does not cover: unweighted, and zero-centred (weight applied as 1 + w)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyscale_jax import sharding as shd


def rms_normalize(x: jax.Array, eps: float, *, group_size: int | None = None) -> jax.Array:
  """`x / rms(x)` over the last dim (or over each `group_size` slice of it), in f32; returns x.dtype."""
  xf = x.astype(jnp.float32)
  if group_size is not None:
    xf = xf.reshape(*x.shape[:-1], -1, group_size)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return y.reshape(x.shape).astype(x.dtype)


class ZeroCenteredRMSNorm(nnx.Module):
  """RMSNorm whose weight is applied as (1 + w), w initialised to 0 (Qwen3-Next / Gemma style).

  With `group_size`, each consecutive `group_size` slice of the last dim is normalised on its own
  (Qwen4-Exp's residual streams: one group per stream), and the weight still spans the whole dim.
  """

  def __init__(self, dim: int, *, eps: float, group_size: int | None = None, param_dtype=jnp.float32):
    if group_size is not None and (group_size < 1 or dim % group_size):
      raise ValueError(f"ZeroCenteredRMSNorm: {group_size=} must be >= 1 and divide {dim=}.")
    self.eps, self.group_size = eps, group_size
    self.weight = nnx.Param(jnp.zeros((dim,), param_dtype), **shd.param(shd.NORM))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., dim] -> [..., dim] in x.dtype (computed in f32)."""
    y = rms_normalize(x.astype(jnp.float32), self.eps, group_size=self.group_size)
    return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
