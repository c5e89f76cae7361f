"""Sparse-attention forward on Hopper Mosaic GPU for the MQA shape of absorbed MLA (one shared key head).

One CTA per (token, 64 heads), three warpgroups:

- The producer gathers each step's `block_k` selected key rows (all Dk columns) into a swizzled
  shared-memory ring. Hopper has no TMA gather and a TMA box lands densely in shared memory, so the
  rows go by `cp.async`: thread t copies 16 bytes of row `t // 8` per 64-column tile, written at
  the 128-byte-swizzled address the warpgroup MMA reads (`_issue_gather`, written against the raw
  Mosaic GPU memrefs through `plgpu.inline_mgpu`). Invalid slots (outside [0, S)) load row 0, so
  the tile never holds stale NaNs; the scores mask them.
- Consumer 0 computes `S = Q K^T` (K = all Dk columns), the online softmax in base 2, shares P
  (bf16) and the row rescale through shared memory, and accumulates `O[:, :Dv/2] += P V`.
- Consumer 1 rescales and accumulates `O[:, Dv/2:]`; the values are the key rows' first Dv
  columns, read from the same tile. Each consumer keeps a [64, Dv/2] f32 accumulator.

Outputs match `sparse_attention.sparse_attention_forward_pallas` (`out` in q's dtype, `lse` f32
with the same convention, -inf and zeros for a row with no valid index). Version 1 declines
(NotImplementedError) sinks, explicit values, G > 1, and heads that are not a multiple of 64.

Shapes: q [B, T, H, Dk], k [B, S, 1, Dk], indices int32 [B, T, K] -> out [B, T, H, Dv], lse [B, T, H].

On the H200 at MLA dims (H 64, Dk 576, Dv 512, k 2048): 10.14-10.70 ms = 437-461 TFLOP/s at T=16K
against 27.6-28.3 ms for the Pallas-Triton forward, 39.2 ms = 477 TFLOP/s at 64K
(bench/probe_sparse_mla_mgpu.py). The gather bounds it: each step waits for its 72 KiB of rows.
Nothing here runs on CPU: it needs sm_90a (wgmma, cp.async into swizzled tiles).
"""

from __future__ import annotations

import dataclasses
import functools
import math

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

