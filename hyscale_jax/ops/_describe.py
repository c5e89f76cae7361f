"""`describe`: which implementation each public op runs here, as a user would name it (for logs and banners)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyscale_jax.ops import _registry
from hyscale_jax.ops.causal_attention.api import REGISTRY as CAUSAL_ATTENTION
from hyscale_jax.ops.flash_topk.api import REGISTRY as FLASH_TOPK
from hyscale_jax.ops.gated_delta_rule.api import REGISTRY as GATED_DELTA_RULE
from hyscale_jax.ops.grouped_matmul.api import REGISTRY as GROUPED_MATMUL
from hyscale_jax.ops.indexer_loss.api import REGISTRY as INDEXER_LOSS
from hyscale_jax.ops.sparse_attention.api import REGISTRY as SPARSE_ATTENTION

# The public ops, in the order `config.ops` lists them.
REGISTRIES = {r.op_name: r for r in (FLASH_TOPK, SPARSE_ATTENTION, INDEXER_LOSS, CAUSAL_ATTENTION, GROUPED_MATMUL,
                                     GATED_DELTA_RULE)}


def describe(platform: str | None = None, backends: Mapping[str, str] | Any = None) -> dict[str, str]:
  """op name -> what it runs on `platform` (None: JAX's default backend, this device).

  E.g. {"flash_topk": "pallas (Mosaic GPU main pass from 32K keys, Triton below)", "causal_attention":
  "pallas (JAX's Triton flash attention)", ...} on a Hopper GPU, "reference (jnp)" on a CPU, and
  "reference (pallas unavailable: import ... failed: ...)" where a kernel's import failed. The kernel
  is the rule its Config states (which pass runs on Mosaic GPU from what size), not a per-shape choice;
  a "pallas" kernel that declines an input (NotImplementedError) falls back to the reference under "auto".

  Args:
    platform: "gpu", "cpu" or "tpu". Another platform than this process's is described without
      knowing its device (the Hopper-only kernels are then named with their condition).
    backends: per-op backend names (`config.ops`, read by key or attribute; a missing op is "auto"),
      or None for "auto" everywhere. Explicit names are described as they are, unavailable ones too.
  """
  here = platform or _registry.platform()
  hopper = _on_hopper(here)
  return {name: registry.describe(_backend(backends, name), here, hopper) for name, registry in REGISTRIES.items()}


def describe_line(platform: str | None = None, backends: Mapping[str, str] | Any = None) -> str:
  """`describe` as one line, "flash_topk: ...; sparse_attention: ...; ...", for a start-up banner."""
  return "; ".join(f"{name}: {what}" for name, what in describe(platform, backends).items())


def _backend(backends, name: str) -> str:
  if backends is None:
    return "auto"
  if isinstance(backends, Mapping):
    return str(backends.get(name, "auto"))
  return str(getattr(backends, name, "auto"))  # a ConfigDict, as the layers read it


def _on_hopper(platform_name: str) -> bool | None:
  """Whether this device is a Hopper GPU (Mosaic GPU kernels); None when describing another platform."""
  if platform_name != _registry.platform():
    return None
  if platform_name != "gpu":
    return False
  try:
    from pallas_kernels._hopper import on_hopper  # noqa: PLC0415 - optional: it imports Mosaic GPU
  except ImportError:
    return None
  return on_hopper()
