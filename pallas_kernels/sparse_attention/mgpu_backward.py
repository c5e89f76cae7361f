"""Sparse-attention backward on Hopper Mosaic GPU for the MQA shape of absorbed MLA (one shared key head).

One CTA per (token, 64 heads), three warpgroups, 64 selected keys a step (`block_k`, one gathered
[64, Dk] tile, the forward's producer and barriers: `mgpu_forward._gather_steps`):

- Q [64, Dk] and dO [64, Dv] stay in shared memory for the whole row.
- Consumer 0 computes S = Q K^T and P = exp2(S scale log2(e) - lse log2(e)) (0 at invalid slots) and
  shares P (bf16) through shared memory. Consumer 1 computes dP = dO V^T (V = K[:, :Dv], the same
  tile), reads P back and shares dS = P (dP - delta) scale (bf16). Reading P in bf16 adds an error of
  the size of dS's own bf16 rounding, which every matmul below takes anyway.
- Both: dQ += dS K, each consumer over its own columns (f32 accumulators in registers: consumer 0
  Dk[0:256] and the tail past 512, consumer 1 Dk[256:512] at MLA dims); then the slot is free and the
  producer gathers the next step while the consumers form dK rows.
- dK rows: dKV = dS^T Q + P^T dO (the latter over the first Dv columns: the values are the key rows'
  prefix), in 64-column chunks split between the consumers (warpgroup MMA with the transposed P and dS
  tiles read from shared memory), each chunk added from registers into an f32 [S, Dk] buffer in
  global memory with `red.global.v2.f32.add` at the gathered key's row (`_scatter_add`). Invalid
  slots add nothing; repeated indices add once per occurrence (separate atomic adds).

delta = rowsum(dO * O) - dlse and the base-2 lse are formed by XLA beforehand; the sinks need nothing
here (the saved lse holds them; dsinks is the caller's XLA sum). dq comes out in q's dtype, dK in f32.

Shapes: q [B, T, H, Dk], k [B, S, 1, Dk], indices int32 [B, T, K], out and dout [B, T, H, Dv],
lse and dlse f32 [B, T, H] -> dq [B, T, H, Dk], dk f32 [B, S, 1, Dk] (value gradient included).

Shared memory at MLA dims: Q 72 KiB, dO 64, the key tile 72, P and dS 8 each, and 1 KiB for the
mbarriers (Pallas rounds each allocation up to 1 KiB; another for the sweep's counter): 225-226 KiB of
the 227, so one gathered stage: the producer fills it again while the consumers form and scatter dK rows.

The schedule (`Config.schedule`) keeps the CTAs that run at once on a narrow band of key rows, so
that the rows they gather and add into stay in L2. In one launch over all tokens ("one_launch") CTAs
start whenever an SM frees, at every phase of their rows, and at 64K the rows they touch (dK f32 151
MB, K 75 MB) far exceed the 50 MB L2. The other two sort each row's indices by key first
(`sorted_by_key`, which skips the sort when the rows already are, as FlashTopK's arrive):
- "waves": launches of one CTA per SM, in a loop. The CTAs of a launch start together and walk their
  keys upward at about the same pace. Each launch waits for its slowest CTA, and Q and dO load with
  nothing else running: a fixed cost per wave.
- "sweep" (the default): one launch. CTAs publish how far they are through a pass over their row (a
  relaxed atomic max on an int32 counter, in 1/4096ths of a pass); a starting CTA reads it and begins
  its walk at that fraction of its own row, wrapping around. Rows of tokens that run together have
  about the same keys at the same fraction, so the running CTAs share one moving band with no launch
  gaps. The value read only picks where a row's walk starts (any value gives the same sums; each CTA
  shares the one value its thread 0 read), so dq's summation order, like dK's, varies run to run.
The sweep measured fastest of the three at 64K, and no slower than one launch at 16K. What is left at
64K is the DRAM traffic of each pass over the rows (dK read and written back, K read: about 377 MB a
pass, one pass per SM count of tokens), which does not overlap the compute.

The f32 atomic adds (T k Dk 4 bytes) are most of the kernel's time: without the scatter (the
`skip_scatter` diagnostic) it runs in about a third of the time. docs/kernels/sparse_attention.md has
the measurements of the schedules, the configs and the alternatives tried.
Nothing here runs on CPU: it needs sm_90a (wgmma, cp.async into swizzled tiles, vector red).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, memref, vector
from jaxlib.mlir.dialects import llvm, nvvm  # jax.extend.mlir has neither; jaxlib's own bindings, as mgpu_forward
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import smem_transforms
from pallas_kernels.sparse_attention import mgpu_forward as fwd
from pallas_kernels.sparse_attention._common import row_delta

_HEADS = fwd._HEADS
_BLOCK_K = 64  # keys a step: dK's rows are one warpgroup MMA's M
_LOG2E = math.log2(math.e)
SCHEDULES = ("one_launch", "waves", "sweep")
_SWEEP_UNIT = 4096  # the sweep's progress counts passes over a row in 1/4096ths


@dataclasses.dataclass(frozen=True)
class Config:
  """Register splits of the three warpgroups (consumers, producer), the width of the dK chunks (columns
  of dK rows per MMA and scatter: 64 or 128), `dk_evict_last` (the adds carry an L2 evict_last hint,
  so the f32 dK rows outlive the gathered key rows in L2), `schedule` ("sweep", "waves" or
  "one_launch": see the module docstring), `sweep_start` (the sweep's counter before the launch: 0;
  tests start it elsewhere so that rows start their walks past their first block), and
  `skip_scatter`, a timing diagnostic only (dK stays zero: what the atomic adds cost).

  The defaults (128-column chunks, 240 / 24 registers, the evict_last hint, the sweep) are the fastest
  measured. Measured slower and removed: `red.global.v4` adds, the next chunk's MMAs issued before
  this chunk's scatter (spills), and dK rows staged in shared memory and added by the TMA unit
  (`cp.reduce.async.bulk`: faster alone, slower in this kernel, whose shared memory is full).
  docs/kernels/sparse_attention.md has the figures.
  """

  consumer_registers: int = 240
  producer_registers: int = 24
  dkv_cols: int = 128
  skip_scatter: bool = False
  dk_evict_last: bool = True
  schedule: str = "sweep"
  sweep_start: int = 0

  def __post_init__(self):
    if self.dkv_cols not in (64, 128):
      raise ValueError(f"Config.dkv_cols={self.dkv_cols} must be 64 or 128.")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"Config.schedule={self.schedule!r} must be one of {SCHEDULES}.")


def _column_groups(dk: int, dv: int):
  """dQ's columns per consumer as (start, width) groups of <= 256 (one MMA's N): consumer 1 takes the
  second quarter-to-half of the value columns, consumer 0 the rest (MLA: [0, 256) + [512, 576) and
  [256, 512)), so the consumer that also forms dS holds fewer accumulators."""
  half = dv // 2
  first = [(0, half)] + ([(dv, dk - dv)] if dk > dv else [])
  return first, [(half, dv - half)]


def _dkv_chunks(dk: int, dv: int, width: int):
  """dK's column chunks (start, width) per consumer, at most `width` wide and never across Dv/2 or Dv:
  consumer 1 the chunks of its dQ columns, consumer 0 the others."""
  half = dv // 2
  chunks = [(c, min(width, end - c)) for start, end in ((0, half), (half, dv), (dv, dk)) for c in range(start, end, width)]
  return [c for c in chunks if not half <= c[0] < dv], [c for c in chunks if half <= c[0] < dv]


def _scatter_add(dk_ref, rows, keys, col0, evict_last: bool):
  """dk_ref[keys[r], col0 + c] += rows[r, c] for the rows whose key is in [0, S), from registers.

  `dk_ref` f32 [S, Dk] in global memory; `rows` f32 [64, N] and `keys` int32 [64, N] (each row's key,
  broadcast along the columns) in the warpgroup-MMA layout. Each register holds two adjacent columns
  of one row: one `red.global.v2.f32.add` each (relaxed, GPU scope: nothing reads dk before the end),
  with `evict_last` under an L2 evict_last policy (`createpolicy.fractional`, all lines).
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA, plgpu.Layout.WGMMA))
  def scatter(ctx, dk_ref, rows, keys):
    del ctx
    i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
    num_keys, dk = ir.MemRefType(dk_ref.type).shape
    base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(dk_ref))
    policy = (mgpu_utils.inline_ptx("createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", result_types=i64)
              if evict_last else None)
    for reg, key_reg, (_, col) in zip(rows.registers.flat, keys.registers.flat,
                                      rows.layout.thread_idxs(rows.shape), strict=True):
      key = vector.extract(key_reg, [], [0])
      valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, key, fwd._c(0, i32)),
                         arith.cmpi(arith.CmpIPredicate.slt, key, fwd._c(num_keys, i32)))
      col = arith.index_cast(i64, col)
      offset = arith.addi(arith.muli(arith.extsi(i64, key), fwd._c(dk, i64)), arith.addi(col, fwd._c(col0, i64)))
      ptr = mgpu_utils.getelementptr(base, [offset], f32)
      lo, hi = vector.extract(reg, [], [0]), vector.extract(reg, [], [1])
      if policy is None:
        mgpu_utils.inline_ptx("red.global.v2.f32.add [$0], {$1, $2};", ptr, lo, hi, predicate=valid)
      else:
        mgpu_utils.inline_ptx("red.global.add.L2::cache_hint.v2.f32 [$0], {$1, $2}, $3;", ptr, lo, hi, policy,
                              predicate=valid, has_side_effects=True)

  scatter(dk_ref, rows, keys)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                   return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=fwd._STEP))
