"""Sparse attention on one GPU: the Pallas kernels against the reference (XLA gather), and the loss pieces.

    python -m bench.sparse_attention check                      # GPU correctness + dk/dv run-to-run spread (atomic, deterministic)
    python -m bench.sparse_attention tune --shape mla64 --seq 16384
    python -m bench.sparse_attention table --shapes mla64 mla128 v4 qsa --seq 16384 65536 --out r.json
    python -m bench.sparse_attention table --smoke              # tiny shapes on the CPU, in seconds
    python -m bench.sparse_attention table --shapes mla64 --seq 16384 65536 --deterministic  # + deterministic bwd

`table` compiles every row's programs up front on `--workers` threads, then checks and times row by
row, rewriting `--out` after each.

Shapes (issue 5): `mla64`/`mla128` absorbed MLA in MQA form (G=1, Dk=576, Dv=512, k=2048, v = the
key's 512-wide latent prefix); `v4` DeepSeek-V4 MQA with K = V (512), sinks, and indices into one
concatenated KV of T tokens plus T/4 compressed entries (top-512 compressed + a 128-token window,
k=640); `qsa` gated GQA (H=24, G=2, D=256, k=2051). Batch 1, bf16, random normal inputs, random
causal selections.

FLOPs: forward `2 T H k (Dk + Dv)`; backward `2 T H k (3 Dk + 2 Dv)` (S recomputed, dP, dq, dk, dv).
`--deterministic` adds `pallas_det_bwd` to each row: the backward with `deterministic=True` (no
atomics: per-slot f32 slabs, then a key-major sum; `--det-chunk-mib` of slabs per query chunk),
timed beside the atomic `pallas_bwd` (`det_over_atomic`), checked against it, and run twice on
the device to check that dq/dk/dv/dsinks are bit-identical (`det_bitwise_equal`). `--smoke` turns it on.

Each row also times the Pallas backward on the same selections with every row in key order
(`pallas_bwd_key_order_ms`), as FlashTopK hands them to a DSA layer: the kernel's row sort is then
skipped. It is checked against the random-order gradients first.

Every timed variant is checked against the reference in the same run first. Before each checked
call, `poison` fills and frees device buffers of the outputs' sizes with NaN, so an output element a
kernel forgot to write most likely reads back as NaN rather than as a stale correct value.
"""

import argparse
import dataclasses
import faulthandler
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import log, poison, rel_err, write_rows
from bench.timing import CompileAhead, timed
from hyscale_jax import ops
from hyscale_jax.ops.indexer_loss.reference import indexer_loss_reference, teacher_mass_reference
from hyscale_jax.ops.sparse_attention.reference import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from pallas_kernels.sparse_attention import (
    Config,
    attention_teacher_pallas,
    sparse_attention_backward_pallas,
    sparse_attention_forward_pallas,
)


@dataclasses.dataclass(frozen=True)
class Shape:
  H: int
  G: int
  Dk: int
  Dv: int
  K: int
  value_is_key: bool = False  # MLA: v = k[..., :Dv]; V4: v = k
  sinks: bool = False
  extra_keys: float = 0.0  # V4: S = T * (1 + extra_keys) (compressed entries after the tokens)
  index_heads: int = 64
  index_dim: int = 128


SHAPES = {
    "mla64": Shape(64, 1, 576, 512, 2048, value_is_key=True),
    "mla128": Shape(128, 1, 576, 512, 2048, value_is_key=True),
    "v4": Shape(64, 1, 512, 512, 640, value_is_key=True, sinks=True, extra_keys=0.25),
    "qsa": Shape(24, 2, 256, 256, 2051, index_heads=4),
    "smoke": Shape(16, 1, 48, 32, 24, value_is_key=True, sinks=True, index_heads=4, index_dim=16),
}


