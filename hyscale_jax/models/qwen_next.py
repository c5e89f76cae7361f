"""Qwen3.8-Flash-Next (`qwen4_exp`): gated GQA with QSA on the attention layers, gated residual streams, and MoE."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hyscale_jax.layers.engram import EngramLayer
from hyscale_jax.layers.gated_deltanet import GatedDeltaNet
from hyscale_jax.layers.hyper_connections import GatedResidual
from hyscale_jax.layers.norms import ZeroCenteredRMSNorm
from hyscale_jax.layers.qsa import QSAAttention
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models.decoder import Decoder


class Qwen4Exp(Decoder):
  """The Qwen3.8-Flash-Next language model; layer i's mixer comes from `layer_types[i]`.

  With `hc_mult` > 0 the residual is `GatedResidual` streams, which replace the pre-norms and the
  final norm (the final collapse is `hc_head`, transformers' `hyper_connection_mixer`); the shared
  expert is sigmoid-gated with `shared_expert_gate`. A "qsa" layer's mixer is `QSAAttention`, a
  "gated_deltanet" layer's (3 of every 4 in the published model) `GatedDeltaNet`. The layers in
  `ple_layer_ids` (one-indexed; layer 2 in the published model) first add their Engram n-gram
  embedding (`EngramLayer`) to the streams. MRoPE is 1-D RoPE here: for text its three position
  axes are equal, and then it reduces to 1-D RoPE. An MTP depth (models/mtp.py) is a "qsa" layer
  with zero-centred norms, as Qwen3-Next's.
  """

  def make_mtp_attention(self, cfg: ModelConfig, depth: int, rngs: nnx.Rngs) -> nnx.Module:
    return QSAAttention(cfg, rngs=rngs)

  def make_mtp_norm(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return ZeroCenteredRMSNorm(cfg.d_model, eps=cfg.rms_eps, param_dtype=jnp.dtype(cfg.param_dtype))

  def make_attention(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.layer_types[layer] == "gated_deltanet":
      return GatedDeltaNet(cfg, rngs=rngs)
    return QSAAttention(cfg, rngs=rngs)

  def make_layer_embedding(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module | None:
    if layer + 1 not in cfg.ple_layer_ids:
      return None
    return EngramLayer(cfg, cfg.ple_layer_ids.index(layer + 1), rngs=rngs)

  def _gated_residual(self, cfg: ModelConfig, rngs: nnx.Rngs, *, inject: bool) -> GatedResidual:
    return GatedResidual(cfg.d_model, cfg.hc_mult, cfg.hc_lowrank, eps=cfg.rms_eps, inject=inject, rngs=rngs,
                         dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))

  def make_hyper_connection(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return self._gated_residual(cfg, rngs, inject=True)

  def make_stream_head(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return self._gated_residual(cfg, rngs, inject=False)
