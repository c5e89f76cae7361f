"""Checkpoint tensor names and layouts: our NNX state path <-> Hugging Face tensors, per architecture.

Module attributes follow the HF checkpoint keys (STYLE.md 6.2), so most names are a rename of the
dotted path: `kernel` is `weight` transposed ([in, out] here, [out, in] in torch), `scale` and
`embedding` are `weight`. The rest is a short rename table per architecture (DeepSeek-V4 is read in the
layout `save_pretrained` writes by default, DeepSeek's own: `attn.wq_a`, `ffn.experts.0.w1`, the mHC's
`hc_attn_fn`...; our residual-stream connections `attn_hc`, `mlp_hc`, `hc_head` take each
architecture's names) and two layouts that are not a rename: stacked experts (one [E, D, F] array
here, E tensors there) and DeepSeek-V4's grouped output projection `wo_a` ([G, in, o] here, [G * o,
in] there). Qwen4-Exp's Engram n-gram table is one [rows, E / H] array here and `split_ngram_parts`
row shards there (as `save_pretrained` writes it); the int64 hash constants transformers stores
beside it are fixed by the config (`constant_tensors`: checked on import, written on export).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable, Iterator

import numpy as np

from hyscale_jax.layers import engram
from hyscale_jax.model_config import ModelConfig

Path = tuple  # a path in the flat NNX state, e.g. ("layers", 0, "mlp", "gate", "kernel")

# (pattern, replacement) on the dotted path, applied in order, before the leaf rename.
_RENAMES: dict[str, list[tuple[str, str]]] = {
    "glm_moe_dsa": [
        (r"^mlp\.e_score_correction_bias$", "mlp.gate.e_score_correction_bias"),
    ],
    "deepseek_v4": [
        (r"^attn_hc\.(fn|base|scale)$", r"hc_attn_\1"),
        (r"^mlp_hc\.(fn|base|scale)$", r"hc_ffn_\1"),
        (r"^input_layernorm\.", "attn_norm."),
        (r"^post_attention_layernorm\.", "ffn_norm."),
        (r"^self_attn\.kv_norm\.", "attn.norm."),
        (r"^self_attn\.", "attn."),
        (r"\.position_bias$", ".ape"),
        (r"^mlp\.e_score_correction_bias$", "ffn.gate.bias"),
        (r"^mlp\.tid2eid$", "ffn.gate.tid2eid"),
        (r"^mlp\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
        (r"^mlp\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
        (r"^mlp\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
        (r"^mlp\.", "ffn."),
    ],
    "qwen4_exp": [
        (r"^attn_hc\.", "attn_hyper_connection."),
        (r"^mlp_hc\.", "mlp_hyper_connection."),
        (r"^hc_head\.", "hyper_connection_mixer."),
        (r"^self_attn\.indexer\.q_norm\.", "self_attn.indexer.q_layernorm."),
        (r"^self_attn\.indexer\.k_norm\.", "self_attn.indexer.k_layernorm."),
        (r"^mlp\.shared_experts\.", "mlp.shared_expert."),
    ],
}
# Per-expert tensor names of each stacked expert array.
_EXPERTS: dict[str, dict[str, str]] = {
    "glm_moe_dsa": {"experts_gate_proj": "mlp.experts.{e}.gate_proj.weight",
                    "experts_up_proj": "mlp.experts.{e}.up_proj.weight",
                    "experts_down_proj": "mlp.experts.{e}.down_proj.weight"},
    "deepseek_v4": {"experts_gate_proj": "ffn.experts.{e}.w1.weight",
                    "experts_up_proj": "ffn.experts.{e}.w3.weight",
                    "experts_down_proj": "ffn.experts.{e}.w2.weight"},
    "qwen4_exp": {"experts_gate_proj": "mlp.experts.{e}.gate_proj.weight",
                  "experts_up_proj": "mlp.experts.{e}.up_proj.weight",
                  "experts_down_proj": "mlp.experts.{e}.down_proj.weight"},
}
_LM_HEAD = {"glm_moe_dsa": "lm_head.weight", "deepseek_v4": "head.weight", "qwen4_exp": "lm_head.weight"}
# An MTP depth's own parts (models/mtp.py) -> the checkpoint's names, under the depth's prefix:
# GLM-5.1 (DeepSeek-V3 layout) `model.layers.{n_layers + d}.`, DeepSeek-V4 `mtp.{d}.`, Qwen `mtp.`
# (the block under `mtp.layers.{d}.`). DeepSeek-V4 splits eh_proj into e_proj and h_proj.
_MTP_PARTS: dict[str, dict[str, str]] = {
    "glm_moe_dsa": {"norm": "shared_head.norm"},
    "deepseek_v4": {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
                    "hc_head.hc_scale": "hc_head_scale"},
    "qwen4_exp": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"},
}


@dataclasses.dataclass(frozen=True)
class TensorRule:
  """One array of ours and the checkpoint tensors it is made of.

  `to_ours(iterator of arrays in `hf` order) -> array` and `to_hf(array) -> list` are exact
  inverses (transposes, stacks and reshapes only), so export then import is bit for bit. `to_ours`
  consumes its sources one at a time, so a stack never holds all of them beside its result.
  """

  ours: Path
  hf: tuple[str, ...]
  to_ours: Callable[[Iterator[np.ndarray]], np.ndarray]
  to_hf: Callable[[np.ndarray], list[np.ndarray]]


def _single(arrays):
  (array,) = arrays
  return array


def _transpose(arrays):
  return np.ascontiguousarray(_single(arrays).T)


def _stack_transposed(shape: tuple[int, ...]) -> Callable[[Iterator[np.ndarray]], np.ndarray]:
  """Fills one [E, in, out] array from E [out, in] tensors, each dropped once copied in."""

  def stack(arrays):
    stacked = None
    for e, array in enumerate(arrays):
      if array.T.shape != tuple(shape[1:]):
        raise ValueError(f"expert {e} has shape {array.shape}, the stack needs {tuple(shape[1:])[::-1]} per expert")
      if stacked is None:
        stacked = np.empty(shape, array.dtype)
      stacked[e] = array.T
    return stacked

  return stack


# transformers' default row-shard count of an Engram table (`split_ngram_parts`).
NGRAM_SPLIT_PARTS = 512


def _row_shards(rows: int, parts: int) -> list[int]:
  """Rows per shard of `torch.chunk(table, parts)`: ceil(rows / parts) each, the last one shorter (and
  fewer than `parts` shards when the rows run out first)."""
  size = -(-rows // parts)
  return [min(size, rows - start) for start in range(0, rows, size)]


def _concat_rows(shape: tuple[int, ...], counts: list[int]) -> Callable[[Iterator[np.ndarray]], np.ndarray]:
  """Fills one [rows, ...] array from its row shards, each dropped once copied in."""

  def concat(arrays):
    table, start = None, 0
    for k, (array, count) in enumerate(zip(arrays, counts, strict=True)):
      if array.shape != (count, *shape[1:]):
        raise ValueError(f"shard {k} has shape {array.shape}, the table needs {(count, *shape[1:])}")
      if table is None:
        table = np.empty(shape, array.dtype)
      table[start:start + count] = array
      start += count
    return table

  return concat


def _ngram_table_rule(cfg: ModelConfig, path: Path, shape: tuple[int, ...], name: str) -> TensorRule:
  parts = json.loads(cfg.hf_config or "{}").get("split_ngram_parts", NGRAM_SPLIT_PARTS)
  counts = _row_shards(shape[0], parts)
  starts = np.cumsum([0, *counts[:-1]])
  return TensorRule(path, tuple(f"{name}.shard_{k}.weight" for k in range(len(counts))), _concat_rows(shape, counts),
                    lambda a: [a[start:start + count] for start, count in zip(starts, counts)])


def constant_tensors(cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Checkpoint tensors that are not parameters but fixed by the config: Qwen4-Exp's Engram hash
  constants (`layer_multipliers`, `ngram_heads_vocab_sizes`, `ngram_heads_offsets`, int64), by name."""
  constants = {}
  for ple_index, layer_id in enumerate(cfg.ple_layer_ids):
    for key, value in engram.checkpoint_constants(cfg, ple_index).items():
      constants[f"model.layers.{layer_id - 1}.ple.ple_embedding.{key}"] = value
  return constants


