"""Residual-stream hyper-connections: DeepSeek-V4's mHC and Qwen4-Exp's gated residual.

With hyper-connections the residual is N parallel streams, [B, T, N, D] (the embedding copied N
times), instead of one [B, T, D]. Around each sub-block (attention, feed-forward) a connection

  - `enter(streams) -> (block_input [B, T, D], mix)` collapses the streams into the block's input;
  - `leave(streams, block_output [B, T, D], mix) -> streams` writes the block's output back.

After the last layer a head (`__call__(streams) -> [B, T, D]`) collapses the streams for the LM head.
Connections whose `replaces_pre_norm` is True normalise the streams themselves, so the block gets
no pre-norm (and a head with `replaces_final_norm`, no final norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from hyscale_jax import sharding as shd
from hyscale_jax.layers.norms import ZeroCenteredRMSNorm, rms_normalize

# The mHC weights stay f32 whatever the param dtype (as in DeepSeek's reference and transformers):
# the Sinkhorn iterations divide by small column sums.
_MHC_DTYPE = jnp.float32


def expand_streams(x: Float[Array, "B T D"], n_streams: int) -> Float[Array, "B T N D"]:
  """The residual streams at the first layer: N copies of the embedding."""
  return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], n_streams, x.shape[-1]))


def sinkhorn(logits: Float[Array, "... N N"], iters: int, eps: float) -> Float[Array, "... N N"]:
  """A near doubly-stochastic matrix from logits: row softmax (+ eps), then alternate normalisations.

  The columns are normalised first, then `iters - 1` rounds of rows then columns, each sum offset
  by `eps` (DeepSeek-V4's Sinkhorn-Knopp projection; `iters` counts column normalisations).
  """
  m = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
  columns = lambda m: m / (m.sum(-2, keepdims=True) + eps)
  rows = lambda m: m / (m.sum(-1, keepdims=True) + eps)
  # Unrolled: a loop's steps are separate GPU launches one after another, each a few tiny kernels.
  return jax.lax.fori_loop(0, iters - 1, lambda _, m: columns(rows(m)), columns(m), unroll=True)


def _mhc_projection(streams, fn, norm_eps):
  """f32[B, T, P]: the RMS-normalised flattened streams [B, T, N * D] times fn [P, N * D]."""
  B, T, N, D = streams.shape
  flat = rms_normalize(streams.reshape(B, T, N * D).astype(jnp.float32), norm_eps)
  return jnp.einsum("btc,pc->btp", flat, fn.astype(jnp.float32))


def _collapse(pre, streams):
  """sum_n pre[..., n] * streams[..., n, :] -> [B, T, D] in streams.dtype (computed in f32)."""
  return jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32)).astype(streams.dtype)


class ManifoldHyperConnection(nnx.Module):
  """DeepSeek-V4's manifold-constrained hyper-connection (mHC) around one sub-block.

  From the RMS-normalised flattened streams, one f32 projection `fn` [(2 + N) * N, N * D] (plus
  `base`, with one `scale` per output kind) gives per token:
    - pre [N] = sigmoid(.) + eps: the weights that collapse the streams into the block input;
    - post [N] = 2 sigmoid(.): how much of the block output each stream receives;
    - comb [N, N] = sinkhorn(.): the near doubly-stochastic stream mixing, new stream k =
      sum_j comb[j, k] * stream j + post[k] * output.
  Attribute names are transformers' (`fn`, `base`, `scale`; checkpoints call them `hc_attn_fn`...).
  """

  replaces_pre_norm = False

  def __init__(self, d_model: int, n_streams: int, *, sinkhorn_iters: int, eps: float, norm_eps: float,
               rngs: nnx.Rngs):
    """Args: d_model D; n_streams N >= 1; sinkhorn_iters >= 1; eps: the mHC offset (`hc_eps`);
    norm_eps: the eps of the streams' RMS normalisation (`rms_eps`); rngs: the `params` stream."""
    if n_streams < 1 or sinkhorn_iters < 1:
      raise ValueError(f"ManifoldHyperConnection: {n_streams=} and {sinkhorn_iters=} must be >= 1.")
    N = n_streams
    self.n_streams, self.sinkhorn_iters, self.eps, self.norm_eps = N, sinkhorn_iters, eps, norm_eps
    # Small init (transformers' 0.02): every token starts near the same mix.
    self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), ((2 + N) * N, N * d_model), _MHC_DTYPE),
                        **shd.param(None, shd.EMBED))
    self.base = nnx.Param(jnp.zeros(((2 + N) * N,), _MHC_DTYPE), **shd.param(None))
    self.scale = nnx.Param(jnp.ones((3,), _MHC_DTYPE), **shd.param(None))  # pre, post, comb

  def enter(self, streams: Float[Array, "B T N D"]):
    """(block input [B, T, D] in streams.dtype, (post f32[B, T, N], comb f32[B, T, N, N]))."""
    N = self.n_streams
    mixes = _mhc_projection(streams, self.fn[...], self.norm_eps)  # [B, T, (2 + N) * N]
    base, scale = self.base[...], self.scale[...]
    pre = jax.nn.sigmoid(mixes[..., :N] * scale[0] + base[:N]) + self.eps
    post = 2 * jax.nn.sigmoid(mixes[..., N: 2 * N] * scale[1] + base[N: 2 * N])
    comb_logits = mixes[..., 2 * N:].reshape(*mixes.shape[:-1], N, N) * scale[2] + base[2 * N:].reshape(N, N)
    comb = sinkhorn(comb_logits, self.sinkhorn_iters, self.eps)
    return _collapse(pre, streams), (post, comb)

  def leave(self, streams: Float[Array, "B T N D"], block_output: Float[Array, "B T D"], mix
            ) -> Float[Array, "B T N D"]:
    """post[k] * output + sum_j comb[j, k] * stream j, in streams.dtype."""
    post, comb = (w.astype(streams.dtype) for w in mix)
    mixed = jnp.einsum("btjk,btjd->btkd", comb, streams)
    return post[..., None] * block_output[:, :, None, :].astype(streams.dtype) + mixed


