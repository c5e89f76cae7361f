"""Probe (issue #20): the Mosaic GPU sparse-attention backward against the Triton one, same process.

    python bench/probe_sparse_attention_bwd_mgpu.py --out probe.json   # mla64 16K, then 64K, then v4 16K

Each shape goes through `probe_sparse_attention_bwd.run_shape`: outputs NaN-poisoned before the
checked call, dq and dk against a gathered f32 recomputation on sampled rows and keys and against
the first variant (the Triton backward, today's heuristic), then medians of `timing.timed`. FLOPs are
TileLang's count, `2 T H k (3 Dk + 2 Dv)`.
"""

import argparse
import dataclasses
import os
import sys
import time

import jax

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import jax.numpy as jnp  # noqa: E402
import probe_sparse_attention_bwd as base  # noqa: E402
from pallas_kernels.sparse_attention import Config  # noqa: E402
from pallas_kernels.sparse_attention import mgpu_backward  # noqa: E402
from probe_sparse_attention_bwd import run_shape, stamp  # noqa: E402
from sparse_attention import SHAPES, make_inputs  # noqa: E402
from timing import timed, write_rows  # noqa: E402

TRITON = dataclasses.replace(Config.backward_heuristics(576, 512, 2, 64, value_from_key=True), backward="triton")
MOSAIC = mgpu_backward.Config
VARIANTS = {"triton": TRITON, "mosaic": MOSAIC(), "mosaic_cols64": MOSAIC(dkv_cols=64),
            "mosaic_regs232": MOSAIC(consumer_registers=232, producer_registers=40),
            "mosaic_no_scatter": MOSAIC(skip_scatter=True),  # a diagnostic: dK stays zero
            "mosaic_no_l2_hint": MOSAIC(dk_evict_last=False),
            "mosaic_one_launch": MOSAIC(schedule="one_launch"),  # the schedule before lockstep waves
            "mosaic_sweep": MOSAIC(schedule="sweep"),  # one launch, each row's walk started at the sweep
            "mosaic_waves": MOSAIC(schedule="waves"),
            "mosaic_sweep_no_l2_hint": MOSAIC(schedule="sweep", dk_evict_last=False)}
_pallas_backward_fn = base.backward_fn


def backward_fn(shape, config, interpret=False):
  """The Triton variants through the pallas backward; a Mosaic `mgpu_backward.Config` straight to the kernel
  (the pallas backward's Mosaic path is the same call plus dsinks, which these shapes' timings leave out)."""
  if not isinstance(config, MOSAIC):
    return _pallas_backward_fn(shape, config, interpret)

  def fn(q, k, v, idx, sinks, dout, out, lse):
    dq, dk = mgpu_backward.sparse_attention_backward_mgpu(q, k, idx, out, lse, dout, jnp.zeros_like(lse),
                                                          scale=shape.Dk**-0.5, config=config)
    return dq, dk.astype(k.dtype)
  return jax.jit(fn)


base.backward_fn = backward_fn  # run_shape builds its programs through it


def sort_rows(T, reps):
  """The sweep's row sort (`mgpu_backward.sorted_by_key`, an unstable sort) against the same sort
  stable, as it was before 2026-12-06, on the bench's selection at T (both must agree exactly), and
  `sorted_by_key` on rows already in key order (FlashTopK's), where it only checks them."""
  idx, S = make_inputs(SHAPES["mla64"], T)["idx"], T
  past = jnp.int32(jnp.iinfo(jnp.int32).max)
  stable = jax.jit(lambda i: jnp.sort(jnp.where((i >= 0) & (i < S), i, past), axis=-1))
  unstable = jax.jit(lambda i: mgpu_backward.sorted_by_key(i, S))
  before, in_order = stable(idx), unstable(idx)
  same = bool(jnp.array_equal(jnp.where(before == past, -1, before), in_order))
  row = dict(shape="mla64", T=T, variant="row_sort", same=same, stable_ms=timed(stable, idx, reps=reps) * 1e3,
             unstable_ms=timed(unstable, idx, reps=reps) * 1e3, in_order_ms=timed(unstable, in_order, reps=reps) * 1e3)
  stamp(f"mla64 T={T} row sort: stable {row['stable_ms']:.2f} ms, unstable {row['unstable_ms']:.2f} ms, "
        f"rows already in order {row['in_order_ms']:.2f} ms, same {same}")
  return [row]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--long-seq", type=int, default=65536, help="0: skip")
  parser.add_argument("--v4", action="store_true", help="also DeepSeek-V4's shape at --seq")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--budget-s", type=float, default=90, help="skip later shapes once this many seconds have passed")
  parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16))
  parser.add_argument("--only", nargs="*", default=None, help="variants at --seq (default all)")
  parser.add_argument("--later-variants", nargs="*", default=None, help="variants at the later shapes (default the best)")
  parser.add_argument("--sort-timing", action="store_true", help="also time the row sort, stable and not")
  parser.add_argument("--out", default="")
  a = parser.parse_args()
  t0, rows = time.perf_counter(), []
  stamp(f"device {jax.devices()[0].device_kind}")

  rows += run_shape("mla64", a.seq, {k: VARIANTS[k] for k in (a.only or VARIANTS)}, a.reps, a.workers)
  write_rows(a.out, rows)
  ok = [r for r in rows if "ms" in r and not r["nan"] and max(r["dq_sampled_f32"], r["dk_sampled_f32"]) < 2e-2]
  best = min((r for r in ok if r["variant"] != "triton"), key=lambda r: r["ms"])["variant"]
  stamp(f"best at mla64 T={a.seq}: {best}")
  pick = {k: VARIANTS[k] for k in [best if n == "best" else n for n in (a.later_variants or ["best"])]}
  later = ([("mla64", a.long_seq, 3)] if a.long_seq else []) + ([("v4", a.seq, a.reps)] if a.v4 else [])
  for name, T, reps in later:
    if time.perf_counter() - t0 > a.budget_s:
      stamp(f"{name} T={T}: skipped (budget)")
      continue
    rows += run_shape(name, T, pick, reps, a.workers)
    write_rows(a.out, rows)
  for T in [a.seq] + ([a.long_seq] if a.long_seq else []) if a.sort_timing else []:
    rows += sort_rows(T, a.reps)
    write_rows(a.out, rows)
  stamp(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
