"""The `gated_delta_rule` op: Gated DeltaNet's recurrence, computed chunkwise (WY/UT form)."""

from hyscale_jax.ops.gated_delta_rule.api import REGISTRY, gated_delta_rule
from hyscale_jax.ops.gated_delta_rule.reference import (
    gated_delta_rule_reference,
    gated_delta_rule_xla_baseline,
)

__all__ = ["REGISTRY", "gated_delta_rule", "gated_delta_rule_reference", "gated_delta_rule_xla_baseline"]
