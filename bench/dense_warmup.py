"""The dense warm-up's two costly parts on one GPU, forward + backward each: the attention and the indexer KL.

    python -m bench.dense_warmup                           # GLM-5.1's shapes at 16K and 32K
    python -m bench.dense_warmup --seq 131072 --kl pallas  # one 128K row of each part
    python -m bench.dense_warmup --smoke --out /tmp/smoke.json   # tiny, on the CPU, in seconds

Shapes (GLM-5.1's warm-up layer, batch 1, bf16, two packed documents): the attention is
`ops.causal_attention` over the non-absorbed MLA heads (64 query and key heads of 192, values of 256);
the KL is `ops.indexer_loss`'s dense form with the indexer's 32 heads of 128 against that teacher.

Rows, each the median seconds of one jitted value-and-gradient after a warm-up:
- `attention`: `causal_attention` with `return_lse="detached"` (as the layer calls it);
- `kl pallas`: the dense KL kernels, reading the attention's LSE;
- `kl streaming`: the jnp streaming in `GPU_DENSE_BLOCKS` tiles that computes each head's LSE itself
  (the `pallas` backend's dense form before the kernels), skipped above `--streaming-max-seq`.
The KL rows report the loss and the largest gradient difference from the first KL row.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import poison, write_rows
from bench.timing import timed_or_report
from hyscale_jax import ops


def _inputs(T, shapes, dtype):
  H, HI, DI, Dqk, Dv = shapes
  keys = jax.random.split(jax.random.key(0), 7)
  normal = lambda i, *shape: jax.random.normal(keys[i], shape, dtype)  # noqa: E731
  return dict(q=normal(0, 1, T, H, Dqk), k=normal(1, 1, T, H, Dqk), v=normal(2, 1, T, H, Dv),
              iq=normal(3, 1, T, HI, DI), ik=normal(4, 1, T, DI), iw=normal(5, 1, T, HI) * 0.1,
              dout=normal(6, 1, T, H, Dv), seg=(jnp.arange(T) >= T // 2).astype(jnp.int32)[None])


def _attention_step(scale):
  @jax.jit
  def step(q, k, v, dout, seg):
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: ops.causal_attention(q, k, v, scale=scale, segment_ids=seg, return_lse="detached",
                                             backend="auto"), q, k, v)
    return (out, lse, *vjp((dout, jnp.zeros_like(lse))))

  return step


def _kl_step(kind, scale, index_scale):
  @jax.jit
  def step(iq, ik, iw, q, k, lse, seg):
    def loss(iq, ik, iw):
      return ops.indexer_loss(iq, ik, iw, q, k, lse if kind == "pallas" else None, None, attn_scale=scale,
                              index_scale=index_scale, segment_ids=(seg, seg), backend="pallas")

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
  parser.add_argument("--kl", nargs="+", default=["pallas", "streaming"], choices=["pallas", "streaming"])
  parser.add_argument("--streaming-max-seq", type=int, default=32768)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in f32 (CPU, Pallas in interpret mode)")
  parser.add_argument("--out", default=None, help="write the rows here as JSON")
  args = parser.parse_args(argv)
  shapes, dtype = (64, 32, 128, 192, 256), jnp.bfloat16  # H, HI, DI, Dqk, Dv
  if args.smoke:
    args.seq, shapes, dtype, args.reps = [40], (4, 2, 16, 24, 16), jnp.float32, 1
  H, HI, DI, Dqk, Dv = shapes
  scale, index_scale = Dqk**-0.5, DI**-0.5 * HI**-0.5
  print(f"{jax.devices()[0].device_kind}: attention {H} heads {Dqk}/{Dv}, indexer {HI} x {DI}, "
        f"{jnp.dtype(dtype).name}", flush=True)
  rows = []
  for T in args.seq:
    x = _inputs(T, shapes, dtype)
    flops = 3.5 * 2 * H * (T * T / 2) * (Dqk + Dv)  # causal half; backward 2.5x the forward
    poison(jax.ShapeDtypeStruct((1, T, H, Dv), dtype))
    timing = timed_or_report(f"attention T {T}", _attention_step(scale), x["q"], x["k"], x["v"], x["dout"],
                             x["seg"], reps=args.reps)
    if timing is None:
      continue
    seconds, (out, lse, *_) = timing
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all()), "attention output not finite"
    rows.append(dict(part="attention", T=T, ms=seconds * 1e3, tflops=flops / seconds / 1e12))
    print(f"attention      T {T:7d}: {seconds * 1e3:10.1f} ms fwd+bwd, {flops / seconds / 1e12:6.1f} TFLOP/s",
          flush=True)
    first = None
    for kind in args.kl:
      if kind == "streaming" and T > args.streaming_max_seq:
        print(f"kl {kind:11s} T {T:7d}: skipped (above --streaming-max-seq)", flush=True)
        continue
      timing = timed_or_report(f"kl {kind} T {T}", _kl_step(kind, scale, index_scale), x["iq"], x["ik"], x["iw"],
                               x["q"], x["k"], lse, x["seg"], reps=args.reps)
      if timing is None:
        continue
      seconds, (loss, grads) = timing
      grads = [np.asarray(g, np.float32) for g in grads]
      row = dict(part=f"kl {kind}", T=T, ms=seconds * 1e3, loss=float(loss))
      note = ""
      if first is None:
        first = (kind, grads)
      else:
        diffs = [float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(grads, first[1])]
        row["max_grad_rel_diff"] = max(diffs)
        note = f", gradients within {max(diffs):.2g} of {first[0]}'s largest"
      rows.append(row)
      print(f"kl {kind:11s} T {T:7d}: {seconds * 1e3:10.1f} ms value+grad, loss {float(loss):.6f}{note}", flush=True)
  write_rows(args.out, rows)
  return rows


if __name__ == "__main__":
  main()
