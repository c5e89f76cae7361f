"""The `indexer_loss` op: KL distillation of the lightning indexer (sparse and dense forms)."""

from hyscale_jax.ops.indexer_loss.api import REGISTRY, indexer_loss
from hyscale_jax.ops.indexer_loss.reference import indexer_loss_reference

__all__ = ["REGISTRY", "indexer_loss", "indexer_loss_reference"]
