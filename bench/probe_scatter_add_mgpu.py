"""Probe (issue #20): how fast can a Hopper CTA add gathered f32 rows into global memory?

The Mosaic GPU sparse-attention backward spends most of its time adding dK rows (f32 [64, Dk] a step,
at the step's 64 gathered key rows) into an f32 [S, Dk] buffer: 37 of its 57.5 ms at 16K, about 200
of 285 ms at 64K, where the buffer (151 MB) no longer fits the 50 MB L2. This probe times that
scatter alone, the backward's CTA shape kept (one CTA a token, two warpgroups splitting Dk 576 into
the kernel's chunks, k/64 steps of 64 rows, causal random rows), three ways:

- `red_v2`: today's `mgpu_backward._scatter_add`, `red.global.v2.f32.add` from registers;
- `bulk`: the rows stored to shared memory, then each thread issues one
  `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32` of half a row (the reduction done
  by the TMA unit and L2, as FlashAttention-3 adds dQ), buffers reused once their reads finish;
- `tma`: the same staging, one `plgpu.copy_smem_to_gmem(..., reduction_op="add")` per row ([1, width]
  boxes), all issued by one thread;
- `none`: the loop and the row values only (what the scatter adds on top).

    python bench/probe_scatter_add_mgpu.py --seq 16384 65536 --out probe.json

Every variant's dK is checked against a jnp oracle (the values are small integers: f32 sums exact).
"""

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, memref
from jaxlib.mlir.dialects import llvm

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from pallas_kernels.sparse_attention import mgpu_backward  # noqa: E402
from pallas_kernels.sparse_attention import mgpu_forward as fwd  # noqa: E402
from timing import timed  # noqa: E402

ROWS = 64
DK = 576
# The backward's dK chunks per consumer at MLA dims (`mgpu_backward._dkv_chunks(576, 512, 128)`).
CHUNKS = mgpu_backward._dkv_chunks(DK, 512, 128)
MODES = ("none", "red_v2", "bulk", "tma")


def _bulk_add(dk_ref, stage_ref, idx_ref, col0):
  """dk_ref[idx[r], col0 + c] += stage_ref[r, c] for keys in [0, S): thread j of the warpgroup issues
  one bulk reduction of half of row j // 2, committed as one bulk group per thread."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
  def issue(ctx, dk_ref, stage_ref, idx_ref):
    del ctx
    i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
    num_keys, dk = ir.MemRefType(dk_ref.type).shape
    width = ir.MemRefType(stage_ref.type).shape[1]
    strides, _ = ir.MemRefType(stage_ref.type).get_strides_and_offset()
    half = width // 2
    tid = arith.remui(mgpu_utils.thread_idx(), fwd._c(128, i32))
    row, part = arith.divui(tid, fwd._c(2, i32)), arith.remui(tid, fwd._c(2, i32))
    key = memref.load(idx_ref, [arith.index_cast(ir.IndexType.get(), row)])
    valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, key, fwd._c(0, i32)),
                       arith.cmpi(arith.CmpIPredicate.slt, key, fwd._c(num_keys, i32)))
    col = arith.muli(part, fwd._c(half, i32))
    dst_off = arith.addi(arith.muli(arith.extsi(i64, key), fwd._c(dk, i64)),
                         arith.extsi(i64, arith.addi(col, fwd._c(col0, i32))))
    gbase = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(dk_ref))
    dst = mgpu_utils.getelementptr(gbase, [dst_off], f32)
    src_off = arith.extsi(i64, arith.addi(arith.muli(row, fwd._c(strides[0], i32)), col))
    src = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(stage_ref), [src_off], f32)
    mgpu_utils.inline_ptx(
        f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {half * 4};",
        dst, src, predicate=valid, has_side_effects=True)
    mgpu_utils.inline_ptx("cp.async.bulk.commit_group;", has_side_effects=True)

  issue(dk_ref, stage_ref, idx_ref)


def _bulk_wait_reads(pending: int):
  """Each thread waits until at most `pending` of its bulk groups still read shared memory; then the
  warpgroup meets (another thread's rows may be the ones about to be overwritten)."""

  @plgpu.inline_mgpu()
  def wait(ctx):
    del ctx
    mgpu_utils.inline_ptx(f"cp.async.bulk.wait_group.read {pending};", has_side_effects=True)
    mgpu_utils.warpgroup_barrier()

  wait()


def _warpgroup_barrier():
  @plgpu.inline_mgpu()
  def meet(ctx):
    del ctx
    mgpu_utils.warpgroup_barrier()

  meet()


def _kernel(idx_gmem, dk_gmem, *, mode):
  # idx int32 [T, K] (entries outside [0, S) skipped), dk f32 [S, DK] (a zeroed Ref taking the adds).
  t = lax.axis_index("cta")
  n_steps = idx_gmem.shape[1] // ROWS
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def values(i, width):
    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, width), 1, layout=plgpu.Layout.WGMMA)
    return (lax.rem(cols, 5) + 1 + lax.rem(i, 3)).astype(jnp.float32)

  def body(stage_smem):
    wg = lax.axis_index("wg")
    for w, my_chunks in enumerate(CHUNKS):
      @pl.when(wg == w)
      def _(w=w, my_chunks=my_chunks):
        def step(i, carry):
          ids_ref = idx_gmem.at[t, pl.ds(i * ROWS, ROWS)]
          if mode == "red_v2":
            ids = plgpu.load(ids_ref, layout=row_layout, optimized=False)
          if mode == "tma":
            keys = [idx_gmem[t, i * ROWS + r] for r in range(ROWS)]
          for j, (col, width) in enumerate(my_chunks):
            rows = values(i, width)
            stage = stage_smem.at[w, j, :, pl.ds(0, width)]
            if mode == "none":
              carry = carry + rows if width == 128 else carry
            elif mode == "red_v2":
              mgpu_backward._scatter_add(dk_gmem, rows, lax.broadcast_in_dim(ids, (ROWS, width), [0]), col)
            elif mode == "bulk":
              _bulk_wait_reads(len(my_chunks) - 1)  # this buffer's reads from the step before are done
              stage[...] = rows
              plgpu.commit_smem()
              _bulk_add(dk_gmem, stage, ids_ref, col)
            else:
              plgpu.wait_smem_to_gmem(len(my_chunks) - 1, wait_read_only=True)
              _warpgroup_barrier()  # the waiting thread is the one that issued the copies
              stage[...] = rows
              plgpu.commit_smem()
              for r, key in enumerate(keys):
                plgpu.copy_smem_to_gmem(stage.at[pl.ds(r, 1)], dk_gmem.at[pl.ds(key, 1), pl.ds(col, width)],
                                        predicate=(key >= 0) & (key < dk_gmem.shape[0]),
                                        commit_group=False, reduction_op="add")
              plgpu.commit_smem_to_gmem_group()
          return carry

        init = plgpu.layout_cast(jnp.zeros((ROWS, 128), jnp.float32), plgpu.Layout.WGMMA)
        carry = lax.fori_loop(0, n_steps, step, init if mode == "none" else jnp.float32(0))
        if mode == "none":  # keeps the values live: the sums stored over the first rows of dK
          stage_smem[w, 0] = carry
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(stage_smem.at[w, 0], dk_gmem.at[pl.ds(0, ROWS), pl.ds(w * 128, 128)])
          plgpu.wait_smem_to_gmem(0)
        if mode == "bulk":
          _bulk_wait_reads(0)
        if mode == "tma":
          plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(body, plgpu.SMEM((2, 3, ROWS, 128), jnp.float32), collective_axes="wg")