def _read_sweep(ctx, sweep_ref, slot_ref):
  """Run by every thread: thread 0 reads the sweep's progress (int32 [1] in global memory, written by
  other CTAs) into shared memory, and after a CTA barrier every thread returns that one value."""
  del ctx
  i32 = ir.IntegerType.get_signless(32)
  ptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(sweep_ref))
  value = mgpu_utils.inline_ptx("ld.relaxed.gpu.global.b32 $0, [$1];", ptr, result_types=i32, has_side_effects=True)
  zero = arith.index_cast(ir.IndexType.get(), fwd._c(0, i32))
  with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), fwd._c(0, i32))):
    memref.store(value, slot_ref, [zero])
  nvvm.barrier()
  return mgpu.FragmentedArray.splat(memref.load(slot_ref, [zero]), (), is_signed=True)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), fwd._STEP))
def _publish_sweep(ctx, sweep_ref, progress):
  """The warpgroup's first thread raises the sweep's progress to `progress` (a relaxed atomic max)."""
  del ctx
  i32 = ir.IntegerType.get_signless(32)
  ptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(sweep_ref))
  first = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(mgpu_utils.thread_idx(), fwd._c(128, i32)), fwd._c(0, i32))
  mgpu_utils.inline_ptx("red.relaxed.gpu.global.max.s32 [$0], $1;", ptr, fwd._scalar(progress), predicate=first)


