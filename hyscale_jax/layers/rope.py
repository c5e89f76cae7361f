"""Rotary position embedding on a slice of the head dim, in the interleaved or half-split layout, with
optional YaRN frequency scaling (`YaRN`): the one place of the RoPE frequency and mscale math."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

if TYPE_CHECKING:
  from hyscale_jax.model_config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YaRN:
  """YaRN RoPE scaling (Peng et al. 2023), with transformers' `rope_type: "yarn"` conventions.

  Frequencies: per pair i of a `rope_dim`-wide slice, `f_i = theta^(-2i / rope_dim)` is kept for
  high-frequency pairs (more than `beta_fast` turns over `original_max_len` positions), divided by
  `factor` for low-frequency ones (fewer than `beta_slow` turns), and linearly blended between them.

  Attention-scale convention (two separate factors, as transformers and DeepSeek's reference apply them):
  - `rope_scale` multiplies the rotated slice (cos and sin), of queries and keys alike, so it scales
    the rope part of every logit by its square. It is `attention_factor` when given (> 0), else
    `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are given (DeepSeek-V3's
    convention: 1.0 for its mscale = mscale_all_dim = 1), else `mscale(factor) = 0.1 ln(factor) + 1`.
    DeepSeek-V4's compressed layers set `attention_factor = 1.0` (transformers forces it: V4's
    reference does not scale cos/sin).
  - `softmax_scale` multiplies MLA's softmax scale (the whole q.k, nope dims too):
    `mscale(factor, mscale_all_dim)^2` when `mscale_all_dim` is given, else 1. Only MLA (GLM-5,
    V3.2) applies it; DeepSeek-V4's attention and every indexer score keep their scales.
  """

  factor: float
  original_max_len: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  attention_factor: float = 0.0  # 0: derived from factor / mscale / mscale_all_dim (see the class docstring)
  truncate: bool = True  # round the blend's dimension range outwards to whole pairs

  def __post_init__(self):
    if not self.factor >= 1:
      raise ValueError(f"YaRN factor={self.factor} must be >= 1.")
    if not isinstance(self.original_max_len, int) or self.original_max_len < 1:
      raise ValueError(f"YaRN original_max_len={self.original_max_len!r} must be a positive int.")
    if self.beta_fast <= 0 or self.beta_slow <= 0 or self.attention_factor < 0:
      raise ValueError(f"YaRN beta_fast={self.beta_fast}, beta_slow={self.beta_slow} must be > 0 and "
                       f"attention_factor={self.attention_factor} >= 0.")

  @property
  def rope_scale(self) -> float:
    """The factor on cos and sin (transformers' `attention_factor` / `attention_scaling`)."""
    if self.attention_factor:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)

  @property
  def softmax_scale(self) -> float:
    """The factor on MLA's softmax scale: `mscale(factor, mscale_all_dim)^2`, 1 without `mscale_all_dim`."""
    return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

  def correction_range(self, rope_dim: int, theta: float) -> tuple[float, float]:
    """(low, high): the pair indices where the blend from kept to interpolated frequencies runs."""
    # The pair index whose frequency turns `turns` times over the original context.
    dim_of = lambda turns: rope_dim * math.log(self.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope_dim - 1)

  def inverse_frequencies(self, rope_dim: int, theta: float) -> Float[Array, "R2"]:
    """f32[rope_dim // 2]: the blended inverse frequencies (f32 throughout, as transformers computes them)."""
    low, high = self.correction_range(rope_dim, theta)
    high = high + 0.001 if low == high else high  # a one-point ramp would divide by zero
    ramp = jnp.clip((jnp.arange(rope_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    base = theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)
    return (1.0 / (self.factor * base)) * ramp + (1.0 / base) * (1 - ramp)


def yarn_of(cfg: ModelConfig) -> YaRN | None:
  """The config's YaRN scaling (`rope_yarn_*` fields), or None when `rope_yarn_factor` is 0."""
  if not cfg.rope_yarn_factor:
    return None
  return YaRN(factor=cfg.rope_yarn_factor, original_max_len=cfg.rope_yarn_original_max_len,
              beta_fast=cfg.rope_yarn_beta_fast, beta_slow=cfg.rope_yarn_beta_slow, mscale=cfg.rope_yarn_mscale,
              mscale_all_dim=cfg.rope_yarn_mscale_all_dim, attention_factor=cfg.rope_yarn_attention_factor,
              truncate=cfg.rope_yarn_truncate)


def rope_inverse_frequencies(rope_dim: int, theta: float, yarn: YaRN | None = None) -> Float[Array, "R2"]:
  """f32[rope_dim // 2]: theta^(-2i / rope_dim), YaRN-scaled when `yarn` is given."""
  if yarn is not None:
    return yarn.inverse_frequencies(rope_dim, theta)
  return 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))


def apply_rope(
    x: Float[Array, "B T *N R"],
    positions: Int[Array, "B T"],
    *,
    theta: float,
    interleaved: bool,
    yarn: YaRN | None = None,
) -> Float[Array, "B T *N R"]:
  """Rotates the last dim of x by its token's position; computes in f32, returns x.dtype.

  Args:
    x: [B, T, R] or [B, T, N, R]; R is even.
    positions: i32[B, T] position of each token (within its packed document).
    theta: the RoPE base.
    interleaved: pairs are (2i, 2i+1) (DeepSeek/MLA) when True, (i, i + R/2) (NeoX) when False.
    yarn: YaRN scaling: its frequencies, and its `rope_scale` on the rotated values (see `YaRN`).
  """
  rope_dim = x.shape[-1]
  angles = positions.astype(jnp.float32)[..., None] * rope_inverse_frequencies(rope_dim, theta, yarn)  # [B, T, R/2]
  if x.ndim == 4:
    angles = angles[:, :, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if yarn is not None and yarn.rope_scale != 1.0:
    cos, sin = cos * yarn.rope_scale, sin * yarn.rope_scale
  xf = x.astype(jnp.float32)
  if interleaved:
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)
  else:
    first, second = xf[..., : rope_dim // 2], xf[..., rope_dim // 2 :]
    out = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
  return out.astype(x.dtype)
