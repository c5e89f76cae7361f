"""CLI: `python -m hyscale_jax.convert import HF_DIR OUT_DIR` and `... export IN_DIR HF_DIR`.

`import` reads a Hugging Face checkpoint folder (config.json, sharded safetensors, index) tensor by
tensor and writes our folder: model_config.json, the orbax params, the checkpoint's tokenizer files
and `config.py`, a train.py config that fine-tunes them (convert/train_config.py); it prints one line
with the train command. `export` writes a Hugging Face folder (with the tokenizer) from our folder, a
Hugging Face one, or a train.py workdir (its newest checkpoint, or `--step N`).

A config.json we cannot import (unsupported fields, all named at once, before any tensor is read), a
checkpoint that does not match its config, or a missing folder, checkpoint or step is one line on
stderr, `error: ...`, and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hyscale_jax import cli
from hyscale_jax.convert import api, native, train_config
from hyscale_jax.convert.hf_config import UnsupportedConfigError


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  traceback = "--traceback" in argv
  return cli.run(lambda: _main([a for a in argv if a != "--traceback"]), traceback=traceback,
                 user_errors=(UnsupportedConfigError, api.CheckpointMismatchError))


def _main(argv: list[str] | None) -> int:
  parser = argparse.ArgumentParser(prog="python -m hyscale_jax.convert", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  imp = commands.add_parser("import", help="Hugging Face folder -> our folder, with a train.py config")
  imp.add_argument("hf_dir")
  imp.add_argument("out_dir")
  imp.add_argument("--param_dtype", choices=("float32", "bfloat16"), default=None,
                   help="storage dtype of our params (default: the checkpoint's)")
  exp = commands.add_parser("export", help="our folder, a Hugging Face one or a train.py workdir -> "
                            "Hugging Face folder")
  exp.add_argument("in_dir")
  exp.add_argument("hf_dir")
  exp.add_argument("--step", type=int, default=None, help="a workdir's checkpoint to export (default: the newest)")
  exp.add_argument("--max_shard_bytes", type=int, default=2 << 30)
  args = parser.parse_args(argv)
  return _import(args) if args.command == "import" else _export(args)


def _import(args) -> int:
  overrides = {} if args.param_dtype is None else {"param_dtype": args.param_dtype}
  model = api.import_checkpoint(args.hf_dir, **overrides)
  native.save_native(model, args.out_dir)
  with_tokenizer = "tokenizer.json" in api.copy_tokenizer(args.hf_dir, args.out_dir)
  config = train_config.write(model.cfg, args.out_dir, source=args.hf_dir, with_tokenizer=with_tokenizer)
  out = os.path.abspath(args.out_dir)
  print(f"imported {model.cfg.architecture} into {out} (weights, {os.path.basename(config)}"
        f"{', tokenizer' if with_tokenizer else ''}); fine-tune with: "
        + train_config.train_command(out, with_tokenizer=with_tokenizer))
  return 0


def _export(args) -> int:
  if native.is_native(args.in_dir) or _is_hugging_face(args.in_dir):
    if args.step is not None:
      raise FileNotFoundError(f"--step={args.step}: {args.in_dir!r} is a checkpoint folder, not a train.py workdir.")
    load = native.load_native if native.is_native(args.in_dir) else api.import_checkpoint
    model = load(args.in_dir)
    count = api.export_checkpoint(model, args.hf_dir, max_shard_bytes=args.max_shard_bytes)
    tokenizer = api.copy_tokenizer(args.in_dir, args.hf_dir)
    print(f"exported {model.cfg.architecture} ({count} tensors{', tokenizer' if tokenizer else ''}) "
          f"from {args.in_dir} to {args.hf_dir}")
    return 0
  # A workdir needs the trainer, which itself imports this package: imported here only.
  from hyscale_jax import workdir_export  # noqa: PLC0415

  if not workdir_export.is_workdir(args.in_dir):
    raise FileNotFoundError(
        f"{args.in_dir!r} is neither a train.py workdir (checkpoints/, config.json), our checkpoint folder "
        f"({native.CONFIG_FILE}) nor a Hugging Face one (config.json with a model_type).")
  exported = workdir_export.export_workdir(args.in_dir, args.hf_dir, step=args.step,
                                           max_shard_bytes=args.max_shard_bytes)
  print(f"exported {exported.architecture} step {exported.step} ({exported.tensors} tensors"
        f"{', tokenizer' if exported.tokenizer else ''}) from {args.in_dir} to {args.hf_dir}")
  return 0


def _is_hugging_face(directory: str) -> bool:
  """Whether `directory` holds a transformers config.json (a train.py workdir's config.json has no model_type)."""
  try:
    with open(os.path.join(directory, "config.json")) as f:
      return "model_type" in json.load(f)
  except (OSError, ValueError):
    return False


if __name__ == "__main__":
  sys.exit(main())