def _backward_kernel(q_gmem, k_gmem, idx_gmem, do_gmem, lse_gmem, delta_gmem, steps_gmem, *refs,
                     scale, consumer_registers, producer_registers, dkv_cols, skip_scatter, dk_evict_last, schedule):
  # Inputs: q [B, T, H, Dk], k [B, S, Dk], indices int32 [B, T, K_pad], dout [B, T, H, Dv], lse2 f32
  # [B, T, H] (lse log2 e, 0 where -inf), delta f32 [B, T, H], steps int32 [B, T] (live steps),
  # dk f32 [B, S, Dk] (a zeroed Ref that takes the atomic adds). Output: dq [B, T, H, Dk]. With `waves`
  # the refs are first int32 [1] (this launch's first token, flat over B and T), dk, and dq as a Ref that
  # each launch fills in part; with "sweep" first int32 [1] (the sweep's progress), dk, dq.
  num_keys, dk = k_gmem.shape[1:]
  dv = do_gmem.shape[3]
  T, n_heads = q_gmem.shape[1], q_gmem.shape[2] // _HEADS
  cta = lax.axis_index("cta")
  flat = lax.div(cta, n_heads)  # the token, flat over B and T
  sweep_gmem = None
  if schedule == "waves":
    first_gmem, dk_gmem, dq_gmem = refs
    flat = flat + first_gmem[0]
  elif schedule == "sweep":
    sweep_gmem, dk_gmem, dq_gmem = refs
  else:
    dk_gmem, dq_gmem = refs
  live = flat < q_gmem.shape[0] * T  # the last launch's CTAs past B * T tokens store nothing
  flat = jnp.minimum(flat, q_gmem.shape[0] * T - 1)
  h, t, b = lax.rem(cta, n_heads), lax.rem(flat, T), lax.div(flat, T)
  dtype = q_gmem.dtype
  heads = pl.ds(h * _HEADS, _HEADS)
  groups, chunks = _column_groups(dk, dv), _dkv_chunks(dk, dv, dkv_cols)
  row = plgpu.Layout.WGMMA.reduce(1)  # one value per head (S, dP) or per key (dK rows)
  c = scale * _LOG2E

  def body(q_smem, do_smem, k_smem, p_smem, ds_smem, bars, q_bar, do_bar, p_ready, ds_ready, pds_free, *slot):
    wg = lax.axis_index("wg")
    n_steps = jnp.where(live, steps_gmem[b, t], 0)
    fwd._init_gather_barriers(bars)
    first_block, publish = jnp.int32(0), lambda i: None
    if schedule == "sweep":  # start where the running CTAs are: the block at the sweep's fraction of a pass
      progress = _read_sweep(sweep_gmem, *slot)
      fraction = lax.bitwise_and(progress, jnp.int32(_SWEEP_UNIT - 1))  # in [0, unit) whatever the counter holds
      first_block = lax.div(fraction * n_steps, jnp.int32(_SWEEP_UNIT))
      # The pass's start plus the blocks done, in passes. Near 2^31 this would wrap negative and the
      # signed max would ignore it (the sweep stops moving, the sums stay right); the counter starts at
      # 0 each call and grows about a unit a pass, 2^19 passes from that.
      publish = lambda i: _publish_sweep(
          sweep_gmem, progress - fraction + lax.div((first_block + i + 1) * _SWEEP_UNIT, n_steps))
    block = lambda i: fwd.rotated_block(i, first_block, n_steps)
    wait_rows, free_slot = functools.partial(fwd._wait_rows, bars), functools.partial(fwd._free_slot, bars)
    step_ids = lambda i, layout: plgpu.load(idx_gmem.at[b, t, pl.ds(block(i) * _BLOCK_K, _BLOCK_K)],
                                            layout=layout, optimized=False)
    key_tile = k_smem.at[0]

    def dq_update(accs, my_groups):
      def mma(acc_refs):
        for acc_ref, (col, width) in zip(acc_refs, my_groups):
          plgpu.wgmma(acc_ref, ds_smem, k_smem.at[0, :, pl.ds(col, width)])
      return tuple(pl.run_state(mma)([plgpu.ACC.init(a) for a in accs]))

    def scatter(ids, rows, col, width):
      if not skip_scatter:
        _scatter_add(dk_gmem.at[b], rows, lax.broadcast_in_dim(ids, (_BLOCK_K, width), [0]), col, dk_evict_last)

    def dkv(i, my_chunks):
      ids = step_ids(i, row)
      for col, width in my_chunks:
        def mma(acc_ref, col=col, width=width):
          plgpu.wgmma(acc_ref, ds_smem.transpose((1, 0)), q_smem.at[:, pl.ds(col, width)])
          if col < dv:
            plgpu.wgmma(acc_ref, p_smem.transpose((1, 0)), do_smem.at[:, pl.ds(col, width)])
          return acc_ref[...]
        scatter(ids, pl.run_scoped(mma, plgpu.ACC((_BLOCK_K, width), jnp.float32)), col, width)

    def store_dq(accs, my_groups):
      for acc, (col, width) in zip(accs, my_groups):
        key_tile[:, pl.ds(col, width)] = acc.astype(dtype)  # this consumer's columns of the tile are free
      plgpu.commit_smem()

      @pl.when(live)
      def _():
        for col, width in my_groups:
          for r in range(_HEADS // 8):  # a TMA store reads contiguous shared memory: one 8-row tile row each
            plgpu.copy_smem_to_gmem(key_tile.at[pl.ds(8 * r, 8), pl.ds(col, width)],
                                    dq_gmem.at[b, t, pl.ds(h * _HEADS + 8 * r, 8), pl.ds(col, width)])
      plgpu.wait_smem_to_gmem(0)

    zeros = lambda width: plgpu.layout_cast(jnp.zeros((_HEADS, width), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _probabilities_wg():
      plgpu.set_max_registers(consumer_registers, action="increase")
      plgpu.copy_gmem_to_smem(q_gmem.at[b, t, heads], q_smem, q_bar)
      plgpu.copy_gmem_to_smem(do_gmem.at[b, t, heads], do_smem, do_bar)
      lse2 = plgpu.load(lse_gmem.at[b, t, heads], layout=row, optimized=False)
      plgpu.barrier_arrive(pds_free)
      plgpu.barrier_wait(q_bar)
      plgpu.barrier_wait(do_bar)

      def step(i, accs):
        ids = step_ids(i, plgpu.Layout.WGMMA.reduce(0))
        wait_rows(i)

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, key_tile.transpose((1, 0)))
          return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((_HEADS, _BLOCK_K), jnp.float32))
        valid = lax.broadcast_in_dim((ids >= 0) & (ids < num_keys), s.shape, [1])
        p = jnp.where(valid, jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [0])), 0.0)
        plgpu.barrier_wait(pds_free)  # both consumers are done with the previous P and dS
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        plgpu.barrier_wait(ds_ready)
        accs = dq_update(accs, groups[0])
        free_slot(i)
        publish(i)
        dkv(i, chunks[0])
        plgpu.barrier_arrive(pds_free)
        return accs

      accs = lax.fori_loop(0, n_steps, step, tuple(zeros(w) for _, w in groups[0]))
      store_dq(accs, groups[0])

    @pl.when(wg == 1)
    def _gradient_wg():
      plgpu.set_max_registers(consumer_registers, action="increase")
      delta = plgpu.load(delta_gmem.at[b, t, heads], layout=row, optimized=False)
      plgpu.barrier_arrive(pds_free)
      plgpu.barrier_wait(q_bar)
      plgpu.barrier_wait(do_bar)

      def step(i, accs):
        wait_rows(i)

        def dov(acc_ref):
          plgpu.wgmma(acc_ref, do_smem, key_tile.at[:, pl.ds(0, dv)].transpose((1, 0)))
          return acc_ref[...]
        dp = pl.run_scoped(dov, plgpu.ACC((_HEADS, _BLOCK_K), jnp.float32))
        plgpu.barrier_wait(p_ready)
        p = plgpu.load(p_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0])) * scale
        ds_smem[...] = ds.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready)
        accs = dq_update(accs, groups[1])
        free_slot(i)
        dkv(i, chunks[1])
        plgpu.barrier_arrive(pds_free)
        return accs

      accs = lax.fori_loop(0, n_steps, step, tuple(zeros(w) for _, w in groups[1]))
      store_dq(accs, groups[1])

    @pl.when(wg == 2)
    def _gather_wg():
      plgpu.set_max_registers(producer_registers, action="decrease")
      fwd._gather_steps(k_gmem.at[b], idx_gmem.at[b, t], k_smem, bars, jnp.asarray(n_steps, jnp.int32),
                        zero_fill=True, first_block=first_block)

  tile = smem_transforms(_BLOCK_K, dtype)
  pl.run_scoped(
      body,
      plgpu.SMEM((_HEADS, dk), dtype, transforms=fwd._KEY_TRANSFORMS),
      plgpu.SMEM((_HEADS, dv), dtype, transforms=fwd._KEY_TRANSFORMS),
      plgpu.SMEM((1, _BLOCK_K, dk), dtype, transforms=fwd._KEY_TRANSFORMS),
      plgpu.SMEM((_HEADS, _BLOCK_K), dtype, transforms=tile),
      plgpu.SMEM((_HEADS, _BLOCK_K), dtype, transforms=tile),
      plgpu.SMEM((4,), jnp.float32),  # the gather's "rows ready" and "slot free" mbarriers (one stage)
      plgpu.Barrier(),
      plgpu.Barrier(),
      plgpu.Barrier(),
      plgpu.Barrier(),
      plgpu.Barrier(num_arrivals=2),
      *([plgpu.SMEM((1,), jnp.int32)] if schedule == "sweep" else []),  # the progress thread 0 read
      collective_axes="wg",
  )


