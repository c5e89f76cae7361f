"""A grouped-matmul forward kernel for Hopper that walks a tile table: `out[r] = lhs[r] @ rhs[group(r)]`.

Why not JAX's shipped `ragged_dot_mgpu`: it finds each row block's group inside the kernel with a
loop unrolled over all G groups (256 scalar compares per tile for GLM-5.1's experts), with one
warpgroup that both issues the loads and runs the MMAs. Here XLA lays out the work once per call:

- `tile_table(group_sizes, tile_m)` lists, for every row tile of every non-empty group, its group,
  its first row and how many of its `tile_m` rows are the group's. Tiles start at their group's first
  row (not at a multiple of `tile_m`), so only a group's last tile is partial, and a tile never
  straddles two groups: its rows past the group are computed and not stored.
- The kernel is persistent (one CTA per SM) over (tile, N block) work items. A producer warpgroup
  streams the lhs rows and the group's weight block through a TMA pipeline; two consumer warpgroups
  each own half of the N block's columns, or with `Config.split_rows` half of the tile's rows
  (warpgroup MMA, f32 accumulators), and store their part. With `Config.rows_as_n` the rows go on
  the MMA's N side (out^T = rhs^T lhs^T, cuBLAS's tiling for narrow matmuls): a tile's row count need
  only be a multiple of 8 (Qwen3.8-Flash-Next's 320-row experts in two tiles of 160), and each
  consumer writes its transposed accumulator through a transposed view of the output buffer.
- A partial tile stores its first `rows` rows as a sum of power-of-two TMA copies (TMA boxes are
  static), which the tile table makes the rare case.

`transpose_rhs` reads rhs as [G, N, K] (the dx of a forward) and hands the MMA its transpose.
Compiled, it needs sm_90a (wgmma, TMA). Off the GPU, `interpret=plgpu.InterpretGPUParams()` runs the
same kernels in Mosaic GPU's interpret mode (warpgroups as threads, barriers and TMA simulated), which
is how CI checks them against the oracle on the CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import smem_transforms
from pallas_kernels.grouped_matmul.autotune import Config


def max_tiles(m: int, g: int, tile_m: int) -> int:
  """An upper bound of the tile table's length for g groups and the rows past them, m rows in all.

  A run of s rows takes ceil((s + 7) / tile_m) tiles at most (its first tile starts up to 7 rows
  early), so the g + 1 runs take fewer than (m + (g + 1) * (tile_m + 6)) / tile_m + 1.
  """
  return pl.cdiv(m + (g + 1) * (tile_m + 6), tile_m)


def tile_table(group_sizes: jax.Array, tile_m: int, num_tiles: int, m: int | None = None) -> jax.Array:
  """int32[4, num_tiles]: per row tile (group, first row, first stored row, end row); unused tiles store none.

  Mosaic GPU's TMA into swizzled shared memory wants the first row a multiple of 8, so group g's
  tiles start at `floor8(start_g) + j * tile_m`: its first tile skips up to 7 rows of the group
  before, and its last stops at the group's end. Rows [first stored, end) of a tile, counted from the
  tile's first row, are the group's. Empty groups get no tile. With `m`, the rows [sum, m) past the
  groups get tiles too, as group G: the kernel stores zeros there.
  """
  sizes = group_sizes.astype(jnp.int32)
  if m is not None:
    sizes = jnp.concatenate([sizes, (m - jnp.sum(sizes))[None]])
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  bases = starts // 8 * 8
  tiles_per_group = jnp.where(sizes > 0, (ends - bases + tile_m - 1) // tile_m, 0)
  tile_ends = jnp.cumsum(tiles_per_group)
  tile_starts = tile_ends - tiles_per_group
  t = jnp.arange(num_tiles, dtype=jnp.int32)
  # compare_all: one fusion. The default binary search is an XLA while loop whose steps run as separate
  # launches, a fixed cost before every call that short calls feel (docs/kernels/grouped_matmul.md).
  group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="compare_all"),
                      sizes.shape[0] - 1).astype(jnp.int32)
  first_row = bases[group] + (t - tile_starts[group]) * tile_m
  used = t < tile_ends[-1]
  lo = jnp.where(used, jnp.maximum(starts[group] - first_row, 0), 0)
  hi = jnp.where(used, jnp.minimum(ends[group] - first_row, tile_m), 0)
  return jnp.stack([group, jnp.where(used, first_row, 0), lo, hi]).astype(jnp.int32)


def _store_rows(out_smem, smem_row, out_gmem, first_row, col, lo, hi, tile_m: int, tile_n: int):
  """Copies rows [lo, hi) of the tile at out_smem[smem_row:] to out_gmem[first_row + lo:first_row + hi, col:].

  A whole tile is one TMA copy; otherwise `hi - lo` rows go as power-of-two runs (a TMA box is
  static). One dynamic row offset into the (2 * tile_m, tile_n) buffer (tile_n: the columns stored at
  once, `Config.store_width`), not a warpgroup index and
  then a row offset: Mosaic GPU slices shared memory with one dynamic index per axis.
  """
  whole = (lo == 0) & (hi == tile_m)

  @pl.when(whole)
  def _():
    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(smem_row, tile_m)],
                            out_gmem.at[pl.ds(first_row, tile_m), pl.ds(col, tile_n)])

  @pl.when(jnp.logical_not(whole))
  def _():
    count = hi - lo
    done = lo
    for bit in reversed(range(int(math.log2(tile_m)) + 1)):
      size = 1 << bit

      @pl.when((count & size) != 0)
      def _():
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(smem_row + done, size)],
                                out_gmem.at[pl.ds(first_row + done, size), pl.ds(col, tile_n)])

      done = done + (count & size)


def _persistent(kernel, out_shape, dtype, num_sms: int, interpret):
  """One CTA per SM, three warpgroups ("wg": two MMA consumers and the TMA producer); `interpret`:
  None to compile, or Mosaic GPU's `InterpretGPUParams` to simulate it (off the GPU)."""
  return plgpu.kernel(
      kernel,
      interpret=interpret,
      out_type=jax.ShapeDtypeStruct(out_shape, dtype),
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )


