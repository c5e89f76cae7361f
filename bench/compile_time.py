"""Trace + compile time of the train step against depth, layers scanned or unrolled (issue 19).

    python -m bench.compile_time --out bench/results/compile_time.json            # 4 vs 78 layers, scan on and off
    python -m bench.compile_time --scan on --out bench/results/compile_time.json  # the scanned path only
    python -m bench.compile_time --smoke --out /tmp/compile_time.json             # 2 vs 6 layers, CPU seconds

The model is GLM-5.1 at the `tiny` widths (configs/glm5_1.py) with the real layer pattern of the
`full` config (78 layers, first_k_dense 3, its IndexShare settings; `--index-topk-freq` overrides
them), built abstractly (`nnx.eval_shape`: nothing is allocated). The step is `value_and_grad` of
the sparse-stage objective of training/lm.py (LM loss + indexer_loss_coeff * indexer KL) under the
config's remat policy, and each row times `jax.jit(step).trace(...).lower()` and `.compile()` on
`jax.ShapeDtypeStruct` inputs. The figure of merit is each scan setting's deep/shallow ratio of
trace + compile seconds: with `scan_layers` the deep step should cost at most 3x the shallow one.
Budget on a 2-core CPU: scanned rows 5-25 s each; the unrolled 78-layer row about 2 min.

Measured there (bench/results/compile_time.json, the chunked LM loss as train.py runs it, idle
machine, 2026-12-04): scanned 5.5 s at 4 layers, 7.6 s at 78 (1.38x); unrolled 5.1 s -> 95.4 s
(18.7x). The parameters are laid out as train.py keeps them, each scanned group stacked
(training/layer_stacks.py); with every layer's parameters apart the scanned step was 5.3 -> 17.6 s
(3.30x), XLA compiling one slice per (layer, parameter) of the stacked gradient.
"""

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import log, write_json
from configs import glm5_1
from hyscale_jax import models
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training import layer_stacks


def model_config(n_layers: int, *, scan: bool, index_topk_freq: int | None = None) -> ModelConfig:
  """GLM-5.1 at the tiny widths with the full config's layer pattern, cut to `n_layers`."""
  full = glm5_1.get_config("full").model
  pattern = {name: full[name] for name in ("first_k_dense", "index_topk_freq", "index_topk_offset")}
  if index_topk_freq is not None:
    pattern["index_topk_freq"] = index_topk_freq
  pattern["first_k_dense"] = min(pattern["first_k_dense"], max(n_layers - 1, 0))
  cfg = ModelConfig.from_config(glm5_1.get_config("tiny").model)
  return dataclasses.replace(cfg, n_layers=n_layers, scan_layers=scan, **pattern)


def step_time(cfg: ModelConfig, *, batch: int, seq: int, coeff: float) -> dict:
  """Seconds to trace + lower and to compile value_and_grad of the objective, on abstract inputs."""
  model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  # As train.py keeps them: each scanned group of layers stacked (training/layer_stacks.py).
  groups = model.scanned_layer_groups()
  params = layer_stacks.stacked(params, groups)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  inputs = dict(tokens=tokens, targets=tokens, positions=tokens, segment_ids=tokens,
                loss_mask=jax.ShapeDtypeStruct((batch, seq), jnp.float32))

  def objective(params, rest, batch):  # the sparse stage's objective, with train.py's chunked LM loss
    model = nnx.merge(graphdef, layer_stacks.per_layer(params, groups), rest)
    h, aux = model.hidden_states(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    return model.lm_loss(h, batch["targets"], batch["loss_mask"]) + coeff * aux["indexer_loss"]

  step = jax.jit(jax.value_and_grad(objective))
  t0 = time.perf_counter()
  lowered = step.trace(params, rest, inputs).lower()
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return dict(trace_lower_s=t1 - t0, compile_s=t2 - t1, total_s=t2 - t0)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--depths", type=int, nargs=2, default=(4, 78), metavar=("SHALLOW", "DEEP"))
  parser.add_argument("--scan", choices=("on", "off", "both"), default="both")
  parser.add_argument("--index-topk-freq", type=int, default=None,
                      help="IndexShare period (default: the full config's)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--smoke", action="store_true", help="2 vs 6 layers")
  parser.add_argument("--out", default="bench/results/compile_time.json")
  args = parser.parse_args(argv)
  depths = (2, 6) if args.smoke else tuple(args.depths)
  scans = {"on": (True,), "off": (False,), "both": (True, False)}[args.scan]
  coeff = glm5_1.get_config("tiny").optim.indexer_loss_coeff
  rows = []
  for scan in scans:
    for n_layers in depths:
      cfg = model_config(n_layers, scan=scan, index_topk_freq=args.index_topk_freq)
      row = dict(n_layers=n_layers, scan_layers=scan, first_k_dense=cfg.first_k_dense,
                 index_topk_freq=cfg.index_topk_freq, index_topk_offset=cfg.index_topk_offset,
                 **step_time(cfg, batch=args.batch, seq=args.seq, coeff=coeff))
      log(f"scan={scan} layers={n_layers}: trace+lower {row['trace_lower_s']:.1f} s, compile {row['compile_s']:.1f} s")
      rows.append(row)
  ratios = {}
  for scan in scans:
    shallow, deep = (next(r for r in rows if r["scan_layers"] == scan and r["n_layers"] == d) for d in depths)
    ratios["scan" if scan else "unrolled"] = deep["total_s"] / shallow["total_s"]
  print(f"{'layers':>6} {'scan':>5} {'trace+lower s':>14} {'compile s':>10} {'total s':>8}")
  for r in rows:
    print(f"{r['n_layers']:>6} {str(r['scan_layers']):>5} {r['trace_lower_s']:>14.2f} {r['compile_s']:>10.2f} "
          f"{r['total_s']:>8.2f}")
  for name, ratio in ratios.items():
    print(f"{name}: {depths[1]} layers / {depths[0]} layers = {ratio:.2f}x")
  data = dict(command=" ".join(["python -m bench.compile_time", *(sys.argv[1:] if argv is None else argv)]),
              backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
              batch=args.batch, seq=args.seq, depths=list(depths), rows=rows, deep_over_shallow=ratios)
  write_json(args.out, data)
  log(f"wrote {args.out}")
  return data


if __name__ == "__main__":
  main()
