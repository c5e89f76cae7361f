"""Model FLOPs of one training step, by part: the one place the numerator of MFU is counted.

    MFU = step_flops(cfg, batch_size=B, seq_len=T, dense=stage).total / step_time_s / n_devices
          / (peak_tflops(jax.devices()[0].device_kind) * 1e12)

with B the global batch (the sequences of one optimizer step over all devices) and `dense` the stage
of that step (the warm-up is dense). Model FLOPs are the math the step needs, as PaLM's MFU counts
it: 2 * M * N * K per matmul, the attention core over exactly the keys each query attends (causal:
query p at 0-based position p sees p + 1 tokens; in the sparse stage its selection), and nothing an
implementation adds: no rematerialization, no recomputed indexer-KL teacher (its probabilities are
the attention's own, already counted), no padded selection slots, no element-wise work (norms,
softmax, RoPE, gates, the router's top-k, compressor pooling, residual-stream mixes by per-token
weights). Packed-document boundaries are ignored: model FLOPs do not depend on the batch's contents.

A part's forward becomes the step's by these factors:
  - trained matmuls (the sparse stage's main model, LM head, MTP): forward + two backward matmuls, 3x;
  - the attention core: the backward is 2.5x the forward (FlashAttention's count: five matmuls,
    the logits recomputed, dV, dP, dQ and dK, against the forward's two), 3.5x in all;
  - Gated DeltaNet's recurrence: the backward counted as twice the forward, 3x;
  - the indexer's projections read detached inputs, so their backward is the weight gradient
    alone: 2x (1x where the indexer is frozen);
  - the indexer's top-k scoring has no gradient, 1x; its KL has one, 3x;
  - the dense warm-up trains only the indexer (objective: the indexer KL; the indexer's inputs and
    the teacher detached), so every other part counts its forward alone, 1x.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from hyscale_jax.model_config import ModelConfig

_MATMUL_STEP = 3.0  # forward, d(input), d(weight)
_ATTENTION_STEP = 3.5  # forward 2 matmuls; backward 5 (logits recomputed, dV, dP, dQ, dK)
_INDEXER_PROJECTION_STEP = 2.0  # detached inputs: forward and d(weight) only
_KL_STEP = 3.0  # the index scores and their gradient w.r.t. the indexer's queries and keys

# Dense (no-sparsity) bf16 tensor-core peaks in TFLOP/s per device, from the vendors' datasheets
# (NVIDIA quotes twice these "with sparsity"), keyed by a substring of `device_kind`; the longest
# matching key wins ("H100 PCIe" over "H100", "GH200" over "H200").
PEAK_TFLOPS: dict[str, float] = {
    "A100": 312.0,
    "H100": 989.4,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.5,
    "H800": 989.4,
    "H200": 989.4,
    "GH200": 989.4,
    "B100": 1750.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5": 459.0,  # v5p
    "TPU v6 lite": 918.0,  # v6e (Trillium)
}


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """Model FLOPs of one training step, by part (forward + backward), for batch_size x seq_len tokens."""

  attention: float  # the attention core (sparse over the selection, or dense causal in the warm-up)
  indexer: float  # the indexer's causal scoring (+ its KL terms)
  projections: float  # every dense projection: attention, indexer, MLPs, shared experts, router, compressors...
  experts: float  # routed experts' active FLOPs (experts_per_token of n_routed_experts)
  lm_head: float

  @property
  def total(self) -> float:
    return self.attention + self.indexer + self.projections + self.experts + self.lm_head


class _Term(NamedTuple):
  part: str  # a StepFlops field
  forward: float  # forward FLOPs of one sequence
  step: float  # its FLOPs in the whole step / its forward FLOPs (the stage's factor)


def step_flops(cfg: ModelConfig, *, batch_size: int, seq_len: int, dense: bool) -> StepFlops:
  """Model FLOPs of one training step of `batch_size` sequences of `seq_len` tokens, by part.

  Args:
    cfg: the model config (only read; nothing is built).
    batch_size: sequences per step, all devices together.
    seq_len: T, tokens per sequence.
    dense: the dense warm-up stage (dense attention, only the indexer trains) instead of the
      sparse stage.

  Returns:
    StepFlops (floats), forward and backward; see the module docstring for what counts.

  Raises:
    ValueError: a non-positive `batch_size` or `seq_len`, or an unknown architecture.
  """
  return _by_part(cfg, batch_size, seq_len, dense, lambda term: term.forward * term.step)


def forward_flops(cfg: ModelConfig, *, batch_size: int, seq_len: int, dense: bool) -> StepFlops:
  """The forward pass alone of `step_flops`' count (what its factors multiply); arguments as there."""
  return _by_part(cfg, batch_size, seq_len, dense, lambda term: term.forward)


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
  """The bf16 peak of one device of `device_kind` (jax.devices()[0].device_kind), in TFLOP/s.

  `override` when > 0, None when unknown (CPU): MFU is then not reported.
  """
  if override > 0:
    return float(override)
  kind = device_kind.lower()
  matches = [key for key in PEAK_TFLOPS if key.lower() in kind]
  return PEAK_TFLOPS[max(matches, key=len)] if matches else None


