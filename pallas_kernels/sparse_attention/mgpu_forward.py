"""Sparse-attention forward on Hopper Mosaic GPU for the MQA shape of absorbed MLA (one shared key head).

One CTA per (token, 64 heads), three warpgroups:

- The producer gathers each step's `block_k` selected key rows (all Dk columns) into a swizzled
  shared-memory ring. Hopper has no TMA gather and a TMA box lands densely in shared memory, so the
  rows go by `cp.async`: thread t copies 16 bytes of row `t // 8` per 64-column tile, written at
  the 128-byte-swizzled address the warpgroup MMA reads (`_copy_rows`, written against the raw
  Mosaic GPU memrefs through `plgpu.inline_mgpu`). Invalid slots (outside [0, S)) are zero-filled
  (or load row 0), so the tile never holds stale NaNs; the scores mask them. By default
  (`Config.gather_signal="mbarrier"`) each thread hands its copies over with
  `cp.async.mbarrier.arrive.noinc` on the slot's "rows ready" barrier and moves on to the next
  free slot: the copies' completion is signalled asynchronously instead of waited for.
- Consumer 0 computes `S = Q K^T` (K = all Dk columns), the online softmax in base 2, shares P
  (bf16) and the row rescale through shared memory, and accumulates `O[:, :Dv/2] += P V`.
- Consumer 1 rescales and accumulates `O[:, Dv/2:]`; the values are the key rows' first Dv
  columns, read from the same tile. Each consumer keeps a [64, Dv/2] f32 accumulator.

Outputs match `sparse_attention.sparse_attention_forward_pallas` (`out` in q's dtype, `lse` f32
with the same convention, -inf and zeros for a row with no valid index; with per-head sinks,
exp(sink) joins the denominator and lse, as in the Triton kernel). It declines (NotImplementedError)
explicit values, G > 1, and heads that are not a multiple of 64. DeepSeek-V4's shape (Dk = Dv =
512, values = keys, sinks) is `value_dim=512` with `v=None`.

Shapes: q [B, T, H, Dk], k [B, S, 1, Dk], indices int32 [B, T, K] -> out [B, T, H, Dv], lse [B, T, H].

Each of the mbarrier hand-over, zero-filled invalid slots and trimmed tails measured faster than
the variant before it, and the kernel several times faster than the Pallas-Triton forward, at MLA
and DeepSeek-V4 dims (docs/kernels/sparse_attention.md has the table). Zero-filling helps most where
short rows' -1 slots would all read row 0 (likely one hot line; not profiled). The gather of key
rows (2.36 MB a token at MLA dims) is the likely bound (an estimate, not profiled).
Nothing here runs on CPU: it needs sm_90a (wgmma, cp.async into swizzled tiles).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, memref
# jax.extend.mlir has no llvm or nvvm dialect (cp.async and the address-space cast need them); these
# are jaxlib's own MLIR bindings, the same modules jax uses, not jax._src.
from jaxlib.mlir.dialects import llvm, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import smem_transforms

_HEADS = 64  # one warpgroup MMA's M
_SWIZZLE = 128  # bytes; a 64-column bf16 tile row
_COLS = 64  # columns per swizzled tile (bf16)
_SMEM_BYTES = 227 * 1024
_LOG2E = math.log2(math.e)
_NEG = -1e30  # a finite "minus infinity" for the running max (empty prefixes never give inf - inf)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning: `block_k` selected keys per step, `num_stages` gathered tiles, register splits, and how
  the producer hands over a step's rows (`gather_signal`):

  - "mbarrier": each producer thread issues its copies and a `cp.async.mbarrier.arrive.noinc` on
    the slot's "rows ready" barrier, which completes once all 128 threads' copies have landed; the
    producer goes straight on to the next free slot, with the next step's indices already loaded.
  - "wait_group": the producer waits for its own copies (`cp.async.wait_group`) before arriving.
    `gathers_in_flight` (this mode only): wait for each step's loads before issuing the next (1), or
    publish step i once step i + 1's loads are issued (2).

  `zero_fill`: invalid slots are zero-filled by the copy (no global read) instead of loading row 0.
  `trim_steps`: each row stops after its last step holding a valid index (XLA counts them first),
  so the all-invalid tail of a row shorter than k costs nothing.

  block_k is 64 for now: at 32, Mosaic GPU's layout inference fails on this kernel (jax 0.11.2).
  """

  block_k: int = 64
  num_stages: int = 2
  consumer_registers: int = 232
  producer_registers: int = 40
  gather_signal: Literal["mbarrier", "wait_group"] = "mbarrier"  # measured: docs/kernels/sparse_attention.md
  gathers_in_flight: int = 1  # 2 measured slower (docs/kernels/sparse_attention.md)
  zero_fill: bool = True
  trim_steps: bool = True

  def __post_init__(self):
    if self.gather_signal not in ("mbarrier", "wait_group"):
      raise ValueError(f"Config.gather_signal={self.gather_signal!r} must be 'mbarrier' or 'wait_group'.")
    if self.gathers_in_flight not in (1, 2):
      raise ValueError(f"Config.gathers_in_flight={self.gathers_in_flight} must be 1 or 2.")
    if self.block_k != 64:
      raise ValueError(f"Config.block_k={self.block_k} must be 64.")
    if self.num_stages < 2:
      raise ValueError(f"Config.num_stages={self.num_stages} must be at least 2.")

  @classmethod
  def heuristics(cls, Dk: int, itemsize: int) -> "Config":
    """64 keys a step, and as many stages as shared memory holds beside Q (two at MLA dims)."""
    block_k = 64
    return cls(block_k=block_k, num_stages=max(2, min(_stages_that_fit(Dk, itemsize, block_k), 4)))


