"""The Pallas (Mosaic GPU) kernels behind the `"pallas"` backend of `hyscale_jax.ops.grouped_matmul`."""

from pallas_kernels.grouped_matmul.autotune import Config, set_autotune
from pallas_kernels.grouped_matmul.grouped_matmul import (
    check_supported,
    grouped_matmul_pallas,
    transposed_grouped_matmul_pallas,
)

__all__ = ["Config", "check_supported", "grouped_matmul_pallas", "set_autotune",
           "transposed_grouped_matmul_pallas"]
