"""Hugging Face `config.json` <-> `ModelConfig`, one function pair per architecture.

Fields map one to one. A value we do not implement (a RoPE type other than default and YaRN, a hash-routed
layer after a score-routed one, ...) is an error naming the field, never silently dropped. Where transformers
departs from DeepSeek's reference, the `ModelConfig` flag that carries the choice is set here
(`indexer_rope_interleave`, `indexer_rope_first`, `indexer_scoring_relu`, `indexer_hadamard`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyscale_jax.model_config import EXECUTION_FIELDS, ModelConfig, index_share_full_layer

_V4_KINDS = {"sliding_attention": "swa", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}
_QWEN_KINDS = {"indexed_attention": "qsa", "full_attention": "qsa", "linear_attention": "gated_deltanet"}
# The MTP layer count's field: DeepSeek's (GLM-5.1 keeps it; transformers' GlmMoeDsaConfig does not
# declare it) and Qwen3-Next's / Qwen3.5's (transformers' qwen4_exp declares neither).
MTP_FIELDS = {"glm_moe_dsa": "num_nextn_predict_layers", "deepseek_v4": "num_nextn_predict_layers",
              "qwen4_exp": "mtp_num_hidden_layers", "qwen4_exp_text": "mtp_num_hidden_layers"}


class UnsupportedConfigError(ValueError):
  """The checkpoint's config.json asks for something our models do not implement."""


def _require(hf: dict, field: str, allowed, model_type: str) -> None:
  value = hf.get(field)
  if value not in allowed:
    raise UnsupportedConfigError(f"{model_type}: config.json {field}={value!r} is not supported (only {allowed}).")


def _rope_theta(params: dict | None, field: str, model_type: str) -> float:
  params = params or {}
  if params.get("rope_type", "default") != "default":
    raise UnsupportedConfigError(f"{model_type}: config.json {field}.rope_type={params['rope_type']!r}: only "
                                 "'default' RoPE is implemented here.")
  return float(params["rope_theta"])


# transformers' YaRN keys -> our ModelConfig fields (layers/rope.py `YaRN`).
_YARN_FIELDS = {"factor": "rope_yarn_factor", "original_max_position_embeddings": "rope_yarn_original_max_len",
                "beta_fast": "rope_yarn_beta_fast", "beta_slow": "rope_yarn_beta_slow", "mscale": "rope_yarn_mscale",
                "mscale_all_dim": "rope_yarn_mscale_all_dim", "attention_factor": "rope_yarn_attention_factor",
                "truncate": "rope_yarn_truncate"}


def _rope_yarn(params: dict, field: str, model_type: str, max_positions: int | None) -> dict:
  """Our `rope_yarn_*` fields for a `rope_parameters` dict: none for default RoPE, as transformers reads YaRN's."""
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return {}
  if rope_type != "yarn":
    raise UnsupportedConfigError(f"{model_type}: config.json {field}.rope_type={rope_type!r}: only 'default' "
                                 "and 'yarn' RoPE are implemented.")
  original = params.get("original_max_position_embeddings")
  factor = params.get("factor") or (max_positions / original if max_positions and original else None)
  if not original or not factor:
    raise UnsupportedConfigError(f"{model_type}: config.json {field} has rope_type='yarn' without "
                                 f"original_max_position_embeddings={original!r} and factor={params.get('factor')!r}.")
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
      if value or key not in ("mscale", "mscale_all_dim", "attention_factor"):  # 0 there means absent
        params[key] = value
  return params


def _index_share(indexer_types: list[str], model_type: str) -> tuple[int, int]:
  """(index_topk_freq, index_topk_offset) that reproduce a per-layer "full"/"shared" list."""
  n = len(indexer_types)
  for freq in range(1, n + 1):
    for offset in range(0, n + 1):
      pattern = ["full" if index_share_full_layer(i, freq, offset) else "shared" for i in range(n)]
      if pattern == list(indexer_types):
        return freq, offset
  raise UnsupportedConfigError(f"{model_type}: indexer_types={indexer_types} is not a frequency/offset "
                               "IndexShare pattern that model.index_topk_freq/offset can express.")


