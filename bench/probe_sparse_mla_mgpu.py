"""Probe (issue 20): the Mosaic GPU sparse-attention forward against the Pallas-Triton one, absorbed-MLA MQA shape.

    python bench/probe_sparse_mla_mgpu.py 16384 [65536 ...] [--smoke-timeout 120]

q [1, T, 64, 576], k [1, T, 1, 576] bf16 (values = the key's first 512 columns), k = 2048 selected
keys per row: random causal picks `randint % (t + 1)`, and slots j > t hold -1 (a real top-k of a
row shorter than k), plus one empty row and one out-of-range index. Both kernels run on NaN-poisoned
memory; the new one is checked against the Triton one on every row and both against the f32
gathered jnp reference on a few hundred rows (the first 80, a random 200, the last 16). Then each is
timed: median of `reps` synchronised calls after a warm-up. FLOPs 2 T H k (576 + 512), all k counted
(also the `-1` slots a trimmed row skips). The Mosaic GPU kernel runs in the variants of `VARIANTS`
(`--variants` picks some): the producer's hand-over ("wait_group": it waits for its copies;
"mbarrier": `cp.async.mbarrier.arrive.noinc`), zero-filled invalid slots, trimmed all-invalid tails.

A first small call of every variant runs in a subprocess with a timeout, so a deadlocked kernel ends
that subprocess instead of the device session; only the variants it passed are compared and timed.
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
from pallas_kernels.sparse_attention.sparse_attention import Config as TritonConfig  # noqa: E402
from pallas_kernels.sparse_attention.mgpu_forward import Config, sparse_attention_forward_mgpu  # noqa: E402
from sparse_attention import poison  # noqa: E402
from timing import timed  # noqa: E402

H, DK, DV, K = 64, 576, 512, 2048
VARIANTS = {  # Config fields over the heuristic config
    "wait_group": dict(gather_signal="wait_group", zero_fill=False, trim_steps=False),  # the first version
    "mbarrier": dict(gather_signal="mbarrier", zero_fill=False, trim_steps=False),
    "mbarrier+zero_fill": dict(gather_signal="mbarrier", zero_fill=True, trim_steps=False),
    "mbarrier+zero_fill+trim": dict(gather_signal="mbarrier", zero_fill=True, trim_steps=True),
    "wait_group+zero_fill+trim": dict(gather_signal="wait_group", zero_fill=True, trim_steps=True),
}


def make_inputs(T: int, seed=0, dk=DK):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (1, T, H, dk), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, T, 1, dk), jnp.bfloat16)
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


def smoke(T: int, configs: dict):
  """A small run of each config and its max errors against the reference (in the timed-out subprocess);
  prints `SMOKE_OK <name>` for each that is finite and close."""
  q, k, idx = make_inputs(T)
  scale = DK**-0.5
  out_r, lse_r = sparse_attention_forward_reference(q, k, k[..., :DV], idx, scale=scale)
  finite = np.isfinite(np.asarray(lse_r))
  for name, config in configs.items():
    out, lse = jax.jit(functools.partial(sparse_attention_forward_mgpu, scale=scale, value_dim=DV, config=config))(
        q, k, None, idx)
    out_err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - out_r.astype(jnp.float32))))
    lse_err = float(np.max(np.abs(np.asarray(lse)[finite] - np.asarray(lse_r)[finite])))
    empty_ok, nan = bool(np.all(np.asarray(lse)[~finite] == -np.inf)), bool(jnp.isnan(out).any())
    print(f"smoke T={T} {name}: max|out - ref| {out_err:.3g}, max|lse - ref| {lse_err:.3g}, "
          f"lse -inf where ref: {empty_ok}, NaN: {nan}", flush=True)
    if out_err < 0.05 and lse_err < 0.02 and empty_ok and not nan:
      print(f"SMOKE_OK {name}", flush=True)


def compare(T: int, configs: dict, reps: int, triton: bool = True, v4: bool = False):
  """Every config checked (against the reference on `check_rows`, and against Triton on all rows), then timed.

  v4: DeepSeek-V4's shape instead (Dk = Dv = 512, the values are the keys, per-head sinks)."""
  dk, dv = (512, 512) if v4 else (DK, DV)
  q, k, idx = make_inputs(T, dk=dk)
  sinks = jax.random.normal(jax.random.key(7), (H,), jnp.float32) if v4 else None
  scale = dk**-0.5
  triton_config = dataclasses.replace(TritonConfig.heuristics(dk, dv, 2), forward="triton")  # "auto" picks Mosaic GPU
  fns = {"triton": jax.jit(functools.partial(sparse_attention_forward_pallas, scale=scale, value_dim=dv, sinks=sinks,
                                             config=triton_config))}
  shapes = jax.eval_shape(fns["triton"], q, k, None, idx)
  if not triton:
    del fns["triton"]
  for name, config in configs.items():
    fns[f"mgpu {name}"] = jax.jit(functools.partial(sparse_attention_forward_mgpu, scale=scale, value_dim=dv,
                                                    sinks=sinks, config=config))
  rows = check_rows(T)
  label = f"T={T}{' V4 (512, sinks)' if v4 else ''}"
  out_r, lse_r = jax.jit(lambda q, i: sparse_attention_forward_reference(q, k, k[..., :dv], i, scale=scale,
                                                                         sinks=sinks))(
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
    print(f"{label} {name} vs reference on {rows.size} rows: {err}", flush=True)
    if base is None:
      base = (out, lse)
    else:
      full = dict(out=float(jnp.max(jnp.abs(out.astype(jnp.float32) - base[0].astype(jnp.float32)))),
                  lse=float(jnp.max(jnp.where(jnp.isfinite(base[1]), jnp.abs(lse - base[1]), 0.0))),
                  nan=bool(jnp.isnan(out).any() | jnp.isnan(lse).any()),
                  same_empty=bool(jnp.all(jnp.isfinite(base[1]) == jnp.isfinite(lse))))
      print(f"{label} {name} vs {next(iter(fns))}, all rows: {full}", flush=True)
    del out, lse
  flops = 2 * T * H * K * (dk + dv)
  for name, fn in fns.items():
    seconds = timed(fn, q, k, None, idx, reps=reps)
    print(f"{label} {name}: {seconds * 1e3:.2f} ms = {flops / seconds / 1e12:.1f} TFLOP/s", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("seqs", type=int, nargs="*", default=[16384])
  parser.add_argument("--smoke", type=int, default=0, help="internal: run the small check at this T and exit")
  parser.add_argument("--smoke-timeout", type=int, default=150)
  parser.add_argument("--stages", type=int, default=0)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--variants", default=",".join(list(VARIANTS)[:4]), help="comma-separated names of VARIANTS")
  parser.add_argument("--no-triton", action="store_true", help="time the Mosaic GPU kernels alone")
  parser.add_argument("--no-smoke", action="store_true")
  parser.add_argument("--v4", type=int, default=0, help="then DeepSeek-V4's shape (512, sinks) at this T")
  args = parser.parse_args()
  base = Config.heuristics(DK, 2)
  if args.stages:
    base = dataclasses.replace(base, num_stages=args.stages)
  names = args.variants.split(",")
  configs = {name: dataclasses.replace(base, **VARIANTS[name]) for name in names}
  if args.smoke:
    smoke(args.smoke, configs)
    return
  if not args.no_smoke:
    cmd = [sys.executable, __file__, "--smoke", "300", "--variants", args.variants, "--stages", str(base.num_stages)]
    try:
      done = subprocess.run(cmd, timeout=args.smoke_timeout, env=dict(os.environ), capture_output=True, text=True)
      output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
      output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      output += f"\nsmoke timed out after {args.smoke_timeout} s"
    print(output[-6000:], flush=True)
    passed = {line.split(" ", 1)[1].strip() for line in output.splitlines() if line.startswith("SMOKE_OK ")}
    configs = {name: config for name, config in configs.items() if name in passed}
    print(f"smoke passed: {sorted(passed)}", flush=True)
    if not configs:
      return
  for T in args.seqs:
    compare(T, configs, args.reps, triton=not args.no_triton)
  if args.v4:  # the last variant that passed (the V4 check is about sinks, not the gather)
    last = list(configs)[-1]
    compare(args.v4, {last: configs[last]}, args.reps, triton=not args.no_triton, v4=True)


if __name__ == "__main__":
  main()
