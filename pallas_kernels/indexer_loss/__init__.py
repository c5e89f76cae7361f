"""The `"pallas"` kernels of `hyscale_jax.ops.indexer_loss`'s dense form (the DSA warm-up)."""

from pallas_kernels.indexer_loss.dense import Config, dense_kl_grads_pallas, dense_kl_stats_pallas

__all__ = ["Config", "dense_kl_grads_pallas", "dense_kl_stats_pallas"]
