"""Per-device training memory, estimated from the model's shapes before anything is compiled.

The estimate adds, per device:
- parameters, gradients and the two AdamW moments (param dtype), divided over `param_shards`;
- what the per-layer `jax.checkpoint` keeps for the backward pass: each layer's input, and under
  `"selection_replay"` the selection (i32, layers with an indexer) and the attention's out/lse of
  every layer (not when MLA query chunking is on at this length); under `"none"` every layer's
  intermediates;
- the f32 logits and their gradient of one chunk of the LM loss (`model.lm_loss_chunk` of the
  device's positions per row; layers/lm_head.py), never of the whole [B, T, V]; with parameters
  below f32, also what the loss's f32 head-gradient accumulator [D, V] adds to the gradient;
- the largest transient of one layer: its intermediates while its backward runs (the recomputed
  forward and their gradients; MLA's query side one `model.attention_query_chunk` of rows at a
  time and the FFN sub-block one `model.ffn_token_chunk`, when those chunk), or the all-gathered
  key rows under context parallelism (counted at full T even when MLA query chunking would hold
  them one chunk at a time: an upper bound);
- with `model.sparse_attention_deterministic`, the backward's f32 contribution slabs (at most the
  kernel's `Config.chunk_bytes`, 1 GiB);
- FlashTopK's main-pass working memory in a layer with an indexer: its query chunks are capped by a
  byte budget, 256 MiB on the Triton pass and 1 GiB on the Mosaic GPU pass (Hopper, from 32K keys).
  A conservative term: under "selection_replay" the selection runs in the forward pass only, not
  beside the backward's transients, and the fits below predate it; it adds at most 1 GiB, under
  1.5% of the peaks they were fitted to;
- the routed experts of one MoE layer's backward, for one token chunk (`model.moe_token_chunk`,
  all tokens when 0) of R = tokens x experts_per_token dispatched rows (`moe_expert_bytes`): with
  `ops.grouped_matmul`'s Hopper kernels, the rows and the experts' activations and their gradients,
  O(R x (D + F)); where the op runs `jax.lax.ragged_dot` (CPU, other GPUs), XLA (and JAX on CPU)
  expand it into a dense dot over a group-masked, group-broadcast operand, [R, D] -> [E, R, D], and
  the backward's operands, cast to f32 to meet the f32 cotangents, become f32 [E, R, D] and
  [E, R, F]: at the 2L-mid GLM-5.1 (E=16, R=131072 at 16K tokens) most of the step's temporaries;
- a fixed runtime reserve (cuBLAS workspaces, autotuning scratch) that the device's peak shows on
  top of the compiled arguments and temporaries.
It is an estimate of the dominant terms, not of XLA's exact buffer assignment. The copy factors
below are what to calibrate against measured peaks (`bench/memory_check.py` prints every term); the
peaks they were fitted to, and the estimate's error on each, are in docs/results.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import logging
import os

import jax
import jax.numpy as jnp

from hyscale_jax.layers.lm_head import chunk_layout
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.sharding import BATCH_AXES

# One layer's intermediates alive at once in its backward pass (1 = the forward's set), by remat policy.
# Under "full" the backward reruns the whole layer (selection included) and holds those intermediates
# with their gradients; under "selection_replay" it reuses the saved selection and attention out/lse
# (their own term), so less of the layer is live again. Fitted to whole-model peaks of train.py on the
# GLM-5.1 2-layer model at real width (`bench/model_step.py --models glm2`, 64K-256K). "none" saves
# every intermediate (its own term); 1.0 there is a prior, not a fit.
LAYER_TRANSIENT_COPIES = {"full": 1.4, "selection_replay": 0.55, "none": 1.0}
# [rows of one loss chunk, V] f32 buffers at the loss: the chunk's logits and their gradient.
LOGITS_COPIES = 2.0
# Bytes per (expert, dispatched row, D column) of the ragged_dot expansion live at once in an MoE
# layer's backward: an f32 masked copy of the rows (or their gradient) plus the activation-dtype one
# of the recomputed forward. Per (expert, row, F column): the f32 masked copy of the hidden gradient.
# Together they put the 2L-mid and tiny GLM-5.1 peaks within 4% (`bench/memory_check.py` prints this term).
MOE_EXPANSION_F32_COPIES = 1.0
# The grouped kernel's per-row buffers of `moe_expert_bytes` live at once: a prior, not yet fitted
# to a whole-model peak.
MOE_GROUPED_COPIES = 1.0
# [rows, D] activation-dtype arrays at full length that a layer run over sequence chunks
# (`model.attention_query_chunk`, `model.ffn_token_chunk`) holds at once beyond the terms above: the
# chunk loops' stacked inputs and outputs and their cotangents. Fitted to the GLM-5.1 2-layer
# model's peaks at 256K-1M with query and FFN chunks (5.4 to 6.7 such arrays were missing without it).
CHUNKED_LAYER_FULL_LENGTH_COPIES = 6.0
# The same when the whole layer runs over sequence chunks (`ModelConfig.layer_chunk`: equal query
# and FFN chunks; `models/layer_chunks.py`): one, the buffer that holds the layer's output (written
# into a copy of its input) and, in the backward pass, its cotangent (overwritten in place by the
# input's). The rest of such a layer holds one chunk of rows (`LayerBytes.rows_bytes`). Fitted to
# the GLM-5.1 2-layer model's peaks at 512K-1M (`bench/memory_proxy.py --run`).
WHOLE_LAYER_CHUNKS_FULL_LENGTH_COPIES = 1.0
# Measured device peak / this estimate, the lowest and highest seen over the runs that docs/results.md
# lists ("Memory preflight against measured peaks"). The preflight refuses a run only when even the
# lowest ratio would not fit, and warns when the estimate alone is over.
MEASURED_OVER_ESTIMATE = (0.84, 1.17)
# What the device's peak holds beyond the compiled program (the runtime's own buffers; docs/results.md).
RUNTIME_RESERVE_BYTES = 64 * 2**20


def _blocks(cfg: ModelConfig) -> list[tuple[ModelConfig, int]]:
  """(config, layer) of every decoder block the step runs: the layers, then the MTP depths' blocks.

  An MTP block is layer n_layers of a config one layer longer whose extra layer is the block's kind
  (models/mtp.py): GLM's with its own indexer, DeepSeek-V4's sliding-window, Qwen's QSA.
  """
  blocks = [(cfg, i) for i in range(cfg.n_layers)]
  if cfg.mtp_depth:
    extra = dict(n_layers=cfg.n_layers + 1)
    if cfg.architecture == "deepseek_v4":
      extra["compress_ratios"] = (*cfg.compress_ratios, 0)
    elif cfg.architecture == "qwen4_exp":
      extra["layer_types"] = (*cfg.layer_types, "qsa")
    else:
      extra.update(index_topk_freq=1, index_topk_offset=0)
    mtp = dataclasses.replace(cfg, **extra)
    blocks += [(mtp, cfg.n_layers)] * cfg.mtp_depth
  return blocks


def _attention_dims(cfg: ModelConfig) -> tuple[int, int, int]:
  """(selected keys per query, attention-output width per head, key-row width) for cfg's family."""
  if cfg.architecture == "deepseek_v4":
    return cfg.sliding_window + cfg.index_topk, cfg.head_dim, cfg.head_dim
  if cfg.architecture == "qwen4_exp":
    return cfg.index_topk * cfg.qsa_block + cfg.qsa_block - 1, cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim
  return cfg.index_topk, cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_dim


