# Adapted from jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py, Copyright 2025 The JAX Authors,
# licensed under the Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0).
"""JAX's Hopper ragged-dot kernel with a precomputed tile table, for hundreds of groups (MoE experts).

JAX's kernel finds each row tile's group with a loop over all G groups, unrolled into the kernel
("we usually only have very few groups"): at G = 256-512 that is thousands of scalar loads and
selects before every tile's pipeline starts, and tiles that belong to no group (one per group
boundary that falls on a tile edge, up to G - 1 per N column) still run their whole K loop. Here
XLA computes, once per call, the table tile -> (group, row block, first row in the block, rows)
with a searchsorted over the G group ends; the kernel reads four scalars per tile and skips the
K loop of empty tiles. Pipeline, wgmma and the logarithmic ladder of TMA row stores are JAX's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_NUM_SMS = 132  # H100 SXM and H200


def tile_table(group_sizes, m: int, block_m: int):
  """int32[4, cdiv(m, block_m) + G - 1]: per row tile its group, row block, first row within the
  block, and rows (0 for a tile past every group). Empty groups get no tile."""
  g = group_sizes.shape[0]
  n_tiles = pl.cdiv(m, block_m) + g - 1
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)  # [G]
  starts = ends - sizes
  first_block = starts // block_m
  tiles = jnp.where(sizes > 0, (jnp.maximum(ends, 1) - 1) // block_m - first_block + 1, 0)  # [G]
  tile_ends = jnp.cumsum(tiles)  # [G]
  t = jnp.arange(n_tiles, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), g - 1).astype(jnp.int32)
  block = first_block[group] + t - (tile_ends - tiles)[group]
  block_start = block * block_m
  row_start = jnp.maximum(starts[group], block_start)
  rows = jnp.minimum(ends[group], block_start + block_m) - row_start
  rows = jnp.where(t < tile_ends[-1], rows, 0)
  return jnp.stack([group, jnp.where(rows > 0, block, 0), row_start - block_start, rows]).astype(jnp.int32)


def ragged_dot(lhs, rhs, *, group_sizes, block_m: int, block_n: int, block_k: int, max_concurrent_steps: int,
               grid_block_n: int, transpose_rhs: bool = False):
  """lhs [M, K] x rhs [G, K, N] ([G, N, K] with transpose_rhs) -> [M, N] in lhs.dtype (f32 accumulation).

  Same contract as JAX's `ragged_dot_mgpu.ragged_dot`: K a multiple of block_k, N of block_n; rows
  past sum(group_sizes) are left unwritten.
  """
  m, k = lhs.shape
  g, n = rhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if k % block_k or n % block_n:
    raise ValueError(f"{k=} and {n=} must be multiples of {block_k=} and {block_n=}.")
  table = tile_table(group_sizes, m, block_m)
  grid_m, grid_n = table.shape[1], n // block_n

  def body(table_gmem, lhs_gmem, rhs_gmem, o_gmem):
    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def mn_loop(loop_info: plgpu.NDLoopInfo):
      mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
      group, block = table_gmem[0, mi], table_gmem[1, mi]
      row_in_block, rows = table_gmem[2, mi], table_gmem[3, mi]

      def acc_scope(acc_ref):
        @pl.when(rows > 0)  # a tile past every group: no K loop
        def _():
          plgpu.emit_pipeline(
              lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                  acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem),
              grid=(k // block_k,),
              in_specs=[
                  plgpu.BlockSpec((block_m, block_k), lambda kk: (block, kk), delay_release=1),
                  plgpu.BlockSpec((block_n, block_k) if transpose_rhs else (block_k, block_n),
                                  lambda kk: (ni, kk) if transpose_rhs else (kk, ni), delay_release=1),
              ],
              max_concurrent_steps=max_concurrent_steps,
          )(lhs_gmem, rhs_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), dtype=o_gmem.dtype))
      def store_scope(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        # TMA stores need static row counts: a ladder of power-of-two row slices covers any count
        # in [0, min(block_m, m)] (JAX's comment explains it in full).
        smem_start = row_in_block
        remaining = min(block_m, m)
        while remaining > 0:
          width = 1 << int(math.log2(remaining))
          remaining //= 2

          @pl.when(rows & width != 0)
          def _():
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(smem_start, width)],
                o_gmem.at[pl.ds(block * block_m + smem_start, width), pl.ds(ni * block_n, block_n)])

          smem_start += rows & width
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype), grid=(_NUM_SMS,), grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(table, lhs, rhs)
