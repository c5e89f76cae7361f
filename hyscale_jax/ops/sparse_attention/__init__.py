"""The `sparse_attention` op: attention over per-query selected key indices."""

from hyscale_jax.ops.sparse_attention.api import REGISTRY, sparse_attention
from hyscale_jax.ops.sparse_attention.reference import (
    attention_logits_at,
    sparse_attention_reference,
)

__all__ = ["REGISTRY", "attention_logits_at", "sparse_attention", "sparse_attention_reference"]
