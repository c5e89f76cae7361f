"""A train.py workdir as a Hugging Face checkpoint folder, with the run's tokenizer.

`python -m hyscale_jax.convert export WORKDIR HF_DIR [--step N]` lands here: the run's config
(`<workdir>/config.json`) rebuilds its model and the newest checkpoint (or step N) fills it, as for
the other commands that read a workdir (`workdir_tools`); `convert.export_checkpoint` writes it. The
tokenizer the run read its text with travels along: `data.tokenizer`'s files, or the BPE of a bundled
corpus (`text_data`); the data itself is not read.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import NamedTuple

from hyscale_jax import convert, workdir_tools
from hyscale_jax.training import file_data, lm, run_config, text_data


class Exported(NamedTuple):
  architecture: str
  step: int
  tensors: int
  tokenizer: bool  # whether HF_DIR received tokenizer.json


def is_workdir(directory: str) -> bool:
  """Whether `directory` is a train.py workdir: it has `checkpoints/`, or its config.json is a run's config."""
  if os.path.isdir(os.path.join(directory, "checkpoints")):
    return True
  try:
    with open(run_config.path(directory)) as f:
      values = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(values, dict) and {"model", "train", "data"} <= set(values)


def export_workdir(workdir: str, hf_dir: str, *, step: int | None = None,
                   max_shard_bytes: int = 2 << 30) -> Exported:
  """Writes the checkpoint of `step` (None: the newest) of `workdir` as a Hugging Face folder `hf_dir`.

  Raises:
    FileNotFoundError: `workdir` has no config.json or no checkpoint, or none of `step` (named, with the
      steps it has).
  """
  config = workdir_tools.load_config(workdir)
  workdir_tools.check_step(workdir, step)
  model, step = lm.restore_model(config, workdir, step=step)
  tensors = convert.export_checkpoint(model, hf_dir, max_shard_bytes=max_shard_bytes)
  return Exported(model.cfg.architecture, step, tensors, write_tokenizer(config.data, hf_dir))


def write_tokenizer(data, hf_dir: str) -> bool:
  """Writes the tokenizer of the run's `config.data` into `hf_dir`: tokenizer.json, and tokenizer_config.json
  naming its end-of-document token (with the other tokenizer files beside `data.tokenizer`); returns False,
  writing nothing, for a run that read token ids without a tokenizer."""
  if data.get("tokenizer"):
    file = file_data.tokenizer_file(data.tokenizer)
    tokenizer, eos_id, _ = file_data.load_tokenizer(file, data.get("eos_token", ""))
    convert.copy_tokenizer(str(file.parent), hf_dir)  # tokenizer_config.json (chat template, ...) beside it
    text = file.read_text()  # the file as it is, not as `tokenizers` would write it again
  elif (source := file_data.resolve_source(data)) in text_data.SOURCES:
    tokenizer, _, _, eos_id = text_data.build_or_load_cache(source, data.vocab_size,
                                                            data.get("cache_dir") or text_data.default_cache_dir())
    text = tokenizer.to_str()
  else:
    return False
  os.makedirs(hf_dir, exist_ok=True)
  (pathlib.Path(hf_dir) / "tokenizer.json").write_text(text)
  if data.get("eos_id", -1) >= 0:
    eos_id = data.eos_id
  _name_eos(pathlib.Path(hf_dir) / "tokenizer_config.json", tokenizer.id_to_token(eos_id))
  return True


def _name_eos(config_file: pathlib.Path, eos: str) -> None:
  """Makes `config_file` (tokenizer_config.json; written when absent) name `eos` as the end-of-document token."""
  config = json.loads(config_file.read_text()) if config_file.exists() else {
      "tokenizer_class": "PreTrainedTokenizerFast"}
  named = config.get("eos_token")
  if (named.get("content") if isinstance(named, dict) else named) != eos:
    config["eos_token"] = eos
    config_file.write_text(json.dumps(config, indent=2) + "\n")
