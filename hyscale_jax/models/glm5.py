"""GLM-5 / GLM-5.1 (`glm_moe_dsa`): an MLA + DSA decoder with dense-then-MoE feed-forward layers."""

from __future__ import annotations

from flax import nnx

from hyscale_jax.layers.mla import MLASparseAttention
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.decoder import Decoder


class GlmMoeDsa(Decoder):
  """The GLM-5.1 language model: MLA in absorbed form with the DSA indexer (IndexShare-aware)."""

  def make_attention(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    return MLASparseAttention(cfg, has_indexer=cfg.has_indexer(layer), rngs=rngs)

  def make_mtp_attention(self, cfg: ModelConfig, depth: int, rngs: nnx.Rngs) -> nnx.Module:
    # The MTP block selects for itself: it runs after the main stack, with no IndexShare neighbour.
    return MLASparseAttention(cfg, has_indexer=True, rngs=rngs)
