"""Language-model training with DSA's two stages: a dense indexer warm-up, then sparse training.

Stage 1 (`train.warmup_steps`): attention is dense, only the indexer learns, from the dense KL.
Stage 2: selection + sparse attention; every parameter learns, the indexer only from the sparse KL
(its inputs are detached) and the rest only from the LM loss (the teacher is detached).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from hyscale_jax import convert, models, ops, parallel
from hyscale_jax import sharding as shd
from hyscale_jax.layers.moe import MoE, update_router_bias
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training import console, file_data, flops, layer_stacks, memory, run_config, step_modes
from hyscale_jax.training.checkpoints import CHECKPOINTS, CheckpointError, Checkpointer
from hyscale_jax.training.metrics import MetricWriter

DENSE_STAGE, SPARSE_STAGE = 0, 1


def check_workdir(workdir: str) -> None:
  """Fails before any compute when `workdir` cannot be created or written."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe_{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"workdir={workdir!r} is not writable: {e}") from e


def is_indexer_param(path) -> bool:
  return any("indexer" in str(p) for p in path)


def make_optimizer(config: ml_collections.ConfigDict, params):
  """AdamW with its own schedule for indexer parameters; the rest is frozen during the warm-up.

  The main schedule is 0 for the warm-up steps (AdamW's update, weight decay included, is scaled
  by it), then warms up and decays over the sparse stage.

  Returns:
    (the optax transformation, the main schedule, the indexer schedule).
  """
  optim, train = config.optim, config.train
  sparse_steps = max(train.steps - train.warmup_steps, 1)
  lr_warmup = min(optim.lr_warmup_steps, sparse_steps)
  main = optax.join_schedules(
      [optax.constant_schedule(0.0),
       optax.warmup_cosine_decay_schedule(0.0, optim.learning_rate, lr_warmup, max(sparse_steps, lr_warmup + 1))],
      [train.warmup_steps])
  indexer = optax.warmup_cosine_decay_schedule(
      0.0, optim.indexer_learning_rate, min(optim.lr_warmup_steps, train.steps),
      max(train.steps, optim.lr_warmup_steps + 1))
  labels = nnx.map_state(lambda path, _: "indexer" if is_indexer_param(path) else "main", params)
  return optax.chain(
      optax.clip_by_global_norm(optim.grad_clip) if optim.grad_clip else optax.identity(),
      optax.multi_transform(
          {"indexer": optax.adamw(indexer, weight_decay=optim.weight_decay),
           "main": optax.adamw(main, weight_decay=optim.weight_decay)},
          labels),
  ), main, indexer


