"""The LM loss from hidden states, over sequence chunks: no [B, T, V] logits, forward or backward.

`chunked_lm_loss` runs the LM head and the cross-entropy one chunk of positions at a time in a
`lax.scan`. Under autodiff its `custom_vjp` computes each chunk's gradients in the forward pass
(the chunk's logits, softmax and their gradient exist only inside that scan step) and saves
dh [B, T, D] and the head's f32 weight gradient, so the backward pass is a scale by the
cotangent: three head matmuls per chunk (logits, dh, dW) and no recomputation. Without autodiff
(evaluation) only the loss is computed.

Chunk j holds positions j, j + n, j + 2n, ... (n chunks). The sequence split contiguously over
`context` (context parallelism) then gives every device T / (n * context) positions of each chunk
from its own rows: the chunks reshape each device's shard in place, and the hidden states are
never gathered over the sequence.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax import sharding as shd

# (head parameters, h [B, C, D]) -> logits [B, C, V] in any float dtype.
Head = Callable[[Any, jax.Array], jax.Array]


def _nll(logits: jax.Array, targets: jax.Array):
  """(f32 logits [..., V], f32 logsumexp [...], f32 nll [...]) of int `targets` [...].

  The target logit is a masked sum over V rather than a gather, so a vocabulary split over devices
  (`vocab` over `tensor`) reduces in place.
  """
  z = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(z, axis=-1)
  hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]
  return z, lse, lse - jnp.sum(jnp.where(hit, z, 0.0), axis=-1)


def lm_loss(logits: Float[Array, "B T V"], targets: Int[Array, "B T"], loss_mask: Float[Array, "B T"]) -> jax.Array:
  """Mean next-token cross-entropy over `loss_mask` from whole logits: f32[].

  Args:
    logits: bf16|f32[B, T, V] (upcast to f32).
    targets: i32[B, T] next-token ids.
    loss_mask: f32[B, T], 1 where a position counts; the mean is over its sum (at least 1).
  """
  return jnp.sum(_nll(logits, targets)[2] * loss_mask) / _count(loss_mask)


def _count(loss_mask):
  return jnp.maximum(jnp.sum(loss_mask.astype(jnp.float32)), 1.0)


def chunk_layout(T: int, chunk: int) -> tuple[int, int]:
  """(n chunks, positions per chunk) for length `T` and at most `chunk` positions per chunk.

  chunk 0 (or >= T) is one chunk of T. Otherwise n = ceil(T / chunk) chunks of ceil(T / n)
  positions; T is padded (masked out) to their product when they do not divide it.
  """
  if not chunk or chunk >= T:
    return 1, T
  n = math.ceil(T / chunk)
  return n, math.ceil(T / n)


def _to_chunks(x, n: int, rows: int):
  """[B, T, ...] -> [n, B, rows, ...], chunk j holding positions j, j + n, ... (zero-padded)."""
  B, T = x.shape[:2]
  x = jnp.pad(x, [(0, 0), (0, n * rows - T)] + [(0, 0)] * (x.ndim - 2))
  x = jnp.moveaxis(x.reshape(B, rows, n, *x.shape[2:]), 2, 0)
  # Each chunk's rows stay split like the sequence they come from (batch and context).
  return shd.shard(x, (None, shd.BATCH, shd.LENGTH) + (None,) * (x.ndim - 3))


def _from_chunks(x, T: int):
  """The inverse of `_to_chunks`: [n, B, rows, ...] -> [B, T, ...]."""
  n, B, rows = x.shape[:3]
  x = jnp.moveaxis(x, 0, 2).reshape(B, n * rows, *x.shape[3:])[:, :T]
  return shd.shard(x, (shd.BATCH, shd.LENGTH) + (None,) * (x.ndim - 2))


def chunked_lm_loss(head: Head, params, h: Float[Array, "B T D"], targets: Int[Array, "B T"],
                    loss_mask: Float[Array, "B T"], *, chunk: int) -> jax.Array:
  """`lm_loss(head(params, h), targets, loss_mask)` without the [B, T, V] logits: f32[].

  Args:
    head: the LM head, (params, h [B, C, D]) -> logits [B, C, V] (any float dtype; the softmax
      and the loss are f32). It is traced once per chunk shape, inside a scan.
    params: the head's parameters, a pytree of arrays; they get gradients (f32-accumulated over
      the chunks, returned in their own dtype).
    h: bf16|f32[B, T, D], the hidden states after the final norm; they get gradients.
    targets: i32[B, T] next-token ids (no gradient).
    loss_mask: f32[B, T] (no gradient); the mean is over its sum (at least 1).
    chunk: at most this many positions per chunk (0: all T at once); one chunk's logits are
      [B, chunk, V] over the whole mesh, [B / batch shards, chunk / context, V] per device.

  Raises:
    ValueError: on mismatched shapes or a negative `chunk`.
  """
  if h.ndim != 3 or targets.shape != h.shape[:2] or loss_mask.shape != h.shape[:2]:
    raise ValueError(f"{h.shape=} must be [B, T, D] with {targets.shape=} and {loss_mask.shape=} [B, T].")
  if not isinstance(chunk, int) or chunk < 0:
    raise ValueError(f"chunk={chunk!r} must be an int >= 0 (0: unchunked).")
  n, rows = chunk_layout(h.shape[1], chunk)
  return _chunked_loss(head, n, rows, params, h, targets, loss_mask.astype(jnp.float32))


def _chunked_loss_impl(head, n, rows, params, h, targets, mask, grads: bool):
  """The scan over chunks: (loss, dparams f32 or None, dh [n, B, rows, D] or None)."""
  count = _count(mask)
  chunks = tuple(_to_chunks(x, n, rows) for x in (h, targets, mask))
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if grads else None

  def body(carry, chunk):
    total, dparams = carry
    hc, tc, mc = chunk
    if not grads:
      return (total + jnp.sum(_nll(head(params, hc), tc)[2] * mc), None), None
    logits, vjp = jax.vjp(head, params, hc)
    z, lse, nll = _nll(logits, tc)
    # d(loss)/dz: (softmax - one-hot) * mask / count, a [B, rows, V] temporary of this step only.
    dz = jnp.exp(z - lse[..., None])
    dz = jnp.where(jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == tc[..., None], dz - 1.0, dz)
    dp, dh = vjp((dz * (mc / count)[..., None]).astype(logits.dtype))
    dparams = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), dparams, dp)
    return (total + jnp.sum(nll * mc), dparams), dh

  (total, dparams), dh = jax.lax.scan(body, (jnp.float32(0), zeros), chunks)
  return total / count, dparams, dh


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked_loss(head, n, rows, params, h, targets, mask):
  return _chunked_loss_impl(head, n, rows, params, h, targets, mask, grads=False)[0]


def _chunked_loss_fwd(head, n, rows, params, h, targets, mask):
  loss, dparams, dh = _chunked_loss_impl(head, n, rows, params, h, targets, mask, grads=True)
  return loss, (dparams, _from_chunks(dh, h.shape[1]), params)  # params only for their dtypes


def _chunked_loss_bwd(head, n, rows, residuals, g):
  dparams, dh, params = residuals
  dparams = jax.tree.map(lambda d, p: (g * d).astype(p.dtype), dparams, params)
  # targets and loss_mask are data: no gradient.
  return dparams, (g * dh).astype(dh.dtype), None, None


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)
