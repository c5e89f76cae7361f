"""Hugging Face `config.json` <-> `ModelConfig`, one function pair per architecture.

Fields map one to one. A value we do not implement (a RoPE type other than default and YaRN, a hash-routed
layer after a score-routed one, ...) is an error naming the field, never silently dropped: each `*_from_hf`
notes every such field in a `_Problems` list, and `from_hf` raises one `UnsupportedConfigError` naming them
all, before any tensor is read. Where transformers departs from DeepSeek's reference, the `ModelConfig` flag
that carries the choice is set here (`indexer_rope_interleave`, `indexer_rope_first`, `indexer_scoring_relu`,
`indexer_hadamard`).

Import keeps the whole config.json in `ModelConfig.hf_config`; export writes it back with the
fields we own (what `*_to_hf` returns) updated, so the exported folder keeps every field (e.g.
`max_position_embeddings`, `mrope_section`). A config that was not imported starts from
transformers' defaults for its model type (`hf_defaults.json`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hyscale_jax.model_config import EXECUTION_FIELDS, PROVENANCE_FIELDS, ModelConfig, index_share_full_layer

_V4_KINDS = {"sliding_attention": "swa", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}
_QWEN_KINDS = {"indexed_attention": "qsa", "full_attention": "qsa", "linear_attention": "gated_deltanet"}
# The MTP layer count's field: DeepSeek's (GLM-5.1 keeps it; transformers' GlmMoeDsaConfig does not
# declare it) and Qwen3-Next's / Qwen3.5's (transformers' qwen4_exp declares neither).
MTP_FIELDS = {"glm_moe_dsa": "num_nextn_predict_layers", "deepseek_v4": "num_nextn_predict_layers",
              "qwen4_exp": "mtp_num_hidden_layers", "qwen4_exp_text": "mtp_num_hidden_layers"}


class UnsupportedConfigError(ValueError):
  """The checkpoint's config.json asks for something our models do not implement.

  Its message is one line, `<model_type>: <field>=<value> <why>; <field>=<value> <why>...`, naming
  every unsupported field of the config at once.
  """


class _Problems:
  """The unsupported fields of one config.json, gathered so that one error names them all."""

  def __init__(self, model_type: str):
    self.model_type, self.items = model_type, []

  def add(self, field: str, value: Any, why: str) -> None:
    self.items.append(f"{field}={value!r} {why}")

  def require(self, hf: dict, field: str, allowed) -> None:
    if hf.get(field) not in allowed:
      self.add(field, hf.get(field), f"is not supported (only {allowed})")

  def raise_any(self) -> None:
    if self.items:
      raise UnsupportedConfigError(f"{self.model_type}: " + "; ".join(self.items))


def _rope_theta(params: dict | None, field: str, problems: _Problems) -> float:
  params = params or {}
  if params.get("rope_type", "default") != "default":
    problems.add(f"{field}.rope_type", params["rope_type"], "is not supported: only 'default' RoPE is implemented "
                 "here (YaRN: GLM's RoPE and V4's compressed layers)")
  return float(params.get("rope_theta", 0.0))


# transformers' YaRN keys -> our ModelConfig fields (layers/rope.py `YaRN`).
_YARN_FIELDS = {"factor": "rope_yarn_factor", "original_max_position_embeddings": "rope_yarn_original_max_len",
                "beta_fast": "rope_yarn_beta_fast", "beta_slow": "rope_yarn_beta_slow", "mscale": "rope_yarn_mscale",
                "mscale_all_dim": "rope_yarn_mscale_all_dim", "attention_factor": "rope_yarn_attention_factor",
                "truncate": "rope_yarn_truncate"}


def _rope_yarn(params: dict, field: str, problems: _Problems, max_positions: int | None) -> dict:
  """Our `rope_yarn_*` fields for a `rope_parameters` dict: none for default RoPE, as transformers reads YaRN's."""
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return {}
  if rope_type != "yarn":
    problems.add(f"{field}.rope_type", rope_type, "is not supported: only 'default' and 'yarn' RoPE are implemented")
    return {}
  original = params.get("original_max_position_embeddings")
  factor = params.get("factor") or (max_positions / original if max_positions and original else None)
  if not original or not factor:
    problems.add(field, params, "has rope_type='yarn' without original_max_position_embeddings and factor")
    return {}
  # transformers: a missing (or 0) beta is 32 / 1; a missing attention_factor is derived from mscale.
  return dict(rope_yarn_factor=float(factor), rope_yarn_original_max_len=int(original),
              rope_yarn_beta_fast=float(params.get("beta_fast") or 32), rope_yarn_beta_slow=float(params.get("beta_slow") or 1),
              rope_yarn_mscale=float(params.get("mscale") or 0), rope_yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0),
              rope_yarn_attention_factor=float(params.get("attention_factor") or 0),
              rope_yarn_truncate=bool(params.get("truncate", True)))


