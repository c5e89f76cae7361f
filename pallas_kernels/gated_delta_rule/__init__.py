"""Triton kernels of the gated delta rule's inter-chunk pass: the `"pallas"` backend of `ops.gated_delta_rule`."""

from pallas_kernels.gated_delta_rule.gated_delta_rule import (
    Config,
    check_applies,
    gated_delta_rule_scan_bwd,
    gated_delta_rule_scan_fwd,
)

__all__ = ["Config", "check_applies", "gated_delta_rule_scan_bwd", "gated_delta_rule_scan_fwd"]