def _depthwise_conv_rule(path: Path, name: str) -> TensorRule:
  """A depthwise conv kernel: [K, C] here, torch's Conv1d [C, 1, K] there."""
  return TensorRule(path, (name,), lambda a: np.ascontiguousarray(_single(a)[:, 0].T),
                    lambda a: [np.ascontiguousarray(a.T[:, None])])


def _expert_ids(n_experts: int) -> Callable[[Iterator[np.ndarray]], np.ndarray]:
  """Reads a `tid2eid` table, checking that every entry names one of the n_experts experts."""

  def read(arrays):
    table = _single(arrays)
    if table.dtype.kind not in "iu" or table.size and not 0 <= table.min() <= table.max() < n_experts:
      raise ValueError(f"the hash-routing table (dtype {table.dtype}, shape {table.shape}) must hold expert ids "
                       f"in [0, {n_experts}), got [{table.min()}, {table.max()}]")
    return table

  return read


def _first_of_copies(name: str, transpose: bool):
  """to_ours of a tensor the checkpoint also stores as copies: the first, which every copy must equal."""

  def first(arrays):
    arrays = iter(arrays)
    value = next(arrays)
    for i, copy in enumerate(arrays, 1):
      if copy.shape != value.shape or not np.array_equal(copy, value):
        raise ValueError(f"copy {i} of {name} (an MTP layer's shared {name}) differs from the model's")
    return np.ascontiguousarray(value.T) if transpose else value

  return first