def _rope_parameters(cfg: ModelConfig, theta: float, scaled: bool, **extra) -> dict:
  """transformers' `rope_parameters` for `theta`, with the config's YaRN keys when `scaled` and it has them."""
  params = {"rope_type": "default", "rope_theta": theta, **extra}
  if scaled and cfg.rope_yarn_factor:
    params["rope_type"] = "yarn"
    for key, name in _YARN_FIELDS.items():
      value = getattr(cfg, name)
      # 0 means absent for the mscales and attention_factor; truncate is written only off its default (True).
      if (key == "truncate" and value) or (not value and key in ("mscale", "mscale_all_dim", "attention_factor")):
        continue
      params[key] = value
  return params


def _index_share(indexer_types: list[str], problems: _Problems) -> tuple[int, int]:
  """(index_topk_freq, index_topk_offset) that reproduce a per-layer "full"/"shared" list."""
  n = len(indexer_types)
  for freq in range(1, n + 1):
    for offset in range(0, n + 1):
      pattern = ["full" if index_share_full_layer(i, freq, offset) else "shared" for i in range(n)]
      if pattern == list(indexer_types):
        return freq, offset
  problems.add("indexer_types", indexer_types, "is not a frequency/offset IndexShare pattern that "
               "model.index_topk_freq/offset can express")
  return 1, 0


def glm_from_hf(hf: dict, problems: _Problems) -> dict:
  n = hf["num_hidden_layers"]
  mlp_types = hf.get("mlp_layer_types") or ["dense"] * hf["first_k_dense_replace"] + ["sparse"] * n
  first_k_dense = mlp_types.count("dense")
  if mlp_types[:n] != ["dense"] * first_k_dense + ["sparse"] * (n - first_k_dense):
    problems.add("mlp_layer_types", mlp_types, "is not dense layers then MoE layers")
  for field in ("attention_bias", "mlp_bias"):
    problems.require(hf, field, (False, None))
  problems.require(hf, "hidden_act", ("silu",))
  freq, offset = _index_share(hf["indexer_types"], problems)
  return dict(
      architecture="glm_moe_dsa", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n,
      first_k_dense=first_k_dense, dense_inter=hf["intermediate_size"], rms_eps=hf["rms_norm_eps"],
      rope_theta=float(hf["rope_parameters"]["rope_theta"]),
      **_rope_yarn(hf["rope_parameters"], "rope_parameters", problems, hf.get("max_position_embeddings")),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), n_heads=hf["num_attention_heads"],
      q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"], qk_nope_dim=hf["qk_nope_head_dim"],
      qk_rope_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], n_routed_experts=hf["n_routed_experts"],
      experts_per_token=hf["num_experts_per_tok"], n_shared_experts=hf["n_shared_experts"],
      moe_inter=hf["moe_intermediate_size"], routed_scaling=hf["routed_scaling_factor"], scoring="sigmoid",
      norm_topk_prob=hf["norm_topk_prob"], n_group=hf["n_group"], topk_group=hf["topk_group"],
      index_n_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
      # transformers' GLM indexer ropes the first qk_rope_head_dim dims, interleaved, with MLA's
      # frequencies; DeepSeek's V3.2 reference uses the half-split layout (architectures.md section 0).
      index_rope_dim=hf["qk_rope_head_dim"], indexer_rope_interleave=True, indexer_rope_first=True,
      indexer_scoring_relu=True, indexer_hadamard=False, index_topk_freq=freq, index_topk_offset=offset,
      latent_norm_eps=1e-6)


