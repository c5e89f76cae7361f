"""Import a Hugging Face checkpoint folder into our model, and export ours back, one tensor at a time."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Callable

import jax
import numpy as np
from flax import nnx

from hyscale_jax import models
from hyscale_jax.convert import hf_config
from hyscale_jax.convert.names import TensorRule, constant_tensors, mtp_depths_present, tensor_rules
from hyscale_jax.convert.safetensors_dir import CheckpointReader, CheckpointWriter
from hyscale_jax.layers.moe import RouterBias, RoutingTable
from hyscale_jax.model_config import ModelConfig

# What a checkpoint holds: the parameters, the MoE router bias (moved by load, not by gradients) and the
# hash-routing tables (fixed).
CHECKPOINT_VARIABLES = nnx.Any(nnx.Param, RouterBias, RoutingTable)
ShardingSpec = jax.sharding.Sharding | Callable[[tuple, tuple[int, ...]], jax.sharding.Sharding] | None
# A checkpoint folder's tokenizer: what `import` copies into our folder and `export` into the Hugging Face one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class CheckpointMismatchError(ValueError):
  """The checkpoint's tensors are not the ones the config's model needs (names or shapes)."""


def read_config(directory: str, **overrides) -> ModelConfig:
  """Our ModelConfig from `<directory>/config.json`; `overrides` set numerics fields (dtype, remat)."""
  path = os.path.join(directory, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path!r} does not exist: not a Hugging Face checkpoint folder.")
  with open(path) as f:
    cfg = hf_config.from_hf(json.load(f), **overrides)
  # transformers builds no MTP layers, so what it saves has the config's MTP count and no MTP tensors.
  if cfg.mtp_depth and not mtp_depths_present(cfg, CheckpointReader(directory).names()):
    logging.warning("%s: config.json asks for %d MTP layer(s) but the checkpoint holds no MTP tensors; "
                    "importing without MTP (model.mtp_depth=0).", directory, cfg.mtp_depth)
    cfg = dataclasses.replace(cfg, mtp_depth=0)
  return cfg


def _rules(model: nnx.Module) -> tuple[list[TensorRule], dict]:
  flat = dict(nnx.to_flat_state(nnx.state(model, CHECKPOINT_VARIABLES)))
  return tensor_rules(model.cfg, {path: tuple(var.shape) for path, var in flat.items()}), flat


def _listing(names: set[str], limit: int = 20) -> str:
  shown = sorted(names)[:limit]
  return f"{shown}" + (f" and {len(names) - limit} more" if len(names) > limit else "")


def sharding_for(sharding: ShardingSpec, path: tuple, shape: tuple[int, ...]) -> jax.sharding.Sharding:
  """The Sharding of the array at `path`: the first device for None, else `sharding` (or its result)."""
  if sharding is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return sharding(path, shape) if callable(sharding) else sharding


def load_weights(model: nnx.Module, directory: str, *, sharding: ShardingSpec = None) -> int:
  """Fills `model`'s parameters (concrete or from `nnx.eval_shape`) from a checkpoint folder, in place.

  Streams: each checkpoint tensor is read, converted to our layout and dtype, and placed with its
  sharding before the next is read, so host memory holds one tensor (and its sources) at a time.

  Args:
    model: a model of ours; `model.cfg` says which tensors it needs.
    directory: a folder with `model.safetensors.index.json` and its shards (or `model.safetensors`).
    sharding: where each array goes: None (the first device), one Sharding for all, or a function
      `(state path, shape) -> Sharding`. Each device receives only its own slice.

  Returns:
    The number of checkpoint tensors read.

  Raises:
    CheckpointMismatchError: the checkpoint lacks tensors the model needs or holds ones it does not
      know (both listed by name), or a tensor's shape differs (named, with both shapes).
  """
  rules, flat = _rules(model)
  reader = CheckpointReader(directory)
  constants = constant_tensors(model.cfg)
  expected = {name for rule in rules for name in rule.hf} | set(constants)
  missing, unknown = expected - reader.names(), reader.names() - expected
  if missing or unknown:
    raise CheckpointMismatchError(
        f"{directory!r} does not match the {model.cfg.architecture} model of its config: "
        f"{len(missing)} missing tensors {_listing(missing)}; {len(unknown)} unknown tensors {_listing(unknown)}.")
  for name, value in constants.items():
    stored = reader.read(name)
    if stored.shape != value.shape or not np.array_equal(stored, value):
      raise CheckpointMismatchError(f"{name} holds {stored.tolist()}, but the config fixes it to {value.tolist()}.")
  values = {}
  for rule in rules:
    variable = flat[rule.ours]
    source = rule.hf[0] + (" (and the rest of its stack)" if len(rule.hf) > 1 else "")
    target_name = "/".join(map(str, rule.ours))
    try:
      value = rule.to_ours(reader.read(name) for name in rule.hf)
    except ValueError as e:
      raise CheckpointMismatchError(f"{source} does not fit {target_name}: {e}.") from e
    if tuple(value.shape) != tuple(variable.shape):
      raise CheckpointMismatchError(
          f"{source} gives shape {tuple(value.shape)} for {target_name}, which needs {tuple(variable.shape)}.")
    value = value.astype(variable.dtype, copy=False)
    target = sharding_for(sharding, rule.ours, value.shape)
    # Waiting for the copy keeps the stream honest: an async host-to-device copy would keep this
    # host buffer alive while the next tensors are read, and the buffers would pile up.
    values[rule.ours] = jax.make_array_from_callback(
        value.shape, target, lambda index, v=value: v[index]).block_until_ready()
    del value
  nnx.update(model, nnx.from_flat_state({path: flat[path].replace(values[path]) for path in values}))
  return len(expected)


def abstract_model(cfg: ModelConfig) -> nnx.Module:
  """The model of `cfg` built abstractly (`nnx.eval_shape`: shapes and dtypes, nothing allocated), to load into.

  Built without the ambient mesh: under train.py's mesh and logical axis rules, flax would turn each
  parameter's logical names into a PartitionSpec by its own rules, which map `embed` and `q_lora` both
  to `fsdp` in `q_a_proj` (P('fsdp', 'fsdp'): a DuplicateSpecError). The loader's `sharding` places the
  arrays instead, and train.py's `state_shardings` (one mesh axis per array, sharding.py) after it.
  """
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))


def import_checkpoint(directory: str, *, sharding: ShardingSpec = None, **overrides) -> nnx.Module:
  """Our model for a Hugging Face checkpoint folder: config from config.json, weights streamed in.

  The model is first built abstractly (`abstract_model`), so the random initialisation never occupies
  memory next to the loaded weights.
  """
  model = abstract_model(read_config(directory, **overrides))
  load_weights(model, directory, sharding=sharding)
  return model


def copy_tokenizer(source: str, target: str) -> list[str]:
  """Copies the `TOKENIZER_FILES` that `source` holds into `target`; returns their names (none: [])."""
  names = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
  os.makedirs(target, exist_ok=True)
  for name in names:
    shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
  return names


def export_checkpoint(model: nnx.Module, directory: str, *, max_shard_bytes: int = 2 << 30) -> int:
  """Writes `model` as a Hugging Face checkpoint folder (config.json, shards, index); returns the tensor count.

  One array at a time is fetched to the host and split into its checkpoint tensors; a shard is
  written once it passes `max_shard_bytes`.
  """
  config = hf_config.to_hf(model.cfg)
  rules, flat = _rules(model)
  os.makedirs(directory, exist_ok=True)
  writer = CheckpointWriter(directory, max_shard_bytes=max_shard_bytes)
  for rule in rules:
    value = np.asarray(jax.device_get(flat[rule.ours][...]))
    for name, array in zip(rule.hf, rule.to_hf(value), strict=True):
      writer.add(name, array)
  for name, array in constant_tensors(model.cfg).items():
    writer.add(name, array)
  writer.close()
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  return len(writer.weight_map)


def config_mismatches(imported: ModelConfig, configured: ModelConfig) -> dict[str, tuple]:
  """Architectural fields where a checkpoint's config and the run's config differ: name -> (ckpt, run)."""
  a, b = hf_config.architectural_fields(imported), hf_config.architectural_fields(configured)
  return {k: (a[k], b[k]) for k in a if a[k] != b[k]}
