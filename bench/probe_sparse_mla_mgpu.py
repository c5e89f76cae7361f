"""Probe (issue 20): the Mosaic GPU sparse-attention forward against the Pallas-Triton one, absorbed-MLA MQA shape.

    python bench/probe_sparse_mla_mgpu.py 16384 [65536 ...] [--smoke-timeout 120]

q [1, T, 64, 576], k [1, T, 1, 576] bf16 (values = the key's first 512 columns), k = 2048 selected
keys per row: random causal picks `randint % (t + 1)`, and slots j > t hold -1 (a real top-k of a
row shorter than k), plus one empty row and one out-of-range index. Both kernels run on NaN-poisoned
memory; the new one is checked against the Triton one on every row and both against the f32
gathered jnp reference on a few hundred rows (the first 80, a random 200, the last 16). Then each is
timed: median of `reps` synchronised calls after a warm-up. FLOPs 2 T H k (576 + 512). The Mosaic
GPU kernel runs with its heuristic config and with `gathers_in_flight=2` (two steps of loads in flight).

A first small call runs in a subprocess with a timeout, so a deadlocked kernel ends the probe
instead of the device session.
"""

import argparse
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from hyscale_jax.ops.sparse_attention.reference import sparse_attention_forward_reference  # noqa: E402
from pallas_kernels.sparse_attention import sparse_attention_forward_pallas  # noqa: E402
from pallas_kernels.sparse_attention.mgpu_forward import Config, sparse_attention_forward_mgpu  # noqa: E402
from sparse_attention import poison  # noqa: E402
from timing import timed  # noqa: E402

H, DK, DV, K = 64, 576, 512, 2048


def make_inputs(T: int, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (1, T, H, DK), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, T, 1, DK), jnp.bfloat16)
  t = jnp.arange(T)[:, None]
  j = jnp.arange(K)[None, :]
  idx = jax.random.randint(ks[2], (1, T, K), 0, T) % (t + 1)
  idx = jnp.where(j > t, -1, idx).astype(jnp.int32)
  idx = idx.at[0, 5].set(-1)  # an empty row: out 0, lse -inf
  idx = idx.at[0, T - 1, 7].set(T + 5)  # out of range: skipped
  return q, k, idx


def check_rows(T: int):
  rng = np.random.default_rng(1)
  rows = np.unique(np.concatenate([np.arange(min(80, T)), rng.integers(0, T, 200), np.arange(max(T - 16, 0), T)]))
  return jnp.asarray(rows)


def smoke(T: int, config: Config):
  """A small run and its max errors against the reference (in the timed-out subprocess)."""
  q, k, idx = make_inputs(T)
  scale = DK**-0.5
  out, lse = jax.jit(functools.partial(sparse_attention_forward_mgpu, scale=scale, value_dim=DV, config=config))(
      q, k, None, idx)
  out_r, lse_r = sparse_attention_forward_reference(q, k, k[..., :DV], idx, scale=scale)
  finite = np.isfinite(np.asarray(lse_r))
  print(f"smoke T={T} {config}: max|out - ref| {float(jnp.max(jnp.abs(out.astype(jnp.float32) - out_r.astype(jnp.float32)))):.3g}, "
        f"max|lse - ref| {float(np.max(np.abs(np.asarray(lse)[finite] - np.asarray(lse_r)[finite]))):.3g}, "
        f"lse -inf where ref: {bool(np.all(np.asarray(lse)[~finite] == -np.inf))}, NaN: {bool(jnp.isnan(out).any())}",
        flush=True)


def compare(T: int, configs: dict, reps: int, triton: bool = True):
  """Every config checked (against the reference on `check_rows`, and against Triton on all rows), then timed."""
  q, k, idx = make_inputs(T)
  scale = DK**-0.5
  fns = {"triton": jax.jit(functools.partial(sparse_attention_forward_pallas, scale=scale, value_dim=DV))}
  shapes = jax.eval_shape(fns["triton"], q, k, None, idx)
  if not triton:
    del fns["triton"]
  for name, config in configs.items():
    fns[f"mgpu {name}"] = jax.jit(functools.partial(sparse_attention_forward_mgpu, scale=scale, value_dim=DV,
                                                    config=config))
  rows = check_rows(T)
  out_r, lse_r = jax.jit(lambda q, i: sparse_attention_forward_reference(q, k, k[..., :DV], i, scale=scale))(
      q[:, rows], idx[:, rows])
  f32 = lambda a: np.asarray(a, np.float32)
  base = None
  for name, fn in fns.items():
    poison(*shapes)
    out, lse = fn(q, k, None, idx)
    o, l, lr = f32(out[:, rows]), f32(lse[:, rows]), f32(lse_r)
    fin = np.isfinite(lr)
    err = dict(out=float(np.max(np.abs(o - f32(out_r)))), lse=float(np.max(np.abs(l[fin] - lr[fin]))),
               empty_ok=bool(np.all(l[~fin] == -np.inf) and np.all(o[~fin] == 0)), nan=bool(np.isnan(o).any()))
    print(f"T={T} {name} vs reference on {rows.size} rows: {err}", flush=True)
    if base is None:
      base = (out, lse)
    else:
      full = dict(out=float(jnp.max(jnp.abs(out.astype(jnp.float32) - base[0].astype(jnp.float32)))),
                  lse=float(jnp.max(jnp.where(jnp.isfinite(base[1]), jnp.abs(lse - base[1]), 0.0))),
                  nan=bool(jnp.isnan(out).any() | jnp.isnan(lse).any()),
                  same_empty=bool(jnp.all(jnp.isfinite(base[1]) == jnp.isfinite(lse))))
      print(f"T={T} {name} vs {next(iter(fns))}, all rows: {full}", flush=True)
    del out, lse
  flops = 2 * T * H * K * (DK + DV)
  for name, fn in fns.items():
    seconds = timed(fn, q, k, None, idx, reps=reps)
    print(f"T={T} {name}: {seconds * 1e3:.2f} ms = {flops / seconds / 1e12:.1f} TFLOP/s", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("seqs", type=int, nargs="*", default=[16384])
  parser.add_argument("--smoke", type=int, default=0, help="internal: run the small check at this T and exit")
  parser.add_argument("--smoke-timeout", type=int, default=150)
  parser.add_argument("--block-k", type=int, default=0)
  parser.add_argument("--stages", type=int, default=0)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--no-triton", action="store_true", help="time the Mosaic GPU kernel alone")
  parser.add_argument("--no-smoke", action="store_true")
  parser.add_argument("--serial-only", action="store_true", help="leave out the gathers_in_flight=2 variant")
  args = parser.parse_args()
  config = Config.heuristics(DK, 2)
  if args.block_k:
    config = Config(block_k=args.block_k, num_stages=args.stages or config.num_stages)
  if args.smoke:
    smoke(args.smoke, config)
    return
  cmd = [sys.executable, __file__, "--smoke", "300", "--block-k", str(config.block_k), "--stages", str(config.num_stages)]
  try:
    if not args.no_smoke:
      subprocess.run(cmd, check=True, timeout=args.smoke_timeout, env=dict(os.environ))
  except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
    print(f"smoke failed: {type(e).__name__}: {e}", flush=True)
    return
  configs = {"default": config}
  if not args.serial_only:
    configs["gathers_in_flight=2"] = dataclasses.replace(config, gathers_in_flight=2)
  for T in args.seqs:
    compare(T, configs, args.reps, triton=not args.no_triton)


if __name__ == "__main__":
  main()
