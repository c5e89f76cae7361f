"""Entry point: `python train.py --config=configs/<name>.py[:variant] --workdir=DIR [--config.x=y]`."""

import importlib

from absl import app, flags, logging
from ml_collections import config_flags

from hyscale_jax import parallel

_CONFIG = config_flags.DEFINE_config_file("config", "configs/glm5_1.py:tiny", "Experiment config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/glm5_1_tiny", "Checkpoints and metrics go here.")

_TASKS = {
    "lm": "hyscale_jax.training.lm",
    "selection_demo": "hyscale_jax.training.selection_demo",
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO; -v 0 shows it
  parallel.maybe_initialize_distributed()  # one process of many: join them before any JAX work
  config = _CONFIG.value
  parallel.check_same_config(config)  # another seed, mesh or model on one process stops them all
  if config.task not in _TASKS:
    raise app.UsageError(f"config.task={config.task!r} is not one of {sorted(_TASKS)}")
  logging.info("task %s, workdir %s\n%s", config.task, _WORKDIR.value, config)
  importlib.import_module(_TASKS[config.task]).train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
