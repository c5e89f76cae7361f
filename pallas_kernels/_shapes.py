"""Block shapes for the Triton-lowered kernels, whose loaded blocks must have power-of-two sizes."""

from __future__ import annotations


def next_power_of_two(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(n - 1, 0).bit_length()


def power_of_two_parts(n: int) -> tuple[int, ...]:
  """n as a sum of descending powers of two (its binary digits): 576 -> (512, 64), 192 -> (128, 64).

  A head dim that is no power of two is loaded as these column slices, each its own dot, summed."""
  return tuple(1 << b for b in reversed(range(n.bit_length())) if n >> b & 1)
