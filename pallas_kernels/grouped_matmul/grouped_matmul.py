"""The `"pallas"` backend of `grouped_matmul`: Hopper Mosaic GPU kernels, padded and tuned.

- `grouped_matmul_pallas`: the own tile-table kernel (`tiled.py`): persistent, warp-specialized (a
  TMA producer and two warpgroup-MMA consumers) over (row tile, N block) pairs; `transpose_rhs` reads
  rhs as [G, N, K] (dx). Faster than JAX's shipped `ragged_dot_mgpu` at every bench shape
  (docs/kernels/grouped_matmul.md).
- `transposed_grouped_matmul_pallas`: the own dW kernel (`tiled.py`), per group `a_g^T @ b_g` into
  [G, P, Q], walking only each group's own rows, with the same producer / two-consumer split.

What the wrappers add: K (and dW's P) zero-padded to the chosen tiles (exact: padded columns
contribute 0 and are sliced off), N and Q only to Mosaic's 64-element swizzle tile (the kernels
read past them as zeros and store nothing there), rows padded to TMA's 8-row tiling, and the block config from
`autotune.choose`. Rows past `sum(group_sizes)` need no pass over the arrays: the forward kernel
writes 0 there and the dW kernel selects 0 for them. Both kernels use wgmma (sm_90a) and bf16/f16
only: anything else raises NotImplementedError so `"auto"` falls back to the reference.

Off the GPU (`backend="pallas"` asked for by name; "auto" picks the reference there) the same kernels
run in Mosaic GPU's interpret mode on `INTERPRET_SMS` simulated SMs, with the heuristic block config
(no tuning): slow, for tests. CI checks them that way against the float64 oracle
(tests/test_grouped_matmul.py), and also exports them for a CUDA target, which runs Mosaic's lowering
and its shared-memory check.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._hopper import require_hopper
from pallas_kernels.grouped_matmul import autotune

_DTYPES = (jnp.bfloat16, jnp.float16)
INTERPRET_SMS = 2  # simulated SMs off the GPU: more than one, so CTAs split the persistent loop as on the device
_SWIZZLE_TILE = 64  # elements of a 128-byte swizzled row (2-byte dtypes): Mosaic's minor-dim tiling of a TMA operand


def check_supported(lhs, rhs, group_sizes, *, transpose_rhs=False) -> None:
  """Raises NotImplementedError unless the inputs are bf16 or f16 and the GPU, if any, is a Hopper (sm_90)."""
  del group_sizes, transpose_rhs
  if not _interpreted():
    require_hopper("grouped_matmul pallas")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.dtype not in _DTYPES:
      raise NotImplementedError(f"grouped_matmul pallas: {name}.dtype={x.dtype} is not bf16/f16.")


def _interpreted() -> bool:
  """Whether the kernels run in Mosaic GPU's interpret mode: off the GPU."""
  return jax.default_backend() != "gpu"


def _launch() -> dict:
  """How the kernels run here: compiled on every SM of the GPU, or interpreted on `INTERPRET_SMS`."""
  if _interpreted():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 - as `tiled`, only when a kernel runs

    return {"num_sms": INTERPRET_SMS, "interpret": plgpu.InterpretGPUParams()}
  return {"num_sms": jax.devices()[0].core_count, "interpret": None}


