"""Whole-model training steps through `train.py`, per step mode: every step timed, both modes in one call.

    python -m bench.model_step --models glm2 --seq 65536 131072 --modes megatron_style hyscale
    python -m bench.model_step --models glm2 --seq 262144 524288 1048576 --modes hyscale --no-preflight \
        --set model.attention_query_chunk=32768 model.ffn_token_chunk=32768     # the longest T
    python -m bench.model_step --models glm2 --seq 65536 131072 --modes hyscale --stage dense --steps 2
    python -m bench.model_step --smoke --out /tmp/model_step.json    # the tiny model, a few steps on CPU

Each (model, T, mode, stage) is one `train.py` process with `--config.step_mode=<mode>` on the pydoc
corpus (built locally, no download), logging every step (`--config.train.log_every=1`, the validation
loss only at the end). Its first step of the stage is the warm-up (its compile is not in any step's
time: train.py compiles ahead of the step); the next `--steps` steps are the steady ones. Each step's
`step_time_s` is train.py's own: device-synced, without evaluation or checkpoint time. The row keeps
every steady step (time, MFU, FlashTopK's rescued rows, loss) and their median, mean, p90 and max;
`spread` is the largest step's distance from the median, as a fraction of it. `speedup` is the
first mode's mean step time over this one's, at the same (model, T, stage).

Stages: `sparse` (the default: the sparse stage from step 1, as after the warm-up) or `dense` (the dense
warm-up alone, where only the indexer learns). Models (GLM-5.1, `configs/glm5_1.py`):
- `tiny`: the tiny variant (4 layers, d 128), batch 8 x 256 tokens, f32.
- `mid`: 4 layers at the real width (d 6144, MLA 64 heads, DSA indexer 32 x 128, k = 2048) with
  dense FFNs, vocab 32768, bf16 activations, batch 1 x `--mid-seq` tokens.
- `glm2`: 2 layers at the real width, one dense and one MoE layer with `--experts` routed experts of
  the real size (2048 wide, top-8, one shared expert; all 256 with AdamW do not fit one H200), bf16
  parameters and activations, vocab 32768, batch 1 x each `--seq` tokens.

Budget: each process compiles one train step (glm2 at 64K-128K: about 1-2 min on one H200) and then runs
1 + `--steps` steps; a 128K `megatron_style` step takes tens of seconds, a dense warm-up step at 128K
minutes, so give those rows fewer steps (`--steps`) or their own call.
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

import numpy as np

_MODELS = {
    "tiny": ["--config=configs/glm5_1.py:tiny"],
    "mid": ["--config=configs/glm5_1.py:full", "--config.model.n_layers=4", "--config.model.first_k_dense=4",
            "--config.model.vocab_size=32768", "--config.data.vocab_size=32768",
            "--config.model.dtype=bfloat16", "--config.data.batch_size=1"],
    "glm2": ["--config=configs/glm5_1.py:full", "--config.model.n_layers=2", "--config.model.first_k_dense=1",
             "--config.model.vocab_size=32768", "--config.data.vocab_size=32768",
             "--config.model.dtype=bfloat16", "--config.model.param_dtype=bfloat16", "--config.data.batch_size=1"],
}
# What each steady step keeps from its metrics.jsonl row.
_STEP_FIELDS = ("step", "step_time_s", "mfu", "model_tflops_per_device", "topk_rescued_rows", "loss", "lm_loss",
                "indexer_loss")


def _log(*args):
  print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}]", *args, flush=True)


def command(model: str, seq: int, mode: str, stage: str, args, workdir: str) -> list[str]:
  """The train.py command line of one row."""
  total = 1 + args.steps  # the stage's warm-up step, then the steady ones
  warmup = total if stage == "dense" else 0
  cmd = [sys.executable, "train.py", *_MODELS[model], f"--workdir={workdir}", f"--config.step_mode={mode}",
         "--config.data.source=pydoc", f"--config.data.cache_dir={args.data_dir}",
         f"--config.train.warmup_steps={warmup}", f"--config.train.steps={total}", "--config.train.log_every=1",
         f"--config.train.eval_every={total}", "--config.train.checkpoint_every=0",
         "--config.train.progress_bar=false", "--verbosity=0"]  # INFO: the memory preflight's estimate
  if model != "tiny":
    cmd.append(f"--config.data.seq_len={seq}")
  if model == "glm2":
    cmd.append(f"--config.model.n_routed_experts={args.experts}")
  if args.smoke:
    cmd.append("--config.data.batch_size=2")
  if args.no_preflight:
    cmd.append("--config.train.memory_preflight=false")
  return cmd + [f"--config.{override}" for override in args.set]


def step_statistics(seconds: list[float]) -> dict:
  """Median, mean, p90 and max of the steady steps' times, and the largest distance from the median as
  a fraction of it (`spread`)."""
  t = np.asarray(seconds, np.float64)
  median = float(np.median(t))
  return dict(median_s=median, mean_s=float(t.mean()), p90_s=float(np.percentile(t, 90)), max_s=float(t.max()),
              spread=float(np.abs(t - median).max() / median))


def run_one(model: str, seq: int, mode: str, stage: str, args, workdir: str) -> dict:
  """Runs train.py once; returns the row (every steady step and their statistics, or the error)."""
  cmd = command(model, seq, mode, stage, args, workdir)
  _log(f"{model} T={seq} {mode} {stage}: {' '.join(cmd[1:])}")
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
  row = dict(model=model, T=seq, mode=mode, stage=stage, wall_s=time.perf_counter() - t0, command=" ".join(cmd[1:]))
  if model == "glm2":
    row["experts"] = args.experts
  # train.py logs the memory preflight's estimate before compiling; the row sets it beside the peak.
  estimate = re.search(r"memory preflight: about ([0-9.]+) GiB", proc.stderr + proc.stdout)
  if estimate:
    row["estimate_gb"] = float(estimate.group(1)) * 2**30 / 1e9
  compile_s = re.findall(r"compiled the \S+(?: warm-up)? step in ([0-9.]+) s", proc.stderr + proc.stdout)
  if compile_s:
    row["compile_s"] = float(compile_s[-1])
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  metrics = []
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      metrics = [json.loads(line) for line in f if line.strip()]
  row["steps"] = [{k: m[k] for k in _STEP_FIELDS if k in m} for m in metrics[1:]]  # after the warm-up step
  if metrics:
    row["warmup_step"] = {k: metrics[0][k] for k in _STEP_FIELDS if k in metrics[0]}
  if any("device_peak_gb" in m for m in metrics):
    row["device_peak_gb"] = max(m.get("device_peak_gb", 0.0) for m in metrics)
  if proc.returncode or not row["steps"]:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    row["error"] = " | ".join(tail) or f"no steady step logged (exit status {proc.returncode})"
    _log(f"{model} {mode} {stage}: FAILED: {row['error'][:400]}; logged steps {[m['step'] for m in metrics]}")
    return row
  row["step_time"] = step_statistics([s["step_time_s"] for s in row["steps"]])
  row["tokens_per_step"] = _tokens_per_step(model, seq, args)
  row["tokens_per_s"] = row["tokens_per_step"] / row["step_time"]["mean_s"]
  if all("mfu" in s for s in row["steps"]):
    row["mfu_median"] = float(np.median([s["mfu"] for s in row["steps"]]))
  row["topk_rescued_rows"] = int(sum(s.get("topk_rescued_rows", 0) for s in row["steps"]))
  st = row["step_time"]
  _log(f"{model} T={seq} {mode} {stage}: median {st['median_s']:.3f} s, mean {st['mean_s']:.3f}, p90 "
       f"{st['p90_s']:.3f}, max {st['max_s']:.3f} (spread {100 * st['spread']:.0f}%), MFU "
       f"{100 * row.get('mfu_median', float('nan')):.1f}%, rescued rows {row['topk_rescued_rows']}; steps "
       + ", ".join(f"{s['step']}:{s['step_time_s']:.3f}" for s in row["steps"]))
  return row


def _tokens_per_step(model, seq, args):
  if model != "tiny":
    return seq
  return (2 if args.smoke else 8) * 256


def table(rows: list[dict]) -> str:
  """The rows as a Markdown table (times in seconds)."""
  lines = ["| model | T | mode | stage | steps | median | mean | p90 | max | spread | MFU | speedup | rescued | "
           "peak GB |", "|" + "---|" * 14]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['T']} | {r['mode']} | {r['stage']} | failed: {r['error'][:80]} |")
      continue
    st = r["step_time"]
    lines.append(f"| {r['model']} | {r['T']} | {r['mode']} | {r['stage']} | {len(r['steps'])} | {st['median_s']:.3f} | "
                 f"{st['mean_s']:.3f} | {st['p90_s']:.3f} | {st['max_s']:.3f} | {100 * st['spread']:.0f}% | "
                 f"{100 * r.get('mfu_median', float('nan')):.1f}% | {r.get('speedup', float('nan')):.2f} | "
                 f"{r['topk_rescued_rows']} | {r.get('device_peak_gb', float('nan')):.1f} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", nargs="+", default=["glm2"], choices=list(_MODELS))
  parser.add_argument("--modes", nargs="+", default=["megatron_style", "hyscale"])
  parser.add_argument("--stage", choices=("sparse", "dense"), default="sparse")
  parser.add_argument("--steps", type=int, default=8, help="steady steps timed after the stage's first")
  parser.add_argument("--mid-seq", type=int, default=16384, help="tokens per sequence of `mid`")
  parser.add_argument("--seq", nargs="+", type=int, default=[65536], help="tokens per sequence of `glm2`")
  parser.add_argument("--experts", type=int, default=64, help="routed experts of `glm2`'s MoE layer")
  parser.add_argument("--no-preflight", action="store_true",
                      help="run past the memory preflight (to find the largest T that fits)")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="config overrides for every run, e.g. model.attention_query_chunk=32768")
  parser.add_argument("--timeout-s", type=float, default=None, help="stop a run after this long (its row says so)")
  parser.add_argument("--append", action="store_true", help="keep the rows already in --out")
  parser.add_argument("--data-dir", default=os.environ.get("HYSCALE_DATA_DIR", ".data"))
  parser.add_argument("--out", default="bench/results/model_step.json")
  parser.add_argument("--smoke", action="store_true", help="the tiny model for a few steps, in seconds on CPU")
  args = parser.parse_args(argv)
  if args.smoke:
    args.models, args.steps = ["tiny"], min(args.steps, 3)
  if min(args.mid_seq, args.experts, args.steps, *args.seq) < 1:
    parser.error(f"--mid-seq {args.mid_seq}, --seq {args.seq}, --experts {args.experts} and --steps {args.steps} "
                 "must be positive")
  from hyscale_jax.training import step_modes  # noqa: PLC0415

  for mode in args.modes:
    step_modes.settings(mode)  # a bad name fails before any run
  kept = []
  if args.append and args.out and os.path.exists(args.out):
    with open(args.out) as f:
      kept = json.load(f)["rows"]
  rows = []
  for model in args.models:
    for seq in {"tiny": [256], "mid": [args.mid_seq], "glm2": args.seq}[model]:
      for mode in args.modes:
        with tempfile.TemporaryDirectory() as workdir:
          row = run_one(model, seq, mode, args.stage, args, workdir)
        row["date"] = datetime.date.today().isoformat()
        base = next((r for r in rows if (r["model"], r["T"], r["mode"]) == (model, seq, args.modes[0])
                     and "step_time" in r), None)
        if base and "step_time" in row:
          row["speedup"] = base["step_time"]["mean_s"] / row["step_time"]["mean_s"]
          row["speedup_over"] = args.modes[0]
        rows.append(row)
        if args.out:
          os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
          with open(args.out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), rows=kept + rows), f, indent=1)
  print("\n" + table(rows))
  return rows


if __name__ == "__main__":
  main()