def _model_config(config) -> ModelConfig:
  cfg = ModelConfig.from_config(config.model)
  if config.train.nonfinite not in ("skip", "stop"):
    raise ValueError(f"train.nonfinite={config.train.nonfinite!r} must be 'skip' or 'stop'.")
  for name in ("steps", "warmup_steps", "log_every", "checkpoint_every", "eval_every"):
    value = config.train.get(name, 0)
    least = 0 if name in ("warmup_steps", "checkpoint_every", "eval_every") else 1
    if not isinstance(value, int) or value < least:
      raise ValueError(f"train.{name}={value!r} must be an int >= {least}.")
  for name, least in (("seq_len", 2), ("batch_size", 1)):
    value = config.data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(f"data.{name}={value!r} must be an int >= {least}"
                       + (" (a token and its target)." if name == "seq_len" else "."))
  peak = config.train.get("peak_tflops", 0.0)
  if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak >= 0:
    raise ValueError(f"train.peak_tflops={peak!r} must be a number >= 0 (0: from the device's kind).")
  weight = config.train.get("mtp_loss_weight", 0.0)
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
    raise ValueError(f"train.mtp_loss_weight={weight!r} must be a number >= 0.")
  return cfg


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """Trains `config.model` on packed real text; resumes from `workdir` when it holds a checkpoint.

  Writes `<workdir>/config.json` (the run's config, `run_config`) before anything else lands there.

  Returns:
    The metric rows logged by this run (also appended to `<workdir>/metrics.jsonl`).
  """
  user_config = config
  config = step_modes.apply(config)  # `config.step_mode`'s backends and model fields, if set
  cfg, mesh = setup(config)  # every config error surfaces here, before any compute
  if config.train.get("memory_preflight", True):
    estimate = memory_preflight(config, cfg, mesh, available=memory.device_memory_bytes())
    logging.info("memory preflight: about %s per device", estimate.describe())
  check_workdir(workdir)
  run_config.save(user_config, workdir)
  # Counted outside the mesh: the abstract model's sharding metadata is not resolved against the rules.
  param_counts = models.count_params(cfg)
  rules = shd.rules_from_config(config.mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    return _train(config, cfg, mesh, rules, workdir, param_counts)


def setup(config: ml_collections.ConfigDict) -> tuple[ModelConfig, jax.sharding.Mesh]:
  """The validated model config and the mesh of `config`; raises ValueError before any compute."""
  cfg = _model_config(config)
  return cfg, _mesh(config, cfg)


def memory_preflight(config: ml_collections.ConfigDict, cfg: ModelConfig, mesh, *,
                     available: int | None) -> memory.MemoryEstimate:
  """`memory.preflight` for this config's batch, sequence and mesh (None available: never raises)."""
  return memory.preflight(cfg, batch_size=config.data.batch_size, seq_len=config.data.seq_len,
                          mesh_shape=dict(mesh.shape), available=available)


def _mesh(config, cfg: ModelConfig) -> jax.sharding.Mesh:
  """The mesh of `config.mesh`, checked against the batch, sequence, heads and experts it splits."""
  mesh = parallel.make_mesh(config.mesh)
  if cfg.n_heads % mesh.shape["tensor"]:
    raise ValueError(f"model.n_heads={cfg.n_heads} must divide over mesh.tensor={mesh.shape['tensor']}.")
  if cfg.n_routed_experts % mesh.shape["expert"]:
    raise ValueError(f"model.n_routed_experts={cfg.n_routed_experts} must divide over "
                     f"mesh.expert={mesh.shape['expert']}.")
  split_batch = math.prod(mesh.shape[a] for a in shd.BATCH_AXES)
  if config.data.batch_size % split_batch:
    raise ValueError(f"data.batch_size={config.data.batch_size} must divide over mesh data x fsdp x expert = "
                     f"{split_batch}.")
  if config.data.seq_len % mesh.shape["context"]:
    raise ValueError(f"data.seq_len={config.data.seq_len} must divide over mesh.context={mesh.shape['context']}.")
  return mesh


def _train(config, cfg: ModelConfig, mesh, rules, workdir: str, param_counts: tuple[int, int]) -> list[dict]:
  """The training loop, under `jax.set_mesh(mesh)` and the logical axis `rules`.

  The ops split the sequence over `context`, the MoE dispatches over `expert`, and parameters and
  optimizer state live split by their logical axes (FSDP over `fsdp`, heads/FFN over `tensor`).
  """
  train = config.train
  started = time.perf_counter()
  bar = tqdm(total=train.steps, unit="step", desc="loading data",
             disable=not (train.progress_bar and sys.stderr.isatty()))
  data = file_data.open_dataset(config.data, model_vocab_size=cfg.vocab_size, seed=train.seed)
  validation = file_data.open_dataset(config.data, model_vocab_size=cfg.vocab_size, seed=train.seed,
                                      split="validation")
  # This process reads only the rows its devices hold, and the same rows whatever the process count.
  rows = parallel.process_rows(mesh, config.data.batch_size)
  logging.info("process %d reads rows %s of each global batch of %d", jax.process_index(), rows.tolist(),
               config.data.batch_size)
  feed = lambda dataset, step: parallel.global_batch(  # noqa: E731
      mesh, dataset.batch(step, rows=rows), rows=rows, batch_size=config.data.batch_size)

  bar.set_description("building the model")
  training = build_training(config, cfg, mesh, rules)
  state, train_step, evaluate, objective = training.state, training.train_step, training.evaluate, training.objective
  checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINTS), every_steps=train.checkpoint_every)
  restored = _restore(checkpointer, state, training.layer_groups)
  start = 0
  if restored is not None:
    start, state, meta = restored
    if meta.get("data", data.fingerprint) != data.fingerprint:
      # Batch s is a function of (seed, s, the corpus): another corpus resumes on other batches.
      logging.warning("checkpoint step %d was trained on %s; this run reads %s", start, meta["data"],
                      data.fingerprint)
  console.say(_banner(config, cfg, mesh, data, workdir, start, param_counts))
  end = min(train.steps, train.stop_at_step or train.steps)
  if start >= end:
    console.say(f"nothing to train: {workdir} already holds step {start} and the run stops at step {end} "
                f"(train.steps={train.steps}" + (f", train.stop_at_step={train.stop_at_step}" if train.stop_at_step
                                                 else "") + "); raise --config.train.steps to train on.")
    bar.close()
    checkpointer.close()
    return []

  metrics_writer = MetricWriter(workdir)
  tensorboard = _tensorboard(workdir)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  # Model FLOPs per step by stage (training/flops.py) and the device's peak, for MFU.
  step_flops = {dense: flops.step_flops(cfg, batch_size=config.data.batch_size, seq_len=config.data.seq_len,
                                        dense=dense).total for dense in (True, False)}
  peak = flops.peak_tflops(jax.devices()[0].device_kind, config.train.get("peak_tflops", 0.0))
  eval_every = config.train.get("eval_every", 0)
  profile_steps = set(config.train.get("profile_steps", ()))
  step_once = _CompiledOnce(train_step)
  logged, window, step, rescue_noted = [], _Window(), start, False
  bar.update(start)
  try:
    for step in range(start, end):
      dense = step < train.warmup_steps
      if step == train.warmup_steps and step > 0:
        console.say(f"step {step + 1}: the sparse stage begins: top-k selection and sparse attention, every "
                    "parameter learns")
      if dense not in step_once.compiled:
        bar.set_description(f"compiling the {'dense warm-up' if dense else 'sparse'} step")
      batch = feed(data, step)
      if step + 1 in profile_steps:
        step_once.compile(state, batch, dense)  # the compile stays out of the trace
        jax.profiler.start_trace(os.path.join(workdir, "profile", f"step_{step + 1}"))
      state, metrics, seconds = step_once(state, batch, dense)
      if step + 1 in profile_steps:
        jax.profiler.stop_trace()
        console.say(f"step {step + 1}: traced into {os.path.join(workdir, 'profile', f'step_{step + 1}')}")
      bar.set_description(cfg.architecture)
      window.add(seconds, step_flops[dense], int(metrics.get("topk_rescued_rows", 0)))
      if window.rescued and not rescue_noted:
        rescue_noted = True
        console.say(f"step {step + 1}: FlashTopK could not prove {window.rescued} rows exact in its fast pass and "
                    "recomputed them on its slow exact path; `topk_rescued_rows` in the metrics counts them.")
      if not bool(metrics["finite"]):
        # The state is the pre-step state, so the gradients can be recomputed to name the culprit.
        grads = lambda: jax.jit(jax.grad(lambda p: objective(p, state["rest"], batch, dense)[0]))(state["params"])
        _handle_nonfinite(train.nonfinite, step, metrics, grads, int(state["skipped_steps"]), checkpointer)
      done = step + 1
      if done % train.log_every == 0 or done == end:
        metrics = {k: float(v) for k, v in metrics.items() if k != "finite"}
        metrics["skipped_steps"] = int(state["skipped_steps"])
        if "topk_rescued_rows" in metrics:  # the window's sum: a rescue between logs is counted too
          metrics["topk_rescued_rows"] = window.rescued
        timing = window.metrics(tokens_per_step, mesh.size, peak)
        if done == end or not eval_every or done % eval_every == 0:
          metrics["val_lm_loss"] = evaluate(state["params"], state["rest"], feed(validation, 0), dense)
        row = metrics_writer.write(done, dict(
            **metrics, stage=DENSE_STAGE if dense else SPARSE_STAGE, **timing,
            lr=training.main_lr(step), indexer_lr=training.indexer_lr(step), **memory.device_peak_metrics()))
        if tensorboard is not None:
          for key, value in row.items():
            if key != "step":
              tensorboard.add_scalar(key, value, done)
          tensorboard.flush()
        logged.append(row)
        bar.set_postfix(loss=f"{row['loss']:.4f}")
        window = _Window()
      checkpointer.maybe_save(done, state, {"step": done, "stage": int(not dense), "data": data.fingerprint},
                              force=done == end)
      bar.update(1)
  except KeyboardInterrupt:
    bar.close()
    latest = checkpointer.latest_step()
    console.say(f"interrupted at step {step + 1}; " + (f"the last checkpoint is step {latest}: rerun the same "
                                                       "command to resume from it." if latest else
                                                       "no checkpoint was written yet."))
    raise
  finally:
    latest = checkpointer.latest_step()
    checkpointer.close()
    if tensorboard is not None:
      tensorboard.close()
  bar.close()
  console.say(_summary(logged, start, end, time.perf_counter() - started, checkpointer.directory, latest, train))
  return logged


