"""One attention block at real dimensions, forward + backward under remat, in every step mode (issue 9).

    python -m bench.layer_step run --layers dsa --seq 16384 131072 --out bench/results/layer_step.json
    python -m bench.layer_step run --layers csa qsa --seq 65536 --append --out bench/results/layer_step.json
    python -m bench.layer_step plot --out bench/results/layer_step.json   # PNGs under bench/plots/
    python -m bench.layer_step run --smoke --layers dsa --modes megatron_style hyscale --out /tmp/smoke.json

Layers (the `full` configs, batch 1, bf16 parameters and activations):
- `dsa`: GLM-5.1 MLA + DSA (d 6144, 64 heads, absorbed 576/512, indexer 32 x 128, k = 2048).
- `csa`: DeepSeek-V4-Flash CSA (d 4096, 64 heads of 512, window 128, ratio-4 entries, indexer 64 x 128,
  k = 512).
- `qsa`: Qwen3.8-Flash-Next QSA (d 2560, 24 heads / 2 KV of 256, indexer 4 x 128, k = 512 blocks of 4).
- `glm`: one whole GLM-5.1 decoder layer: the `dsa` block plus its MoE (256 routed experts of 2048,
  top-8, one shared expert, grouped matmuls through `ops.grouped_matmul`), with both residuals.

The `dsa`/`csa`/`qsa` block is RMSNorm -> attention (projections, indexer, selection, sparse attention,
output projection) and its indexer loss; the MLP/MoE is excluded. `glm` is `models.DecoderLayer`
itself (layer `first_k_dense`, the first MoE layer), and its breakdown has the MoE as its own part. The loss is `mean(out^2) + indexer_loss`,
differentiated with respect to the block's parameters and its input, under `jax.checkpoint` with the
mode's policy (as the decoder runs each layer). Modes (hyscale_jax/training/step_modes.py):
`megatron_style`, `+flashtopk`, `+replay`, `hyscale`, and with `--ablation` one `+replay+<opt>`
line per holistic optimization. The sparse attention kernel is the same (`auto`) in every mode.

Each row: the step's median time after a warm-up, its speedup over `megatron_style` at the same
layer and T, its peak memory, and a breakdown. Peak memory is XLA's compiled memory analysis of the
step (arguments + outputs + temporaries, i.e. what the step needs on the device; the allocator's
fragmentation is not included). Breakdown: each part timed alone on the same shapes, times how often
the mode runs it per step (`counts`): indexer projections (forward + backward, plus one forward for
the remat recompute), selection (twice under remat `full`), sparse attention forward (twice unless
`selection_replay` saves out/lse) and backward, indexer loss (forward + backward, plus the recompute
forward; once with `fused_loss_grad`), and other = step - parts.

Correctness: the warm-up call of every mode is checked against `megatron_style` (loss and gradients,
relative error) after `poison` fills freed buffers with NaN; rows record the errors and `check_ok`.
A mode that runs out of memory records "OOM" and the run goes on. Rows are written to `--out` as
they finish, so a killed run keeps them.

Budget (one H200, 10-minute calls): every program of the sweep is traced up front and compiled on
`--compile-workers` threads before the first row runs (at real dims a compile takes 20-130 s; XLA
autotunes on the device while compiling, so no row is timed during a compile). Measured:
dsa 16K-128K with `--ablation --reps 2` in 7.2 min (2 of them waiting for the first compiles); csa
and qsa 16K, 64K, 128K together in 6.2 min; qsa 16K-128K in 3.2 min. T >= 256K:
`--modes hyscale --no-breakdown --reps 0` (the checked first call is timed; a DSA step takes 20 s
at 512K and 51 s at 1M). `megatron_style` past 128K takes 18 s (DSA, 128K) to 20 s (QSA, 512K) per
step (O(T^2) selection twice and a rescoring loss backward).
"""

import argparse
import dataclasses
import functools
import json
import os
import time