def _stages_that_fit(Dk: int, itemsize: int, block_k: int) -> int:
  """Gathered [block_k, Dk] tiles that fit in shared memory beside Q [64, Dk] and 8 KiB of the rest."""
  return (_SMEM_BYTES - 8 * 1024 - _HEADS * Dk * itemsize) // (block_k * Dk * itemsize)


_KEY_TRANSFORMS = (plgpu.TilingTransform((8, _COLS)), plgpu.SwizzleTransform(_SWIZZLE))


def _c(value, ty):
  return arith.constant(ty, value)


def _scalar(array):
  """The ir.Value of a scalar passed to `inline_mgpu` (a splat FragmentedArray)."""
  return array.registers.flat[0]


def _copy_rows(k_ref, keys, smem, dst_base, zero_fill):
  """cp.async of 16 bytes of each of the rows `keys[r]` (one per 16 tile rows) into the swizzled tile.

  `dst_base` is this thread's byte offset in the tile at `smem` (row t // 8, chunk t % 8, swizzled);
  row r of the thread's rows sits 2 r row tiles further. Keys outside [0, S) load row 0, or nothing
  with `zero_fill` (the copy's source size is 0: the 16 bytes are zeros).
  """
  i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
  num_keys, dk = ir.MemRefType(k_ref.type).shape
  col_tiles, tile_bytes = dk // _COLS, 8 * _SWIZZLE
  gmem = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(k_ref))
  chunk = arith.remui(arith.remui(mgpu_utils.thread_idx(), _c(128, i32)), _c(8, i32))
  src_chunk = arith.extui(i64, arith.muli(chunk, _c(16, i32)))
  for r, key in enumerate(keys):
    valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, key, _c(0, i32)),
                       arith.cmpi(arith.CmpIPredicate.slt, key, _c(num_keys, i32)))
    size = arith.select(valid, _c(16, i32), _c(0, i32)) if zero_fill else None
    key = arith.select(valid, key, _c(0, i32))
    src_row = arith.addi(arith.muli(arith.extui(i64, key), _c(dk * 2, i64)), src_chunk)
    dst_row = arith.addi(dst_base, _c(2 * r * col_tiles * tile_bytes, i32))
    for u in range(col_tiles):
      src = mgpu_utils.getelementptr(gmem, [arith.addi(src_row, _c(u * _COLS * 2, i64))], i8)
      dst = mgpu_utils.getelementptr(smem, [arith.addi(dst_row, _c(u * tile_bytes, i32))], i8)
      nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG, cp_size=size)


