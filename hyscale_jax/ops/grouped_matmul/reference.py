"""The `"reference"` backend of `grouped_matmul`: `lax.ragged_dot` (and `ragged_dot_general` for dW)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# out[g] = lhs_g^T @ dout_g: the ragged (row) dimension is the contracted one, as in JAX's
# `ref_transposed_ragged_dot`.
_TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
# lhs [M, K] x rhs [G, N, K] contracting K with rhs's last axis: no transposed copy of rhs.
_RHS_NK = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_matmul_reference(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "G K N"] | Float[Array, "G N K"],
    group_sizes: Int[Array, "G"],
    *,
    transpose_rhs: bool = False,
) -> Float[Array, "M N"]:
  """`out[r] = lhs[r] @ rhs[g(r)]` (`rhs[g(r)].T` with `transpose_rhs`); f32 accumulation, lhs's dtype.

  Rows past `sum(group_sizes)` are zero. XLA:CPU and XLA:GPU lower `ragged_dot` to a dense dot over a
  masked [G, M, K] copy of lhs, so this backend is for CPU at small shapes and for checking kernels.
  """
  if transpose_rhs:
    out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, _RHS_NK, preferred_element_type=jnp.float32)
  else:
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def transposed_grouped_matmul_reference(
    lhs: Float[Array, "M K"],
    dout: Float[Array, "M N"],
    group_sizes: Int[Array, "G"],
) -> Float[Array, "G K N"]:
  """`out[g] = lhs_g^T @ dout_g` over each group's rows (the weight gradient); f32 accumulation.

  Rows past `sum(group_sizes)` are ignored, whatever they hold. Returns lhs's dtype.
  """
  out = jax.lax.ragged_dot_general(lhs, dout, group_sizes, _TRANSPOSED, preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)
