"""Probe (issue #20): layouts of the Pallas sparse-attention backward, timed side by side on one GPU.

    python bench/probe_sparse_attention_bwd.py --out probe.json       # mla64 16K, then 64K, v4, mla128
    python bench/probe_sparse_attention_bwd.py --smoke                # tiny shapes, interpret mode, seconds

Every variant is one `Config` of `sparse_attention_backward_pallas` (`today` is the backward's
heuristic before issue 20: 32 heads, 16 keys, 4 warps, 1 stage, dS^T q on the older mma). Inputs are
`bench/sparse_attention.py`'s (bf16, random causal selections); out and lse come from the Pallas
forward. Before each variant's checked call its outputs' sizes are NaN-poisoned. Checks: dq and dk
against `today` (relative L2 over the whole arrays), and against a gathered f32 recomputation from
the same residuals on sampled query rows (dq) and sampled keys (dk: every (token, slot) that selected
the key). Times are `timing.timed` medians (5 calls after a warm-up). All programs of a shape compile
up front on `--workers` threads; one that fails to compile (shared memory) is reported and skipped.
FLOPs are TileLang's count, `2 T H k (3 Dk + 2 Dv)`.

Every variant here is the Triton kernel (`backward="triton"`; "auto" now runs the Mosaic GPU one,
`probe_sparse_attention_bwd_mgpu.py`). Measured 2026-12-04 on the H200 (bench/NOTES.md; `--budget-s
45` skipped mla128): today 142.98 ms at mla64 16K, 660.59 at 64K, 38.52 at v4 16K; `slices32_h64_k32_w8_s1` (now the heuristic) 133.91,
566.29 and 33.41; the 16-key slices 165.7-169.1. An earlier call timed layouts since removed (dK
computed as q^T dS on wgmma; dq in a kernel of its own): 185.9-559.0 ms at mla64 16K.
"""

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from pallas_kernels.sparse_attention import (  # noqa: E402
    Config,
    sparse_attention_backward_pallas,
    sparse_attention_forward_pallas,
)
from sparse_attention import SHAPES, Shape, flops, make_inputs, poison, rel_err  # noqa: E402
from timing import CompileAhead, timed, write_rows  # noqa: E402

TODAY = Config(block_h=32, block_k=16, num_warps=4, num_stages=1, backward="triton")
VARIANTS = {
    "today": TODAY,
    "slices32_h64_k16_w8_s1": Config(block_h=64, block_k=16, num_warps=8, num_stages=1, slice_h=32, backward="triton"),
    "slices32_h64_k16_w8_s2": Config(block_h=64, block_k=16, num_warps=8, num_stages=2, slice_h=32, backward="triton"),
    "slices32_h64_k32_w8_s1": Config(block_h=64, block_k=32, num_warps=8, num_stages=1, slice_h=32, backward="triton"),
    "slices16_h64_k16_w8_s1": Config(block_h=64, block_k=16, num_warps=8, num_stages=1, slice_h=16, backward="triton"),
}
LATER = {  # shape -> variants run there (besides today); "best" = the fastest at mla64 16K
    "v4": ["slices32_h64_k16_w8_s2", "best"],
    "mla128": ["best"],
}


def stamp(*msg):
  print(f"[{time.strftime('%H:%M:%S')}]", *msg, flush=True)


def backward_fn(shape: Shape, config: Config, interpret=False):
  fused = shape.value_is_key

  def fn(q, k, v, idx, sinks, dout, out, lse):
    return sparse_attention_backward_pallas((q, k, None if fused else v, idx, sinks, out, lse),
                                            (dout, jnp.zeros_like(lse)), scale=shape.Dk**-0.5, config=config,
                                            interpret=interpret)
  return jax.jit(fn)


@functools.partial(jax.jit, static_argnames=("scale", "value_dim"))
def sampled_reference(q, k, idx, dout, out, lse, rows, keys, *, scale, value_dim):
  """f32 dq at query `rows` and dk at `keys`, recomputed by gathering, from the same residuals (MQA, values =
  the key's first `value_dim` columns; every index valid)."""
  f32 = lambda x: x.astype(jnp.float32)
  delta = jnp.sum(f32(dout) * f32(out), axis=-1)  # [B, T, H]
  # dq at rows: S, P from lse, dP, dS over the row's gathered keys.
  qr, kr = f32(q[0, rows]), f32(k[0, idx[0, rows], 0])  # [r, H, Dk], [r, K, Dk]
  p = jnp.exp(jnp.einsum("rhd,rkd->rhk", qr, kr) * scale - lse[0, rows][..., None])
  dp = jnp.einsum("rhd,rkd->rhk", f32(dout[0, rows]), kr[..., :value_dim])
  dq = jnp.einsum("rhk,rkd->rhd", p * (dp - delta[0, rows][..., None]), kr) * scale
  # dk at keys: every token's heads against the key, weighted by how often the token selected it.

  def one_key(s):
    ks = f32(k[0, s, 0])
    count = jnp.sum(idx[0] == s, axis=-1).astype(jnp.float32)  # [T]
    p = jnp.exp(jnp.einsum("thd,d->th", f32(q[0]), ks) * scale - lse[0])
    ds = p * (jnp.einsum("thd,d->th", f32(dout[0]), ks[:value_dim]) - delta[0])
    dk = jnp.einsum("t,th,thd->d", count, ds, f32(q[0])) * scale
    return dk.at[:value_dim].add(jnp.einsum("t,th,thd->d", count, p, f32(dout[0])))

  return dq, jax.lax.map(one_key, keys)


