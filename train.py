"""Entry point: `python train.py --config=configs/<name>.py[:variant] --workdir=DIR [--config.x=y]`."""

import importlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from hyscale_jax import cli, parallel

_DEFAULT_CONFIG = "configs/glm5_1.py:tiny"
if __name__ == "__main__":
  # config_flags reads the overrides from sys.argv when the flag is defined, so a mistyped key fails here.
  cli.check_config_overrides(sys.argv, _DEFAULT_CONFIG)
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Experiment config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/glm5_1_tiny", "Checkpoints and metrics go here.")
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show the full traceback of an error (a user's mistake is "
                               "otherwise one line, exit status 2).")

_TASKS = {
    "lm": "hyscale_jax.training.lm",
    "selection_demo": "hyscale_jax.training.selection_demo",
}


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or value as one line and exit status 2."""
  try:
    return flags.FLAGS(argv)
  except Exception as error:  # noqa: BLE001 - config_flags raises many types for a bad command line
    if "--traceback" in argv:
      raise
    cli.fail(str(error).strip().splitlines()[0])
  return argv


def main(argv):
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}: flags take the form --name=value (see --help)")
  sys.exit(cli.run(lambda: _train(), traceback=_TRACEBACK.value))


def _train():
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO; -v 0 shows it
  parallel.maybe_initialize_distributed()  # one process of many: join them before any JAX work
  config = _CONFIG.value
  parallel.check_same_config(config)  # another seed, mesh or model on one process stops them all
  if config.task not in _TASKS:
    raise ValueError(f"config.task={config.task!r} is not one of {sorted(_TASKS)}.")
  logging.info("task %s, workdir %s\n%s", config.task, _WORKDIR.value, config)
  importlib.import_module(_TASKS[config.task]).train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