def _banner(config, cfg: ModelConfig, mesh, data, workdir: str, start: int, param_counts: tuple[int, int]) -> str:
  """The start banner: model, parameters (total, active per token), mesh, data, stage schedule and workdir,
  one line each."""
  total, active = param_counts
  train = config.train
  devices = mesh.devices.flat
  end = min(train.steps, train.stop_at_step or train.steps)
  stages = []
  if train.warmup_steps:
    stages.append(f"steps 1-{min(train.warmup_steps, train.steps)}: dense warm-up, the indexer alone learns")
  if train.steps > train.warmup_steps:
    stages.append(f"steps {train.warmup_steps + 1}-{train.steps}: sparse, every parameter learns")
  source = file_data.resolve_source(config.data)
  rows = [
      ("model", f"{cfg.architecture}: {cfg.n_layers} layers, d_model {cfg.d_model}, {total / 1e6:,.1f}M parameters "
                f"({active / 1e6:,.1f}M active per token), {cfg.dtype}"),
      ("mesh", f"{mesh.size} {devices[0].device_kind} device{'s' if mesh.size > 1 else ''}: "
               + " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items())),
      ("data", f"{source}: {data.fingerprint}; {config.data.batch_size} x {config.data.seq_len} = "
               f"{config.data.batch_size * config.data.seq_len:,} tokens per step"),
      ("schedule", "; ".join(stages) + (f"; stopping at step {end}" if end < train.steps else "")),
      ("kernels", _kernels(config.ops)),
      ("workdir", f"{workdir}: " + (f"resuming from the checkpoint of step {start}" if start else "a new run")),
  ]
  lines = [console.table(rows)]
  if train.warmup_steps >= train.steps:
    lines.append(f"note: train.warmup_steps={train.warmup_steps} >= train.steps={train.steps}: the whole run is the "
                 "dense warm-up, where only the indexer learns (the other parameters' learning rate is 0, so the "
                 "LM loss stays flat). Lower --config.train.warmup_steps to reach the sparse stage.")
  return "\n".join(lines)


def _kernels(backends) -> str:
  """What each op runs on this device (`ops.describe`), in one line."""
  described = ops.describe(backends=backends)
  if len(set(described.values())) == 1:
    return f"every op: {next(iter(described.values()))}"
  return "; ".join(f"{name}: {what}" for name, what in described.items())


def _summary(logged: list[dict], start: int, end: int, seconds: float, directory: str, latest: int | None,
             train) -> str:
  """The closing lines: steps run and time, the last losses, where the checkpoints are."""
  line = f"done: steps {start + 1}-{end} in {console.duration(seconds)}"
  if logged:
    last = logged[-1]
    line += f"; loss {last['loss']:.4f} (lm {last['lm_loss']:.4f})"
    if "val_lm_loss" in last:
      line += f", validation {last['val_lm_loss']:.4f}"
  line += (f"\ncheckpoints: {directory} (latest step {latest})" if latest is not None
           else "\nno checkpoint written (train.checkpoint_every=0)")
  if end < train.steps:
    line += f"\nstopped at step {end} (train.stop_at_step); rerun the same command to continue."
  return line


class _CompiledOnce:
  """Runs the jitted `train_step`, compiled ahead of time once per stage, and times each step.

  A compiled executable is called as it is: no jit cache lookup, so nothing can retrace it mid-run (a
  module imported lazily on the first trace can register a JAX config option, which changes every jit
  cache key and recompiles the whole step on the next call). The compile is logged and kept out of
  the step's time.
  """

  def __init__(self, step_fn: Callable):
    self.step_fn = step_fn
    self.compiled: dict[bool, Callable] = {}

  def compile(self, state, batch, dense: bool) -> None:
    """Compiles the stage's step, once."""
    if dense not in self.compiled:
      start = time.perf_counter()
      self.compiled[dense] = self.step_fn.lower(state, batch, dense).compile()
      logging.info("compiled the %s step in %.1f s", "dense warm-up" if dense else "sparse",
                   time.perf_counter() - start)

  def __call__(self, state, batch, dense: bool):
    """(state, metrics, seconds from dispatch to the metrics on the host, compile excluded)."""
    self.compile(state, batch, dense)
    start = time.perf_counter()
    state, metrics = self.compiled[dense](state, batch)
    # Every output of one executable is ready at once: waiting for the metrics waits for the step.
    metrics = jax.block_until_ready(metrics)
    return state, metrics, time.perf_counter() - start


class _Window:
  """The steps since the last log: their wall time, device-synced step times, model FLOPs and the rows
  FlashTopK rescued."""

  def __init__(self):
    self.start = time.perf_counter()
    self.step_seconds: list[float] = []
    self.flops = 0.0
    self.rescued = 0

  def add(self, seconds: float, step_flops: float, rescued_rows: int) -> None:
    self.step_seconds.append(seconds)
    self.flops += step_flops
    self.rescued += rescued_rows

  def metrics(self, tokens_per_step: int, n_devices: int, peak_tflops: float | None) -> dict:
    """tokens_per_sec (wall clock, everything included), step_time_s (mean) and step_time_max_s (device-
    synced, no evaluation or checkpoint), model_tflops_per_device and mfu (against `peak_tflops`, if known)."""
    steps, busy = len(self.step_seconds), sum(self.step_seconds)
    tflops = self.flops / busy / n_devices / 1e12
    row = dict(tokens_per_sec=steps * tokens_per_step / (time.perf_counter() - self.start),
               step_time_s=busy / steps, step_time_max_s=max(self.step_seconds), model_tflops_per_device=tflops)
    if peak_tflops:
      row["mfu"] = tflops / peak_tflops
    return row


class Training(NamedTuple):
  """What `build_training` returns: the sharded state and the jitted functions train.py runs."""

  state: dict  # params, rest (non-parameter variables), opt_state, skipped_steps
  state_shardings: dict
  train_step: Callable  # (state, batch, dense) -> (state, metrics); jitted, donates state
  evaluate: Callable  # (params, rest, batch, dense) -> lm loss; jitted
  objective: Callable  # (params, rest, batch, dense) -> (total, (lm, aux)); not jitted
  main_lr: Callable
  indexer_lr: Callable
  # `Decoder.scanned_layer_groups()`: the layers stored stacked in state (layer_stacks.py).
  layer_groups: list


def restore_model(config: ml_collections.ConfigDict, workdir: str, *,
                  step: int | None = None) -> tuple[nnx.Module, int]:
  """The model of train.py's checkpoint of `step` under `workdir` (None: the newest that reads), one
  module per layer as `models.build` makes it (for evaluation, generation, export), and its step.

  Raises:
    FileNotFoundError: `workdir` holds no checkpoint, or none of `step`.
    CheckpointError: checkpoints exist but none reads with `config`'s model.
  """
  config = step_modes.apply(config)
  cfg, mesh = setup(config)
  rules = shd.rules_from_config(config.mesh)
  graphdef, abstract, groups = abstract_state(config, cfg, mesh, rules)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINTS), every_steps=0)
    try:
      if step is None:
        restored = _restore(checkpointer, abstract, groups)
      else:
        restored = checkpointer.restore_step(abstract, step)
    finally:
      checkpointer.close()
  if restored is None:
    raise FileNotFoundError(f"workdir={workdir!r} holds no checkpoint (looked in {checkpointer.directory}).")
  step, state, _ = restored
  return nnx.merge(graphdef, layer_stacks.per_layer(state["params"], groups), state["rest"]), step


