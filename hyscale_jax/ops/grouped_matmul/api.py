"""`grouped_matmul`: one matmul per group of consecutive rows, each against its own weight (MoE experts)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _checks
from hyscale_jax.ops._registry import Backend, BackendRegistry
from hyscale_jax.ops.grouped_matmul.reference import (
    grouped_matmul_reference,
    transposed_grouped_matmul_reference,
)
from hyscale_jax.ops.grouped_matmul.vjp import grouped_with_vjp


def _checked(check, run):
  """Runs `check(lhs, rhs, ...)` (NotImplementedError when the backend does not apply) before `run`.

  The backward's kernels are traced only when differentiating, too late for `"auto"` to fall back,
  so the backend declines up front for every kernel the backward will need.
  """
  def wrapped(lhs, rhs, group_sizes, *, transpose_rhs=False):
    check(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    return run(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  return wrapped


def _pallas_kernel(hopper):
  """The kernels are Hopper's (wgmma, TMA): elsewhere `check_supported` declines and "auto" runs the reference."""
  if hopper is None:
    return "Mosaic GPU on Hopper; the reference elsewhere"
  return "Mosaic GPU" if hopper else "Mosaic GPU, Hopper only: declines here, the reference runs"


REGISTRY = BackendRegistry(
    "grouped_matmul",
    {"reference": functools.partial(grouped_with_vjp, grouped_matmul_reference,
                                    transposed_grouped_matmul_reference)},
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)
# JAX's Hopper Mosaic GPU kernels (forward/dx and dW) under the same custom_vjp.
REGISTRY.register_optional(
    "pallas", "pallas_kernels.grouped_matmul", ("grouped_matmul_pallas", "transposed_grouped_matmul_pallas",
                                                "check_supported"),
    wrap=lambda forward, transposed, check: _checked(check, functools.partial(grouped_with_vjp, forward,
                                                                             transposed)),
    kernel=lambda kernels, hopper: _pallas_kernel(hopper))


def grouped_matmul(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "G K N"] | Float[Array, "G N K"],
    group_sizes: Int[Array, "G"],
    *,
    transpose_rhs: bool = False,
    backend: Backend = "auto",
) -> Float[Array, "M N"]:
  """Row r of lhs times the weight of its group: `out[r] = lhs[r] @ rhs[g]` for the g-th run of rows.

  Rows are sorted by group, as `lax.ragged_dot` takes them: group g owns rows
  `[sum(group_sizes[:g]), sum(group_sizes[:g+1]))`. Rows past `sum(group_sizes)` give zeros and get
  zero gradient. Products accumulate in f32; the output is in lhs's dtype. Differentiable in lhs
  and rhs through one custom_vjp shared by all backends: dlhs is a grouped matmul with the other rhs
  layout and drhs the per-group `lhs_g^T @ dout_g`; nothing [G, M, ...] is built (the reference's XLA
  lowering aside, see `grouped_matmul_reference`).

  Args:
    lhs: bf16|f16|f32[M, K] rows sorted by group.
    rhs: [G, K, N] weights in lhs's dtype, or [G, N, K] with `transpose_rhs`.
    group_sizes: int[G] rows per group, >= 0, summing to at most M.
    transpose_rhs: rhs is [G, N, K] (e.g. the transposed weight of a backward pass).
    backend: "auto" (Pallas on a Hopper GPU, else the reference), "pallas" or "reference".

  Returns:
    [M, N] in lhs.dtype.

  Raises:
    ValueError: wrong ranks, mismatched K or G, lhs/rhs not of one float dtype, non-integer
      group_sizes; for concrete group_sizes also a negative size or a sum above M. Under jit the
      values cannot be checked: the reference then treats a sum above M as ending at row M, and the
      Pallas kernels give undefined rows (no error is raised).
  """
  _check_args(lhs, rhs, group_sizes, transpose_rhs)
  names = REGISTRY.candidates(backend)
  return REGISTRY.run(names, lhs, rhs, group_sizes.astype(jnp.int32), transpose_rhs=bool(transpose_rhs))


def _check_args(lhs, rhs, group_sizes, transpose_rhs) -> None:
  _checks.check_rank("lhs", lhs, 2, "M, K")
  _checks.check_rank("rhs", rhs, 3, "G, N, K" if transpose_rhs else "G, K, N")
  _checks.check_float("lhs", lhs)
  _checks.check_float("rhs", rhs)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"rhs.dtype={rhs.dtype} must equal lhs.dtype={lhs.dtype}.")
  k_axis = 2 if transpose_rhs else 1
  _checks.check_dim("rhs", rhs, k_axis, lhs.shape[1], f"K, from lhs.shape={tuple(lhs.shape)}, {transpose_rhs=}")
  if not hasattr(group_sizes, "shape") or group_sizes.ndim != 1:
    shape = getattr(group_sizes, "shape", group_sizes)
    raise ValueError(f"group_sizes must be an int array of shape [G], got group_sizes.shape={shape}.")
  _checks.check_int("group_sizes", group_sizes)
  if group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"group_sizes.shape={tuple(group_sizes.shape)} must be [G] with G={rhs.shape[0]} "
                     f"from rhs.shape={tuple(rhs.shape)}.")
  if isinstance(group_sizes, jax.core.Tracer):
    return
  sizes = np.asarray(group_sizes).astype(np.int64)
  if (sizes < 0).any():
    raise ValueError(f"group_sizes has a negative size: {sizes.tolist()}.")
  if sizes.sum() > lhs.shape[0]:
    raise ValueError(f"group_sizes sum to {sizes.sum()} > M={lhs.shape[0]} rows of lhs.shape={tuple(lhs.shape)}.")