def glm_from_hf(hf: dict) -> dict:
  n = hf["num_hidden_layers"]
  mlp_types = hf.get("mlp_layer_types") or ["dense"] * hf["first_k_dense_replace"] + ["sparse"] * n
  first_k_dense = mlp_types.count("dense")
  if mlp_types[:n] != ["dense"] * first_k_dense + ["sparse"] * (n - first_k_dense):
    raise UnsupportedConfigError(f"glm_moe_dsa: mlp_layer_types={mlp_types} is not dense layers then MoE layers.")
  for field in ("attention_bias", "mlp_bias"):
    _require(hf, field, (False, None), "glm_moe_dsa")
  _require(hf, "hidden_act", ("silu",), "glm_moe_dsa")
  freq, offset = _index_share(hf["indexer_types"], "glm_moe_dsa")
  return dict(
      architecture="glm_moe_dsa", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n,
      first_k_dense=first_k_dense, dense_inter=hf["intermediate_size"], rms_eps=hf["rms_norm_eps"],
      rope_theta=float(hf["rope_parameters"]["rope_theta"]),
      **_rope_yarn(hf["rope_parameters"], "rope_parameters", "glm_moe_dsa", hf.get("max_position_embeddings")),
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


def deepseek_v4_from_hf(hf: dict) -> dict:
  n = hf["num_hidden_layers"]
  rates = hf["compress_rates"]
  kinds = [_V4_KINDS.get(t) for t in hf["layer_types"]]
  if None in kinds:
    raise UnsupportedConfigError(f"deepseek_v4: layer_types={hf['layer_types']} has unknown entries.")
  ratio = {"swa": 0, "csa": rates["compressed_sparse_attention"], "hca": rates["heavily_compressed_attention"]}
  if ratio["csa"] == ratio["hca"]:
    raise UnsupportedConfigError(f"deepseek_v4: compress_rates={rates} must differ between CSA and HCA.")
  # transformers: without mlp_layer_types, the first num_hash_layers (default 3) layers are hash-routed.
  mlp_types = (hf.get("mlp_layer_types") or ["hash_moe"] * hf.get("num_hash_layers", 3) + ["moe"] * n)[:n]
  n_hash = mlp_types.count("hash_moe")
  if mlp_types != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
    raise UnsupportedConfigError(f"deepseek_v4: mlp_layer_types={mlp_types} is not 'hash_moe' layers then 'moe' layers.")
  _require(hf, "num_key_value_heads", (1,), "deepseek_v4")
  _require(hf, "hidden_act", ("silu",), "deepseek_v4")
  rope = _v4_rope_parameters(hf)
  head_dim = hf["head_dim"]
  rope_dim = int(head_dim * hf["partial_rotary_factor"])
  return dict(
      architecture="deepseek_v4", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n,
      first_k_dense=0, rms_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_theta=_rope_theta(rope["main"], "rope_parameters.main", "deepseek_v4"),
      compress_rope_theta=float(rope["compress"]["rope_theta"]),
      # transformers reads `truncate` from the outer rope_parameters dict, which V4 nests: always True.
      **dict(_rope_yarn(rope["compress"], "rope_parameters.compress", "deepseek_v4",
                        hf.get("max_position_embeddings", 1048576)), rope_yarn_truncate=True),
      n_hash_layers=n_hash,
      n_heads=hf["num_attention_heads"], head_dim=head_dim, qk_rope_dim=rope_dim, q_lora_rank=hf["q_lora_rank"],
      o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"], sliding_window=hf["sliding_window"],
      compress_ratios=tuple(ratio[k] for k in kinds), csa_ratio=ratio["csa"],
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


def qwen4_exp_from_hf(hf: dict) -> dict:
  hf = hf.get("text_config") or hf
  kinds = [_QWEN_KINDS.get(t) for t in hf["layer_types"]]
  if None in kinds:
    raise UnsupportedConfigError(f"qwen4_exp: layer_types={hf['layer_types']} has unknown entries.")
  if hf.get("ple_layer_ids"):
    raise UnsupportedConfigError(f"qwen4_exp: ple_layer_ids={hf['ple_layer_ids']}: per-layer (n-gram) "
                                 "embeddings are not implemented.")
  _require(hf, "indexer_kv_heads", (1,), "qwen4_exp")
  _require(hf, "attention_bias", (False, None), "qwen4_exp")
  shared, inter = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
  if shared % inter:
    raise UnsupportedConfigError(f"qwen4_exp: shared_expert_intermediate_size={shared} is not a multiple of "
                                 f"moe_intermediate_size={inter}.")
  rope = hf["rope_parameters"]
  rope_dim = int(hf["head_dim"] * rope.get("partial_rotary_factor", 1.0))
  return dict(
      architecture="qwen4_exp", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"], first_k_dense=0, rms_eps=hf["rms_norm_eps"],
      rope_theta=_rope_theta(rope, "rope_parameters", "qwen4_exp"),
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
  return dict(
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
      norm_topk_prob=cfg.norm_topk_prob, hc_count=cfg.hc_mult, hc_lowrank=cfg.hc_lowrank, ple_layer_ids=[],
      linear_num_key_heads=cfg.linear_n_key_heads, linear_num_value_heads=cfg.linear_n_value_heads,
      linear_key_head_dim=cfg.linear_key_dim, linear_value_head_dim=cfg.linear_value_dim,
      linear_conv_kernel_dim=cfg.linear_conv_kernel, output_gate_type=cfg.linear_output_gate,
      hidden_act="silu", attention_bias=False, dtype=cfg.param_dtype)


_FROM_HF = {"glm_moe_dsa": glm_from_hf, "deepseek_v4": deepseek_v4_from_hf, "qwen4_exp": qwen4_exp_from_hf,
            "qwen4_exp_text": qwen4_exp_from_hf}
_TO_HF = {"glm_moe_dsa": glm_to_hf, "deepseek_v4": deepseek_v4_to_hf, "qwen4_exp": qwen4_exp_to_hf}


def from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Our ModelConfig for a transformers `config.json` dict; `overrides` set non-architectural fields."""
  model_type = hf.get("model_type")
  if model_type not in _FROM_HF:
    raise UnsupportedConfigError(f"config.json model_type={model_type!r} is not one of {sorted(_FROM_HF)}.")
  fields = _FROM_HF[model_type](hf)
  fields["mtp_depth"] = int((hf.get("text_config") or hf).get(MTP_FIELDS[model_type]) or 0)
  dtype = hf.get("dtype") or hf.get("torch_dtype")
  if dtype in ("float32", "bfloat16") and "param_dtype" not in overrides:
    fields["param_dtype"] = dtype
  fields.update(overrides)
  return ModelConfig(**fields)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The transformers `config.json` dict for `cfg` (an error for fields transformers cannot express)."""
  if cfg.architecture not in _TO_HF:
    raise UnsupportedConfigError(f"no export for model.architecture={cfg.architecture!r}.")
  return dict(_TO_HF[cfg.architecture](cfg), **{MTP_FIELDS[cfg.architecture]: cfg.mtp_depth})


def architectural_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The fields a checkpoint fixes (everything but `model_config.EXECUTION_FIELDS`), for comparisons."""
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in EXECUTION_FIELDS}
