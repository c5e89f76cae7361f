"""The DSA lightning indexer (DeepSeek-V3.2 §2.1, GLM-5): per-head queries, one shared key, head weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import sharding as shd
from hyscale_jax.layers.rope import YaRN, apply_rope


def hadamard_matrix(n: int) -> np.ndarray:
  """The orthonormal Sylvester-Hadamard matrix H_n / sqrt(n); n is a power of two."""
  if n < 1 or n & (n - 1):
    raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {n=}.")
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(n)


class LightningIndexer(nnx.Module):
  """Produces the inputs of `ops.flash_topk` and `ops.indexer_loss` from a block's hidden state.

  Score: `I[t, s] = score_scale * sum_j w[t, j] * relu(<q[t, j], k[s]>)`. Attribute names follow
  the Hugging Face DSA checkpoints (`wq_b`, `wk`, `k_norm`, `weights_proj`); `weights_proj` is kept
  in f32, as in the reference. The inputs are detached: the indexer learns only from the indexer
  KL loss, never from the LM loss.

  Flags that published checkpoints disagree on (architectures.md §2):
    rope_interleave: RoPE pairs (2i, 2i+1) when True, half-split when False.
    rope_first: RoPE on the first `rope_dim` dims (`[pe | nope]`) when True, else on the last.
    scoring_relu: when False the score is linear, `sum_j w_j <q_j, k>`. It is computed exactly by
      the same ReLU-sum op as two heads `q' = sum_j w_j q_j` and `-q'` with weights (1, -1), since
      relu(a) - relu(-a) = a.
    hadamard: rotate q and k by the orthonormal Hadamard matrix (leaves scores unchanged in exact
      arithmetic; the reference uses it for FP8).
    key_compressor: DeepSeek-V4's CSA indexer scores compressed entries: a `Compressor` (which
      applies its own norm and RoPE) replaces `wk`/`k_norm`, and the keys are [B, T // ratio, DI].
  """

  def __init__(
      self,
      d_model: int,
      q_lora_rank: int,
      num_heads: int,
      head_dim: int,
      *,
      rope_dim: int = 0,
      rope_theta: float = 10000.0,
      rope_yarn: YaRN | None = None,
      rope_interleave: bool = False,
      rope_first: bool = True,
      scoring_relu: bool = True,
      hadamard: bool = False,
      key_compressor=None,
      rngs: nnx.Rngs,
      dtype: jnp.dtype = jnp.float32,
      param_dtype: jnp.dtype = jnp.float32,
  ):
    if not 0 <= rope_dim <= head_dim or rope_dim % 2:
      raise ValueError(f"indexer {rope_dim=} must be even and in [0, {head_dim=}].")
    if hadamard:
      hadamard_matrix(head_dim)  # validates the size now rather than at the first call
    self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
    self.rope_theta, self.rope_interleave, self.rope_first = rope_theta, rope_interleave, rope_first
    self.rope_yarn = rope_yarn
    self.scoring_relu, self.hadamard = scoring_relu, hadamard
    linear = lambda i, o, axes, **kw: nnx.Linear(i, o, use_bias=False, rngs=rngs, kernel_metadata=shd.param(*axes),
                                                 **kw)
    self.wq_b = linear(q_lora_rank, num_heads * head_dim, (shd.Q_LORA, shd.INDEX), dtype=dtype,
                       param_dtype=param_dtype)
    if key_compressor is None:
      self.wk = linear(d_model, head_dim, (shd.EMBED, shd.INDEX), dtype=dtype, param_dtype=param_dtype)
      self.k_norm = nnx.LayerNorm(head_dim, epsilon=1e-6, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                  scale_metadata=shd.param(shd.NORM), bias_metadata=shd.param(shd.NORM))
    self.compressor = key_compressor
    self.weights_proj = linear(d_model, num_heads, (shd.EMBED, shd.INDEX), dtype=jnp.float32,
                               param_dtype=jnp.float32)

  @property
  def score_scale(self) -> float:
    """The d_I^{-1/2} factor of the index score (pass as `scale=` to the ops)."""
    return self.head_dim**-0.5

  def _rope(self, x, positions):
    if not self.rope_dim:
      return x
    r = self.rope_dim
    pe, nope = (x[..., :r], x[..., r:]) if self.rope_first else (x[..., -r:], x[..., :-r])
    pe = apply_rope(pe, positions, theta=self.rope_theta, interleaved=self.rope_interleave, yarn=self.rope_yarn)
    return jnp.concatenate([pe, nope] if self.rope_first else [nope, pe], axis=-1)

  def queries(
      self,
      x: Float[Array, "B T D"],
      q_latent: Float[Array, "B T L"],
      positions: Int[Array, "B T"] | None = None,
  ) -> tuple[Float[Array, "B T HI DI"], Float[Array, "B T HI"]]:
    """The query side of `__call__`: (q [B, T, HI, DI], weights f32[B, T, HI]) of some query rows.

    Row-local, so it runs on any slice of rows (with their positions) and gives those rows of the
    whole call's result; MLA's query chunking relies on it.
    """
    x, q_latent = jax.lax.stop_gradient((x, q_latent))
    B, T, _ = x.shape
    q = self._rope(self.wq_b(q_latent).reshape(B, T, self.num_heads, self.head_dim), _positions(x, positions))
    if self.hadamard:
      q = q @ jnp.asarray(hadamard_matrix(self.head_dim), q.dtype)
    weights = self.weights_proj(x.astype(jnp.float32)) * self.num_heads**-0.5  # [B, T, HI]
    if not self.scoring_relu:
      merged = jnp.einsum("bthd,bth->btd", q.astype(jnp.float32), weights).astype(q.dtype)
      q = jnp.stack([merged, -merged], axis=2)  # [B, T, 2, DI]
      weights = jnp.broadcast_to(jnp.asarray([1.0, -1.0], jnp.float32), (B, T, 2))
    return q, weights

  def keys(
      self,
      x: Float[Array, "B T D"],
      positions: Int[Array, "B T"] | None = None,
      segment_ids: Int[Array, "B T"] | None = None,
  ) -> Float[Array, "B S DI"]:
    """The key side of `__call__`: k [B, S, DI] (S = T, or T // ratio with a key compressor)."""
    x = jax.lax.stop_gradient(x)
    B, T, _ = x.shape
    positions = _positions(x, positions)
    if self.compressor is None:
      k = self._rope(self.k_norm(self.wk(x)), positions)  # [B, T, DI]
    else:
      if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
      k = self.compressor(x, positions, segment_ids)[0]  # [B, T // ratio, DI]
    if self.hadamard:
      k = k @ jnp.asarray(hadamard_matrix(self.head_dim), k.dtype)
    return k

  def __call__(
      self,
      x: Float[Array, "B T D"],
      q_latent: Float[Array, "B T L"],
      positions: Int[Array, "B T"] | None = None,
      segment_ids: Int[Array, "B T"] | None = None,
  ) -> tuple[Float[Array, "B T HI DI"], Float[Array, "B S DI"], Float[Array, "B T HI"]]:
    """Returns (q [B, T, HI, DI], k [B, S, DI], weights f32[B, T, HI]) from detached inputs.

    S is T, or T // ratio with a key compressor. With `scoring_relu=False`, HI is 2 (see the class
    docstring). The same as `queries(x, q_latent, positions)` and `keys(x, positions, segment_ids)`.

    Args:
      x: [B, T, D] the attention block's input (after the pre-attention norm).
      q_latent: [B, T, L] the normalised query latent c^Q (or x itself without a q low-rank path).
      positions: i32[B, T] token positions for RoPE (default 0..T-1).
      segment_ids: i32[B, T] packed-document ids, for the key compressor (default one document).
    """
    q, weights = self.queries(x, q_latent, positions)
    return q, self.keys(x, positions, segment_ids), weights


def _positions(x, positions):
  """`positions`, or 0..T-1 in every row of x [B, T, ...] when None."""
  if positions is not None:
    return positions
  B, T = x.shape[:2]
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
