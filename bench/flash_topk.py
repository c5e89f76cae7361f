"""FlashTopK on the GPU: the Pallas backend against the XLA baseline, the reference and a ceiling.

Run on the H200 (one call per mode; every figure in a table comes from the same process):

  python -m bench.flash_topk check                 # GPU correctness: bit-exact on integer inputs
  python -m bench.flash_topk tune --seq 16384      # main-pass configs at one shape
  python -m bench.flash_topk tune --only ceiling ceiling_fp8   # the main pass alone, bf16 against fp8
  python -m bench.flash_topk tune --only ceiling ceiling_mgpu  # Triton's main pass against the Mosaic GPU scoring
  python -m bench.flash_topk table --shapes dsa16k dsa64k --only ceiling ceiling_mgpu --mgpu-config '{"block_q": 2}'
  python -m bench.flash_topk tune --config '{"block_k": 128}'   # the listed configs with these fields
  python -m bench.flash_topk select --seq 16384    # the finish's selection kernel: rows per program x warps
  python -m bench.flash_topk rescore --seq 131072  # the Mosaic pass's rescoring alone: layouts x blocks x warps
  python -m bench.flash_topk table --shapes dsa128k --only pallas_unsorted pallas_mosaic_unsorted xla_baseline
  python -m bench.flash_topk table --shapes dsa16k dsa64k glm64k --out flash_topk.json
  python -m bench.flash_topk table --shapes dsa16k --only pallas pallas_fp8 xla_baseline   # bf16 vs fp8
  python -m bench.flash_topk table --shapes dsa16k --only pallas pallas_unsorted   # the winners' sort's cost
  python -m bench.flash_topk table --shapes dsa64k --only pallas pallas_segments_unsorted pallas_segments_triton_unsorted
  python -m bench.flash_topk table --smoke --out /tmp/smoke.json   # tiny shapes on CPU (interpret), seconds

FLOPs are causal-effective: 2·H·D per visible (query, key) pair. "ceiling" is the same main pass with
the threshold at +inf, so it scores and masks every visible pair and selects nothing: the cost of
the matmul and its epilogue. Memory is XLA's compiled temp allocation: working memory beyond the
inputs and outputs.

The `_fp8` variants take the same q and k quantized per row to float8_e4m3fn with power-of-two
scales (`quantize_fp8(..., power_of_two=True)`, DeepSeek-V3.2's ue8m0), q's scales folded into the
head weights as DeepSeek does, outside the timed call: `pallas_fp8` (fp8 tensor cores in the main
pass), `ceiling_fp8`, and `xla_baseline_fp8` (the same fp8 score function in XLA, for agreement).
`ceiling_mgpu` is the Mosaic GPU scoring pass (`pallas_kernels.flash_topk.mgpu_scores`: warpgroup MMA
+ TMA, counts and max per row, and the candidate mask with `emit_mask`) at threshold +inf, on the
same inputs as `ceiling`: both score every visible pair and select nothing. Its blocks come from `--mgpu-config`
(`block_q`, `block_k`, `stages`, `pingpong`, register budgets); `tune` runs a list of them (`MGPU_CONFIGS`,
narrowed by `--mgpu-config`'s fields) beside the Triton configs.
`fp8_overlap_with_bf16` is the mean fraction of a row's selected keys that the bf16 selection shares
(quantization moves the boundary: about 98% is what others report). `pallas_unsorted` is the call
the DSA layers make (`flash_topk(..., sorted=False)`: the same sets, no sort of the winners).
`pallas` and `pallas_unsorted` run `--config` as given (`scorer="auto"`: Triton below 32K keys, the
Mosaic pass from there on Hopper); `pallas_mosaic[_unsorted]` force the Mosaic pass
(`pallas_kernels/flash_topk/mosaic_pass.py`, blocks from `--mgpu-config`) and report
`agreement_with_pallas`, the fraction of sorted slots equal to `pallas`'s.
`pallas_segments_unsorted` passes segment ids (one document per row, the same selection) as train.py's
packed rows do, with `--config` as given; `pallas_segments_triton_unsorted` the same on the Triton pass.
`pallas_packed[_triton]_unsorted`: documents of `--doc-len` tokens packed in each row (TFLOP/s over
their own causal pairs; compress ratio 1 only).
"""

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_json
from bench.timing import timed
from hyscale_jax import ops
from hyscale_jax.ops.flash_topk import pallas as topk_pallas
from hyscale_jax.ops.flash_topk import quantize_fp8
from hyscale_jax.ops.flash_topk.pallas import flash_topk_pallas_with_stats
from hyscale_jax.ops.flash_topk.reference import fold_q_scale, key_factor
from pallas_kernels.flash_topk import Config, flash_topk_candidates, select_candidates

# name -> (T, H, D, topk, compress_ratio, weights?)
SHAPES = {
    "dsa16k": (16384, 64, 128, 2048, 1, True),
    "dsa64k": (65536, 64, 128, 2048, 1, True),
    "dsa128k": (131072, 64, 128, 2048, 1, True),
    "glm64k": (65536, 32, 128, 2048, 1, True),
    "csa128k": (131072, 64, 128, 512, 4, True),
    "qsa128k": (131072, 4, 128, 512, 4, False),
    "dsa1m": (1048576, 64, 128, 2048, 1, True),
    "smoke": (256, 4, 16, 32, 1, True),
}


# `tune`'s Mosaic GPU scoring configs at H 64, D 128, each within shared memory (`mgpu_scores.smem_bytes`);
# block_q 4 with block_k 128 keeps a [128, 256] f32 accumulator, 256 registers a thread: expect spills.
MGPU_CONFIGS = [dict(block_q=bq, block_k=bk, stages=st, pingpong=pp) for bq, bk, st, pp in [
    (4, 64, 2, False), (4, 64, 3, False), (4, 64, 4, False), (4, 64, 4, True), (4, 128, 2, False),
    (2, 64, 3, False), (2, 64, 5, False), (2, 64, 5, True), (2, 128, 2, False), (1, 128, 3, False)]]
MGPU_CONFIGS += [dict(block_q=4, block_k=64, stages=st, pingpong=False, emit_mask=True) for st in (2, 3)]  # + the mask