def grouped_matmul_tiled(lhs, rhs, group_sizes, *, config: Config, transpose_rhs: bool = False,
                         num_sms: int | None = None, interpret=None):
  """lhs bf16|f16[M, K] x rhs [G, K, N] ([G, N, K] with transpose_rhs) -> [M, N] in lhs.dtype.

  `config`: block_m rows x 2 * block_n columns per CTA (2 * block_m x block_n with `split_rows`),
  block_k the K step, max_concurrent_steps pipeline stages, grid_block_n the snake band in N
  blocks. K must be a multiple of block_k (the caller pads). N need not be a multiple of the CTA's
  columns: TMA reads the columns past N as zeros and drops their stores, and a warpgroup whose
  columns lie wholly past N stores nothing, so narrow
  experts (Qwen's 640) run on the wide tiles without a padded copy of the weights. Rows past
  sum(group_sizes) are 0 (zero tiles, no pass over the output). f32 accumulation.
  """
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tile_m, tile_n, tile_k = config.block_m, config.block_n, config.block_k
  block_n = 2 * tile_n
  if k % tile_k:
    raise ValueError(f"K={k} must be a multiple of block_k={tile_k}.")
  if tile_m & (tile_m - 1) and not config.rows_as_n:
    # `_store_rows` takes any height, but rows-on-M tiles of 192 have never run on a GPU
    raise ValueError(f"block_m={tile_m}: row tiles with the rows on M must be a power of two (64, 128 or 256).")
  num_tiles = max_tiles(m, g, config.rows)
  table = tile_table(group_sizes, config.rows, num_tiles, m)
  n_blocks = pl.cdiv(n, block_n)
  k_steps = k // tile_k
  dtype = lhs.dtype
  transforms = smem_transforms(tile_k, dtype)
  if num_sms is None:
    num_sms = jax.devices()[0].core_count
  if config.continuous:
    kernel = _continuous_forward_kernel(m, k, n, g, num_tiles, dtype, config, transpose_rhs)
    return _persistent(kernel, (m, n), dtype, num_sms, interpret)(table, lhs, rhs)

  def pipeline(body, compute_context):
    rhs_block = (block_n, tile_k) if transpose_rhs else (tile_k, block_n)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tile_m, tile_k), lambda ki: (0, ki), transforms=transforms,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec(rhs_block, (lambda ki: (0, ki)) if transpose_rhs else (lambda ki: (ki, 0)),
                            transforms=transforms, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  def kernel(table_gmem, lhs_gmem, rhs_gmem, out_gmem):
    unused = lambda *_, **__: None  # the allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(
            lhs_gmem.at[pl.ds(0, tile_m), :],
            rhs_gmem.at[0, pl.ds(0, block_n), :] if transpose_rhs else rhs_gmem.at[0, :, pl.ds(0, block_n)]),
        out_smem=plgpu.SMEM((2 * tile_m, tile_n), dtype),
        collective_axes="wg",
    )
    def scope(allocations, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_tiles * n_blocks,), collective_axes="sm")
      def work(info: plgpu.NDLoopInfo):
        tile, n_block = plgpu.planar_snake(info.index[0], (num_tiles, n_blocks), 1, config.grid_block_n)
        group, first_row = table_gmem[0, tile], pl.multiple_of(table_gmem[1, tile], 8)
        lo, hi = table_gmem[2, tile], table_gmem[3, tile]

        smem_row = pl.multiple_of(wg * tile_m, tile_m)
        col = n_block * block_n + wg * tile_n

        stores = (wg < 2) & (col < n)  # the consumers, where their half holds columns of the output

        @pl.when((hi > lo) & (group == g) & stores)  # rows past the groups: zeros
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          out_smem[pl.ds(smem_row, tile_m), :] = jnp.zeros((tile_m, tile_n), dtype)
          plgpu.commit_smem()
          _store_rows(out_smem, smem_row, out_gmem, first_row, col, lo, hi, tile_m, tile_n)

        @pl.when((hi > lo) & (group < g))
        def _():
          n_slice = pl.ds(n_block * block_n, block_n)

          def compute_context(run_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
            def _(acc_ref):
              run_pipeline(acc_ref)
              acc = acc_ref[...].astype(dtype)

              @pl.when(col < n)
              def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read it
                out_smem[pl.ds(smem_row, tile_m), :] = acc
                plgpu.commit_smem()
                _store_rows(out_smem, smem_row, out_gmem, first_row, col, lo, hi, tile_m, tile_n)

          def mma(_, lhs_smem, rhs_smem, acc_ref):
            if transpose_rhs:
              rhs_wg = rhs_smem.at[pl.ds(wg * tile_n, tile_n), :].transpose((1, 0))
            else:
              rhs_wg = rhs_smem.at[:, pl.ds(wg * tile_n, tile_n)]
            plgpu.wgmma(acc_ref, lhs_smem, rhs_wg)
            plgpu.wgmma_wait(0)
            return acc_ref

          rhs_g = rhs_gmem.at[group, n_slice, :] if transpose_rhs else rhs_gmem.at[group, :, n_slice]
          pipeline(mma, compute_context)(lhs_gmem.at[pl.ds(first_row, tile_m), :], rhs_g,
                                         allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _persistent(kernel, (m, n), dtype, num_sms, interpret)(table, lhs, rhs)


def _mma_steps(acc_ref, steps, step0, stages, produced, consumed, delay_release, mma):
  """The consumer side of a continuous pipeline: `steps` K steps into acc_ref, from global step `step0`.

  Step s's operands are in slot s % stages once produced[slot] completes; the slot is handed back
  (consumed[slot], one arrival per consumer warpgroup) when this warpgroup's wgmma on it has
  finished: at once (delay_release 0), or one step later (1), so that one wgmma group stays in
  flight while the next step's barrier is awaited and its wgmma issued. `mma(ki, slot)` issues it.
  """

  def body(ki, acc_ref):
    step = step0 + ki
    slot = lax.rem(step, stages)
    plgpu.barrier_wait(produced.at[slot])
    mma(ki, slot, acc_ref)
    plgpu.wgmma_wait(delay_release)
    if delay_release:
      plgpu.barrier_arrive(consumed.at[lax.rem(step + stages - 1, stages)], predicate=ki > 0)
    else:
      plgpu.barrier_arrive(consumed.at[slot])
    return acc_ref

  lax.fori_loop(0, steps, body, acc_ref)
  if delay_release:
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(consumed.at[lax.rem(step0 + steps - 1, stages)])


def _load_steps(steps, step0, stages, produced, consumed, copies):
  """The producer side: for each of `steps` K steps, wait for its slot to be handed back (from the
  CTA's stages-th step on) and issue `copies(ki, slot, barrier)`, whose TMA copies complete it."""

  @pl.loop(0, steps)
  def _(ki):
    step = step0 + ki
    slot = lax.rem(step, stages)

    @pl.when(step >= stages)
    def _():
      plgpu.barrier_wait(consumed.at[slot])

    copies(ki, slot, produced.at[slot])


def _await_last_releases(steps_done, stages, consumed):
  """The producer's last act: wait for the consumers to hand back the CTA's last `stages` steps.

  `_load_steps` waits for a slot's release only before reusing it, so without this the final
  releases complete barrier phases the producer never observes. The hardware does not mind (the
  CTA ends once the consumers do anyway), but Mosaic GPU's interpret mode refuses to free a barrier
  with a phase some warpgroup that waits on it has not seen, and that mode is how CI runs these
  kernels on the CPU.
  """
  for back in range(stages, 0, -1):
    step = steps_done - back

    @pl.when(step >= 0)
    def _():
      plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])