def _thread_tile_offset(col_tiles):
  """Byte offset in a [block_k, Dk] tile of thread t's 16 bytes: row t // 8, chunk t % 8, swizzled.

  The tile is physically [block_k / 8, Dk / 64, 8, 64]; in the 128-byte swizzle a row's chunk c
  sits at chunk c ^ (row % 8).
  """
  i32 = ir.IntegerType.get_signless(32)
  tid = arith.remui(mgpu_utils.thread_idx(), _c(128, i32))
  row_in, chunk = arith.divui(tid, _c(8, i32)), arith.remui(tid, _c(8, i32))  # row 0..15
  sub_row = arith.remui(row_in, _c(8, i32))
  return arith.addi(
      arith.muli(arith.divui(row_in, _c(8, i32)), _c(col_tiles * 8 * _SWIZZLE, i32)),
      arith.addi(arith.muli(sub_row, _c(_SWIZZLE, i32)), arith.muli(arith.xori(chunk, sub_row), _c(16, i32))))


def _thread_keys(idx_ref, step, block_k):
  """This thread's keys of `step` (rows t // 8 + 16 r), loaded from the indices in global memory."""
  i32 = ir.IntegerType.get_signless(32)
  first = arith.addi(arith.muli(step, _c(block_k, i32)),
                     arith.divui(arith.remui(mgpu_utils.thread_idx(), _c(128, i32)), _c(8, i32)))
  return [memref.load(idx_ref, [arith.index_cast(ir.IndexType.get(), arith.addi(first, _c(16 * r, i32)))])
          for r in range(block_k // 16)]


def _issue_gather(k_ref, idx_ref, dst_ref, *, zero_fill):
  """cp.async rows k[idx[j]] into dst [block_k, Dk], as one commit group ("wait_group" mode).

  `k_ref` [S, Dk] in global memory, `idx_ref` int32 [block_k], `dst_ref` the tiled, 128-byte-swizzled
  shared tile, physically [block_k / 8, Dk / 64, 8, 64]. Thread t of the warpgroup copies 16 bytes
  (8 columns, chunk t % 8) of rows t // 8 + 16 r of every 64-column tile: eight threads read a
  row's 128 contiguous bytes.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_KEY_TRANSFORMS)))
  def issue(ctx, k_ref, idx_ref, dst_ref):
    del ctx
    row_tiles, col_tiles, tile_rows, tile_cols = ir.MemRefType(dst_ref.type).shape
    assert (tile_rows, tile_cols, col_tiles * tile_cols) == (8, _COLS, ir.MemRefType(k_ref.type).shape[1])
    i32 = ir.IntegerType.get_signless(32)
    keys = _thread_keys(idx_ref, _c(0, i32), 8 * row_tiles)
    _copy_rows(k_ref, keys, mgpu_utils.memref_ptr(dst_ref), _thread_tile_offset(col_tiles), zero_fill)
    nvvm.cp_async_commit_group()

  issue(k_ref, idx_ref, dst_ref)


def _wait_gathers(pending: int):
  """Waits until at most `pending` of this thread's committed gathers are still in flight."""

  @plgpu.inline_mgpu()
  def wait(ctx):
    del ctx
    nvvm.cp_async_wait_group(pending)

  wait()


# ---- "mbarrier" mode: the gather's own barriers ----
# Pallas barrier refs cannot enter `inline_mgpu`, and `cp.async.mbarrier.arrive` needs the barrier's
# address, so the 2 * num_stages mbarriers ("rows ready" then "slot free", 8 bytes each) live in the
# tail of the lse buffer, past its 64 floats, and are driven here. Both are waited on by parity:
# step i uses slot i % num_stages in phase i // num_stages.


def _bar_ptr(bars_ref, number):
  """The shared-memory address of mbarrier `number` (an int or i32 value) of `bars_ref`."""
  i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
  number = _c(number, i32) if isinstance(number, int) else number
  return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(bars_ref), [arith.muli(number, _c(8, i32))], i8)


def _num_stages(bars_ref):
  (floats,) = ir.MemRefType(bars_ref.type).shape
  return floats // 4  # two barriers a stage, two floats a barrier


def _slot_phase(step, num_stages):
  i32 = ir.IntegerType.get_signless(32)
  return arith.remui(step, _c(num_stages, i32)), arith.andi(arith.divui(step, _c(num_stages, i32)), _c(1, i32))


_STEP = plgpu.Layout.WG_SPLAT(shape=())


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _init_gather_barriers(ctx, bars_ref):
  """Run by every thread of the CTA: thread 0 sets up "rows ready" (128 producer arrivals, each
  counted when that thread's copies land) and "slot free" (256: every consumer thread), then all sync."""
  del ctx
  i32 = ir.IntegerType.get_signless(32)
  num_stages = _num_stages(bars_ref)
  first = arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), _c(0, i32))
  for j in range(2 * num_stages):
    nvvm.mbarrier_init(_bar_ptr(bars_ref, j), _c(128 if j < num_stages else 256, i32), predicate=first)
  nvvm.fence_mbarrier_init()
  nvvm.barrier()


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _STEP))
def _wait_rows(ctx, bars_ref, step):
  """A consumer waits for step's rows, then orders them (written by cp.async, the generic proxy)
  before its warpgroup MMAs read them (the async proxy)."""
  del ctx
  i32 = ir.IntegerType.get_signless(32)
  slot, phase = _slot_phase(_scalar(step), _num_stages(bars_ref))
  nvvm.mbarrier_try_wait_parity(_bar_ptr(bars_ref, slot), phase, _c(10_000_000, i32))
  nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _STEP))
