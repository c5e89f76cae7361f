"""The MoE's grouped matmul at real shapes: forward, dx and dW, against `lax.ragged_dot` and torch (issue 19).

    python -m bench.grouped_matmul --out bench/results/grouped_matmul.json            # the H200 run
    python -m bench.grouped_matmul --shapes glm5_16k glm5_16k_zipf --out ...         # a subset
    python -m bench.grouped_matmul --smoke --out /tmp/gmm.json                         # CPU, reference only

Shapes (bf16, the `full` configs; M = tokens x top-k routed rows, G = experts):
- `glm5_16k`, `glm5_64k`: GLM-5.1 (D 6144, F 2048, E 256, top-8) at 16K and 64K tokens;
- `dsv4_16k`: DeepSeek-V4-Flash (D 4096, F 2048, E 256, top-6) at 16K;
- `qwen_16k`, `qwen_64k`: Qwen3.8-Flash-Next (D 2560, F 640, E 512, top-10) at 16K and 64K (at 16K
  its forward reads 2.7 GB for 2.1 TFLOP, bound by DRAM on an H100; at 64K by the MMAs);
- `glm5_16k_zipf`, `qwen_16k_zipf`: GLM-5.1 and Qwen3.8-Flash-Next at 16K with a skewed load (expert
  e gets rows ~ 1 / (e + 1)^0.8; GLM-5.1's busiest expert has ~80x the rows of its idlest, Qwen's
  ~150x). The others split the rows evenly.

Passes, one row each per backend: `forward` x[M, D] @ W[E, D, F] (the gate/up projection),
`dx` dout[M, F] @ W^T (`transpose_rhs`, the same W) and `dw` x_g^T @ dout_g -> [E, D, F]
(the transposed kernel). FLOPs are 2 M D F for each. Backends: `pallas` (this repo's op: its own
Mosaic GPU kernels, pallas_kernels/grouped_matmul/tiled.py), `jax_mgpu` (JAX's shipped
`ragged_dot_mgpu` and `transposed_ragged_dot_mgpu`, what `pallas` ran before), `ragged_dot` (`lax.ragged_dot`, and for dW
`lax.ragged_dot_general` with the rows contracted, as JAX differentiates ragged_dot), and
`torch_grouped_mm` (`torch._grouped_mm` in a subprocess, so the two allocators do not fight; only
when torch imports). Each row: median ms after a warm-up, TFLOP/s, and `vs_ragged_dot` (ragged_dot's
time / this time), or the failure ("OOM", "compile error"). On CPU (`--smoke`) the op's backend is
`reference` and there is no torch row.

Correctness before timing: the output buffer is poisoned (a NaN buffer of its size freed just before),
then every output is checked against float32 products of the same bf16 inputs on 6 sampled groups (the
first, the last, the largest, an empty one if any, and two random), so the check does not depend on
ragged_dot compiling; rows record `rel_err` and `check_ok`. Inputs are random normal, never zeros.

Budget (one H200): the autotuner measures 4-6 configs per (pass, shape) the first time (the skewed
shape reuses glm5_16k's entries; the cache key is the sizes, not the load): 12 tunings x <= 6 Mosaic
compiles, expected ~2-3 minutes, plus ragged_dot's attempts (XLA rewrites it into a dense dot over a
[G, M, D] masked copy and fails to compile or runs out of memory at these shapes) and the torch
subprocess (~30 s). Expect 4-6 minutes for all shapes; split with `--shapes` if a call runs long.
Tuned configs are cached under `$HYSCALE_CACHE_DIR` (see pallas_kernels/grouped_matmul/autotune.py).
"""

import argparse
import json
import logging
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import Results, is_oom, poison  # noqa: E402
from bench.timing import timed  # noqa: E402
from hyscale_jax import ops  # noqa: E402
from hyscale_jax.ops.grouped_matmul import (  # noqa: E402
    grouped_matmul_reference,
    transposed_grouped_matmul_reference,
)

