"""The memory preflight's estimate against measured peaks: train.py's own step, one fresh process per config.

  python -m bench.memory_check --out bench/results/memory_check.json          # H200, about 6 minutes
  python -m bench.memory_check --smoke --out /tmp/memory_check_smoke.json     # CPU, seconds

For each configuration a child process (so no peak carries over) builds the step exactly as
`train.py` does (`lm.setup`, `lm.memory_preflight`, `lm.build_training`: the same model, optimizer,
shardings and jitted `train_step`), compiles it for the sparse stage, runs 2 steps on packed pydoc text,
and reads the device's `peak_bytes_in_use` plus the compiled `memory_analysis()`. The parent prints
one row per configuration (estimate, measured peak, ratio, within 25%?) with every estimate term, and
rewrites --out after each row. Where the device has no memory stats (CPU), the compiled figures
(arguments + outputs - aliased + temporaries) stand in for the peak, and the row says so.

Configurations run in priority order; one that would start past --budget-s is skipped and listed, and
one whose estimate exceeds the device by over 15% is skipped as "estimate exceeds device" (that is the
preflight's verdict, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import compiled_memory, write_json

GiB = 2**30
DATA_VOCAB = 2048  # the pydoc BPE; every model's vocabulary is at least this
# Mid-size models: real widths, 2-3 layers, fewer routed experts and a 32K vocabulary so that the
# parameters (f32 + AdamW) leave room for activations at 64K tokens on one H200. bf16 activations.
_MID = dict(vocab_size=32768, dtype="bfloat16", param_dtype="float32")
_GLM_MID = dict(_MID, n_layers=2, first_k_dense=1, n_routed_experts=16)
_DSV4_MID = dict(_MID, n_layers=3, compress_ratios=[0, 4, 128], n_routed_experts=16)
# No Engram: its 51.2B-parameter n-gram table alone outgrows the H200 (and its EOS id the 32K vocabulary).
_QWEN_MID = dict(_MID, n_layers=2, layer_types=["qsa", "qsa"], n_routed_experts=32, ple_layer_ids=[])


def _case(name, config, variant, seq_len, remat, model=None, batch_size=1):
  return dict(name=name, config=config, variant=variant, seq_len=seq_len, batch_size=batch_size, remat=remat,
              model=dict(model or {}))


def device_cases() -> list[dict]:
  """The H200 list, most informative first (the budget may cut the tail)."""
  glm, dsv4, qwen = "configs/glm5_1.py", "configs/deepseek_v4_flash.py", "configs/qwen3_8_flash_next.py"
  # The first four are the calibration set: about 6 minutes on an H200 (tiny ~55 s, each 2L mid ~125 s,
  # ~100 s of it compiling), so the default budget reaches the 4K row.
  # The calibration set was measured with the MoE on ragged_dot's dense expansion; on a Hopper GPU the
  # MoE now runs ops.grouped_matmul's kernel, so a rerun recalibrates MOE_GROUPED_COPIES instead.
  return [
      _case("glm5_1 tiny", glm, "tiny", 256, "selection_replay", batch_size=8),
      _case("glm5_1 2L mid", glm, "full", 16384, "selection_replay", _GLM_MID),
      _case("glm5_1 2L mid", glm, "full", 16384, "full", _GLM_MID),
      _case("glm5_1 2L mid", glm, "full", 4096, "selection_replay", _GLM_MID),
      _case("qwen3_8 2L mid", qwen, "full", 16384, "selection_replay", _QWEN_MID),
      _case("glm5_1 2L mid", glm, "full", 65536, "selection_replay", _GLM_MID),
      _case("glm5_1 2L mid", glm, "full", 65536, "full", _GLM_MID),
      _case("qwen3_8 2L mid", qwen, "full", 16384, "full", _QWEN_MID),
      # Last: the V4 sparse-attention row of an earlier bench did not finish in its call .
      _case("deepseek_v4 3L mid", dsv4, "full", 16384, "selection_replay", _DSV4_MID),
      _case("deepseek_v4 3L mid", dsv4, "full", 16384, "full", _DSV4_MID),
  ]


# The tests' CPU-sized GLM-5.1: compiles in seconds.
_SMOKE = dict(d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
              qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2, moe_inter=16,
              index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=8, vocab_size=DATA_VOCAB)


def smoke_cases() -> list[dict]:
  """CPU-sized models: the whole path (children, estimate, compile, 2 steps, table) in seconds."""
  return [
      _case("glm5_1 smoke", "configs/glm5_1.py", "tiny", 64, "selection_replay", _SMOKE, batch_size=2),
      _case("glm5_1 smoke", "configs/glm5_1.py", "tiny", 64, "full", _SMOKE, batch_size=2),
  ]


# ----------------------------------------------------------------------------------------------------
# Child: one configuration.


def build_config(case: dict, data_dir: str):
  """train.py's config for `case`: sparse stage from step 0 (the dense warm-up is [T, T]), 2 steps."""
  import importlib  # noqa: PLC0415

  module = importlib.import_module(case["config"].removesuffix(".py").replace("/", "."))
  config = module.get_config(case["variant"])
  config.model.update(case["model"], remat_policy=case["remat"])
  config.data.update(source="pydoc", vocab_size=DATA_VOCAB, seq_len=case["seq_len"],
                     batch_size=case["batch_size"], cache_dir=data_dir)
  config.train.update(steps=2, warmup_steps=0, progress_bar=False)
  return config