def _row_variants(tile_m: int, short_m: int | None, hi):
  """(rows, predicate) of the tile heights a tile may run at: all `tile_m` rows, or, with `short_m`,
  `short_m` rows where the group's rows end within them (hi <= short_m: a group's last tile under
  skew, or a narrow group's tail), so half the MMAs of a 64-row tail are not spent on rows past it."""
  if short_m is None:
    return ((tile_m, None),)
  return ((tile_m, hi > short_m), (short_m, hi <= short_m))


def _continuous_forward_kernel(m, k, n, g, num_tiles, dtype, config: Config, transpose_rhs: bool):
  """The forward/dx kernel body with one pipeline over all of a CTA's (tile, N block) items.

  Per item the producer warpgroup streams k / block_k steps of (lhs rows, the group's weight block)
  into `stages` slots, numbered by the CTA's global step, so it runs up to `stages` steps into the
  next item while the consumers finish this one and store it: no drain and refill per item (the
  per-item pipeline's cost at short K: Qwen's dx has 10 steps per item). Both sides walk the same
  items and skip the same ones (zero tiles and unused ones), so their step counts agree.

  The CTA's tile is `config.rows` x `config.columns`. By default the consumers split its columns
  (each block_m x block_n, sharing the lhs block). With `config.split_rows` they split its rows, as
  CUTLASS's cooperative Hopper kernels do: each takes block_m of the 2 * block_m rows and all
  block_n columns (one m64nN wgmma per K slice at block_m 64, sharing the weight block), and a
  consumer whose half holds none of the group's rows (a group's last tile, under skew) runs no MMAs,
  only the barriers: the 64-row tail of `short_tiles` without a second accumulator or a predicated
  copy.

  `config.store_cols`: a consumer's tile goes out through an output buffer that many columns wide,
  one chunk after another (each waits until the previous chunk's copy has read the buffer), so the
  shared memory an output tile would take holds one more pipeline stage.
  """
  del m
  tile_m, tile_n, tile_k = config.block_m, config.block_n, config.block_k
  rows, columns = config.rows, config.columns
  split, stages, k_steps = config.split_rows, config.max_concurrent_steps, k // tile_k
  n_blocks = pl.cdiv(n, columns)
  transforms = smem_transforms(tile_k, dtype)
  rhs_block = (columns, tile_k) if transpose_rhs else (tile_k, columns)
  short_m = 64 if config.short_tiles and tile_m > 64 else None
  store_cols = config.store_width

  def kernel(table_gmem, lhs_gmem, rhs_gmem, out_gmem):
    @functools.partial(
        pl.run_scoped,
        lhs_smem=plgpu.SMEM((stages, rows, tile_k), dtype, transforms=transforms),
        rhs_smem=plgpu.SMEM((stages, *rhs_block), dtype, transforms=transforms),
        out_smem=plgpu.SMEM((2 * tile_m, store_cols), dtype),
        # One arrival per TMA copy issued: rhs and lhs, or rhs and both lhs variants with short
        # tiles (a copy whose predicate is false still arrives, expecting 0 bytes).
        produced=plgpu.Barrier(num_arrivals=2 if short_m is None else 3, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # two consumer warpgroups
        collective_axes="wg",
    )
    def scope(lhs_smem, rhs_smem, out_smem, produced, consumed):
      wg = lax.axis_index("wg")

      def item(info):
        tile, n_block = plgpu.planar_snake(info.index[0], (num_tiles, n_blocks), 1, config.grid_block_n)
        group, first_row = table_gmem[0, tile], pl.multiple_of(table_gmem[1, tile], 8)
        lo, hi = table_gmem[2, tile], table_gmem[3, tile]
        return n_block, group, first_row, lo, hi, (hi > lo) & (group < g)

      @pl.when(wg == 2)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @plgpu.nd_loop((num_tiles * n_blocks,), collective_axes="sm", init_carry=jnp.int32(0))
        def work(info, carry):
          n_block, group, first_row, _, hi, runs = item(info)

          def copies(ki, slot, barrier):
            ks = pl.ds(ki * tile_k, tile_k)
            ns = pl.ds(n_block * columns, columns)
            for lhs_rows, pred in _row_variants(rows, short_m, hi):
              plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(first_row, lhs_rows), ks],
                                      lhs_smem.at[slot, pl.ds(0, lhs_rows)], barrier, predicate=pred)
            rhs_src = rhs_gmem.at[group, ns, ks] if transpose_rhs else rhs_gmem.at[group, ks, ns]
            plgpu.copy_gmem_to_smem(rhs_src, rhs_smem.at[slot], barrier)

          @pl.when(runs)
          def _():
            _load_steps(k_steps, carry, stages, produced, consumed, copies)

          return carry + jnp.where(runs, k_steps, 0)

        _await_last_releases(work, stages, consumed)

      @pl.when(wg < 2)
      def _consumers():
        plgpu.set_max_registers(232, action="increase")
        smem_row = pl.multiple_of(wg * tile_m, tile_m)

        @plgpu.nd_loop((num_tiles * n_blocks,), collective_axes="sm", init_carry=jnp.int32(0))
        def work(info, carry):
          n_block, group, first_row, lo, hi, runs = item(info)
          if split:  # this warpgroup's rows of the tile, counted from its own first row
            row0 = first_row + wg * tile_m
            lo, hi = (jnp.clip(x - wg * tile_m, 0, tile_m) for x in (lo, hi))
            col = n_block * columns
          else:
            row0, col = first_row, n_block * columns + wg * tile_n

          def rhs_view(slot):
            if config.rows_as_n:  # this warpgroup's columns as the MMA's M: [tile_n, tile_k]
              if transpose_rhs:
                return rhs_smem.at[slot, pl.ds(wg * tile_n, tile_n), :]
              return rhs_smem.at[slot, :, pl.ds(wg * tile_n, tile_n)].transpose((1, 0))
            if split:
              return rhs_smem.at[slot].transpose((1, 0)) if transpose_rhs else rhs_smem.at[slot]
            if transpose_rhs:
              return rhs_smem.at[slot, pl.ds(wg * tile_n, tile_n), :].transpose((1, 0))
            return rhs_smem.at[slot, :, pl.ds(wg * tile_n, tile_n)]

          def store(values, tile_rows, transposed=False):
            """values [tile_rows, tile_n] ([tile_n, tile_rows] if `transposed`: a rows_as_n accumulator,
            written through a transposed view of the buffer) in `store_cols`-column chunks; chunks wholly
            past N store nothing."""
            for first in range(0, tile_n, store_cols):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous copy has read it
              if transposed:
                out_smem.at[pl.ds(smem_row, tile_rows)].transpose((1, 0))[...] = values[first:first + store_cols]
              else:
                out_smem[pl.ds(smem_row, tile_rows), :] = values[:, first:first + store_cols]
              plgpu.commit_smem()

              @pl.when(col + first < n)
              def _(first=first):
                _store_rows(out_smem, smem_row, out_gmem, row0, col + first, lo, hi, tile_rows, store_cols)

          @pl.when((hi > lo) & (group == g) & (col < n))  # rows past the groups: zeros
          def _():
            store(jnp.zeros((tile_m, tile_n), dtype), tile_m)

          if split:
            # A half with none of the group's rows hands the slots back without an MMA.
            @pl.when(runs & (hi <= lo))
            def _():
              _mma_steps(None, k_steps, carry, stages, produced, consumed, config.delay_release,
                         lambda ki, slot, acc_ref: None)

          consumer_runs = runs & (hi > lo) if split else runs
          for tile_rows, pred in _row_variants(tile_m, short_m, hi):
            def mma(ki, slot, acc_ref, tile_rows=tile_rows):
              del ki
              lhs_view = lhs_smem.at[slot, pl.ds(wg * tile_m, tile_m)] if split else lhs_smem.at[slot, pl.ds(0, tile_rows)]
              if config.rows_as_n:  # out^T += rhs^T lhs^T
                plgpu.wgmma(acc_ref, rhs_view(slot), lhs_view.transpose((1, 0)))
              else:
                plgpu.wgmma(acc_ref, lhs_view, rhs_view(slot))

            acc_shape = (tile_n, tile_rows) if config.rows_as_n else (tile_rows, tile_n)

            @pl.when(consumer_runs if pred is None else consumer_runs & pred)
            def _(tile_rows=tile_rows, mma=mma, acc_shape=acc_shape):
              @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(acc_shape, jnp.float32))
              def _(acc_ref):
                _mma_steps(acc_ref, k_steps, carry, stages, produced, consumed, config.delay_release, mma)
                acc = acc_ref[...].astype(dtype)

                @pl.when(col < n)  # a half wholly past N stores nothing
                def _():
                  store(acc, tile_rows, transposed=config.rows_as_n)

          return carry + jnp.where(runs, k_steps, 0)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel


def group_table(group_sizes: jax.Array) -> jax.Array:
  """int32[4, G] per group: (first row read, a multiple of 8; rows [lo, hi) of the group from it;
  the row, from it, where the rows past all groups begin).

  The dW kernel walks rows first_row + [0, ceil(hi / block_k) * block_k) and selects 0, in the blocks
  that hold them, for b's rows outside [lo, hi) (the neighbouring groups') and for a's rows past all
  groups (which may hold anything). An empty group has lo = hi.
  """
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first_row = starts // 8 * 8
  return jnp.stack([first_row, starts - first_row, ends - first_row, ends[-1] - first_row]).astype(jnp.int32)


def _mask_rows(ref, keep):
  """ref[r, :] = 0 where not keep(r), r the row within the step's block, in shared memory, fenced for
  the wgmma that reads it next.

  A block both consumer warpgroups read (a, or b with `split_rows`) is masked by both, unordered:
  each writes back the values it read or zero, and the result is the same in any interleaving, so no
  barrier between the two is needed. Mosaic GPU's race detector reports these writes (and only
  these: tests/test_grouped_matmul.py).
  """
  row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
  values = ref[...]
  ref[...] = jnp.where(keep(row), values, jnp.zeros_like(values))
  plgpu.commit_smem()


def _store_dw_tile(out_smem, smem_row, tile_p: int, out_tile, inside_q, acc):
  """One consumer's [tile_p, tile_q] f32 dW block to `out_tile` through its rows of `out_smem`
  (nothing where the block lies wholly past Q: `inside_q` false)."""
  @pl.when(inside_q)
  def _():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem[pl.ds(smem_row, tile_p), :] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(smem_row, tile_p)], out_tile)


