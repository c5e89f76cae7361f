"""The dense warm-up's attention on one GPU: `ops.causal_attention` forward + backward per backend.

    python -m bench.causal_attention                                  # H 64, 256/256, T 16K and 64K
    python -m bench.causal_attention --heads 24 --kv-heads 2 --seq 65536   # QSA's GQA
    python -m bench.causal_attention --smoke --out /tmp/smoke.json    # tiny, on the CPU, in seconds

Shape: batch 1, bf16, `--heads` query heads over `--kv-heads` key/value heads of 256 (GLM-5.1's
non-absorbed MLA: 192 + 64 = 256 and v 256), two packed documents (segment ids 0 | 1 at T/2).
Each row: backend, T, the median seconds of one jitted forward + backward (`jax.vjp` and the
cotangent pull-back) after a warm-up, TFLOP/s, and the largest |difference| of out and dq from
`pallas` (from `reference` when pallas is absent). `--out` writes the rows as JSON. FLOPs count the causal half only: forward
`2 N (T^2 / 2) (H + Hv)`, backward 2.5x that. `xla_baseline` builds [N, T, T] f32 logits (64 GiB
at T 16K, N 64) and is skipped when they would pass `--baseline-gib`; an out-of-memory prints OOM.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_rows
from bench.timing import against_first, timed_or_report
from hyscale_jax import ops
from hyscale_jax.ops.causal_attention.reference import attend_with_saved_residuals


def _inputs(T, N, K, H, Hv, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, T, N, H), dtype)
  k = jax.random.normal(keys[1], (1, T, K, H), dtype)
  v = jax.random.normal(keys[2], (1, T, K, Hv), dtype)
  dout = jax.random.normal(keys[3], (1, T, N, Hv), dtype)
  seg = (jnp.arange(T) >= T // 2).astype(jnp.int32)[None]
  return q, k, v, dout, seg


def _step(backend, scale, blocks):
  attention = functools.partial(ops.causal_attention, backend=backend)
  if backend == "pallas" and blocks:  # the kernel with these tiles instead of Config.heuristics
    from pallas_kernels import causal_attention as kernel  # noqa: PLC0415

    config = kernel.Config(*blocks)
    forward, backward = (functools.partial(f, config=config) for f in (
        kernel.causal_attention_forward_pallas, kernel.causal_attention_backward_pallas))
    attention = lambda q, k, v, **kw: attend_with_saved_residuals(forward, backward, q, k, v, q_offset=0, **kw)

  @jax.jit
  def step(q, k, v, dout, seg):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, scale=scale, segment_ids=(seg, seg)), q, k, v)
    return (out, *vjp(dout))

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--heads", type=int, default=64)
  parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA, non-absorbed MLA)")
  parser.add_argument("--backends", nargs="+", default=["pallas", "reference", "xla_baseline"])
  parser.add_argument("--baseline-gib", type=float, default=100.0)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--blocks", type=int, nargs=3, default=None, metavar=("BLOCK_Q", "BLOCK_K", "BLOCK_BWD"),
                      help="pallas tiles instead of pallas_kernels.causal_attention.Config.heuristics")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in f32 (CPU)")
  parser.add_argument("--out", default=None, help="write the rows here as JSON")
  args = parser.parse_args(argv)
  N, K = args.heads, args.kv_heads or args.heads
  H = Hv = 256
  dtype = jnp.bfloat16
  if args.smoke:
    args.seq, N, K, H, Hv, dtype, args.reps = [40], 4, 2, 16, 16, jnp.float32, 1
  rows = []
  print(f"{jax.devices()[0].device_kind}: N {N}, K {K}, head dims {H}/{Hv}, {jnp.dtype(dtype).name}", flush=True)
  for T in args.seq:
    inputs = _inputs(T, N, K, H, Hv, dtype)
    flops = 3.5 * 2 * N * (T * T / 2) * (H + Hv)
    first = None
    for backend in args.backends:
      if backend == "xla_baseline" and N * T * T * 4 / 2**30 > args.baseline_gib:
        print(f"{backend:13s} T {T:6d}: skipped ([N, T, T] f32 logits = {N * T * T * 4 / 2**30:.0f} GiB)")
        continue
      step = _step(backend, H**-0.5, args.blocks)
      timing = timed_or_report(f"{backend:13s} T {T:6d}", step, *inputs, reps=args.reps)
      if timing is None:
        continue
      seconds, (out, dq, _, _) = timing
      diffs, note, first = against_first(first, backend, np.float32(out), np.float32(dq))
      rows.append(dict(backend=backend, T=T, N=N, K=K, ms=seconds * 1e3, tflops=flops / seconds / 1e12, **diffs))
      print(f"{backend:13s} T {T:6d}: {seconds * 1e3:9.1f} ms fwd+bwd, {flops / seconds / 1e12:6.1f} TFLOP/s{note}",
            flush=True)
  write_rows(args.out, rows)


if __name__ == "__main__":
  main()
