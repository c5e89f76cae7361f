"""Helpers shared by the bench scripts: checks on poisoned memory, failures as rows, logging, results files.

Timing lives beside it in bench/timing.py.
"""

import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np


def log(*args) -> None:
  """Prints `args` after the wall-clock time, flushed: the progress lines of long runs."""
  print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}]", *args, flush=True)


def poison(*trees) -> None:
  """Fills, then frees, NaN buffers the size of the arrays (or ShapeDtypeStructs) in `trees`, None
  skipped, for the allocator to hand out next: an output element a kernel forgets to write then most
  likely reads back as NaN rather than as a stale correct value."""
  for a in jax.tree.leaves(trees):
    jnp.full(a.shape, jnp.nan, a.dtype).block_until_ready().delete()


@jax.jit
def _squared_sums(a, b):
  # One fused reduction per array: no f32 copies of (up to 20 GB of) gradients.
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.sum((a - b) ** 2), jnp.sum(b**2)


def rel_err(a, b) -> float:
  """||a - b|| / ||b|| over every array of the pytrees `a` and `b` (Frobenius norms, summed in f32)."""
  num = den = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    n, d = _squared_sums(jnp.asarray(x), jnp.asarray(y))
    num, den = num + float(n), den + float(d)
  return float(np.sqrt(num / max(den, 1e-30)))


def is_oom(err: Exception) -> bool:
  """Whether `err` is the device running out of memory (XLA's RESOURCE_EXHAUSTED or an allocator's)."""
  text = str(err)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def error_text(err: Exception, limit: int = 300) -> str:
  """A failed row's `error`: "OOM" or the exception's type, then the first line of its message."""
  lines = str(err).splitlines()
  return f"{'OOM' if is_oom(err) else type(err).__name__}: {(lines[0] if lines else '')[:limit]}"


def compiled_memory(compiled) -> dict:
  """A compiled program's `memory_analysis()` in bytes, with `total_bytes` = arguments + outputs -
  aliased + temporaries (what it needs on the device, the allocator's fragmentation aside); {} where
  the backend reports none."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")
  out = {f: int(getattr(analysis, f, 0) or 0) for f in fields}
  out["total_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] - out["alias_size_in_bytes"]
                        + out["temp_size_in_bytes"])
  return out


def _jsonable(x):
  return x.item() if hasattr(x, "item") else str(x)  # numpy scalars; anything else by its name


def write_json(path, data) -> None:
  """Writes `data` to `path` as JSON (indent 1; numpy scalars as numbers), making its folder; nothing
  when `path` is empty or None."""
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(data, f, indent=1, default=_jsonable)


def write_rows(path, rows, **fields) -> None:
  """Writes {"device": this device's kind, **fields, "rows": rows} to `path` (nothing when it is empty)."""
  write_json(path, dict(device=jax.devices()[0].device_kind, **fields, rows=rows))


class Results:
  """Rows rewritten to `path` after each one, so a killed run keeps them (JSON: device, date, rows).

  With `append`, the rows already in `path` stay in front.
  """

  def __init__(self, path, append: bool = False):
    self.path = path
    self.data = dict(device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(), rows=[])
    if append and path and os.path.exists(path):
      with open(path) as f:
        self.data["rows"] = json.load(f)["rows"]

  def add(self, row: dict) -> None:
    self.data["rows"].append(row)
    self.write()

  def write(self) -> None:
    write_json(self.path, self.data)
