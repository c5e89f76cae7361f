"""Gated DeltaNet's recurrence on one GPU: `ops.gated_delta_rule` forward, and forward + backward, per backend.

    python -m bench.gated_delta_rule --out /tmp/gdr.json           # Qwen3.8-Flash-Next heads, T 16K and 64K
    python -m bench.gated_delta_rule --chunk 128 --seq 65536        # another chunk length
    python -m bench.gated_delta_rule --backends reference pallas xla_baseline --seq 4096
    python -m bench.gated_delta_rule --pallas-configs 16,4,1 64,8,1 32,4,2  # kernel tiles to compare
    python -m bench.gated_delta_rule --smoke --out /tmp/smoke.json  # tiny, on the CPU (pallas interpreted)

Shape: batch 1, bf16 q/k/v/beta and f32 g, Qwen3.8-Flash-Next's 16 q/k heads and 48 value heads of
128, two packed documents (segment ids 0 | 1 at T/2), unit-norm keys, XLA's default f32 matmul
precision (tf32 on the H200; the pallas kernels follow it, `--matmul-precision highest` for f32).
Rows: backend, T, pass ("fwd": the jitted forward; "fwd+bwd": `jax.vjp` and the pull-back of a
random cotangent), the median ms after a warm-up, TFLOP/s, and for every backend after `reference`
the largest |difference| from it of out (and of dq and dv for fwd+bwd). A backend that fails to
compile or run (a Triton error, an OOM) gives a row with `error` and no time; the others still run.
`--pallas-configs` adds pallas rows with other kernel tiles. `xla_baseline` (token by token, T states kept for the backward) is not run by default and is
skipped above `--baseline-max-t`. FLOPs: the chunked form's matmuls per value head and chunk of C
tokens (k k^T and q k^T 2 C^2 Dk each, the triangular solve C^2 (Dk + Dv), the intra-chunk scores
times u 2 C^2 Dv, three state products 2 C Dk Dv each), i.e. per token `C (5 Dk + 3 Dv) + 6 Dk Dv`
forward, the backward counted as twice the forward. One H200 call at the defaults compiles 8 programs.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import error_text, write_rows
from bench.timing import timed
from hyscale_jax import ops
from hyscale_jax.ops.gated_delta_rule import REGISTRY


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


def _steps(backend, chunk):
  """(forward, forward + backward), jitted; both return f32 numpy-able outputs for the checks."""
  rule = functools.partial(ops.gated_delta_rule, chunk=chunk, backend=backend)

  @jax.jit
  def forward(q, k, v, g, beta, dout, seg):
    del dout
    return (rule(q, k, v, g, beta, segment_ids=seg),)

  @jax.jit
  def forward_backward(q, k, v, g, beta, dout, seg):
    out, vjp = jax.vjp(lambda q, k, v, g, beta: rule(q, k, v, g, beta, segment_ids=seg), q, k, v, g, beta)
    dq, _, dv, _, _ = vjp(dout)
    return out, dq, dv

  return {"fwd": forward, "fwd+bwd": forward_backward}


def _flops(T, Hv, Dk, Dv, C):
  return T * Hv * (C * (5 * Dk + 3 * Dv) + 6 * Dk * Dv)


def _row(backend, T, name, step, inputs, flops, reps, want):
  """One row: time `step`, compare its outputs with the reference's (`want`), or record its error."""
  row = dict(backend=backend, T=T, **{"pass": name})
  try:
    seconds = timed(step, *inputs, reps=reps)
    outputs = [np.float32(x) for x in step(*inputs)]
  except Exception as e:  # noqa: BLE001 (a kernel that does not compile, or an OOM, is a row)
    row["error"] = error_text(e)
    print(f"{backend:16s} T {T:6d} {name:8s}: {row['error']}", flush=True)
    return row, None
  row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
  note = ""
  if want is not None:
    for label, got, ref in zip(("out", "dq", "dv"), outputs, want):
      row[f"max_{label}_diff"] = float(np.abs(got - ref).max())
      note += f", max|{label} - reference| {row[f'max_{label}_diff']:.3g}"
  print(f"{backend:16s} T {T:6d} {name:8s}: {seconds * 1e3:9.2f} ms, {row['tflops']:6.2f} TFLOP/s{note}", flush=True)
  return row, outputs


def _register_pallas_config(spec):
  """A bench-only backend name, "pallas[block_v,num_warps,num_stages]", running the kernels with that
  Config (the op itself always takes `Config.heuristics`)."""
  from hyscale_jax.ops.gated_delta_rule.scan_vjp import gated_delta_rule_with_scan_kernels  # noqa: PLC0415
  from pallas_kernels import gated_delta_rule as kernels  # noqa: PLC0415

  block_v, num_warps, num_stages = map(int, spec.split(","))
  config = kernels.Config(block_v=block_v, num_warps=num_warps, num_stages=num_stages)
  name = f"pallas[{spec}]"
  REGISTRY.implementations[name] = functools.partial(
      gated_delta_rule_with_scan_kernels, functools.partial(kernels.gated_delta_rule_scan_fwd, config=config),
      functools.partial(kernels.gated_delta_rule_scan_bwd, config=config),
      functools.partial(kernels.check_applies, config=config))
  return name


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--chunk", type=int, default=64)
  parser.add_argument("--backends", nargs="+", default=["reference", "pallas"])
  parser.add_argument("--baseline-max-t", type=int, default=16384)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--pallas-configs", nargs="*", default=[],
                      help="more pallas rows, each with the kernels' Config as block_v,num_warps,num_stages")
  parser.add_argument("--matmul-precision", default=None, help="jax_default_matmul_precision, e.g. highest")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in f32 (CPU)")
  parser.add_argument("--out", default=None, help="write the rows here as JSON")
  args = parser.parse_args(argv)
  if args.matmul_precision:
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
  Hk, Hv, Dk, Dv, dtype = 16, 48, 128, 128, jnp.bfloat16
  if args.smoke:
    args.seq, Hk, Hv, Dk, Dv, dtype, args.reps, args.chunk = [40], 2, 4, 16, 16, jnp.float32, 1, 16
  backends = ["reference"] + [b for b in args.backends if b != "reference"]  # the others compare with it
  backends += [_register_pallas_config(spec) for spec in args.pallas_configs]
  rows = []
  print(f"{jax.devices()[0].device_kind}: Hk {Hk}, Hv {Hv}, Dk {Dk}, Dv {Dv}, chunk {args.chunk}, "
        f"{jnp.dtype(dtype).name}, matmul precision {jax.config.jax_default_matmul_precision}", flush=True)
  for T in args.seq:
    inputs = _inputs(T, Hk, Hv, Dk, Dv, dtype)
    flops = _flops(T, Hv, Dk, Dv, args.chunk)
    want = {}
    for backend in backends:
      if backend not in REGISTRY.implementations or (backend == "xla_baseline" and T > args.baseline_max_t):
        print(f"{backend:16s} T {T:6d}: skipped", flush=True)
        continue
      for name, step in _steps(backend, args.chunk).items():
        row, outputs = _row(backend, T, name, step, inputs, flops * (1 if name == "fwd" else 3), args.reps,
                            want.get(name))
        rows.append(row)
        if backend == "reference" and outputs is not None:
          want[name] = outputs
  write_rows(args.out, rows)


if __name__ == "__main__":
  main()
