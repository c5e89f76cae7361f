"""Models: built from `config.model` by architecture name; parameter counts computed abstractly."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.decoder import Decoder, DecoderLayer, LayerOutput, ModelOutput
from hyscale_jax.models.deepseek_v4 import DeepseekV4
from hyscale_jax.models.generate import generate
from hyscale_jax.models.glm5 import GlmMoeDsa
from hyscale_jax.models.qwen_next import Qwen4Exp

ARCHITECTURES = {"glm_moe_dsa": GlmMoeDsa, "deepseek_v4": DeepseekV4, "qwen4_exp": Qwen4Exp}


def build(config, *, rngs: nnx.Rngs) -> nnx.Module:
  """The model for `config` (a `config.model` ConfigDict or a ModelConfig)."""
  cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_config(config)
  if cfg.architecture not in ARCHITECTURES:
    raise ValueError(f"model.architecture={cfg.architecture!r} is not one of {sorted(ARCHITECTURES)}.")
  return ARCHITECTURES[cfg.architecture](cfg, rngs=rngs)


def count_params(config) -> tuple[int, int]:
  """(total, active per token) parameter counts, computed on abstract shapes (nothing allocated).

  Active counts every parameter except the routed experts a token does not use:
  `experts_per_token / n_routed_experts` of each MoE layer's routed-expert weights, and of an Engram
  n-gram table only the rows a token reads (one per n-gram head).
  """
  cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_config(config)
  abstract = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
  total, routed, unread = 0, 0, 0
  for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    size = int(np.prod(leaf.shape))
    total += size
    if any(str(p).startswith("experts_") for p in path):
      routed += size
    if "ngram_embedding" in path:
      unread += size - (cfg.ngram_size - 1) * cfg.ngram_heads_per_order * leaf.shape[-1]
  active = total - routed + routed * cfg.experts_per_token // cfg.n_routed_experts - unread
  return total, active


__all__ = ["ARCHITECTURES", "Decoder", "DecoderLayer", "LayerOutput", "DeepseekV4", "GlmMoeDsa", "ModelConfig",
           "ModelOutput", "Qwen4Exp", "build", "count_params", "generate"]