# The largest lengths need most of the GPU: JAX's default preallocation is 75% of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import Results, compiled_memory, is_oom, log, poison, rel_err  # noqa: E402
from bench.timing import CompileAhead, timed  # noqa: E402
from configs import deepseek_v4_flash, glm5_1, qwen3_8_flash_next  # noqa: E402
from hyscale_jax import ops, remat  # noqa: E402
from hyscale_jax.layers.compressed_attention import CompressedSparseAttention, window_indices  # noqa: E402
from hyscale_jax.layers.mla import MLASparseAttention  # noqa: E402
from hyscale_jax.layers.qsa import QSAAttention, block_tokens, expand_blocks  # noqa: E402
from hyscale_jax.model_config import ModelConfig  # noqa: E402
from hyscale_jax.models import DecoderLayer  # noqa: E402
from hyscale_jax.ops.flash_topk.api import REGISTRY as TOPK_REGISTRY  # noqa: E402
from hyscale_jax.ops.sparse_attention.api import REGISTRY as ATTENTION_REGISTRY  # noqa: E402
from hyscale_jax.training import step_modes  # noqa: E402

LAYERS = {"dsa": glm5_1, "csa": deepseek_v4_flash, "qsa": qwen3_8_flash_next, "glm": glm5_1}
# The attention kind inside each layer kind (`glm` is a whole decoder layer around a `dsa` block).
ATTENTION_KIND = {"dsa": "dsa", "csa": "csa", "qsa": "qsa", "glm": "dsa"}
DEFAULT_SEQ = (16384, 32768, 65536, 131072, 262144, 524288, 1048576)
PLOTS = "bench/plots"


def config_variant(args) -> str:
  """The config variant of a run: "tiny" under --smoke, else the real dims ("full")."""
  return "tiny" if args.smoke else "full"


def parts_config(kind: str, variant: str) -> ModelConfig:
  """The config the parts are planned and timed with (both must build the same programs)."""
  return layer_config(kind, variant, "+replay")


def layer_config(kind: str, variant: str, mode: str) -> ModelConfig:
  """The layer's ModelConfig (bf16) with the mode's model overrides."""
  model = LAYERS[kind].get_config(variant).model.to_dict()
  model.update(step_modes.settings(mode)[1], dtype="bfloat16", param_dtype="bfloat16")
  if variant == "tiny" and model.get("attention_query_chunk"):
    model["attention_query_chunk"] = 32  # four query chunks at T=128
  return ModelConfig.from_config(model)


def build_attention(kind: str, cfg: ModelConfig):
  rngs = nnx.Rngs(0)
  if kind == "dsa":
    return MLASparseAttention(cfg, has_indexer=True, rngs=rngs)
  if kind == "csa":
    return CompressedSparseAttention(cfg, "csa", cfg.csa_ratio, rngs=rngs)
  return QSAAttention(cfg, rngs=rngs)


class AttentionBlock(nnx.Module):
  """RMSNorm -> attention; returns (out [B, T, D], indexer loss)."""

  def __init__(self, kind: str, cfg: ModelConfig):
    self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.rms_eps, rngs=nnx.Rngs(1), dtype=jnp.bfloat16,
                            param_dtype=jnp.bfloat16)
    self.attn = build_attention(kind, cfg)

  def __call__(self, x, backends):
    B, T, _ = x.shape
    out = self.attn(self.norm(x), *_positions_and_segments(B, T), backends=backends)
    return out.out, out.indexer_loss


class LayerBlock(nnx.Module):
  """A whole decoder layer (attention + MoE, `models.DecoderLayer`); returns (out [B, T, D], indexer loss).

  `norm`/`attn` name the attention half as `AttentionBlock` does, and `moe_norm`/`moe` the MoE half,
  so the parts are timed from the very weights the step uses.
  """

  def __init__(self, kind: str, cfg: ModelConfig):
    rngs, layer = nnx.Rngs(1), cfg.first_k_dense  # the first MoE layer
    self.layer = DecoderLayer(cfg, layer, MLASparseAttention(cfg, has_indexer=True, rngs=rngs), rngs=rngs)

  norm = property(lambda self: self.layer.input_layernorm)
  attn = property(lambda self: self.layer.self_attn)
  moe_norm = property(lambda self: self.layer.post_attention_layernorm)
  moe = property(lambda self: self.layer.mlp)

  def __call__(self, x, backends):
    B, T, _ = x.shape
    out, _, indexer_loss, *_ = self.layer(x, *_positions_and_segments(B, T), backends=backends)
    return out, indexer_loss