def _by_part(cfg, batch_size, seq_len, dense, value) -> StepFlops:
  for name, n in (("batch_size", batch_size), ("seq_len", seq_len)):
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
      raise ValueError(f"{name}={n!r} must be a positive int.")
  totals = {field.name: 0.0 for field in dataclasses.fields(StepFlops)}
  for term in _terms(cfg, int(seq_len), bool(dense)):
    totals[term.part] += float(batch_size) * float(value(term))
  return StepFlops(**totals)


def _terms(cfg: ModelConfig, T: int, dense: bool) -> list[_Term]:
  """Every counted term of one sequence: the layers, the final collapse, the LM head, the MTP depths."""
  if cfg.architecture not in ("glm_moe_dsa", "deepseek_v4", "qwen4_exp"):
    raise ValueError(f"model.architecture={cfg.architecture!r} has no FLOP count.")
  terms = []
  for layer in range(cfg.n_layers):
    terms += _layer(cfg, layer, T, dense)
    terms += _matmuls(T, dense, _engram_weights(cfg, layer))
  terms += _matmuls(T, dense, _stream_head_weights(cfg))
  terms += _lm_head(cfg, T, dense)
  for depth in range(cfg.mtp_depth):
    terms += _mtp_depth(cfg, depth, T, dense)
  return terms


def _matmuls(T: int, dense: bool, weights: float, part: str = "projections") -> list[_Term]:
  """`weights` of main-model matmuls that each of T tokens goes through: 2 FLOPs per weight."""
  return [_Term(part, 2.0 * weights * T, 1.0 if dense else _MATMUL_STEP)] if weights else []


def _core(dense: bool, forward: float, step: float = _ATTENTION_STEP) -> list[_Term]:
  """A main-model attention core (or recurrence) of `forward` FLOPs: trained in the sparse stage only."""
  return [_Term("attention", forward, 1.0 if dense else step)]


def _layer(cfg: ModelConfig, layer: int, T: int, dense: bool) -> list[_Term]:
  """Decoder layer `layer` (an MTP depth's block when >= n_layers): mixer, FFN, residual streams."""
  return (_mixer(cfg, layer, T, dense) + _ffn(cfg, layer, T, dense)
          + _matmuls(T, dense, 2 * _connection_weights(cfg)))


def _mixer(cfg: ModelConfig, layer: int, T: int, dense: bool) -> list[_Term]:
  """Layer `layer`'s token mixer, as the models build it (an MTP depth's for layer >= n_layers)."""
  mtp = layer >= cfg.n_layers
  if cfg.architecture == "glm_moe_dsa":  # models/glm5.py: an MTP block selects for itself
    return _mla(cfg, T, dense, has_indexer=mtp or cfg.has_indexer(layer))
  if cfg.architecture == "deepseek_v4":  # models/deepseek_v4.py: an MTP block is a sliding-window layer
    kind, ratio = ("swa", 0) if mtp else (cfg.layer_kind(layer), cfg.compress_ratios[layer])
    return _compressed(cfg, T, dense, kind, ratio)
  if mtp or cfg.layer_types[layer] == "qsa":  # models/qwen_next.py: an MTP block is a QSA layer
    return _qsa(cfg, T, dense)
  return _gated_deltanet(cfg, T, dense)


