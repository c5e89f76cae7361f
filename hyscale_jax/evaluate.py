"""`python -m hyscale_jax.evaluate --workdir W`: a train.py run's validation loss, perplexity, and loss by position.

Reads the run's config (`<W>/config.json`) and a checkpoint (the newest, or `--step N`), runs the model
over `--batches` batches of the run's validation split (its `data.batch_size` rows of `data.seq_len`
tokens each; by default the whole split once), and prints the mean next-token loss, its perplexity
exp(loss), and the mean loss of the tokens at each range of positions within their document
(`position_buckets`: [0, 16), [16, 64), [64, 256), ... up to seq_len). Long-context training should
show the later buckets' loss falling below the earlier ones'. The numbers also go to a JSON file
(`--out`, default `<W>/eval_step<N>.json`).

Attention is sparse (selection + sparse attention, as trained after the warm-up) unless `--dense`.
Batch b is the one training would read at validation step b, so with `--batches 1` the loss is the
`val_lm_loss` train.py logged at that step (up to float rounding).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyscale_jax import cli, workdir_tools
from hyscale_jax.layers.lm_head import chunk_layout
from hyscale_jax.models.generate import frozen_backends, thawed_backends
from hyscale_jax.training import lm, text_data

FIRST_BUCKET_END = 16  # the first position bucket is [0, 16)
BUCKET_GROWTH = 4  # each later bucket ends 4x further


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
  """[(start, end)] ranges of positions covering [0, seq_len): [0, 16), [16, 64), [64, 256), ...,
  each end 4x the last, the final one cut at seq_len."""
  buckets, start, end = [], 0, FIRST_BUCKET_END
  while start < seq_len:
    buckets.append((start, min(end, seq_len)))
    start, end = end, end * BUCKET_GROWTH
  return buckets


def evaluate_model(model: nnx.Module, dataset: text_data.PackedRows, *, batches: int | None = None,
                   backends=None, dense: bool = False) -> dict:
  """The mean next-token loss of `model` over `batches` batches of `dataset`, overall and by position.

  Args:
    model: a decoder from `models.build` or `lm.restore_model`.
    dataset: packed rows (`file_data.open_dataset`); batch b is `dataset.batch(b)`.
    batches: how many batches (None: the split once, `num_rows // batch_size`, at least 1). More
      than that reads rows of the next epochs again.
    backends: per-op backend names (`config.ops`); None means "auto".
    dense: dense attention (the warm-up's) instead of selection + sparse attention.

  Returns:
    {"batches", "batch_size", "seq_len", "attention" ("sparse" or "dense"), "tokens" (scored),
    "loss", "perplexity", "buckets": [{"positions": [start, end], "tokens", "loss", "perplexity"}]}.
    Loss is the mean over the scored tokens (`loss_mask`) in nats; a bucket without tokens has loss
    and perplexity None. A token's position is its input's position in its document (`positions`).

  Raises:
    ValueError: `batches` < 1.
  """
  if batches is None:
    batches = max(1, dataset.num_rows // dataset.batch_size)
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise ValueError(f"batches={batches!r} must be an int >= 1.")
  buckets = position_buckets(dataset.seq_len)
  edges = np.array([end for _, end in buckets])
  sums, counts = np.zeros(len(buckets)), np.zeros(len(buckets))
  graphdef, state = nnx.split(model)
  for b in range(batches):
    batch = dataset.batch(b)
    nll = np.asarray(_token_losses(graphdef, frozen_backends(backends), dense, state,
                                   {k: batch[k] for k in ("tokens", "targets", "positions", "segment_ids")}),
                     np.float64)
    scored = batch["loss_mask"] > 0
    bucket = np.searchsorted(edges, batch["positions"][scored], side="right")  # [scored] bucket of each token
    sums += np.bincount(bucket, weights=nll[scored], minlength=len(buckets))
    counts += np.bincount(bucket, minlength=len(buckets))
  loss = float(sums.sum() / max(counts.sum(), 1))
  rows = [{"positions": [start, end], "tokens": int(n), "loss": float(s / n) if n else None,
           "perplexity": _perplexity(s / n) if n else None}
          for (start, end), s, n in zip(buckets, sums, counts)]
  return {"batches": batches, "batch_size": dataset.batch_size, "seq_len": dataset.seq_len,
          "attention": "dense" if dense else "sparse", "tokens": int(counts.sum()), "loss": loss,
          "perplexity": _perplexity(loss), "buckets": rows}


def evaluate_workdir(workdir: str, *, step: int | None = None, batches: int | None = None, dense: bool = False,
                     on_loaded: Callable[[str], None] | None = None) -> dict:
  """`evaluate_model` of a train.py workdir's checkpoint on the run's validation split.

  Args:
    workdir: the run's workdir (config.json and checkpoints/).
    step: the checkpoint (None: the newest that reads).
    batches, dense: as in `evaluate_model`.
    on_loaded: called with one line naming what was loaded, before the evaluation runs.

  Returns:
    `evaluate_model`'s dict, after "workdir", "architecture" and "step".

  Raises:
    FileNotFoundError: no workdir, config.json or checkpoint (of `step`).
    ValueError: a config or data the run cannot open, or `batches` < 1.
    CheckpointError: the checkpoint does not read with the run's config.
  """
  config = workdir_tools.load_config(workdir)
  workdir_tools.check_step(workdir, step)
  dataset = workdir_tools.open_validation(config)
  model, step = lm.restore_model(config, workdir, step=step)
  if on_loaded is not None:
    on_loaded(workdir_tools.describe(config, workdir, step))
  result = evaluate_model(model, dataset, batches=batches, backends=config.ops, dense=dense)
  return {"workdir": os.path.abspath(workdir), "architecture": config.model.architecture, "step": step, **result}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _token_losses(graphdef, backends, dense, state, batch):
  """f32[B, T] next-token cross-entropy of every position of `batch` (tokens, targets, positions,
  segment_ids; i32[B, T] each), the LM head run over `lm_loss_chunk` positions at a time (no [B, T, V])."""
  model = nnx.merge(graphdef, state)
  h, _ = model.hidden_states(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                             dense=dense, backends=thawed_backends(backends))  # [B, T, D]
  B, T, _ = h.shape
  n, rows = chunk_layout(T, model.cfg.lm_loss_chunk)
  pad = lambda a: jnp.pad(a, [(0, 0), (0, n * rows - T)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
  split = lambda a: jnp.moveaxis(pad(a).reshape(B, n, rows, *a.shape[2:]), 1, 0)  # [n, B, rows, ...]  # noqa: E731
  nll = jax.lax.map(lambda xs: optax.softmax_cross_entropy_with_integer_labels(model.logits(xs[0]), xs[1]),
                    (split(h), split(batch["targets"])))  # [n, B, rows]
  return jnp.moveaxis(nll, 0, 1).reshape(B, n * rows)[:, :T]


def _perplexity(loss: float) -> float:
  return math.exp(loss) if loss < 700 else math.inf  # exp overflows a double past ~709


def format_table(result: dict) -> str:
  """The result as plain text: the overall line, then one line per position bucket."""
  lines = [f"validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} ({result['attention']} "
           f"attention; {result['tokens']} tokens scored in {result['batches']} batches of {result['batch_size']} x "
           f"{result['seq_len']})",
           f"{'positions':<16}{'tokens':>10}{'loss':>10}{'perplexity':>14}"]
  for row in result["buckets"]:
    start, end = row["positions"]
    loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
    perplexity = "-" if row["perplexity"] is None else f"{row['perplexity']:.2f}"
    lines.append(f"{f'[{_size(start)}, {_size(end)})':<16}{row['tokens']:>10}{loss:>10}{perplexity:>14}")
  return "\n".join(lines)


def _size(n: int) -> str:
  """4096 -> '4K' (a multiple of 1024), else the number."""
  return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def _parser() -> workdir_tools.ArgumentParser:
  parser = workdir_tools.ArgumentParser(
      prog="python -m hyscale_jax.evaluate",
      description="Validation loss, perplexity and loss by position of a train.py run's checkpoint.")
  workdir_tools.add_workdir_flags(parser)
  parser.add_argument("--batches", type=int, default=None,
                      help="validation batches of the run's data.batch_size x data.seq_len tokens (default: the "
                      "whole validation split once)")
  parser.add_argument("--dense", action="store_true",
                      help="dense attention (the warm-up stage's) instead of selection + sparse attention")
  parser.add_argument("--out", default=None,
                      help="the JSON file to write (default: <workdir>/eval_step<N>.json, or eval_step<N>_dense.json "
                      "with --dense)")
  parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
  return parser


def _main(args) -> None:
  if args.batches is not None and args.batches < 1:
    raise ValueError(f"--batches={args.batches} must be >= 1.")
  if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
    raise FileNotFoundError(f"--out={args.out}: its folder does not exist.")
  result = evaluate_workdir(args.workdir, step=args.step, batches=args.batches, dense=args.dense,
                            on_loaded=lambda line: print(line, flush=True))
  print(format_table(result))
  out = args.out or os.path.join(args.workdir, f"eval_step{result['step']}{'_dense' if args.dense else ''}.json")
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  sys.exit(cli.run(lambda: _main(args), traceback=args.traceback))


if __name__ == "__main__":
  main()
