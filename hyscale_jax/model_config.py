"""The frozen, validated model config that layers and models see (never a ConfigDict)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hyscale_jax import remat

_DTYPES = ("float32", "bfloat16")


# Fields that choose how a model runs (numerics, memory and speed knobs: same math), not what a
# checkpoint holds; a checkpoint's config is compared with a run's on every other field.
EXECUTION_FIELDS: frozenset[str] = frozenset({
    "dtype", "param_dtype", "remat_policy", "indexer_loss_grad_in_forward", "attention_query_chunk",
    "ffn_token_chunk", "moe_token_chunk", "lm_loss_chunk", "scan_layers", "linear_chunk",
    "sparse_attention_deterministic"})
# Where a config came from, not what it computes: the Hugging Face config.json it was imported from
# (export writes it back, with the fields we own updated). Never compared between configs.
PROVENANCE_FIELDS: frozenset[str] = frozenset({"hf_config"})


def index_share_full_layer(layer: int, freq: int, offset: int) -> bool:
  """IndexShare (GLM-5.2): layer i runs its own indexer iff max(i - offset + 1, 0) % freq == 0 (and layer 0)."""
  return max(layer - offset + 1, 0) % freq == 0 or layer == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A GLM-5 / DeepSeek-V3.2-style MLA + DSA + MoE decoder. Field names follow HF `GlmMoeDsaConfig`."""

  architecture: str = "glm_moe_dsa"
  vocab_size: int = 154880
  d_model: int = 6144
  n_layers: int = 78
  # The first layers use a dense FFN of width `dense_inter`; the rest are MoE.
  first_k_dense: int = 3
  dense_inter: int = 12288
  rms_eps: float = 1e-5
  rope_theta: float = 1e6
  # YaRN scaling (layers/rope.py `YaRN`, transformers' `rope_type: "yarn"` fields) of the long-range
  # RoPE: GLM-5 / V3.2's MLA and indexer rope, DeepSeek-V4's compressed layers (`compress_rope_theta`;
  # SWA layers never scale). rope_yarn_factor 0 disables it; attention_factor 0 derives it from mscale.
  rope_yarn_factor: float = 0.0
  rope_yarn_original_max_len: int = 0
  rope_yarn_beta_fast: float = 32.0
  rope_yarn_beta_slow: float = 1.0
  rope_yarn_mscale: float = 0.0
  rope_yarn_mscale_all_dim: float = 0.0
  rope_yarn_attention_factor: float = 0.0
  rope_yarn_truncate: bool = True
  tie_embeddings: bool = False
  # MLA.
  n_heads: int = 64
  q_lora_rank: int = 2048
  kv_lora_rank: int = 512
  # eps of MLA's latent norms (q_a_layernorm, kv_a_layernorm): 1e-6 in DeepSeek's reference and
  # transformers, whatever rms_eps the block norms use.
  latent_norm_eps: float = 1e-6
  qk_nope_dim: int = 192
  qk_rope_dim: int = 64
  v_head_dim: int = 256
  # MoE.
  n_routed_experts: int = 256
  experts_per_token: int = 8
  n_shared_experts: int = 1
  moe_inter: int = 2048
  routed_scaling: float = 2.5
  # DeepSeek-V4's hash routing: the first `n_hash_layers` MoE layers choose experts by a fixed token
  # table (`tid2eid` [vocab, k], layers/moe.py) instead of by score; their combine weights still
  # come from the router's scores.
  n_hash_layers: int = 0
  scoring: str = "sigmoid"
  norm_topk_prob: bool = True
  n_group: int = 1
  topk_group: int = 1
  # Tokens per chunk of the routed experts (layers/moe.py): dispatched rows and expert activations exist
  # for one chunk at a time, each chunk rematerialized in the backward pass; 0 runs all tokens at once.
  moe_token_chunk: int = 0
  # The FFN sub-block (its norm, the dense MLP or the whole MoE, the residual add) over this many
  # sequence positions at a time when T is longer (T must then be a multiple; 0: all at once). Each
  # chunk is rematerialized, so its [B, chunk, F] activations (dense FFN: 3 x 12288 wide at GLM-5.1)
  # and their gradients exist one chunk at a time; the cost is one more forward of the block.
  ffn_token_chunk: int = 0
  # SwiGLU clamp (DeepSeek-V4): gate <= limit, |up| <= limit before silu(gate) * up; 0 disables it.
  swiglu_limit: float = 0.0
  # Residual streams (layers/hyper_connections.py): `hc_mult` parallel residual streams, 0 for a
  # plain residual. The architecture picks the kind: DeepSeek-V4's mHC (Sinkhorn mixing,
  # `hc_sinkhorn_iters`, `hc_eps`) or Qwen4-Exp's gated residual (gate rank `hc_lowrank`; it
  # replaces the pre-norms and the final norm). GLM has none.
  hc_mult: int = 0
  hc_sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  hc_lowrank: int = 0
  # Qwen4-Exp: a sigmoid gate (`shared_expert_gate`) on the shared expert's output.
  shared_expert_gate: bool = False
  # The MoE router's noaux_tc selection bias (updated from the expert load); Qwen4-Exp has none.
  router_bias: bool = True
  # DSA lightning indexer.
  index_n_heads: int = 32
  index_head_dim: int = 128
  index_topk: int = 2048
  index_rope_dim: int = 64
  indexer_rope_interleave: bool = True
  indexer_rope_first: bool = True
  indexer_scoring_relu: bool = True
  indexer_hadamard: bool = False
  # IndexShare (GLM-5.2): layer i runs its own indexer iff max(i - offset + 1, 0) % freq == 0.
  index_topk_freq: int = 1
  index_topk_offset: int = 0
  # DeepSeek-V4 (`deepseek_v4`): shared-KV MQA with sinks over a sliding window plus compressed
  # entries. `compress_ratios[i]` is layer i's type: 0 = sliding window only (SWA), `csa_ratio` =
  # CSA (overlapping compressor + indexer top-k), any other ratio = HCA (all visible entries).
  head_dim: int = 512
  o_groups: int = 8
  o_lora_rank: int = 1024
  sliding_window: int = 128
  compress_ratios: tuple[int, ...] = ()
  csa_ratio: int = 4
  compress_rope_theta: float = 160000.0
  # Qwen3.8-Flash-Next (`qwen4_exp`): gated GQA with the QSA block indexer on "qsa" layers.
  # `layer_types[i]` is "qsa" or "gated_deltanet"; head_dim and qk_rope_dim (the partial RoPE
  # width) are shared with the fields above.
  n_kv_heads: int = 2
  layer_types: tuple[str, ...] = ()
  # Gated DeltaNet ("gated_deltanet" layers, layers/gated_deltanet.py): q/k heads and value heads
  # (a multiple of them) with their dims, the short causal conv's width, the output gate's
  # activation ("sigmoid" in Qwen3.8-Flash-Next, "silu" in Qwen3-Next) and the op's chunk length.
  linear_n_key_heads: int = 16
  linear_n_value_heads: int = 48
  linear_key_dim: int = 128
  linear_value_dim: int = 128
  linear_conv_kernel: int = 4
  linear_output_gate: str = "sigmoid"
  linear_chunk: int = 64
  # Engram / PLE (layers/engram.py): hashed n-gram embeddings added to the residual streams before the
  # (one-indexed, as transformers' `ple_layer_ids`) layers listed. Per such layer, n-grams of orders
  # 2..`ngram_size` are hashed `ngram_heads_per_order` ways each into prime-sized tables (the first
  # primes >= `ngram_vocab_base`, all layers' heads distinct, rows padded to `ngram_vocab_multiple`) of
  # `ple_embed_dim / heads` features; `ngram_seed` fixes the hash multipliers. N-grams never reach back
  # across an `eos_token_id` (or a document start); `ple_conv_kernel` is the dilated conv's width.
  ple_layer_ids: tuple[int, ...] = ()
  ple_embed_dim: int = 0
  ple_conv_kernel: int = 4
  ngram_size: int = 3
  ngram_heads_per_order: int = 8
  ngram_vocab_base: int = 20_000_000
  ngram_vocab_multiple: int = 128
  ngram_seed: int = 1234
  eos_token_id: int = -1
  qsa_block: int = 4
  indexer_pool: str = "sum"
  indexer_frozen: bool = False
  # Holistic step optimizations (hyscale_jax/step_modes.py; same values and gradients, less work):
  # the indexer loss computes its gradient in the forward pass and saves it (DSA, CSA and QSA
  # layers), so neither the backward pass nor the "selection_replay" rematerialization reruns the teacher.
  indexer_loss_grad_in_forward: bool = False
  # Every `ops.sparse_attention` call (MLA/DSA, DeepSeek-V4's window and CSA, QSA) runs its
  # deterministic backward: dk/dv bit-identical run to run instead of summed by f32 atomics, at a
  # cost in backward time and up to ~1 GiB of f32 rows per call (the pallas kernel's `chunk_bytes`).
  sparse_attention_deterministic: bool = False
  # MLA (DSA) attention over this many query rows at a time when T is longer (T must then be a
  # multiple): the keys are computed once, and under remat the absorbed queries, the attention
  # output and their gradients exist one chunk at a time (0: all rows at once).
  attention_query_chunk: int = 0
  # The training loss runs the LM head and cross-entropy over this many sequence positions at a
  # time (layers/lm_head.py; 0: all at once): one chunk's f32 logits are [B, chunk, V] instead of
  # the whole [B, T, V] (81 GB at 128K tokens for GLM-5.1's 154,880-token vocabulary). 2048 keeps
  # that at 1.3 GB per sequence while each chunk's head matmul stays large (2048 x D x V).
  lm_loss_chunk: int = 2048
  # QSA indexer q/k norms zero-centred (weight applied as 1 + w), as transformers' qwen4_exp has them.
  indexer_norm_zero_centered: bool = False
  # Multi-token prediction (models/mtp.py): this many extra blocks after the last layer, depth d
  # predicting token t + 2 + d at position t from depth d-1's hidden state and the embedding of
  # token t + 1 + d; they share the embedding and the LM head (0: none). The published GLM-5.1,
  # DeepSeek-V4 and Qwen3.8-Flash-Next have 1.
  mtp_depth: int = 0
  # Numerics and memory.
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat_policy: str = "selection_replay"
  # Runs of structurally identical layers (or of a repeating block of them) go through one
  # jax.lax.scan (models/decoder.py), so trace and compile time do not grow with depth; False
  # unrolls every layer (same values and gradients; for comparison and debugging).
  scan_layers: bool = True
  # The Hugging Face config.json this config was imported from (JSON text; "" if none), kept so that
  # export writes back every field it had (convert/hf_config.py). A string: configs stay hashable.
  hf_config: str = ""

  def saves_attention(self, seq_len: int) -> bool:
    """Whether "selection_replay" saves the attention's out/lse at this length (not when MLA chunks).

    A chunked layer's saved attention output ([B, T, H, kv_lora_rank], 67 GB at 1M for GLM-5.1) is
    what chunking is there to avoid, so each chunk keeps its selection (and the indexer loss's
    gradient, when computed in the forward pass) and reruns its attention forward in the backward
    pass. Every remat that encloses the layer must agree: an outer policy saves names from inside.
    A length the chunk does not divide counts as unchunked here (the layer itself raises).
    """
    try:
      return not self.query_chunk(seq_len)
    except ValueError:
      return True

  def query_chunk(self, seq_len: int) -> int:
    """Rows per MLA query chunk at length `seq_len`, or 0 when it runs unchunked (off, T fits one, or no MLA).

    Raises:
      ValueError: `seq_len` is above `attention_query_chunk` but not a multiple of it.
    """
    if self.architecture != "glm_moe_dsa":  # only MLA layers chunk
      return 0
    return self._sequence_chunk("attention_query_chunk", seq_len)

  def layer_chunk(self, seq_len: int) -> int:
    """Positions per chunk when whole MLA layers run over sequence chunks (`DecoderLayer._chunked_layer`):
    the query chunk, when the FFN chunk at this length is the same; else 0.

    Raises:
      ValueError: as `query_chunk` and `ffn_chunk`.
    """
    chunk = self.query_chunk(seq_len)
    return chunk if chunk and chunk == self.ffn_chunk(seq_len) else 0

  def ffn_chunk(self, seq_len: int) -> int:
    """Positions per FFN sub-block chunk at length `seq_len`, or 0 when it runs unchunked (off or T fits one).

    Raises:
      ValueError: `seq_len` is above `ffn_token_chunk` but not a multiple of it.
    """
    return self._sequence_chunk("ffn_token_chunk", seq_len)

  def _sequence_chunk(self, field: str, seq_len: int) -> int:
    chunk = getattr(self, field)
    if not chunk or seq_len <= chunk:
      return 0
    if seq_len % chunk:
      raise ValueError(f"model.{field}={chunk} must divide the sequence length T={seq_len} "
                       "(or be >= T, or 0 for no chunking).")
    return chunk

  def __post_init__(self):
    positive = ("vocab_size", "d_model", "n_layers", "n_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
                "index_topk_freq", "dense_inter", "moe_inter", "n_routed_experts", "experts_per_token")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name} must be a positive int, got {name}={value!r}.")
    if not 0 <= self.first_k_dense <= self.n_layers:
      raise ValueError(f"model.first_k_dense={self.first_k_dense} must be in [0, n_layers={self.n_layers}].")
    if self.qk_rope_dim % 2 or self.index_rope_dim % 2:
      raise ValueError(f"RoPE dims must be even: {self.qk_rope_dim=}, {self.index_rope_dim=}.")
    if self.index_rope_dim > self.index_head_dim:
      raise ValueError(f"model.index_rope_dim={self.index_rope_dim} exceeds index_head_dim={self.index_head_dim}.")
    if self.n_routed_experts % self.n_group:
      raise ValueError(f"model.n_routed_experts={self.n_routed_experts} must divide into n_group={self.n_group}.")
    if self.experts_per_token > self.n_routed_experts:
      raise ValueError(f"model.experts_per_token={self.experts_per_token} > n_routed_experts={self.n_routed_experts}.")
    if self.remat_policy not in remat.REMAT_POLICIES:
      raise ValueError(f"model.remat_policy={self.remat_policy!r} is not one of {remat.REMAT_POLICIES}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is not one of {_DTYPES}.")
    for name in ("moe_token_chunk", "ffn_token_chunk", "attention_query_chunk", "lm_loss_chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"model.{name}={value!r} must be an int >= 0 (0: unchunked).")
    if not isinstance(self.sparse_attention_deterministic, bool):
      raise ValueError(f"model.sparse_attention_deterministic={self.sparse_attention_deterministic!r} must be a bool.")
    if not isinstance(self.mtp_depth, int) or isinstance(self.mtp_depth, bool) or self.mtp_depth < 0:
      raise ValueError(f"model.mtp_depth={self.mtp_depth!r} must be an int >= 0 (0: no MTP).")
    self._check_hyper_connections()
    self._check_yarn_and_hash()
    if self.shared_expert_gate and self.n_shared_experts < 1:
      raise ValueError("model.shared_expert_gate=True needs shared experts, got "
                       f"n_shared_experts={self.n_shared_experts}.")
    if self.swiglu_limit < 0:
      raise ValueError(f"model.swiglu_limit={self.swiglu_limit} must be >= 0 (0 disables the clamp).")
    if self.architecture == "deepseek_v4":
      self._check_deepseek_v4()
    if self.architecture == "qwen4_exp":
      self._check_qwen4_exp()
    elif self.ple_layer_ids:
      raise ValueError(f"model.ple_layer_ids={self.ple_layer_ids}: only qwen4_exp has n-gram (Engram) embeddings.")

  def _check_hyper_connections(self):
    if not isinstance(self.hc_mult, int) or self.hc_mult < 0:
      raise ValueError(f"model.hc_mult={self.hc_mult!r} must be an int >= 0 (0: a plain residual).")
    if not self.hc_mult:
      return
    if self.architecture == "glm_moe_dsa":
      raise ValueError(f"model.hc_mult={self.hc_mult}: glm_moe_dsa has no hyper-connections; use 0.")
    if self.architecture == "deepseek_v4" and self.hc_sinkhorn_iters < 1:
      raise ValueError(f"model.hc_sinkhorn_iters={self.hc_sinkhorn_iters} must be >= 1 for DeepSeek-V4's mHC.")
    if self.architecture == "qwen4_exp" and self.hc_lowrank < 1:
      raise ValueError(f"model.hc_lowrank={self.hc_lowrank} must be >= 1 for Qwen4-Exp's gated residual.")

  def _check_yarn_and_hash(self):
    if self.rope_yarn_factor:
      if self.rope_yarn_factor < 1 or self.rope_yarn_original_max_len < 1:
        raise ValueError(f"model.rope_yarn_factor={self.rope_yarn_factor} must be >= 1 (0: no YaRN) with "
                         f"rope_yarn_original_max_len={self.rope_yarn_original_max_len} >= 1.")
      if self.architecture == "qwen4_exp":
        raise ValueError(f"model.rope_yarn_factor={self.rope_yarn_factor}: qwen4_exp has no YaRN RoPE; use 0.")
    n_moe = self.n_layers - self.first_k_dense
    if not isinstance(self.n_hash_layers, int) or not 0 <= self.n_hash_layers <= n_moe:
      raise ValueError(f"model.n_hash_layers={self.n_hash_layers!r} must be an int in [0, {n_moe}] (the MoE layers).")
    if self.n_hash_layers and self.architecture != "deepseek_v4":
      raise ValueError(f"model.n_hash_layers={self.n_hash_layers}: only deepseek_v4 has hash-routed MoE layers.")

  def _check_qwen4_exp(self):
    if len(self.layer_types) != self.n_layers:
      raise ValueError(f"model.layer_types has {len(self.layer_types)} entries; qwen4_exp needs one "
                       f"per layer (n_layers={self.n_layers}).")
    bad = sorted(set(self.layer_types) - {"qsa", "gated_deltanet"})
    if bad:
      raise ValueError(f"model.layer_types has unknown types {bad}; use 'qsa' or 'gated_deltanet'.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads={self.n_heads} must divide into n_kv_heads={self.n_kv_heads}.")
    if self.indexer_pool not in ("sum", "max"):
      raise ValueError(f"model.indexer_pool={self.indexer_pool!r} is not 'sum' or 'max'.")
    if self.qsa_block < 1 or self.qk_rope_dim > self.head_dim:
      raise ValueError(f"model.qsa_block={self.qsa_block} must be >= 1 and qk_rope_dim <= head_dim.")
    if "gated_deltanet" in self.layer_types:
      self._check_gated_deltanet()
    if self.ple_layer_ids:
      self._check_engram()

  def _check_engram(self):
    ids = self.ple_layer_ids
    if list(ids) != sorted(set(ids)) or ids[0] < 1 or ids[-1] > self.n_layers:
      raise ValueError(f"model.ple_layer_ids={ids} must be increasing one-indexed layer ids in [1, {self.n_layers}].")
    for name in ("ple_embed_dim", "ple_conv_kernel", "ngram_heads_per_order", "ngram_vocab_base",
                 "ngram_vocab_multiple"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name} must be a positive int when ple_layer_ids is set, got {name}={value!r}.")
    heads = (self.ngram_size - 1) * self.ngram_heads_per_order
    if self.ngram_size < 2 or self.ple_embed_dim % heads:
      raise ValueError(f"model.ngram_size={self.ngram_size} must be >= 2 and ple_embed_dim={self.ple_embed_dim} "
                       f"a multiple of the {heads} n-gram heads ((ngram_size - 1) * ngram_heads_per_order).")
    if not 0 <= self.eos_token_id < self.vocab_size:
      raise ValueError(f"model.eos_token_id={self.eos_token_id} must be a token id in [0, vocab_size="
                       f"{self.vocab_size}) when ple_layer_ids is set: n-grams stop at it.")

  def _check_gated_deltanet(self):
    for name in ("linear_n_key_heads", "linear_n_value_heads", "linear_key_dim", "linear_value_dim",
                 "linear_conv_kernel", "linear_chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name} must be a positive int, got {name}={value!r}.")
    if self.linear_n_value_heads % self.linear_n_key_heads:
      raise ValueError(f"model.linear_n_value_heads={self.linear_n_value_heads} must be a multiple of "
                       f"linear_n_key_heads={self.linear_n_key_heads}.")
    if self.linear_output_gate not in ("sigmoid", "silu"):
      raise ValueError(f"model.linear_output_gate={self.linear_output_gate!r} is not 'sigmoid' or 'silu'.")

  def _check_deepseek_v4(self):
    if len(self.compress_ratios) != self.n_layers:
      raise ValueError(f"model.compress_ratios has {len(self.compress_ratios)} entries; "
                       f"deepseek_v4 needs one per layer (n_layers={self.n_layers}).")
    if any(not isinstance(r, int) or r < 0 for r in self.compress_ratios):
      raise ValueError(f"model.compress_ratios={self.compress_ratios} must be ints >= 0.")
    if self.n_heads % self.o_groups:
      raise ValueError(f"model.n_heads={self.n_heads} must divide into o_groups={self.o_groups}.")
    if self.qk_rope_dim > self.head_dim or self.index_rope_dim > self.index_head_dim:
      raise ValueError(f"RoPE dims exceed head dims: {self.qk_rope_dim=} vs {self.head_dim=}, "
                       f"{self.index_rope_dim=} vs {self.index_head_dim=}.")
    if self.sliding_window < 1:
      raise ValueError(f"model.sliding_window={self.sliding_window} must be >= 1.")

  def layer_kind(self, layer: int) -> str:
    """DeepSeek-V4 layer type: "swa", "csa" or "hca" (from `compress_ratios`)."""
    ratio = self.compress_ratios[layer]
    return "swa" if ratio == 0 else "csa" if ratio == self.csa_ratio else "hca"

  @classmethod
  def from_config(cls, config: Any) -> "ModelConfig":
    """From an ml_collections ConfigDict (or dict); unknown keys are an error naming them."""
    values = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown model config keys {unknown}; known keys: {sorted(known)}.")
    for name in ("compress_ratios", "layer_types", "ple_layer_ids"):  # ConfigDicts hold lists; the config, tuples
      if name in values:
        values[name] = tuple(values[name])
    return cls(**values)

  def has_indexer(self, layer: int) -> bool:
    """Whether `layer` runs its own indexer (IndexShare 'full' layer) or reuses the previous one's."""
    return index_share_full_layer(layer, self.index_topk_freq, self.index_topk_offset)

  def is_moe(self, layer: int) -> bool:
    return layer >= self.first_k_dense

  def is_hash_moe(self, layer: int) -> bool:
    """Whether `layer` is one of the first `n_hash_layers` MoE layers, routed by the token table."""
    return self.first_k_dense <= layer < self.first_k_dense + self.n_hash_layers

  @property
  def attention_scale(self) -> float:
    """τ = (qk_nope_dim + qk_rope_dim)^{-1/2}, before YaRN's mscale (`MLASparseAttention.scale` has it)."""
    return (self.qk_nope_dim + self.qk_rope_dim) ** -0.5
