"""Sparse attention on one GPU: the Pallas forward against the reference and a plain XLA gather.

Run on the H200: `python bench/sparse_attention.py [--seq 16384] [--heads 64 128] [--out results.json]`.
FLOPs: forward 2·T·H·K·(Dk + Dv); forward + backward counted as 3.5x that. Inputs are random normal
bf16, the selection is random and causal; every timed variant is first checked against the reference.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from hyscale_jax import ops  # noqa: E402
from timing import timed  # noqa: E402


def xla_gather_forward(q, k, v, idx, scale):
  """The plain XLA baseline: gather every selected row at once, then einsum (no chunking)."""
  k_sel = jax.vmap(lambda kb, ib: kb[ib])(k[:, :, 0], idx)  # [B, T, K, Dk]
  v_sel = jax.vmap(lambda vb, ib: vb[ib])(v[:, :, 0], idx)
  s = jnp.einsum("bthd,btkd->bthk", q, k_sel, preferred_element_type=jnp.float32) * scale
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bthk,btkd->bthd", p.astype(v.dtype), v_sel, preferred_element_type=jnp.float32)


def run(T, H, Dk=576, Dv=512, K=2048):
  ks = jax.random.split(jax.random.key(T * 7 + H), 4)
  q = jax.random.normal(ks[0], (1, T, H, Dk), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, T, 1, Dk), jnp.bfloat16)
  v = k[..., :Dv]  # MLA: the value is the latent part of the key
  idx = (jax.random.randint(ks[2], (1, T, K), 0, T) % (jnp.arange(T)[:, None] + 1)).astype(jnp.int32)
  dout = jax.random.normal(ks[3], (1, T, H, Dv), jnp.bfloat16)
  scale = Dk**-0.5
  fwd = {b: jax.jit(lambda q, k, v, b=b: ops.sparse_attention(q, k, v, idx, scale=scale, backend=b))
         for b in ("pallas", "reference")}
  out_p, lse_p = fwd["pallas"](q, k, v)
  out_r, lse_r = fwd["reference"](q, k, v)
  rel = float(jnp.linalg.norm((out_p - out_r).astype(jnp.float32)) / jnp.linalg.norm(out_r.astype(jnp.float32)))
  lse_err = float(jnp.max(jnp.abs(lse_p - lse_r)))
  flops = 2 * T * H * K * (Dk + Dv)
  rows = [dict(T=T, H=H, variant="xla_gather_fwd", seconds=timed(jax.jit(lambda q, k, v: xla_gather_forward(q, k, v, idx, scale)), q, k, v))]
  for b in ("pallas", "reference"):
    rows.append(dict(T=T, H=H, variant=f"{b}_fwd", seconds=timed(fwd[b], q, k, v)))
    grad = jax.jit(jax.grad(lambda q, k, b=b: jnp.sum(
        ops.sparse_attention(q, k, k[..., :Dv], idx, scale=scale, backend=b)[0].astype(jnp.float32)
        * dout), argnums=(0, 1)))
    rows.append(dict(T=T, H=H, variant=f"{b}_fwd_bwd", seconds=timed(grad, q, k)))
  for r in rows:
    r["tflops"] = (3.5 if "bwd" in r["variant"] else 1.0) * flops / r["seconds"] / 1e12
    r["rel_err_vs_reference"] = rel
    r["lse_max_abs_err"] = lse_err
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq", type=int, nargs="+", default=[16384])
  parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  print("device:", jax.devices()[0].device_kind, flush=True)
  rows = []
  for T in args.seq:
    for H in args.heads:
      new = run(T, H)
      rows += new
      for r in new:
        print(f"T={T:6d} H={H:3d} {r['variant']:20s} {r['seconds']*1e3:9.2f} ms {r['tflops']:7.1f} TFLOP/s"
              f"  (pallas vs reference: rel err {r['rel_err_vs_reference']:.2e}, lse {r['lse_max_abs_err']:.2e})",
              flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