# Keys per query. Each returns i64[T], the count for the query at 0-based position p, summed by the caller.

def _visible(T: int) -> np.ndarray:
  """p + 1: the causal keys of query p."""
  return np.arange(1, T + 1, dtype=np.int64)


def _entries(T: int, ratio: int) -> np.ndarray:
  """floor((p + 1) / ratio): the compressed entries (or whole blocks) w with (w + 1) * ratio <= p + 1."""
  return _visible(T) // ratio


def _indexer(dense: bool, *, weights: float, T: int, per_pair: float, visible: np.ndarray, topk: int,
             trains: bool = True) -> list[_Term]:
  """A lightning indexer: its projections (`weights` per token), the sparse stage's top-k scoring over
  every `visible` (query, key) pair, and its KL over the top-k pairs (sparse) or every visible pair
  (dense), `per_pair` FLOPs each. A frozen indexer (`trains` False) only selects."""
  if dense and not trains:  # dense attention needs no selection
    return []
  terms = [_Term("projections", 2.0 * weights * T, _INDEXER_PROJECTION_STEP if trains else 1.0)]
  if not dense:
    terms.append(_Term("indexer", per_pair * visible.sum(), 1.0))
  if trains:
    pairs = visible if dense else np.minimum(visible, topk)
    terms.append(_Term("indexer", per_pair * pairs.sum(), _KL_STEP))
  return terms


def _mla(cfg: ModelConfig, T: int, dense: bool, *, has_indexer: bool) -> list[_Term]:
  """GLM-5 / DeepSeek-V3.2 MLA with the DSA indexer (layers/mla.py, layers/indexer.py).

  Projections per token: q_a, q_b, kv_a, o_proj, and kv_b's L x H (nope + v) weights once -- as
  kv_b_proj in the warm-up's non-absorbed form, as the absorption einsums q_nope @ W_UK and
  out @ W_UV (its two halves) in the sparse stage. Core: the sparse stage's absorbed MQA form over
  min(p + 1, k) keys, 2 H ((L + R) + L) per key; the warm-up's non-absorbed form over p + 1 keys,
  2 H ((nope + R) + v) per key. Indexer (layers that own one): wq_b, wk, weights_proj (and the
  Hadamard rotation of q and k when on), 2 H_I D_I per scored pair (one merged head when the score
  is linear, `indexer_scoring_relu` False).
  """
  D, H, L, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
  nope, v = cfg.qk_nope_dim, cfg.v_head_dim
  weights = D * cfg.q_lora_rank + cfg.q_lora_rank * H * (nope + R) + D * (L + R) + L * H * (nope + v) + H * v * D
  terms = _matmuls(T, dense, weights)
  if dense:
    terms += _core(dense, 2.0 * H * (nope + R + v) * _visible(T).sum())
  else:
    terms += _core(dense, 2.0 * H * (L + R + L) * np.minimum(_visible(T), cfg.index_topk).sum())
  if has_indexer:
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    index_weights = cfg.q_lora_rank * HI * DI + D * DI + D * HI
    if cfg.indexer_hadamard:  # q [HI, DI] and k [DI] times the [DI, DI] rotation
      index_weights += (HI + 1) * DI * DI
    scoring_heads = HI if cfg.indexer_scoring_relu else 1
    terms += _indexer(dense, weights=index_weights, T=T, per_pair=2.0 * scoring_heads * DI, visible=_visible(T),
                      topk=cfg.index_topk)
  return terms