def _mtp_local(cfg: ModelConfig, path: Path) -> tuple[str, str]:
  """(checkpoint prefix, local dotted name before the architecture's renames) of an MTP array."""
  arch, depth, part = cfg.architecture, int(path[1]), path[2]
  rest = ".".join(map(str, path[3:]))
  if arch == "qwen4_exp" and depth:
    raise ValueError(f"qwen4_exp checkpoints hold one MTP layer's fc and norms (mtp.fc, mtp.norm); "
                     f"model.mtp_depth={cfg.mtp_depth} has no checkpoint layout.")
  prefix = {"glm_moe_dsa": f"model.layers.{cfg.n_layers + depth}.", "deepseek_v4": f"mtp.{depth}.",
            "qwen4_exp": "mtp."}[arch]
  if part == "block":
    return (f"mtp.layers.{depth}." if arch == "qwen4_exp" else prefix), rest
  local = f"{part}.{rest}"
  for ours, theirs in _MTP_PARTS[arch].items():
    if local == ours or local.startswith(ours + "."):
      local = theirs + local[len(ours):]
  return prefix, local


def _rule_for(cfg: ModelConfig, path: Path, shape: tuple[int, ...]) -> TensorRule:
  arch = cfg.architecture
  # GLM-5.1's MTP layers (DeepSeek-V3 layout) also store the embedding and the head.
  copies = range(cfg.mtp_depth) if arch == "glm_moe_dsa" else ()
  if path == ("lm_head", "kernel"):
    names = (_LM_HEAD[arch], *(f"model.layers.{cfg.n_layers + d}.shared_head.head.weight" for d in copies))
    return TensorRule(path, names, _first_of_copies(names[0], True), lambda a: [a.T] * len(names))
  if path == ("embed_tokens", "embedding") and copies:
    names = ("model.embed_tokens.weight", *(f"model.layers.{cfg.n_layers + d}.embed_tokens.weight" for d in copies))
    return TensorRule(path, names, _first_of_copies(names[0], False), lambda a: [a] * len(names))
  if path[0] == "mtp":
    prefix, local = _mtp_local(cfg, path)
    if arch == "deepseek_v4" and local == "eh_proj.kernel":  # [2D, D] <-> e_proj, h_proj [D, D] each
      d = shape[1]
      return TensorRule(path, (prefix + "e_proj.weight", prefix + "h_proj.weight"),
                        lambda a: np.ascontiguousarray(np.concatenate([x.T for x in a], axis=0)),
                        lambda a: [np.ascontiguousarray(a[:d].T), np.ascontiguousarray(a[d:].T)])
  elif path[0] == "layers":
    prefix, local = f"model.layers.{path[1]}.", ".".join(map(str, path[2:]))
  else:
    prefix, local = "model.", ".".join(map(str, path))
  if local.startswith("mlp.experts_"):
    template = _EXPERTS[arch][local.removeprefix("mlp.")]
    names = tuple(prefix + template.format(e=e) for e in range(shape[0]))
    return TensorRule(path, names, _stack_transposed(shape), lambda a: [x.T for x in a])
  for pattern, replacement in _RENAMES[arch]:
    local = re.sub(pattern, replacement, local)
  if local == "ple.ple_embedding.ngram_embedding.embedding":
    return _ngram_table_rule(cfg, path, shape, prefix + "ple.ple_embedding.ngram_embedding")
  if local == "ple.conv1d":
    return _depthwise_conv_rule(path, prefix + "ple.conv1d.weight")
  if arch == "qwen4_exp" and path[0] == "layers" and cfg.layer_types[int(path[1])] == "gated_deltanet":
    # Gated DeltaNet is transformers' `linear_attn`; its depthwise conv kernel is [K, C] here and
    # torch's Conv1d [C, 1, K] there, and its gated norm's weight is our `norm` array.
    local = re.sub(r"^self_attn\.", "linear_attn.", local)
    if local == "linear_attn.conv1d":
      return _depthwise_conv_rule(path, prefix + local + ".weight")
    local += ".weight" if local == "linear_attn.norm" else ""
  leaf = local.rsplit(".", 1)[-1]
  if leaf == "tid2eid":  # the hash-routing table: int32 here, torch's int64 there
    return TensorRule(path, (prefix + local,), _expert_ids(cfg.n_routed_experts), lambda a: [a.astype(np.int64)])
  if arch == "deepseek_v4" and local.endswith("attn.wo_a"):  # [G, in, o] <-> [G * o, in]
    g, fan_in, rank = shape
    return TensorRule(path, (prefix + local + ".weight",),
                      lambda a: np.ascontiguousarray(_single(a).reshape(g, rank, fan_in).transpose(0, 2, 1)),
                      lambda a: [a.transpose(0, 2, 1).reshape(g * rank, fan_in)])
  if leaf == "kernel":
    return TensorRule(path, (prefix + local[: -len("kernel")] + "weight",), _transpose, lambda a: [a.T])
  if leaf in ("scale", "embedding"):
    local = local[: -len(leaf)] + "weight"
  return TensorRule(path, (prefix + local,), _single, lambda a: [a])


def mtp_depths_present(cfg: ModelConfig, names: set[str]) -> int:
  """How many MTP depths (0, 1, ... in order) have block tensors among the checkpoint's `names`."""
  if cfg.architecture not in _RENAMES:
    raise ValueError(f"no checkpoint layout for model.architecture={cfg.architecture!r}.")
  prefix = {"glm_moe_dsa": lambda d: f"model.layers.{cfg.n_layers + d}.", "deepseek_v4": lambda d: f"mtp.{d}.",
            "qwen4_exp": lambda d: f"mtp.layers.{d}."}[cfg.architecture]
  depth = 0
  while any(name.startswith(prefix(depth)) for name in names):
    depth += 1
  return depth


def tensor_rules(cfg: ModelConfig, flat_shapes: dict[Path, tuple[int, ...]]) -> list[TensorRule]:
  """The rule of every array in our state (`flat_shapes`: path -> shape), in state order."""
  if cfg.architecture not in _RENAMES:
    raise ValueError(f"no checkpoint layout for model.architecture={cfg.architecture!r}.")
  return [_rule_for(cfg, path, shape) for path, shape in flat_shapes.items()]