def _free_slot(ctx, bars_ref, step):
  """A consumer thread is done reading step's slot."""
  del ctx
  num_stages = _num_stages(bars_ref)
  slot, _ = _slot_phase(_scalar(step), num_stages)
  ptr = _bar_ptr(bars_ref, arith.addi(slot, _c(num_stages, ir.IntegerType.get_signless(32))))
  mgpu_utils.inline_ptx("mbarrier.arrive.release.cta.shared::cta.b64 _, [$0];", ptr, has_side_effects=True)


def _gather_steps(k_ref, idx_ref, dst_ref, bars_ref, n_steps, *, zero_fill, first_block=None):
  """The producer's whole loop: for each step, wait for its slot to be free, copy the rows, and arrive
  (asynchronously, `cp.async.mbarrier.arrive.noinc`) on the slot's "rows ready" barrier.

  `idx_ref` int32 [K_pad] (this row's indices), `dst_ref` the ring [num_stages, block_k, Dk] (tiled,
  swizzled), `n_steps` i32. The next step's keys are loaded before waiting for its slot. With
  `first_block` (i32 in [0, n_steps), 0 when n_steps is 0) step i gathers block (first_block + i) mod
  n_steps of the row: the consumers read their indices through `rotated_block`, the same formula.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_KEY_TRANSFORMS), plgpu.RefType(),
                                _STEP, _STEP))
  def loop(ctx, k_ref, idx_ref, dst_ref, bars_ref, n_steps, first_block):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    num_stages, row_tiles, col_tiles, tile_rows, tile_cols = ir.MemRefType(dst_ref.type).shape
    assert (tile_rows, tile_cols, col_tiles * tile_cols) == (8, _COLS, ir.MemRefType(k_ref.type).shape[1])
    assert num_stages == _num_stages(bars_ref)
    block_k, stage_bytes = 8 * row_tiles, row_tiles * col_tiles * 8 * _SWIZZLE
    n, first = _scalar(n_steps), _scalar(first_block)
    smem, dst_base = mgpu_utils.memref_ptr(dst_ref), _thread_tile_offset(col_tiles)

    def block(i):
      j = arith.addi(i, first)
      return arith.select(arith.cmpi(arith.CmpIPredicate.uge, j, n), arith.subi(j, n), j)

    @mgpu_utils.fori(n, _thread_keys(idx_ref, block(_c(0, i32)), block_k))
    def _(i, keys):
      slot, phase = _slot_phase(i, num_stages)
      with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.uge, i, _c(num_stages, i32))):
        # The consumers freed it in the phase before: parity (i // num_stages - 1) & 1.
        free = _bar_ptr(bars_ref, arith.addi(slot, _c(num_stages, i32)))
        nvvm.mbarrier_try_wait_parity(free, arith.xori(phase, _c(1, i32)), _c(10_000_000, i32))
      _copy_rows(k_ref, keys, smem, arith.addi(dst_base, arith.muli(slot, _c(stage_bytes, i32))), zero_fill)
      nvvm.cp_async_mbarrier_arrive(_bar_ptr(bars_ref, slot), noinc=True)
      return _thread_keys(idx_ref, block(arith.minui(arith.addi(i, _c(1, i32)), arith.subi(n, _c(1, i32)))), block_k)

    nvvm.cp_async_commit_group()  # nothing of this thread's in flight when it exits
    nvvm.cp_async_wait_group(0)

  first_block = jnp.zeros((), jnp.int32) if first_block is None else first_block
  loop(k_ref, idx_ref, dst_ref, bars_ref, n_steps, first_block)


def rotated_block(i, first_block, n_steps):
  """The row's block that step i reads when the walk starts at `first_block` (both in [0, n_steps)).

  `_gather_steps`'s producer computes the same in MLIR (`block`); the two must stay one formula."""
  j = i + first_block
  return jnp.where(j >= n_steps, j - n_steps, j)


