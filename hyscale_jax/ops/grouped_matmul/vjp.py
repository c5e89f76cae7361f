"""The custom_vjp every grouped-matmul backend shares: the backward is two more grouped matmuls."""

from __future__ import annotations

import functools

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped(forward, transposed, transpose_rhs, lhs, rhs, group_sizes):
  return forward(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


def _grouped_fwd(forward, transposed, transpose_rhs, lhs, rhs, group_sizes):
  return _grouped(forward, transposed, transpose_rhs, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _grouped_bwd(forward, transposed, transpose_rhs, residuals, dout):
  lhs, rhs, group_sizes = residuals
  dout = dout.astype(lhs.dtype)
  # dx = dout @ W^T per group: the forward kernel with the other rhs layout; rows past the sum are 0.
  dlhs = forward(dout, rhs, group_sizes, transpose_rhs=not transpose_rhs)
  # dW[g] = x_g^T @ dout_g ([G, K, N]), or dout_g^T @ x_g for the [G, N, K] layout.
  drhs = transposed(dout, lhs, group_sizes) if transpose_rhs else transposed(lhs, dout, group_sizes)
  return dlhs, drhs.astype(rhs.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_with_vjp(forward, transposed, lhs, rhs, group_sizes, *, transpose_rhs=False):
  """`forward(lhs, rhs, group_sizes, transpose_rhs=...)`, differentiated through grouped matmuls only.

  Saved: lhs, rhs and group_sizes (no activation of the op itself). The backward runs `forward`
  once more with the other rhs layout (dlhs, [M, K]) and `transposed` once (drhs, [G, K, N] or
  [G, N, K]); neither builds anything [G, M, ...], so the memory stays O(M x width + weights).
  group_sizes gets no gradient.

  Args:
    forward: `(lhs[M, K], rhs, group_sizes, *, transpose_rhs) -> [M, N]`, zero past the groups.
    transposed: `(a[M, P], b[M, Q], group_sizes) -> [G, P, Q]`, `a_g^T @ b_g`, ignoring rows past
      the groups.
  """
  return _grouped(forward, transposed, transpose_rhs, lhs, rhs, group_sizes)
