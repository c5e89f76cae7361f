"""Device timing shared by the bench scripts."""

import time

import jax
import numpy as np


def timed(fn, *args, reps=5, warmup=True):
  """Median seconds of `fn(*args)` after a warm-up call, synchronised with block_until_ready."""
  if warmup:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))