def check_applies(q, k, v, value_dim, deterministic=False):
  """Raises NotImplementedError unless this kernel takes the shapes (the caller then runs Triton)."""
  B, T, H, Dk = q.shape
  Dv = Dk if value_dim is None else value_dim
  if deterministic:
    raise NotImplementedError("the Mosaic GPU backward adds dK atomically (no deterministic mode)")
  if v is not None or k.shape[2] != 1:
    raise NotImplementedError("the Mosaic GPU backward takes values from the key rows and one key head")
  if H % _HEADS or Dk % 64 or Dv % 128 or Dv > min(Dk, 512) or Dk > 576:
    raise NotImplementedError(f"the Mosaic GPU backward needs H % 64 == 0, Dk % 64 == 0, Dk <= 576, Dv % 128 == 0, "
                              f"Dv <= min(Dk, 512); got {H=}, {Dk=}, {Dv=}")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
    raise NotImplementedError(f"the Mosaic GPU backward takes bf16/f16 q and k, got {q.dtype}, {k.dtype}")


def rows_ascending(rows):
  """bool scalar: every row of int [..., K] is non-decreasing."""
  return jnp.all(rows[..., 1:] >= rows[..., :-1])


def sorted_by_key(indices, num_keys: int):
  """int32 [..., K]: each row's indices in [0, num_keys) in ascending order, then -1 for the others.

  Rows that arrive so already (FlashTopK's unsorted rows list their winners in key order) skip the
  sort: one pass checks every row, and the result is the same either way."""
  past = jnp.int32(jnp.iinfo(jnp.int32).max)
  keyed = jnp.where((indices >= 0) & (indices < num_keys), indices, past).astype(jnp.int32)
  in_order = rows_ascending(keyed)
  # Not stable: equal int32 keys are the same value, and XLA makes a stable sort carry an iota
  # operand to break ties (its StableSortExpander), twice the data for nothing here.
  rows = lax.cond(in_order, lambda x: x, lambda x: jnp.sort(x, axis=-1, stable=False), keyed)
  return jnp.where(rows == past, -1, rows)


