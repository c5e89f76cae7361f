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
    line = f"step {step}: " + " ".join(f"{k}={v:.5g}" for k, v in row.items() if k != "step")
    logging.info(line)
    tqdm.write(line)  # prints above an active progress bar without breaking it
    return row

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]