def _forward_kernel(*refs, scale, block_k, num_stages, dv, consumer_registers, producer_registers,
                    gather_signal, gathers_in_flight, zero_fill, has_sinks, trim_steps):
  # Inputs: q [B, T, H, Dk], k [B, S, Dk], indices int32 [B, T, K_pad], sinks f32 [H] (if any),
  # steps int32 [B, T] (with trim_steps: the steps each row runs).
  # Outputs: out [B, T, H, Dv], lse f32 [B, T, H].
  q_gmem, k_gmem, idx_gmem, *rest, out_gmem, lse_gmem = refs
  sinks_gmem = rest.pop(0) if has_sinks else None
  steps_gmem = rest.pop(0) if trim_steps else None
  num_keys, dk = k_gmem.shape[1:]
  T, n_heads = q_gmem.shape[1], q_gmem.shape[2] // _HEADS
  cta = lax.axis_index("cta")  # one grid axis: CUDA's y and z stop at 65535, and T reaches 1M
  h, t, b = lax.rem(cta, n_heads), lax.rem(lax.div(cta, n_heads), T), lax.div(cta, n_heads * T)
  half = dv // 2
  dtype = q_gmem.dtype
  heads = pl.ds(h * _HEADS, _HEADS)
  mbarrier = gather_signal == "mbarrier"

  def body(q_smem, k_smem, p_smem, row_smem, lse_smem, q_bar, k_ready, k_free, p_ready, p_free):
    wg = lax.axis_index("wg")
    step_ids = lambda i: idx_gmem.at[b, t, pl.ds(i * block_k, block_k)]
    n_steps = steps_gmem[b, t] if trim_steps else idx_gmem.shape[2] // block_k
    lse_rows = lse_smem.at[pl.ds(0, _HEADS)]
    bars = lse_smem.at[pl.ds(_HEADS, 4 * num_stages)]
    if mbarrier:
      _init_gather_barriers(bars)
      wait_rows, free_slot = functools.partial(_wait_rows, bars), functools.partial(_free_slot, bars)
    else:
      wait_rows = lambda i: plgpu.barrier_wait(k_ready.at[lax.rem(i, num_stages)])
      free_slot = lambda i: plgpu.barrier_arrive(k_free.at[lax.rem(i, num_stages)])

    def pv(acc, p, slot, col):
      def mma(acc_ref):
        plgpu.wgmma(acc_ref, p, k_smem.at[slot, :, pl.ds(col, half)])
      return pl.run_state(mma)(plgpu.ACC.init(acc))

    def store_out(o, col):
      q_smem[:, pl.ds(col, half)] = o.astype(dtype)  # Q's tile is free by now
      plgpu.commit_smem()
      for r in range(_HEADS // 8):  # a TMA store reads contiguous shared memory: one 8-row tile row each
        plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(8 * r, 8), pl.ds(col, half)],
                                out_gmem.at[b, t, pl.ds(h * _HEADS + 8 * r, 8), pl.ds(col, half)])

    row = plgpu.Layout.WGMMA.reduce(1)
    zeros = lambda: plgpu.layout_cast(jnp.zeros((_HEADS, half), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _softmax_wg():
      plgpu.set_max_registers(consumer_registers, action="increase")
      plgpu.copy_gmem_to_smem(q_gmem.at[b, t, heads], q_smem, q_bar)
      plgpu.barrier_wait(q_bar)
      c = scale * _LOG2E

      def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, num_stages)
        ids = plgpu.load(step_ids(i), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        wait_rows(i)

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((_HEADS, block_k), jnp.float32))
        valid = (ids >= 0) & (ids < num_keys)
        s = jnp.where(lax.broadcast_in_dim(valid, s.shape, [1]), s * c, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))  # masked: exp2(-inf) = 0
        l = l * alpha + p.sum(axis=1)
        p16 = p.astype(dtype)
        plgpu.barrier_wait(p_free)  # consumer 1 has read the previous P and rescale
        p_smem[...] = p16
        row_smem[...] = alpha
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p16, slot, 0)
        free_slot(i)
        return acc, m_new, l

      init = (zeros(), plgpu.layout_cast(jnp.full((_HEADS,), _NEG, jnp.float32), row),
              plgpu.layout_cast(jnp.zeros((_HEADS,), jnp.float32), row))
      acc, m, l = lax.fori_loop(0, n_steps, step, init)
      factor = None
      if has_sinks:  # the sink joins the denominator (base 2: sink * log2 e) and adds no value
        sink = plgpu.load(sinks_gmem.at[heads], layout=row, optimized=False) * _LOG2E
        m_new = jnp.maximum(m, sink)
        factor = jnp.exp2(m - m_new)
        l = l * factor + jnp.exp2(sink - m_new)
        m = m_new
      nonempty = l > 0
      safe_l = jnp.where(nonempty, l, 1.0)
      inv = 1.0 / safe_l if factor is None else factor / safe_l
      inv = jnp.where(nonempty, inv, 0.0)
      plgpu.barrier_wait(p_free)
      row_smem[...] = inv  # the final factor, for consumer 1
      plgpu.barrier_arrive(p_ready)
      lse_rows[...] = jnp.where(nonempty, (m + jnp.log2(safe_l)) / _LOG2E, -jnp.inf)
      store_out(acc * lax.broadcast_in_dim(inv, acc.shape, [0]), 0)
      plgpu.copy_smem_to_gmem(lse_rows, lse_gmem.at[b, t, heads])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _value_wg():
      plgpu.set_max_registers(consumer_registers, action="increase")
      plgpu.barrier_arrive(p_free)

      def step(i, acc):
        slot = lax.rem(i, num_stages)
        wait_rows(i)
        plgpu.barrier_wait(p_ready)
        alpha = plgpu.load(row_smem, layout=row)
        acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem, slot, half)
        plgpu.barrier_arrive(p_free)
        free_slot(i)
        return acc

      acc = lax.fori_loop(0, n_steps, step, zeros())
      plgpu.barrier_wait(p_ready)
      inv = plgpu.load(row_smem, layout=row)
      store_out(acc * lax.broadcast_in_dim(inv, acc.shape, [0]), half)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _gather_wg():
      plgpu.set_max_registers(producer_registers, action="decrease")
      if mbarrier:
        _gather_steps(k_gmem.at[b], idx_gmem.at[b, t], k_smem, bars, jnp.asarray(n_steps, jnp.int32),
                      zero_fill=zero_fill)
        return

      def publish(i, pending):  # step i's rows are in: hand them to the consumers
        _wait_gathers(pending)
        plgpu.commit_smem()  # make the generic-proxy writes visible to the MMA's async proxy
        plgpu.barrier_arrive(k_ready.at[lax.rem(i, num_stages)])

      @pl.loop(0, n_steps)
      def _(i):
        slot = lax.rem(i, num_stages)

        @pl.when(i >= num_stages)
        def _():
          plgpu.barrier_wait(k_free.at[slot])

        _issue_gather(k_gmem.at[b], step_ids(i), k_smem.at[slot], zero_fill=zero_fill)
        if gathers_in_flight == 1:
          publish(i, 0)
        else:  # step i's loads stay in flight while step i - 1 is published
          pl.when(i >= 1)(lambda: publish(i - 1, 1))

      if gathers_in_flight > 1:
        pl.when(n_steps > 0)(lambda: publish(n_steps - 1, 0))

  pl.run_scoped(
      body,
      plgpu.SMEM((_HEADS, dk), dtype, transforms=_KEY_TRANSFORMS),
      plgpu.SMEM((num_stages, block_k, dk), dtype, transforms=_KEY_TRANSFORMS),
      plgpu.SMEM((_HEADS, block_k), dtype, transforms=smem_transforms(block_k, dtype)),
      plgpu.SMEM((_HEADS,), jnp.float32),
      plgpu.SMEM((_HEADS + 4 * num_stages,), jnp.float32),  # lse, then the "mbarrier" mode's barriers
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
      plgpu.Barrier(),
      plgpu.Barrier(),
      collective_axes="wg",
  )


