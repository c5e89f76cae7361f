"""Memory and communication plan for a config at long context on N GPUs, from the real model shapes.

  python -m bench.context_plan --config configs/glm5_1.py:full --seq 1048576 --gpus 8 32 512
  python -m bench.context_plan --smoke --out /tmp/smoke.json   # the tiny config, in seconds

Mesh per GPU count: context parallelism over `min(N, --max-context)` devices (the sequence is split
zigzag; keys are all-gathered), and the remaining factor as expert parallelism for the MoE, with
parameters and optimizer state fully sharded (FSDP) over all N devices. Per layer and device it
lists what is held and the bytes each collective moves per training step (forward + backward), for
bf16 activations and parameters and f32 AdamW state. Parameter counts come from the model built on
abstract shapes (`models.count_params`' method); nothing is allocated.
"""

import argparse
import collections
import importlib

import numpy as np
from flax import nnx

from bench.common import write_json
from hyscale_jax import models
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training.memory import estimate_training_memory

BF16, F32, I32 = 2, 4, 4


def load_config(spec: str) -> ModelConfig:
  path, _, variant = spec.partition(":")
  module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
  return ModelConfig.from_config(module.get_config(variant or "full").model)


def layer_params(cfg: ModelConfig):
  """{layer index: (dense params, routed-expert params)} and the params outside the layers."""
  abstract = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  per_layer = collections.defaultdict(lambda: [0, 0])
  outside = 0
  for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    size = int(np.prod(leaf.shape))
    if path[0] == "layers":
      routed = any(str(p).startswith("experts_") for p in path)
      per_layer[int(path[1])][1 if routed else 0] += size
    else:
      outside += size
  return dict(per_layer), outside


def plan(cfg: ModelConfig, T: int, gpus: int, max_context: int):
  context = min(gpus, max_context)
  expert = gpus // context
  per_layer, outside = layer_params(cfg)
  dense_p = np.mean([d for d, _ in per_layer.values()])
  routed_p = np.mean([r for _, r in per_layer.values() if r] or [0])
  total_p = sum(d + r for d, r in per_layer.values()) + outside
  T_local = T // context
  kv_width = cfg.kv_lora_rank + cfg.qk_rope_dim  # MLA in MQA form: one row per token
  held = {
      "hidden state x (bf16)": T_local * cfg.d_model * BF16,
      "gathered MLA KV rows, transient (bf16)": T * kv_width * BF16,
      "gathered indexer keys, transient (bf16)": T * cfg.index_head_dim * BF16,
      "saved selection (i32, selection_replay)": T_local * cfg.index_topk * I32,
      "saved attention out (bf16) + lse (f32)": T_local * cfg.n_heads * (cfg.kv_lora_rank * BF16 + F32),
      "FSDP shard of the layer's params (bf16)": (dense_p + routed_p) * BF16 / gpus,
      "AdamW m, v and f32 master for that shard": (dense_p + routed_p) * 3 * F32 / gpus,
  }
  ring = (context - 1) / context
  moved = {
      "KV all-gather fwd + reduce-scatter of dKV": 2 * ring * T * kv_width * BF16,
      "indexer-key all-gather": ring * T * cfg.index_head_dim * BF16,
      "FSDP param all-gather (fwd, bwd) + grad reduce-scatter": 3 * (gpus - 1) / gpus * (dense_p + routed_p / expert) * BF16,
      "MoE all-to-all (dispatch + combine, fwd + bwd)": (4 * (expert - 1) / expert * T_local
                                                         * cfg.experts_per_token * cfg.d_model * BF16),
  }
  return dict(gpus=gpus, mesh=dict(context=context, expert=expert, fsdp=gpus), T=T,
              params_total=total_p, per_layer_held_bytes=held, per_layer_moved_bytes=moved,
              model_held_bytes=cfg.n_layers * sum(v for k, v in held.items() if "transient" not in k),
              preflight_estimate_bytes=estimate_training_memory(
                  cfg, batch_size=1, seq_len=T, context_shards=context, param_shards=gpus,
                  param_count=total_p).total,
              step_moved_bytes=cfg.n_layers * sum(moved.values()))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/glm5_1.py:full")
  parser.add_argument("--seq", type=int, default=1 << 20)
  parser.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 512])
  parser.add_argument("--max-context", type=int, default=64)
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true", help="the tiny GLM at 4096 tokens on 8 GPUs, in seconds")
  args = parser.parse_args(argv)
  if args.smoke:
    args.config, args.seq, args.gpus, args.max_context = "configs/glm5_1.py:tiny", 4096, [8], 8
  cfg = load_config(args.config)
  rows = [plan(cfg, args.seq, n, args.max_context) for n in args.gpus]
  gb = lambda b: f"{b / 1e9:,.2f}"
  print(f"{args.config}: {cfg.n_layers} layers, {rows[0]['params_total'] / 1e9:.1f}B params, T={args.seq:,}")
  print("\n| per layer, per device (GB) | " + " | ".join(f"{r['gpus']} GPUs (ctx {r['mesh']['context']}, "
                                                        f"ep {r['mesh']['expert']})" for r in rows) + " |")
  print("|---|" + "---|" * len(rows))
  for key in rows[0]["per_layer_held_bytes"]:
    print(f"| holds: {key} | " + " | ".join(gb(r["per_layer_held_bytes"][key]) for r in rows) + " |")
  for key in rows[0]["per_layer_moved_bytes"]:
    print(f"| moves: {key} | " + " | ".join(gb(r["per_layer_moved_bytes"][key]) for r in rows) + " |")
  print("| **all layers: held (saved + params + state)** | " + " | ".join(gb(r["model_held_bytes"]) for r in rows) + " |")
  print("| train.py's preflight estimate (whole step) | " + " | ".join(gb(r["preflight_estimate_bytes"]) for r in rows) + " |")
  print("| **all layers: moved per step** | " + " | ".join(gb(r["step_moved_bytes"]) for r in rows) + " |")
  write_json(args.out, rows)


if __name__ == "__main__":
  main()