def _has_indexer(cfg: ModelConfig, layer: int) -> bool:
  """Whether `layer` runs `flash_topk` (so `"selection_replay"` saves its i32[T, index_topk])."""
  if cfg.architecture == "deepseek_v4":
    return cfg.layer_kind(layer) == "csa"
  if cfg.architecture == "qwen4_exp":
    return cfg.layer_types[layer] == "qsa"
  return cfg.has_indexer(layer)


def _attention_parts(cfg: ModelConfig, layer: int) -> int:
  """(out, lse) pairs the layer's attention computes and `"selection_replay"` saves: DeepSeek-V4's HCA
  attends its window (`sparse_attention`) and every visible entry (`causal_attention`) apart and
  merges them by their LSEs; Gated DeltaNet saves none (no softmax); every other layer makes one call."""
  if cfg.architecture == "qwen4_exp" and cfg.layer_types[layer] == "gated_deltanet":
    return 0
  return 2 if cfg.architecture == "deepseek_v4" and cfg.layer_kind(layer) == "hca" else 1


class LayerBytes(NamedTuple):
  """Bytes per token of one layer's large intermediates, by which rows hold them at once.

  `whole`: every position of the sequence (the keys, the residual stream, the norms);
  `query`: the MLA query side (absorbed queries, attention output, selection, indexer queries),
  one `model.attention_query_chunk` of rows at a time when that chunking is on;
  `ffn`: the FFN sub-block's activations (dense MLP, shared experts, router), one
  `model.ffn_token_chunk` of rows at a time when that chunking is on;
  `keys`: the part of `whole` made for every position even when the whole layer runs over sequence
  chunks (`ModelConfig.layer_chunk`: MLA's keys); the rest of the layer then holds one chunk of rows.
  """

  whole: float
  query: float
  ffn: float
  keys: float

  @property
  def total(self) -> float:
    return self.whole + self.query + self.ffn

  def rows_bytes(self, cfg: ModelConfig, rows: float, seq_len: int) -> float:
    """Bytes of this device's `rows` positions of length-`seq_len` sequences, each part over its chunk's rows.

    A length a chunk does not divide counts as unchunked here (the layer itself raises).
    """
    layer_chunk = _chunk_at(cfg.layer_chunk, seq_len)
    if layer_chunk:
      return rows * self.keys + rows * layer_chunk / seq_len * (self.total - self.keys)

    def chunked(chunk_of):
      chunk = _chunk_at(chunk_of, seq_len)
      return rows * chunk / seq_len if chunk else rows

    return rows * self.whole + chunked(cfg.query_chunk) * self.query + chunked(cfg.ffn_chunk) * self.ffn