def transposed_grouped_matmul_tiled(a, b, group_sizes, *, config: Config, num_sms: int | None = None,
                                    interpret=None):
  """a bf16|f16[M, P], b [M, Q] -> [G, P, Q] in a.dtype: `a_g^T @ b_g` over each group's rows (dW).

  Persistent over (group, P block, Q block) work items, group-major so a group's rows stay in L2
  while its tiles are computed. A CTA computes block_m x 2 * block_n of one group's output: a TMA
  producer streams block_k rows of a and b at a time; each consumer warpgroup zeroes, in the first
  and last block, its half of b's rows that belong to other groups, and, in a block that reaches past
  the groups, a's rows there (both warpgroups write the same zeros to the shared a block, so the
  order does not matter), then accumulates `a_blk^T @ b_blk` in f32. Rows past sum(group_sizes) may
  hold anything, NaN included. P must be a multiple of block_m (the caller pads); Q need not be a
  multiple of 2 * block_n (TMA reads b's columns past Q as zeros and drops those stores). An empty
  group's output is 0.
  """
  m, p = a.shape
  q = b.shape[1]
  g = group_sizes.shape[0]
  tile_p, tile_q, tile_k = config.block_m, config.block_n, config.block_k
  block_q = 2 * tile_q
  if config.rows_as_n:
    raise ValueError("Config.rows_as_n is a forward/dx tiling; the dW kernel does not take it.")
  if p % (tile_p * (2 if config.split_rows else 1)):
    raise ValueError(f"P={p} must be a multiple of block_m={tile_p} (twice that with split_rows).")
  table = group_table(group_sizes)
  p_blocks, q_blocks = p // tile_p, pl.cdiv(q, block_q)
  dtype = a.dtype
  a_transforms = smem_transforms(tile_p, dtype)  # a's block is [rows, P]: P is its minor axis
  b_transforms = smem_transforms(block_q, dtype)
  if num_sms is None:
    num_sms = jax.devices()[0].core_count
  if config.continuous:
    kernel = _continuous_dw_kernel(m, p, q, g, dtype, config)
    return _persistent(kernel, (g, p, q), dtype, num_sms, interpret)(table, a, b)

  def pipeline(body, compute_context, steps):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tile_k, tile_p), lambda ki: (ki, 0), transforms=a_transforms, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tile_k, block_q), lambda ki: (ki, 0), transforms=b_transforms, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  def kernel(table_gmem, a_gmem, b_gmem, out_gmem):
    unused = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        # A static grid of `stages` steps: a shorter one would size the buffers for fewer stages.
        allocations=pipeline(unused, unused, config.max_concurrent_steps).get_allocations(a_gmem.at[:, pl.ds(0, tile_p)],
                                                                b_gmem.at[:, pl.ds(0, block_q)]),
        out_smem=plgpu.SMEM((2 * tile_p, tile_q), dtype),
        collective_axes="wg",
    )
    def scope(allocations, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g, p_blocks * q_blocks), collective_axes="sm")
      def work(info: plgpu.NDLoopInfo):
        group = info.index[0]
        p_block, q_block = plgpu.planar_snake(info.index[1], (p_blocks, q_blocks), 1, config.grid_block_n)
        first_row, lo, hi = pl.multiple_of(table_gmem[0, group], 8), table_gmem[1, group], table_gmem[2, group]
        past_groups = table_gmem[3, group]
        steps = (hi + tile_k - 1) // tile_k
        smem_row = pl.multiple_of(wg * tile_p, tile_p)
        col = q_block * block_q + wg * tile_q
        out_tile = out_gmem.at[group, pl.ds(p_block * tile_p, tile_p), pl.ds(col, tile_q)]

        store = functools.partial(_store_dw_tile, out_smem, smem_row, tile_p, out_tile, col < q)

        @pl.when((hi == lo) & (wg < 2))  # an empty group: zeros from the two consumer warpgroups
        def _():
          store(jnp.zeros((tile_p, tile_q), jnp.float32))

        @pl.when(hi > lo)
        def _():
          def compute_context(run_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_p, tile_q), jnp.float32))
            def _(acc_ref):
              run_pipeline(acc_ref)
              store(acc_ref[...])

          def mma(idx, a_smem, b_smem, acc_ref):
            b_half = b_smem.at[:, pl.ds(wg * tile_q, tile_q)]
            step = idx[0]

            base = step * tile_k

            @pl.when((step == 0) | (step == steps - 1))
            def _():
              _mask_rows(b_half, lambda r: (r + base >= lo) & (r + base < hi))

            @pl.when(base + tile_k > past_groups)  # 0 * NaN is NaN: a's rows past the groups too
            def _():
              _mask_rows(a_smem, lambda r: r + base < past_groups)

            plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_half)
            plgpu.wgmma_wait(0)
            return acc_ref

          rows = pl.ds(first_row, m)  # static length; only the first `steps` blocks are read
          pipeline(mma, compute_context, steps)(a_gmem.at[rows, pl.ds(p_block * tile_p, tile_p)],
                                                b_gmem.at[rows, pl.ds(q_block * block_q, block_q)],
                                                allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _persistent(kernel, (g, p, q), dtype, num_sms, interpret)(table, a, b)


def _continuous_dw_kernel(m, p, q, g, dtype, config: Config):
  """The dW kernel body with one pipeline over all of a CTA's (group, P block, Q block) items.

  As `_continuous_forward_kernel`: the producer numbers steps across items (a group's item has
  ceil(rows / block_k) steps, so the count is carried), and loads the next item's first rows while
  the consumers finish and store this one; a group's small K (Qwen: 320 rows, 5 steps) made the
  per-item pipeline's drain and refill a large share of each item. The masking is the per-item
  kernel's: b's rows of other groups in the first and last step, a's rows past all groups.

  `config.split_rows`: the CTA's tile is 2 * block_m of P by block_n of Q, the warpgroups splitting
  P (each masks the whole shared b block and its half of a; identical writes, as for a below), so a
  Q that 2 * block_n does not divide (Qwen's 640 = 5 x 128) reads and computes no columns past it.
  """
  del m
  tile_p, tile_q, tile_k = config.block_m, config.block_n, config.block_k
  stages, split = config.max_concurrent_steps, config.split_rows
  block_p, block_q = (2 * tile_p, tile_q) if split else (tile_p, 2 * tile_q)
  p_blocks, q_blocks = p // block_p, pl.cdiv(q, block_q)
  a_transforms = smem_transforms(block_p, dtype)
  b_transforms = smem_transforms(block_q, dtype)

  def kernel(table_gmem, a_gmem, b_gmem, out_gmem):
    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((stages, tile_k, block_p), dtype, transforms=a_transforms),
        b_smem=plgpu.SMEM((stages, tile_k, block_q), dtype, transforms=b_transforms),
        out_smem=plgpu.SMEM((2 * tile_p, tile_q), dtype),
        produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        collective_axes="wg",
    )
    def scope(a_smem, b_smem, out_smem, produced, consumed):
      wg = lax.axis_index("wg")

      def item(info):
        group = info.index[0]
        p_block, q_block = plgpu.planar_snake(info.index[1], (p_blocks, q_blocks), 1, config.grid_block_n)
        first_row, lo, hi = pl.multiple_of(table_gmem[0, group], 8), table_gmem[1, group], table_gmem[2, group]
        steps = jnp.where(hi > lo, (hi + tile_k - 1) // tile_k, 0)
        return group, p_block, q_block, first_row, lo, hi, table_gmem[3, group], steps

      @pl.when(wg == 2)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @plgpu.nd_loop((g, p_blocks * q_blocks), collective_axes="sm", init_carry=jnp.int32(0))
        def work(info, carry):
          _, p_block, q_block, first_row, _, _, _, steps = item(info)

          def copies(ki, slot, barrier):
            rows = pl.ds(first_row + ki * tile_k, tile_k)  # past M, TMA reads zeros
            plgpu.copy_gmem_to_smem(a_gmem.at[rows, pl.ds(p_block * block_p, block_p)], a_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(b_gmem.at[rows, pl.ds(q_block * block_q, block_q)], b_smem.at[slot], barrier)

          _load_steps(steps, carry, stages, produced, consumed, copies)
          return carry + steps

        _await_last_releases(work, stages, consumed)

      @pl.when(wg < 2)
      def _consumers():
        plgpu.set_max_registers(232, action="increase")
        smem_row = pl.multiple_of(wg * tile_p, tile_p)

        @plgpu.nd_loop((g, p_blocks * q_blocks), collective_axes="sm", init_carry=jnp.int32(0))
        def work(info, carry):
          group, p_block, q_block, _, lo, hi, past_groups, steps = item(info)
          if split:
            row0, col = p_block * block_p + wg * tile_p, q_block * block_q
          else:
            row0, col = p_block * block_p, q_block * block_q + wg * tile_q
          out_tile = out_gmem.at[group, pl.ds(row0, tile_p), pl.ds(col, tile_q)]

          store = functools.partial(_store_dw_tile, out_smem, smem_row, tile_p, out_tile, col < q)

          @pl.when(hi == lo)  # an empty group: zeros
          def _():
            store(jnp.zeros((tile_p, tile_q), jnp.float32))

          def mma(ki, slot, acc_ref):
            if split:
              a_wg, b_wg = a_smem.at[slot, :, pl.ds(wg * tile_p, tile_p)], b_smem.at[slot]
            else:
              a_wg, b_wg = a_smem.at[slot], b_smem.at[slot, :, pl.ds(wg * tile_q, tile_q)]
            base = ki * tile_k

            @pl.when((ki == 0) | (ki == steps - 1))
            def _():
              _mask_rows(b_wg, lambda r: (r + base >= lo) & (r + base < hi))

            @pl.when(base + tile_k > past_groups)  # 0 * NaN is NaN: a's rows past the groups too
            def _():
              _mask_rows(a_wg, lambda r: r + base < past_groups)

            plgpu.wgmma(acc_ref, a_wg.transpose((1, 0)), b_wg)

          @pl.when(hi > lo)
          def _():
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_p, tile_q), jnp.float32))
            def _(acc_ref):
              _mma_steps(acc_ref, steps, carry, stages, produced, consumed, config.delay_release, mma)
              store(acc_ref[...])

          return carry + steps

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel
