"""Context parallelism's shard_map path on every local device: ops and train.py steps against one device.

  python -m bench.context_parallel --out bench/results/context_parallel.json      # H200 (1 device), ~3 min
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
      python -m bench.context_parallel --smoke                                    # 8 fake CPU devices
  python -m bench.context_parallel --smoke --out /tmp/context_parallel.json      # one CPU device

Over a `context` mesh axis of all local devices (size 1 on one H200: the shard_map lowering still
runs, each op on its one shard with the shard's `q_offset`), it checks and times:
1. `flash_topk` (Pallas on GPU) under `parallel.context_parallel_flash_topk`, contiguous and zigzag
   layouts: indices and scores bit-identical to the single-device call;
2. `sparse_attention` forward + gradients (q, k, v) under `parallel.context_parallel_sparse_attention`:
   within f32 tolerance of the single-device call (dk/dv use f32 atomics on the GPU);
3. the sparse indexer loss and its gradients under the ambient mesh (`jax.set_mesh`);
4. `train.py`'s loop (`lm.train_and_evaluate`) on configs/glm5_1.py:tiny with `mesh.context=-1`:
   losses within 1e-4 relative of the run without a mesh, and the step time of each (`--smoke`: one
   layer of the tests' CPU-sized GLM-5.1, two sparse steps).
On one device the ops and the train step take the shard_map path only under
`ops._context.shard_map_on_one_device()` (a 1-way split is otherwise skipped); the script uses it
and counts the shard_map calls traced into the train step. It exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from bench.common import log, write_json
from bench.timing import timed
from hyscale_jax import ops, parallel
from hyscale_jax.ops import _context

# GLM-5.1's indexer and absorbed MLA (MQA 576/512) at T=16K on the GPU; small on CPU.
GPU_DIMS = dict(B=1, T=16384, HI=32, DI=128, topk=2048, H=64, Dk=576, Dv=512, K=2048)
SMOKE_DIMS = dict(B=2, T=256, HI=4, DI=32, topk=16, H=4, Dk=48, Dv=32, K=16)


def _max_rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _inputs(d: dict, seed: int = 0):
  """Integer-valued bf16 indexer inputs (exact f32 scores, many ties) and attention inputs of d["dtype"]."""
  rng = np.random.default_rng(seed)
  ints = lambda shape: jnp.asarray(rng.integers(-2, 3, size=shape).astype(np.float32), jnp.bfloat16)
  B, T = d["B"], d["T"]
  iq, ik, iw = ints((B, T, d["HI"], d["DI"])), ints((B, T, d["DI"])), ints((B, T, d["HI"]))
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (B, T, d["H"], d["Dk"]), d["dtype"])
  k = jax.random.normal(ks[1], (B, T, 1, d["Dk"]), d["dtype"])
  v = k[..., : d["Dv"]]  # absorbed MLA: the value is the key's latent part
  pos = jnp.arange(T)[None, :, None]
  idx = jnp.where(jax.random.uniform(ks[2], (B, T, d["K"])) < 0.9,
                  jax.random.randint(ks[3], (B, T, d["K"]), 0, T) % (pos + 1), -1).astype(jnp.int32)
  dout = jax.random.normal(ks[4], (B, T, d["H"], d["Dv"]), jnp.float32)
  return (iq, ik, iw), (q, k, v, idx, dout)


def check_flash_topk(mesh, n, d, backend, reps) -> list[dict]:
  (iq, ik, iw), _ = _inputs(d)
  single = jax.jit(lambda q, k, w: ops.flash_topk(q, k, w, topk=d["topk"], scale=0.5, backend=backend))
  want = single(iq, ik, iw)
  rows = [dict(check="flash_topk", layout="single device", seconds=timed(single, iq, ik, iw, reps=reps))]
  for layout in parallel.LAYOUTS:
    lay = lambda x: parallel.to_layout(x, n, layout)  # noqa: B023
    cp = jax.jit(lambda q, k, w: parallel.context_parallel_flash_topk(  # noqa: B023
        q, k, w, mesh=mesh, topk=d["topk"], layout=layout, scale=0.5, backend=backend))
    args = (lay(iq), lay(ik), lay(iw))
    assert "shard_map" in str(jax.make_jaxpr(cp)(*args)), "no shard_map in the context-parallel flash_topk"
    got = [parallel.from_layout(x, n, layout) for x in cp(*args)]
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
    rows.append(dict(check="flash_topk", layout=layout, ok=same, seconds=timed(cp, *args, reps=reps),
                     mismatched_indices=int(np.sum(np.asarray(got[0]) != np.asarray(want.indices)))))
  return rows


def check_sparse_attention(mesh, n, d, backend, reps, tol, layouts=parallel.LAYOUTS) -> list[dict]:
  _, (q, k, v, idx, dout) = _inputs(d)

  def loss(attend):
    # idx and dout are arguments, not closed-over constants (GBs of constants make XLA compile crawl).
    def f(q, k, v, idx, dout):
      out, lse = attend(q, k, v, idx)
      return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

  args = (q, k, v, idx, dout)
  single = loss(lambda q, k, v, idx: ops.sparse_attention(q, k, v, idx, scale=0.05, backend=backend))
  want = single(*args)
  rows = [dict(check="sparse_attention fwd+bwd", layout="single device", seconds=timed(single, *args, reps=reps))]
  for layout in layouts:
    lay = lambda x: parallel.to_layout(x, n, layout)  # noqa: B023

    def attend(q, k, v, idx, layout=layout):
      out, lse = parallel.context_parallel_sparse_attention(
          lay(q), lay(k), lay(v), lay(idx), mesh=mesh, scale=0.05, layout=layout, backend=backend)
      return parallel.from_layout(out, n, layout), parallel.from_layout(lse, n, layout)

    cp = loss(attend)
    got = cp(*args)
    errors = dict(value=_max_rel(got[0], want[0]), **{f"d{name}": _max_rel(g, w)
                                                      for name, g, w in zip("qkv", got[1], want[1])})
    rows.append(dict(check="sparse_attention fwd+bwd", layout=layout, ok=max(errors.values()) <= tol,
                     max_rel_error=errors, seconds=timed(cp, *args, reps=reps)))
  return rows


def check_indexer_loss(mesh, d, backend, reps, tol) -> list[dict]:
  (iq, ik, iw), (q, k, v, idx, _) = _inputs(d)
  iq, ik, iw = (x.astype(jnp.float32) for x in (iq, ik, iw))
  lse = jax.jit(lambda q, k, v, idx: ops.sparse_attention(q, k, v, idx, scale=0.05, backend=backend)[1])(q, k, v, idx)
  teacher = (q, k, lse, idx)  # arguments, not constants (see check_sparse_attention)
  loss = lambda iq, ik, iw, q, k, lse, idx: ops.indexer_loss(iq, ik, iw, q, k, lse, idx, attn_scale=0.05,
                                                             index_scale=0.5)
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  want = grad(iq, ik, iw, *teacher)
  single_s = timed(grad, iq, ik, iw, *teacher, reps=reps)
  with jax.set_mesh(mesh), _context.shard_map_on_one_device():
    assert "shard_map" in str(jax.make_jaxpr(loss)(iq, ik, iw, *teacher)), "indexer_loss did not split over context"
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    got = grad(iq, ik, iw, *teacher)
    cp_s = timed(grad, iq, ik, iw, *teacher, reps=reps)
  errors = dict(value=_max_rel(got[0], want[0]), **{f"d{name}": _max_rel(g, w)
                                                    for name, g, w in zip(("index_q", "index_k", "weights"),
                                                                          got[1], want[1])})
  return [dict(check="indexer_loss (sparse) + grads", layout="single device", seconds=single_s),
          dict(check="indexer_loss (sparse) + grads", layout="contiguous (ambient mesh)",
               ok=max(errors.values()) <= tol, max_rel_error=errors, seconds=cp_s)]

def _train_config(workdir_root, smoke, **mesh):
  from configs import glm5_1  # noqa: PLC0415

  config = glm5_1.get_config("tiny")
  if smoke:  # the tests' CPU-sized GLM-5.1, one layer
    config.model.update(d_model=32, n_layers=1, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
                        kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4,
                        experts_per_token=2, moe_inter=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8,
                        index_topk=8, vocab_size=2048)
    config.data.update(vocab_size=2048, seq_len=64, batch_size=2)  # the pydoc tokenizer .data/ keeps
  data_dir = os.environ.get("HYSCALE_DATA_DIR") or os.path.join(workdir_root, "data")  # the tokenizer, built once
  config.data.update(source="pydoc", cache_dir=data_dir)
  config.train.update(steps=6, warmup_steps=2, log_every=1, checkpoint_every=100, progress_bar=False)
  if smoke:  # two sparse steps, validated once at the end, no checkpoint: no dense-stage programs
    config.train.update(steps=2, warmup_steps=0, eval_every=2, checkpoint_every=0)
  config.mesh.update(mesh)
  return config


def check_training(smoke: bool) -> list[dict]:
  """train.py's loop without a mesh, then with mesh.context=-1 (shard_map even when that is 1 device)."""
  from hyscale_jax.training import lm  # noqa: PLC0415

  calls = []
  real = _context.run_sequence_sharded
  _context.run_sequence_sharded = lambda *a, **kw: calls.append(1) or real(*a, **kw)
  root = tempfile.mkdtemp(prefix="hyscale_cp_bench_")
  try:
    runs = {}
    for name, mesh in (("no mesh", {}), ("mesh context=-1", dict(context=-1))):
      config = _train_config(root, smoke, **mesh)
      calls.clear()
      t0 = time.perf_counter()
      with _context.shard_map_on_one_device() if mesh else contextlib.nullcontext():
        rows = lm.train_and_evaluate(config, os.path.join(root, name.replace(" ", "_").replace("=", "")))
      tokens = config.data.batch_size * config.data.seq_len
      sparse_s = [tokens / r["tokens_per_sec"] for r in rows if r["stage"] == lm.SPARSE_STAGE][1:]  # after compile
      runs[name] = dict(rows=rows, shard_map_calls=len(calls), wall_s=time.perf_counter() - t0,
                        step_s=float(np.median(sparse_s)) if sparse_s else None)
      log(f"  train {name}: {len(rows)} steps in {runs[name]['wall_s']:.1f}s, shard_map calls traced "
          f"{len(calls)}, sparse step {runs[name]['step_s'] * 1e3:.1f} ms, losses "
          + ", ".join(f"{r['loss']:.5f}" for r in rows))
  finally:
    _context.run_sequence_sharded = real
    shutil.rmtree(root, ignore_errors=True)
  one, cp = runs["no mesh"], runs["mesh context=-1"]
  rel = max(abs(b[key] - a[key]) / max(abs(a[key]), 1e-12)
            for a, b in zip(one["rows"], cp["rows"]) for key in ("loss", "lm_loss", "indexer_loss"))
  ok = rel <= 1e-4 and cp["shard_map_calls"] > 0 and len(one["rows"]) == len(cp["rows"])
  return [dict(check="train.py glm5_1 tiny", layout="no mesh", seconds=one["step_s"],
               losses=[r["loss"] for r in one["rows"]]),
          dict(check="train.py glm5_1 tiny", layout="mesh context=-1", ok=ok, max_rel_loss_diff=rel,
               shard_map_calls=cp["shard_map_calls"], seconds=cp["step_s"], losses=[r["loss"] for r in cp["rows"]])]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="small shapes (CPU, 8 fake devices or 1)")
  parser.add_argument("--out", default=None, help="JSON of every row")
  parser.add_argument("--backend", default=None, help="flash_topk/sparse_attention backend (default: pallas on "
                      "GPU, reference elsewhere)")
  parser.add_argument("--seq", type=int, default=None, help="T for the op checks (default 16384, smoke 256)")
  parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, smoke 1)")
  parser.add_argument("--attn-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="q/k/v dtype of the attention and indexer-loss checks (tolerance 1e-4 / 2e-2)")
  parser.add_argument("--skip-train", action="store_true")
  args = parser.parse_args(argv)
  devices = jax.devices()
  n, platform = len(devices), devices[0].platform
  backend = args.backend or ("pallas" if platform == "gpu" else "reference")
  dims = dict(SMOKE_DIMS if args.smoke else GPU_DIMS)
  dims["T"] = args.seq or dims["T"]
  dims["dtype"] = args.attn_dtype
  reps = args.reps or (1 if args.smoke else 5)
  # Per-row arithmetic is the same; dk/dv sum in another order (shards, GPU atomics), rounded to the dtype.
  tol = 1e-4 if args.attn_dtype == "float32" else 2e-2
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=devices)
  log(f"context parallelism over {n} {platform} device(s) ({devices[0].device_kind}), backend {backend}, "
      f"dims {dims}")
  rows, t_start = [], time.perf_counter()
  steps = [("flash_topk", lambda: check_flash_topk(mesh, n, dims, backend, reps)),
           ("sparse_attention", lambda: check_sparse_attention(
               mesh, n, dims, backend, reps, tol,
               # zigzag's gradient compiles for minutes on a 2-core CPU over 8 devices; the tests cover it
               layouts=("contiguous",) if args.smoke and n > 1 else parallel.LAYOUTS)),
           ("indexer_loss", lambda: check_indexer_loss(mesh, dims, backend, reps, tol))]
  if not args.skip_train:
    steps.append(("train", lambda: check_training(args.smoke)))
  for name, step in steps:
    t0 = time.perf_counter()
    log(f"[{time.perf_counter() - t_start:6.1f}s] {name} ...")
    try:
      new = step()
    except Exception as e:  # noqa: BLE001 (report and go on to the next check)
      new = [dict(check=name, layout="-", ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")]
    for r in new:
      r.setdefault("attn_dtype", args.attn_dtype)
      status = {True: "ok", False: "FAIL", None: ""}[r.get("ok")]
      secs = f"{r['seconds'] * 1e3:10.2f} ms" if r.get("seconds") is not None else " " * 13
      detail = {k: r[k] for k in ("max_rel_error", "max_rel_loss_diff", "mismatched_indices", "shard_map_calls",
                                  "error") if k in r}
      log(f"  {r['check']:<32} {r['layout']:<26} {secs} {status:<4} {detail if detail else ''}")
    log(f"  ({time.perf_counter() - t0:.1f}s)")
    rows.extend(new)
    write_json(args.out, dict(devices=n, platform=platform, backend=backend, dims=dims, rows=rows))
  failed = [r for r in rows if r.get("ok") is False]
  log(f"{len(rows) - len(failed)} rows, {len(failed)} failed, {time.perf_counter() - t_start:.0f}s")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
