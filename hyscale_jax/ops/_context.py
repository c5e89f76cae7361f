"""Context parallelism inside the ops: under a mesh with a "context" axis, split the sequence.

When the ambient mesh (`jax.set_mesh`) has a `context` axis of size n > 1, an op runs under
`jax.shard_map`: the query-side arrays are split contiguously over `context` along the sequence
(and the batch over `data`/`fsdp`/`expert` when present), the key-side arrays are all-gathered, and each
device runs the single-device implementation on its rows at their absolute positions. The result
is the same function of the global arrays as without the mesh (bit for bit where the per-row
arithmetic is exact). Under autodiff the all-gather's transpose reduce-scatters the key gradients
back to their owners.
"""

from __future__ import annotations

import contextlib
import threading

import jax
from jax.sharding import PartitionSpec as P

from hyscale_jax.sharding import BATCH_AXES, CONTEXT_AXIS


_ONE_DEVICE = threading.local()


@contextlib.contextmanager
def shard_map_on_one_device():
  """While active, a `context` axis of size 1 also takes the shard_map path (same results).

  For exercising the context-parallel lowering on a single device (bench/context_parallel.py);
  training leaves it off, since a 1-way split only adds the shard_map boundary. The ops decide
  inside their jitted bodies, whose trace caches do not see this switch, so entering and leaving
  it clears JAX's caches (everything traced afterwards recompiles).
  """
  previous = getattr(_ONE_DEVICE, "on", False)
  jax.clear_caches()
  _ONE_DEVICE.on = True
  try:
    yield
  finally:
    _ONE_DEVICE.on = previous
    jax.clear_caches()


def context_mesh():
  """The ambient mesh when it splits the sequence (a `context` axis of size > 1), else None.

  Under `shard_map_on_one_device()` a `context` axis of size 1 counts too.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
    return None
  axis_type = dict(zip(mesh.axis_names, mesh.axis_types))[CONTEXT_AXIS]
  if axis_type == jax.sharding.AxisType.Manual:  # already inside a shard_map over the axis
    return None
  return mesh if mesh.shape[CONTEXT_AXIS] > 1 or getattr(_ONE_DEVICE, "on", False) else None


def _batch_axes(mesh) -> tuple[str, ...]:
  return tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def token_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that split [B, T] rows under `run_sequence_sharded` (for psums over all rows)."""
  return _batch_axes(mesh) + (CONTEXT_AXIS,)


def run_sequence_sharded(per_shard, mesh, *, sharded, gathered=(), replicated=(), n_out: int,
                         reduced: bool = False):
  """Runs `per_shard(row_offset, sharded, gathered, replicated)` on every device of `mesh`.

  Args:
    per_shard: the single-device computation; `row_offset` is the shard's first global row, the
      sharded arrays are the local rows [B/b, T/n, ...], the gathered ones whole [B/b, S, ...].
    mesh: from `context_mesh()`.
    sharded, gathered: [B, T or S, ...] arrays (or None) split along axis 1 over `context`.
    replicated: arrays (or None) every device sees whole.
    n_out: how many [B, T, ...] outputs per_shard returns (split like the sharded inputs).
    reduced: per_shard instead returns one value already reduced over `token_axes(mesh)` (a
      psum), the same on every device.
  """
  batch = _batch_axes(mesh) or None
  spec = P(batch, CONTEXT_AXIS)
  n_s, n_g = len(sharded), len(gathered)

  def body(*args):
    local, full, rest = args[:n_s], args[n_s : n_s + n_g], args[n_s + n_g :]
    full = [None if x is None else jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True) for x in full]
    offset = jax.lax.axis_index(CONTEXT_AXIS) * local[0].shape[1]
    return per_shard(offset, local, full, rest)

  specs = [None if x is None else spec for x in (*sharded, *gathered)]
  specs += [None if x is None else P() for x in replicated]
  out_specs = P() if reduced else spec if n_out == 1 else (spec,) * n_out
  return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs, check_vma=False)(
      *sharded, *gathered, *replicated)
