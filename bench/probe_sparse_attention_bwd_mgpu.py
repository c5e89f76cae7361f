"""Probe (issue #20): the Mosaic GPU sparse-attention backward against the Triton one, same process.

    python bench/probe_sparse_attention_bwd_mgpu.py --out probe.json   # mla64 16K, then 64K, then v4 16K

Each shape goes through `probe_sparse_attention_bwd.run_shape`: outputs NaN-poisoned before the
checked call, dq and dk against a gathered f32 recomputation on sampled rows and keys and against
the first variant (the Triton backward, today's heuristic), then medians of `timing.timed`. FLOPs are
TileLang's count, `2 T H k (3 Dk + 2 Dv)`.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from pallas_kernels.sparse_attention import Config  # noqa: E402
from probe_sparse_attention_bwd import run_shape, stamp  # noqa: E402

TRITON = dataclasses.replace(Config.backward_heuristics(576, 512, 2, 64, value_from_key=True), backward="triton")
VARIANTS = {"triton": TRITON, "mosaic": Config(backward="mosaic")}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--long-seq", type=int, default=65536, help="0: skip")
  parser.add_argument("--v4", action="store_true", help="also DeepSeek-V4's shape at --seq")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--budget-s", type=float, default=90, help="skip later shapes once this many seconds have passed")
  parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16))
  parser.add_argument("--out", default="")
  a = parser.parse_args()
  t0, rows = time.perf_counter(), []
  stamp(f"device {jax.devices()[0].device_kind}")

  def save():
    if a.out:
      with open(a.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)

  rows += run_shape("mla64", a.seq, VARIANTS, a.reps, a.workers)
  save()
  later = ([("mla64", a.long_seq, 3)] if a.long_seq else []) + ([("v4", a.seq, a.reps)] if a.v4 else [])
  for name, T, reps in later:
    if time.perf_counter() - t0 > a.budget_s:
      stamp(f"{name} T={T}: skipped (budget)")
      continue
    rows += run_shape(name, T, VARIANTS, reps, a.workers)
    save()
  stamp(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
