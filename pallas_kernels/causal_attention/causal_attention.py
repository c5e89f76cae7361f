"""JAX's shipped Triton flash-attention kernel (`jax.experimental.pallas.ops.gpu.attention`) fitted to
`ops.causal_attention`: head dims, lengths and GQA heads padded or repeated to what it tiles.

The kernel takes one segment-id array for queries and keys, causal masks aligned at position 0,
and one head dim for q, k and v. So this backend:
- declines (NotImplementedError) different query and key segment ids, a query offset (context
  parallelism), key length != query length, compressed keys (compress_ratio > 1), a differentiated
  lse (`return_lse`: the kernel's backward takes no lse cotangent), head dims above 256 and dtypes
  other than bf16/f16/f32;
- pads q, k and v with zero columns to one head dim max(H, Hv) (zero columns change no logit and
  give zero output columns, sliced off), and the length to a multiple of its blocks (padded keys
  come after every real query, so causality hides them; padded rows get zero gradient);
- repeats each of the K key/value heads N/K times (GQA, MQA), since the kernel maps query head n
  to key head n. That costs N/K copies of k and v ([B, T, N, H] each) and the same size of dk, dv
  before they are summed back per group: 2 x 0.8 GB at T 64K for QSA's 24/2 x 256 in bf16; none
  for non-absorbed MLA (K = N).

Importing JAX's module emits a DeprecationWarning (it points to tokamax); it is imported lazily,
inside the first call, with that warning suppressed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels._shapes import next_power_of_two

_LN2 = math.log(2.0)
# lse of padded query rows: large, so their probabilities exp2(qk - lse) are 0 in the backward.
_PAD_LSE = 1e30


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles of the forward (block_q x block_k) and of both backward loops (block_bwd), Triton's warps/stages."""

  block_q: int = 128
  block_k: int = 128
  block_bwd: int = 32
  num_warps: int | None = None  # None: JAX's choice (4 for head dims <= 64, else 8)
  num_stages: int = 2

  @classmethod
  def heuristics(cls, head_dim: int, itemsize: int) -> "Config":
    """The largest square forward tile whose q block plus double-buffered k and v blocks fit ~160 KiB of
    shared memory (Hopper has 227 KiB per CTA), and backward tiles whose ~6 blocks do.

    bf16: 128 x 128 up to 128 dims, 64 x 64 at 256 (a 128-row tile of 256 dims is 64 KiB; q plus two
    stages of k and v would need 320 KiB); f32 halves them. A prior from the tile sizes, not yet tuned.
    """
    row = next_power_of_two(head_dim) * itemsize
    block = next(b for b in (128, 64, 32, 16) if b == 16 or 5 * b * row <= 160 * 1024)
    block_bwd = next(b for b in (32, 16) if b == 16 or 6 * b * row <= 160 * 1024)
    return cls(block_q=block, block_k=block, block_bwd=block_bwd)

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_bwd"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"Config.{name}={value} must be a power of two >= 16.")

  def padded_length(self, T: int) -> int:
    """T rounded up so that every block divides it (the kernel clips blocks to the length)."""
    block = max(self.block_q, self.block_k, self.block_bwd)
    if T <= block:  # one block of the whole (power-of-two) length
      return max(16, next_power_of_two(T))
    return -(-T // block) * block

  def block_sizes(self):
    """JAX's `BlockSizes` for these tiles."""
    from jax.experimental.pallas.ops.gpu import attention  # noqa: PLC0415

    return attention.BlockSizes(block_q=self.block_q, block_k=self.block_k, block_q_dkv=self.block_bwd,
                                block_kv_dkv=self.block_bwd, block_q_dq=self.block_bwd, block_kv_dq=self.block_bwd)


@functools.cache
def _jax_attention():
  """JAX's attention module, imported once with its DeprecationWarning contained."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention  # noqa: PLC0415
  return attention


def _check_applies(q, k, v, mask, compress_ratio, return_lse):
  """NotImplementedError where the kernel does not apply (see the module docstring)."""
  q_offset, q_seg, kv_seg = mask
  if compress_ratio != 1:
    raise NotImplementedError(f"causal_attention pallas: the kernel's mask is token-causal ({compress_ratio=}).")
  if return_lse:
    raise NotImplementedError("causal_attention pallas: the kernel's backward takes no lse cotangent (return_lse).")
  if not (isinstance(q_offset, int) and q_offset == 0):
    raise NotImplementedError("causal_attention pallas: the kernel's causal mask starts at 0 (no q_offset).")
  if q_seg is not kv_seg:
    raise NotImplementedError("causal_attention pallas: the kernel takes one segment-id array for q and k.")
  if k.shape[1] != q.shape[1]:
    raise NotImplementedError(f"causal_attention pallas: key length {k.shape[1]} != query length {q.shape[1]}.")
  if max(q.shape[3], v.shape[3]) > 256:
    raise NotImplementedError(f"causal_attention pallas: head dims {q.shape[3]}/{v.shape[3]} above 256.")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
      raise NotImplementedError(f"causal_attention pallas: {name}.dtype={x.dtype} (bf16, f16 or f32 only).")
  if not q.dtype == k.dtype == v.dtype:
    raise NotImplementedError(f"causal_attention pallas: mixed dtypes {q.dtype}, {k.dtype}, {v.dtype}.")


def _pad(x, T_pad, D, value=0):
  """[B, T, heads, d] -> [B, T_pad, heads, D], padded with `value`."""
  return jnp.pad(x, ((0, 0), (0, T_pad - x.shape[1]), (0, 0), (0, D - x.shape[3])), constant_values=value)


def _kernel_inputs(q, k, v, seg, config):
  """(q, k, v [B, T_pad, N, D] with k, v heads repeated; seg [B, T_pad] or None; T_pad, D)."""
  B, T, N, _ = q.shape
  G = N // k.shape[2]
  D = max(q.shape[3], v.shape[3])
  T_pad = config.padded_length(T)
  q, k, v = (_pad(x, T_pad, D) for x in (q, k, v))
  k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  seg = None if seg is None else jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=-1)
  return q, k, v, seg, T_pad, D


def _resolve(config, interpret, q, v):
  config = config or Config.heuristics(max(q.shape[3], v.shape[3]), jnp.dtype(q.dtype).itemsize)
  return config, jax.default_backend() != "gpu" if interpret is None else interpret


def causal_attention_forward_pallas(q, k, v, mask, *, scale, sinks=None, compress_ratio: int = 1,
                                    return_lse: bool = False, config: Config | None = None,
                                    interpret: bool | None = None):
  """(out [B, T, N, Hv] in q.dtype, lse f32[B, T, N]) by JAX's `mha` forward kernel.

  Args:
    q: bf16|f16|f32[B, T, N, H]; k: [B, T, K, H]; v: [B, T, K, Hv].
    mask: (q_offset, q_seg, kv_seg) as `ops.causal_attention` passes it; q_offset must be the int 0
      and q_seg the same array as kv_seg (int[B, T]) or both None.
    scale: logit scale. sinks: must be None (the shared vjp glue passes it).
    compress_ratio, return_lse: must be 1 and False (declined otherwise).
    config: tiles; None = `Config.heuristics`. interpret: None = whenever JAX's backend is not a GPU.
  """
  _check_applies(q, k, v, mask, compress_ratio, return_lse)
  if sinks is not None:
    raise NotImplementedError("causal_attention pallas: no sinks.")
  config, interpret = _resolve(config, interpret, q, v)
  B, T, N, _ = q.shape
  qp, kp, vp, seg, T_pad, _ = _kernel_inputs(q, k, v, mask[1], config)
  out, lse2 = _jax_attention().mha(
      qp, kp, vp, seg, sm_scale=scale, causal=True, block_sizes=config.block_sizes(),
      num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret, return_residuals=True)
  lse = jnp.swapaxes(lse2, 1, 2)[:, :T] * _LN2  # the kernel's lse is base 2: [B, N, T_pad]
  return out[:, :T, :, : v.shape[3]], lse


def causal_attention_backward_pallas(residuals, cotangents, *, scale, compress_ratio: int = 1,
                                     config: Config | None = None, interpret: bool | None = None):
  """(dq, dk, dv, None) by JAX's Triton `mha` backward, from the saved out and lse.

  Args:
    residuals: (q, k, v, mask, sinks, out, lse) of `causal_attention_forward_pallas`.
    cotangents: (dout [B, T, N, Hv], dlse); dlse is ignored (the forward declined `return_lse`).
    compress_ratio: 1 (the forward declined any other).
  """
  del compress_ratio
  q, k, v, mask, _, out, lse = residuals
  dout = cotangents[0]
  config, interpret = _resolve(config, interpret, q, v)
  B, T, N, H = q.shape
  K, Hv = k.shape[2], v.shape[3]
  qp, kp, vp, seg, T_pad, D = _kernel_inputs(q, k, v, mask[1], config)
  outp, doutp = _pad(out, T_pad, D), _pad(dout.astype(q.dtype), T_pad, D)
  lse2 = jnp.pad(jnp.swapaxes(lse / _LN2, 1, 2), ((0, 0), (0, 0), (0, T_pad - T)), constant_values=_PAD_LSE)
  attention = _jax_attention()
  dq, dk, dv, _ = attention._mha_backward(  # noqa: SLF001 (the public mha's own backward, given its residuals)
      scale, True, config.block_sizes(), "triton", config.num_warps, config.num_stages, None,
      interpret, False, False, (qp, kp, vp, seg, outp, lse2.astype(jnp.float32)), doutp)
  per_group = lambda x, d: x[:, :T].astype(jnp.float32).reshape(B, T, K, N // K, D).sum(3)[..., :d]
  return (dq[:, :T, :, :H].astype(q.dtype), per_group(dk, H).astype(k.dtype), per_group(dv, Hv).astype(v.dtype),
          None)
