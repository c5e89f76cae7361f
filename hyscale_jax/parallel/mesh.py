"""The device mesh from `config.mesh`, and multi-process start-up."""

from __future__ import annotations

import functools
import hashlib
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


# How long a process waits for all the others to join, and how long the coordination service waits
# for a silent process before declaring it lost (every survivor then exits with its task named).
INIT_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 60
# Config fields that may differ between processes (host-local paths, terminal output). The files
# behind the data paths must hold the same corpus on every host.
PER_PROCESS_FIELDS = ("data.cache_dir", "data.path", "data.tokenizer", "data.offsets", "train.progress_bar")


def _env_int(name: str, default: int | None = None) -> int | None:
  value = os.environ.get(name, "")
  if not value:
    return default
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} must be an integer.") from None


def _cluster_detected() -> bool:
  """SLURM (srun) or Open MPI (mpirun) started this process as one of several.

  SLURM's step variables (set by srun, not in the batch script itself) mark a task of a step; a plain
  `python train.py` in an sbatch script of several tasks is one process.
  """
  env = os.environ
  slurm = "SLURM_STEP_NODELIST" in env and "SLURM_PROCID" in env and _env_int("SLURM_NTASKS", 1) > 1
  return slurm or _env_int("OMPI_COMM_WORLD_SIZE", 1) > 1


