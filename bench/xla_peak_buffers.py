"""The largest buffers at a jitted step's memory peak, from an XLA dump (how the 512K chunk sizes were found).

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_as_text" \
        python train.py ...            # compiles (and may run out of memory: the dump is written first)
    python -m bench.xla_peak_buffers /tmp/dump --module train_step --lines 45
    python -m bench.xla_peak_buffers /tmp/mp --module step --live 1   # python -m bench.memory_proxy --dump /tmp/mp
    python -m bench.xla_peak_buffers --smoke --out /tmp/peak.json     # dumps a small step of its own (CPU)

Prints the head of each matching `*memory-usage-report.txt` that XLA's compiler writes: the
total, then buffers by size with the shapes that share each one. With `--live GIB` it also reads
the module's `*-buffer-assignment.txt` and `*-live-range.txt` and prints the values of the
temporary allocation live at the schedule's peak (at least GIB each), with their live ranges: what
is held there, as against the heap's packed size that the report totals. `--out` writes one row per
report (its total bytes and, with `--live`, the peak and the values live there). `--smoke` compiles a
small value_and_grad step, `smoke_step`, with XLA dumping into a temporary folder, and reads that.
"""

import argparse
import glob
import os
import re
import tempfile

from bench.common import write_json


def _temp_values(assignment: str) -> dict:
  """{(instruction, shape index): (bytes, offset, shape)} of the preallocated temporary allocation."""
  temp = assignment.split("preallocated-temp:")[1].split("\nallocation")[0]
  pattern = r"value: <\d+ ([^\s{]+)(\{[\d,]*\})? @\S*> \(size=(\d+),offset=(\d+)\): (\S+)"
  return {(name, index or "{}"): (int(size), int(offset), shape)
          for name, index, size, offset, shape in re.findall(pattern, temp)}


def _live_ranges(live_range: str) -> dict:
  """{(instruction, shape index): (first, last) schedule positions}."""
  ranges = live_range.split("BufferLiveRange:")[1]
  return {(name, "{" + index + "}"): (int(a), int(b))
          for name, index, a, b in re.findall(r"^\s+(\S+?)\{(\S*)\}:(\d+)-(\d+)", ranges, re.M)}


def live_at_peak(assignment: str, live_range: str):
  """(peak position, bytes live there, [(bytes, first, last, instruction, shape)] live there), where the
  bytes are the union of the live values' [offset, offset + size) in the temporary allocation."""
  values, ranges = _temp_values(assignment), _live_ranges(live_range)
  items = [(size, offset, *ranges[key], key[0], shape) for key, (size, offset, shape) in values.items()
           if key in ranges]

  def held(t):
    total, covered = 0, -1
    for lo, hi in sorted((o, o + s) for s, o, a, b, *_ in items if a <= t <= b):
      lo = max(lo, covered)
      if hi > lo:
        total, covered = total + hi - lo, hi
    return total

  # The peak is where some large value starts or ends; the largest values' ends are enough to look at.
  largest = sorted(items, key=lambda v: -v[0])[:200]
  candidates = sorted({a for _, _, a, _, *_ in largest} | {b for _, _, _, b, *_ in largest})
  peak = max(candidates, key=held, default=0)
  live = sorted(((s, a, b, name, shape) for s, o, a, b, name, shape in items if a <= peak <= b), reverse=True)
  return peak, held(peak), live


def report(path: str, lines: int, live: float | None) -> dict:
  """Prints the head of one memory-usage report and, with `live` (GiB), the values of at least that
  size live at the schedule's peak; returns the row (bytes)."""
  print("==", os.path.basename(path))
  with open(path) as f:
    text = f.readlines()
  print("".join(text[:lines]))
  total = re.search(r"Total bytes: (\d+)", "".join(text))
  row = dict(report=os.path.basename(path), total_bytes=int(total.group(1)) if total else None)
  if live is None:
    return row
  stem = path[:-len("memory-usage-report.txt")]
  with open(stem + "buffer-assignment.txt") as f, open(stem + "live-range.txt") as g:
    peak, held, values = live_at_peak(f.read(), g.read())
  print(f"live at schedule position {peak}: {held / 2**30:.1f} GiB")
  shown = [v for v in values if v[0] >= live * 2**30]
  for size, first, last, name, shape in shown:
    print(f"  {size / 2**30:7.2f} GiB  {first:6d}-{last:<6d} {name} {shape}")
  return dict(row, peak_position=peak, live_bytes=held,
              live=[dict(bytes=size, first=first, last=last, instruction=name, shape=shape)
                    for size, first, last, name, shape in shown])


def smoke_dump(folder: str) -> None:
  """Compiles `smoke_step` (value_and_grad of a two-matmul MLP's loss) with XLA dumping it as text into `folder`."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={folder}"
                             " --xla_dump_hlo_module_re=.*smoke_step.* --xla_dump_hlo_as_text").strip()
  import jax  # noqa: PLC0415 (XLA reads the flags when its backend starts, on the first compile)
  import jax.numpy as jnp  # noqa: PLC0415

  jax.config.update("jax_enable_compilation_cache", False)  # a program from the persistent cache dumps nothing

  def loss(w1, w2, x):
    return jnp.mean(jnp.square(jnp.tanh(x @ w1) @ w2 - x))

  @jax.jit
  def smoke_step(w1, w2, x):
    return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)

  smoke_step.lower(jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((128, 64))).compile()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("dump_dir", nargs="?", help="the folder of --xla_dump_to")
  parser.add_argument("--module", default="train_step", help="a fragment of the jitted function's name")
  parser.add_argument("--lines", type=int, default=45, help="lines of each report to print")
  parser.add_argument("--live", type=float, default=None, metavar="GIB",
                      help="also the values live at the schedule's peak, those of at least GIB")
  parser.add_argument("--out", default=None, help="a JSON file for the rows")
  parser.add_argument("--smoke", action="store_true", help="dump and read a small step of its own, in seconds")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    if args.smoke:
      args.dump_dir, args.module, args.live = tmp, "smoke_step", 0.0
      smoke_dump(tmp)
    elif args.dump_dir is None:
      parser.error("give the dump folder (or --smoke)")
    reports = sorted(glob.glob(os.path.join(args.dump_dir, f"*{args.module}*memory-usage-report.txt")))
    if not reports:
      raise SystemExit(f"no *{args.module}*memory-usage-report.txt under {args.dump_dir}: was XLA_FLAGS set "
                       "with --xla_dump_to and --xla_dump_hlo_as_text?")
    rows = [report(path, args.lines, args.live) for path in reports]
  write_json(args.out, dict(dump_dir=args.dump_dir, module=args.module, rows=rows))
  return rows


if __name__ == "__main__":
  main()