def abstract_state(config: ml_collections.ConfigDict, cfg: ModelConfig, mesh, rules):
  """(graphdef, the train state of `build_training` as ShapeDtypeStructs with its shardings, the scanned
  layer groups): what a checkpoint restores into, with nothing initialised or computed."""
  # Built outside the mesh: the abstract model's sharding metadata is resolved below, by the rules.
  model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  groups = model.scanned_layer_groups()
  params = layer_stacks.stacked(params, groups)
  tx, _, _ = make_optimizer(config, params)
  state = {"params": params, "rest": rest, "opt_state": jax.eval_shape(tx.init, params),
           "skipped_steps": jax.ShapeDtypeStruct((), jnp.int32)}
  shardings = shd.state_shardings(state, mesh, rules)
  abstract = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state,
                          shardings)
  return graphdef, abstract, groups


def _restore(checkpointer: Checkpointer, state: dict, groups) -> tuple[int, dict, dict] | None:
  """The newest checkpoint into `state`'s layout; one written with every layer apart (before the
  scanned groups were stored stacked) is read in that layout and stacked."""
  try:
    return checkpointer.restore_latest(state)
  except CheckpointError as error:
    if not groups:
      raise
    try:
      restored = checkpointer.restore_latest(layer_stacks.per_layer(jax.eval_shape(lambda: state), groups))
    except CheckpointError:
      raise error from None
    step, per_layer, meta = restored
    logging.warning("checkpoint step %d has every layer apart; stacking the scanned layers", step)
    # Only the parameters and their AdamW moments are stored stacked; `rest` stays per layer.
    restacked = dict(per_layer, **{key: layer_stacks.stacked(per_layer[key], groups) for key in ("params", "opt_state")})
    return step, jax.device_put(restacked, jax.tree.map(lambda x: x.sharding, state)), meta


