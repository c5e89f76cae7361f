"""The LM loss from hidden states, over sequence chunks: no [B, T, V] logits, forward or backward.

`chunked_lm_loss` runs the LM head and the cross-entropy one chunk of positions at a time in a
`lax.scan`. Under autodiff its `custom_vjp` computes each chunk's gradients in the forward pass
(the chunk's logits, softmax and their gradient exist only inside that scan step) and saves
dh [B, T, D] and the head's f32 weight gradient, so the backward pass is a scale by the
cotangent: three head matmuls per chunk (logits, dh, dW) and no recomputation. Without autodiff
(evaluation) only the loss is computed.

Under a mesh that splits the batch (data, fsdp, expert) or the sequence (context), each device
chunks its own rows inside a `jax.shard_map` over those axes: the hidden states are never
gathered, and the weight gradient is summed over devices once, after the scan (a GSPMD scan
would all-reduce it at every chunk). The other mesh axes stay automatic, so a vocabulary split
over `tensor` still splits each chunk's logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _streaming as st
from hyscale_jax.sharding import BATCH_AXES, CONTEXT_AXIS, splitting_axes

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
  return jnp.sum(_nll(logits, targets)[2] * loss_mask) / jnp.maximum(jnp.sum(loss_mask.astype(jnp.float32)), 1.0)


def chunk_layout(T: int, chunk: int) -> tuple[int, int]:
  """(n chunks, positions per chunk) for `T` positions (one device's) and at most `chunk` per chunk.

  chunk 0 (or >= T) is one chunk of T. Otherwise n = ceil(T / chunk) chunks of ceil(T / n)
  positions; T is padded (masked out) to their product when they do not divide it.
  """
  if not chunk or chunk >= T:
    return 1, T
  n = math.ceil(T / chunk)
  return n, math.ceil(T / n)


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
    chunk: at most this many positions of each device's rows per chunk (0: all at once). One
      chunk's logits are [B / batch shards, chunk, V] per device; under context parallelism a
      device holds T / context positions, chunked the same way.

  Raises:
    ValueError: on mismatched shapes or a negative `chunk`.
  """
  if h.ndim != 3 or targets.shape != h.shape[:2] or loss_mask.shape != h.shape[:2]:
    raise ValueError(f"{h.shape=} must be [B, T, D] with {targets.shape=} and {loss_mask.shape=} [B, T].")
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
    raise ValueError(f"chunk={chunk!r} must be an int >= 0 (0: unchunked).")
  return _chunked_loss(head, chunk, params, h, targets, loss_mask.astype(jnp.float32))


def _local_loss(head, chunk, params, h, targets, mask, *, grads: bool, axes: tuple[str, ...]):
  """One device's rows: loss (and, with `grads`, f32 dparams and dh [B, T, D]), summed over `axes`."""
  psum = (lambda x: jax.lax.psum(x, axes)) if axes else (lambda x: x)
  count = jnp.maximum(psum(jnp.sum(mask)), 1.0)
  split, join = st.row_chunks(chunk_layout(h.shape[1], chunk)[1], h.shape[1])  # [B, T, ...] <-> [n, B, rows, ...]
  chunks = tuple(split(x) for x in (h, targets, mask))

  def body(i, carry):
    total, dparams, dh = carry
    hc, tc, mc = (jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in chunks)
    if not grads:
      return total + jnp.sum(_nll(head(params, hc), tc)[2] * mc), None, None
    logits, vjp = jax.vjp(head, params, hc)
    z, lse, nll = _nll(logits, tc)
    # d(loss)/dz = (softmax - one-hot) * mask / count: a [B, rows, V] temporary of this step only.
    dz = jnp.exp(z - lse[..., None])
    dz = jnp.where(jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == tc[..., None], dz - 1.0, dz)
    dp, dh_rows = vjp((dz * (mc / count)[..., None]).astype(logits.dtype))
    dparams = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), dparams, dp)
    return total + jnp.sum(nll * mc), dparams, dh.at[i].set(dh_rows)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if grads else None
  # dh (a [B, T, D] residual until the backward pass) is written into a buffer made here, not one
  # XLA would allocate at the start of the step (st.fresh_zeros).
  dh = st.fresh_zeros(chunks[0].shape, chunks[0].dtype, h) if grads else None
  total, dparams, dh = jax.lax.fori_loop(0, chunks[0].shape[0], body, (jnp.float32(0), zeros, dh))
  loss = psum(total) / count
  return (loss, psum(dparams), join(dh)) if grads else loss


def _row_axes(shape) -> tuple[Any, tuple[str, ...], tuple[str, ...]]:
  """(ambient mesh, its batch axes, its context axis) that split [B, T] rows here; () where none do.

  The batch splits over BATCH_AXES and the sequence over `context` as `sharding.shard` places the
  activations (`sharding.splitting_axes`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
    return None, (), ()
  return mesh, splitting_axes(mesh, BATCH_AXES, shape[0]), splitting_axes(mesh, (CONTEXT_AXIS,), shape[1])


def _sharded_loss(head, chunk, params, h, targets, mask, *, grads: bool):
  """`_local_loss` on each device's rows under a `shard_map` over the axes that split them."""
  mesh, batch, context = _row_axes(h.shape)
  axes = batch + context
  local = functools.partial(_local_loss, head, chunk, grads=grads, axes=axes)
  if not axes:
    return local(params, h, targets, mask)
  rows = P(batch or None, context or None)
  # The head's parameters enter whole over the row axes (gathered over fsdp, as every layer's are)
  # and their gradient leaves summed. Axes that split no rows stay automatic when they split
  # anything (a vocabulary over tensor); size-1 axes are manual, so without tensor parallelism
  # the shard_map is fully manual.
  manual = {a for a in mesh.axis_names if a in axes or mesh.shape[a] == 1}
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows, rows),
                       out_specs=(P(), P(), rows) if grads else P(), axis_names=manual,
                       check_vma=False)(params, h, targets, mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_loss(head, chunk, params, h, targets, mask):
  return _sharded_loss(head, chunk, params, h, targets, mask, grads=False)


def _chunked_loss_fwd(head, chunk, params, h, targets, mask):
  loss, dparams, dh = _sharded_loss(head, chunk, params, h, targets, mask, grads=True)
  return loss, (dparams, dh, params)  # params only for their dtypes


def _chunked_loss_bwd(head, chunk, residuals, g):
  dparams, dh, params = residuals
  dparams = jax.tree.map(lambda d, p: (g * d).astype(p.dtype), dparams, params)
  # targets and loss_mask are data: no gradient.
  return dparams, (g * dh).astype(dh.dtype), None, None


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)