def _compressed(cfg: ModelConfig, T: int, dense: bool, kind: str, ratio: int) -> list[_Term]:
  """A DeepSeek-V4 layer of kind "swa", "csa" or "hca" (layers/compressed_attention.py, compressor.py).

  Projections per token: wq_a, wq_b, wkv, the grouped wo_a (H hd x o_lora in all) and wo_b; the
  compressor's wkv and wgate (2 hd wide each with CSA's overlap, hd without). Core: one shared K = V
  head of hd, 2 H (hd + hd) per key, over the window min(p + 1, W) plus, for CSA in the sparse
  stage, the top-k of the floor((p + 1) / m) visible entries, for HCA (and CSA's warm-up) all of them.
  CSA's indexer: wq_b, weights_proj, its own overlapping compressor (2 x 2 D_I wide), the Hadamard
  rotation when on; 2 H_I D_I per (query, visible entry) pair.
  """
  D, H, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
  weights = D * cfg.q_lora_rank + cfg.q_lora_rank * H * hd + D * hd + H * hd * cfg.o_lora_rank
  weights += cfg.o_groups * cfg.o_lora_rank * D
  keys = np.minimum(_visible(T), cfg.sliding_window)
  if kind != "swa":
    weights += 2 * D * (2 * hd if kind == "csa" else hd)
    entries = _entries(T, ratio)
    keys = keys + (np.minimum(entries, cfg.index_topk) if kind == "csa" and not dense else entries)
  terms = _matmuls(T, dense, weights) + _core(dense, 2.0 * H * (hd + hd) * keys.sum())
  if kind == "csa":
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    index_weights = cfg.q_lora_rank * HI * DI + D * HI + 2 * D * 2 * DI
    if cfg.indexer_hadamard:  # per token q [HI, DI]; per entry k [DI], one entry every `ratio` tokens
      index_weights += HI * DI * DI + DI * DI / ratio
    terms += _indexer(dense, weights=index_weights, T=T, per_pair=2.0 * HI * DI, visible=_entries(T, ratio),
                      topk=cfg.index_topk)
  return terms


def _qsa(cfg: ModelConfig, T: int, dense: bool) -> list[_Term]:
  """A Qwen3.8-Flash-Next QSA layer: gated GQA over the selected blocks (layers/qsa.py).

  Projections per token: q_proj (query and gate, 2 H hd), k_proj, v_proj (G hd each), o_proj.
  Core: 2 H (hd + hd) per attended token; the sparse stage attends the top-k of the
  floor((p + 1) / m) complete blocks, m tokens each, plus the (p + 1) mod m tail; the warm-up
  p + 1 tokens. Indexer: index_qk_proj ((H_I + 1) D_I wide), 2 H_I D_I per (query, visible block)
  pair (weight-free: no head weights); its KL unless `indexer_frozen`.
  """
  D, H, G, hd, m = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.qsa_block
  weights = D * 2 * H * hd + 2 * D * G * hd + H * hd * D
  blocks = _entries(T, m)
  keys = _visible(T) if dense else np.minimum(blocks, cfg.index_topk) * m + _visible(T) % m
  HI, DI = cfg.index_n_heads, cfg.index_head_dim
  return (_matmuls(T, dense, weights) + _core(dense, 2.0 * H * (hd + hd) * keys.sum())
          + _indexer(dense, weights=D * (HI + 1) * DI, T=T, per_pair=2.0 * HI * DI, visible=blocks,
                     topk=cfg.index_topk, trains=not cfg.indexer_frozen))


def _gated_deltanet(cfg: ModelConfig, T: int, dense: bool) -> list[_Term]:
  """A Gated DeltaNet layer (layers/gated_deltanet.py, ops/gated_delta_rule).

  Projections per token: in_proj_qkv (2 Hk Dk + Hv Dv wide), in_proj_z (Hv Dv), in_proj_b and
  in_proj_a (Hv each), out_proj, and the depthwise conv (kernel x channels weights, 2 FLOPs each).
  Recurrence, the chunked (WY/UT) form with chunks of C = min(linear_chunk, T), per token and value
  head: within the chunk k k^T and q k^T (2 C Dk each), the triangular solve (C (Dk + Dv)), the
  scores times u (2 C Dv); against the state u -= w S, q S and the state update k^T u (2 Dk Dv each):
  C (5 Dk + 3 Dv) + 6 Dk Dv, with the backward counted as twice the forward (bench/gated_delta_rule.py).
  """
  D, Hk, Hv = cfg.d_model, cfg.linear_n_key_heads, cfg.linear_n_value_heads
  Dk, Dv, C = cfg.linear_key_dim, cfg.linear_value_dim, min(cfg.linear_chunk, T)
  channels = 2 * Hk * Dk + Hv * Dv
  weights = D * channels + D * Hv * Dv + 2 * D * Hv + Hv * Dv * D + cfg.linear_conv_kernel * channels
  recurrence = T * Hv * (C * (5 * Dk + 3 * Dv) + 6 * Dk * Dv)
  return _matmuls(T, dense, weights) + _core(dense, float(recurrence), _MATMUL_STEP)


