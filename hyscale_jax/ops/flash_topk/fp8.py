"""fp8 inputs for `flash_topk`: per-row e4m3 quantization, as DeepSeek-V3.2's indexer feeds it."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from hyscale_jax.ops.flash_topk.reference import FP8

E4M3_MAX = 448.0  # the largest float8_e4m3fn value


def quantize_fp8(
    x: Float[Array, "*rows D"], *, power_of_two: bool = False
) -> tuple[Float[Array, "*rows D"], Float[Array, "*rows"]]:
  """Per-row fp8: `(values float8_e4m3fn[..., D], scales f32[...])` with `x ~ values * scales[..., None]`.

  One scale per row of the last axis, `amax / 448` (all-zero rows get scale 1), so each row's
  largest magnitude maps to e4m3's largest value; values round to nearest. With `power_of_two` the
  scale is rounded up to a power of two, like DeepSeek-V3.2's ue8m0 scales. For `flash_topk`,
  quantize q [B, Tq, H, D] (its scales [B, Tq, H] are `q_scale`) and k [B, Tk, D] (`k_scale`).
  """
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  if power_of_two:  # scale = m * 2^e with m in [0.5, 1): the next power of two is 2^e (2^(e-1) if m = 0.5)
    mantissa, exponent = jnp.frexp(scale)
    scale = jnp.ldexp(jnp.float32(1.0), exponent - (mantissa == 0.5))
  values = jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX)  # x / (amax / 448) can round past 448
  return values.astype(FP8), scale
