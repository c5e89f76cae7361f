"""CLI: `python -m hyscale_jax.convert import HF_DIR OUT_DIR` and `... export OUT_DIR HF_DIR`.

`import` reads a Hugging Face checkpoint folder (config.json, sharded safetensors, index) tensor by
tensor and writes our folder (model_config.json + orbax params), then prints the `--config.model.*`
settings that `train.py --config.init_from=OUT_DIR` needs. `export` writes a Hugging Face folder back.

A config.json we cannot import (unsupported fields, all named at once, before any tensor is read), a
checkpoint that does not match its config, or a missing folder is one line on stderr,
`error: <model_type>: <field>=<value> ...`, and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from hyscale_jax.convert import api, native
from hyscale_jax.convert.hf_config import UnsupportedConfigError

# What a user's input can be wrong about; anything else is a bug and keeps its traceback.
_USER_ERRORS = (UnsupportedConfigError, api.CheckpointMismatchError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
  try:
    return _main(argv)
  except _USER_ERRORS as error:
    print(f"error: {error}", file=sys.stderr)
    return 2


def _main(argv: list[str] | None) -> int:
  parser = argparse.ArgumentParser(prog="python -m hyscale_jax.convert", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  imp = commands.add_parser("import", help="Hugging Face folder -> our folder")
  imp.add_argument("hf_dir")
  imp.add_argument("out_dir")
  imp.add_argument("--param_dtype", choices=("float32", "bfloat16"), default=None,
                   help="storage dtype of our params (default: the checkpoint's)")
  exp = commands.add_parser("export", help="our folder (or a Hugging Face one) -> Hugging Face folder")
  exp.add_argument("in_dir")
  exp.add_argument("hf_dir")
  exp.add_argument("--max_shard_bytes", type=int, default=2 << 30)
  args = parser.parse_args(argv)

  if args.command == "import":
    overrides = {} if args.param_dtype is None else {"param_dtype": args.param_dtype}
    model = api.import_checkpoint(args.hf_dir, **overrides)
    native.save_native(model, args.out_dir)
    print(f"imported {model.cfg.architecture} from {args.hf_dir} into {args.out_dir}")
    print("train with --config.init_from=" + args.out_dir + " and these model settings:")
    for key, value in api.model_config_dict(model.cfg).items():
      print(f"  --config.model.{key}={value!r}".replace("'", '"') if isinstance(value, (str, list))
            else f"  --config.model.{key}={value}")
  else:
    load = native.load_native if native.is_native(args.in_dir) else api.import_checkpoint
    model = load(args.in_dir)
    count = api.export_checkpoint(model, args.hf_dir, max_shard_bytes=args.max_shard_bytes)
    print(f"exported {model.cfg.architecture} ({count} tensors) from {args.in_dir} to {args.hf_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
