"""Our own checkpoint folder for an imported model: `model_config.json` plus the parameters with orbax.

`python -m hyscale_jax.convert import` writes one, with the checkpoint's tokenizer and a train.py
`config.py` (convert/train_config.py); `export` and `train.py --config.init_from=DIR` read one (or a
Hugging Face folder directly).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from hyscale_jax.convert.api import (CHECKPOINT_VARIABLES, ShardingSpec, abstract_model, config_mismatches,
                                     import_checkpoint, sharding_for)
from hyscale_jax.model_config import ModelConfig

CONFIG_FILE, PARAMS_DIR = "model_config.json", "params"


def is_native(directory: str) -> bool:
  return os.path.exists(os.path.join(directory, CONFIG_FILE))


def save_native(model: nnx.Module, directory: str) -> None:
  """Writes `model`'s config and checkpoint variables under `directory` (which must not hold params yet)."""
  os.makedirs(directory, exist_ok=True)
  fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(model.cfg).items()}
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(fields, f, indent=2, sort_keys=True)
  state = nnx.to_pure_dict(nnx.state(model, CHECKPOINT_VARIABLES))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(os.path.join(directory, PARAMS_DIR)), state)


def read_native_config(directory: str, **overrides) -> ModelConfig:
  with open(os.path.join(directory, CONFIG_FILE)) as f:
    fields = json.load(f)
  fields.update(overrides)
  return ModelConfig.from_config(fields)


def load_native(directory: str, *, sharding: ShardingSpec = None, **overrides) -> nnx.Module:
  """Our model from a folder `save_native` wrote; orbax reads each array straight into its sharding."""
  model = abstract_model(read_native_config(directory, **overrides))
  state = nnx.state(model, CHECKPOINT_VARIABLES)
  flat = dict(nnx.to_flat_state(state))
  target = nnx.from_flat_state({
      path: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding_for(sharding, path, var.shape))
      for path, var in flat.items()})
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(os.path.abspath(os.path.join(directory, PARAMS_DIR)),
                                    nnx.to_pure_dict(target))
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(model, state)
  return model


def load_pretrained(directory: str, cfg: ModelConfig, *, sharding: ShardingSpec = None) -> nnx.Module:
  """The model of `cfg` with weights from `directory` (ours or Hugging Face), for `train.py`'s init_from.

  Raises:
    ValueError: the checkpoint's architecture differs from `cfg` (the differing fields are named).
  """
  numerics = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, remat_policy=cfg.remat_policy)
  if is_native(directory):
    imported = read_native_config(directory, **numerics)
    load = lambda: load_native(directory, sharding=sharding, **numerics)
  else:
    from hyscale_jax.convert.api import read_config  # noqa: PLC0415
    imported = read_config(directory, **numerics)
    load = lambda: import_checkpoint(directory, sharding=sharding, **numerics)
  mismatches = config_mismatches(imported, cfg)
  if mismatches:
    raise ValueError(f"init_from={directory!r} holds a different model than config.model: "
                     + ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in sorted(mismatches.items()))
                     + ". Set config.model to the checkpoint's: `python -m hyscale_jax.convert import` writes a "
                     "config.py that has it.")
  model = load()
  leftover = [path for path, v in nnx.to_flat_state(nnx.state(model)) if not isinstance(v[...], jax.Array)]
  if leftover:
    raise ValueError(f"init_from={directory!r} left variables unset: {leftover[:10]}.")
  return model
