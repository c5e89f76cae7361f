"""What the commands share (train.py, `python -m hyscale_jax.evaluate`, `.generate`, `.convert`): a user's
mistake is one line on stderr and exit status 2; a traceback only for an internal error, or with
`--traceback`.

A user's mistake: a config key or value (named with its full key, such as `data.seq_len`), a data file
and line, a checkpoint or workdir, a command-line flag, a model that does not fit the device.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator

import ml_collections

from hyscale_jax.training.checkpoints import CheckpointError

# Exceptions that carry a message meant for the user. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, MemoryError,
    CheckpointError, FloatingPointError)
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def say_error(message: str) -> None:
  """Prints `error: message` on stderr."""
  print(f"error: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
  """Prints `error: message` on stderr and exits with status 2."""
  say_error(message)
  sys.exit(EXIT_USER_ERROR)


def run(main: Callable[[], int | None], *, traceback: bool = False,
        user_errors: tuple[type[BaseException], ...] = ()) -> int:
  """`main()`'s exit status. A user's mistake (`USER_ERRORS`, `user_errors`, or the device running out of
  memory) becomes one line and status 2, Ctrl-C status 130, both without a traceback unless `traceback`."""
  try:
    return main() or 0
  except KeyboardInterrupt:
    if traceback:
      raise
    say_error("interrupted")
    return EXIT_INTERRUPTED
  except (*USER_ERRORS, *user_errors) as error:
    if traceback:
      raise
    say_error(_message(error))
  except Exception as error:  # noqa: BLE001 - only the device's out-of-memory error is the user's
    if traceback or "RESOURCE_EXHAUSTED" not in str(error):
      raise
    say_error("the device ran out of memory: " + str(error).splitlines()[0][:500] + " (lower data.seq_len or "
              "data.batch_size, set model.remat_policy=full, or split the sequence over more devices with "
              "mesh.context)")
  return EXIT_USER_ERROR


def _message(error: BaseException) -> str:
  return str(error).strip() or type(error).__name__


def config_keys(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[str]:
  """Every leaf key of `config`, dotted ("train.steps")."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from config_keys(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """The config of `path[:variant]`, as `config_flags.DEFINE_config_file` loads it (`get_config(variant)`).

  Raises:
    FileNotFoundError: no such file.
    ValueError: the file has no `get_config`, or it rejects the variant.
  """
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config={spec}: {path!r} does not exist (configs/ holds glm5_1.py, "
                            "deepseek_v4_flash.py, qwen3_8_flash_next.py).")
  module_spec = importlib.util.spec_from_file_location("_hyscale_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"--config={spec}: {path} defines no get_config().")
  return module.get_config(variant) if variant else module.get_config()


def check_config_overrides(argv: list[str], default_config: str, flag: str = "config") -> None:
  """Fails (status 2) on a `--<flag>.<key>=...` whose key the config file does not have, with the
  closest key: `unknown config key train.stepz; did you mean train.steps?`. Values are absl's to parse."""
  spec, overrides = default_config, []
  args = iter(argv[1:])
  for arg in args:
    if arg == "--":
      break
    name, eq, value = arg.partition("=")
    if name == f"--{flag}":
      spec = value if eq else next(args, "")
    elif name.startswith(f"--{flag}."):
      overrides.append(name[len(flag) + 3:])
  if not overrides:
    path = spec.partition(":")[0]
    if not os.path.isfile(path):
      fail(f"--{flag}={spec}: {path!r} does not exist.")
    return
  try:
    config = load_config_file(spec)
  except USER_ERRORS as error:
    fail(_message(error))
  keys = list(config_keys(config))
  groups = {key.rsplit(".", 1)[0] for key in keys if "." in key}
  for key in overrides:
    if key in keys or key in groups:
      continue
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    fail(f"unknown config key {key}" + (f"; did you mean {close[0]}?" if close else
                                        f" (--{flag}={spec} has no such field)"))
