"""DeepSeek-V4's KV compressor (CSA with overlapping windows, HCA without): gated softmax pooling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import sharding as shd
from hyscale_jax.layers.rope import YaRN, apply_rope


def rope_tail(x, positions, *, rope_dim: int, theta: float, yarn: YaRN | None = None):
  """Interleaved RoPE (YaRN-scaled with `yarn`) on the last `rope_dim` dims of x [B, T, ..., D] (V4's `[nope | rope]` layout)."""
  if not rope_dim:
    return x
  pe = apply_rope(x[..., -rope_dim:], positions, theta=theta, interleaved=True, yarn=yarn)
  return jnp.concatenate([x[..., :-rope_dim], pe], axis=-1)


class Compressor(nnx.Module):
  """Pools each window of `ratio` tokens into one entry (architectures.md §3.2).

  Per channel, `C_w = sum_slots softmax(z_slot + B_slot) * a_slot` in f32, then RMSNorm and RoPE at
  the window's first position. Without overlap (HCA) the slots are window w's `ratio` tokens. With
  overlap (CSA) `a` and `z` are twice as wide: the slots are window w-1's first half and window w's
  second half, so an entry spans 2 * ratio tokens with stride `ratio`. Only complete windows are
  emitted (`T // ratio` entries), so entry w depends only on tokens < (w + 1) * ratio: query t may
  use it iff (w + 1) * ratio <= t + 1, the `flash_topk` compress_ratio rule. In packed sequences a
  slot from another document than the window's last token gets no weight, and the entry takes that
  token's segment id. Attribute names follow HF (`wkv`, `wgate`, `position_bias`, `norm`).
  """

  def __init__(self, d_model: int, dim: int, ratio: int, *, overlap: bool, rope_dim: int,
               rope_theta: float, rope_yarn: YaRN | None = None, rms_eps: float = 1e-6, rngs: nnx.Rngs,
               dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32):
    if ratio < 1 or not 0 <= rope_dim <= dim:
      raise ValueError(f"Compressor: {ratio=} must be >= 1 and {rope_dim=} in [0, {dim=}].")
    width = 2 * dim if overlap else dim
    self.dim, self.ratio, self.overlap = dim, ratio, overlap
    self.rope_dim, self.rope_theta, self.rope_yarn = rope_dim, rope_theta, rope_yarn
    linear = lambda: nnx.Linear(d_model, width, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                kernel_metadata=shd.param(shd.EMBED, None))
    self.wkv, self.wgate = linear(), linear()
    self.position_bias = nnx.Param(jnp.zeros((ratio, width), jnp.float32), **shd.param(None, shd.NORM))
    self.norm = nnx.RMSNorm(dim, epsilon=rms_eps, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                            scale_metadata=shd.param(shd.NORM))

  def __call__(
      self,
      x: Float[Array, "B T D"],
      positions: Int[Array, "B T"],
      segment_ids: Int[Array, "B T"],
  ) -> tuple[Float[Array, "B S C"], Int[Array, "B S"]]:
    """(entries [B, T // ratio, dim] in x's dtype, their segment ids i32[B, T // ratio])."""
    B, T, _ = x.shape
    m, c = self.ratio, self.dim
    S = T // m
    windows = lambda y: y[:, : S * m].reshape(B, S, m, *y.shape[2:])
    values = windows(self.wkv(x).astype(jnp.float32))  # [B, S, m, width]
    gates = windows(self.wgate(x).astype(jnp.float32)) + self.position_bias[...]
    slot_seg = windows(segment_ids)  # [B, S, m]
    entry_seg = slot_seg[:, :, -1]
    if self.overlap:  # slots: window w-1's A half (none for w = 0), then window w's B half
      shift = lambda y, fill: jnp.concatenate([jnp.full_like(y[:, :1], fill), y[:, :-1]], axis=1)
      values = jnp.concatenate([shift(values[..., :c], 0.0), values[..., c:]], axis=2)
      gates = jnp.concatenate([shift(gates[..., :c], -jnp.inf), gates[..., c:]], axis=2)
      slot_seg = jnp.concatenate([shift(slot_seg, -1), slot_seg], axis=2)  # [B, S, 2m]
    gates = jnp.where((slot_seg == entry_seg[..., None])[..., None], gates, -jnp.inf)
    pooled = jnp.sum(jax.nn.softmax(gates, axis=2) * values, axis=2)  # [B, S, c]
    entries = self.norm(pooled.astype(x.dtype))
    first_position = windows(positions)[:, :, -1] - (m - 1)
    return rope_tail(entries, first_position, rope_dim=self.rope_dim, theta=self.rope_theta, yarn=self.rope_yarn), entry_seg
