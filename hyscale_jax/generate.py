"""`python -m hyscale_jax.generate --workdir W --prompt "..."`: text from a train.py run's checkpoint.

Reads the run's config (`<W>/config.json`), its tokenizer (the one its text was read with) and a
checkpoint (the newest, or `--step N`); encodes the prompt, appends up to `--max_new_tokens` tokens,
and prints the prompt and its continuation on stdout (what was loaded, and the speed, go to stderr).
Tokens are sampled with `--temperature`, `--top_k` and `--top_p` (`models.generate.Sampling`), or
chosen greedily with `--greedy`; decoding stops at the tokenizer's end-of-document token unless
`--ignore_eos`. GLM-5.1 (MLA + DSA) decodes with a KV cache (`models/kv_cache.py`: one compiled step
per token); other architectures fall back to `models.generate`, which reruns the whole buffer for every
token (said in one line on stderr). `--out` writes the ids and text as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from hyscale_jax import cli, models, workdir_tools
from hyscale_jax.models import kv_cache
from hyscale_jax.models.generate import Sampling
from hyscale_jax.training import lm


def _parser() -> workdir_tools.ArgumentParser:
  parser = workdir_tools.ArgumentParser(
      prog="python -m hyscale_jax.generate",
      description="Text from a train.py run's checkpoint, through the run's tokenizer.")
  workdir_tools.add_workdir_flags(parser)
  parser.add_argument("--prompt", required=True, help="the text to continue (not empty)")
  parser.add_argument("--max_new_tokens", type=int, default=100,
                      help="tokens to append, at most (>= 1; default %(default)s)")
  parser.add_argument("--temperature", type=float, default=0.8,
                      help="divides the logits before sampling (>= 0, 0 is greedy; default %(default)s)")
  parser.add_argument("--top_k", type=int, default=40,
                      help="sample among the k likeliest tokens (>= 0, 0: all; default %(default)s)")
  parser.add_argument("--top_p", type=float, default=0.95,
                      help="then among the likeliest tokens whose probability sums to top_p (in (0, 1], 1: all; "
                      "default %(default)s)")
  parser.add_argument("--greedy", action="store_true", help="take the likeliest token every step (no sampling)")
  parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default %(default)s)")
  parser.add_argument("--ignore_eos", action="store_true",
                      help="keep going past the end-of-document token (default: stop there)")
  parser.add_argument("--no_kv_cache", action="store_true",
                      help="decode without the KV cache (models.generate: the whole buffer per token)")
  parser.add_argument("--out", default=None, help="also write the prompt, ids and text to this JSON file")
  parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
  return parser


def _check_flags(args) -> Sampling | None:
  """The sampling (None: greedy) once every flag is in range; ValueError naming the flag otherwise."""
  if not args.prompt:
    raise ValueError("--prompt is empty: give the text to continue.")
  if args.max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens={args.max_new_tokens} must be >= 1.")
  if args.step is not None and args.step < 0:
    raise ValueError(f"--step={args.step} must be >= 0.")
  if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
    raise FileNotFoundError(f"--out={args.out}: its folder does not exist.")
  try:
    sampling = Sampling(args.temperature, args.top_k, args.top_p).check()
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  return None if args.greedy or sampling.greedy else sampling


def _main(args) -> None:
  sampling = _check_flags(args)
  config = workdir_tools.load_config(args.workdir)
  workdir_tools.check_step(args.workdir, args.step)
  dataset = workdir_tools.open_validation(config)
  tokenizer = dataset.tokenizer
  if tokenizer is None:
    raise ValueError(f"the run in {args.workdir!r} has no tokenizer (it read token ids: data.source="
                     f"{config.data.source!r} without data.tokenizer), so text cannot be turned into ids.")
  prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
  if not prompt_ids:
    raise ValueError(f"--prompt={args.prompt!r} encodes to no tokens.")
  model, step = lm.restore_model(config, args.workdir, step=args.step)
  print(workdir_tools.describe(config, args.workdir, step), file=sys.stderr, flush=True)

  reason = "--no_kv_cache" if args.no_kv_cache else kv_cache.unsupported_reason(model)
  if reason is not None and not args.no_kv_cache:
    print(f"note: no KV cache ({reason}); decoding without one, the whole sequence per token.", file=sys.stderr)
  stop = None if args.ignore_eos else dataset.eos_id
  prompt = np.asarray([prompt_ids], np.int32)
  timings, start = {}, time.perf_counter()
  if reason is None:
    out = kv_cache.generate(model, prompt, args.max_new_tokens, backends=config.ops, sampling=sampling,
                            seed=args.seed, stop_token=stop, timings=timings)
  else:
    out = models.generate(model, prompt, args.max_new_tokens, backends=config.ops, sampling=sampling, seed=args.seed)
  new_ids = np.asarray(out)[0, len(prompt_ids):].tolist()
  seconds = time.perf_counter() - start
  if stop is not None and stop in new_ids:
    new_ids = new_ids[:new_ids.index(stop)]  # the document ends there; the end token itself is not text
  text = tokenizer.decode(new_ids, skip_special_tokens=False)
  print(args.prompt + text, flush=True)
  print(_speed(len(new_ids), seconds, timings, sampling), file=sys.stderr)
  if args.out is not None:
    record = {"workdir": os.path.abspath(args.workdir), "architecture": config.model.architecture, "step": step,
              "prompt": args.prompt, "prompt_ids": prompt_ids, "ids": new_ids, "text": text,
              "sampling": None if sampling is None else sampling._asdict(), "seed": args.seed,
              "kv_cache": reason is None, "seconds": seconds}
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)
      f.write("\n")


def _speed(n_new: int, seconds: float, timings: dict, sampling: Sampling | None) -> str:
  """One line: how many tokens, how long, and the decode rate apart from compilation where known."""
  how = "greedy" if sampling is None else "sampled"
  if not timings:
    return f"{n_new} new tokens in {seconds:.2f} s, compilation included ({how}, no KV cache)"
  line = (f"{n_new} new tokens in {seconds:.2f} s ({how}, KV cache): prefill {timings['prefill_s']:.2f} s and first "
          f"step {timings.get('first_step_s', 0.0):.2f} s with their compilation")
  if timings["decode_steps"]:
    line += f", then {timings['decode_steps'] / timings['decode_s']:.1f} tokens/s"
  return line


def main(argv: Sequence[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  sys.exit(cli.run(lambda: _main(args), traceback=args.traceback))


if __name__ == "__main__":
  main()
