"""What the Triton (`sparse_attention`) and Mosaic GPU (`mgpu_backward`) backward passes share."""

from __future__ import annotations

import jax.numpy as jnp


def row_delta(out, dout, dlse):
  """f32 [B, T, H] delta = <dout, out> - dlse: the softmax Jacobian's row term, with lse's own cotangent
  folded in (both backward kernels, and the sinks' gradient)."""
  return jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