def glm_to_hf(cfg: ModelConfig) -> dict:
  if not (cfg.indexer_rope_interleave and cfg.indexer_rope_first and cfg.indexer_scoring_relu) \
      or cfg.indexer_hadamard or cfg.index_rope_dim != cfg.qk_rope_dim or cfg.latent_norm_eps != 1e-6:
    raise UnsupportedConfigError(
        "glm_moe_dsa export: transformers' GLM indexer is interleaved RoPE first, ReLU, no Hadamard, "
        f"index_rope_dim == qk_rope_dim and 1e-6 latent norms; this config has {cfg.indexer_rope_interleave=}, "
        f"{cfg.indexer_rope_first=}, {cfg.indexer_scoring_relu=}, {cfg.indexer_hadamard=}, "
        f"{cfg.index_rope_dim=}, {cfg.qk_rope_dim=}, {cfg.latent_norm_eps=}.")
  return dict(
      architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, first_k_dense_replace=cfg.first_k_dense,
      mlp_layer_types=["dense" if not cfg.is_moe(i) else "sparse" for i in range(cfg.n_layers)],
      intermediate_size=cfg.dense_inter, rms_norm_eps=cfg.rms_eps,
      rope_parameters=_rope_parameters(cfg, cfg.rope_theta, True),
      tie_word_embeddings=cfg.tie_embeddings, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
      q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_dim,
      qk_rope_head_dim=cfg.qk_rope_dim, v_head_dim=cfg.v_head_dim, n_routed_experts=cfg.n_routed_experts,
      num_experts_per_tok=cfg.experts_per_token, n_shared_experts=cfg.n_shared_experts,
      moe_intermediate_size=cfg.moe_inter, routed_scaling_factor=cfg.routed_scaling,
      norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
      index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
      indexer_types=["full" if cfg.has_indexer(i) else "shared" for i in range(cfg.n_layers)],
      hidden_act="silu", attention_bias=False, dtype=cfg.param_dtype)