_HEADS = 64  # one warpgroup MMA's M
_SWIZZLE = 128  # bytes; a 64-column bf16 tile row
_COLS = 64  # columns per swizzled tile (bf16)
_SMEM_BYTES = 227 * 1024
_LOG2E = math.log2(math.e)
_NEG = -1e30  # a finite "minus infinity" for the running max (empty prefixes never give inf - inf)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning: `block_k` selected keys per step, `num_stages` gathered tiles, register splits, and
  `gathers_in_flight`: the producer waits for each step's loads before issuing the next (1), or
  publishes step i once step i + 1's loads are issued (2).

  block_k is 64 for now: at 32, Mosaic GPU's layout inference fails on this kernel (jax 0.11.2).
  """

  block_k: int = 64
  num_stages: int = 2
  consumer_registers: int = 232
  producer_registers: int = 40
  gathers_in_flight: int = 1  # 2 measured slower: 12.30 against 10.70 ms at T=16K (bench/probe_sparse_mla_mgpu.py)

  def __post_init__(self):
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
    stages = (_SMEM_BYTES - 8 * 1024 - _HEADS * Dk * itemsize) // (block_k * Dk * itemsize)
    return cls(block_k=block_k, num_stages=max(2, min(stages, 4)))


def _transforms(minor: int, dtype):
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


_KEY_TRANSFORMS = (plgpu.TilingTransform((8, _COLS)), plgpu.SwizzleTransform(_SWIZZLE))


def _c(value, ty):
  return arith.constant(ty, value)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_KEY_TRANSFORMS)))
def _issue_gather(ctx, k_ref, idx_ref, dst_ref):
  """cp.async rows k[idx[j]] (row 0 where idx[j] is outside [0, S)) into dst [block_k, Dk], as one commit group.

  `k_ref` [S, Dk] in global memory, `idx_ref` int32 [block_k], `dst_ref` the tiled, 128-byte-swizzled
  shared tile, physically [block_k / 8, Dk / 64, 8, 64]. Thread t of the warpgroup copies 16 bytes
  (8 columns, chunk t % 8) of rows t // 8 + 16 r of every 64-column tile: eight threads read a
  row's 128 contiguous bytes. In the 128-byte swizzle a row's chunk c sits at chunk c ^ (row % 8).
  """
  del ctx
  i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
  i8 = ir.IntegerType.get_signless(8)
  num_keys, dk = ir.MemRefType(k_ref.type).shape
  row_tiles, col_tiles, tile_rows, tile_cols = ir.MemRefType(dst_ref.type).shape
  assert (tile_rows, tile_cols, col_tiles * tile_cols) == (8, _COLS, dk), ir.MemRefType(dst_ref.type)
  itemsize = 2
  tile_bytes = tile_rows * tile_cols * itemsize
  tid = arith.remui(mgpu_utils.thread_idx(), _c(128, i32))
  row_in = arith.divui(tid, _c(8, i32))  # 0..15
  chunk = arith.remui(tid, _c(8, i32))
  sub_row = arith.remui(row_in, _c(8, i32))
  # Byte offset in the tile of (row_in, chunk), swizzled; rows 16 r further are 2 r row tiles on.
  dst_base = arith.addi(
      arith.muli(arith.divui(row_in, _c(8, i32)), _c(col_tiles * tile_bytes, i32)),
      arith.addi(arith.muli(sub_row, _c(_SWIZZLE, i32)),
                 arith.muli(arith.xori(chunk, sub_row), _c(16, i32))))
  gmem = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(k_ref))
  smem = mgpu_utils.memref_ptr(dst_ref)
  src_chunk = arith.extui(i64, arith.muli(chunk, _c(16, i32)))
  for r in range(row_tiles * 8 // 16):
    row = arith.addi(row_in, _c(16 * r, i32))
    key = memref.load(idx_ref, [arith.index_cast(ir.IndexType.get(), row)])
    valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, key, _c(0, i32)),
                       arith.cmpi(arith.CmpIPredicate.slt, key, _c(num_keys, i32)))
    key = arith.select(valid, key, _c(0, i32))
    src_row = arith.addi(arith.muli(arith.extui(i64, key), _c(dk * itemsize, i64)), src_chunk)
    dst_row = arith.addi(dst_base, _c(2 * r * col_tiles * tile_bytes, i32))
    for u in range(col_tiles):
      src = mgpu_utils.getelementptr(gmem, [arith.addi(src_row, _c(u * tile_cols * itemsize, i64))], i8)
      dst = mgpu_utils.getelementptr(smem, [arith.addi(dst_row, _c(u * tile_bytes, i32))], i8)
      nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG)
  nvvm.cp_async_commit_group()


def _wait_gathers(pending: int):
  """Waits until at most `pending` of this thread's committed gathers are still in flight."""

  @plgpu.inline_mgpu()
  def wait(ctx):
    del ctx
    nvvm.cp_async_wait_group(pending)

  wait()


