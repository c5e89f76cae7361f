"""The SwiGLU feed-forward block: dense FFN layers and the MoE's shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from hyscale_jax import sharding as shd


def swiglu(gate: jax.Array, up: jax.Array, limit: float = 0.0) -> jax.Array:
  """`silu(gate) * up`; with `limit > 0` (DeepSeek-V4) gate is clamped to <= limit and up to [-limit, limit]."""
  if limit:
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
  return jax.nn.silu(gate) * up


class MLP(nnx.Module):
  """SwiGLU feed-forward: `down_proj(silu(gate_proj(x)) * up_proj(x))`.

  Attribute names follow the Hugging Face checkpoint keys (`gate_proj`, `up_proj`, `down_proj`),
  so conversion is a key map. No biases, as in the DeepSeek and GLM checkpoints.
  """

  def __init__(
      self,
      d_model: int,
      hidden: int,
      *,
      swiglu_limit: float = 0.0,
      rngs: nnx.Rngs,
      dtype: jnp.dtype = jnp.float32,
      param_dtype: jnp.dtype = jnp.float32,
  ):
    """Builds the three projections.

    Args:
      d_model: D, the model width (input and output).
      hidden: F, the inner width.
      swiglu_limit: the SwiGLU clamp (see `swiglu`); 0 disables it.
      rngs: supplies the `params` stream for the kernels.
      dtype: compute dtype of the matmuls.
      param_dtype: storage dtype of the kernels.
    """
    linear = lambda i, o, axes: nnx.Linear(
        i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype, kernel_metadata=shd.param(*axes)
    )
    self.swiglu_limit = swiglu_limit
    self.gate_proj = linear(d_model, hidden, (shd.EMBED, shd.MLP))
    self.up_proj = linear(d_model, hidden, (shd.EMBED, shd.MLP))
    self.down_proj = linear(hidden, d_model, (shd.MLP, shd.EMBED))

  def __call__(self, x: Float[Array, "B T D"], *, backends=None) -> Float[Array, "B T D"]:
    """Applies the SwiGLU block.

    Args:
      x: bf16|f32[B, T, D] (any leading dims work; only the last one is contracted).
      backends: ignored (plain dense matmuls); accepted so a decoder layer calls its MLP and its MoE alike.

    Returns:
      [B, T, D] in the module `dtype` (nnx.Linear promotes its inputs to it).
    """
    del backends
    h = swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit)  # [B, T, F]
    return self.down_proj(h)  # [B, T, D]