def deepseek_v4_from_hf(hf: dict, problems: _Problems) -> dict:
  n = hf["num_hidden_layers"]
  rates = hf["compress_rates"]
  kinds = [_V4_KINDS.get(t) for t in hf["layer_types"]]
  if None in kinds:
    problems.add("layer_types", hf["layer_types"], f"has unknown entries (known: {sorted(_V4_KINDS)})")
  ratio = {"swa": 0, "csa": rates["compressed_sparse_attention"], "hca": rates["heavily_compressed_attention"]}
  if ratio["csa"] == ratio["hca"]:
    problems.add("compress_rates", rates, "must differ between CSA and HCA")
  # transformers: without mlp_layer_types, the first num_hash_layers (default 3) layers are hash-routed.
  mlp_types = (hf.get("mlp_layer_types") or ["hash_moe"] * hf.get("num_hash_layers", 3) + ["moe"] * n)[:n]
  n_hash = mlp_types.count("hash_moe")
  if mlp_types != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
    problems.add("mlp_layer_types", mlp_types, "is not 'hash_moe' layers then 'moe' layers")
  problems.require(hf, "num_key_value_heads", (1,))
  problems.require(hf, "hidden_act", ("silu",))
  rope = _v4_rope_parameters(hf)
  head_dim = hf["head_dim"]
  rope_dim = int(head_dim * hf["partial_rotary_factor"])
  return dict(
      architecture="deepseek_v4", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n,
      first_k_dense=0, rms_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_theta=_rope_theta(rope["main"], "rope_parameters.main", problems),
      compress_rope_theta=float(rope["compress"]["rope_theta"]),
      # transformers reads `truncate` from the outer rope_parameters dict, which V4 nests: always True.
      **dict(_rope_yarn(rope["compress"], "rope_parameters.compress", problems,
                        hf.get("max_position_embeddings", 1048576)), rope_yarn_truncate=True),
      n_hash_layers=n_hash,
      n_heads=hf["num_attention_heads"], head_dim=head_dim, qk_rope_dim=rope_dim, q_lora_rank=hf["q_lora_rank"],
      o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"], sliding_window=hf["sliding_window"],
      compress_ratios=tuple(ratio.get(k, 0) for k in kinds), csa_ratio=ratio["csa"],
      index_n_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
      # transformers' V4 indexer ropes its queries and compressed keys with the attention's rope
      # slice width (qk_rope_dim), interleaved, at the tail; no Hadamard (DeepSeek's FP8 path has one).
      index_rope_dim=rope_dim, indexer_hadamard=False,
      n_routed_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
      n_shared_experts=hf["n_shared_experts"], moe_inter=hf["moe_intermediate_size"],
      scoring=hf["scoring_func"], routed_scaling=hf["routed_scaling_factor"],
      # transformers' V4 router always renormalises the chosen weights, whatever norm_topk_prob says.
      norm_topk_prob=True, swiglu_limit=float(hf["swiglu_limit"]),
      hc_mult=hf["hc_mult"], hc_sinkhorn_iters=hf["hc_sinkhorn_iters"], hc_eps=hf["hc_eps"])