def run_case(case: dict, data_dir: str, force: bool) -> dict:
  """Estimate, build, compile and run train.py's step for `case`; every figure in bytes."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from hyscale_jax import parallel  # noqa: PLC0415
  from hyscale_jax import sharding as shd  # noqa: PLC0415
  from hyscale_jax.training import lm, memory  # noqa: PLC0415
  from hyscale_jax.training.text_data import PackedTextDataset  # noqa: PLC0415

  device = jax.devices()[0]
  config = build_config(case, data_dir)
  cfg, mesh = lm.setup(config)
  estimate = lm.memory_preflight(config, cfg, mesh, available=None)  # train.py's split of batch and params
  available = memory.device_memory_bytes()
  result = dict(device=str(device.device_kind), platform=device.platform, estimate_bytes=estimate.total,
                estimate_terms=estimate.components, device_bytes=available,
                copies=dict(layer_transient=memory.LAYER_TRANSIENT_COPIES[cfg.remat_policy], logits=memory.LOGITS_COPIES,
                            moe_expansion_f32=memory.MOE_EXPANSION_F32_COPIES, moe_grouped=memory.MOE_GROUPED_COPIES,
                            runtime_reserve=memory.RUNTIME_RESERVE_BYTES))
  if available and estimate.total > 1.15 * available and not force:
    return dict(result, status="skipped: estimate exceeds device")
  stats = lambda: device.memory_stats() or {}
  rules = shd.rules_from_config(config.mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    t0 = time.perf_counter()
    training = lm.build_training(config, cfg, mesh, rules)
    jax.block_until_ready(training.state)
    result["state_bytes_in_use"] = stats().get("bytes_in_use")
    data = PackedTextDataset(source="pydoc", vocab_size=DATA_VOCAB, seq_len=case["seq_len"],
                             batch_size=case["batch_size"], seed=0, cache_dir=data_dir)
    batches = [parallel.global_batch(mesh, data.batch(i)) for i in range(2)]
    result["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = training.train_step.lower(training.state, batches[0], dense=False).compile()
    result["compile_s"] = time.perf_counter() - t0
    result["memory_analysis"] = compiled_memory(compiled)
    state, losses, step_s = training.state, [], []
    for batch in batches:
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch)
      losses.append(float(metrics["loss"]))
      step_s.append(time.perf_counter() - t0)
  result.update(losses=losses, step_s=step_s)
  peak = stats().get("peak_bytes_in_use")
  if peak is not None:
    result.update(measured_bytes=int(peak), measured_source="peak_bytes_in_use")
  elif result["memory_analysis"]:
    result.update(measured_bytes=result["memory_analysis"]["total_bytes"],
                  measured_source="compiled memory_analysis (no device memory stats)")
  return dict(result, status="ok")


def child_main(case_json: str, data_dir: str, force: bool) -> None:
  case = json.loads(case_json)
  try:
    result = run_case(case, data_dir, force)
  except Exception as e:  # noqa: BLE001 (an OOM or a lowering error is a result to report, not a crash)
    result = dict(status=f"error: {type(e).__name__}: {str(e)[:400]}")
  print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------------
# Parent: one child per configuration, the table, the JSON.


def _prepare_data(data_dir: str) -> None:
  """Builds the pydoc BPE cache once, so the children only read it (no JAX here: no device memory)."""
  from hyscale_jax.training.text_data import build_or_load_cache  # noqa: PLC0415

  build_or_load_cache("pydoc", DATA_VOCAB, data_dir)


def _row(case: dict, result: dict) -> dict:
  row = dict(case, **result)
  measured, est = result.get("measured_bytes"), result.get("estimate_bytes")
  if measured and est:
    row["ratio"] = est / measured
    row["within_25pct"] = abs(row["ratio"] - 1) <= 0.25
  return row


def _format(row: dict) -> str:
  gib = lambda b: f"{b / GiB:8.3f}" if b is not None else "       -"
  ratio = f"{row['ratio']:5.2f}" if "ratio" in row else "    -"
  within = {True: "yes", False: "NO"}.get(row.get("within_25pct"), "-")
  head = (f"{row['name']:<20} {row['seq_len']:>6} {row['remat']:<16} {gib(row.get('estimate_bytes'))} "
          f"{gib(row.get('measured_bytes'))} {ratio} {within:<4} {row['status']}")
  extra = []
  if row.get("measured_source", "peak_bytes_in_use") != "peak_bytes_in_use":
    extra.append(f"measured = {row['measured_source']}")
  if row.get("memory_analysis"):
    ma = row["memory_analysis"]
    extra.append(f"compiled: args {ma['argument_size_in_bytes'] / GiB:.2f} + out {ma['output_size_in_bytes'] / GiB:.2f}"
                 f" - alias {ma['alias_size_in_bytes'] / GiB:.2f} + temp {ma['temp_size_in_bytes'] / GiB:.2f}"
                 f" = {ma['total_bytes'] / GiB:.2f} GiB")
  if row.get("state_bytes_in_use") is not None:
    extra.append(f"state after init {row['state_bytes_in_use'] / GiB:.2f} GiB")
  if "compile_s" in row:
    extra.append(f"compile {row['compile_s']:.1f}s, steps {', '.join(f'{s:.2f}' for s in row['step_s'])}s, "
                 f"losses {', '.join(f'{x:.3f}' for x in row['losses'])}")
  if row.get("estimate_terms"):
    extra.append("terms: " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in row["estimate_terms"].items()))
  return head + "".join(f"\n    {e}" for e in extra)


HEADER = (f"{'config':<20} {'T':>6} {'remat':<16} {'est GiB':>8} {'peak GiB':>8} {'ratio':>5} {'25%?':<4} status")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny configs on CPU, seconds")
  parser.add_argument("--out", default="bench/results/memory_check.json", help="JSON, rewritten after each row")
  parser.add_argument("--only", nargs="*", default=None, help="run only these cases, by 0-based index in the list")
  parser.add_argument("--budget-s", type=float, default=320.0,
                      help="start no case past this many seconds; the last may run 150 s more")
  parser.add_argument("--case-timeout-s", type=float, default=180.0, help="kill a child after this long")
  parser.add_argument("--data-dir", default=os.environ.get("HYSCALE_DATA_DIR") or "/tmp/hyscale_memory_check_data")
  parser.add_argument("--force", action="store_true", help="run cases even when the estimate exceeds the device")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child is not None:
    child_main(args.child, args.data_dir, args.force)
    return

  cases = smoke_cases() if args.smoke else device_cases()
  if args.only:
    cases = [cases[int(i)] for i in args.only]
  env = dict(os.environ)
  if args.smoke:
    env.setdefault("JAX_PLATFORMS", "cpu")
  else:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the allocator's limit; the peak is what XLA used
  print(f"memory check: {len(cases)} configs, one process each, budget {args.budget_s:.0f}s", flush=True)
  t_start = time.perf_counter()
  _prepare_data(args.data_dir)
  print(f"pydoc token cache ready in {args.data_dir} ({time.perf_counter() - t_start:.1f}s)", flush=True)
  rows = []
  print(HEADER, flush=True)
  for case in cases:
    elapsed = time.perf_counter() - t_start
    if elapsed > args.budget_s:
      result = dict(status=f"skipped: budget ({elapsed:.0f}s > {args.budget_s:.0f}s)")
    else:
      timeout = min(args.case_timeout_s, max(args.budget_s + 150 - elapsed, 30))
      cmd = [sys.executable, "-m", "bench.memory_check", "--child", json.dumps(case), "--data-dir", args.data_dir]
      cmd += ["--force"] if args.force else []
      t0 = time.perf_counter()
      try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if lines:
          result = json.loads(lines[-1][len("RESULT "):])
        else:
          tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
          result = dict(status=f"error: child exited {proc.returncode}: {' | '.join(tail)[:400]}")
      except subprocess.TimeoutExpired:
        result = dict(status=f"error: timed out after {timeout:.0f}s")
      result["wall_s"] = time.perf_counter() - t0
    row = _row(case, result)
    rows.append(row)
    print(_format(row), flush=True)
    write_json(args.out, dict(rows=rows, smoke=args.smoke, wall_s=time.perf_counter() - t_start))
  ok = [r for r in rows if "ratio" in r]
  print(f"\n{sum(r['within_25pct'] for r in ok)}/{len(ok)} measured configs within 25% "
        f"({time.perf_counter() - t_start:.0f}s); JSON in {args.out}", flush=True)


if __name__ == "__main__":
  main()
