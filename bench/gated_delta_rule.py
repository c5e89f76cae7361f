"""Gated DeltaNet's recurrence on one GPU: `ops.gated_delta_rule` forward + backward per backend.

    python bench/gated_delta_rule.py                                # Qwen3.8-Flash-Next heads, T 16K and 64K
    python bench/gated_delta_rule.py --chunk 128 --seq 65536        # another chunk length
    python bench/gated_delta_rule.py --smoke --out /tmp/smoke.json  # tiny, on the CPU, in seconds

Shape: batch 1, bf16 q/k/v/beta and f32 g, Qwen3.8-Flash-Next's 16 q/k heads and 48 value heads of
128, two packed documents (segment ids 0 | 1 at T/2), unit-norm keys. Each row: backend, T, the
median seconds of one jitted forward + backward (`jax.vjp` and the cotangent pull-back) after a
warm-up, TFLOP/s, and the largest |difference| of out and dq from the first backend that ran.
`pallas` is skipped while no kernel is registered; `xla_baseline` (token by token, T states kept for
the backward) is skipped above `--baseline-max-t`. FLOPs: the chunked form's matmuls per value head
and chunk of C tokens (k k^T and q k^T 2 C^2 Dk each, the triangular solve C^2 (Dk + Dv), the
intra-chunk scores times u 2 C^2 Dv, three state products 2 C Dk Dv each), i.e. per token
`C (5 Dk + 3 Dv) + 6 Dk Dv` forward, the backward counted as twice the forward.
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from hyscale_jax import ops  # noqa: E402
from hyscale_jax.ops.gated_delta_rule import REGISTRY  # noqa: E402
from timing import against_first, timed_or_report, write_rows  # noqa: E402


def _inputs(T, Hk, Hv, Dk, Dv, dtype):
  keys = jax.random.split(jax.random.key(0), 7)
  q = jax.random.normal(keys[0], (1, T, Hk, Dk), dtype)
  k = jax.random.normal(keys[1], (1, T, Hk, Dk), jnp.float32)
  k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
  v = jax.random.normal(keys[2], (1, T, Hv, Dv), dtype)
  g = -jax.random.uniform(keys[3], (1, T, Hv), jnp.float32, 0.0, 0.5)
  beta = jax.random.uniform(keys[4], (1, T, Hv), jnp.float32).astype(dtype)
  dout = jax.random.normal(keys[5], (1, T, Hv, Dv), dtype)
  seg = (jnp.arange(T) >= T // 2).astype(jnp.int32)[None]
  return q, k, v, g, beta, dout, seg


def _step(backend, chunk):
  rule = functools.partial(ops.gated_delta_rule, chunk=chunk, backend=backend)

  @jax.jit
  def step(q, k, v, g, beta, dout, seg):
    out, vjp = jax.vjp(lambda q, k, v, g, beta: rule(q, k, v, g, beta, segment_ids=seg), q, k, v, g, beta)
    return (out, *vjp(dout))

  return step


def _flops(T, Hv, Dk, Dv, C):
  return 3 * T * Hv * (C * (5 * Dk + 3 * Dv) + 6 * Dk * Dv)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--chunk", type=int, default=64)
  parser.add_argument("--backends", nargs="+", default=["pallas", "reference", "xla_baseline"])
  parser.add_argument("--baseline-max-t", type=int, default=16384)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in f32 (CPU)")
  parser.add_argument("--out", default=None, help="write the rows here as JSON")
  args = parser.parse_args(argv)
  Hk, Hv, Dk, Dv, dtype = 16, 48, 128, 128, jnp.bfloat16
  if args.smoke:
    args.seq, Hk, Hv, Dk, Dv, dtype, args.reps, args.chunk = [40], 2, 4, 8, 8, jnp.float32, 1, 16
  rows, first = [], None
  print(f"{jax.devices()[0].device_kind}: Hk {Hk}, Hv {Hv}, Dk {Dk}, Dv {Dv}, chunk {args.chunk}, "
        f"{jnp.dtype(dtype).name}", flush=True)
  for T in args.seq:
    inputs = _inputs(T, Hk, Hv, Dk, Dv, dtype)
    flops, first = _flops(T, Hv, Dk, Dv, args.chunk), None
    for backend in args.backends:
      if backend not in REGISTRY.implementations or (backend == "xla_baseline" and T > args.baseline_max_t):
        print(f"{backend:13s} T {T:6d}: skipped", flush=True)
        continue
      step = _step(backend, args.chunk)
      timing = timed_or_report(f"{backend:13s} T {T:6d}", step, *inputs, reps=args.reps)
      if timing is None:
        continue
      seconds, (out, dq, *_) = timing
      diffs, note, first = against_first(first, backend, np.float32(out), np.float32(dq))
      rows.append(dict(backend=backend, T=T, ms=seconds * 1e3, tflops=flops / seconds / 1e12, **diffs))
      print(f"{backend:13s} T {T:6d}: {seconds * 1e3:9.1f} ms fwd+bwd, {flops / seconds / 1e12:6.2f} TFLOP/s{note}",
            flush=True)
  write_rows(args.out, rows)


if __name__ == "__main__":
  main()