def _v4_rope_parameters(hf: dict) -> dict:
  """{"main": ..., "compress": ...} as transformers' DeepseekV4Config makes them: a flat `rope_parameters`
  (or legacy `rope_scaling`) is the compressed layers' scaling, with YaRN's attention_factor forced to 1."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
    return rope
  compress = {**rope, "rope_theta": hf.get("compress_rope_theta", 160000.0)}
  compress["rope_type"] = compress.pop("type", compress.get("rope_type", "default"))
  if compress["rope_type"] == "yarn":
    compress.setdefault("attention_factor", 1.0)
  return {"main": {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}, "compress": compress}


def deepseek_v4_to_hf(cfg: ModelConfig) -> dict:
  kinds = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
  hca = sorted({r for i, r in enumerate(cfg.compress_ratios) if cfg.layer_kind(i) == "hca"})
  if len(hca) > 1 or cfg.index_rope_dim != cfg.qk_rope_dim or cfg.indexer_hadamard or cfg.hc_mult < 1:
    raise UnsupportedConfigError(
        f"deepseek_v4 export: transformers has one HCA ratio (got {hca}), index_rope_dim == qk_rope_dim "
        f"({cfg.index_rope_dim=}, {cfg.qk_rope_dim=}), no Hadamard ({cfg.indexer_hadamard=}) and mHC "
        f"streams ({cfg.hc_mult=} must be >= 1).")
  prf = cfg.qk_rope_dim / cfg.head_dim
  return dict(
      architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, rms_norm_eps=cfg.rms_eps,
      tie_word_embeddings=cfg.tie_embeddings, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
      head_dim=cfg.head_dim, partial_rotary_factor=prf, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
      o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window,
      layer_types=[kinds[cfg.layer_kind(i)] for i in range(cfg.n_layers)],
      compress_rates={"compressed_sparse_attention": cfg.csa_ratio,
                      "heavily_compressed_attention": hca[0] if hca else 128},
      mlp_layer_types=["hash_moe" if cfg.is_hash_moe(i) else "moe" for i in range(cfg.n_layers)],
      rope_parameters={"main": _rope_parameters(cfg, cfg.rope_theta, False, partial_rotary_factor=prf),
                       "compress": _rope_parameters(cfg, cfg.compress_rope_theta, True, partial_rotary_factor=prf)},
      rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
      index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
      n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.experts_per_token,
      n_shared_experts=cfg.n_shared_experts, moe_intermediate_size=cfg.moe_inter, scoring_func=cfg.scoring,
      routed_scaling_factor=cfg.routed_scaling, norm_topk_prob=True, swiglu_limit=cfg.swiglu_limit,
      hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, hidden_act="silu",
      dtype=cfg.param_dtype)


def _engram_from_hf(hf: dict, problems: _Problems) -> dict:
  """The Engram / PLE fields (transformers' defaults for absent ones); {} without PLE layers."""
  if not hf.get("ple_layer_ids"):
    return {}
  eos = hf.get("eos_token_id")
  eos = eos[0] if isinstance(eos, list) and eos else eos
  if not isinstance(eos, int):
    problems.add("eos_token_id", hf.get("eos_token_id"), "must be set with ple_layer_ids (n-grams stop at it)")
  return dict(
      ple_layer_ids=tuple(sorted(set(hf["ple_layer_ids"]))), ple_embed_dim=hf.get("ple_embed_dim") or hf["hidden_size"],
      ple_conv_kernel=hf.get("ple_conv_kernel_size", 4), ngram_size=hf.get("ngram_size", 3),
      ngram_heads_per_order=hf.get("heads_per_ngram", 8), ngram_vocab_base=hf.get("ngram_vocab_size_base", 20_000_000),
      ngram_vocab_multiple=hf.get("make_ngram_vocab_size_divisible_by", 128), ngram_seed=hf.get("seed", 1234),
      eos_token_id=eos if isinstance(eos, int) else -1)


def qwen4_exp_from_hf(hf: dict, problems: _Problems) -> dict:
  hf = hf.get("text_config") or hf
  kinds = [_QWEN_KINDS.get(t) for t in hf["layer_types"]]
  if None in kinds:
    problems.add("layer_types", hf["layer_types"], f"has unknown entries (known: {sorted(_QWEN_KINDS)})")
  problems.require(hf, "indexer_kv_heads", (1,))
  problems.require(hf, "attention_bias", (False, None))
  shared, inter = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
  if shared % inter:
    problems.add("shared_expert_intermediate_size", shared, f"is not a multiple of moe_intermediate_size={inter}")
  rope = hf["rope_parameters"]
  rope_dim = int(hf["head_dim"] * rope.get("partial_rotary_factor", 1.0))
  return dict(
      architecture="qwen4_exp", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"], first_k_dense=0, rms_eps=hf["rms_norm_eps"],
      rope_theta=_rope_theta(rope, "rope_parameters", problems), **_engram_from_hf(hf, problems),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), layer_types=tuple(kinds),
      n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
      qk_rope_dim=rope_dim, index_n_heads=hf["indexer_n_heads"], index_head_dim=hf["indexer_head_dim"],
      # transformers ropes the QSA index queries and block keys with the attention's rope slice.
      index_rope_dim=rope_dim, qsa_block=hf["indexer_compress_ratio"],
      index_topk=hf["indexer_budget"] // hf["indexer_compress_ratio"],
      n_routed_experts=hf["num_experts"], experts_per_token=hf["num_experts_per_tok"],
      n_shared_experts=shared // inter, moe_inter=inter, scoring="softmax", routed_scaling=1.0,
      # transformers' Qwen4-Exp: a sigmoid-gated shared expert, a router without a selection bias,
      # zero-centred indexer norms, and gated-residual streams in place of the pre-norms.
      norm_topk_prob=hf["norm_topk_prob"], shared_expert_gate=True, router_bias=False,
      indexer_norm_zero_centered=True, hc_mult=hf["hc_count"], hc_lowrank=hf["hc_lowrank"],
      # Gated DeltaNet ("linear_attention" layers), with transformers' defaults for absent fields.
      linear_n_key_heads=hf.get("linear_num_key_heads", 16), linear_n_value_heads=hf.get("linear_num_value_heads", 32),
      linear_key_dim=hf.get("linear_key_head_dim", 128), linear_value_dim=hf.get("linear_value_head_dim", 128),
      linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
      linear_output_gate=hf.get("output_gate_type") or hf.get("hidden_act", "silu"))