def visible_pairs(T, compress_ratio):
  p = np.arange(T, dtype=np.int64)
  return int(np.minimum(T // compress_ratio, (p + 1) // compress_ratio).sum())


def inputs(T, H, D, compress_ratio, use_weights, dtype=jnp.bfloat16, seed=0):
  kq, kk, kw = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (1, T, H, D), dtype)
  k = jax.random.normal(kk, (1, T // compress_ratio, D), dtype)
  w = jax.random.normal(kw, (1, T, H), jnp.float32) if use_weights else None
  return q, k, w


def fp8_inputs(q, k, w):
  """(q8, k8, weights with q's scales folded in, k_scale): the fp8 path's operands for q, k, w."""
  q8, q_scale = quantize_fp8(q, power_of_two=True)
  k8, k_scale = quantize_fp8(k, power_of_two=True)
  return q8, k8, fold_q_scale(w, q_scale), k_scale


def set_overlap(a, b):
  """Mean over rows of |a & b| / |a| for index rows i32[..., k] (distinct entries, -1 = empty)."""
  both = jnp.sort(jnp.concatenate([a, b], axis=-1), axis=-1)
  shared = jnp.sum((both[..., 1:] == both[..., :-1]) & (both[..., 1:] >= 0), axis=-1)
  return float(jnp.mean(shared / jnp.maximum(jnp.sum(a >= 0, axis=-1), 1)))


def temp_bytes(fn, *args):
  return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def run_check(kinds=("bf16", "fp8"), config=None):
  """Pallas vs reference vs xla_baseline on the GPU: integer inputs bit-exact; real inputs compared.

  `kinds` picks the bf16 checks, the fp8 ones (`check_fp8`), or both; `config` the Pallas backend's
  (e.g. `--config '{"scorer": "mosaic"}'`).
  """
  rows = check_fp8() if "fp8" in kinds else []
  if "bf16" not in kinds:
    return rows
  rng = np.random.default_rng(0)
  for T, H, topk, cr, use_w, lo, hi in [(4096, 64, 256, 1, True, -2, 2), (4096, 4, 64, 4, False, -1, 1),
                                        (8192, 32, 2048, 1, True, 0, 1)]:
    q = jnp.asarray(rng.integers(lo, hi + 1, (2, T, H, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.integers(lo, hi + 1, (2, T // cr, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.integers(-2, 3, (2, T, H)), jnp.float32) if use_w else None
    kw = dict(topk=topk, compress_ratio=cr, scale=0.5)
    got_i, got_s, stats = jax.jit(functools.partial(flash_topk_pallas_with_stats, config=config, **kw))(q, k, w)
    ref = ops.flash_topk(q, k, w, backend="reference", **kw)
    base = ops.flash_topk(q, k, w, backend="xla_baseline", **kw)
    row = dict(check="integer", T=T, H=H, topk=topk, compress_ratio=cr,
               equal_reference=bool(jnp.array_equal(got_i, ref.indices) & jnp.array_equal(got_s, ref.scores)),
               equal_baseline=bool(jnp.array_equal(got_i, base.indices)),
               rescued=int(stats["rescued"]), candidates_per_row=float(stats["candidates_per_row"]))
    print(row, flush=True)
    rows.append(row)
  q, k, w = inputs(16384, 64, 128, 1, True)
  got = jax.jit(functools.partial(flash_topk_pallas_with_stats, topk=2048, scale=128**-0.5, config=config))(q, k, w)
  base = ops.flash_topk(q, k, w, topk=2048, scale=128**-0.5, backend="xla_baseline")
  same_rows = float(jnp.mean(jnp.all(got[0] == base.indices, axis=-1)))
  overlap = float(jnp.mean(jnp.sort(got[0], -1) == jnp.sort(base.indices, -1)))
  row = dict(check="random_bf16", T=16384, rows_identical=same_rows, sorted_slot_agreement=overlap,
             rescued=int(got[2]["rescued"]), candidates_per_row=float(got[2]["candidates_per_row"]))
  print(row, flush=True)
  rows.append(row)
  return rows


def check_fp8():
  """The fp8 path on the GPU. Integer-valued e4m3 q and k with power-of-two scales (every sum exact in
  f32): pallas equals the reference and the xla_baseline bit for bit. Random inputs at DeepSeek's
  shape: pallas against the xla_baseline on the same fp8 score function."""
  rng = np.random.default_rng(1)
  rows = []
  for T, H, topk, cr in [(4096, 64, 256, 1), (8192, 32, 2048, 1), (4096, 4, 64, 4)]:
    q = jnp.asarray(rng.integers(-3, 4, (2, T, H, 128)), jnp.float8_e4m3fn)
    k = jnp.asarray(rng.integers(-3, 4, (2, T // cr, 128)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.integers(-2, 3, (2, T, H)), jnp.float32)
    q_scale = jnp.asarray(2.0 ** rng.integers(-4, 2, (2, T, H)), jnp.float32)
    k_scale = jnp.asarray(2.0 ** rng.integers(-4, 2, (2, T // cr)), jnp.float32)
    kw = dict(topk=topk, compress_ratio=cr, scale=0.5)
    got_i, got_s, stats = jax.jit(functools.partial(flash_topk_pallas_with_stats, **kw))(
        q, k, fold_q_scale(w, q_scale), k_scale=k_scale)
    ref = ops.flash_topk(q, k, w, q_scale=q_scale, k_scale=k_scale, backend="reference", **kw)
    base = ops.flash_topk(q, k, w, q_scale=q_scale, k_scale=k_scale, backend="xla_baseline", **kw)
    row = dict(check="integer_fp8", T=T, H=H, topk=topk, compress_ratio=cr,
               equal_reference=bool(jnp.array_equal(got_i, ref.indices) & jnp.array_equal(got_s, ref.scores)),
               equal_baseline=bool(jnp.array_equal(got_i, base.indices) & jnp.array_equal(got_s, base.scores)),
               rescued=int(stats["rescued"]), candidates_per_row=float(stats["candidates_per_row"]))
    print(row, flush=True)
    rows.append(row)
  q8, k8, w8, k_scale = fp8_inputs(*inputs(16384, 64, 128, 1, True))
  got = jax.jit(pallas_fn(2048, 1, Config()))(q8, k8, w8, k_scale)
  base = ops.flash_topk(q8, k8, w8, k_scale=k_scale, topk=2048, scale=128**-0.5, backend="xla_baseline")
  row = dict(check="random_fp8", T=16384, rows_identical=float(jnp.mean(jnp.all(got[0] == base.indices, axis=-1))),
             set_overlap=set_overlap(got[0], base.indices), rescued=int(got[2]["rescued"]),
             candidates_per_row=float(got[2]["candidates_per_row"]))
  print(row, flush=True)
  rows.append(row)
  return rows


def interpret() -> bool:
  """The Pallas kernels run in interpret mode off the GPU (the CPU smoke)."""
  return jax.default_backend() != "gpu"


def ceiling_fn(topk, compress_ratio, config):
  def fn(q, k, w, k_scale=None):
    t = jnp.full(q.shape[:2], jnp.inf, jnp.float32)
    c = flash_topk_candidates(q, k, w, t, q_offset=0, segment_ids=None, topk=topk,
                              compress_ratio=compress_ratio, scale=128**-0.5, slots=1024, config=config,
                              interpret=interpret(),
                              key_scale=None if k_scale is None else key_factor(k_scale, 128**-0.5))
    return c.n_above, c.n_visible
  return fn


def ceiling_mgpu_fn(mgpu_config, compress_ratio=1):
  """(q, k, w) -> (n_above, max_score[, mask]) of the Mosaic GPU scoring pass at threshold +inf (batch
  row 0; the bench's inputs have one); the mask with `emit_mask` in the config."""
  from pallas_kernels.flash_topk.mgpu_scores import score_counts_mgpu  # noqa: PLC0415 - Mosaic GPU only when run

  def fn(q, k, w):
    t = jnp.full(q.shape[1:2], jnp.inf, jnp.float32)
    w = jnp.ones(q.shape[1:3], jnp.float32) if w is None else w[0]
    n_above, _, best, *mask = score_counts_mgpu(q[0], k[0], w, t, scale=128**-0.5, compress_ratio=compress_ratio,
                                                interpret=interpret(), **mgpu_config)
    return n_above, best, *mask
  return fn


def packed_pairs(T, doc_len):
  """Visible (query, key) pairs of a row of T tokens packed with documents of doc_len (the last shorter)."""
  lengths = [min(doc_len, T - start) for start in range(0, T, doc_len)]
  return sum(n * (n + 1) // 2 for n in lengths)


def pallas_fn(topk, compress_ratio, config, by_score=True, one_segment=False, doc_len=0):
  """(q, k, w[, k_scale]) -> (indices, scores, stats); k_scale for fp8 q and k; `by_score` False: the
  op's `sorted=False` (the layers' call: no sort of the winners); `one_segment`: segment ids passed,
  all one document (what train.py's packed rows pass for a row of one document: the same selection,
  through the segment masks); `doc_len`: segment ids of documents of doc_len tokens (compress ratio 1)."""
  def fn(q, k, w, k_scale=None):
    segment_ids = None
    if one_segment:
      segment_ids = (jnp.ones(q.shape[:2], jnp.int32), jnp.ones(k.shape[:2], jnp.int32))
    if doc_len:
      ids = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) // doc_len, q.shape[:2])
      segment_ids = (ids, ids)
    return flash_topk_pallas_with_stats(q, k, w, k_scale=k_scale, topk=topk, compress_ratio=compress_ratio,
                                        segment_ids=segment_ids, scale=128**-0.5, config=config, sorted=by_score)
  return fn


def run_tune(T, configs, names=("ceiling", "pallas"), mgpu_configs=()):
  """Each config's time for the variants in `names`: ceiling, pallas, and their `_fp8` twins over
  `configs`; ceiling_mgpu over `mgpu_configs` (dicts of `score_counts_mgpu`'s block arguments)."""
  q, k, w = inputs(T, 64, 128, 1, True)
  args = {"": (q, k, w), "_fp8": jax.jit(fp8_inputs)(q, k, w)}
  flops = 2 * 64 * 128 * visible_pairs(T, 1)
  triton_names = [n for n in names if n != "ceiling_mgpu"]
  runs = [(config, name) for config in configs for name in triton_names]
  if "ceiling_mgpu" in names:
    runs += [(config, "ceiling_mgpu") for config in mgpu_configs]
  rows = []
  for config, name in runs:
    if name == "ceiling_mgpu":
      fn = ceiling_mgpu_fn(config)
    else:
      fn = (ceiling_fn if name.startswith("ceiling") else pallas_fn)(2048, 1, config)
    try:
      s = timed(jax.jit(fn), *args["_fp8" if name.endswith("_fp8") else ""], reps=3)
      row = dict(variant=name, T=T, config=str(config), ms=s * 1e3, tflops=flops / s / 1e12)
    except Exception as e:  # a config Triton (or Mosaic GPU) cannot compile: report it and go on
      row = dict(variant=name, T=T, config=str(config), error=f"{type(e).__name__}: {str(e)[:200]}")
    print(row, flush=True)
    rows.append(row)
  return rows


def threshold_and_main_pass(topk, slots, config):
  """The Pallas backend's first two stages at scale 1/sqrt(128), jitted: (q, k, w) -> t and (q, k, w, t) -> Candidates."""
  scale = 128**-0.5
  threshold = jax.jit(lambda q, k, w: topk_pallas._threshold(
      q, k, w, jnp.int32(0), None, None, None, topk=topk, compress_ratio=1, scale=scale, slots=slots, config=config,
      interpret=interpret()))
  main = jax.jit(lambda q, k, w, t: flash_topk_candidates(
      q, k, w, t, q_offset=0, segment_ids=None, topk=topk, compress_ratio=1, scale=scale, slots=slots,
      config=config, interpret=interpret()))
  return threshold, main


def flat_candidates(cands, slots):
  """(scores f32[R, slots], indices i32[R, slots], kept i32[R]) of the candidates, rows flattened: the finish's input."""
  return (cands.scores.reshape(-1, slots), cands.indices.reshape(-1, slots),
          jnp.minimum(cands.n_above, slots).reshape(-1))


def run_breakdown(T, config, topk=2048):
  """Where the Pallas backend's time goes: threshold, main pass, finish (+ rescue) by subtraction."""
  q, k, w = inputs(T, 64, 128, 1, True)
  flops = 2 * 64 * 128 * visible_pairs(T, 1)
  slots = config.candidate_slots(topk, T)
  threshold, main = threshold_and_main_pass(topk, slots, config)
  t = threshold(q, k, w)
  full = jax.jit(pallas_fn(topk, 1, config))
  ceiling = jax.jit(ceiling_fn(topk, 1, config))
  finish = jax.jit(lambda c, t: topk_pallas._finish(c, t, topk, method=config.finish, interpret=interpret()))
  finish_top_k = jax.jit(lambda c, t: topk_pallas._finish(c, t, topk, method="top_k", interpret=interpret()))
  top_k_only = jax.jit(lambda s: jax.lax.top_k(s, topk))
  cands = main(q, k, w, t)
  scores, indices, n_kept = flat_candidates(cands, slots)
  select_alone = jax.jit(lambda s, i, n: select_candidates(s, i, n, topk, interpret=interpret()))
  winners = select_alone(scores, indices, n_kept)
  sort_alone = jax.jit(topk_pallas.sort_winners)
  times = dict(select_alone=timed(select_alone, scores, indices, n_kept, reps=3),
               sort_alone=timed(sort_alone, *winners, reps=3),
               threshold=timed(threshold, q, k, w, reps=3), main_pass=timed(main, q, k, w, t, reps=3),
               finish_unchunked=timed(finish, cands, t, reps=3),
               finish_top_k_unchunked=timed(finish_top_k, cands, t, reps=3), top_k_alone=timed(top_k_only, cands.scores),
               full=timed(full, q, k, w, reps=3), ceiling=timed(ceiling, q, k, w, reps=3))
  times["rest"] = times["full"] - times["threshold"] - times["main_pass"] - times["finish_unchunked"]
  stats = full(q, k, w)[2]
  row = dict(T=T, config=str(config), **{f"{n}_ms": v * 1e3 for n, v in times.items()},
             full_tflops=flops / times["full"] / 1e12, ceiling_tflops=flops / times["ceiling"] / 1e12,
             candidates_per_row=float(stats["candidates_per_row"]), rescued=int(stats["rescued"]))
  print(row, flush=True)
  return [row]


def run_select(T, config, topk=2048):
  """The finish's selection kernel alone on the main pass's real candidates: rows per program x warps."""
  q, k, w = inputs(T, 64, 128, 1, True)
  slots = config.candidate_slots(topk, T)
  threshold, main = threshold_and_main_pass(topk, slots, config)
  scores, indices, n_kept = flat_candidates(main(q, k, w, threshold(q, k, w)), slots)
  rows, first = [], None
  for rows_per_program, num_warps in ((1, 4), (1, 8), (2, 8), (4, 8), (2, 16), (4, 16)):
    fn = jax.jit(functools.partial(select_candidates, topk=topk, rows_per_program=rows_per_program,
                                   num_warps=num_warps))
    try:
      out = fn(scores, indices, n_kept)
      first = first or out
      same = all(bool(jnp.array_equal(jnp.where(jnp.arange(topk) < out[2][:, None], a, 0),
                                      jnp.where(jnp.arange(topk) < first[2][:, None], b, 0)))
                 for a, b in zip(out[:2], first[:2])) and bool(jnp.array_equal(out[2], first[2]))
      row = dict(T=T, rows_per_program=rows_per_program, num_warps=num_warps,
                 ms=timed(fn, scores, indices, n_kept, reps=5) * 1e3, same_as_first=same)
    except Exception as e:  # a config Triton cannot compile: report it and go on
      row = dict(T=T, rows_per_program=rows_per_program, num_warps=num_warps, error=f"{type(e).__name__}: {str(e)[:200]}")
    print(row, flush=True)
    rows.append(row)
  return rows


def run_rescore(T, count=4000, slots=8192):
  """The Mosaic pass's rescoring alone (`index_scores_at_prefix`): each row's first min(t+1, count) of
  `slots` listed keys, in key order as the listing leaves them, by layout x block_k x warps."""
  from pallas_kernels.flash_topk.scores_at import index_scores_at_prefix  # noqa: PLC0415

  q, k, w = inputs(T, 64, 128, 1, True)
  rows = jnp.arange(T)[:, None]
  idx = jnp.sort(jax.random.randint(jax.random.key(1), (T, slots), 0, T) % (rows + 1), axis=-1)[None]
  lengths = jnp.minimum(jnp.arange(T) + 1, count)[None]
  flops = 2 * 64 * 128 * float(jnp.sum(lengths))
  out = []
  for keys_as_rows, block_k, num_warps in ((False, 64, 4), (True, 64, 4), (True, 64, 8), (True, 128, 8),
                                           (False, 32, 4), (True, 32, 4)):
    fn = jax.jit(functools.partial(index_scores_at_prefix, scale=128**-0.5, block_k=block_k, num_warps=num_warps,
                                   keys_as_rows=keys_as_rows))
    try:
      seconds = timed(fn, q, k, w, idx, lengths, reps=5)
      row = dict(T=T, count=count, keys_as_rows=keys_as_rows, block_k=block_k, num_warps=num_warps,
                 ms=seconds * 1e3, tflops=flops / seconds / 1e12)
    except Exception as e:  # a config Triton cannot compile: report it and go on
      row = dict(T=T, keys_as_rows=keys_as_rows, block_k=block_k, num_warps=num_warps,
                 error=f"{type(e).__name__}: {str(e)[:200]}")
    print(row, flush=True)
    out.append(row)
  return out


def run_memory(shapes, config):
  """Compile-only: the Pallas backend's working memory (XLA temp bytes) at each shape."""
  rows = []
  for shape in shapes:
    T, H, D, topk, cr, use_w = SHAPES[shape]
    args = (jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, T // cr, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, T, H), jnp.float32) if use_w else None)
    analysis = jax.jit(pallas_fn(topk, cr, config)).lower(*args).compile().memory_analysis()
    row = dict(shape=shape, variant="pallas", temp_gb=analysis.temp_size_in_bytes / 1e9,
               output_gb=analysis.output_size_in_bytes / 1e9, argument_gb=analysis.argument_size_in_bytes / 1e9)
    print(row, flush=True)
    rows.append(row)
  return rows


def run_table(shapes, config, reps, skip, mgpu_config=None, doc_len=8192):
  rows = []
  for shape in shapes:
    T, H, D, topk, cr, use_w = SHAPES[shape]
    q, k, w = inputs(T, H, D, cr, use_w)
    q8, k8, w8, k_scale = jax.block_until_ready(jax.jit(fp8_inputs)(q, k, w))
    flops = 2 * H * D * visible_pairs(T, cr)
    baseline = lambda q, k, w, k_scale=None: tuple(ops.flash_topk(
        q, k, w, topk=topk, compress_ratio=cr, scale=D**-0.5, k_scale=k_scale, backend="xla_baseline"))
    mosaic = dataclasses.replace(config, scorer="mosaic", **{f"mosaic_{key}": value for key, value in
                                                              (mgpu_config or {}).items()
                                                              if key in ("block_q", "block_k", "stages")})
    variants = {  # name -> (function, its arguments)
        "pallas": (jax.jit(pallas_fn(topk, cr, config)), (q, k, w)),
        "pallas_fp8": (jax.jit(pallas_fn(topk, cr, config)), (q8, k8, w8, k_scale)),
        "pallas_unsorted": (jax.jit(pallas_fn(topk, cr, config, by_score=False)), (q, k, w)),
        # The main pass scored on Mosaic GPU (mark, list, rescore: pallas_kernels/flash_topk/mosaic_pass.py).
        "pallas_mosaic": (jax.jit(pallas_fn(topk, cr, mosaic)), (q, k, w)),
        "pallas_mosaic_unsorted": (jax.jit(pallas_fn(topk, cr, mosaic, by_score=False)), (q, k, w)),
        # With segment ids (one document): "auto" as given, and the Triton pass forced.
        "pallas_segments_unsorted": (jax.jit(pallas_fn(topk, cr, config, by_score=False, one_segment=True)),
                                     (q, k, w)),
        "pallas_segments_triton_unsorted": (jax.jit(pallas_fn(
            topk, cr, dataclasses.replace(config, scorer="triton"), by_score=False, one_segment=True)), (q, k, w)),
        # Documents of --doc-len tokens packed in the row (compress ratio 1 only); TFLOP/s over the
        # documents' own pairs. "auto" as given, and the Triton pass forced.
        "pallas_packed_unsorted": (jax.jit(pallas_fn(topk, cr, config, by_score=False, doc_len=doc_len)), (q, k, w)),
        "pallas_packed_triton_unsorted": (jax.jit(pallas_fn(
            topk, cr, dataclasses.replace(config, scorer="triton"), by_score=False, doc_len=doc_len)), (q, k, w)),
        # The same backend with the previous finish (lax.top_k over the whole candidate buffer).
        "pallas_top_k_finish": (jax.jit(pallas_fn(topk, cr, dataclasses.replace(config, finish="top_k"))),
                                (q, k, w)),
        "ceiling": (jax.jit(ceiling_fn(topk, cr, config)), (q, k, w)),
        "ceiling_fp8": (jax.jit(ceiling_fn(topk, cr, config)), (q8, k8, w8, k_scale)),
        "ceiling_mgpu": (jax.jit(ceiling_mgpu_fn(mgpu_config or {}, cr)), (q, k, w)),
        "xla_baseline": (jax.jit(baseline), (q, k, w)),
        "xla_baseline_fp8": (jax.jit(baseline), (q8, k8, w8, k_scale)),
        "reference": (jax.jit(lambda q, k, w: tuple(ops.flash_topk(
            q, k, w, topk=topk, compress_ratio=cr, scale=D**-0.5, backend="reference"))), (q, k, w)),
    }
    if cr != 1:  # packed documents over compressed keys: not defined here
      variants = {name: v for name, v in variants.items() if not name.startswith("pallas_packed")}
    results, selected = {}, {}
    for name, (fn, args) in variants.items():
      if name in skip.get(shape, ()):
        continue
      out = jax.block_until_ready(fn(*args))  # the warm-up; its stats are reported
      seconds = timed(fn, *args, reps=reps, warmup=False)
      pairs_flops = 2 * H * D * packed_pairs(T, doc_len) if name.startswith("pallas_packed") else flops
      row = dict(shape=shape, T=T, H=H, topk=topk, compress_ratio=cr, variant=name, ms=seconds * 1e3,
                 tflops=pairs_flops / seconds / 1e12, temp_gb=temp_bytes(fn, *args) / 1e9)
      if name.startswith("pallas_packed"):
        row["doc_len"] = doc_len
      if name.startswith("pallas"):
        stats = out[2]
        row.update(rescued=int(stats["rescued"]), candidates_per_row=float(stats["candidates_per_row"]))
      if name in ("pallas", "pallas_unsorted", "pallas_mosaic", "pallas_mosaic_unsorted", "xla_baseline", "pallas_fp8",
                  "xla_baseline_fp8", "pallas_segments_unsorted", "pallas_segments_triton_unsorted",
                  "pallas_packed_unsorted", "pallas_packed_triton_unsorted"):
        selected[name] = jnp.sort(out[0], axis=-1)
      if name == "pallas_unsorted" and "pallas" in selected:  # the same sets as the sorted call
        row["same_sets_as_pallas"] = bool(jnp.array_equal(selected[name], selected["pallas"]))
      if name.startswith(("pallas_mosaic", "pallas_segments")) and "pallas" in selected:  # f32 sums in another order: the
        # same sets but for keys within a rounding of a row's k-th score
        row["agreement_with_pallas"] = float(jnp.mean(selected[name] == selected["pallas"]))
      if name == "pallas_top_k_finish" and "pallas" in results:  # the two finishes: bit-identical outputs
        ref = jax.block_until_ready(variants["pallas"][0](q, k, w))
        row["identical_to_pallas"] = bool(jnp.array_equal(out[0], ref[0]) & jnp.array_equal(out[1], ref[1]))
        del ref
      del out
      results[name] = row
      print(row, flush=True)
    # f32 rounding may move keys tied within an ulp of the k-th score
    for ours, base in (("pallas", "xla_baseline"), ("pallas_fp8", "xla_baseline_fp8")):
      if ours in selected and base in selected:
        results[ours]["agreement_with_xla_baseline"] = float(jnp.mean(selected[ours] == selected[base]))
    if "pallas_packed_unsorted" in selected and "pallas_packed_triton_unsorted" in selected:
      results["pallas_packed_unsorted"]["agreement_with_triton"] = float(jnp.mean(
          selected["pallas_packed_unsorted"] == selected["pallas_packed_triton_unsorted"]))
    if "pallas_fp8" in selected and "pallas" in selected:
      results["pallas_fp8"]["fp8_overlap_with_bf16"] = set_overlap(selected["pallas_fp8"], selected["pallas"])
    selected.clear()
    for row in results.values():
      if "xla_baseline" in results:
        row["speedup_vs_xla_baseline"] = results["xla_baseline"]["ms"] / row["ms"]
      if "ceiling" in results:
        row["fraction_of_ceiling"] = results["ceiling"]["ms"] / row["ms"]
    rows += results.values()
  print("\n| shape | variant | ms | TFLOP/s | x xla_baseline | / ceiling | temp GB | rescued rows | cand/row |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['shape']} | {r['variant']} | {r['ms']:.1f} | {r['tflops']:.1f} | "
          f"{r.get('speedup_vs_xla_baseline', float('nan')):.2f} | {r.get('fraction_of_ceiling', float('nan')):.2f} | "
          f"{r['temp_gb']:.2f} | {r.get('rescued', '')} | {r.get('candidates_per_row', ''):} |")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", nargs="?", default="table", choices=("check", "tune", "breakdown", "select", "rescore", "memory",
                                                                     "table"))
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--shapes", nargs="+", default=["dsa16k", "dsa64k"])
  parser.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--config", type=json.loads, default={}, help="Config fields as JSON")
  parser.add_argument("--mgpu-config", type=json.loads, default={},
                      help="ceiling_mgpu's score_counts_mgpu block arguments as JSON (block_q, block_k, stages, ...)")
  parser.add_argument("--doc-len", type=int, default=8192, help="table: document length of the pallas_packed variants")
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true", help="the table at a tiny shape on any device, in seconds")
  args = parser.parse_args(argv)
  if args.smoke:
    args.mode, args.shapes, args.reps = "table", ["smoke"], 1
  print(jax.devices(), flush=True)
  if args.mode == "check":  # --only bf16 / fp8: one kind of check
    rows = run_check(tuple(args.only or ("bf16", "fp8")), Config(**args.config))
  elif args.mode == "memory":
    rows = run_memory(args.shapes, Config(**args.config))
  elif args.mode == "breakdown":
    rows = run_breakdown(args.seq, Config(**args.config))
  elif args.mode == "rescore":
    rows = run_rescore(args.seq)
  elif args.mode == "select":
    rows = run_select(args.seq, Config(**args.config))
  elif args.mode == "tune":
    configs = [Config(block_rows=r, block_k=bk, num_warps=nw, num_stages=ns, keys_as_rows=False)
               for r, bk, nw, ns in [(64, 64, 4, 2), (64, 128, 4, 2), (64, 64, 2, 2), (64, 64, 8, 2),
                                     (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 4, 2),
                                     (64, 256, 4, 2), (64, 128, 8, 3), (128, 128, 8, 2)]]
    # keys as the matmul's rows (the head sum inside thread quads), at the key blocks that fill M
    configs += [Config(block_rows=64, block_k=bk, num_warps=nw, num_stages=ns, keys_as_rows=True)
                for bk, nw, ns in [(64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2)]]
    if args.config:  # a subset: the listed configs that agree with --config's fields
      configs = [c for c in configs if all(getattr(c, f) == v for f, v in args.config.items())]
    # ceiling_mgpu: the listed configs that agree with --mgpu-config, or that config alone if none does
    mgpu_configs = [c for c in MGPU_CONFIGS if all(c.get(f) == v for f, v in args.mgpu_config.items())]
    mgpu_configs = mgpu_configs or [{**MGPU_CONFIGS[0], **args.mgpu_config}]
    rows = run_tune(args.seq, configs, tuple(args.only or ("ceiling", "pallas")), mgpu_configs)
  else:
    every = {"pallas", "pallas_unsorted", "pallas_mosaic", "pallas_mosaic_unsorted", "pallas_fp8",
             "pallas_segments_unsorted", "pallas_segments_triton_unsorted", "pallas_packed_unsorted",
             "pallas_packed_triton_unsorted", "pallas_top_k_finish", "ceiling", "ceiling_fp8", "ceiling_mgpu", "xla_baseline", "xla_baseline_fp8",
             "reference"}
    skip = {s: every - set(args.only) for s in args.shapes} if args.only else {}
    if args.smoke and not args.only:  # CI's bench smoke (CI time): the old finish's equality and the unsorted
      # call's sets are tests/test_flash_topk*.py's, and the ceilings are timings only
      skip = {"smoke": {"pallas_top_k_finish", "pallas_unsorted", "pallas_mosaic", "pallas_mosaic_unsorted",
                        "pallas_segments_unsorted", "pallas_segments_triton_unsorted", "pallas_packed_unsorted",
                        "pallas_packed_triton_unsorted",
                        "ceiling", "ceiling_fp8", "ceiling_mgpu", "xla_baseline_fp8"}}
    rows = run_table(args.shapes, Config(**args.config), args.reps, skip, args.mgpu_config, args.doc_len)
  write_json(args.out, rows)


if __name__ == "__main__":
  main()