def _forward_kernel(q_gmem, k_gmem, idx_gmem, out_gmem, lse_gmem, *, scale, block_k, num_stages, dv,
                    consumer_registers, producer_registers, gathers_in_flight):
  # Inputs: q [B, T, H, Dk], k [B, S, Dk], indices int32 [B, T, K_pad].
  # Outputs: out [B, T, H, Dv], lse f32 [B, T, H].
  num_keys, dk = k_gmem.shape[1:]
  T, n_heads = q_gmem.shape[1], q_gmem.shape[2] // _HEADS
  cta = lax.axis_index("cta")  # one grid axis: CUDA's y and z stop at 65535, and T reaches 1M
  h, t, b = lax.rem(cta, n_heads), lax.rem(lax.div(cta, n_heads), T), lax.div(cta, n_heads * T)
  n_steps = idx_gmem.shape[2] // block_k
  half = dv // 2
  dtype = q_gmem.dtype
  heads = pl.ds(h * _HEADS, _HEADS)

  def body(q_smem, k_smem, p_smem, row_smem, lse_smem, q_bar, k_ready, k_free, p_ready, p_free):
    wg = lax.axis_index("wg")
    step_ids = lambda i: idx_gmem.at[b, t, pl.ds(i * block_k, block_k)]

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
        plgpu.barrier_wait(k_ready.at[slot])

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
        plgpu.barrier_arrive(k_free.at[slot])
        return acc, m_new, l

      init = (zeros(), plgpu.layout_cast(jnp.full((_HEADS,), _NEG, jnp.float32), row),
              plgpu.layout_cast(jnp.zeros((_HEADS,), jnp.float32), row))
      acc, m, l = lax.fori_loop(0, n_steps, step, init)
      nonempty = l > 0
      safe_l = jnp.where(nonempty, l, 1.0)
      inv = jnp.where(nonempty, 1.0 / safe_l, 0.0)
      plgpu.barrier_wait(p_free)
      row_smem[...] = inv  # the final factor, for consumer 1
      plgpu.barrier_arrive(p_ready)
      lse_smem[...] = jnp.where(nonempty, (m + jnp.log2(safe_l)) / _LOG2E, -jnp.inf)
      store_out(acc * lax.broadcast_in_dim(inv, acc.shape, [0]), 0)
      plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[b, t, heads])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _value_wg():
      plgpu.set_max_registers(consumer_registers, action="increase")
      plgpu.barrier_arrive(p_free)

      def step(i, acc):
        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(p_ready)
        alpha = plgpu.load(row_smem, layout=row)
        acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem, slot, half)
        plgpu.barrier_arrive(p_free)
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      acc = lax.fori_loop(0, n_steps, step, zeros())
      plgpu.barrier_wait(p_ready)
      inv = plgpu.load(row_smem, layout=row)
      store_out(acc * lax.broadcast_in_dim(inv, acc.shape, [0]), half)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _gather_wg():
      plgpu.set_max_registers(producer_registers, action="decrease")

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

        _issue_gather(k_gmem.at[b], step_ids(i), k_smem.at[slot])
        if gathers_in_flight == 1:
          publish(i, 0)
        else:  # step i's loads stay in flight while step i - 1 is published
          pl.when(i >= 1)(lambda: publish(i - 1, 1))

      if gathers_in_flight > 1:
        publish(n_steps - 1, 0)

  pl.run_scoped(
      body,
      plgpu.SMEM((_HEADS, dk), dtype, transforms=_KEY_TRANSFORMS),
      plgpu.SMEM((num_stages, block_k, dk), dtype, transforms=_KEY_TRANSFORMS),
      plgpu.SMEM((_HEADS, block_k), dtype, transforms=_transforms(block_k, dtype)),
      plgpu.SMEM((_HEADS,), jnp.float32),
      plgpu.SMEM((_HEADS,), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
      plgpu.Barrier(),
      plgpu.Barrier(),
      collective_axes="wg",
  )


def sparse_attention_forward_mgpu(q, k, v, indices, *, scale, sinks=None, value_dim: int | None = None,
                                  config: Config | None = None):
  """Forward pass on Hopper: (out in q.dtype [B, T, H, Dv], lse f32 [B, T, H]).

  Args:
    q: bf16|f16 [B, T, H, Dk], H a multiple of 64, Dk a multiple of 64.
    k: [B, S, 1, Dk], the one key head all query heads share.
    v: must be None: the values are `k[..., :value_dim]` (value_dim a multiple of 128, <= 512).
    indices: int [B, T, K] into S; entries outside [0, S) (-1) are skipped.
    scale: the logit scale.

  Raises:
    NotImplementedError: sinks, explicit values, several key heads, or shapes outside the above; the
      caller then uses the Pallas-Triton kernel.
  """
  B, T, H, Dk = q.shape
  S, G = k.shape[1], k.shape[2]
  Dv = Dk if value_dim is None else value_dim
  if sinks is not None or v is not None or G != 1:
    raise NotImplementedError("the Mosaic GPU forward takes values from the key rows, one key head, no sinks")
  if H % _HEADS or Dk % _COLS or Dv % (2 * _COLS) or Dv > min(Dk, 512):
    raise NotImplementedError(f"the Mosaic GPU forward needs H % 64 == 0, Dk % 64 == 0, Dv % 128 == 0, "
                              f"Dv <= min(Dk, 512); got {H=}, {Dk=}, {Dv=}")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
    raise NotImplementedError(f"the Mosaic GPU forward takes bf16/f16 q and k, got {q.dtype}, {k.dtype}")
  config = config or Config.heuristics(Dk, jnp.dtype(q.dtype).itemsize)
  K = indices.shape[2]
  K_pad = -(-K // config.block_k) * config.block_k
  indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, K_pad - K)), constant_values=-1)
  kernel = functools.partial(
      _forward_kernel, scale=float(scale), block_k=config.block_k, num_stages=config.num_stages, dv=Dv,
      consumer_registers=config.consumer_registers, producer_registers=config.producer_registers,
      gathers_in_flight=config.gathers_in_flight)
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((B, T, H, Dv), q.dtype), jax.ShapeDtypeStruct((B, T, H), jnp.float32)),
      grid=(B * T * (H // _HEADS),),
      grid_names=("cta",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),  # row sums stay in a warp
      kernel_name="hyscale_sparse_attention_fwd_mgpu",
  )(q, k[:, :, 0], indices)