def _layer_bytes_per_token(cfg: ModelConfig, layer: int) -> LayerBytes:
  """Bytes per token of one layer's large intermediates (matmul outputs, attention out, indices).

  None grows with the length: HCA and CSA's warm-up stream their entries rather than list them.
  Only MLA (GLM-5.1 / DSA) layers have a query side apart from `whole` (see `ModelConfig.query_chunk`).
  """
  a = jnp.dtype(cfg.dtype).itemsize
  D, H = cfg.d_model, cfg.n_heads
  index = cfg.index_n_heads * cfg.index_head_dim + cfg.index_head_dim + cfg.index_n_heads
  lse_parts = 0  # f32 [H] per token beyond the one lse below
  query = 0.0
  keys = None  # all of `whole` unless a family's layer chunks whole (MLA's, below)
  if cfg.architecture == "deepseek_v4":
    hd, kind = cfg.head_dim, cfg.layer_kind(layer)
    attn = 2 * cfg.q_lora_rank + 2 * H * hd + 2 * hd + 2 * H * hd + cfg.o_groups * cfg.o_lora_rank
    # i32 keys per query: the window's, and CSA's top-k. HCA's entries are streamed by
    # `causal_attention` (no list); its window and entry parts add two (out, lse) before the merge.
    # CSA's dense warm-up holds what HCA holds; this counts its sparse stage.
    attended = cfg.sliding_window + (cfg.index_topk if kind == "csa" else 0)
    if _attention_parts(cfg, layer) > 1:
      attn += 2 * H * hd
      lse_parts = 2 * H
    attn += index if kind == "csa" else 0
  elif cfg.architecture == "qwen4_exp" and cfg.layer_types[layer] == "gated_deltanet":
    # q, k, v before and after the conv, z, the op's output, its norm and gate; the f32 state of
    # each chunk (what the op's scan keeps for its backward) spread over the chunk's tokens.
    qkv = 2 * cfg.linear_n_key_heads * cfg.linear_key_dim + cfg.linear_n_value_heads * cfg.linear_value_dim
    attn = 2 * qkv + 4 * cfg.linear_n_value_heads * cfg.linear_value_dim
    attn += cfg.linear_n_value_heads * cfg.linear_key_dim * cfg.linear_value_dim * 4 // (a * cfg.linear_chunk)
    attended = 0
  elif cfg.architecture == "qwen4_exp":
    hd = cfg.head_dim
    attn = 2 * H * hd + 4 * cfg.n_kv_heads * hd + 2 * H * hd + index
    attended = cfg.index_topk * cfg.qsa_block + cfg.qsa_block - 1
  else:
    L, R, nope = cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.qk_nope_dim
    # The keys (latent, roped, the value prefix, the indexer's) for all rows; the rest per query.
    attn = 2 * (L + R) + L + (cfg.index_head_dim if cfg.has_indexer(layer) else 0)
    query_side = (2 * cfg.q_lora_rank + H * (nope + R) + H * L + H * (L + R) + H * L + H * cfg.v_head_dim
                  + (cfg.index_n_heads * (cfg.index_head_dim + 1) if cfg.has_indexer(layer) else 0))
    # and the selection, twice: the Hopper backward's copy of it sorted by key (its sweep and waves
    # schedules, `pallas_kernels.sparse_attention.mgpu_backward.sorted_by_key`) lives beside it
    query = query_side * a + 2 * cfg.index_topk * 4
    attended = 0
    keys = attn * a
  if cfg.is_moe(layer):  # the shared experts and the f32 combine (the routed rows: `moe_expert_bytes`)
    mlp = 3 * cfg.n_shared_experts * cfg.moe_inter + 2 * D
  else:
    mlp = 3 * cfg.dense_inter
  whole = (attn + 4 * D) * a + (2 * H + lse_parts) * 4 + attended * 4
  return LayerBytes(whole=whole, query=query, ffn=mlp * a + cfg.n_routed_experts * 4,
                    keys=whole if keys is None else keys)


