"""Layers: Flax NNX modules for indexers, compressors, attention and MoE, one file per family."""

from hyscale_jax.layers.indexer import LightningIndexer

__all__ = ["LightningIndexer"]
