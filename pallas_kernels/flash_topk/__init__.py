"""The Pallas main pass behind the `"pallas"` backend of `hyscale_jax.ops.flash_topk`, and the indexer's
scores at selected keys (the indexer loss's student side)."""

from pallas_kernels._shapes import next_power_of_two
from pallas_kernels.flash_topk.flash_topk import Candidates, Config, flash_topk_candidates
from pallas_kernels.flash_topk.scores_at import index_scores_at_pallas
from pallas_kernels.flash_topk.select import from_ordered_bits, ordered_bits, select_candidates

__all__ = ["Candidates", "Config", "flash_topk_candidates", "from_ordered_bits", "index_scores_at_pallas",
           "next_power_of_two", "ordered_bits", "select_candidates"]
