"""Whole-model training speed through `train.py`, per step mode (issues 9, 19): steps per second.

    python bench/model_step.py --models tiny mid --modes megatron_style hyscale --out bench/results/model_step.json
    python bench/model_step.py --models glm2 --seq 65536 131072 --append --out bench/results/model_step.json
    python bench/model_step.py --models glm2 --seq 524288 1048576 --modes hyscale --no-preflight \
        --set model.attention_query_chunk=32768 model.ffn_token_chunk=32768   # the largest T
    python bench/model_step.py --smoke --out /tmp/model_step.json    # the tiny model for 4 steps on CPU

Each (model, T, mode) is one `train.py` process with `--config.step_mode=<mode>` on the pydoc corpus
(built locally, no download): `--warmup-windows` logging windows of the dense warm-up stage (0 for
none), then two windows of the sparse stage. Steps per second come from train.py's own
`tokens_per_sec` of the last window (the first sparse window holds the sparse step's compile),
divided by the tokens per step; the row also keeps every logged loss, so both stages' curves are
there, and train.py's `device_peak_gb`. Models (GLM-5.1, `configs/glm5_1.py`):
- `tiny`: the tiny variant (4 layers, d 128), batch 8 x 256 tokens, f32.
- `mid`: 4 layers at the real width (d 6144, MLA 64 heads, DSA indexer 32 x 128, k = 2048) with
  dense FFNs (256 experts per layer would not fit one GPU with AdamW), vocab 32768, bf16
  activations, batch 1 x `--mid-seq` tokens.
- `glm2`: 2 layers at the real width, one dense and one MoE layer with `--experts` routed experts of
  the real size (2048 wide, top-8, one shared expert; all 256 with AdamW do not fit one H200), bf16
  parameters and activations, vocab 32768, batch 1 x each `--seq` tokens.

Budget: each process compiles one train step (tiny: seconds; mid: about 1-2 min) and builds the
pydoc tokenizer once per vocab size (cached under `--data-dir`). `--models mid --mid-seq 16384`
in both modes: about 5-7 min on one H200.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_MODELS = {
    "tiny": ["--config=configs/glm5_1.py:tiny"],
    "mid": ["--config=configs/glm5_1.py:full", "--config.model.n_layers=4", "--config.model.first_k_dense=4",
            "--config.model.vocab_size=32768", "--config.data.vocab_size=32768",
            "--config.model.dtype=bfloat16", "--config.data.batch_size=1"],
    "glm2": ["--config=configs/glm5_1.py:full", "--config.model.n_layers=2", "--config.model.first_k_dense=1",
             "--config.model.vocab_size=32768", "--config.data.vocab_size=32768",
             "--config.model.dtype=bfloat16", "--config.model.param_dtype=bfloat16", "--config.data.batch_size=1"],
}


def _log(*args):
  print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}]", *args, flush=True)


def run_one(model, seq, mode, args, workdir):
  """Runs train.py once; returns the row (steps_per_s from the last logged window, or the error)."""
  log_every = args.log_every
  warmup = args.warmup_windows * log_every
  cmd = [sys.executable, "train.py", *_MODELS[model], f"--workdir={workdir}", f"--config.step_mode={mode}",
         "--config.data.source=pydoc", f"--config.data.cache_dir={args.data_dir}",
         f"--config.train.warmup_steps={warmup}", f"--config.train.steps={warmup + 2 * log_every}",
         f"--config.train.log_every={log_every}", "--config.train.checkpoint_every=0",
         "--config.train.progress_bar=false", "--verbosity=0"]  # INFO: the memory preflight's estimate
  if model != "tiny":
    cmd.append(f"--config.data.seq_len={seq}")
  if model == "glm2":
    cmd.append(f"--config.model.n_routed_experts={args.experts}")
  if args.smoke:
    cmd.append("--config.data.batch_size=2")
  if args.no_preflight:
    cmd.append("--config.train.memory_preflight=false")
  cmd += [f"--config.{override}" for override in args.set]
  _log(f"{model} {mode}: {' '.join(cmd[1:])}")
  t0 = time.perf_counter()
  # The long rows need most of the GPU (JAX preallocates 75% unless told): as bench/layer_step.py asks.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")])))
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
  except subprocess.TimeoutExpired as e:
    # TimeoutExpired carries bytes even under text=True.
    stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
    proc = subprocess.CompletedProcess(cmd, -9, stdout, stderr + f"\ntimed out after {args.timeout_s} s")
  row = dict(model=model, T=seq, mode=mode, wall_s=time.perf_counter() - t0, command=" ".join(cmd[1:]))
  if model == "glm2":
    row["experts"] = args.experts
  if args.set:
    row["set"] = list(args.set)
  # train.py logs the memory preflight's estimate before compiling; the row sets it beside the peak.
  estimate = re.search(r"memory preflight: about ([0-9.]+) GiB", proc.stderr + proc.stdout)
  if estimate:
    row["estimate_gb"] = float(estimate.group(1)) * 2**30 / 1e9
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  metrics = []
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      metrics = [json.loads(line) for line in f if line.strip()]
  curve = [{k: m.get(k) for k in ("step", "stage", "loss", "lm_loss", "indexer_loss")} for m in metrics]
  if proc.returncode:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    row["error"] = " | ".join(tail)
    if curve:  # a run cut by --timeout-s keeps the windows it logged
      row["curve"] = curve
    _log(f"{model} {mode}: FAILED: {row['error'][:400]}; logged steps {[m['step'] for m in curve]}")
    return row
  last = metrics[-1]
  tokens_per_step = _tokens_per_step(model, seq, args)
  row.update(steps_per_s=last["tokens_per_sec"] / tokens_per_step, tokens_per_s=last["tokens_per_sec"],
             tokens_per_step=tokens_per_step, lm_loss=last["lm_loss"], indexer_loss=last["indexer_loss"],
             curve=curve)
  if "device_peak_gb" in last:
    row["device_peak_gb"] = max(m.get("device_peak_gb", 0.0) for m in metrics)
  _log(f"{model} T={seq} {mode}: {row['steps_per_s']:.3f} steps/s ({row['tokens_per_s']:.0f} tokens/s), "
       f"lm_loss {row['lm_loss']:.4f}, indexer_loss {row['indexer_loss']:.4f}; losses by step: "
       + ", ".join(f"{m['step']}:{m['loss']:.3f}" for m in row["curve"]))
  return row


def _tokens_per_step(model, seq, args):
  if model != "tiny":
    return seq
  return (2 if args.smoke else 8) * 256


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", nargs="+", default=list(_MODELS), choices=list(_MODELS))
  parser.add_argument("--modes", nargs="+", default=["megatron_style", "hyscale"])
  parser.add_argument("--mid-seq", type=int, default=16384, help="tokens per sequence of `mid`")
  parser.add_argument("--seq", nargs="+", type=int, default=[65536], help="tokens per sequence of `glm2`")
  parser.add_argument("--experts", type=int, default=64, help="routed experts of `glm2`'s MoE layer")
  parser.add_argument("--log-every", type=int, default=10)
  parser.add_argument("--warmup-windows", type=int, default=0,
                      help="logging windows of the dense warm-up stage before the two sparse ones")
  parser.add_argument("--no-preflight", action="store_true",
                      help="run past the memory preflight (to find the largest T that fits)")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="config overrides for every run, e.g. model.attention_query_chunk=32768")
  parser.add_argument("--timeout-s", type=float, default=None, help="stop a run after this long (its row says so)")
  parser.add_argument("--append", action="store_true", help="keep the rows already in --out")
  parser.add_argument("--data-dir", default=os.environ.get("HYSCALE_DATA_DIR", ".data"))
  parser.add_argument("--out", default="bench/results/model_step.json")
  parser.add_argument("--smoke", action="store_true", help="the tiny model for 4 steps, in seconds on CPU")
  args = parser.parse_args(argv)
  if args.smoke:
    args.models, args.log_every = ["tiny"], 2
  if min(args.mid_seq, args.log_every, args.experts, *args.seq) < 1 or args.warmup_windows < 0:
    parser.error(f"--mid-seq {args.mid_seq}, --seq {args.seq}, --experts {args.experts} and --log-every "
                 f"{args.log_every} must be positive, --warmup-windows {args.warmup_windows} >= 0")
  sys.path.insert(0, ".")
  from hyscale_jax.training import step_modes  # noqa: PLC0415

  for mode in args.modes:
    step_modes.settings(mode)  # a bad name fails before any run
  kept = []
  if args.append and args.out and os.path.exists(args.out):
    with open(args.out) as f:
      kept = json.load(f)["rows"]
  rows = []
  for model in args.models:
    seqs = {"tiny": [256], "mid": [args.mid_seq], "glm2": args.seq}[model]
    for seq in seqs:
      for mode in args.modes:
        with tempfile.TemporaryDirectory() as workdir:
          rows.append(run_one(model, seq, mode, args, workdir))
        rows[-1]["date"] = datetime.date.today().isoformat()
        base = next((r for r in rows if (r["model"], r["T"], r["mode"]) == (model, seq, args.modes[0])
                     and "steps_per_s" in r), None)
        if base and "steps_per_s" in rows[-1]:
          rows[-1]["speedup"] = rows[-1]["steps_per_s"] / base["steps_per_s"]
          rows[-1]["speedup_over"] = args.modes[0]
        if args.out:
          os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
          with open(args.out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), rows=kept + rows), f, indent=1)
  print("\n| model | T | mode | steps/s | tokens/s | speedup | peak GB | estimate GB |\n|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['model']} | {r['T']} | {r['mode']} | failed | | | | {r.get('estimate_gb', float('nan')):.1f} |")
    else:
      print(f"| {r['model']} | {r['T']} | {r['mode']} | {r['steps_per_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r.get('speedup', float('nan')):.2f} | {r.get('device_peak_gb', float('nan')):.1f} | "
            f"{r.get('estimate_gb', float('nan')):.1f} |")
  return rows


if __name__ == "__main__":
  main()
