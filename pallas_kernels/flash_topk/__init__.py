"""The Pallas main pass behind the `"pallas"` backend of `hyscale_jax.ops.flash_topk`."""

from pallas_kernels.flash_topk.flash_topk import (
    Candidates, Config, flash_topk_candidates, next_power_of_two,
)
from pallas_kernels.flash_topk.select import select_candidates

__all__ = ["Candidates", "Config", "flash_topk_candidates", "next_power_of_two", "select_candidates"]