# name -> (tokens, D, F, E, top-k, load)
SHAPES = {
    "glm5_16k": (16384, 6144, 2048, 256, 8, "uniform"),
    "glm5_16k_zipf": (16384, 6144, 2048, 256, 8, "zipf"),
    "glm5_64k": (65536, 6144, 2048, 256, 8, "uniform"),
    "dsv4_16k": (16384, 4096, 2048, 256, 6, "uniform"),
    "qwen_16k": (16384, 2560, 640, 512, 10, "uniform"),
    "qwen_16k_zipf": (16384, 2560, 640, 512, 10, "zipf"),
    "qwen_64k": (65536, 2560, 640, 512, 10, "uniform"),
}
SMOKE_SHAPES = {"smoke": (32, 64, 32, 4, 2, "uniform"), "smoke_zipf": (32, 64, 32, 4, 2, "zipf")}
PASSES = ("forward", "dx", "dw")


def group_sizes(m: int, g: int, load: str) -> np.ndarray:
  """int32[g] summing to m: even, or Zipf-like (rows ~ 1 / (e + 1)^0.8, shuffled over experts)."""
  if load == "uniform":
    weights = np.ones(g)
  else:
    weights = 1.0 / np.arange(1, g + 1) ** 0.8
    np.random.default_rng(1).shuffle(weights)
  sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
  sizes[np.argmax(sizes)] += m - sizes.sum()
  return sizes.astype(np.int32)


def make_inputs(tokens, d, f, e, k, load, dtype):
  m = tokens * k
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (m, d), dtype)
  w = jax.random.normal(keys[1], (e, d, f), dtype) * jnp.asarray(d**-0.5, dtype)
  dout = jax.random.normal(keys[2], (m, f), dtype)
  return x, w, dout, group_sizes(m, e, load)


def jax_kernel(lhs, rhs, sizes, transpose_rhs=False):
  """JAX's shipped Hopper `ragged_dot_mgpu` at 128 x 128 x 64 tiles, 4 stages, snake band 4 (what the
  `pallas` backend ran before its own kernel): the forward/dx baseline our kernel must beat."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415

  return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, block_m=128, block_n=128, block_k=64,
                                    max_concurrent_steps=4, grid_block_n=4, transpose_rhs=transpose_rhs)


def jax_transposed_kernel(a, b, sizes):
  """JAX's shipped Hopper `transposed_ragged_dot_mgpu` (dW) at 128 x 128 x 64 tiles, 4 stages, band 4."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu  # noqa: PLC0415

  return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=sizes, block_m=128, block_n=128,
                                                          block_k=64, max_concurrent_steps=4, grid_block_n=4)


def pass_fns(backend: str):
  """pass -> jitted (x, w, dout, sizes) -> output, for the op's `backend`, "ragged_dot" or "jax_mgpu"."""
  if backend == "jax_mgpu":
    return {
        "forward": lambda x, w, dout, s: jax_kernel(x, w, s),
        "dx": lambda x, w, dout, s: jax_kernel(dout, w, s, transpose_rhs=True),
        "dw": lambda x, w, dout, s: jax_transposed_kernel(x, dout, s),
    }
  if backend == "ragged_dot":  # the raw lax calls, as JAX differentiates ragged_dot (no custom_vjp)
    return {
        "forward": lambda x, w, dout, s: grouped_matmul_reference(x, w, s),
        "dx": lambda x, w, dout, s: grouped_matmul_reference(dout, w, s, transpose_rhs=True),
        "dw": lambda x, w, dout, s: transposed_grouped_matmul_reference(x, dout, s),
    }
  if backend == "pallas":
    from pallas_kernels.grouped_matmul import transposed_grouped_matmul_pallas as transposed  # noqa: PLC0415
  else:
    transposed = transposed_grouped_matmul_reference
  return {
      "forward": lambda x, w, dout, s: ops.grouped_matmul(x, w, s, backend=backend),
      "dx": lambda x, w, dout, s: ops.grouped_matmul(dout, w, s, transpose_rhs=True, backend=backend),
      "dw": lambda x, w, dout, s: transposed(x, dout, s),
  }


