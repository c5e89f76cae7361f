"""Atomic, resumable checkpoints with orbax: a step is visible only once it is completely written.

A run killed mid-save leaves only orbax's temporary folder, which is never taken for a checkpoint.
A complete-looking checkpoint that cannot be read (truncated or corrupted files) is moved aside,
never deleted, and the run resumes from the newest one that reads.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


# The checkpoints' folder inside a train.py workdir.
CHECKPOINTS = "checkpoints"


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, or no checkpoint could be read."""


class Checkpointer:
  """Saves (state, metadata) every `every_steps` under `directory` and restores the newest readable one.

  `every_steps=0` saves nothing, not even at the end (benchmarks, throwaway runs).
  """

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.every_steps = every_steps
    self._max_to_keep = max_to_keep
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=self._max_to_keep, create=True,
                                             enable_async_checkpointing=False))

  def maybe_save(self, step: int, state: Any, metadata: dict, *, force: bool = False) -> bool:
    """Saves when `step` is on the interval (or `force`); returns whether it saved (never if every_steps is 0).

    Raises:
      CheckpointError: the save failed (disk full, unwritable directory, ...); the previous
        checkpoint is untouched.
    """
    if not self.every_steps or not (force or step % self.every_steps == 0) or step == self._manager.latest_step():
      return False
    try:
      self._manager.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(metadata)),
          force=True,
      )
      self._manager.wait_until_finished()
    except Exception as e:  # orbax and tensorstore raise many types for I/O failures
      raise CheckpointError(
          f"saving the checkpoint of step {step} under {self.directory} failed: {e!r}. The previous "
          f"checkpoint (step {self._manager.latest_step()}) is intact; rerun to resume from it.") from e
    logging.info("saved checkpoint at step %d in %s", step, self.directory)
    return True

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first (a save killed midway is not one)."""
    return sorted(self._manager.all_steps())

  def restore_step(self, abstract_state: Any, step: int) -> tuple[int, Any, dict]:
    """(step, state, metadata) of the checkpoint of `step`.

    Raises:
      FileNotFoundError: there is no complete checkpoint of `step` (the message lists those there are).
      CheckpointError: it does not read (for example with another model's config).
    """
    steps = self.all_steps()
    if step not in steps:
      raise FileNotFoundError(f"{self.directory} has no checkpoint of step {step}; its checkpoints are of steps "
                              f"{steps}.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as e:  # a truncated or corrupted file surfaces as many exception types
      raise CheckpointError(f"checkpoint step {step} in {self.directory} does not read: {e}") from e
    return step, restored["state"], dict(restored["meta"])

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """(step, state, metadata) of the newest checkpoint that reads, or None when there is none.

    Newer checkpoints that fail to read are moved aside to `<step>.unreadable-<time>` (nothing is
    deleted) once an older one has read, with a message naming them.

    Raises:
      CheckpointError: checkpoints exist but none reads (for example after a model change).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    failures = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
      except Exception as e:  # a truncated or corrupted file surfaces as many exception types
        failures.append((step, e))
        continue
      if failures:
        # Process 0 alone renames (every process saw the same failures on the shared directory); the
        # others wait for it here. A process that dies meanwhile stops the rest through the
        # coordination service's heartbeat ($HYSCALE_HEARTBEAT_TIMEOUT_S), so nobody waits forever.
        if jax.process_index() == 0:
          for bad_step, error in failures:
            self._move_aside(bad_step, error, fallback=step)
        _sync_processes(f"hyscale_checkpoint_moved_aside_{step}")
        self._manager = self._open()
      _check_same_step(step, self.directory)
      logging.info("restored checkpoint at step %d from %s", step, self.directory)
      return step, restored["state"], dict(restored["meta"])
    if failures:
      step, error = failures[0]
      raise CheckpointError(
          f"no checkpoint under {self.directory} could be read; the newest (step {step}) failed with "
          f"{error!r}. If the model or optimizer config changed, use a new workdir.") from error
    return None

  def _move_aside(self, step: int, error: Exception, *, fallback: int) -> None:
    source = os.path.join(self.directory, str(step))
    target = f"{source}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(source, target)
    message = (f"checkpoint step {step} is unreadable ({type(error).__name__}: {str(error)[:200]}); "
               f"moved it to {target} and resuming from step {fallback}.")
    logging.warning(message)
    print(f"WARNING: {message}", file=sys.stderr)

  def close(self):
    self._manager.close()


def saved_steps(directory: str) -> list[int]:
  """`Checkpointer.all_steps` of `directory`, [] (and nothing created) when there is no such folder."""
  if not os.path.isdir(directory):
    return []
  checkpointer = Checkpointer(directory, every_steps=0)
  try:
    return checkpointer.all_steps()
  finally:
    checkpointer.close()


def _sync_processes(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415 (only multi-process runs need it)

    multihost_utils.sync_global_devices(name)


def _check_same_step(step: int, directory: str) -> None:
  """Stops every process when they restored different steps (storage that some processes read
  differently); they would otherwise train on from different states."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415

  steps = multihost_utils.process_allgather(np.asarray(step, dtype=np.int64)).reshape(-1)
  if np.any(steps != step):
    raise CheckpointError(f"processes restored different checkpoint steps {steps.tolist()} (by process) from "
                          f"{directory}: is it one shared directory that every process reads alike?")