def _chunk_at(chunk_of, seq_len: int) -> int:
  """`chunk_of(seq_len)` (`ModelConfig.query_chunk` or `ffn_chunk`), with 0 for a chunk that does not
  divide the length: the estimate counts it unchunked (the layer itself raises)."""
  try:
    return chunk_of(seq_len)
  except ValueError:
    return 0


def _runs_in_chunks(cfg: ModelConfig, seq_len: int) -> bool:
  """Whether the layers run over query or FFN chunks at this length."""
  return bool(_chunk_at(cfg.query_chunk, seq_len) or _chunk_at(cfg.ffn_chunk, seq_len))


def _full_length_copies(cfg: ModelConfig, seq_len: int) -> float:
  """[rows, D] arrays a layer over sequence chunks holds at full length (0 when it does not chunk)."""
  if _chunk_at(cfg.layer_chunk, seq_len):
    return WHOLE_LAYER_CHUNKS_FULL_LENGTH_COPIES
  return CHUNKED_LAYER_FULL_LENGTH_COPIES if _runs_in_chunks(cfg, seq_len) else 0.0


def _indexer_grads(cfg: ModelConfig, seq_len: int) -> float:
  """Bytes per token that `"selection_replay"` saves of the indexer loss's forward-pass gradient (0 without it).

  The gradients w.r.t. the indexer's queries and weights, and w.r.t. its keys: one whole-length key
  gradient per MLA query chunk (each chunk's loss reaches every key), so that term grows as T^2 / chunk.
  A whole layer over chunks (`ModelConfig.layer_chunk`) saves one key gradient and its weights' gradients.
  """
  if not cfg.indexer_loss_grad_in_forward:
    return 0.0
  a = jnp.dtype(cfg.dtype).itemsize
  if _chunk_at(cfg.layer_chunk, seq_len):  # summed over the chunks, the query side pulled back to weights
    return cfg.index_head_dim * a
  chunk = _chunk_at(cfg.query_chunk, seq_len)
  key_grads = seq_len // chunk if chunk else 1
  return (cfg.index_n_heads * (cfg.index_head_dim + 1) + key_grads * cfg.index_head_dim) * a


