"""The largest buffers at a jitted step's memory peak, from an XLA dump (how the 512K chunk sizes were found).

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_as_text" \
        python train.py ...            # compiles (and may run out of memory: the dump is written first)
    python bench/xla_peak_buffers.py /tmp/dump --module train_step --lines 45

Prints the head of each matching `*memory-usage-report.txt` that XLA's GPU compiler writes: the
total, then buffers by size with the shapes that share each one.
"""

import argparse
import glob
import os


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("dump_dir")
  parser.add_argument("--module", default="train_step", help="a fragment of the jitted function's name")
  parser.add_argument("--lines", type=int, default=45, help="lines of each report to print")
  args = parser.parse_args(argv)
  reports = sorted(glob.glob(os.path.join(args.dump_dir, f"*{args.module}*memory-usage-report.txt")))
  if not reports:
    raise SystemExit(f"no *{args.module}*memory-usage-report.txt under {args.dump_dir}: was XLA_FLAGS set "
                     "with --xla_dump_to and --xla_dump_hlo_as_text?")
  for path in reports:
    print("==", os.path.basename(path))
    with open(path) as f:
      print("".join(f.readlines()[:args.lines]))


if __name__ == "__main__":
  main()
