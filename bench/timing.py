"""Device timing shared by the bench scripts."""

import json
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


def timed_or_report(label, fn, *args, reps=5):
  """(median seconds, fn's outputs), or None after printing `label` and why it did not run (OOM, an
  error compiling): for sweeps where one failed row must not end the run."""
  try:
    seconds = timed(fn, *args, reps=reps)
    return seconds, fn(*args)
  except Exception as e:  # noqa: BLE001 (an OOM or a kernel that does not compile is a row)
    print(f"{label}: {'OOM' if 'RESOURCE_EXHAUSTED' in str(e) else type(e).__name__}: "
          f"{str(e).splitlines()[0][:160]}", flush=True)
    return None


def against_first(first, backend, out, dq):
  """A backend's outputs against the first backend's of the same row: (row fields `max_out_diff`,
  `max_dq_diff`, the note to print, the first backend's (name, out, dq) for the next backend).
  out, dq: f32 numpy arrays; `first` None for the first backend."""
  if first is None:
    return dict(max_out_diff=None, max_dq_diff=None), "", (backend, out, dq)
  name, first_out, first_dq = first
  d_out, d_dq = float(np.abs(out - first_out).max()), float(np.abs(dq - first_dq).max())
  return dict(max_out_diff=d_out, max_dq_diff=d_dq), f", max|out - {name}| {d_out:.3g}, max|dq - {name}| {d_dq:.3g}", first


def write_rows(path, rows):
  """Writes {"device": the device kind, "rows": rows} as JSON to `path` (nothing when path is None)."""
  if path:
    with open(path, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


class CompileAhead:
  """Compiles jitted programs on a thread pool, in the order submitted.

  XLA and Triton compile off the GIL, so a sweep's dozens of programs at real dims compile
  concurrently instead of one after another. XLA autotunes on the device while compiling: callers
  that time programs `wait_all()` first.
  `submit` traces in the caller's thread (so closures bind now) and returns the abstract outputs;
  `get` waits for the executable, or raises the compile's error.
  """

  def __init__(self, workers: int):
    import concurrent.futures  # noqa: PLC0415

    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
    self._futures = {}

  def submit(self, key, jitted, *args):
    traced = jitted.trace(*args)  # closures bind here; the worker only lowers and compiles this trace
    self._futures[key] = self._pool.submit(lambda: traced.lower().compile())
    return traced.out_info

  def wait_all(self):
    """Blocks until every submitted compile has finished (XLA autotunes on the device while compiling)."""
    for future in list(self._futures.values()):
      future.exception()

  def __len__(self):
    return len(self._futures)

  def get(self, key):
    """The compiled program (dropped from the pool's table: the caller owns it)."""
    return self._futures.pop(key).result()

  def shutdown(self):
    for future in self._futures.values():
      future.cancel()
    self._pool.shutdown(wait=False, cancel_futures=True)
