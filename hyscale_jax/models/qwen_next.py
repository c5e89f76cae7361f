"""Qwen3.8-Flash-Next (`qwen4_exp`): gated GQA with QSA on the attention layers, and MoE."""

from __future__ import annotations

from flax import nnx

from hyscale_jax.layers.qsa import QSAAttention
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.decoder import Decoder


class Qwen4Exp(Decoder):
  """The Qwen3.8-Flash-Next language model; layer i's mixer comes from `layer_types[i]`.

  Only "qsa" layers are implemented: Gated DeltaNet ("gated_deltanet", 3 of every 4 layers in the
  published model) raises NotImplementedError, so the `tiny` config stacks QSA layers only. Not
  implemented either (README feature table): hyper-connections, the Engram n-gram embedding, the
  shared expert's sigmoid gate, MTP, and MRoPE (it reduces to 1-D RoPE for text).
  """

  def make_attention(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.layer_types[layer] != "qsa":
      raise NotImplementedError(
          f"layer {layer} is {cfg.layer_types[layer]!r}: Gated DeltaNet is not implemented; "
          "use layer_types of 'qsa' only (as configs/qwen3_8_flash_next.py:tiny does).")
    return QSAAttention(cfg, rngs=rngs)
