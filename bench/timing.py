"""Device timing shared by the bench scripts.

On a GPU, `timed` reads the device's own timestamps: the calls run under `jax.profiler.trace`, a
pause apart, and each call's time is the span from its first kernel's start to its last kernel's
end on the device planes of the trace (CUPTI's records, as CUDA events around the call would give),
so host launch and synchronisation costs are not in it. Elsewhere (the CPU) it is the wall clock
to `block_until_ready`.
"""

import glob
import os
import tempfile
import time

import jax
import numpy as np

from bench.common import error_text

# "device" (the default) or "wall": HYSCALE_BENCH_TIMING=wall times by the host's clock on a GPU too,
# for sweeps of many short rows where a profiler session per row costs more than it tells.
METHOD = os.environ.get("HYSCALE_BENCH_TIMING", "device")
# Host pause between timed calls: the device idles this long, so the calls' kernels separate by gaps
# above half of it, and no call's own kernels are that far apart (a while loop's host round trip
# takes tens of microseconds).
PAUSE_S = 0.02


def split_spans(intervals, gap_ns: float) -> list[float]:
  """Nanoseconds from first start to last end of each group of (start_ns, end_ns) intervals that the
  device ran without an idle gap above `gap_ns`; the groups in time order."""
  spans, first, last = [], None, None
  for start, end in sorted(intervals):
    if first is not None and start - last > gap_ns:
      spans.append(last - first)
      first = None
    if first is None:
      first, last = start, end
    last = max(last, end)
  if first is not None:
    spans.append(last - first)
  return spans


def device_spans(run, reps: int) -> list[float] | None:
  """Seconds on the device of each of `reps` calls of `run()` (which blocks until its outputs are
  ready), from a profiler trace; None when the trace has no device events or not one group per call."""
  from jax.profiler import ProfileData  # noqa: PLC0415

  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(reps):
        run()
        time.sleep(PAUSE_S)
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return None
    data = ProfileData.from_file(files[0])
  intervals = [(e.start_ns, e.start_ns + e.duration_ns) for plane in data.planes
               if plane.name.startswith("/device:") for line in plane.lines for e in line.events]
  spans = split_spans(intervals, PAUSE_S * 1e9 / 2)
  return [s * 1e-9 for s in spans] if len(spans) == reps else None


def timed(fn, *args, reps=5, warmup=True):
  """Median seconds of `fn(*args)` after a warm-up call: the device's time on a GPU (`device_spans`),
  else the wall clock to block_until_ready (also on a GPU with HYSCALE_BENCH_TIMING=wall, or if the
  trace gives no one span per call, with a note)."""
  run = lambda: jax.block_until_ready(fn(*args))
  if warmup:
    run()
  if METHOD not in ("device", "wall"):
    raise ValueError(f"HYSCALE_BENCH_TIMING={METHOD!r} must be 'device' or 'wall'.")
  if METHOD == "device" and jax.devices()[0].platform == "gpu":
    spans = device_spans(run, reps)
    if spans is not None:
      return float(np.median(spans))
    print("timing: the profiler trace gave no one device span per call; wall clock instead", flush=True)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def timed_or_report(label, fn, *args, reps=5):
  """(median seconds, fn's outputs), or None after printing `label` and why it did not run (OOM, an
  error compiling): for sweeps where one failed row must not end the run."""
  try:
    seconds = timed(fn, *args, reps=reps)
    return seconds, fn(*args)
  except Exception as e:  # noqa: BLE001 (an OOM or a kernel that does not compile is a row)
    print(f"{label}: {error_text(e, 160)}", flush=True)
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
