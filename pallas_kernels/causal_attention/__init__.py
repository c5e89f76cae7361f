"""JAX's Triton flash-attention kernel behind the `"pallas"` backend of `hyscale_jax.ops.causal_attention`."""

from pallas_kernels.causal_attention.causal_attention import (
    Config,
    causal_attention_backward_pallas,
    causal_attention_forward_pallas,
)

__all__ = ["Config", "causal_attention_backward_pallas", "causal_attention_forward_pallas"]
