"""bench/timing.py: each timed call's device span from a profiler trace's kernel intervals."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import timing  # noqa: E402


def test_split_spans_groups_kernels_by_idle_gaps():
  # Three calls 1 ms apart; the second call's kernels overlap (two streams) and arrive unsorted.
  intervals = [(2_000_000, 2_000_400), (10, 50), (0, 30), (2_000_100, 2_000_900), (4_000_000, 4_000_001),
               (60, 100)]
  assert timing.split_spans(intervals, gap_ns=500_000) == [100, 900, 1]
  assert timing.split_spans(intervals, gap_ns=5_000_000) == [4_000_001]
  assert timing.split_spans([], gap_ns=1) == []


def test_timed_on_the_cpu_is_the_wall_clock():
  f = jax.jit(lambda x: jnp.sin(x).sum())
  x = jnp.arange(4096, dtype=jnp.float32)
  assert timing.device_spans(lambda: jax.block_until_ready(f(x)), 2) is None  # no device plane here
  assert 0 < timing.timed(f, x, reps=3) < 5
