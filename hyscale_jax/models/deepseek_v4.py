"""DeepSeek-V4 (`deepseek_v4`): shared-KV MQA with sinks over SWA / CSA / HCA layers, mHC, and MoE."""

from __future__ import annotations

from flax import nnx

from hyscale_jax.layers.compressed_attention import CompressedSparseAttention
from hyscale_jax.layers.hyper_connections import ManifoldHyperConnection, ManifoldHyperHead
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.decoder import Decoder


class DeepseekV4(Decoder):
  """The DeepSeek-V4 language model; layer i's kind comes from `compress_ratios[i]`.

  With `hc_mult` > 0 the residual is mHC streams (`ManifoldHyperConnection` around each block,
  `ManifoldHyperHead` before the final norm). The first `n_hash_layers` MoE layers route by the
  token table `tid2eid` (hash routing; the decoder passes them the token ids), and the compressed
  layers' RoPE is YaRN-scaled when the config sets `rope_yarn_factor`. MTP depths (models/mtp.py)
  take the mHC streams and are sliding-window layers (the published `compress_ratios` end with a 0
  for the MTP layer).
  """

  mtp_takes_streams = True

  def make_mtp_attention(self, cfg: ModelConfig, depth: int, rngs: nnx.Rngs) -> nnx.Module:
    return CompressedSparseAttention(cfg, "swa", 0, rngs=rngs)

  def make_attention(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    return CompressedSparseAttention(cfg, cfg.layer_kind(layer), cfg.compress_ratios[layer], rngs=rngs)

  def make_hyper_connection(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return ManifoldHyperConnection(cfg.d_model, cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                                   eps=cfg.hc_eps, norm_eps=cfg.rms_eps, rngs=rngs)

  def make_stream_head(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return ManifoldHyperHead(cfg.d_model, cfg.hc_mult, eps=cfg.hc_eps, norm_eps=cfg.rms_eps, rngs=rngs)