@functools.partial(jax.jit, static_argnames=("num_keys", "mode"))
def scatter(idx, *, num_keys, mode):
  """f32 [S, DK]: the probe's dK for int32 indices [T, K] (K a multiple of 64)."""
  dk = jax.new_ref(jnp.zeros((num_keys, DK), jnp.float32))
  plgpu.kernel(functools.partial(_kernel, mode=mode), out_type=(), grid=(idx.shape[0],), grid_names=("cta",),
               num_threads=2, thread_name="wg",
               compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
               kernel_name=f"probe_scatter_{mode}")(idx, dk)
  return dk[...]


@functools.partial(jax.jit, static_argnames=("num_keys",))
def oracle(idx, *, num_keys):
  """What every variant but `none` must return: per key, the count of its selections at each step % 3
  times the row value ((col within its 128-column chunk) % 5 + 1 + step % 3)."""
  steps = jnp.arange(idx.shape[1]) // ROWS
  valid = (idx >= 0) & (idx < num_keys)
  cols = jnp.arange(DK) % 128 % 5 + 1
  out = jnp.zeros((num_keys, DK), jnp.float32)
  for m in range(3):
    hits = valid & (steps % 3 == m)[None, :]
    counts = jnp.zeros((num_keys,), jnp.float32).at[jnp.where(hits, idx, 0)].add(hits.astype(jnp.float32))
    out += counts[:, None] * (cols + m).astype(jnp.float32)
  return out


def causal_indices(T, K, seed=0):
  """int32 [T, K]: row t's entries uniform over [0, t] (repeats allowed), as the backward bench draws."""
  raw = jax.random.randint(jax.random.key(seed), (T, K), 0, 2**30)
  return (raw % (jnp.arange(T)[:, None] + 1)).astype(jnp.int32)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--topk", type=int, default=2048)
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  rows = []
  for T in args.seq:
    idx = causal_indices(T, args.topk)
    want = oracle(idx, num_keys=T)
    for mode in args.modes:
      start = time.time()
      try:
        got = scatter(idx, num_keys=T, mode=mode)
        err = None if mode == "none" else float(jnp.max(jnp.abs(got - want)))
        seconds = timed(functools.partial(scatter, num_keys=T, mode=mode), idx, reps=args.reps)
      except Exception as e:  # noqa: BLE001  (a probe: report and go on)
        print(f"T={T} {mode}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
        rows.append({"T": T, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        continue
      gbytes = T * args.topk * DK * 4 / 1e9
      row = {"T": T, "mode": mode, "ms": seconds * 1e3, "added_GB": gbytes, "GB_per_s": gbytes / seconds,
             "max_abs_err": err, "wall_s": time.time() - start}
      rows.append(row)
      print(json.dumps(row), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"device": str(jax.devices()[0].device_kind), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