def sampled_groups(sizes: np.ndarray, n: int = 6) -> list[int]:
  picks = {0, len(sizes) - 1, int(np.argmax(sizes))}
  empty = np.flatnonzero(sizes == 0)
  if empty.size:
    picks.add(int(empty[0]))
  rng = np.random.default_rng(2)
  while len(picks) < min(n, len(sizes)):
    picks.add(int(rng.integers(len(sizes))))
  return sorted(picks)


def check(pass_name, out, x, w, dout, sizes):
  """Relative Frobenius error of `out` on sampled groups against f32 products of the same inputs."""
  starts = np.concatenate([[0], np.cumsum(sizes)])
  num = den = 0.0
  for g in sampled_groups(sizes):
    a, b = int(starts[g]), int(starts[g + 1])
    f32 = lambda y: y.astype(jnp.float32)
    if pass_name == "forward":
      got, want = out[a:b], f32(x[a:b]) @ f32(w[g])
    elif pass_name == "dx":
      got, want = out[a:b], f32(dout[a:b]) @ f32(w[g]).T
    else:
      got, want = out[g], f32(x[a:b]).T @ f32(dout[a:b])
    num += float(jnp.sum((f32(got) - want) ** 2))
    den += float(jnp.sum(want**2))
  if pass_name != "dw" and starts[-1] < out.shape[0]:  # rows past the groups must be exactly 0
    num += float(jnp.sum(jnp.abs(out[int(starts[-1]):].astype(jnp.float32))))
  return float(np.sqrt(num / max(den, 1e-30)))


def failure(err: Exception) -> str:
  return "OOM" if is_oom(err) else "compile error" if "compil" in str(err).lower() else f"error: {str(err)[:200]}"


def run_one(name, shape, pass_name, backend, inputs, reps, tolerance):
  tokens, d, f, e, k, load = shape
  x, w, dout, sizes_np = inputs
  sizes = jnp.asarray(sizes_np)
  m = x.shape[0]
  row = dict(shape=name, tokens=tokens, M=m, D=d, F=f, E=e, topk=k, load=load, **{"pass": pass_name},
             backend=backend, max_group=int(sizes_np.max()), min_group=int(sizes_np.min()))
  fn = jax.jit(pass_fns(backend)[pass_name])
  try:
    compiled = fn.lower(x, w, dout, sizes).compile()
    out_shape = jax.eval_shape(fn, x, w, dout, sizes)
    poison(out_shape)
    out = compiled(x, w, dout, sizes)
    row["rel_err"] = check(pass_name, out, x, w, dout, sizes)
    row["check_ok"] = bool(row["rel_err"] < tolerance)
    del out
    seconds = timed(compiled, x, w, dout, sizes, reps=reps)
  except Exception as err:  # noqa: BLE001 - a failing baseline is a result ("OOM", "compile error")
    row.update(ms=failure(err), tflops=None, check_ok=False)
    return row
  row.update(ms=seconds * 1e3, tflops=2.0 * m * d * f / seconds / 1e12)
  if backend == "pallas":
    row["config"] = pallas_config(pass_name, m, d, f, e, x.dtype)
  return row


def pallas_config(pass_name, m, d, f, e, dtype):
  """The block config the pallas backend used (cached when tuned, else the heuristic)."""
  import dataclasses  # noqa: PLC0415

  from pallas_kernels.grouped_matmul import autotune  # noqa: PLC0415
  kind, k, n = {"forward": ("forward", d, f), "dx": ("forward_transposed_rhs", f, d),
                 "dw": ("transposed", d, f)}[pass_name]
  found = autotune.cached_config(jax.devices()[0].device_kind, autotune.cache_key(kind, m, k, n, e, dtype))
  return dataclasses.asdict(found or autotune.Config.heuristics(kind, m, k, n, e))


