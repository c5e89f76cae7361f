"""The `flash_topk` op: exact top-k selection over lightning-indexer scores."""

from hyscale_jax.ops.flash_topk.api import REGISTRY, TopK, flash_topk
from hyscale_jax.ops.flash_topk.fp8 import quantize_fp8
from hyscale_jax.ops.flash_topk.reference import (
    flash_topk_reference,
    flash_topk_xla_baseline,
    index_scores,
    index_scores_at,
)

__all__ = [
    "REGISTRY",
    "TopK",
    "flash_topk",
    "flash_topk_reference",
    "flash_topk_xla_baseline",
    "index_scores",
    "index_scores_at",
    "quantize_fp8",
]
