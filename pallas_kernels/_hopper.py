"""Whether this process runs on a Hopper GPU (sm_90), where the Mosaic GPU kernels (wgmma, TMA) apply,
and what those kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


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


def smem_transforms(minor: int, dtype) -> tuple:
  """Shared-memory tiling and swizzle of a TMA block whose minor axis holds `minor` elements of `dtype`:
  the widest swizzle the row allows (128 bytes from 64 bf16 columns), in tiles of 8 rows, which is what
  the warpgroup MMA reads without bank conflicts."""
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
