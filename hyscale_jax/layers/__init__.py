"""Layers: Flax NNX modules for indexers, attention and MoE, one file per family."""

from hyscale_jax.layers.indexer import LightningIndexer
from hyscale_jax.layers.mla import MLASparseAttention
from hyscale_jax.layers.mlp import MLP
from hyscale_jax.layers.moe import MoE, RouterBias, update_router_bias

__all__ = ["LightningIndexer", "MLASparseAttention", "MLP", "MoE", "RouterBias", "update_router_bias"]