def make_inputs(shape: Shape, T: int, seed=0, dtype=jnp.bfloat16, key_window: int = 0):
  """Random inputs of one row; `key_window` > 0 draws each token's selections from its last
  `key_window` visible keys only (locality, as trained indexers select), else from all of them."""
  S = int(T * (1 + shape.extra_keys))
  ks = jax.random.split(jax.random.key(seed), 8)
  q = jax.random.normal(ks[0], (1, T, shape.H, shape.Dk), dtype)
  k = jax.random.normal(ks[1], (1, S, shape.G, shape.Dk), dtype)
  v = k[..., : shape.Dv] if shape.value_is_key else jax.random.normal(ks[2], (1, S, shape.G, shape.Dv), dtype)
  # Random causal selections over the T token keys; V4's window/compressed entries are mixed in.
  visible = jnp.arange(T)[:, None] + 1 + (S - T)
  draw = jax.random.randint(ks[3], (1, T, shape.K), 0, S)
  idx = visible - 1 - draw % jnp.minimum(visible, key_window) if key_window else draw % visible
  dout = jax.random.normal(ks[4], (1, T, shape.H, shape.Dv), dtype)
  sinks = jax.random.normal(ks[5], (shape.H,), jnp.float32) if shape.sinks else None
  iq = jax.random.normal(ks[6], (1, T, shape.index_heads, shape.index_dim), dtype)
  ik = jax.random.normal(ks[7], (1, S, shape.index_dim), dtype)
  iw = jax.random.normal(ks[0], (1, T, shape.index_heads), dtype)
  return dict(q=q, k=k, v=v, idx=idx.astype(jnp.int32), dout=dout, sinks=sinks, iq=iq, ik=ik, iw=iw)


def flops(shape: Shape, T: int):
  fwd = 2 * T * shape.H * shape.K * (shape.Dk + shape.Dv)
  bwd = 2 * T * shape.H * shape.K * (3 * shape.Dk + 2 * shape.Dv)
  return fwd, bwd


def grad_errors(grads, expected):
  """{"dq": ..., "dk": ..., "dv": ..., "dsinks": ...}: relative errors of `grads` against `expected`
  where the latter has the gradient; all must be finite."""
  errors = {f"d{n}": rel_err(a, b) for n, a, b in zip(("q", "k", "v", "sinks"), grads, expected) if b is not None}
  assert all(np.isfinite(list(errors.values()))), errors
  return errors


def format_errors(errors):
  return json.dumps({k: float(f"{v:.2e}") for k, v in errors.items()})