def maybe_initialize_distributed() -> bool:
  """Joins the other processes through `jax.distributed.initialize` when this is one process of many.

  Call before any JAX computation. Three ways to start, one command for all:
    - plain: $JAX_COORDINATOR_ADDRESS (host:port of process 0), $JAX_NUM_PROCESSES, $JAX_PROCESS_ID;
    - SLURM (`srun`) or Open MPI (`mpirun`): nothing to set, JAX's cluster detection reads their
      variables (a $JAX_COORDINATOR_ADDRESS, when also set, overrides the detected coordinator). It
      gives each process the one GPU numbered by its local rank (one process per GPU); for one
      process per node set $JAX_LOCAL_DEVICE_IDS=0,1,...
  On CPU the collectives between processes go through gloo (TCP). Timeouts: $HYSCALE_INIT_TIMEOUT_S
  (default `INIT_TIMEOUT_S`) for every process to join, $HYSCALE_HEARTBEAT_TIMEOUT_S (default
  `HEARTBEAT_TIMEOUT_S`) before a silent process is declared lost and every other one stops.

  Returns:
    Whether this run is one of several processes.

  Raises:
    ValueError: a plain start with one of the three variables missing or malformed.
  """
  env = os.environ
  plain = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
  given = [name for name in plain if env.get(name)]
  cluster = _cluster_detected()
  if not given and not cluster:
    return False
  if jax.distributed.is_initialized():
    return True
  if not cluster and len(given) < len(plain):
    missing = [name for name in plain if name not in given]
    raise ValueError(f"a multi-process start needs ${', $'.join(plain)}; {', '.join(given)} set but "
                     f"${', $'.join(missing)} missing (or start under srun / mpirun).")
  num_processes, process_id = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
  if num_processes is not None and not (num_processes >= 1 and process_id is not None
                                        and 0 <= process_id < num_processes):
    raise ValueError(f"$JAX_PROCESS_ID={process_id} must be in [0, $JAX_NUM_PROCESSES={num_processes}).")
  if not jax.config.jax_cpu_collectives_implementation:
    # Must precede the CPU backend's creation; without it CPU processes cannot exchange data.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=env.get("JAX_COORDINATOR_ADDRESS") or None,
      num_processes=num_processes, process_id=process_id,
      initialization_timeout=_env_int("HYSCALE_INIT_TIMEOUT_S", INIT_TIMEOUT_S),
      heartbeat_timeout_seconds=_env_int("HYSCALE_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S))
  logging.info("process %d of %d, %d local devices of %d", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


def _flat_fields(config, prefix: str = "") -> dict[str, str]:
  out = {}
  for key, value in sorted(config.items()):
    name = f"{prefix}{key}"
    if hasattr(value, "items"):
      out.update(_flat_fields(value, name + "."))
    elif name not in PER_PROCESS_FIELDS:
      out[name] = repr(value)
  return out


def _digest(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def check_same_config(config) -> None:
  """Stops every process when their configs differ, naming the fields (a no-op in one process).

  Each process hashes every field of `config` (except `PER_PROCESS_FIELDS`); one all-gather
  compares the hashes, a second one (only on a mismatch) finds the fields that differ.

  Raises:
    ValueError: on every process, naming the differing fields and the processes that disagree.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415 (only multi-process runs need it)

  fields = _flat_fields(config)
  names = _digest("\n".join(fields))
  whole = _digest("\n".join(f"{k}={v}" for k, v in fields.items()))
  summary = multihost_utils.process_allgather(np.asarray([len(fields), names, whole], np.int32))
  if (summary == summary[0]).all():
    return
  if not (summary[:, :2] == summary[0, :2]).all():
    raise ValueError(f"the config fields differ between processes (process {jax.process_index()} has "
                     f"{len(fields)}): start every process with the same code and config file.")
  per_field = multihost_utils.process_allgather(np.asarray([_digest(v) for v in fields.values()], np.int32))
  differ = [(name, sorted(np.nonzero(per_field[:, i] != per_field[0, i])[0].tolist()))
            for i, name in enumerate(fields) if (per_field[:, i] != per_field[0, i]).any()]
  described = "; ".join(f"config.{name} (processes {p} differ from process 0)" for name, p in differ)
  raise ValueError(f"processes were started with different configs: {described}. This process "
                   f"({jax.process_index()}) has "
                   + ", ".join(f"{name}={fields[name]}" for name, _ in differ) + ".")


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
  """The mesh over the first prod(sizes) devices, every axis Auto (XLA places what is unsharded).

  Devices are taken in `jax.devices()` order, process by process, and the last axis varies
  fastest: `tensor`, then `context`, `expert`, `fsdp` stay inside a process (a host) as long as
  their product fits its local devices, and `data` spans hosts first. With several processes the
  mesh must use every device (each process feeds its own).
  """
  sizes = mesh_shape(mesh_config, jax.device_count())
  total = math.prod(sizes.values())
  if jax.process_count() > 1 and total != jax.device_count():
    raise ValueError(f"config.mesh={sizes} uses {total} of {jax.device_count()} devices over "
                     f"{jax.process_count()} processes; a multi-process mesh must use them all (set one axis to -1).")
  devices = np.asarray(jax.devices()[:total])
  return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def batch_sharding(mesh) -> NamedSharding:
  """[B, T, ...] arrays: batch over data x fsdp x expert, sequence over context."""
  return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))


def process_rows(mesh, batch_size: int) -> np.ndarray:
  """i64[N] sorted rows of a [batch_size, ...] global batch that this process's devices hold.

  A process reads only these rows (all of them when `data`, `fsdp` and `expert` stay inside it; the
  rows of its own data shards when they span processes). Processes that split one row's sequence
  over `context` read that row each.
  """
  # Any sequence length that divides over `context` gives the same rows.
  indices = batch_sharding(mesh).addressable_devices_indices_map((batch_size, mesh.shape[CONTEXT_AXIS]))
  held = np.zeros(batch_size, dtype=bool)
  for index in indices.values():
    held[index[0]] = True
  return np.flatnonzero(held).astype(np.int64)


def global_batch(mesh, batch: dict[str, np.ndarray], *, rows=None, batch_size: int | None = None
                 ) -> dict[str, jax.Array]:
  """Global arrays sharded by `batch_sharding` from this process's rows of the global batch.

  Args:
    batch: [N, T, ...] arrays: the whole global batch (N = B) when `rows` is None, else its rows `rows`.
    rows: i64[N] sorted global row indices that `batch` holds, covering `process_rows(mesh, B)`.
    batch_size: B, the global batch size; required with `rows`.

  Each process places only the blocks of its own devices, whichever axes span processes (rows
  when `data` does, sequence chunks when `context` does).

  Raises:
    ValueError: `rows` without `batch_size`, or rows that miss one this process's devices hold.
  """
  sharding = batch_sharding(mesh)
  if rows is None:
    return {name: jax.make_array_from_callback(value.shape, sharding, lambda index, value=value: value[index])
            for name, value in batch.items()}
  if batch_size is None:
    raise ValueError("global_batch: rows= needs batch_size=, the global batch size.")
  rows = np.asarray(rows, dtype=np.int64)
  missing = np.setdiff1d(process_rows(mesh, batch_size), rows)
  if missing.size:
    raise ValueError(f"global_batch: rows={rows.tolist()} miss rows {missing.tolist()} that this process's devices hold.")

  def block(index, value):
    local = np.searchsorted(rows, np.arange(batch_size)[index[0]])
    return value[(local, *index[1:])]

  return {name: jax.make_array_from_callback((batch_size, *value.shape[1:]), sharding,
                                             functools.partial(block, value=value))
          for name, value in batch.items()}
