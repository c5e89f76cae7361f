"""The train.py config that `python -m hyscale_jax.convert import` writes beside the weights: `<folder>/config.py`.

`python train.py --config=<folder>/config.py` then fine-tunes those weights: the LM recipe of
configs/base.py (`two_stage_lm`) with `config.init_from` the folder, the checkpoint's tokenizer as
`config.data.tokenizer` when it has one, and a `config.model` of three parts:
- the fields the checkpoint fixes (`hf_config.checkpoint_fields`), the only ones the file lists: every
  other architectural field is `ModelConfig`'s default, which this architecture does not use;
- the execution fields (`EXECUTION_FIELDS`: dtype, remat, chunking) at their defaults, so that
  `--config.model.<knob>=...` overrides them;
- the imported config.json (`hf_config`), so that an export of the trained run writes back every field
  it had (convert/hf_config.py `to_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hyscale_jax.convert import hf_config, native
from hyscale_jax.model_config import EXECUTION_FIELDS, ModelConfig

FILENAME = "config.py"
# Fine-tuning defaults: tokens per sequence (at most the checkpoint's max_position_embeddings) and the
# peak learning rate; `--config.data.seq_len` and `--config.optim.learning_rate` change them.
SEQ_LEN = 4096
LEARNING_RATE = 1e-5

_TEMPLATE = '''"""Fine-tunes the {architecture} weights beside this file with the LM recipe of configs/base.py.

Written by `python -m hyscale_jax.convert import` from {source}.

Usage: {command}
"""

import os

import ml_collections

from configs import base
from hyscale_jax.convert import train_config

# What the checkpoint fixes ({architecture} uses no other model field), and the dtype its weights were imported in.
MODEL = dict(
{fields}
)
# The weights (model_config.json and params/){tokenizer_note} beside this file.
WEIGHTS = os.path.dirname(os.path.abspath(__file__))


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  if variant:
    raise ValueError(f"{{__file__}} has no variants; got {{variant!r}}.")
  config = base.two_stage_lm("{architecture}", "full", MODEL, {{}}, full_seq_len={seq_len},
                             full_learning_rate={learning_rate!r})
  # MODEL, the execution knobs (dtype, remat, chunking) and the imported config.json, which export writes back.
  config.model = ml_collections.ConfigDict(train_config.model_settings(MODEL, WEIGHTS))
  config.init_from = WEIGHTS
  # The checkpoint's indexer is trained already: no dense warm-up stage.
  config.train.warmup_steps = 0
  # data.path's suffix picks the source: .jsonl text (read with data.tokenizer) or .npy token ids.
  config.data.source = ""
{tokenizer}  return config
'''


def train_command(directory: str, *, with_tokenizer: bool) -> str:
  """The train.py command line for the config.py in `directory` (from the repository root)."""
  data = "--config.data.path=DATA.jsonl" + ("" if with_tokenizer else " --config.data.tokenizer=TOKENIZER.json")
  return f"python train.py --config={os.path.join(directory, FILENAME)} --workdir=WORKDIR {data}"


def write(cfg: ModelConfig, directory: str, *, source: str, with_tokenizer: bool) -> str:
  """Writes `<directory>/config.py` for `cfg`, the model whose weights `directory` holds; returns its path.

  Args:
    cfg: the imported model's config.
    directory: our checkpoint folder (`native.save_native`), made absolute in the usage line.
    source: the Hugging Face folder it came from, named in the file's docstring.
    with_tokenizer: whether `directory` holds the checkpoint's tokenizer.json.
  """
  directory = os.path.abspath(directory)
  fields = dict(hf_config.checkpoint_fields(cfg), param_dtype=cfg.param_dtype)
  text = _TEMPLATE.format(
      architecture=cfg.architecture, source=os.path.abspath(source),
      command=train_command(directory, with_tokenizer=with_tokenizer),
      fields="\n".join(f"    {name}={_literal(value)}," for name, value in fields.items()),
      tokenizer_note=" and their tokenizer" if with_tokenizer else "", seq_len=_seq_len(cfg),
      learning_rate=LEARNING_RATE, tokenizer="  config.data.tokenizer = WEIGHTS\n" if with_tokenizer else "")
  path = os.path.join(directory, FILENAME)
  with open(path, "w") as f:
    f.write(text)
  return path


def model_settings(fields: dict[str, Any], directory: str) -> dict[str, Any]:
  """`config.model` for a run from our folder `directory`: `fields`, the execution fields at `ModelConfig`'s
  defaults (unless `fields` sets them), and the config.json the folder was imported from (`hf_config`).

  Tuples become lists, as ConfigDicts hold them.
  """
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in EXECUTION_FIELDS}
  settings = {**defaults, **fields, "hf_config": native.read_native_config(directory).hf_config}
  return {name: list(value) if isinstance(value, tuple) else value for name, value in settings.items()}


def _seq_len(cfg: ModelConfig) -> int:
  original = hf_config.original_hf(cfg)
  longest = (original.get("text_config") or original).get("max_position_embeddings")
  return min(SEQ_LEN, longest) if isinstance(longest, int) and longest > 0 else SEQ_LEN


def _literal(value: Any) -> str:
  """`value` as Python source, strings in double quotes."""
  if isinstance(value, str):
    return json.dumps(value)
  if isinstance(value, tuple):
    return "(" + ", ".join(map(_literal, value)) + ("," if len(value) == 1 else "") + ")"
  return repr(value)
