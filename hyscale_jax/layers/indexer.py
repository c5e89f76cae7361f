"""The DSA lightning indexer (DeepSeek-V3.2 §2.1): per-head queries, one shared key, head weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


class LightningIndexer(nnx.Module):
  """Produces the inputs of `ops.flash_topk` and `ops.indexer_loss` from a block's hidden state.

  Attribute names follow the Hugging Face DSA checkpoints (`wq_b`, `wk`, `k_norm`, `weights_proj`).
  The inputs are detached: the indexer learns only from the indexer KL loss, never from the LM loss.
  `weights_proj` is kept in f32, as in the reference.
  """

  def __init__(
      self,
      d_model: int,
      q_lora_rank: int,
      num_heads: int,
      head_dim: int,
      *,
      rngs: nnx.Rngs,
      dtype: jnp.dtype = jnp.float32,
      param_dtype: jnp.dtype = jnp.float32,
  ):
    self.num_heads, self.head_dim = num_heads, head_dim
    linear = lambda i, o, **kw: nnx.Linear(i, o, use_bias=False, rngs=rngs, **kw)
    self.wq_b = linear(q_lora_rank, num_heads * head_dim, dtype=dtype, param_dtype=param_dtype)
    self.wk = linear(d_model, head_dim, dtype=dtype, param_dtype=param_dtype)
    self.k_norm = nnx.LayerNorm(head_dim, epsilon=1e-6, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.weights_proj = linear(d_model, num_heads, dtype=jnp.float32, param_dtype=jnp.float32)

  @property
  def score_scale(self) -> float:
    """The d_I^{-1/2} factor of the index score (pass as `scale=` to the ops)."""
    return self.head_dim**-0.5

  def __call__(
      self, x: Float[Array, "B T D"], q_latent: Float[Array, "B T L"]
  ) -> tuple[Float[Array, "B T HI DI"], Float[Array, "B T DI"], Float[Array, "B T HI"]]:
    """Returns (q [B, T, HI, DI], k [B, T, DI], weights f32[B, T, HI]) from detached inputs.

    Args:
      x: [B, T, D] the attention block's input (after the pre-attention norm).
      q_latent: [B, T, L] the normalised query latent c^Q (or x itself without a q low-rank path).
    """
    x, q_latent = jax.lax.stop_gradient((x, q_latent))
    B, T, _ = x.shape
    q = self.wq_b(q_latent).reshape(B, T, self.num_heads, self.head_dim)  # [B, T, HI, DI]
    k = self.k_norm(self.wk(x))  # [B, T, DI]
    weights = self.weights_proj(x.astype(jnp.float32)) * self.num_heads**-0.5  # [B, T, HI]
    return q, k, weights