def sparse_attention_backward_mgpu(q, k, indices, out, lse, dout, dlse, *, scale, config: Config | None = None):
  """(dq in q.dtype [B, T, H, Dk], dk f32 [B, S, 1, Dk]) for values = k[..., :Dv] (Dv = out's last dim).

  Args:
    q: bf16|f16 [B, T, H, Dk]; k: [B, S, 1, Dk]; indices: int [B, T, K], entries outside [0, S)
      skipped; out, dout: [B, T, H, Dv]; lse, dlse: f32 [B, T, H] (lse natural-log, -inf for an empty
      row, as the forward saves it). dk holds the key and the value gradient (f32 atomic sums, in
      an order that varies run to run).

  Raises:
    NotImplementedError: shapes outside `check_applies`.
  """
  check_applies(q, k, None, out.shape[-1])
  config = config or Config()
  B, T, H, Dk = q.shape
  S = k.shape[1]
  K = indices.shape[2]
  K_pad = -(-K // _BLOCK_K) * _BLOCK_K
  indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, K_pad - K)), constant_values=-1)
  f32 = lambda x: x.astype(jnp.float32)
  delta = row_delta(out, dout, dlse)
  lse2 = jnp.where(jnp.isfinite(lse), f32(lse) * _LOG2E, 0.0)  # an empty row's P is 0 by its mask
  dk_acc = jax.new_ref(jnp.zeros((B, S, Dk), jnp.float32))
  launch = functools.partial(
      plgpu.kernel,
      functools.partial(_backward_kernel, scale=float(scale), consumer_registers=config.consumer_registers,
                        producer_registers=config.producer_registers, dkv_cols=config.dkv_cols,
                        skip_scatter=config.skip_scatter, dk_evict_last=config.dk_evict_last,
                        schedule=config.schedule),
      grid_names=("cta",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      kernel_name="hyscale_sparse_attention_bwd",
  )
  dout, keys = dout.astype(q.dtype), k[:, :, 0]
  if config.schedule != "one_launch":  # the sums over slots do not care about their order
    indices = sorted_by_key(indices, S)
  steps = fwd.live_steps(indices, S, _BLOCK_K)
  if config.schedule == "waves":
    tokens = max(1, jax.devices()[0].core_count // (H // _HEADS))  # one CTA per SM a launch
    dq_ref = jax.new_ref(jnp.zeros((B, T, H, Dk), q.dtype))
    call = launch(grid=(tokens * (H // _HEADS),))

    def wave(i, carry):
      call(q, keys, indices, dout, lse2, delta, steps, jnp.full((1,), i * tokens, jnp.int32), dk_acc, dq_ref)
      return carry

    lax.fori_loop(0, pl.cdiv(B * T, tokens), wave, 0)
    return dq_ref[...], dk_acc[...][:, :, None]
  sweep = [jax.new_ref(jnp.full((1,), config.sweep_start, jnp.int32))] if config.schedule == "sweep" else []
  dq = launch(out_type=jax.ShapeDtypeStruct((B, T, H, Dk), q.dtype), grid=(B * T * (H // _HEADS),))(
      q, keys, indices, dout, lse2, delta, steps, *sweep, dk_acc)
  return dq, dk_acc[...][:, :, None]
