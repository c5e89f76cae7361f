"""Probe: sorting FlashTopK's [rows, 2048] winners by (score desc, index asc), variants timed on the GPU.

Measured 2026-12-04 on the H200 (bench/NOTES.md): XLA's unstable two-key sort 2.16 / 7.56 ms at 16K /
64K rows against 2.87 / 10.68 for the stable one-key sort; Triton's tl.sort of packed u64 keys (through
jax-triton 0.3.1, carried as a wheel) 2.31 / 8.46 ms at its best (16 warps). Run:
`python bench/probe_sort_winners.py` (jax-triton is optional).
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "bench")
from timing import timed  # noqa: E402

def make(rows, n=2048, seed=0):
  rng = np.random.default_rng(seed)
  scores = rng.integers(0, 5000, size=(rows, n)).astype(np.float32)  # many ties
  bits = scores.view(np.uint32) | np.uint32(0x80000000)  # ordered bits of non-negative f32
  key = ~bits  # ascending key = descending score
  idx = np.sort(rng.integers(0, 1 << 20, size=(rows, n)).astype(np.int32), axis=1)
  return jnp.asarray(key), jnp.asarray(idx)

@jax.jit
def stable_1key(key, idx):
  return jax.lax.sort((key, idx), num_keys=1, is_stable=True)

@jax.jit
def unstable_2keys(key, idx):
  return jax.lax.sort((key, idx), num_keys=2, is_stable=False)

@jax.jit
def iota_argsort(key, idx):  # sort (key, iota) and gather idx: the pattern XLA may send to cub
  n = key.shape[1]
  k2, perm = jax.lax.sort((key, jax.lax.broadcasted_iota(jnp.int32, key.shape, 1)), num_keys=1, is_stable=True)
  return k2, jnp.take_along_axis(idx, perm, axis=1)

variants = dict(stable_1key=stable_1key, unstable_2keys=unstable_2keys, iota_argsort=iota_argsort)

try:
  import triton, triton.language as tl
  import jax_triton as jt

  @triton.jit
  def _sort_rows(key_ptr, idx_ptr, okey_ptr, oidx_ptr, N: tl.constexpr, ROWS: tl.constexpr):
    for r in tl.static_range(ROWS):
      row = tl.program_id(0) * ROWS + r
      offs = row * N + tl.arange(0, N)
      key = tl.load(key_ptr + offs)
      idx = tl.load(idx_ptr + offs)
      packed = (key.to(tl.uint64) << 32) | idx.to(tl.uint32).to(tl.uint64)
      s = tl.sort(packed)
      tl.store(okey_ptr + offs, (s >> 32).to(tl.uint32))
      tl.store(oidx_ptr + offs, (s & 0xFFFFFFFF).to(tl.uint32).to(tl.int32))

  def triton_sort(warps, rows_per):
    @jax.jit
    def fn(key, idx):
      R, N = key.shape
      return jt.triton_call(key, idx, kernel=_sort_rows, out_shape=[jax.ShapeDtypeStruct(key.shape, key.dtype),
                                                                     jax.ShapeDtypeStruct(idx.shape, idx.dtype)],
                            grid=(R // rows_per,), num_warps=warps, N=N, ROWS=rows_per)
    return fn
  for w in (4, 8, 16):
    variants[f"triton_sort_w{w}"] = triton_sort(w, 1)
  variants["triton_sort_w8_r2"] = triton_sort(8, 2)
except Exception as e:  # noqa: BLE001
  print("jax-triton unavailable:", type(e).__name__, str(e)[:300], flush=True)

rows_out = []
for rows in (16384, 65536):
  key, idx = make(rows)
  ref_k, ref_i = stable_1key(key, idx)
  ref_k, ref_i = np.asarray(ref_k), np.asarray(ref_i)
  for name, fn in variants.items():
    try:
      k2, i2 = fn(key, idx)
      ok = bool(np.array_equal(np.asarray(k2), ref_k) and np.array_equal(np.asarray(i2), ref_i))
      ms = timed(fn, key, idx, reps=10) * 1e3
    except Exception as e:  # noqa: BLE001
      print(rows, name, "FAIL", type(e).__name__, str(e)[:300], flush=True); continue
    print(f"rows={rows} {name}: {ms:.3f} ms equal={ok}", flush=True)
    rows_out.append(dict(rows=rows, variant=name, ms=ms, equal=ok))
print("ROWS" + json.dumps(rows_out))
