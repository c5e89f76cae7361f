"""Real text with no download: byte-level windows over CPython's bundled documentation."""

from __future__ import annotations

import numpy as np

from hyscale_jax.training.text_data import pydoc_documents

BYTE_VOCAB = 256


def bundled_text() -> bytes:
  """About 0.5 MB of English technical prose shipped with CPython (`pydoc_data.topics`)."""
  return "\n\n".join(pydoc_documents()).encode("utf-8")


class ByteWindows:
  """Deterministic batches of byte windows: batch `i` depends only on (seed, i), so runs resume exactly."""

  def __init__(self, text: bytes, *, seq_len: int, batch_size: int, seed: int):
    if len(text) <= seq_len:
      raise ValueError(f"text of {len(text)} bytes is too short for {seq_len=}.")
    self.tokens = np.frombuffer(text, dtype=np.uint8)
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

  def batch(self, index: int) -> np.ndarray:
    """i32[batch_size, seq_len] token ids."""
    rng = np.random.default_rng((self.seed, index))
    starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
    return np.stack([self.tokens[s : s + self.seq_len] for s in starts]).astype(np.int32)