def build_training(config: ml_collections.ConfigDict, cfg: ModelConfig, mesh, rules) -> Training:
  """The model (or `config.init_from`), AdamW, the sharded state and the train step of train.py.

  Call under `jax.set_mesh(mesh)` and `nnx.logical_axis_rules(rules)`. Benchmarks use it to run
  and measure exactly the step that `train_and_evaluate` runs.
  """
  if config.get("init_from"):  # streamed straight into the replicated sharding; no random init
    model = convert.load_pretrained(config.init_from, cfg, sharding=NamedSharding(mesh, P()))
  else:
    model = models.build(cfg, rngs=nnx.Rngs(config.train.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  # Each scanned group of layers is stored stacked, and so are its AdamW moments (layer_stacks.py).
  groups = model.scanned_layer_groups()
  params = layer_stacks.stacked(params, groups)
  tx, main_lr, indexer_lr = make_optimizer(config, params)
  state = {"params": params, "rest": rest, "opt_state": tx.init(params), "skipped_steps": jnp.int32(0)}
  # Parameters and the AdamW moments (which carry the parameters' logical axes) are split by the
  # rules; the rest is replicated. A checkpoint restores into these shardings whatever mesh wrote it.
  state_shardings = shd.state_shardings(state, mesh, rules)
  state = jax.device_put(state, state_shardings)

  mtp_weight = config.train.get("mtp_loss_weight", 0.0)

  def forward(params, rest, batch, dense, with_mtp=True):
    model = nnx.merge(graphdef, layer_stacks.per_layer(params, groups), rest)
    mtp_tokens = batch["targets"] if with_mtp and cfg.mtp_depth else None
    h, aux = model.hidden_states(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                 dense=dense, backends=config.ops, mtp_tokens=mtp_tokens, final_norm=False)
    if mtp_tokens is not None:  # the MTP depths' losses, chunked the same way
      aux["mtp_loss"] = model.mtp_loss(aux.pop("mtp_hidden"), batch["targets"], batch["loss_mask"])
    # Chunked over the sequence (model.lm_loss_chunk): no [B, T, V] logits, forward or backward.
    # The final norm inside the loss's chunks: no normalised [B, T, D] copy nor its gradient.
    return model.lm_loss(h, batch["targets"], batch["loss_mask"], prenorm=True), aux

  def objective(params, rest, batch, dense):
    lm, aux = forward(params, rest, batch, dense)
    # Warm-up: only the indexer trains, and only from the KL (the MTP blocks' indexers too). Sparse:
    # LM + mtp_loss_weight * MTP + coeff * KL; the KL reaches disjoint parameters (detached indexer
    # inputs and teacher).
    total = aux["indexer_loss"] if dense else lm + config.optim.indexer_loss_coeff * aux["indexer_loss"]
    if "mtp_loss" in aux and not dense:
      total = total + mtp_weight * aux["mtp_loss"]
    return total, (lm, aux)

  @jax.jit(static_argnames="dense", donate_argnums=0, out_shardings=(state_shardings, NamedSharding(mesh, P())))
  def train_step(state, batch, dense):
    (total, (lm, aux)), grads = jax.value_and_grad(objective, has_aux=True)(
        state["params"], state["rest"], batch, dense)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    rest = state["rest"]
    if not dense and "expert_load" in aux:
      model = nnx.merge(graphdef, layer_stacks.per_layer(params, groups), rest)
      # In aux["expert_load"]'s order: the main layers', then the MTP blocks'.
      blocks = list(model.layers) + [depth.block for depth in (model.mtp or [])]
      moes = [block.mlp for block in blocks if isinstance(block.mlp, MoE)]
      for moe, load in zip(moes, aux["expert_load"]):
        update_router_bias(moe, load, config.optim.router_bias_rate)
      _, _, rest = nnx.split(model, nnx.Param, ...)
    finite = jnp.isfinite(total) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    new = {"params": params, "rest": rest, "opt_state": opt_state}
    # A non-finite step changes nothing: params, optimizer moments and router biases stay as they were.
    new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, {k: state[k] for k in new})
    new["skipped_steps"] = state["skipped_steps"] + (~finite).astype(jnp.int32)
    metrics = dict(loss=total, lm_loss=lm, indexer_loss=aux["indexer_loss"], grad_norm=optax.tree.norm(grads),
                   finite=finite)
    if "topk_rescued_rows" in aux:  # FlashTopK's slow exact path: visible, never silent
      metrics["topk_rescued_rows"] = aux["topk_rescued_rows"]
    if "mtp_loss" in aux:
      metrics["mtp_loss"] = aux["mtp_loss"]
    return new, metrics

  @jax.jit(static_argnames="dense")
  def evaluate(params, rest, batch, dense):
    return forward(params, rest, batch, dense, with_mtp=False)[0]

  return Training(state, state_shardings, train_step, evaluate, objective, main_lr, indexer_lr, groups)


def _handle_nonfinite(policy, step, metrics, grads, skipped, checkpointer):
  """Counts a skipped step, or stops with the first non-finite tensor named (the state is unchanged).

  `grads` is a thunk: the gradients are recomputed only to name the culprit.
  """
  if policy == "skip":
    logging.warning("step %d: non-finite loss or gradients; skipped (%d skipped so far)", step, skipped)
    return
  named = [(name, metrics[name]) for name in ("lm_loss", "mtp_loss", "indexer_loss", "loss") if name in metrics]
  named += [("grad " + "/".join(map(str, path)), g) for path, g in nnx.to_flat_state(grads())]
  first = next(name for name, value in named if not bool(jnp.all(jnp.isfinite(jnp.asarray(value[...])))))
  raise FloatingPointError(
      f"step {step}: {first} is not finite (train.nonfinite='stop'). Parameters and optimizer state were "
      f"not updated; the last checkpoint is step {checkpointer.latest_step()}. Set "
      f"--config.train.nonfinite=skip to skip such steps instead.")


def _tensorboard(workdir: str):
  """A tensorboardX writer under `<workdir>/tensorboard`, or None when tensorboardX is missing or this is
  not process 0."""
  if jax.process_index() != 0:
    return None
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415
  except ImportError:
    logging.warning("tensorboardX is not installed: metrics go to metrics.jsonl only.")
    return None
  return SummaryWriter(os.path.join(workdir, "tensorboard"))
