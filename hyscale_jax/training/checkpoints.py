"""Atomic, resumable checkpoints with orbax: a step is visible only once it is completely written."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves (state, metadata) every `every_steps` under `directory` and restores the latest one.

  orbax writes each step into a temporary folder and renames it when complete, so a run killed
  mid-save leaves the previous checkpoint as the latest; `restore_latest` resumes from it.
  """

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.every_steps = every_steps
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False,
        ),
    )

  def maybe_save(self, step: int, state: Any, metadata: dict, *, force: bool = False) -> bool:
    """Saves when `step` is on the interval (or `force`); returns whether it saved."""
    if not (force or step % self.every_steps == 0) or step == self._manager.latest_step():
      return False
    self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(metadata)),
        force=True,
    )
    self._manager.wait_until_finished()
    logging.info("saved checkpoint at step %d in %s", step, self.directory)
    return True

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """(step, state, metadata) of the latest complete checkpoint, or None when there is none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
    )
    logging.info("restored checkpoint at step %d from %s", step, self.directory)
    return step, restored["state"], dict(restored["meta"])

  def close(self):
    self._manager.close()
