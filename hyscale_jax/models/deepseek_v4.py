"""DeepSeek-V4 (`deepseek_v4`): shared-KV MQA with sinks over SWA / CSA / HCA layers, and MoE."""

from __future__ import annotations

from flax import nnx

from hyscale_jax.layers.compressed_attention import CompressedSparseAttention
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.decoder import Decoder


class DeepseekV4(Decoder):
  """The DeepSeek-V4 language model; layer i's kind comes from `compress_ratios[i]`.

  Not implemented (README feature table): mHC hyper-connections (plain residuals here), hash
  routing of the first MoE layers (all layers route by score), MTP, YaRN scaling of the
  compressed layers' RoPE, and the SwiGLU clamp.
  """

  def make_attention(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    return CompressedSparseAttention(cfg, cfg.layer_kind(layer), cfg.compress_ratios[layer], rngs=rngs)
