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
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from hyscale_jax import convert, models, parallel
from hyscale_jax import sharding as shd
from hyscale_jax.layers.moe import MoE, update_router_bias
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training import file_data, layer_stacks, memory, step_modes
from hyscale_jax.training.checkpoints import CheckpointError, Checkpointer
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
  for name in ("steps", "warmup_steps", "log_every", "checkpoint_every"):
    value = config.train[name]
    least = 0 if name in ("warmup_steps", "checkpoint_every") else 1
    if not isinstance(value, int) or value < least:
      raise ValueError(f"train.{name}={value!r} must be an int >= {least}.")
  weight = config.train.get("mtp_loss_weight", 0.0)
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
    raise ValueError(f"train.mtp_loss_weight={weight!r} must be a number >= 0.")
  return cfg


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """Trains `config.model` on packed real text; resumes from `workdir` when it holds a checkpoint.

  Returns:
    The metric rows logged by this run (also appended to `<workdir>/metrics.jsonl`).
  """
  config = step_modes.apply(config)  # `config.step_mode`'s backends and model fields, if set
  cfg, mesh = setup(config)  # every config error surfaces here, before any compute
  if config.train.get("memory_preflight", True):
    estimate = memory_preflight(config, cfg, mesh, available=memory.device_memory_bytes())
    logging.info("memory preflight: about %s per device", estimate.describe())
  check_workdir(workdir)
  rules = shd.rules_from_config(config.mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    return _train(config, cfg, mesh, rules, workdir)


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


def _train(config, cfg: ModelConfig, mesh, rules, workdir: str) -> list[dict]:
  """The training loop, under `jax.set_mesh(mesh)` and the logical axis `rules`.

  The ops split the sequence over `context`, the MoE dispatches over `expert`, and parameters and
  optimizer state live split by their logical axes (FSDP over `fsdp`, heads/FFN over `tensor`).
  """
  train = config.train
  data = file_data.open_dataset(config.data, model_vocab_size=cfg.vocab_size, seed=train.seed)
  validation = file_data.open_dataset(config.data, model_vocab_size=cfg.vocab_size, seed=train.seed,
                                      split="validation")
  # This process reads only the rows its devices hold, and the same rows whatever the process count.
  rows = parallel.process_rows(mesh, config.data.batch_size)
  logging.info("process %d reads rows %s of each global batch of %d", jax.process_index(), rows.tolist(),
               config.data.batch_size)
  feed = lambda dataset, step: parallel.global_batch(  # noqa: E731
      mesh, dataset.batch(step, rows=rows), rows=rows, batch_size=config.data.batch_size)

  training = build_training(config, cfg, mesh, rules)
  state, train_step, evaluate, objective = training.state, training.train_step, training.evaluate, training.objective
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=train.checkpoint_every)
  restored = _restore(checkpointer, state, training.layer_groups)
  start = 0
  if restored is not None:
    start, state, meta = restored
    logging.info("resuming at step %d", start)
    if meta.get("data", data.fingerprint) != data.fingerprint:
      # Batch s is a function of (seed, s, the corpus): another corpus resumes on other batches.
      logging.warning("checkpoint step %d was trained on %s; this run reads %s", start, meta["data"],
                      data.fingerprint)

  metrics_writer = MetricWriter(workdir)
  tensorboard = _tensorboard(workdir)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  logged, window_start, window_steps = [], time.perf_counter(), 0
  bar = tqdm(range(start, train.steps), initial=start, total=train.steps, unit="step", desc=cfg.architecture,
             disable=not (train.progress_bar and sys.stderr.isatty()))
  for step in bar:
    if train.stop_at_step and step >= train.stop_at_step:
      logging.info("stopping at step %d (train.stop_at_step); rerun to continue", step)
      break
    dense = step < train.warmup_steps
    batch = feed(data, step)
    state, metrics = train_step(state, batch, dense)
    if not bool(metrics["finite"]):
      # The state is the pre-step state, so the gradients can be recomputed to name the culprit.
      grads = lambda: jax.jit(jax.grad(lambda p: objective(p, state["rest"], batch, dense)[0]))(state["params"])
      _handle_nonfinite(train.nonfinite, step, metrics, grads, int(state["skipped_steps"]), checkpointer)
    window_steps += 1
    done = step + 1
    if done % train.log_every == 0 or done == train.steps:
      metrics = {k: float(v) for k, v in metrics.items() if k != "finite"}
      metrics["skipped_steps"] = int(state["skipped_steps"])
      elapsed = time.perf_counter() - window_start
      val = feed(validation, 0)
      row = metrics_writer.write(done, dict(
          **metrics, val_lm_loss=evaluate(state["params"], state["rest"], val, dense),
          stage=DENSE_STAGE if dense else SPARSE_STAGE, tokens_per_sec=window_steps * tokens_per_step / elapsed,
          lr=training.main_lr(step), indexer_lr=training.indexer_lr(step), **memory.device_peak_metrics()))
      if tensorboard is not None:
        for key, value in row.items():
          if key != "step":
            tensorboard.add_scalar(key, value, done)
        tensorboard.flush()
      logged.append(row)
      bar.set_postfix(loss=f"{row['loss']:.4f}")
      window_start, window_steps = time.perf_counter(), 0
    last = done == train.steps or done == train.stop_at_step
    checkpointer.maybe_save(done, state, {"step": done, "stage": int(not dense), "data": data.fingerprint},
                            force=last)
  checkpointer.close()
  if tensorboard is not None:
    tensorboard.close()
  return logged


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


def restore_model(config: ml_collections.ConfigDict, workdir: str) -> tuple[nnx.Module, int]:
  """The model of train.py's newest checkpoint under `workdir`, one module per layer as
  `models.build` makes it (for evaluation, generation, export), and the checkpoint's step.

  Raises:
    FileNotFoundError: `workdir` holds no checkpoint.
    CheckpointError: checkpoints exist but none reads with `config`'s model.
  """
  config = step_modes.apply(config)
  cfg, mesh = setup(config)
  rules = shd.rules_from_config(config.mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    training = build_training(config, cfg, mesh, rules)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0)
    try:
      restored = _restore(checkpointer, training.state, training.layer_groups)
    finally:
      checkpointer.close()
  if restored is None:
    raise FileNotFoundError(f"workdir={workdir!r} holds no checkpoint (looked in {checkpointer.directory}).")
  step, state, _ = restored
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, layer_stacks.per_layer(state["params"], training.layer_groups), state["rest"]), step


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