def Block(kind: str, cfg: ModelConfig) -> nnx.Module:
  """The timed block of a layer kind: the attention block, or the whole decoder layer for `glm`."""
  return LayerBlock(kind, cfg) if kind == "glm" else AttentionBlock(ATTENTION_KIND[kind], cfg)


def _positions_and_segments(B: int, T: int):
  """Positions 0..T-1 and one document per row: (i32[B, T], i32[B, T])."""
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), jnp.zeros((B, T), jnp.int32)


def step_fn(kind: str, mode: str, cfg: ModelConfig, graphdef):
  """jit(value_and_grad) of `mean(out^2) + indexer_loss` w.r.t. (params, x), under the mode's remat."""
  backends = type("Backends", (), step_modes.settings(mode)[0])

  def block_loss(state, x):
    out, aux = nnx.merge(graphdef, state)(x, backends)
    return jnp.mean(jnp.square(out.astype(jnp.float32))) + aux

  def step_loss(state, x):  # the policy keeps the attention output unless the layer chunks its queries
    return remat.remat(block_loss, cfg.remat_policy, save_attention=cfg.saves_attention(x.shape[1]))(state, x)

  return jax.jit(jax.value_and_grad(step_loss, argnums=(0, 1)))


# ------------------------------------------------------------------------------------------------
# Components, each timed alone on the real shapes.


