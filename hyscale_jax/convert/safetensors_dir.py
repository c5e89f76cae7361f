"""A Hugging Face checkpoint folder: sharded safetensors plus `model.safetensors.index.json`, read lazily.

Reading opens a shard only for the tensor asked for and returns just that tensor, so a caller that
converts and places one tensor at a time never holds more than one (plus its sources) in host memory.
Writing does the same in reverse: tensors are appended to the current shard's buffer and the shard is
flushed once it passes `max_shard_bytes`.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointReader:
  """Names and lazy tensor reads of a checkpoint folder (an index over shards, or one `model.safetensors`)."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        self.weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
    elif os.path.exists(os.path.join(directory, SINGLE)):
      with safe_open(os.path.join(directory, SINGLE), "np") as f:
        self.weight_map = {name: SINGLE for name in f.keys()}
    else:
      raise FileNotFoundError(f"{directory!r} has neither {INDEX} nor {SINGLE}: not a Hugging Face checkpoint.")
    missing = sorted({shard for shard in self.weight_map.values()
                      if not os.path.exists(os.path.join(directory, shard))})
    if missing:
      raise FileNotFoundError(f"{directory!r}: the index names shards that are not there: {missing}.")

  def names(self) -> set[str]:
    return set(self.weight_map)

  def shape(self, name: str) -> tuple[int, ...]:
    with safe_open(os.path.join(self.directory, self.weight_map[name]), "np") as f:
      return tuple(f.get_slice(name).get_shape())

  def read(self, name: str) -> np.ndarray:
    """The tensor `name` as a numpy array (only this tensor is read from its shard)."""
    with safe_open(os.path.join(self.directory, self.weight_map[name]), "np") as f:
      return f.get_tensor(name)


class CheckpointWriter:
  """Writes tensors into shards of about `max_shard_bytes`, then the index (on `close`)."""

  def __init__(self, directory: str, *, max_shard_bytes: int = 2 << 30):
    if max_shard_bytes < 1:
      raise ValueError(f"{max_shard_bytes=} must be positive.")
    os.makedirs(directory, exist_ok=True)
    self.directory, self.max_shard_bytes = directory, max_shard_bytes
    self._pending: dict[str, np.ndarray] = {}
    self._pending_bytes = 0
    self._shards: list[dict[str, np.ndarray] | list[str]] = []
    self.weight_map: dict[str, str] = {}
    self.total_bytes = 0

  def add(self, name: str, array: np.ndarray) -> None:
    if name in self.weight_map or name in self._pending:
      raise ValueError(f"tensor {name!r} written twice.")
    if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    self._pending[name] = np.ascontiguousarray(array)
    self._pending_bytes += array.nbytes
    self.total_bytes += array.nbytes

  def _flush(self) -> None:
    shard = f"model-{len(self._shards) + 1:05d}.safetensors"  # renamed to -of-N on close
    save_file(self._pending, os.path.join(self.directory, shard), metadata={"format": "pt"})
    self._shards.append(list(self._pending))
    self._pending, self._pending_bytes = {}, 0

  def close(self) -> None:
    """Flushes the last shard, names shards `model-0000i-of-0000n.safetensors`, writes the index."""
    if self._pending or not self._shards:
      self._flush()
    n = len(self._shards)
    for i, names in enumerate(self._shards, start=1):
      final = f"model-{i:05d}-of-{n:05d}.safetensors"
      os.replace(os.path.join(self.directory, f"model-{i:05d}.safetensors"), os.path.join(self.directory, final))
      self.weight_map.update({name: final for name in names})
    with open(os.path.join(self.directory, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))},
                f, indent=2)