_TORCH = r"""
import json, sys, time, torch
spec = json.loads(sys.argv[1]); rows = []
for case in spec:
  m, d, f, e = case["M"], case["D"], case["F"], case["E"]
  offs = torch.tensor(case["offsets"], dtype=torch.int32, device="cuda")
  x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
  dout = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
  # torch's Hopper grouped GEMM wants A row-major and B column-major: each pass gets its own layout,
  # made before timing (as torch's autograd keeps both weight layouts around).
  w_fd = (torch.randn(e, f, d, device="cuda") * d ** -0.5).to(torch.bfloat16)  # W^T rows
  w_df = w_fd.transpose(-2, -1).contiguous()
  x_t, dout_cm = x.t().contiguous(), dout.t().contiguous().t()
  fns = {"forward": lambda: torch._grouped_mm(x, w_fd.transpose(-2, -1), offs=offs),
         "dx": lambda: torch._grouped_mm(dout, w_df.transpose(-2, -1), offs=offs),
         "dw": lambda: torch._grouped_mm(x_t, dout_cm, offs=offs)}
  for name, fn in fns.items():
    try:
      fn(); torch.cuda.synchronize(); times = []
      for _ in range(case["reps"]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); fn(); end.record(); torch.cuda.synchronize(); times.append(start.elapsed_time(end))
      ms = sorted(times)[len(times) // 2]
      rows.append(dict(shape=case["shape"], **{"pass": name}, ms=ms, tflops=2.0 * m * d * f / ms / 1e9))
    except Exception as err:
      rows.append(dict(shape=case["shape"], **{"pass": name}, ms="error: " + str(err)[:200], tflops=None))
print("ROWS" + json.dumps(rows))
"""


