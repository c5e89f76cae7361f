"""Jaxpr walking for the memory and structure tests (every equation, sub-jaxprs included), and
exporting a function's GPU kernels for an abstract H200 on this CPU."""

import jax
import numpy as np


def export_for_h200(fn, *args):
  """`fn` exported for CUDA on this CPU: Pallas lowers its kernels for an abstract H200, to Triton IR
  (Triton's own compile to PTX is left to the device) or through Mosaic GPU's lowering (layouts, the
  warpgroup MMA, TMA and its shared-memory check). Mosaic GPU reads the device from `jax.devices()`:
  use the `fake_hopper` fixture (tests/conftest.py) for its kernels."""
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200, axis_types=(jax.sharding.AxisType.Auto,))
  kernels = [jax.export.DisabledSafetyCheck.custom_call(name)
             for name in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")]
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=kernels)(*args)


def _as_jaxpr(value):
  """The Jaxpr inside a Jaxpr or ClosedJaxpr, else None."""
  if hasattr(value, "eqns"):
    return value
  if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    return value.jaxpr
  return None


def equations(jaxpr):
  """Every equation of `jaxpr` and, recursively, of the jaxprs in its equations' params
  (jit/closed_call/while/cond bodies, custom_vjp functions, pallas_call kernels)."""
  for eqn in _as_jaxpr(jaxpr).eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if _as_jaxpr(sub) is not None:
          yield from equations(sub)


def largest_intermediate(jaxpr) -> int:
  """The largest output aval, in elements, over all equations (sub-jaxprs included)."""
  return max(int(np.prod(getattr(v.aval, "shape", ()))) for e in equations(jaxpr) for v in e.outvars)


def lowers_to_loop(fn, *args) -> bool:
  """Whether `fn` lowers to a StableHLO while loop, whose steps a GPU runs as launches one after
  another (a lax.scan that is not unrolled, jnp.searchsorted's default method)."""
  return "stablehlo.while" in jax.jit(fn).lower(*args).as_text()
