"""Probe: the dense warm-up's indexer KL (`indexer_loss(indices=None)`) by query and key block sizes.

The dense stage at 128K spends most of its step here (about 225 s a step for 2 layers on the H200,
bench/NOTES.md), streamed over [query_chunk, H, key_chunk] f32 tiles: at the defaults (64 x 256) a
128K-token pass is about 520K loop steps of small kernels. This times value and gradient (index_q,
index_k, index_weights) at GLM-5.1's dense-form shapes (64 MHA heads of 256, indexer 32 x 128, bf16)
for several block sizes, and checks each against the first row's loss and gradients.

Usage: python bench/probe_dense_indexer_loss.py [--seq 32768] [--blocks 64x256 256x1024 ...]
"""

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from hyscale_jax.ops.indexer_loss.reference import indexer_loss_reference  # noqa: E402
from timing import timed_or_report, write_rows  # noqa: E402


def make_inputs(T, H, D, HI, DI, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  bf16 = lambda key, shape, s=1.0: (s * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
  return dict(index_q=bf16(keys[0], (1, T, HI, DI)), index_k=bf16(keys[1], (1, T, DI)),
              index_weights=bf16(keys[2], (1, T, HI), 0.1), attn_q=bf16(keys[3], (1, T, H, D)),
              attn_k=bf16(keys[4], (1, T, H, D)))


def loss_and_grads(x, *, blocks, attn_scale, index_scale):
  query_chunk, key_chunk = blocks

  def loss(iq, ik, iw):
    return indexer_loss_reference(iq, ik, iw, x["attn_q"], x["attn_k"], None, None, attn_scale=attn_scale,
                                  index_scale=index_scale, query_chunk=query_chunk, key_chunk=key_chunk)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))(x["index_q"], x["index_k"], x["index_weights"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[32768])
  parser.add_argument("--blocks", nargs="+", default=["64x256", "128x512", "256x512", "256x1024", "512x1024"],
                      help="query_chunk x key_chunk; the first is the reference row")
  parser.add_argument("--heads", type=int, default=64)
  parser.add_argument("--head-dim", type=int, default=256)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  blocks = [tuple(int(n) for n in b.split("x")) for b in args.blocks]
  rows = []
  for T in args.seq:
    x = make_inputs(T, args.heads, args.head_dim, 32, 128)
    first = None
    for bq, ck in blocks:
      fn = jax.jit(functools.partial(loss_and_grads, blocks=(bq, ck), attn_scale=args.head_dim ** -0.5,
                                     index_scale=128 ** -0.5 * 32 ** -0.5))
      got = timed_or_report(f"T={T} {bq}x{ck}", fn, x, reps=args.reps)
      if got is None:
        rows.append(dict(T=T, query_chunk=bq, key_chunk=ck, error=True))
        continue
      seconds, (loss, grads) = got
      leaves = [np.asarray(v, np.float32) for v in (loss, *grads)]
      row = dict(T=T, query_chunk=bq, key_chunk=ck, ms=seconds * 1e3, loss=float(leaves[0]),
                 finite=bool(all(np.isfinite(v).all() for v in leaves)))
      if first is None:
        first = leaves
      else:
        row["max_rel_diff"] = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                                  for a, b in zip(leaves, first))
      rows.append(row)
      print(json.dumps(row), flush=True)
      write_rows(args.out, rows)  # after each row: a call cut by its time limit keeps what it measured


if __name__ == "__main__":
  main()
