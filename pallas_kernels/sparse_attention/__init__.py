"""The Pallas kernels behind the `"pallas"` backend of `hyscale_jax.ops.sparse_attention`."""

from pallas_kernels.sparse_attention.sparse_attention import (
    Config,
    attention_teacher_pallas,
    sparse_attention_backward_pallas,
    sparse_attention_forward_pallas,
)

__all__ = ["Config", "attention_teacher_pallas", "sparse_attention_backward_pallas",
           "sparse_attention_forward_pallas"]
