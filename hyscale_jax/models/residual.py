"""The residual around a decoder block: a plain `x + block(norm(x))`, or a hyper-connection's streams.

`DecoderLayer` and its chunked form (`layer_chunks`) both run a block as `enter` -> `prenorm` -> block ->
`leave`; the steps live here so that both import them.
"""

from __future__ import annotations


def enter(connection, x):
  """(block input, mix) of the residual `x`: x itself for a plain residual (`connection` None), else the
  hyper-connection's collapse of the streams [B, T, N, D] into [B, T, D] and its mix for `leave`."""
  return (x, None) if connection is None else connection.enter(x)


def prenorm(norm, h):
  """The block's RMSNorm of h, or h itself where a hyper-connection replaced the pre-norm (`norm` None)."""
  return h if norm is None else norm(h)


def leave(connection, x, block_output, mix):
  """The residual after a block: x + output, or the connection's stream update."""
  return x + block_output if connection is None else connection.leave(x, block_output, mix)