def variants(shape: Shape, scale, fwd_config=None, bwd_config=None, det_chunk_mib=1024):
  """name -> fn(q, k, v, idx, sinks, dout[, out, lse]) for the forward, backward and fwd+bwd of each backend,
  and `pallas_det_bwd`, the deterministic Pallas backward (`det_chunk_mib` MiB of f32 slabs per chunk).

  Shapes whose values are the key's prefix (`value_is_key`) call with `v=None`, so the Pallas
  kernels read one row for both and return the value gradient inside dk; the reference's separate
  dv is folded into dk the same way, so both backends return (dq, dk, None, dsinks).
  """
  fused = shape.value_is_key
  value_dim = shape.Dv if fused else None

  def fwd_p(q, k, v, idx, sinks, dout, forward=None):
    config = fwd_config
    if forward is not None:  # a named forward kernel instead of the backend's pick
      config = dataclasses.replace(config or Config.heuristics(shape.Dk, shape.Dv, q.dtype.itemsize), forward=forward)
    return sparse_attention_forward_pallas(q, k, None if fused else v, idx, scale=scale, sinks=sinks,
                                           value_dim=value_dim, config=config)

  def fwd_r(q, k, v, idx, sinks, dout):
    return sparse_attention_forward_reference(q, k, v, idx, scale=scale, sinks=sinks)

  def bwd_p(q, k, v, idx, sinks, dout, out, lse, deterministic=False):
    config = bwd_config
    if deterministic:
      default = Config.backward_heuristics(shape.Dk, shape.Dv, q.dtype.itemsize, shape.H // shape.G,
                                           value_from_key=fused)
      config = dataclasses.replace(bwd_config or default, chunk_bytes=det_chunk_mib << 20)
    return sparse_attention_backward_pallas((q, k, None if fused else v, idx, sinks, out, lse),
                                            (dout, jnp.zeros_like(lse)), scale=scale, deterministic=deterministic,
                                            config=config)

  def bwd_r(q, k, v, idx, sinks, dout, out, lse):
    dq, dk, dv, dsinks = sparse_attention_backward_reference((q, k, v, idx, sinks, out, lse),
                                                             (dout, jnp.zeros_like(lse)), scale=scale)
    if fused:
      dk, dv = dk.at[..., : shape.Dv].add(dv), None
    return dq, dk, dv, dsinks

  def fwd_bwd(backend):
    def run(q, k, v, idx, sinks, dout):
      def loss(q, k, v, sinks):
        out, _ = ops.sparse_attention(q, k, None if fused else v, idx, scale=scale, sinks=sinks,
                                      value_dim=value_dim, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
      return jax.grad(loss, argnums=(0, 1, 2) + ((3,) if sinks is not None else ()))(q, k, v, sinks)
    return run

  return dict(
      pallas_fwd=fwd_p, pallas_triton_fwd=functools.partial(fwd_p, forward="triton"), reference_fwd=fwd_r, pallas_bwd=bwd_p, reference_bwd=bwd_r,
      pallas_det_bwd=functools.partial(bwd_p, deterministic=True),
      pallas_fwd_bwd=fwd_bwd("pallas"), reference_fwd_bwd=fwd_bwd("reference"),
  )


def checked_outputs(fns, args):
  """Reference then (on poisoned memory) Pallas forward and backward; returns both and the errors."""
  out_r, lse_r = fns["reference_fwd"](*args)
  g_r = fns["reference_bwd"](*args, out_r, lse_r)
  poison(out_r, lse_r)
  out_p, lse_p = fns["pallas_fwd"](*args)
  poison(*g_r)
  g_p = fns["pallas_bwd"](*args, out_r, lse_r)
  errors = dict(out=rel_err(out_p, out_r), lse=float(jnp.max(jnp.abs(lse_p - lse_r))),
                **grad_errors(g_p, g_r))
  assert all(np.isfinite(list(errors.values()))), errors
  return (out_r, lse_r), g_p, errors


def key_order_backward_row(bwd, args, out, lse, g_p, bwd_flops, reps):
  """The same backward program on the same selections with each row in key order, as FlashTopK's
  `sorted=False` rows arrive in a DSA layer (measured on the GPU, 2026-12-06): the kernel then skips
  its row sort. Checked against the random-order gradients first (the same sums, another order)."""
  q, k, v, idx, sinks, dout = args
  ordered = (q, k, v, jnp.sort(idx, axis=-1), sinks, dout)
  poison(*g_p)
  g_o = bwd(*ordered, out, lse)
  errors = grad_errors(g_o, g_p)
  ms = timed(bwd, *ordered, out, lse, reps=reps) * 1e3
  return dict(key_order_errors=errors, pallas_bwd_key_order_ms=ms, pallas_bwd_key_order_tflops=bwd_flops / ms / 1e9)


def teacher_inputs(x, lse):
  """(q, k, lse, indices) of the teacher timing: the last 1024 rows, which select the full k keys."""
  rows = slice(max(x["q"].shape[1] - 1024, 0), None)
  return x["q"][:, rows], x["k"], lse[:, rows], x["idx"][:, rows]


def row_programs(name, shape: Shape, T, skip_reference, fwd_config=None, bwd_config=None, det_chunk_mib=0):
  """(key -> jitted fn, key -> abstract args) of every program one table row runs (the deterministic
  backward only with `det_chunk_mib`, its slab budget)."""
  x = jax.eval_shape(lambda: make_inputs(shape, T))
  scale = shape.Dk**-0.5
  args = (x["q"], x["k"], x["v"], x["idx"], x["sinks"], x["dout"])
  out = jax.ShapeDtypeStruct(x["q"].shape[:3] + (shape.Dv,), x["q"].dtype)
  lse = jax.ShapeDtypeStruct(x["q"].shape[:3], jnp.float32)
  backends = ("pallas",) + (() if skip_reference else ("reference",))
  fns, abstract = {}, {}
  for key, fn in variants(shape, scale, fwd_config, bwd_config, det_chunk_mib).items():
    if key.split("_")[0] in backends and (det_chunk_mib or key != "pallas_det_bwd"):
      fns[key] = jax.jit(fn)
      abstract[key] = args + ((out, lse) if key.endswith("_bwd") and "fwd" not in key else ())
  teacher_args = jax.eval_shape(teacher_inputs, x, lse)
  loss_args = (x["iq"], x["ik"], x["iw"], x["q"], x["k"], lse, x["idx"])
  for backend in backends:
    teacher = attention_teacher_pallas if backend == "pallas" else teacher_mass_reference
    fns[f"{backend}_teacher"] = jax.jit(functools.partial(teacher, scale=scale))
    abstract[f"{backend}_teacher"] = teacher_args

    def loss(iq, ik, iw, q, k, lse, idx, backend=backend):
      return ops.indexer_loss(iq, ik, iw, q, k, lse, idx, attn_scale=scale, index_scale=shape.index_dim**-0.5,
                              backend=backend)

    fns[f"{backend}_loss"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    abstract[f"{backend}_loss"] = loss_args
  return fns, abstract


def compile_all(programs, workers):
  """Compiles every (row, key) program on `workers` threads; {(row, key): executable or its error}."""
  jobs = [(row, key, fn, programs[row][1][key]) for row in programs for key, fn in programs[row][0].items()]
  log(f"compiling {len(jobs)} programs on {workers} threads")
  ahead, done, t0 = CompileAhead(workers), {}, time.perf_counter()
  for row, key, fn, args in jobs:
    try:
      ahead.submit((row, key), fn, *args)
    except Exception as e:  # noqa: BLE001 - a program that does not trace is reported like one that does not compile
      done[row, key] = e
  for row, key, _, _ in jobs:
    if (row, key) not in done:
      try:
        done[row, key] = ahead.get((row, key))
      except Exception as e:  # noqa: BLE001 - reported in the row, the table goes on
        done[row, key] = e
    error = done[row, key] if isinstance(done[row, key], Exception) else None
    failed = f" FAILED: {str(error).splitlines()[0][:200]}" if error else ""
    log(f"compiled {row} {key} by {time.perf_counter() - t0:.0f} s{failed}")
  ahead.shutdown()
  return done


def run_row(row_key, shape: Shape, T, compiled, reps, skip_reference, key_window=0):
  """Checks, then times, one (shape, T) row from its compiled programs."""
  name = row_key[0]
  get = lambda key: _unwrap(compiled[row_key, key])
  x = make_inputs(shape, T, key_window=key_window)
  args = (x["q"], x["k"], x["v"], x["idx"], x["sinks"], x["dout"])
  fns = {key: get(key) for key in ("pallas_fwd", "pallas_bwd", "reference_fwd", "reference_bwd")
         if (row_key, key) in compiled}
  if skip_reference:  # check against the jitted reference (compiled on first call)
    fns.update({k: jax.jit(f) for k, f in variants(shape, shape.Dk**-0.5).items() if k.startswith("reference")})
  (out_r, lse_r), g_p, errors = checked_outputs(fns, args)
  log(f"{name} T={T}: checked against the reference: {errors}")
  fwd_flops, bwd_flops = flops(shape, T)
  row = dict(shape=name, T=T, H=shape.H, G=shape.G, Dk=shape.Dk, Dv=shape.Dv, K=shape.K, errors=errors)
  if key_window:
    row["key_window"] = key_window
  for backend in ("pallas",) + (() if skip_reference else ("reference",)):
    r = 1 if backend == "reference" and T > 16384 else reps
    row[f"{backend}_fwd_ms"] = timed(get(f"{backend}_fwd"), *args, reps=r) * 1e3
    row[f"{backend}_bwd_ms"] = timed(get(f"{backend}_bwd"), *args, out_r, lse_r, reps=r) * 1e3
    row[f"{backend}_fwd_bwd_ms"] = timed(get(f"{backend}_fwd_bwd"), *args, reps=r) * 1e3
    row[f"{backend}_fwd_tflops"] = fwd_flops / row[f"{backend}_fwd_ms"] / 1e9
    row[f"{backend}_bwd_tflops"] = bwd_flops / row[f"{backend}_bwd_ms"] / 1e9
    row[f"{backend}_fwd_bwd_tflops"] = (fwd_flops + bwd_flops) / row[f"{backend}_fwd_bwd_ms"] / 1e9
    row[f"{backend}_fwd_bwd_temp_gb"] = compiled[row_key, f"{backend}_fwd_bwd"].memory_analysis().temp_size_in_bytes / 1e9
    if backend == "pallas":  # the Triton forward beside the backend's pick (the Mosaic GPU kernel on Hopper)
      poison(out_r, lse_r)
      out_t, lse_t = get("pallas_triton_fwd")(*args)
      row["errors"]["triton_out"], row["errors"]["triton_lse"] = rel_err(out_t, out_r), float(jnp.max(jnp.abs(lse_t - lse_r)))
      row["pallas_triton_fwd_ms"] = timed(get("pallas_triton_fwd"), *args, reps=r) * 1e3
      row["pallas_triton_fwd_tflops"] = fwd_flops / row["pallas_triton_fwd_ms"] / 1e9
      row.update(key_order_backward_row(get("pallas_bwd"), args, out_r, lse_r, g_p, bwd_flops, r))
    log(f"{name} T={T}: {backend} attention timed")
    teacher_in = teacher_inputs(x, lse_r)
    row[f"teacher_1k_rows_{backend}"] = get(f"{backend}_teacher")(*teacher_in)
    row[f"teacher_1k_rows_{backend}_ms"] = timed(get(f"{backend}_teacher"), *teacher_in, reps=reps) * 1e3
    loss_in = (x["iq"], x["ik"], x["iw"], x["q"], x["k"], lse_r, x["idx"])
    row[f"indexer_loss_{backend}_ms"] = timed(get(f"{backend}_loss"), *loss_in, reps=r) * 1e3
    log(f"{name} T={T}: {backend} loss pieces timed")
  if (row_key, "pallas_det_bwd") in compiled:
    row.update(deterministic_row(get("pallas_det_bwd"), args, out_r, lse_r, g_p, reps))
    row["det_over_atomic"] = row["pallas_det_bwd_ms"] / row["pallas_bwd_ms"]
    row["pallas_det_bwd_tflops"] = bwd_flops / row["pallas_det_bwd_ms"] / 1e9
    row["pallas_det_bwd_temp_gb"] = compiled[row_key, "pallas_det_bwd"].memory_analysis().temp_size_in_bytes / 1e9
    log(f"{name} T={T}: deterministic backward timed")
  if "teacher_1k_rows_reference" in row:
    row["teacher_rel_err"] = rel_err(row["teacher_1k_rows_pallas"], row["teacher_1k_rows_reference"])
  row.pop("teacher_1k_rows_pallas")
  row.pop("teacher_1k_rows_reference", None)
  return row


def deterministic_row(det_bwd, args, out, lse, atomic_grads, reps):
  """The deterministic backward run twice on poisoned memory (bit-identical?), against the atomic
  one's gradients (already checked against the reference), and timed."""
  poison(*atomic_grads)
  first = det_bwd(*args, out, lse)
  poison(*atomic_grads)
  second = det_bwd(*args, out, lse)
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(first, second) if a is not None)
  errors = grad_errors(first, atomic_grads)
  del first, second
  return dict(det_bitwise_equal=same, det_vs_atomic=errors,
              pallas_det_bwd_ms=timed(det_bwd, *args, out, lse, reps=reps) * 1e3)


def _unwrap(compiled):
  if isinstance(compiled, Exception):
    raise compiled
  return compiled


def run_dense_teacher(shape: Shape, T, reps):
  """The dense warm-up loss (streamed over key chunks, no [T, T]) at T: fwd + bwd to the indexer."""
  x = make_inputs(shape, T)
  scale = shape.Dk**-0.5

  def loss(iq, ik, iw):
    return indexer_loss_reference(iq, ik, iw, x["q"], x["k"], None, None, attn_scale=scale,
                                  index_scale=shape.index_dim**-0.5, query_chunk=256, key_chunk=1024)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return dict(dense_warmup_loss_ms=timed(fn, x["iq"], x["ik"], x["iw"], reps=reps) * 1e3)


def run_check():
  """Pallas vs reference on the GPU in f32 (tight) and bf16, and the dk/dv spread between two runs."""
  for name, T in (("mla64", 2048), ("v4", 2048), ("qsa", 2048)):
    shape = SHAPES[name]
    for dtype in (jnp.float32, jnp.bfloat16):
      x = make_inputs(shape, T, seed=1, dtype=dtype)
      scale = shape.Dk**-0.5
      fns = {n: jax.jit(f) for n, f in variants(shape, scale).items()}
      args = (x["q"], x["k"], x["v"], x["idx"], x["sinks"], x["dout"])
      (out_r, lse_r), g_p, errors = checked_outputs(fns, args)
      g_p2 = fns["pallas_bwd"](*args, out_r, lse_r)
      spread = {f"d{n}": float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for n, a, b in zip("kv", g_p[1:3], g_p2[1:3]) if a is not None}
      det = deterministic_row(fns["pallas_det_bwd"], args, out_r, lse_r, g_p, reps=1)
      print(f"check {name} T={T} {jnp.dtype(dtype).name}: errors vs reference "
            f"{ {k: float(f'{v:.2e}') for k, v in errors.items()} }, run-to-run max |diff| {spread}; "
            f"deterministic: bit-identical twice {det['det_bitwise_equal']}, vs atomic "
            f"{ {k: float(f'{v:.2e}') for k, v in det['det_vs_atomic'].items()} }", flush=True)


TUNE_CONFIGS = [  # the Triton backward's (at MLA and V4 dims "auto" would run the Mosaic GPU kernel)
    Config(block_h=32, block_k=16, num_warps=4, num_stages=1, backward="triton"),
    Config(block_h=32, block_k=16, num_warps=8, num_stages=1, backward="triton"),
    Config(block_h=32, block_k=32, num_warps=4, num_stages=1, backward="triton"),
    Config(block_h=16, block_k=32, num_warps=4, num_stages=1, backward="triton"),
    Config(block_h=64, block_k=16, num_warps=8, num_stages=1, backward="triton"),  # over the shared memory at MLA dims
]


def run_tune(name, T, reps):
  shape = SHAPES[name]
  x = make_inputs(shape, T)
  scale = shape.Dk**-0.5
  args = (x["q"], x["k"], x["v"], x["idx"], x["sinks"], x["dout"])
  out, lse = jax.jit(variants(shape, scale)["reference_fwd"])(*args)
  want = jax.jit(variants(shape, scale)["reference_bwd"])(*args, out, lse)
  _, bwd_flops = flops(shape, T)
  for config in TUNE_CONFIGS:
    if config.block_h > shape.H // shape.G * 2:
      continue
    fn = jax.jit(variants(shape, scale, bwd_config=config)["pallas_bwd"])
    try:
      got = fn(*args, out, lse)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
      print(f"tune {name} T={T} {config}: failed: {str(e).splitlines()[0][:200]}", flush=True)
      continue
    err = rel_err(got[1], want[1])
    ms = timed(fn, *args, out, lse, reps=reps) * 1e3
    print(f"tune {name} T={T} bwd {config}: {ms:.2f} ms = {bwd_flops / ms / 1e9:.1f} TFLOP/s, dk rel err {err:.1e}",
          flush=True)


def print_row(row):
  ref = lambda key: row.get(f"reference_{key}", float("nan"))
  print(f"{row['shape']:6s} T={row['T']:6d} | fwd pallas {row['pallas_fwd_ms']:8.2f} ms {row['pallas_fwd_tflops']:6.1f}"
        f" TF/s (triton {row['pallas_triton_fwd_ms']:.2f} ms {row['pallas_triton_fwd_tflops']:.1f}) ref {ref('fwd_tflops'):5.1f} | bwd pallas {row['pallas_bwd_ms']:8.2f} ms"
        f" {row['pallas_bwd_tflops']:6.1f} TF/s ref {ref('bwd_tflops'):5.1f}"
        f" | fwd+bwd {row['pallas_fwd_bwd_ms']:8.2f} ms vs ref {ref('fwd_bwd_ms'):8.2f} ms"
        f" | temp GB pallas {row['pallas_fwd_bwd_temp_gb']:.2f} ref {ref('fwd_bwd_temp_gb'):.2f}"
        f" | teacher 1k rows {row['teacher_1k_rows_pallas_ms']:.2f} ms ref {row.get('teacher_1k_rows_reference_ms', float('nan')):.2f}"
        f" | indexer loss fwd+bwd {row['indexer_loss_pallas_ms']:.1f} ms ref {row.get('indexer_loss_reference_ms', float('nan')):.1f}"
        f" | errors {format_errors(row['errors'])}", flush=True)
  if "pallas_bwd_key_order_ms" in row:
    print(f"{row['shape']:6s} T={row['T']:6d} | bwd pallas, rows in key order {row['pallas_bwd_key_order_ms']:8.2f} ms"
          f" {row['pallas_bwd_key_order_tflops']:6.1f} TF/s"
          f" | vs random order {format_errors(row['key_order_errors'])}", flush=True)
  if "pallas_det_bwd_ms" in row:
    print(f"{row['shape']:6s} T={row['T']:6d} | deterministic bwd {row['pallas_det_bwd_ms']:8.2f} ms"
          f" {row['pallas_det_bwd_tflops']:6.1f} TF/s = {row['det_over_atomic']:.2f}x atomic"
          f" | temp GB {row['pallas_det_bwd_temp_gb']:.2f} | bit-identical twice: {row['det_bitwise_equal']}"
          f" | vs atomic {format_errors(row['det_vs_atomic'])}", flush=True)


def run_table(shapes, seqs, dense_seq, reps, skip_reference_above, workers, out_path, det_chunk_mib=0,
              key_window=0):
  """Every (shape, T) row: all programs compiled up front on `workers` threads, then checked and
  timed row by row; the JSON is rewritten after each row, so a cut-off run keeps what it measured."""
  rows = []

  keys = [(name, T) for name in shapes for T in seqs]
  programs = {key: row_programs(key[0], SHAPES[key[0]], key[1], key[1] > skip_reference_above,
                                det_chunk_mib=det_chunk_mib) for key in keys}
  compiled = compile_all(programs, workers)
  for name, T in keys:
    try:
      row = run_row((name, T), SHAPES[name], T, compiled, reps, T > skip_reference_above, key_window)
    except Exception as e:  # noqa: BLE001 - one failing row (e.g. out of memory) does not end the table
      log(f"{name} T={T} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      rows.append(dict(shape=name, T=T, error=f"{type(e).__name__}: {str(e)[:300]}"))
      write_rows(out_path, rows)
      continue
    rows.append(row)
    print_row(row)
    write_rows(out_path, rows)
  if dense_seq:
    name = shapes[0]
    dense = run_dense_teacher(SHAPES[name], dense_seq, reps)
    rows.append(dict(shape=name, T=dense_seq, **dense))
    print(f"{name:6s} T={dense_seq:6d} | dense warm-up indexer loss fwd+bwd (reference, streamed): "
          f"{dense['dense_warmup_loss_ms']:.1f} ms", flush=True)
    write_rows(out_path, rows)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=["check", "tune", "table"])
  parser.add_argument("--shapes", nargs="+", default=["mla64", "mla128", "v4", "qsa"])
  parser.add_argument("--shape", default="mla64")
  parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--dense-seq", type=int, default=16384, help="T for the dense warm-up loss (0: skip)")
  parser.add_argument("--skip-reference-above", type=int, default=1 << 30)
  parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16), help="compile threads")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device, in seconds")
  parser.add_argument("--deterministic", action="store_true", help="table: also the deterministic backward")
  parser.add_argument("--det-chunk-mib", type=int, default=1024, help="its f32 slab budget per query chunk")
  parser.add_argument("--key-window", type=int, default=0,
                      help="table: select from each token's last N visible keys (0: all of them)")
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  faulthandler.dump_traceback_later(300, repeat=True)  # where a long run spends its time
  log("device:", jax.devices()[0].device_kind)
  if args.mode == "check":
    return run_check()
  if args.mode == "tune":
    for T in args.seq:
      run_tune(args.shape, T, args.reps)
    return
  shapes, seqs, dense_seq, deterministic = args.shapes, args.seq, args.dense_seq, args.deterministic
  if args.smoke:
    shapes, seqs, dense_seq, deterministic = ["smoke"], [48], 48, True
  run_table(shapes, seqs, dense_seq, args.reps, args.skip_reference_above, args.workers, args.out,
            det_chunk_mib=args.det_chunk_mib if deterministic else 0, key_window=args.key_window)


if __name__ == "__main__":
  main()