def run_shape(name, T, variants, reps, workers, interpret=False):
  shape = SHAPES[name]
  assert shape.G == 1 and shape.value_is_key, "the sampled reference is written for MQA with values from the key"
  x = make_inputs(shape, T)
  args = (x["q"], x["k"], x["v"], x["idx"], x["sinks"], x["dout"])
  out, lse = jax.jit(functools.partial(sparse_attention_forward_pallas, scale=shape.Dk**-0.5, value_dim=shape.Dv,
                                       interpret=interpret))(x["q"], x["k"], None, x["idx"], sinks=x["sinks"])
  ahead, t0 = CompileAhead(workers), time.perf_counter()
  for key, config in variants.items():
    ahead.submit(key, backward_fn(shape, config, interpret), *args, out, lse)
  compiled = {}
  for key in variants:
    try:
      compiled[key] = ahead.get(key)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
      compiled[key] = None
      stamp(f"{name} T={T} {key}: FAILED to compile: {str(e).splitlines()[0][:300]}")
  ahead.shutdown()
  stamp(f"{name} T={T}: compiled {len(variants)} variants by {time.perf_counter() - t0:.0f} s")
  rng = np.random.default_rng(0)
  rows = jnp.asarray(np.unique(np.r_[0, T - 1, rng.integers(0, T, 6)]), jnp.int32)
  keys = jnp.asarray(np.unique(np.r_[0, T - 1, rng.integers(0, T, 6)]), jnp.int32)
  dq_ref, dk_ref = sampled_reference(x["q"], x["k"], x["idx"], x["dout"], out, lse, rows, keys,
                                     scale=shape.Dk**-0.5, value_dim=shape.Dv)
  bwd_flops = flops(shape, T)[1]
  results, first = [], None
  for key, fn in compiled.items():
    if fn is None:
      results.append(dict(shape=name, T=T, variant=key, error="compile"))
      continue
    poison(x["q"], x["k"])  # dq [B, T, H, Dk] and dk [B, S, G, Dk]
    dq, dk = fn(*args, out, lse)[:2]
    checks = dict(dq_sampled_f32=rel_err(dq[0, rows], dq_ref), dk_sampled_f32=rel_err(dk[0, keys, 0], dk_ref),
                  nan=bool(jnp.isnan(dq).any() | jnp.isnan(dk).any()))
    if first is None:
      first = (key, dq, dk)
    else:
      checks.update({f"dq_vs_{first[0]}": rel_err(dq, first[1]), f"dk_vs_{first[0]}": rel_err(dk, first[2])})
    del dq, dk
    ms = timed(fn, *args, out, lse, reps=reps) * 1e3
    row = dict(shape=name, T=T, variant=key, config=str(variants[key]), ms=ms, tflops=bwd_flops / ms / 1e9, **checks)
    results.append(row)
    stamp(f"{name} T={T} {key}: {ms:.2f} ms, {row['tflops']:.1f} TFLOP/s, checks {checks}")
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--long-seq", type=int, default=65536, help="today and the best variant (0: skip)")
  parser.add_argument("--later", nargs="*", default=["v4", "mla128"], help="shapes run after mla64 (see LATER)")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--budget-s", type=float, default=45, help="skip later steps once this many seconds have passed")
  parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16))
  parser.add_argument("--smoke", action="store_true", help="tiny shape in interpret mode, on any device")
  parser.add_argument("--out", default="")
  a = parser.parse_args()
  t0, rows = time.perf_counter(), []
  stamp(f"device {jax.devices()[0].device_kind}")

  if a.smoke:
    SHAPES["probe_smoke"] = Shape(16, 1, 48, 32, 24, value_is_key=True)
    smoke = {"today": Config(block_h=8, block_k=8), "slices": Config(block_h=16, block_k=8, slice_h=4)}
    rows += run_shape("probe_smoke", 40, smoke, 1, 1, interpret=True)
    write_rows(a.out, rows)
    return
  rows += run_shape("mla64", a.seq, VARIANTS, a.reps, a.workers)
  write_rows(a.out, rows)
  ok = [r for r in rows if "ms" in r and not r["nan"] and max(r["dq_sampled_f32"], r["dk_sampled_f32"]) < 2e-2]
  best = min(ok, key=lambda r: r["ms"])["variant"]
  stamp(f"best at mla64 T={a.seq}: {best}")
  named = lambda n: best if n == "best" else n
  pick = lambda names: {"today": TODAY, **{named(n): VARIANTS[named(n)] for n in names}}
  if a.long_seq and time.perf_counter() - t0 < a.budget_s:
    rows += run_shape("mla64", a.long_seq, pick(["best"]), 3, a.workers)
    write_rows(a.out, rows)
  for name in a.later:
    if time.perf_counter() - t0 > a.budget_s:
      stamp(f"{name}: skipped (budget)")
      continue
    rows += run_shape(name, a.seq, pick(LATER[name]), 3, a.workers)
    write_rows(a.out, rows)
  stamp(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