def qwen4_exp_to_hf(cfg: ModelConfig) -> dict:
  if cfg.index_rope_dim != cfg.qk_rope_dim or cfg.hc_mult < 1 or not cfg.shared_expert_gate or cfg.router_bias \
      or not cfg.indexer_norm_zero_centered:
    raise UnsupportedConfigError(
        "qwen4_exp export: transformers' model has index_rope_dim == qk_rope_dim, gated-residual streams "
        "(hc_mult >= 1), a gated shared expert, no router bias and zero-centred indexer norms; this config has "
        f"{cfg.index_rope_dim=}, {cfg.qk_rope_dim=}, {cfg.hc_mult=}, {cfg.shared_expert_gate=}, "
        f"{cfg.router_bias=}, {cfg.indexer_norm_zero_centered=}.")
  names = {"qsa": "indexed_attention", "gated_deltanet": "linear_attention"}
  engram = {} if not cfg.ple_layer_ids else dict(
      ple_embed_dim=cfg.ple_embed_dim, ple_conv_kernel_size=cfg.ple_conv_kernel, ngram_size=cfg.ngram_size,
      heads_per_ngram=cfg.ngram_heads_per_order, ngram_vocab_size_base=cfg.ngram_vocab_base,
      make_ngram_vocab_size_divisible_by=cfg.ngram_vocab_multiple, seed=cfg.ngram_seed, eos_token_id=cfg.eos_token_id)
  return dict(**engram,
      architectures=["Qwen4ExpForCausalLM"], model_type="qwen4_exp_text", vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, rms_norm_eps=cfg.rms_eps,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                       "partial_rotary_factor": cfg.qk_rope_dim / cfg.head_dim},
      tie_word_embeddings=cfg.tie_embeddings, layer_types=[names[t] for t in cfg.layer_types],
      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
      indexer_n_heads=cfg.index_n_heads, indexer_kv_heads=1, indexer_head_dim=cfg.index_head_dim,
      indexer_budget=cfg.index_topk * cfg.qsa_block, indexer_compress_ratio=cfg.qsa_block,
      num_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.experts_per_token,
      moe_intermediate_size=cfg.moe_inter, shared_expert_intermediate_size=cfg.moe_inter * cfg.n_shared_experts,
      norm_topk_prob=cfg.norm_topk_prob, hc_count=cfg.hc_mult, hc_lowrank=cfg.hc_lowrank,
      ple_layer_ids=list(cfg.ple_layer_ids), number_of_conv_states=3 if cfg.ple_layer_ids else 1,
      linear_num_key_heads=cfg.linear_n_key_heads, linear_num_value_heads=cfg.linear_n_value_heads,
      linear_key_head_dim=cfg.linear_key_dim, linear_value_head_dim=cfg.linear_value_dim,
      linear_conv_kernel_dim=cfg.linear_conv_kernel,
      # Unset means `hidden_act` (silu) to transformers: the form its own configs write.
      output_gate_type=None if cfg.linear_output_gate == "silu" else cfg.linear_output_gate,
      hidden_act="silu", attention_bias=False, dtype=cfg.param_dtype)


_FROM_HF = {"glm_moe_dsa": glm_from_hf, "deepseek_v4": deepseek_v4_from_hf, "qwen4_exp": qwen4_exp_from_hf,
            "qwen4_exp_text": qwen4_exp_from_hf}
_TO_HF = {"glm_moe_dsa": glm_to_hf, "deepseek_v4": deepseek_v4_to_hf, "qwen4_exp": qwen4_exp_to_hf}


_DEFAULTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_defaults.json")