def torch_rows(cases, reps):
  """torch._grouped_mm on the same shapes, one subprocess per shape; [] when torch is missing.

  torch's Hopper grouped GEMM asserts (on the device, killing the process) unless every group offset
  is a multiple of 16 bytes (8 bf16 rows), so each group is rounded up to a multiple of 8 rows for
  torch; rows say so (`torch_rows_rounded_up`).
  """
  import importlib.util  # noqa: PLC0415
  if importlib.util.find_spec("torch") is None:
    return []
  rows = []
  for name, (_, d, f, e, _, _), sizes in cases:
    aligned = -(-sizes.astype(np.int64) // 8) * 8
    spec = [dict(shape=name, M=int(aligned.sum()), D=d, F=f, E=e, reps=reps, offsets=np.cumsum(aligned).tolist())]
    try:
      proc = subprocess.run([sys.executable, "-c", _TORCH, json.dumps(spec)], capture_output=True, text=True,
                            timeout=120)
    except subprocess.TimeoutExpired:
      rows += [dict(shape=name, **{"pass": p}, ms="error: torch timed out", tflops=None) for p in PASSES]
      continue
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROWS")]
    if not lines:
      print(f"torch run failed on {name}: {proc.stderr[-600:]}", file=sys.stderr)
      rows += [dict(shape=name, **{"pass": p}, ms="error: torch failed", tflops=None) for p in PASSES]
      continue
    for row in json.loads(lines[-1][4:]):
      row["torch_rows_rounded_up"] = int(aligned.sum() - sizes.sum())
      rows.append(row)
  return rows


_BASELINE = r"""
import json, sys
from bench import grouped_matmul as gmm
name, pass_name, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
shape = gmm.SHAPES[name]
row = gmm.run_one(name, shape, pass_name, "ragged_dot", gmm.make_inputs(*shape, gmm.jnp.bfloat16), reps, 2e-2)
print("ROW" + json.dumps(row))
"""


def ragged_dot_row(name, pass_name, reps, timeout_s):
  """`lax.ragged_dot`'s row in a subprocess: XLA may spend minutes failing to compile it at scale."""
  base = dict(shape=name, **{"pass": pass_name}, backend="ragged_dot", tflops=None, check_ok=False)
  try:
    proc = subprocess.run([sys.executable, "-c", _BASELINE, name, pass_name, str(reps)], capture_output=True,
                          text=True, timeout=timeout_s, env=dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.9"))
  except subprocess.TimeoutExpired:
    return dict(base, ms=f"no result in {timeout_s} s (compile)")
  lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW")]
  if not lines:
    return dict(base, ms=f"error: {failure(RuntimeError(proc.stderr[-2000:]))}")
  return json.loads(lines[-1][3:])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="bench/results/grouped_matmul.json")
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--append", action="store_true")
  parser.add_argument("--no-tune", action="store_true", help="use the heuristic/cached configs only")
  parser.add_argument("--baseline-max-rows", type=int, default=0,
                      help="skip ragged_dot above this many routed rows (0: always try; it fails slowly at scale)")
  parser.add_argument("--backends", nargs="+", default=["pallas", "jax_mgpu", "ragged_dot", "torch"],
                      choices=["pallas", "jax_mgpu", "ragged_dot", "torch"], help="which rows to run (with --append, in parts)")
  parser.add_argument("--baseline-timeout", type=int, default=90, help="seconds for each ragged_dot row's process")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, reference backend only")
  args = parser.parse_args(argv)
  logging.basicConfig(format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
  logging.getLogger("pallas_kernels").setLevel(logging.INFO)  # each autotuned config as it is measured
  if args.smoke:
    shapes, backends, dtype, tolerance = SMOKE_SHAPES, ("reference", "ragged_dot"), jnp.float32, 1e-4
  else:
    from pallas_kernels.grouped_matmul import set_autotune  # noqa: PLC0415
    set_autotune(not args.no_tune)
    shapes = {name: SHAPES[name] for name in args.shapes}
    backends, dtype, tolerance = tuple(b for b in ("pallas", "jax_mgpu", "ragged_dot") if b in args.backends), jnp.bfloat16, 2e-2
  # torch first, before JAX claims 95% of the GPU (its pool is only freed at exit).
  loads = {name: group_sizes(shape[0] * shape[4], shape[3], shape[5]) for name, shape in shapes.items()}
  anchors = [] if args.smoke or "torch" not in args.backends else torch_rows([(n, shapes[n], loads[n]) for n in shapes], args.reps)
  results = Results(args.out, args.append)
  print(f"device {jax.devices()[0].device_kind}; shapes {list(shapes)}; backends {backends}", flush=True)
  ours = [b for b in backends if b != "ragged_dot"]
  for name, shape in shapes.items():  # our kernels first, printed as they finish
    inputs = make_inputs(*shape, dtype)
    for pass_name in PASSES:
      for backend in ours:
        if pass_name not in pass_fns(backend):
          continue
        row = run_one(name, shape, pass_name, backend, inputs, args.reps, tolerance)
        print(json.dumps(row), flush=True)
        results.add(row)
    del inputs
  # The baseline last, each (shape, pass) in its own process under a time limit.
  for name, shape in shapes.items() if "ragged_dot" in backends else ():
    for pass_name in PASSES:
      if args.baseline_max_rows and shape[0] * shape[4] > args.baseline_max_rows:
        row = dict(shape=name, **{"pass": pass_name}, backend="ragged_dot", ms="skipped", tflops=None)
      elif args.smoke:
        row = run_one(name, shape, pass_name, "ragged_dot", make_inputs(*shape, dtype), args.reps, tolerance)
      else:
        row = ragged_dot_row(name, pass_name, args.reps, args.baseline_timeout)
      print(json.dumps(row), flush=True)
      results.add(row)
  by_key = {(r["shape"], r["pass"]): r for r in results.data["rows"] if r["backend"] == "ragged_dot"}
  for row in results.data["rows"] + [dict(r, backend="torch_grouped_mm") for r in anchors]:
    if row["backend"] == "ragged_dot":
      continue
    base = by_key.get((row["shape"], row["pass"]), {}).get("ms")
    row["vs_ragged_dot"] = base / row["ms"] if isinstance(base, float) and isinstance(row["ms"], float) else base
    if row["backend"] == "torch_grouped_mm":
      print(json.dumps(row), flush=True)
      results.add(row)
  results.write()  # the ratios filled in above, on rows already written

if __name__ == "__main__":
  main()