def live_steps(indices, num_keys: int, block_k: int):
  """int32 [B, T]: 1 + the last step (of block_k indices) holding an index in [0, num_keys), 0 if none."""
  B, T, K = indices.shape
  valid = (indices >= 0) & (indices < num_keys)
  any_valid = valid.reshape(B, T, K // block_k, block_k).any(axis=-1)
  return jnp.max(jnp.where(any_valid, jnp.arange(1, K // block_k + 1, dtype=jnp.int32), 0), axis=-1)


def sparse_attention_forward_mgpu(q, k, v, indices, *, scale, sinks=None, value_dim: int | None = None,
                                  config: Config | None = None):
  """Forward pass on Hopper: (out in q.dtype [B, T, H, Dv], lse f32 [B, T, H]).

  Args:
    q: bf16|f16 [B, T, H, Dk], H a multiple of 64, Dk a multiple of 64 and at most 576 (two gathered
      stages must fit in shared memory beside Q).
    k: [B, S, 1, Dk], the one key head all query heads share.
    v: must be None: the values are `k[..., :value_dim]` (value_dim a multiple of 128, <= 512).
    indices: int [B, T, K] into S; entries outside [0, S) (-1) are skipped.
    scale: the logit scale.
    sinks: optional f32 [H]: exp(sinks[h]) joins head h's softmax denominator (and lse), with no value.

  Raises:
    NotImplementedError: explicit values, several key heads, or shapes outside the above; the
      caller then uses the Pallas-Triton kernel.
  """
  B, T, H, Dk = q.shape
  S, G = k.shape[1], k.shape[2]
  Dv = Dk if value_dim is None else value_dim
  if v is not None or G != 1:
    raise NotImplementedError("the Mosaic GPU forward takes values from the key rows and one key head")
  if H % _HEADS or Dk % _COLS or Dv % (2 * _COLS) or Dv > min(Dk, 512):
    raise NotImplementedError(f"the Mosaic GPU forward needs H % 64 == 0, Dk % 64 == 0, Dv % 128 == 0, "
                              f"Dv <= min(Dk, 512); got {H=}, {Dk=}, {Dv=}")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
    raise NotImplementedError(f"the Mosaic GPU forward takes bf16/f16 q and k, got {q.dtype}, {k.dtype}")
  config = config or Config.heuristics(Dk, jnp.dtype(q.dtype).itemsize)
  fit = _stages_that_fit(Dk, jnp.dtype(q.dtype).itemsize, config.block_k)
  if config.num_stages > fit:  # Dk > 576 leaves room for one tile: Mosaic would fail to compile, not decline
    raise NotImplementedError(f"the Mosaic GPU forward fits {fit} gathered stages of Dk={Dk} in shared memory, "
                              f"fewer than Config.num_stages={config.num_stages} (>= 2)")
  K = indices.shape[2]
  K_pad = -(-K // config.block_k) * config.block_k
  indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, K_pad - K)), constant_values=-1)
  operands = [q, k[:, :, 0], indices]
  if sinks is not None:
    operands.append(jnp.asarray(sinks, jnp.float32).reshape(H))
  if config.trim_steps:
    operands.append(live_steps(indices, S, config.block_k))
  kernel = functools.partial(
      _forward_kernel, scale=float(scale), block_k=config.block_k, num_stages=config.num_stages, dv=Dv,
      consumer_registers=config.consumer_registers, producer_registers=config.producer_registers,
      gather_signal=config.gather_signal, gathers_in_flight=config.gathers_in_flight, zero_fill=config.zero_fill,
      has_sinks=sinks is not None, trim_steps=config.trim_steps)
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((B, T, H, Dv), q.dtype), jax.ShapeDtypeStruct((B, T, H), jnp.float32)),
      grid=(B * T * (H // _HEADS),),
      grid_names=("cta",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),  # row sums stay in a warp
      kernel_name="hyscale_sparse_attention_fwd",
  )(*operands)
