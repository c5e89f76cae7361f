"""XLA's buffer assignment for train.py's step at any length, compiled on the CPU without allocating (issue 19).

    python -m bench.memory_proxy --seq 524288 1048576 --set model.attention_query_chunk=32768 \
        model.ffn_token_chunk=32768
    python -m bench.memory_proxy --run 2 --seq 1048576 --set ...   # on the GPU: the step itself
    python -m bench.memory_proxy --smoke --out /tmp/proxy.json      # the same two layers at tiny widths

Builds the `glm2` model of bench/model_step.py (GLM-5.1 at the real width, 1 dense + 1 MoE layer of
64 experts, bf16 parameters, vocab 32768, batch 1) in `--mode` (default `hyscale`) on abstract
shapes (nothing initialised), lowers the same value_and_grad + AdamW step as `lm.build_training`
with `jax.ShapeDtypeStruct` arguments, compiles it for the CPU and prints `memory_analysis()`'s
temporaries and the largest buffers of the peak when `--dump` is given.

A proxy, not the GPU's figure: the ops run their `reference` backends (the Pallas kernels do not
lower for the CPU at these sizes), which stream over query and key chunks much as the kernels do, and
the MoE's grouped matmul runs a stand-in with the kernel's memory (one [M, N] output, [G, K, N]
weight gradients) instead of `ragged_dot`, whose CPU lowering expands to [E, M, K]. What it shows
is the full-length [T, D] arrays the layer structure keeps, which both compilers must hold.
`--out` writes one row per T: the compiled sizes in bytes (bench/common.py's `compiled_memory`) beside
the preflight's estimate. `--smoke` compiles the same two layers at configs/glm5_1.py's tiny widths at
T = 256 on the CPU, in seconds.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

from bench.common import compiled_memory, write_json

GiB = 2**30


def _register_grouped_stand_in():
  """`ops.grouped_matmul`'s backend "memory_proxy": a dense matmul against group 0's weight, under the
  op's own custom_vjp (the same residuals); every output of the kernel's shape, nothing [G, M, K]."""
  import jax.numpy as jnp  # noqa: PLC0415

  from hyscale_jax.ops.grouped_matmul import api  # noqa: PLC0415
  from hyscale_jax.ops.grouped_matmul.vjp import grouped_with_vjp  # noqa: PLC0415

  def forward(lhs, rhs, group_sizes, *, transpose_rhs=False):
    w = rhs[0].T if transpose_rhs else rhs[0]
    return jnp.dot(lhs, w, preferred_element_type=jnp.float32).astype(lhs.dtype)

  def transposed(lhs, dout, group_sizes):
    one = jnp.dot(lhs.T, dout, preferred_element_type=jnp.float32).astype(lhs.dtype)
    return jnp.broadcast_to(one, (group_sizes.shape[0], *one.shape)) * (group_sizes[:, None, None] > 0)

  api.REGISTRY.implementations["memory_proxy"] = functools.partial(grouped_with_vjp, forward, transposed)


def glm2_config(seq: int, mode: str, experts: int, overrides: list[str], variant: str = "full"):
  """bench/model_step.py's `glm2` train.py config at length `seq` in step mode `mode`; `variant`
  "tiny": the same two layers (one dense, one MoE) at the tiny config's widths, experts and vocab."""
  import ast  # noqa: PLC0415

  from configs import glm5_1  # noqa: PLC0415

  config = glm5_1.get_config(variant)
  config.model.update(n_layers=2, first_k_dense=1)
  if variant == "full":
    config.model.update(vocab_size=32768, dtype="bfloat16", param_dtype="bfloat16", n_routed_experts=experts)
    config.data.update(vocab_size=32768)
  config.data.update(batch_size=1, seq_len=seq)
  config.train.update(warmup_steps=0, steps=2)
  config.step_mode = mode
  for item in overrides:
    key, value = item.split("=", 1)
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    node[last] = value
  return config