def _ffn(cfg: ModelConfig, layer: int, T: int, dense: bool) -> list[_Term]:
  """The dense SwiGLU MLP (3 D F), or the MoE: router (D E), shared experts (3 D F n_shared), Qwen's
  shared-expert gate (D), and `experts_per_token` routed experts (3 D F each, under `experts`)."""
  D = cfg.d_model
  if not cfg.is_moe(layer):
    return _matmuls(T, dense, 3 * D * cfg.dense_inter)
  shared = D * cfg.n_routed_experts + 3 * D * cfg.moe_inter * cfg.n_shared_experts
  shared += D if cfg.shared_expert_gate and cfg.n_shared_experts else 0
  return (_matmuls(T, dense, shared)
          + _matmuls(T, dense, 3 * D * cfg.moe_inter * cfg.experts_per_token, part="experts"))


def _connection_weights(cfg: ModelConfig) -> int:
  """Weights of one sub-block's residual-stream connection (layers/hyper_connections.py; 0 without).

  DeepSeek-V4's mHC: `fn` [(2 + N) N, N D]. Qwen's gated residual: the low-rank gate (N D x r, r x N D)
  and `block_inject_weight` (N D x N). The per-token mixes of the streams are element-wise here.
  """
  N, D = cfg.hc_mult, cfg.d_model
  if not N:
    return 0
  if cfg.architecture == "deepseek_v4":
    return (2 + N) * N * N * D
  return 2 * N * D * cfg.hc_lowrank + N * D * N


def _stream_head_weights(cfg: ModelConfig) -> int:
  """Weights of the final collapse of the streams: mHC's `hc_fn` [N, N D], or a gated residual's low-rank gate."""
  N, D = cfg.hc_mult, cfg.d_model
  if not N:
    return 0
  return N * N * D if cfg.architecture == "deepseek_v4" else 2 * N * D * cfg.hc_lowrank


def _engram_weights(cfg: ModelConfig, layer: int) -> int:
  """Layer `layer`'s Engram (layers/engram.py; 0 where none): key_proj (E x N D), value_proj (E x D), and
  the depthwise conv (kernel x N D). The n-gram rows are gathered, not multiplied."""
  if layer + 1 not in cfg.ple_layer_ids:
    return 0
  N, D, E = cfg.hc_mult, cfg.d_model, cfg.ple_embed_dim
  return E * N * D + E * D + cfg.ple_conv_kernel * N * D


def _lm_head(cfg: ModelConfig, T: int, dense: bool) -> list[_Term]:
  """One LM head pass: D x V per token (tied or not)."""
  return _matmuls(T, dense, cfg.d_model * cfg.vocab_size, part="lm_head")


def _mtp_depth(cfg: ModelConfig, depth: int, T: int, dense: bool) -> list[_Term]:
  """MTP depth `depth` (models/mtp.py): eh_proj (2 D x D; on each of the N streams where DeepSeek-V4
  hands them over), its decoder block (layer n_layers + depth), its stream collapse and its LM head pass."""
  streams = cfg.hc_mult if cfg.architecture == "deepseek_v4" and cfg.hc_mult else 1
  return (_matmuls(T, dense, streams * 2 * cfg.d_model * cfg.d_model) + _layer(cfg, cfg.n_layers + depth, T, dense)
          + _matmuls(T, dense, _stream_head_weights(cfg)) + _lm_head(cfg, T, dense))
