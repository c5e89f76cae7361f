"""Probe (issue 20): is the sparse-attention backward's loss at 64K the L2? The one-launch Mosaic backward
on the same slots with the keys moved (one process, medians of 3; one device call, about 3 minutes).

    python bench/probe_sparse_attention_bwd_locality.py [T]

Rows: the bench's causal random selections; the same rows sorted by key; the keys taken mod 16K and
mod 8K (the same slots and work over fewer rows of dK and K); and R key bands, a launch each over the
band's slots (bf16 dq per band summed in f32 by XLA). H100, 2026-12-06 (bench/NOTES.md): 366.3, 359.7,
323.9, 261.6 ms, 4 bands 344.6: the same work over 8K rows ran at the 16K run's rate, which is what
`mgpu_backward.Config.schedule="waves"` recovers without bands.
"""

import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from pallas_kernels.sparse_attention import mgpu_backward as mb  # noqa: E402
from pallas_kernels.sparse_attention import sparse_attention_forward_pallas  # noqa: E402
from sparse_attention import SHAPES, flops, make_inputs  # noqa: E402
from timing import timed  # noqa: E402

ONE_LAUNCH = mb.Config(schedule="one_launch")


def main():
  T = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
  shape = SHAPES["mla64"]
  x = make_inputs(shape, T)
  q, k, idx, dout = x["q"], x["k"], x["idx"], x["dout"]
  scale = shape.Dk**-0.5
  out, lse = jax.jit(functools.partial(sparse_attention_forward_pallas, scale=scale, value_dim=shape.Dv))(q, k, None, idx)
  backward = functools.partial(mb.sparse_attention_backward_mgpu, scale=scale, config=ONE_LAUNCH)
  bwd = jax.jit(lambda q, k, idx, out, lse, dout: backward(q, k, idx, out, lse, dout, jnp.zeros_like(lse)))
  bwd_flops = flops(shape, T)[1]

  def report(name, seconds, extra=""):
    print(f"T={T} {name}: {seconds * 1e3:.2f} ms, {bwd_flops / seconds / 1e12:.1f} TFLOP/s {extra}", flush=True)

  report("causal random", timed(bwd, q, k, idx, out, lse, dout, reps=3))
  sorted_rows = jax.jit(functools.partial(mb.sorted_by_key, num_keys=k.shape[1]))
  srt = sorted_rows(idx)
  report("sorted rows", timed(bwd, q, k, srt, out, lse, dout, reps=3))
  print(f"T={T} jnp.sort of the selection: {timed(sorted_rows, idx, reps=3) * 1e3:.2f} ms", flush=True)
  for window in (16384, 8192):
    if window < T:
      moved = jnp.where(idx >= 0, idx % window, -1).astype(jnp.int32)
      report(f"keys mod {window}", timed(bwd, q, k, moved, out, lse, dout, reps=3), "(same slots)")
  for bands in (4, 8):
    width = -(-T // bands)

    def banded(q, k, srt, out, lse, dout, bands=bands, width=width):
      slot = jnp.arange(srt.shape[-1])
      dq, dk = 0, 0
      for r in range(bands):
        lo = jnp.sum((srt >= 0) & (srt < r * width), -1, keepdims=True)
        hi = jnp.sum((srt >= 0) & (srt < (r + 1) * width), -1, keepdims=True)
        band = jnp.take_along_axis(srt, jnp.minimum(lo + slot, srt.shape[-1] - 1), -1)
        band_dq, band_dk = backward(q, k, jnp.where(slot < hi - lo, band, -1), out, lse, dout, jnp.zeros_like(lse))
        dq, dk = dq + band_dq.astype(jnp.float32), dk + band_dk
      return dq.astype(q.dtype), dk

    report(f"{bands} key bands", timed(jax.jit(banded), q, k, srt, out, lse, dout, reps=3), "(launch per band)")


if __name__ == "__main__":
  main()