def lower_step(config):
  """The compiled sparse-stage train step of `config` (as `lm.build_training`'s) on abstract arguments."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from hyscale_jax import models  # noqa: PLC0415
  from hyscale_jax.training import layer_stacks, lm, step_modes  # noqa: PLC0415

  config = step_modes.apply(config)
  with config.unlocked():
    config.ops.grouped_matmul = "memory_proxy"
  cfg = lm._model_config(config)
  abstract = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  groups = abstract.scanned_layer_groups()
  params = jax.eval_shape(lambda p: layer_stacks.stacked(p, groups), params)
  tx = lm.make_optimizer(config, params)[0]
  opt_state = jax.eval_shape(tx.init, params)
  T = config.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((1, T), jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}

  def objective(params, rest, batch):
    model = nnx.merge(graphdef, layer_stacks.per_layer(params, groups), rest)
    h, aux = model.hidden_states(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                 dense=False, backends=config.ops, final_norm=False)
    lm_loss = model.lm_loss(h, batch["targets"], batch["loss_mask"], prenorm=True)
    return lm_loss + config.optim.indexer_loss_coeff * aux["indexer_loss"]

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, rest, batch):
    loss, grads = jax.value_and_grad(objective)(params, rest, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return cfg, step.lower(params, opt_state, rest, batch).compile()


def run_on_device(config, steps: int) -> dict:
  """`--run`: train.py's own step (`lm.build_training`) on this accelerator for `steps` steps of random
  tokens (no corpus, no evaluation: the fewest device seconds): compiled temporaries, step times,
  losses and the allocator's peak."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from hyscale_jax import parallel  # noqa: PLC0415
  from hyscale_jax import sharding as shd  # noqa: PLC0415
  from hyscale_jax.training import lm, memory, step_modes  # noqa: PLC0415

  config = step_modes.apply(config)
  cfg, mesh = lm.setup(config)
  T = config.data.seq_len
  estimate = lm.memory_preflight(config, cfg, mesh, available=None)
  row = dict(T=T, estimate_gib=estimate.total / GiB, estimate=estimate.describe())
  print(f"T={T}: preflight {estimate.describe()}", flush=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (1, T + 1), dtype=np.int32)
  batch = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:], positions=np.arange(T, dtype=np.int32)[None],
               segment_ids=np.zeros((1, T), np.int32), loss_mask=np.ones((1, T), np.float32))
  rules = shd.rules_from_config(config.mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    training = lm.build_training(config, cfg, mesh, rules)
    batch = parallel.global_batch(mesh, batch)
    t0 = time.perf_counter()
    compiled = training.train_step.lower(training.state, batch, dense=False).compile()
    ma = compiled.memory_analysis()
    row.update(compile_s=time.perf_counter() - t0, temp_gib=ma.temp_size_in_bytes / GiB,
               argument_gib=ma.argument_size_in_bytes / GiB)
    print(f"T={T}: compiled in {row['compile_s']:.0f} s, temporaries {row['temp_gib']:.1f} GiB, arguments "
          f"{row['argument_gib']:.1f} GiB", flush=True)
    state, row["losses"], row["step_s"] = training.state, [], []
    for _ in range(steps):
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch)
      row["losses"].append(float(metrics["loss"]))
      row["step_s"].append(time.perf_counter() - t0)
      row.update(memory.device_peak_metrics())
      print(f"T={T}: step {len(row['losses'])}: {row['step_s'][-1]:.1f} s, loss {row['losses'][-1]:.4f} "
            f"(lm {float(metrics['lm_loss']):.4f}, indexer {float(metrics['indexer_loss']):.4f}), peak "
            f"{row.get('device_peak_gb', float('nan')):.1f} GB", flush=True)
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq", nargs="+", type=int, default=[524288, 1048576])
  parser.add_argument("--mode", default="hyscale")
  parser.add_argument("--experts", type=int, default=64)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, as model_step.py's")
  parser.add_argument("--dump", default=None, help="an XLA dump folder (its buffer-assignment text is written)")
  parser.add_argument("--run", type=int, default=0, metavar="STEPS",
                      help="on the accelerator: compile train.py's step and run this many steps (random tokens)")
  parser.add_argument("--out", default=None, help="a JSON file for the rows")
  parser.add_argument("--smoke", action="store_true", help="the two layers at the tiny widths, T 256, in seconds")
  args = parser.parse_args(argv)
  variant = "tiny" if args.smoke else "full"
  if args.smoke:
    args.seq = [256]
  rows = []
  if args.run:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # as bench/model_step.py
    for seq in args.seq:
      try:
        rows.append(run_on_device(glm2_config(seq, args.mode, args.experts, args.set, variant), args.run))
      except Exception as e:  # noqa: BLE001 (out of memory is a result)
        rows.append(dict(T=seq, error=f"{type(e).__name__}: {str(e)[:600]}"))
        print(f"T={seq}: {rows[-1]['error']}", flush=True)
      write_json(args.out, dict(mode=args.mode, set=args.set, rows=rows))
    return rows
  if args.dump:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
                               " --xla_dump_hlo_module_re=.*step.* --xla_dump_hlo_as_text").strip()
  import jax  # noqa: PLC0415

  jax.config.update("jax_platforms", "cpu")
  if args.dump:
    jax.config.update("jax_enable_compilation_cache", False)  # a program from the persistent cache dumps nothing
  _register_grouped_stand_in()
  from hyscale_jax.training import memory  # noqa: PLC0415

  for seq in args.seq:
    config = glm2_config(seq, args.mode, args.experts, args.set, variant)
    t0 = time.perf_counter()
    cfg, compiled = lower_step(config)
    sizes = compiled_memory(compiled)
    estimate = memory.estimate_training_memory(cfg, batch_size=1, seq_len=seq, grouped_kernel=True)
    row = dict(T=seq, compile_s=time.perf_counter() - t0, estimate_bytes=estimate.total, **sizes)
    print(f"T={seq} {args.mode} {' '.join(args.set)}: temporaries {sizes['temp_size_in_bytes'] / GiB:.1f} GiB, "
          f"arguments {sizes['argument_size_in_bytes'] / GiB:.1f} GiB, outputs "
          f"{sizes['output_size_in_bytes'] / GiB:.1f} GiB (aliased {sizes['alias_size_in_bytes'] / GiB:.1f}); "
          f"preflight {estimate.total / GiB:.1f} GiB [{estimate.describe()}]; compiled in {row['compile_s']:.0f} s",
          flush=True)
    rows.append(row)
    write_json(args.out, dict(mode=args.mode, set=args.set, variant=variant, compiled_for="cpu", rows=rows))
  return rows


if __name__ == "__main__":
  main()
