"""Tile sweep of the own tile-table grouped-matmul kernel against JAX's shipped one (issue 19; one device call).

    python -m bench.grouped_matmul_sweep --out bench/results/grouped_matmul_sweep.json
    python -m bench.grouped_matmul_sweep --smoke --out /tmp/sweep.json    # CPU: interpreted kernels, tiny shape

For each shape of bench/grouped_matmul.py and the forward / dx passes: JAX's shipped `ragged_dot_mgpu`
at 128 x 128 x 64 / 4 stages / band 4 (the baseline, same process), then `pallas_kernels.grouped_matmul.tiled` at
each config of `--configs` (tile_m x tile_n x tile_k / stages / n_band); dW likewise against JAX's
`transposed_ragged_dot_mgpu`. Each output is poisoned and checked on sampled groups against f32
products before it is timed; a config that fails to compile or run is a row with its error. Prints
one JSON row per run.

`--smoke` runs the same rows off the GPU on one tiny shape (M 128, D = F = 128, 4 experts, skewed load)
and one config: the tiled kernels in Mosaic GPU's interpret mode on 2 simulated SMs, and
`lax.ragged_dot` standing in for JAX's kernels, which only compile for a Hopper GPU (the rows say so).
"""

import argparse
import dataclasses
import json
import os
import re

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import grouped_matmul as gmm  # noqa: E402
from bench.common import Results, poison  # noqa: E402
from bench.timing import timed  # noqa: E402
from hyscale_jax.ops.grouped_matmul import grouped_matmul_reference, transposed_grouped_matmul_reference  # noqa: E402
from pallas_kernels.grouped_matmul import tiled  # noqa: E402
from pallas_kernels.grouped_matmul.autotune import Config  # noqa: E402

DEFAULT_CONFIGS = ("128x128x64/3/4", "128x128x64/3/8", "128x128x64/3/16", "128x128x64/3/2")
# --smoke: (tokens, D, F, E, top-k, load) as bench/grouped_matmul.py's SHAPES, and its one config.
SMOKE_SHAPES = {"smoke": (64, 128, 128, 4, 2, "zipf")}
SMOKE_CONFIGS = ("64x64x64/2/2/c0",)
STAND_IN = "lax.ragged_dot, standing in off the GPU"


def parse(spec: str, problem=None) -> Config:
  """"block_m x block_n x block_k / stages / snake band[/c<delay_release>]" (block_n per warpgroup: the
  CTA has 2x; a `/c0` or `/c1` suffix runs the continuous pipeline with that delay_release, and
  letters after it: `s` 64-row tail tiles (forward), `p` warpgroups splitting the CTA's rows (a CTA
  of 2 * block_m x block_n: forward/dx 64-row halves at block_m 64, dW's P), `t` the rows on the
  MMA's N side (`rows_as_n`: block_m rows, a multiple of 32, x block_n = 64 columns a warpgroup),
  then `w<cols>` for `store_cols`), or
  "heur[/c<delay_release>]": `Config.heuristics` at `problem` = (kind, m, k, n, g)."""
  tiles, *rest = spec.split("/")
  if tiles != "heur":
    stages, band, *rest = rest
  pipeline = {}
  if rest:
    found = re.fullmatch(r"c([01])([spt]*)(?:w(\d+))?", rest[0]) if len(rest) == 1 else None
    if not found:
      raise ValueError(f"bad config {spec!r}")
    delay, flags, store_cols = found.groups()
    pipeline = dict(continuous=True, delay_release=int(delay), short_tiles="s" in flags,
                    split_rows="p" in flags, rows_as_n="t" in flags, store_cols=int(store_cols or 0))
  if tiles == "heur":  # only what the spec names: the heuristic keeps its own tiling flags
    given = {key: value for key, value in pipeline.items() if value or key == "delay_release"}
    return dataclasses.replace(Config.heuristics(*problem), **given)
  block_m, block_n, block_k = (int(v) for v in tiles.split("x"))
  return Config(block_m=block_m, block_n=block_n, block_k=block_k, max_concurrent_steps=int(stages),
                grid_block_n=int(band), **pipeline)


def run(fn, label, pass_name, inputs, reps):
  x, w, dout, sizes_np = inputs
  sizes = jnp.asarray(sizes_np)
  row = dict(label=label, **{"pass": pass_name})
  try:
    compiled = jax.jit(fn).lower(x, w, dout, sizes).compile()
    poison(jax.eval_shape(fn, x, w, dout, sizes))
    out = compiled(x, w, dout, sizes)
    row["rel_err"] = gmm.check(pass_name, out, x, w, dout, sizes_np)
    del out
    row["ms"] = timed(compiled, x, w, dout, sizes, reps=reps) * 1e3
  except Exception as err:  # noqa: BLE001 - a config that does not compile is a row
    row["ms"] = f"error: {type(err).__name__}: {str(err)[:300]}"
  return row


