"""Rotary position embedding on a slice of the head dim, in the interleaved or half-split layout."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_inverse_frequencies(rope_dim: int, theta: float) -> Float[Array, "R2"]:
  """f32[rope_dim // 2]: theta^(-2i / rope_dim)."""
  return 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))


def apply_rope(
    x: Float[Array, "B T *N R"],
    positions: Int[Array, "B T"],
    *,
    theta: float,
    interleaved: bool,
) -> Float[Array, "B T *N R"]:
  """Rotates the last dim of x by its token's position; computes in f32, returns x.dtype.

  Args:
    x: [B, T, R] or [B, T, N, R]; R is even.
    positions: i32[B, T] position of each token (within its packed document).
    theta: the RoPE base.
    interleaved: pairs are (2i, 2i+1) (DeepSeek/MLA) when True, (i, i + R/2) (NeoX) when False.
  """
  rope_dim = x.shape[-1]
  angles = positions.astype(jnp.float32)[..., None] * rope_inverse_frequencies(rope_dim, theta)  # [B, T, R/2]
  if x.ndim == 4:
    angles = angles[:, :, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  if interleaved:
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)
  else:
    first, second = xf[..., : rope_dim // 2], xf[..., rope_dim // 2 :]
    out = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
  return out.astype(x.dtype)
