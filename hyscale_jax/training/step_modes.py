"""Step modes: named presets of the op backends, the remat policy and the holistic optimizations.

One table for the comparison of issue 9, used by `train.py` (`--config.step_mode=...`) and by the
bench scripts (`bench/layer_step.py`, `bench/model_step.py`):

- `megatron_style`: `xla_baseline` selection (materialized score rows + `lax.top_k`), remat `full`
  (the backward pass reselects), and the indexer loss's Megatron-style backward that rescores
  every key (`indexer_loss` backend `xla_baseline`). The sparse attention kernel is ours, as in
  every mode, so only selection and recomputation differ.
- `+flashtopk`: our selection (`auto`: Pallas on GPU), remat `full`.
- `+replay`: our selection with `selection_replay` (one selection per step).
- `hyscale`: `+replay` plus every holistic optimization in `HOLISTIC`.
- `+replay+<name>`: `+replay` plus one holistic optimization (the ablation).
"""

from __future__ import annotations

import copy

import ml_collections

# Holistic optimizations: model-config overrides, each with the same values and gradients.
HOLISTIC: dict[str, dict] = {
    # The indexer loss's gradient computed in its forward pass and saved (DSA, CSA, QSA): the teacher
    # runs once per step instead of three times (forward, remat recompute, backward).
    "fused_loss_grad": {"indexer_loss_grad_in_forward": True},
    # MLA attention over 128K query rows at a time and the FFN sub-block over 128K positions, for
    # 256K-1M tokens; each chunk then reruns its forward in the backward pass
    # (ModelConfig.query_chunk, ModelConfig.ffn_chunk; equal sizes run the whole layer over the
    # chunks, ModelConfig.layer_chunk). No-op at T <= 128K. A chunk size the config already sets
    # (nonzero) is kept: the mode turns chunking on, the user may choose its size.
    "query_chunk": {"attention_query_chunk": 131072, "ffn_token_chunk": 131072},
}
_SIZES_THE_USER_KEEPS = ("attention_query_chunk", "ffn_token_chunk")
_BASE = {
    "megatron_style": ({"flash_topk": "xla_baseline", "indexer_loss": "xla_baseline"}, {"remat_policy": "full"}),
    "+flashtopk": ({"flash_topk": "auto", "indexer_loss": "auto"}, {"remat_policy": "full"}),
    "+replay": ({"flash_topk": "auto", "indexer_loss": "auto"}, {"remat_policy": "selection_replay"}),
}
STEP_MODES: tuple[str, ...] = (*_BASE, "hyscale")
ABLATIONS: tuple[str, ...] = tuple(f"+replay+{name}" for name in HOLISTIC)


def settings(mode: str) -> tuple[dict, dict]:
  """(ops backends, model-config overrides) of `mode`; `sparse_attention` is "auto" in every mode.

  Raises:
    ValueError: `mode` is not in STEP_MODES or ABLATIONS.
  """
  if mode == "hyscale":
    holistic = list(HOLISTIC)
  elif mode in ABLATIONS:
    holistic = [mode.removeprefix("+replay+")]
  elif mode in _BASE:
    holistic = []
  else:
    raise ValueError(f"step_mode={mode!r} is not one of {STEP_MODES + ABLATIONS}.")
  ops, model = _BASE["+replay" if holistic else mode]
  model = dict(model, indexer_loss_grad_in_forward=False, attention_query_chunk=0, ffn_token_chunk=0)
  for name in holistic:
    model.update(HOLISTIC[name])
  return dict(ops, sparse_attention="auto"), model


def apply(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` with `config.step_mode`'s settings written into `config.ops` and `config.model`.

  An empty or missing `step_mode` returns `config` unchanged (each field as configured). Where the
  mode turns a chunking on, a nonzero chunk size already in `config.model` is kept.
  """
  mode = config.get("step_mode", "")
  if not mode:
    return config
  ops, model = settings(mode)
  config = copy.deepcopy(config)
  with config.unlocked():
    for name, backend in ops.items():
      config.ops[name] = backend
    for name, value in model.items():
      if not (name in _SIZES_THE_USER_KEEPS and value and config.model.get(name)):
        config.model[name] = value
  return config
