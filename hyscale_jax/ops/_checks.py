"""Argument checks shared by the public ops: every message names the argument and its shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


_INT32 = np.iinfo(np.int32)


def check_rank(name: str, x, rank: int, letters: str) -> None:
  """An array of rank `rank` with no zero-length axis."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array of shape [{letters}], got {type(x).__name__}.")
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} [{letters}], got {name}.shape={tuple(x.shape)}.")
  if 0 in x.shape:
    raise ValueError(f"{name}.shape={tuple(x.shape)} [{letters}] has an empty axis; every axis needs >= 1.")


def check_dim(name: str, x, axis: int, expected: int, what: str) -> None:
  if x.shape[axis] != expected:
    raise ValueError(
        f"{name}.shape={tuple(x.shape)}: dimension {axis} ({what}) must be {expected}."
    )


def check_float(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating dtype, got {name}.dtype={x.dtype}.")


def check_int(name: str, x) -> None:
  """An integer array; concrete 64-bit values must fit in int32 (JAX computes in int32 and would wrap)."""
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer dtype, got {name}.dtype={x.dtype}.")
  if np.dtype(x.dtype).itemsize > 4 and not isinstance(x, jax.core.Tracer):
    values = np.asarray(x)
    if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
      raise ValueError(f"{name} ({name}.dtype={x.dtype}) holds values outside int32: "
                       f"[{values.min()}, {values.max()}].")


def check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {name}={value!r}.")


def check_scalar_int(name: str, value) -> None:
  """Accepts a Python int or a 0-d integer array (traced values allowed, e.g. inside shard_map)."""
  if isinstance(value, bool):
    raise ValueError(f"{name} must be an int, got {name}={value!r}.")
  if isinstance(value, (int, np.integer)):
    if not _INT32.min <= value <= _INT32.max:
      raise ValueError(f"{name}={value} does not fit in int32.")
    return
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0 and jnp.issubdtype(
      value.dtype, jnp.integer
  ):
    return
  shape = getattr(value, "shape", None)
  raise ValueError(f"{name} must be an int or a 0-d integer array, got {name}={value!r} ({shape=}).")


def check_static_float(name: str, value) -> None:
  """A finite Python (or NumPy scalar) number; arrays, bools, strings, NaN and inf are rejected."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
    raise ValueError(f"{name} must be a Python float, got {name}={value!r}.")
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {name}={value!r}.")


def check_segment_ids(segment_ids, B: int, Tq: int, Tk: int) -> None:
  """`segment_ids` is None or a pair (q_seg int[B, Tq], kv_seg int[B, Tk])."""
  if segment_ids is None:
    return
  if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
    raise ValueError(f"segment_ids must be a pair (q_seg [B, Tq], kv_seg [B, Tk]), got {segment_ids!r}.")
  for name, seg, shape in (("q_seg", segment_ids[0], (B, Tq)), ("kv_seg", segment_ids[1], (B, Tk))):
    check_rank(f"segment_ids {name}", seg, 2, "B, T")
    check_int(f"segment_ids {name}", seg)
    if tuple(seg.shape) != shape:
      raise ValueError(f"segment_ids {name}.shape={tuple(seg.shape)} must be {shape}.")