def op_inputs(kind, block, x):
  """The inputs each op sees inside the block (forward, no gradient): a dict per layer kind."""
  B, T, _ = x.shape
  pos, seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), jnp.zeros((B, T), jnp.int32)
  h = block.norm(x)
  a = block.attn
  if kind == "dsa":
    q, k, v, c_q, _ = a._mqa_inputs(h, pos)
    return dict(h=h, c_q=c_q, q=q, k=k, v=v, pos=pos, seg=seg, segs=(seg, seg))
  if kind == "csa":
    c_q, q, kv = a.queries_and_kv(h, pos)
    entries, entry_seg = a.compressor(h, pos, seg)
    return dict(h=h, c_q=c_q, q=q, kv=kv, entries=entries, pos=pos, seg=seg, segs=(seg, entry_seg))
  q, k, v, _ = a.qkv_gate(h, pos)
  block_seg = jnp.zeros((B, T // a.cfg.qsa_block), jnp.int32)  # one document: QSAIndexer's block ids
  return dict(h=h, q=q, k=k, v=v, pos=pos, seg=seg, segs=(seg, block_seg))


def indexer_call(kind, indexer, d):
  if kind == "dsa":
    return indexer(d["h"], d["c_q"], d["pos"])
  if kind == "csa":
    return indexer(d["h"], d["c_q"], d["pos"], d["seg"])
  iq, bk, _ = indexer(d["h"], d["pos"], d["seg"])
  return iq, bk, None


def select(kind, cfg, scale, d, index, *, backend):
  """The layers' selection call: unsorted, as they make it (the same sets; no sort of the winners)."""
  ratio = {"dsa": 1, "csa": cfg.csa_ratio, "qsa": cfg.qsa_block}[kind]
  return ops.flash_topk(*index, topk=cfg.index_topk, compress_ratio=ratio, scale=scale, segment_ids=d["segs"],
                        sorted=False, backend=backend).indices


def attention_args(kind, cfg, d, sel):
  """(q, k, v, indices) of the block's `ops.sparse_attention` call, v None where the layer reads values from k."""
  if kind == "dsa":
    return d["q"], d["k"], None, sel  # values: k's latent prefix (value_dim), as MLASparseAttention
  if kind == "csa":
    T = d["q"].shape[1]
    keys = jnp.concatenate([d["kv"], d["entries"]], axis=1)[:, :, None]
    idx = jnp.concatenate([window_indices(d["seg"], cfg.sliding_window), jnp.where(sel >= 0, sel + T, -1)], -1)
    return d["q"], keys, None, idx  # K = V
  return d["q"], d["k"], d["v"], expand_blocks(sel, d["seg"], cfg.qsa_block)


def indexer_loss(kind, cfg, a, d, index, sel, lse, backend):
  """The block's `ops.indexer_loss` call (QSA: the block form over the selected blocks' tokens)."""
  kw = dict(grad_in_forward=cfg.indexer_loss_grad_in_forward, backend=backend)
  if kind == "qsa":
    key_tokens = block_tokens(expand_blocks(sel, d["seg"], cfg.qsa_block), cfg.qsa_block)
    return ops.indexer_loss(*index, d["q"], d["k"], lse, sel, attn_scale=a.scale, index_scale=a.indexer.score_scale,
                            key_tokens=key_tokens, key_pool=cfg.indexer_pool, **kw)
  q, k = (d["q"], d["k"]) if kind == "dsa" else (d["q"], d["entries"][:, :, None])
  scale = a.scale  # MLA's includes YaRN's mscale
  return ops.indexer_loss(*index, q, k, lse, sel, attn_scale=scale, index_scale=a.indexer.score_scale,
                          compress_ratio=cfg.csa_ratio if kind == "csa" else 1, segment_ids=d["segs"], **kw)


def run_parts(kind, block, x, modes, call):
  """Runs the block's parts one after another through `call(name, fn, *args) -> fn's output`.

  The same chain serves planning (`block` and `x` abstract; `call` compiles ahead and returns
  abstract outputs) and timing (`call` runs the compiled program and returns real outputs), so both
  see the same programs. Every array is an argument of its program, never a closed-over constant.
  """
  layer_kind, kind = kind, ATTENTION_KIND[kind]
  a, cfg = block.attn, block.attn.cfg
  block_graph, block_state = nnx.split(block)
  idx_graph, idx_state = nnx.split(a.indexer)
  sinks = a.attn_sink.value if kind == "csa" else None
  d = call("inputs", lambda s, x: op_inputs(kind, nnx.merge(block_graph, s), x), block_state, x)
  project = lambda s, d: indexer_call(kind, nnx.merge(idx_graph, s), d)

  def proj_loss(s, d):
    return sum(jnp.mean(jnp.square(t.astype(jnp.float32))) for t in project(s, d) if t is not None)

  index = call("indexer_proj_fwd", project, idx_state, d)
  call("indexer_proj_fwd_bwd", jax.grad(proj_loss), idx_state, d)
  sel = None
  for backend in sorted({step_modes.settings(m)[0]["flash_topk"] for m in modes}):
    sel = call(f"selection[{backend}]", functools.partial(select, kind, cfg, a.indexer.score_scale, backend=backend),
               d, index)
  q, k, v, idx = call("attention_inputs", lambda d, sel: attention_args(kind, cfg, d, sel), d, sel)
  scale = a.scale  # MLA's includes YaRN's mscale
  value_dim = cfg.kv_lora_rank if kind == "dsa" else None
  attend = lambda q, k, v, idx, sinks: ops.sparse_attention(q, k, v, idx, sinks=sinks, scale=scale,
                                                            value_dim=value_dim)
  args = (q, k, v, idx, sinks)
  lse = call("attention_fwd", attend, *args)[1]
  attn_loss = lambda *args: jnp.mean(jnp.square(attend(*args)[0].astype(jnp.float32)))
  call("attention_fwd_bwd", jax.grad(attn_loss, argnums=(0, 1) if v is None else (0, 1, 2)), *args)
  del q, k, v, idx, args
  for variant in sorted({loss_variant(kind, m) for m in modes}):
    backend, fused = variant
    vcfg = dataclasses.replace(cfg, indexer_loss_grad_in_forward=fused)
    loss = lambda iq, ik, iw, d, sel, lse, vcfg=vcfg, backend=backend: indexer_loss(
        kind, vcfg, a, d, (iq, ik, iw), sel, lse, backend)
    call(f"loss_fwd{variant}", loss, *index, d, sel, lse)
    call(f"loss_fwd_bwd{variant}", jax.grad(loss, argnums=(0, 1)), *index, d, sel, lse)
  if layer_kind == "glm":  # the MoE on the block's normed input (its own input has the same shape and dtype)
    moe_graph, moe_state = nnx.split(block.moe)
    backends = type("Backends", (), step_modes.settings(modes[-1])[0])
    moe = lambda s, h: nnx.merge(moe_graph, s)(h, backends=backends)[0]
    moe_loss = lambda s, h: jnp.mean(jnp.square(moe(s, h).astype(jnp.float32)))
    call("moe_fwd", moe, moe_state, d["h"])
    call("moe_fwd_bwd", jax.grad(moe_loss, argnums=(0, 1)), moe_state, d["h"])


def loss_variant(kind, mode):
  """(indexer loss backend, fused gradient) of `mode`."""
  ops_, model = step_modes.settings(mode)
  return ops_["indexer_loss"], model["indexer_loss_grad_in_forward"]


def breakdown(kind, mode, cfg, T, times, step_s):
  """{part: seconds per step} and {part: executions per step} of `mode` from the parts' times."""
  ops_, model = step_modes.settings(mode)
  replay = model["remat_policy"] == "selection_replay"
  saves_attention = replay and cfg.saves_attention(T)  # a query-chunked layer reruns its attention forward
  variant = loss_variant(kind, mode)
  fused = variant[1] and replay
  counts = {"indexer_projections": 1, "selection": 1 if replay else 2, "attention_fwd": 1 if saves_attention else 2,
            "attention_bwd": 1, "indexer_loss": 1 if fused else 2}
  parts = {
      "indexer_projections": times["indexer_proj_fwd_bwd"] + times["indexer_proj_fwd"],
      "selection": counts["selection"] * times[f"selection[{ops_['flash_topk']}]"],
      "attention_fwd": counts["attention_fwd"] * times["attention_fwd"],
      "attention_bwd": times["attention_bwd"],
      # forward + backward, plus the remat recompute's forward (fused: one forward-with-gradient).
      "indexer_loss": times[f"loss_fwd_bwd{variant}"] + (0.0 if fused else times[f"loss_fwd{variant}"]),
  }
  if kind == "glm":  # every remat policy recomputes the MoE's forward in the backward pass
    counts["moe"] = 2
    parts["moe"] = times["moe_fwd_bwd"] + times["moe_fwd"]
  parts["other"] = step_s - sum(parts.values())
  return parts, counts


# ------------------------------------------------------------------------------------------------
# The run.


def ablation_applies(kind: str, T: int, mode: str, variant: str) -> bool:
  """False for a `+replay+<opt>` line whose optimization this layer never uses at this T (a duplicate)."""
  if mode not in step_modes.ABLATIONS:
    return True
  cfg = layer_config(kind, variant, mode)
  return any(field in _LAYER_USES[kind] and (field != "attention_query_chunk" or cfg.query_chunk(T))
             for field in step_modes.HOLISTIC[mode.removeprefix("+replay+")])


# The holistic config fields each layer kind reads.
_LAYER_USES = {"dsa": {"indexer_loss_grad_in_forward", "attention_query_chunk"},
               "csa": {"indexer_loss_grad_in_forward"}, "qsa": {"indexer_loss_grad_in_forward"},
               "glm": {"indexer_loss_grad_in_forward", "attention_query_chunk"}}


def plan_layer(kind, T, modes, args, programs):
  """Submits every program of one (layer, T) to `programs`, which compiles them ahead of `run_layer`."""
  variant = config_variant(args)
  x = jax.ShapeDtypeStruct((1, T, layer_config(kind, variant, modes[0]).d_model), jnp.bfloat16)
  for mode in modes:
    cfg = layer_config(kind, variant, mode)
    graphdef, state = nnx.split(nnx.eval_shape(lambda cfg=cfg: Block(kind, cfg)))
    programs.submit((kind, T, f"step[{mode}]"), step_fn(kind, mode, cfg, graphdef), state, x)
  if not args.no_breakdown:
    block = nnx.eval_shape(lambda: Block(kind, parts_config(kind, variant)))
    run_parts(kind, block, x, modes, lambda name, fn, *a: programs.submit((kind, T, name), jax.jit(fn), *a))


def run_layer(kind, T, modes, args, programs, results, tolerance):
  """Checks and times every mode of one (layer, T) from its programs compiled ahead; returns the rows."""
  variant = config_variant(args)
  x = jax.random.normal(jax.random.key(T), (1, T, layer_config(kind, variant, modes[0]).d_model), jnp.bfloat16)
  reference, base_s, rows, times = None, None, [], None
  for mode in modes:
    cfg = layer_config(kind, variant, mode)
    row = dict(layer=kind, T=T, mode=mode, config=variant, remat_policy=cfg.remat_policy,
               ops=step_modes.settings(mode)[0],
               resolved=dict(flash_topk=_resolve(TOPK_REGISTRY, step_modes.settings(mode)[0]["flash_topk"]),
                             sparse_attention=_resolve(ATTENTION_REGISTRY, "auto")))
    log(f"{kind} T={T} {mode}: waiting for its compile")
    try:
      compiled = programs.get((kind, T, f"step[{mode}]"))
      row["peak_gb"] = compiled_memory(compiled)["total_bytes"] / 1e9
      state = nnx.split(Block(kind, cfg))[1]  # the same weights in every mode (fixed seeds)
      if reference is not None:
        poison(reference)
      t0 = time.perf_counter()
      out = jax.block_until_ready(compiled(state, x))  # the warm-up, checked below
      first_s = time.perf_counter() - t0
      if reference is None:
        reference = out
      else:
        row["loss_rel_err"] = rel_err(out[0], reference[0])
        row["grad_rel_err"] = rel_err(out[1], reference[1])
        row["check_ok"] = bool(np.isfinite(row["grad_rel_err"]) and row["grad_rel_err"] < tolerance
                               and row["loss_rel_err"] < tolerance)
      if out is not reference:
        del out
      # --reps 0 (steps of a minute at 1M): the step time is the checked first call's, no warm-up.
      row["step_s"] = timed(compiled, state, x, reps=args.reps, warmup=False) if args.reps else first_s
      row["reps"] = args.reps
      stats = jax.devices()[0].memory_stats() or {}  # None on CPU
      if "peak_bytes_in_use" in stats:  # the process's peak so far: this step's when it is the largest yet
        row["process_peak_gb"] = stats["peak_bytes_in_use"] / 1e9
      del compiled, state
      if mode == modes[0]:
        base_s = row["step_s"]
      row["speedup"] = base_s / row["step_s"] if base_s else None
      row["speedup_over"] = modes[0]
    except Exception as err:  # noqa: BLE001  (XlaRuntimeError and friends: record OOM, re-raise the rest)
      if not is_oom(err):
        raise
      row["step_s"] = "OOM"
      log(f"{kind} T={T} {mode}: OOM ({str(err).splitlines()[0][:160]})")
    if isinstance(row["step_s"], float) and not args.no_breakdown:
      if times is None:
        log(f"{kind} T={T}: timing the parts alone")
        times = part_times(kind, variant, x, modes, args, programs)
      if times:
        row["parts_s"], row["counts"] = breakdown(kind, mode, cfg, T, times, row["step_s"])
    row["parts_alone_s"] = times
    log(_describe(row))
    results.add(row)
    rows.append(row)
  return rows


def part_times(kind, variant, x, modes, args, programs):
  """{part: median seconds} of the parts alone ({} when they do not fit the device)."""
  times, untimed = {}, ("inputs", "attention_inputs")

  def call(name, fn, *a):
    compiled = programs.get((kind, x.shape[1], name))
    out = jax.block_until_ready(compiled(*a))  # the warm-up; its output feeds the next part
    if name not in untimed:
      times[name] = timed(compiled, *a, reps=args.reps, warmup=False)
    return out

  try:
    run_parts(kind, Block(kind, parts_config(kind, variant)), x, modes, call)
  except Exception as err:  # noqa: BLE001
    if not is_oom(err):
      raise
    log(f"{kind} T={x.shape[1]}: parts OOM")
    return {}
  times["attention_bwd"] = max(times["attention_fwd_bwd"] - times["attention_fwd"], 0.0)
  return times


def _resolve(registry, backend):
  return registry.candidates(backend)[0]


def _describe(row):
  if row["step_s"] == "OOM":
    return f"{row['layer']} T={row['T']} {row['mode']}: OOM"
  speedup = f"x{row['speedup']:.2f}" if row["speedup"] else "x?"
  text = (f"{row['layer']} T={row['T']:>7} {row['mode']:<26} step {row['step_s'] * 1e3:10.1f} ms"
          f"  {speedup}  peak {row['peak_gb']:.1f} GB")
  if "grad_rel_err" in row:
    text += f"  check {'ok' if row['check_ok'] else 'MISMATCH'} (loss {row['loss_rel_err']:.1e}, grads {row['grad_rel_err']:.1e})"
  if "parts_s" in row:
    text += "  | " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["parts_s"].items())
  return text


def run(args):
  modes = list(args.modes) + (list(step_modes.ABLATIONS) if args.ablation else [])
  if modes[0] != "megatron_style":
    log(f"note: speedups are relative to the first mode, {modes[0]!r}")
  for mode in modes:
    step_modes.settings(mode)  # a bad name fails before any compile
  seqs = [128] if args.smoke else args.seq
  log(f"device {jax.devices()[0].device_kind}; layers {args.layers}; T {seqs}; modes {modes}")
  log(f"sparse attention in every mode: the same kernel, backend 'auto' -> {_resolve(ATTENTION_REGISTRY, 'auto')!r}"
       " (only selection, recomputation and the indexer loss's backward differ)")
  results = Results(args.out, args.append)
  tolerance = 0.05  # bf16 steps; different near-tie selections move a few rows
  variant = config_variant(args)
  pairs = [(kind, T, [m for m in modes if ablation_applies(kind, T, m, variant)]) for kind in args.layers for T in seqs]
  programs = CompileAhead(args.compile_workers)
  try:
    for kind, T, layer_modes in pairs:
      plan_layer(kind, T, layer_modes, args, programs)
    log(f"traced {len(programs)} programs; compiling on {args.compile_workers} threads")
    # XLA autotunes on the device while it compiles: no timing until every compile is done.
    programs.wait_all()
    log("compiled")
    for kind, T, layer_modes in pairs:
      run_layer(kind, T, layer_modes, args, programs, results, tolerance)
  finally:
    programs.shutdown()
  print_table(results.data["rows"])


def latest_rows(rows):
  """One row per (layer, T, mode): the last one written (an appended rerun supersedes the earlier row).

  Rows marked `invalid` (with the reason, kept in the JSON) are left out.
  """
  return list({(r["layer"], r["T"], r["mode"]): r for r in rows if "invalid" not in r}.values())


def print_table(rows):
  """The markdown table of the rows (latest per layer, T and mode), by layer, T and mode."""
  kinds, modes = list(LAYERS), list(step_modes.STEP_MODES + step_modes.ABLATIONS)
  rows = sorted(latest_rows(rows), key=lambda r: (kinds.index(r["layer"]), r["T"], modes.index(r["mode"])))
  print("\n| layer | T | mode | step ms | speedup | peak GB | check | breakdown ms |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    peak = f"{r['peak_gb']:.1f}" if "peak_gb" in r else ""
    if r["step_s"] == "OOM":
      print(f"| {r['layer']} | {r['T']} | {r['mode']} | OOM | | {peak} | | |")
      continue
    check = "" if "check_ok" not in r else ("ok" if r["check_ok"] else f"MISMATCH {r['grad_rel_err']:.1e}")
    parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.get("parts_s", {}).items())
    over_baseline = r["speedup"] and r.get("speedup_over", "megatron_style") == "megatron_style"
    speedup = f"{r['speedup']:.2f}" if over_baseline else "-"
    print(f"| {r['layer']} | {r['T']} | {r['mode']} | {r['step_s'] * 1e3:.1f} | {speedup} | {peak} | {check} | {parts} |")


# ------------------------------------------------------------------------------------------------
# Plots.


def plot(args):
  """bench/plots/layer_step_speedup.png and layer_step_breakdown_<T>.png from the results JSON."""
  import matplotlib  # noqa: PLC0415  (optional: the `bench` extra)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  with open(args.out) as f:
    data = json.load(f)
  rows = [r for r in latest_rows(data["rows"]) if isinstance(r["step_s"], float)]
  os.makedirs(args.plots, exist_ok=True)
  written = []
  fig, axes = plt.subplots(1, len(LAYERS), figsize=(5 * len(LAYERS), 4.2), sharey=True)
  for ax, kind in zip(axes, LAYERS):
    for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"] != "megatron_style"):
      pts = sorted((r["T"], r["speedup"]) for r in rows if r["layer"] == kind and r["mode"] == mode and r["speedup"]
                   and r.get("speedup_over", "megatron_style") == "megatron_style")
      if pts:
        ax.plot(*zip(*pts), marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title(f"{kind}: speedup over megatron_style")
    ax.set_xlabel("T (tokens)")
    ax.legend(fontsize=8)
  axes[0].set_ylabel("x megatron_style (step time)")
  fig.suptitle(f"{data['device']}, {data['date']}: one attention block, fwd + bwd under remat, bf16, B=1")
  fig.tight_layout()
  path = os.path.join(args.plots, "layer_step_speedup.png")
  fig.savefig(path, dpi=110)
  written.append(path)
  T = args.breakdown_seq
  fig, axes = plt.subplots(1, len(LAYERS), figsize=(5 * len(LAYERS), 4.5))
  for ax, kind in zip(axes, LAYERS):
    # Per mode the latest row that has a breakdown (a later --no-breakdown rerun has none).
    at = [r for r in latest_rows(r for r in data["rows"] if "parts_s" in r and isinstance(r["step_s"], float))
          if r["layer"] == kind and r["T"] == T]
    bottom = np.zeros(len(at))
    for part in ("indexer_projections", "selection", "attention_fwd", "attention_bwd", "indexer_loss", "moe", "other"):
      values = np.array([max(r["parts_s"].get(part, 0.0), 0.0) * 1e3 for r in at])
      ax.bar([r["mode"] for r in at], values, bottom=bottom, label=part)
      bottom += values
    # The parts are timed alone; where they sum past the step ("other" < 0) the tick shows the step.
    ax.scatter([r["mode"] for r in at], [r["step_s"] * 1e3 for r in at], marker="_", s=900, color="black",
               zorder=3, label="whole step")
    ax.set_title(f"{kind} at T={T}")
    ax.set_ylabel("ms per step")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(args.plots, f"layer_step_breakdown_{T}.png")
  fig.savefig(path, dpi=110)
  written.append(path)
  log("wrote", *written)
  return written


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("command", nargs="?", default="run", choices=("run", "plot", "table"),
                      help="run the modes; plot or table: from --out's rows")
  parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
  parser.add_argument("--seq", nargs="+", type=int, default=list(DEFAULT_SEQ))
  parser.add_argument("--modes", nargs="+", default=list(step_modes.STEP_MODES),
                      help=f"of {step_modes.STEP_MODES + step_modes.ABLATIONS}; the first is the speedup base")
  parser.add_argument("--ablation", action="store_true", help="add one +replay+<opt> mode per holistic optimization")
  parser.add_argument("--no-breakdown", action="store_true", help="skip timing the parts alone")
  parser.add_argument("--reps", type=int, default=3, help="timed steps after the warm-up (0: time the warm-up)")
  parser.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                      help="threads compiling ahead of the device work")
  parser.add_argument("--out", default="bench/results/layer_step.json")
  parser.add_argument("--append", action="store_true", help="keep the rows already in --out")
  parser.add_argument("--plots", default=PLOTS)
  parser.add_argument("--breakdown-seq", type=int, default=131072, help="T of the stacked breakdown plot")
  parser.add_argument("--smoke", action="store_true", help="tiny configs at T=128 on any device, in seconds")
  args = parser.parse_args(argv)
  if any(t < 1 for t in args.seq) or args.reps < 0 or (args.reps == 0 and not args.no_breakdown):
    parser.error(f"--seq {args.seq} must be positive and --reps {args.reps} >= 0 (0: the first call's time, "
                 "with --no-breakdown)")
  if args.command == "table":
    with open(args.out) as f:
      return print_table(json.load(f)["rows"])
  if args.command == "plot":
    if args.smoke:
      args.breakdown_seq = 128
    return plot(args)
  if args.smoke:
    args.reps = 1
  return run(args)


if __name__ == "__main__":
  main()
