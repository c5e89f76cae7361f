"""Times the reference backends against the XLA baseline on one device, after checking they agree.

Run on the GPU: `python -m bench.ops_baseline [--seq 8192 16384] [--out results.json]`; `--smoke` runs
tiny shapes (H=4, D=16, k=32, T=256) on any device in seconds.
FLOPs are causal-effective: flash_topk counts 2·H·D per visible (query, key) pair; sparse attention
counts 2·H·K·(Dk + Dv) forward and 2.5x that for forward + backward.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_rows
from bench.timing import timed
from hyscale_jax import ops


def bench_flash_topk(T, H=64, D=128, topk=2048, dtype=jnp.bfloat16, reps=5):
  kq, kk, kw = jax.random.split(jax.random.key(T), 3)
  q = jax.random.normal(kq, (1, T, H, D), dtype)
  k = jax.random.normal(kk, (1, T, D), dtype)
  w = jax.random.normal(kw, (1, T, H), jnp.float32)
  pairs = T * (T + 1) / 2
  rows = []
  for backend in ("xla_baseline", "reference"):
    fn = jax.jit(lambda q, k, w, b=backend: ops.flash_topk(q, k, w, topk=topk, scale=D**-0.5, backend=b))
    seconds = timed(fn, q, k, w, reps=reps)
    rows.append(dict(op="flash_topk", backend=backend, T=T, seconds=seconds,
                     tflops=2 * H * D * pairs / seconds / 1e12))
  return rows


def check_flash_topk_agreement(T=4096, H=64, D=128, topk=2048):
  """Integer-valued bf16 inputs (exact in f32, many ties): both backends must give identical indices."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.integers(-2, 3, (1, T, H, D)), jnp.bfloat16)
  k = jnp.asarray(rng.integers(-2, 3, (1, T, D)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-2, 3, (1, T, H)), jnp.float32)
  a = ops.flash_topk(q, k, w, topk=topk, backend="xla_baseline")
  b = ops.flash_topk(q, k, w, topk=topk, backend="reference")
  return bool(jnp.array_equal(a.indices, b.indices)) and bool(jnp.array_equal(a.scores, b.scores))


def bench_sparse_attention(T, H=64, Dk=576, Dv=512, K=2048, dtype=jnp.bfloat16, reps=5):
  ks = jax.random.split(jax.random.key(T + 1), 4)
  q = jax.random.normal(ks[0], (1, T, H, Dk), dtype)
  kv = jax.random.normal(ks[1], (1, T, 1, Dk), dtype)
  pos = jnp.arange(T)[:, None]
  idx = jax.random.randint(ks[2], (1, T, K), 0, T) % (pos + 1)  # causal, random
  fwd = jax.jit(lambda q, kv: ops.sparse_attention(q, kv, kv[..., :Dv], idx, scale=Dk**-0.5, backend="reference"))
  dout = jax.random.normal(ks[3], (1, T, H, Dv), dtype)
  loss = lambda q, kv: jnp.sum(ops.sparse_attention(q, kv, kv[..., :Dv], idx, scale=Dk**-0.5, backend="reference")[0] * dout)
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
  flops = 2 * T * H * K * (Dk + Dv)
  t_f, t_fb = timed(fwd, q, kv, reps=reps), timed(fwd_bwd, q, kv, reps=reps)
  return [dict(op="sparse_attention_fwd", backend="reference", T=T, seconds=t_f, tflops=flops / t_f / 1e12),
          dict(op="sparse_attention_fwd_bwd", backend="reference", T=T, seconds=t_fb,
               tflops=3.5 * flops / t_fb / 1e12)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
  parser.add_argument("--out", default="")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device, in seconds")
  args = parser.parse_args(argv)
  topk_dims = dict(H=4, D=16, topk=32) if args.smoke else {}
  attention_dims = dict(H=4, Dk=48, Dv=32, K=32) if args.smoke else {}
  seqs, reps = ([256], 1) if args.smoke else (args.seq, 5)
  print("device:", jax.devices()[0].device_kind, flush=True)
  agree = check_flash_topk_agreement(**(dict(T=256, **topk_dims) if args.smoke else {}))
  print(f"flash_topk reference == xla_baseline on integer inputs ({topk_dims or 'T=4096, k=2048'}):", agree,
        flush=True)
  rows = []
  for T in seqs:
    rows += bench_flash_topk(T, **topk_dims, reps=reps)
    rows += bench_sparse_attention(T, **attention_dims, reps=reps)
    for r in rows[-4:]:
      print(f"{r['op']:26s} {r['backend']:13s} T={r['T']:6d} {r['seconds']*1e3:10.2f} ms {r['tflops']:8.2f} TFLOP/s",
            flush=True)
  write_rows(args.out, rows, agree=agree)


if __name__ == "__main__":
  main()