def _pad_axis(x, axis: int, multiple: int):
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _uniform_sizes(m: int, g: int) -> np.ndarray:
  """m rows split over g groups as evenly as possible (what the tuner measures on)."""
  return np.full(g, m // g, np.int32) + (np.arange(g) < m % g).astype(np.int32)


def _seconds(fn, *args, reps: int = 5) -> float:
  """Median wall seconds of a compiled call, synchronised (the first call is the warm-up)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _config(kind, m, k, n, g, dtype, run, shapes):
  """The block config for this problem; tuning (if on) measures `run(a, b, sizes, config)` on random inputs.

  Called while tracing the caller's jit: the measurement runs eagerly on concrete device arrays
  (`ensure_compile_time_eval`), made once per problem on the device (host RNG at 10^9 elements is slow).
  """
  if _interpreted():  # the interpreter's timings say nothing about the GPU's
    return autotune.Config.heuristics(kind, m, k, n, g)
  inputs = []

  def measure(config):
    with jax.ensure_compile_time_eval():
      if not inputs:
        keys = jax.random.split(jax.random.key(0), 2)
        inputs.extend(jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes))
        inputs.append(jnp.asarray(_uniform_sizes(shapes[0][0], g)))
      compiled = jax.jit(lambda a, b, s: run(a, b, s, config)).lower(*inputs).compile()
      return _seconds(compiled, *inputs)

  return autotune.choose(jax.devices()[0].device_kind, kind, m, k, n, g, dtype, measure)


def _forward(lhs, rhs, group_sizes, config, transpose_rhs):
  """The kernel call on padded operands; out [M, N] with rows past the groups left unwritten."""
  from pallas_kernels.grouped_matmul import tiled  # noqa: PLC0415 - imports Mosaic GPU

  m = lhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  # TMA wants the row count a multiple of its 8-row tiling; the padded rows are past every group.
  # N only to the 64-element swizzle tile (no copy at the models' widths): the kernel reads the
  # columns past N as zeros and stores none of them, so N need not fill the CTA's columns.
  lhs = _pad_axis(_pad_axis(lhs, 1, config.block_k), 0, 8)
  rhs = _pad_axis(_pad_axis(rhs, 2 if transpose_rhs else 1, config.block_k), 1 if transpose_rhs else 2, _SWIZZLE_TILE)
  out = tiled.grouped_matmul_tiled(lhs, rhs, group_sizes, config=config, transpose_rhs=transpose_rhs, **_launch())
  return out[:m, :n]


def grouped_matmul_pallas(lhs, rhs, group_sizes, *, transpose_rhs=False, config=None):
  """lhs bf16|f16[M, K] x rhs [G, K, N] ([G, N, K] with transpose_rhs) -> [M, N] in lhs.dtype.

  f32 accumulation in the wgmma accumulator; rows past sum(group_sizes) are 0. `config` overrides
  the cached/heuristic block config.
  """
  check_supported(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  (m, k), g = lhs.shape, rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if config is None:
    kind = "forward_transposed_rhs" if transpose_rhs else "forward"
    config = _config(kind, m, k, n, g, lhs.dtype,
                     lambda a, b, s, c: _forward(a, b, s, c, transpose_rhs), (lhs.shape, rhs.shape))
  return _forward(lhs, rhs, group_sizes, config, transpose_rhs)


def _transposed(a, b, group_sizes, config):
  from pallas_kernels.grouped_matmul import tiled  # noqa: PLC0415

  p, q = a.shape[1], b.shape[1]
  a = _pad_axis(_pad_axis(a, 1, config.block_m * (2 if config.split_rows else 1)), 0, 8)
  b = _pad_axis(_pad_axis(b, 1, _SWIZZLE_TILE), 0, 8)  # Q as N in the forward
  out = tiled.transposed_grouped_matmul_tiled(a, b, group_sizes, config=config, **_launch())
  return out[:, :p, :q]


def transposed_grouped_matmul_pallas(a, b, group_sizes, *, config=None):
  """a bf16|f16[M, P], b [M, Q] -> [G, P, Q] in a.dtype: `a_g^T @ b_g` over each group's rows (dW).

  f32 accumulation; rows past sum(group_sizes) are ignored; an empty group gives zeros.
  """
  check_supported(a, b, group_sizes)
  (m, p), q, g = a.shape, b.shape[1], group_sizes.shape[0]
  if config is None:
    config = _config("transposed", m, p, q, g, a.dtype, _transposed, (a.shape, b.shape))
  return _transposed(a, b, group_sizes, config)