def run_variants(variants, pass_name, inputs, reps, results, flops, fields):
  """Times each (label, fn) in turn; the first that runs is the baseline of `vs_jax_kernel`."""
  base_ms = None
  for label, fn in variants:
    row = dict(run(fn, label, pass_name, inputs, reps), **fields)
    if isinstance(row["ms"], float):
      row["tflops"] = flops / row["ms"] / 1e9
      base_ms = base_ms or row["ms"]
      row["vs_jax_kernel"] = base_ms / row["ms"]
    print(json.dumps(row), flush=True)
    results.add(row)


def launch() -> dict:
  """The tiled kernels' launch arguments: compiled for every SM of the GPU, or elsewhere (the smoke)
  interpreted by Mosaic GPU on 2 simulated SMs."""
  if jax.default_backend() == "gpu":
    return {}
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415

  return dict(num_sms=2, interpret=plgpu.InterpretGPUParams())


def run_dw(name, inputs, m, d, f, e, load, args, results):
  """dW rows: JAX's transposed kernel (the baseline) and the own one at each config."""
  if jax.default_backend() == "gpu":
    variants = [("jax_transposed_ragged_dot_mgpu", lambda x, w, dout, s: gmm.jax_transposed_kernel(x, dout, s))]
  else:
    variants = [(STAND_IN, lambda x, w, dout, s: transposed_grouped_matmul_reference(x, dout, s))]
  variants = variants[args.no_jax_baseline:]
  for spec in args.dw_configs or args.configs:
    config = parse(spec, ("transposed", m, d, f, e))
    if d % config.block_m:
      continue
    variants.append((f"tiled {spec} = {config}", lambda x, w, dout, s, c=config: tiled.transposed_grouped_matmul_tiled(
        x, dout, s, config=c, **launch())))
  run_variants(variants, "dw", inputs, args.reps, results, 2.0 * m * d * f,
               dict(shape=name, M=m, K=m, P=d, Q=f, E=e, load=load))


def run_forward(name, inputs, m, d, f, e, load, transpose, args, results):
  """Forward (or, with `transpose`, dx) rows: JAX's kernel (the baseline) and the own one at each config."""
  kk, n = (f, d) if transpose else (d, f)
  lhs_of = (lambda x, dout: dout) if transpose else (lambda x, dout: x)
  if jax.default_backend() == "gpu":
    variants = [("jax_ragged_dot_mgpu", lambda x, w, dout, s: gmm.jax_kernel(lhs_of(x, dout), w, s, transpose))]
  else:
    variants = [(STAND_IN, lambda x, w, dout, s: grouped_matmul_reference(lhs_of(x, dout), w, s,
                                                                             transpose_rhs=transpose))]
  variants = variants[args.no_jax_baseline:]
  for spec in args.configs:
    config = parse(spec, ("forward_transposed_rhs" if transpose else "forward", m, kk, n, e))
    if kk % config.block_k:
      continue
    variants.append((f"tiled {spec} = {config}", lambda x, w, dout, s, c=config: tiled.grouped_matmul_tiled(
        lhs_of(x, dout), w, s, config=c, transpose_rhs=transpose, **launch())))
  run_variants(variants, "dx" if transpose else "forward", inputs, args.reps, results, 2.0 * m * d * f,
               dict(shape=name, M=m, K=kk, N=n, E=e, load=load))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="bench/results/grouped_matmul_sweep.json")
  parser.add_argument("--shapes", nargs="+", default=list(gmm.SHAPES), choices=list(gmm.SHAPES))
  parser.add_argument("--passes", nargs="+", default=["forward", "dx", "dw"], choices=["forward", "dx", "dw"])
  parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
  parser.add_argument("--dw-configs", nargs="+", default=None, help="dW's configs, if not --configs")
  parser.add_argument("--no-jax-baseline", action="store_true",
                      help="skip JAX's kernel (the first config is then the `vs_jax_kernel` baseline)")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--smoke", action="store_true", help="one tiny shape and config, interpreted on the CPU")
  args = parser.parse_args(argv)
  shapes = {name: gmm.SHAPES[name] for name in args.shapes}
  if args.smoke:
    shapes, args.configs, args.dw_configs, args.reps = SMOKE_SHAPES, list(SMOKE_CONFIGS), None, 1
  results = Results(args.out, False)
  print(f"device {jax.devices()[0].device_kind}", flush=True)
  for name, shape in shapes.items():
    tokens, d, f, e, k, load = shape
    inputs = gmm.make_inputs(*shape, jnp.bfloat16)
    m = tokens * k
    for pass_name in args.passes:
      if pass_name == "dw":
        run_dw(name, inputs, m, d, f, e, load, args, results)
      else:
        run_forward(name, inputs, m, d, f, e, load, pass_name == "dx", args, results)
    del inputs


if __name__ == "__main__":
  main()
