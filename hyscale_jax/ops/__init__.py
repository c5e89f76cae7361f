"""Public functional ops. Each dispatches by `backend=` name to an implementation in its registry."""

from hyscale_jax.ops._describe import describe, describe_line
from hyscale_jax.ops.causal_attention import causal_attention
from hyscale_jax.ops.flash_topk import TopK, flash_topk
from hyscale_jax.ops.gated_delta_rule import gated_delta_rule
from hyscale_jax.ops.grouped_matmul import grouped_matmul
from hyscale_jax.ops.indexer_loss import indexer_loss
from hyscale_jax.ops.sparse_attention import sparse_attention

__all__ = ["TopK", "causal_attention", "describe", "describe_line", "flash_topk", "gated_delta_rule",
           "grouped_matmul", "indexer_loss", "sparse_attention"]
