"""The device mesh from `config.mesh`, and multi-process start-up."""

from __future__ import annotations

import logging
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hyscale_jax.sharding import BATCH_AXES, CONTEXT_AXIS

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
# Keys of config.mesh that are not axis sizes.
_NOT_AXES = ("rules",)


def maybe_initialize_distributed() -> None:
  """Calls `jax.distributed.initialize()` when the environment says this is one process of many.

  It reads the coordinator from JAX's variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
  JAX_PROCESS_ID) or a cluster launcher's (SLURM, Open MPI), so one command serves every host.
  """
  env = os.environ
  many = (env.get("JAX_COORDINATOR_ADDRESS")
          or int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
  if many and not jax.distributed.is_initialized():
    jax.distributed.initialize()
    logging.info("process %d of %d", jax.process_index(), jax.process_count())


def mesh_shape(mesh_config, n_devices: int) -> dict[str, int]:
  """Axis sizes from `config.mesh` (one -1 takes the rest); their product must divide the devices."""
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  unknown = sorted(set(mesh_config.keys()) - set(MESH_AXES) - set(_NOT_AXES))
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {unknown}; the axes are {MESH_AXES}.")
  rest = [a for a, s in sizes.items() if s == -1]
  if len(rest) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f"config.mesh={sizes}: sizes must be >= 1, with at most one -1 (the rest).")
  known = math.prod(s for s in sizes.values() if s != -1)
  if rest:
    if n_devices % known:
      raise ValueError(f"config.mesh={sizes}: {n_devices} devices do not divide by {known}.")
    sizes[rest[0]] = n_devices // known
  total = math.prod(sizes.values())
  if total > n_devices:
    raise ValueError(f"config.mesh={sizes} needs {total} devices; {n_devices} are available.")
  return sizes


def make_mesh(mesh_config) -> jax.sharding.Mesh:
  """The mesh over the first prod(sizes) devices, every axis Auto (XLA places what is unsharded)."""
  sizes = mesh_shape(mesh_config, jax.device_count())
  devices = np.asarray(jax.devices()[: math.prod(sizes.values())])
  return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def batch_sharding(mesh) -> NamedSharding:
  """[B, T, ...] arrays: batch over data x fsdp x expert, sequence over context."""
  return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))


def global_batch(mesh, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """This process's rows of a global batch, placed as global arrays sharded by `batch_sharding`."""
  sharding = batch_sharding(mesh)
  out = {}
  for name, value in batch.items():
    rows = value.shape[0] // jax.process_count()
    local = value[jax.process_index() * rows : (jax.process_index() + 1) * rows]
    out[name] = jax.make_array_from_process_local_data(sharding, local, value.shape)
  return out