class ManifoldHyperHead(nnx.Module):
  """DeepSeek-V4's final collapse of the mHC streams: sum_n (sigmoid(.) + eps)[n] * stream n.

  `hc_fn` [N, N * D], `hc_base` [N], `hc_scale` [1] (transformers' and the checkpoints' names), in f32.
  The model's final RMSNorm follows it.
  """

  replaces_final_norm = False

  def __init__(self, d_model: int, n_streams: int, *, eps: float, norm_eps: float, rngs: nnx.Rngs):
    if n_streams < 1:
      raise ValueError(f"ManifoldHyperHead: {n_streams=} must be >= 1.")
    N = n_streams
    self.eps, self.norm_eps = eps, norm_eps
    self.hc_fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (N, N * d_model), _MHC_DTYPE),
                           **shd.param(None, shd.EMBED))
    self.hc_base = nnx.Param(jnp.zeros((N,), _MHC_DTYPE), **shd.param(None))
    self.hc_scale = nnx.Param(jnp.ones((1,), _MHC_DTYPE), **shd.param(None))

  def __call__(self, streams: Float[Array, "B T N D"]) -> Float[Array, "B T D"]:
    mixes = _mhc_projection(streams, self.hc_fn[...], self.norm_eps)  # [B, T, N]
    pre = jax.nn.sigmoid(mixes * self.hc_scale[...] + self.hc_base[...]) + self.eps
    return _collapse(pre, streams)


class GatedResidual(nnx.Module):
  """Qwen4-Exp's gated residual over N streams (its "hyper-connection"); also the final mixer.

  The streams are normalised per stream by a zero-centred RMSNorm `hc_norm` (weight [N * D]), which
  replaces the block's pre-norm. A low-rank gate `sigmoid(up(silu(down(normed) / N)))` [N, D] weighs
  the normalised streams, whose mean over N is the block input. The block output is added to every
  stream k with weight `2 sigmoid(block_inject_weight(normed) / N)[k]`; the un-normalised streams
  carry on. Without `inject` (the model's final `hyper_connection_mixer`) it only collapses.
  Attribute names are transformers'.
  """

  replaces_pre_norm = True
  replaces_final_norm = True

  def __init__(self, d_model: int, n_streams: int, lowrank: int, *, eps: float, inject: bool = True,
               rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32):
    """Args: d_model D; n_streams N >= 1; lowrank: the gate's rank (`hc_lowrank`) >= 1; eps: the
    norm's eps; inject: build `block_inject_weight` (False for the final mixer); rngs, dtype, param_dtype."""
    if n_streams < 1 or lowrank < 1:
      raise ValueError(f"GatedResidual: {n_streams=} and {lowrank=} must be >= 1.")
    linear = lambda i, o, axes: nnx.Linear(i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                           kernel_metadata=shd.param(*axes))
    N, D = n_streams, d_model
    self.n_streams = N
    self.hc_norm = ZeroCenteredRMSNorm(N * D, eps=eps, group_size=D, param_dtype=param_dtype)
    self.input_mix_weight_down = linear(N * D, lowrank, (shd.EMBED, None))
    self.input_mix_weight_up = linear(lowrank, N * D, (None, shd.EMBED))
    self.block_inject_weight = linear(N * D, N, (shd.EMBED, None)) if inject else None

  def _normed_and_mixed(self, streams):
    B, T, N, D = streams.shape
    normed = self.hc_norm(streams.reshape(B, T, N * D))  # [B, T, N * D]
    gate = jax.nn.sigmoid(self.input_mix_weight_up(jax.nn.silu(self.input_mix_weight_down(normed) / N)))
    mixed = jnp.mean(gate.reshape(B, T, N, D) * normed.reshape(B, T, N, D), axis=2)  # [B, T, D]
    return normed, mixed

  def __call__(self, streams: Float[Array, "B T N D"]) -> Float[Array, "B T D"]:
    """The collapsed streams [B, T, D] (the block input, or the final hidden state)."""
    return self._normed_and_mixed(streams)[1]

  def enter(self, streams: Float[Array, "B T N D"]):
    """(block input [B, T, D], injection weights [B, T, N])."""
    if self.block_inject_weight is None:
      raise ValueError("GatedResidual.enter needs inject=True (this one is a final mixer).")
    normed, mixed = self._normed_and_mixed(streams)
    return mixed, 2 * jax.nn.sigmoid(self.block_inject_weight(normed) / self.n_streams)

  def leave(self, streams: Float[Array, "B T N D"], block_output: Float[Array, "B T D"], inject
            ) -> Float[Array, "B T N D"]:
    """streams + inject[k] * block output on each stream k."""
    return streams + (inject[..., None] * block_output[:, :, None, :]).astype(streams.dtype)
