"""Abstract inputs at absorbed MLA's shape (H 64, Dk 576 = 512 + 64, values the 512 prefix, k 2048), for
tests that trace or lower the sparse-attention kernels without running them."""

import jax
import jax.numpy as jnp

MLA_H, MLA_DK, MLA_DV, MLA_K = 64, 576, 512, 2048


def mla_backward_inputs(T: int):
  """(q, k, indices, out, lse) ShapeDtypeStructs of one bf16 sequence of T queries and T keys."""
  f = jax.ShapeDtypeStruct
  return (f((1, T, MLA_H, MLA_DK), jnp.bfloat16), f((1, T, 1, MLA_DK), jnp.bfloat16), f((1, T, MLA_K), jnp.int32),
          f((1, T, MLA_H, MLA_DV), jnp.bfloat16), f((1, T, MLA_H), jnp.float32))
