"""Metrics: one JSON line per logged step in `<workdir>/metrics.jsonl`, mirrored to the log.

With several processes only process 0 writes and prints (every process computes the same global scalars).
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
from tqdm import tqdm


class MetricWriter:
  """Appends `{"step": ..., **scalars}` lines to a JSONL file (resumed runs keep appending)."""

  def __init__(self, workdir: str, filename: str = "metrics.jsonl"):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)

  def write(self, step: int, scalars: dict) -> dict:
    row = {"step": int(step), **{k: float(np.asarray(v)) for k, v in scalars.items()}}
    if jax.process_index() != 0:
      return row
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    logging.info("step %d: %s", step, " ".join(f"{k}={v:.5g}" for k, v in row.items() if k != "step"))
    tqdm.write(summary_line(row))  # prints above an active progress bar without breaking it
    return row

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]


def summary_line(row: dict) -> str:
  """The console's line for a metrics row: the losses and the speed (metrics.jsonl keeps every field); a
  row without a `loss` (another task's) lists its fields."""
  if "loss" not in row:
    return f"step {row['step']}: " + " ".join(f"{k}={v:.5g}" for k, v in row.items() if k != "step")
  parts = [f"step {row['step']}: loss {row['loss']:.4f}"]
  if "lm_loss" in row and "indexer_loss" in row:
    parts[0] += f" (lm {row['lm_loss']:.4f}, indexer KL {row['indexer_loss']:.4f})"
  if "val_lm_loss" in row:
    parts.append(f"validation {row['val_lm_loss']:.4f}")
  if "step_time_s" in row:
    speed = f"{row['step_time_s']:.3g} s/step"
    if "tokens_per_sec" in row:
      speed += f", {row['tokens_per_sec']:,.0f} tokens/s"
    if "mfu" in row:
      speed += f", MFU {100 * row['mfu']:.1f}%"
    parts.append(speed)
  if row.get("skipped_steps"):
    parts.append(f"{int(row['skipped_steps'])} skipped")
  return "; ".join(parts)
