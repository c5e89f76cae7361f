"""The run's config in its workdir (`<workdir>/config.json`): written at start, read by the tools that
open a workdir (evaluation, generation, export), so none of them rebuilds it by hand."""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from hyscale_jax.model_config import EXECUTION_FIELDS, PROVENANCE_FIELDS
from hyscale_jax.training.checkpoints import CHECKPOINTS

FILENAME = "config.json"


def path(workdir: str) -> str:
  return os.path.join(workdir, FILENAME)


def save(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `config` to `<workdir>/config.json` (atomically: a reader never sees half a file).

  Raises:
    ValueError: the workdir holds checkpoints of another model: the message names the differing
      `model.*` keys (execution settings such as dtype or remat may change between runs). Without a
      checkpoint the file is replaced: a run that stopped before its first one leaves nothing to trip on.
  """
  saved = load(workdir) if os.path.exists(path(workdir)) and _has_checkpoint(workdir) else None
  if saved is not None:
    differ = model_differences(saved.model, config.model)
    if differ:
      listed = "; ".join(f"model.{k}: {a!r} in the workdir, {b!r} now" for k, (a, b) in sorted(differ.items()))
      raise ValueError(f"workdir {workdir!r} holds checkpoints of another model ({listed}). Use another "
                       "--workdir, or the workdir's own config.")
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  partial = path(workdir) + f".tmp{os.getpid()}"
  with open(partial, "w") as f:
    f.write(config.to_json_best_effort(indent=1, sort_keys=True) + "\n")
  os.replace(partial, path(workdir))


def _has_checkpoint(workdir: str) -> bool:
  folder = os.path.join(workdir, CHECKPOINTS)
  return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))


def load(workdir: str) -> ml_collections.ConfigDict:
  """The config of the run in `workdir`, as train.py took it.

  Raises:
    FileNotFoundError: `workdir` holds no config.json (not a train.py workdir, or one from before the
      config was saved).
  """
  if not os.path.exists(path(workdir)):
    raise FileNotFoundError(f"{path(workdir)!r} does not exist: {workdir!r} is not a train.py workdir.")
  with open(path(workdir)) as f:
    values = json.load(f)
  # JSON has no tuples: the model's sequence fields and the mesh rules' pairs are tuples again.
  for key, value in values.get("model", {}).items():
    if isinstance(value, list):
      values["model"][key] = tuple(value)
  rules = values.get("mesh", {}).get("rules")
  if rules is not None:
    values["mesh"]["rules"] = tuple((name, tuple(target) if isinstance(target, list) else target)
                                    for name, target in rules)
  return ml_collections.ConfigDict(values)


def model_differences(a, b) -> dict[str, tuple]:
  """The architectural `model.*` fields where configs `a` and `b` differ: name -> (a's, b's)."""
  a, b = (dict(x.to_dict() if hasattr(x, "to_dict") else x) for x in (a, b))
  skip = EXECUTION_FIELDS | PROVENANCE_FIELDS
  norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - JSON turns tuples into lists
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
          if k not in skip and norm(a.get(k)) != norm(b.get(k))}
