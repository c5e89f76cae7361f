"""What train.py and the workdir tools tell the user: plain lines on stderr at the default verbosity.

Logging (absl, orbax) stays at WARNING by default and carries the details; these lines are the few a
user reads: the start banner, stage changes, long set-up work, the final summary. They go to stderr,
beside the progress bar, so that a command's output (generated text, a results table) stays alone
on stdout. Only process 0 prints (every process would say the same). `tqdm.write` keeps an active
progress bar intact.
"""

from __future__ import annotations

import sys

import jax
from tqdm import tqdm


def say(message: str) -> None:
  """Prints `message` as one or more plain lines (process 0 only)."""
  if jax.process_index() == 0:
    tqdm.write(message, file=sys.stderr)


def table(rows: list[tuple[str, str]]) -> str:
  """'name   value' lines with the values aligned: the banner's layout."""
  width = max(len(name) for name, _ in rows)
  return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def duration(seconds: float) -> str:
  """'42 s', '3 min 12 s' or '2 h 05 min'."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds} s"
  if seconds < 3600:
    return f"{seconds // 60} min {seconds % 60:02d} s"
  return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
