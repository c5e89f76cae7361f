"""The `causal_attention` op: dense causal attention (the warm-up stage) streamed over key blocks."""

from hyscale_jax.ops.causal_attention.api import REGISTRY, causal_attention
from hyscale_jax.ops.causal_attention.reference import (
    causal_attention_reference,
    causal_attention_xla_baseline,
)

__all__ = ["REGISTRY", "causal_attention", "causal_attention_reference", "causal_attention_xla_baseline"]
