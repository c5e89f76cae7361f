"""The `grouped_matmul` op: per-group matmuls over consecutive rows (MoE experts)."""

from hyscale_jax.ops.grouped_matmul.api import REGISTRY, grouped_matmul
from hyscale_jax.ops.grouped_matmul.reference import (
    grouped_matmul_reference,
    transposed_grouped_matmul_reference,
)

__all__ = ["REGISTRY", "grouped_matmul", "grouped_matmul_reference", "transposed_grouped_matmul_reference"]