def _deterministic_slabs(cfg: ModelConfig, rows: float, key_width: int) -> float:
  """The f32 slabs of `model.sparse_attention_deterministic`'s backward: every selected entry's gradient
  row (the family's keys per query, `_attention_dims`) per head block (the backward kernel's `block_h`
  for this family's heads per key group), over query chunks capped at the kernel's `Config.chunk_bytes`
  (docs/kernels/sparse_attention.md compares its measured temporaries with the atomic backward's)."""
  if not cfg.sparse_attention_deterministic:
    return 0.0
  from pallas_kernels.sparse_attention import Config  # noqa: PLC0415 - its default budget is the cap

  heads_per_group = cfg.n_heads // cfg.n_kv_heads if cfg.architecture == "qwen4_exp" else cfg.n_heads
  selected, out_width, _ = _attention_dims(cfg)  # V4: window + top-k; QSA: its blocks' tokens
  block_h = Config.backward_heuristics(key_width, out_width, jnp.dtype(cfg.dtype).itemsize, heads_per_group,
                                       value_from_key=cfg.architecture != "qwen4_exp").block_h
  head_blocks = max(1, math.ceil(heads_per_group / block_h))  # QSA: key_width already spans its groups
  return min(float(Config().chunk_bytes), rows * selected * key_width * 4 * head_blocks)