def from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Our ModelConfig for a transformers `config.json` dict; `overrides` set non-architectural fields.

  The dict itself is kept (`hf_config`, JSON text) for `to_hf`.

  Raises:
    UnsupportedConfigError: one line naming every field of `hf` we do not implement (or a missing one).
  """
  model_type = hf.get("model_type")
  if model_type not in _FROM_HF:
    raise UnsupportedConfigError(f"{model_type}: model_type={model_type!r} is not supported (only {sorted(_FROM_HF)})")
  problems = _Problems(model_type)
  try:
    fields = _FROM_HF[model_type](hf, problems)
  except KeyError as missing:
    problems.add(str(missing.args[0]), None, "is missing from config.json and has no default")
  problems.raise_any()
  fields["mtp_depth"] = int((hf.get("text_config") or hf).get(MTP_FIELDS[model_type]) or 0)
  dtype = hf.get("dtype") or hf.get("torch_dtype")
  if dtype in ("float32", "bfloat16") and "param_dtype" not in overrides:
    fields["param_dtype"] = dtype
  fields["hf_config"] = json.dumps(hf, sort_keys=True)
  fields.update(overrides)
  return ModelConfig(**fields)


def defaults(model_type: str) -> dict[str, Any]:
  """transformers' config.json for `model_type` with every field at its default (`hf_defaults.json`)."""
  with open(_DEFAULTS_FILE) as f:
    return json.load(f)[model_type]


def _overlay(base: dict, ours: dict) -> dict:
  """`base` with `ours` written over it; nested dicts (rope_parameters) merge key by key. A value equal
  to base's keeps base's spelling (YaRN's `beta_fast: 32` stays an int, not our float 32.0)."""
  merged = dict(base)
  for key, value in ours.items():
    old = merged.get(key)
    if isinstance(value, dict) and isinstance(old, dict):
      merged[key] = _overlay(old, value)
    elif key in merged and old == value and isinstance(old, bool) == isinstance(value, bool):
      continue
    elif not (isinstance(old, list) and old and old[0] == value and key == "eos_token_id"):
      merged[key] = value  # (a list of EOS ids whose first is ours stays as it was)
  return merged


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The transformers `config.json` dict for `cfg` (an error for fields transformers cannot express).

  Every field of the config.json `cfg` was imported from (`cfg.hf_config`), or else of transformers'
  defaults for the model type, with the fields `cfg` fixes written over them.
  """
  if cfg.architecture not in _TO_HF:
    raise UnsupportedConfigError(f"no export for model.architecture={cfg.architecture!r}.")
  ours = _TO_HF[cfg.architecture](cfg)
  base = json.loads(cfg.hf_config) if cfg.hf_config else defaults(ours["model_type"])
  # Depth 0 leaves an imported config's MTP count as it was: transformers saves its count with no MTP
  # tensors, which imports as depth 0 (`read_config`); a config not imported says 0 where transformers has one.
  mtp_field = MTP_FIELDS[cfg.architecture]
  if cfg.mtp_depth or (not cfg.hf_config and mtp_field in base):
    ours[mtp_field] = cfg.mtp_depth
  return _overlay(base, ours)


def checkpoint_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The fields of `cfg` that its architecture's config.json sets (what `from_hf` reads, MTP depth included),
  in `ModelConfig`'s order: `ModelConfig(**checkpoint_fields(cfg))` is `cfg` up to the execution and
  provenance fields, since every other field is one the architecture leaves at its default.

  Raises:
    UnsupportedConfigError: as `to_hf`, for a config transformers cannot express.
  """
  names = {*_FROM_HF[cfg.architecture](to_hf(cfg), _Problems(cfg.architecture)), "mtp_depth"}
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}


def original_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json `cfg` was imported from ({} if none)."""
  return json.loads(cfg.hf_config) if cfg.hf_config else {}


def architectural_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The fields a checkpoint fixes (all but `EXECUTION_FIELDS` and `PROVENANCE_FIELDS`), for comparisons."""
  skip = EXECUTION_FIELDS | PROVENANCE_FIELDS
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
