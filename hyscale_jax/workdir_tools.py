"""What the commands that read a train.py workdir share (evaluate, generate, `convert export`).

They open a workdir in the order that finds a user's mistake before any compute: the run's config
(`<workdir>/config.json`, `run_config.load`), the checkpoint step, the dataset and its tokenizer,
then the model (`lm.restore_model`). A mistake raises `ValueError` or `FileNotFoundError` with a
one-line message, which `cli.run` prints as `error: ...` with exit status 2 and no traceback;
`ArgumentParser` does the same for a bad flag.
"""

from __future__ import annotations

import argparse
import os

import ml_collections

from hyscale_jax import cli
from hyscale_jax import models
from hyscale_jax.training import checkpoints, file_data, lm, run_config, step_modes, text_data


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors are one line `error: ...` and status 2 (not the usage first)."""

  def error(self, message: str):
    cli.fail(f"{message} (see --help)")


def add_workdir_flags(parser: argparse.ArgumentParser) -> None:
  """--workdir and --step, the flags of every workdir command."""
  parser.add_argument("--workdir", required=True,
                      help="a train.py workdir: holds config.json (the run's config) and checkpoints/")
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint step to load (default: the newest that reads)")


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's config, ready to restore its checkpoint on this machine.

  The run's `step_mode` is applied (the backends and model fields it trained with); the mesh is this
  machine's one device (any mesh reads a checkpoint), and `init_from` is dropped (the checkpoint holds
  every weight).

  Raises:
    FileNotFoundError: `workdir` is not a folder, or holds no config.json.
    ValueError: the config does not validate.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"workdir {workdir!r} does not exist (or is not a folder).")
  config = step_modes.apply(run_config.load(workdir))
  config.mesh.update({axis: 1 for axis in config.mesh if axis != "rules"})
  config.init_from = ""
  lm.setup(config)  # the config checks train.py runs first
  return config


def check_step(workdir: str, step: int | None) -> None:
  """Raises FileNotFoundError when the workdir has no checkpoint, or none of step `step` (None: any)."""
  folder = os.path.join(workdir, checkpoints.CHECKPOINTS)
  steps = checkpoints.saved_steps(folder)
  if not steps:
    raise FileNotFoundError(f"workdir {workdir!r} holds no checkpoint (looked in {folder}).")
  if step is not None and step not in steps:
    raise FileNotFoundError(f"--step={step}: workdir {workdir!r} has checkpoints of steps {steps} only.")


def open_validation(config: ml_collections.ConfigDict) -> text_data.PackedRows:
  """The run's validation split, with its tokenizer where the run has one (`.tokenizer`, else None).

  Raises:
    ValueError: the corpus or tokenizer the config names cannot be opened (named).
  """
  try:
    return file_data.open_dataset(config.data, model_vocab_size=config.model.vocab_size, seed=config.train.seed,
                                  split="validation")
  except OSError as e:
    raise ValueError(f"the run's data cannot be opened: {e}") from None


def describe(config: ml_collections.ConfigDict, workdir: str, step: int) -> str:
  """One line: what was loaded (architecture, step, parameter counts, workdir)."""
  total, active = models.count_params(config.model)
  return (f"loaded {config.model.architecture} step {step} from {workdir}: {_count(total)} parameters "
          f"({_count(active)} active per token)")


def _count(n: int) -> str:
  """1234567 -> '1.23M' (three significant digits)."""
  for exponent, suffix in ((12, "T"), (9, "B"), (6, "M"), (3, "K")):
    if n >= 0.9995 * 10**exponent:  # 999_999 is '1M', not '1e+03K'
      return f"{n / 10**exponent:.3g}{suffix}"
  return str(n)
