"""Whether this process runs on a Hopper GPU (sm_90), where the Mosaic GPU kernels (wgmma, TMA) apply."""

from __future__ import annotations

import jax


def require_hopper(what: str) -> None:
  """Raises NotImplementedError, naming `what`, unless JAX's default device is a Hopper GPU (sm_90)."""
  if jax.default_backend() != "gpu":
    raise NotImplementedError(f"{what}: needs a GPU, the default backend is {jax.default_backend()!r}.")
  device = jax.devices()[0]
  capability = str(getattr(device, "compute_capability", ""))
  if not capability.startswith("9."):
    raise NotImplementedError(f"{what}: the Mosaic GPU kernels need Hopper (sm_90), got compute capability "
                              f"{capability!r} ({device.device_kind}).")


def on_hopper() -> bool:
  """Whether JAX's default device is a Hopper GPU (sm_90)."""
  try:
    require_hopper("")
  except NotImplementedError:
    return False
  return True