def _selection_working_bytes(cfg: ModelConfig, batch: float, rows: float, seq_len: int) -> float:
  """FlashTopK's main-pass buffers for one query chunk (0 without an indexer layer), as the Pallas
  backend sizes them (`ops.flash_topk.pallas.working_bytes`: under `Config.chunk_bytes`, or
  `Config.mosaic_chunk_bytes` where "auto" scores on Mosaic GPU, Hopper from 32K indexed keys).
  `batch` rows of `rows / batch` queries on this device select over all `seq_len` positions' keys
  (gathered under context parallelism): V4's CSA entries, QSA's blocks, every token for DSA."""
  if not any(_has_indexer(c, i) for c, i in _blocks(cfg)):
    return 0.0
  from hyscale_jax.ops.flash_topk.pallas import working_bytes  # noqa: PLC0415 - the kernels' own sizing

  per_key = {"deepseek_v4": cfg.csa_ratio, "qwen4_exp": cfg.qsa_block}.get(cfg.architecture, 1)
  b = max(1, math.ceil(batch))
  return float(working_bytes(b, max(1, math.ceil(rows / b)), max(1, seq_len // per_key), cfg.index_n_heads,
                             cfg.index_head_dim, cfg.dtype, cfg.index_topk))


def grouped_matmul_kernel_applies(cfg: ModelConfig) -> bool:
  """Whether `ops.grouped_matmul` runs its Hopper kernel here ("auto" on an sm_90 GPU, bf16/f16), not ragged_dot."""
  from pallas_kernels._hopper import on_hopper  # noqa: PLC0415 - the estimate itself needs no kernel package

  return jnp.dtype(cfg.dtype).itemsize == 2 and on_hopper()


def moe_expert_bytes(cfg: ModelConfig, layer: int, rows: float, *, grouped_kernel: bool) -> float:
  """Bytes of one MoE layer's routed experts in its backward, for one token chunk (0 for a dense layer).

  `rows` tokens on this device, `model.moe_token_chunk` of them at a time, dispatch R = tokens *
  experts_per_token copies. With the grouped kernel (`grouped_kernel`): the dispatched rows, the
  expert outputs and the f32 combine [R, D], the gate/up/hidden activations and their f32 gradients
  [R, F], `MOE_GROUPED_COPIES` times. Otherwise `jax.lax.ragged_dot`'s dense expansion: one step
  holds about an f32 [E, R, D] and [E, R, F] plus the forward's [E, R, D] in the activation dtype,
  E times what the grouped kernel needs. E is all of n_routed_experts: exact without an `expert`
  mesh axis; with one, each device holds E / expert experts and this is an upper bound.
  """
  if not cfg.is_moe(layer):
    return 0.0
  a = jnp.dtype(cfg.dtype).itemsize
  tokens = min(rows, cfg.moe_token_chunk) if cfg.moe_token_chunk else rows
  R = tokens * cfg.experts_per_token
  if grouped_kernel:
    return MOE_GROUPED_COPIES * R * (cfg.d_model * (2 * a + 4) + cfg.moe_inter * (4 * a + 4))
  return cfg.n_routed_experts * R * (cfg.d_model * (4 * MOE_EXPANSION_F32_COPIES + a)
                                     + cfg.moe_inter * 4 * MOE_EXPANSION_F32_COPIES)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device, by component."""

  components: dict

  @property
  def total(self) -> int:
    return int(sum(self.components.values()))

  def describe(self) -> str:
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(self.components.items(), key=lambda kv: -kv[1]))
    return f"{self.total / 2**30:.2f} GiB ({parts} GiB)"


def estimate_training_memory(cfg: ModelConfig, *, batch_size: int, seq_len: int, data_shards: int = 1,
                             context_shards: int = 1, param_shards: int = 1,
                             param_count: int | None = None, grouped_kernel: bool | None = None) -> MemoryEstimate:
  """Estimated bytes per device of one training step (see the module docstring).

  Args:
    cfg: the model.
    batch_size, seq_len: the global batch.
    data_shards, context_shards: how the batch and the sequence are split over devices.
    param_shards: how many devices share each parameter (1 = replicated).
    param_count: total parameters, if already known (else counted on abstract shapes).
    grouped_kernel: whether the MoE's grouped matmuls run the Hopper kernel (None: as they would here,
      `grouped_matmul_kernel_applies`) or `ragged_dot`'s dense expansion.
  """
  if grouped_kernel is None:
    grouped_kernel = grouped_matmul_kernel_applies(cfg)
  if param_count is None:
    from hyscale_jax import models  # noqa: PLC0415 (models imports the layers; keep this module light)
    param_count = models.count_params(cfg)[0]
  p_bytes, a_bytes = jnp.dtype(cfg.param_dtype).itemsize, jnp.dtype(cfg.dtype).itemsize
  rows = batch_size / data_shards * seq_len / context_shards  # tokens on this device
  _, out_width, key_width = _attention_dims(cfg)
  # Positions per row of one LM-loss chunk: each device chunks its own T / context positions.
  chunk_rows = chunk_layout(math.ceil(seq_len / context_shards), cfg.lm_loss_chunk)[1]
  blocks = _blocks(cfg)  # the MTP depths' blocks count as layers
  per_layer = [_layer_bytes_per_token(c, i) for c, i in blocks]
  if cfg.remat_policy == "none":
    saved = sum(b.total for b in per_layer)
  elif cfg.remat_policy == "selection_replay":
    attention = cfg.n_heads * (out_width * a_bytes + 4) if cfg.saves_attention(seq_len) else 0  # out, lse
    saved = sum(_attention_parts(c, i) * attention + (cfg.index_topk * 4 + _indexer_grads(cfg, seq_len)
                                                       if _has_indexer(c, i) else 0)
                for c, i in blocks)
  else:
    saved = 0
  components = {
      "parameters": param_count * p_bytes / param_shards,
      "gradients": param_count * p_bytes / param_shards,
      "optimizer": 2 * param_count * p_bytes / param_shards,
      # With hyper-connections each layer's saved input is its hc_mult residual streams.
      "layer inputs": len(blocks) * rows * cfg.d_model * max(cfg.hc_mult, 1) * a_bytes,
      "saved selection and attention": rows * saved,
      "logits": (LOGITS_COPIES * batch_size / data_shards * chunk_rows * cfg.vocab_size * 4
                 + (4 - p_bytes) * cfg.d_model * cfg.vocab_size),
      "one layer's transients": max(batch_size / data_shards * seq_len * key_width * a_bytes,
                                    LAYER_TRANSIENT_COPIES[cfg.remat_policy]
                                    * max(b.rows_bytes(cfg, rows, seq_len) for b in per_layer)),
      "chunked layer's full-length arrays": (_full_length_copies(cfg, seq_len) * rows * cfg.d_model * a_bytes),
      # One MoE layer's backward at a time; every remat policy runs it.
      "MoE routed experts": max(moe_expert_bytes(c, i, rows, grouped_kernel=grouped_kernel) for c, i in blocks),
      "deterministic attention slabs": _deterministic_slabs(cfg, rows, key_width),
      "selection working memory": _selection_working_bytes(cfg, batch_size / data_shards, rows, seq_len),
      "runtime reserve": RUNTIME_RESERVE_BYTES,
  }
  return MemoryEstimate({k: int(v) for k, v in components.items()})


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
  """What one device can hold: the allocator's limit on an accelerator, physical RAM on a CPU."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  try:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(jax.local_device_count(), 1)
  except (ValueError, OSError, AttributeError):
    return None


def device_peak_metrics(device: jax.Device | None = None) -> dict:
  """{"device_peak_gb": the allocator's peak so far} on an accelerator; {} where it keeps no statistics."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "peak_bytes_in_use" not in stats:
    return {}
  return {"device_peak_gb": stats["peak_bytes_in_use"] / 1e9}


# The smallest sequence chunk the preflight proposes: below it the per-chunk loops cost more than
# they save (docs/results.md: 16K chunks fit GLM-5.1's 2-layer model at 1M tokens on one GPU).
MIN_SUGGESTED_SEQUENCE_CHUNK = 4096


def _sequence_chunk_knob(cfg: ModelConfig, seq_len: int, fits, estimate) -> str | None:
  """The largest power-of-two sequence chunk below the current one whose estimate fits, as a knob.

  MLA layers (GLM-5.1 / DSA) take equal query and FFN chunks, which runs each layer whole over the
  chunks (`ModelConfig.layer_chunk`); other families chunk their FFN sub-block (`ffn_token_chunk`).
  """
  mla = cfg.architecture == "glm_moe_dsa"
  current = _chunk_at(cfg.layer_chunk if mla else cfg.ffn_chunk, seq_len) or seq_len
  chunk = 1 << ((current - 1).bit_length() - 1)  # the largest power of two below it
  while chunk >= MIN_SUGGESTED_SEQUENCE_CHUNK:
    if seq_len % chunk == 0:
      fields = dict(attention_query_chunk=chunk, ffn_token_chunk=chunk) if mla else dict(ffn_token_chunk=chunk)
      e = estimate(dataclasses.replace(cfg, **fields))
      if fits(e):
        flags = " ".join(f"--config.model.{name}={value}" for name, value in fields.items())
        return f"{flags} (the {'layers' if mla else 'FFN sub-blocks'} over {chunk}-token chunks): {e.total / 2**30:.2f} GiB"
    chunk //= 2
  return None


def preflight(cfg: ModelConfig, *, batch_size: int, seq_len: int, mesh_shape: dict, available: int | None,
              headroom: float = 1.0) -> MemoryEstimate:
  """The step's per-device memory estimate; raises MemoryError, before compiling, when it clearly exceeds
  `available` bytes.

  Clearly: even at the lowest measured peak / estimate ratio (`MEASURED_OVER_ESTIMATE`) it would not fit.
  An estimate over `available` but within that error logs a warning and runs. The message gives the
  estimate by component and the knobs that would fit: `remat_policy=full`, smaller sequence chunks
  (`_sequence_chunk_knob`), a larger `mesh.context` (for the devices it would take), or a shorter
  `data.seq_len`.
  """
  from hyscale_jax import models  # noqa: PLC0415

  count = models.count_params(cfg)[0]
  # The batch is split over BATCH_AXES (data x fsdp x expert); parameters at least over fsdp x tensor (the
  # default rules; experts also over expert, which this lower bound leaves out).
  split = dict(data_shards=math.prod(mesh_shape.get(axis, 1) for axis in BATCH_AXES),
               context_shards=mesh_shape.get("context", 1), param_count=count,
               param_shards=mesh_shape.get("fsdp", 1) * mesh_shape.get("tensor", 1))
  # The estimate of `cfg` (or a knob's variant of it) with some of this step's shapes replaced.
  estimate_of = lambda c=cfg, **changes: estimate_training_memory(  # noqa: E731
      c, **{"batch_size": batch_size, "seq_len": seq_len, **split, **changes})
  estimate = estimate_of()
  if available is None or estimate.total <= headroom * available:
    return estimate
  low, _ = MEASURED_OVER_ESTIMATE
  if low * estimate.total <= headroom * available:
    logging.warning(
        "memory preflight: this step needs about %s per device, over the %.2f GiB available but within the "
        "estimate's measured error (peaks have come in at %.0f%% of it): running. If it runs out of memory, "
        "--config.model.remat_policy=full, a larger --config.mesh.context or a shorter --config.data.seq_len "
        "lower it.",
        estimate.describe(), available / 2**30, 100 * low)
    return estimate
  fits = lambda e: e.total <= headroom * available
  knobs = []
  if cfg.remat_policy != "full":
    full = estimate_of(dataclasses.replace(cfg, remat_policy="full"))
    knobs.append(f"--config.model.remat_policy=full: {full.total / 2**30:.2f} GiB" + ("" if fits(full) else " (still too much)"))
  chunked = _sequence_chunk_knob(cfg, seq_len, fits, estimate_of)
  if chunked:
    knobs.append(chunked)
  for context in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
    if context <= split["context_shards"] or seq_len % context:
      continue
    e = estimate_of(context_shards=context)
    if fits(e):
      knobs.append(f"--config.mesh.context={context} ({context} devices per sequence): {e.total / 2**30:.2f} GiB")
      break
  shorter = seq_len // 2
  while shorter >= 1:
    e = estimate_of(seq_len=shorter)
    if fits(e):
      knobs.append(f"--config.data.seq_len={shorter}: {e.total / 2**30:.2f} GiB")
      break
    shorter //= 2
  weights = estimate.components["parameters"] + estimate.components["gradients"] + estimate.components["optimizer"]
  if weights > headroom * available:
    knobs.append(f"the parameters, gradients and AdamW state alone take {weights / 2**30:.2f} GiB per device: "
                 "they need sharding over more devices (a larger --config.mesh.fsdp) or a smaller model")
  raise MemoryError(
      f"memory preflight: this step needs about {estimate.describe()} per device, more than the "
      f"{available / 2**30:.2f} GiB available. Knobs: " + "; ".join(knobs) + ". "
      "Set --config.train.memory_preflight=false to try anyway.")


__all__ = ["LAYER_TRANSIENT_COPIES", "WHOLE_LAYER_CHUNKS_FULL_LENGTH_COPIES", "LOGITS_COPIES", "MOE_EXPANSION_F32_COPIES", "MemoryEstimate",
           "MIN_SUGGESTED_SEQUENCE_CHUNK", "MOE_GROUPED_COPIES", "RUNTIME_RESERVE_BYTES", "grouped_matmul_kernel_applies", "moe_expert_bytes", "device_memory_bytes", "device_peak_metrics", "estimate_training_memory", "preflight"]
