"""Pallas (Triton-style) sparse attention forward: one query token per program, heads as rows, gathered KV.

Each program takes one token's block of `block_h` heads of one KV group (in MQA all heads share the
group, so every gathered key row serves them all), walks its selected indices `block_k` at a time,
gathers those key and value rows, and keeps an online softmax. It writes `out` and the f32 `lse`
(including the sink) that the backward pass and the indexer loss reuse. `hyscale_jax.ops` pairs it
with the reference backward for now (STYLE's `backward_impl="xla"`), which reads the saved out/lse.

Triton wants power-of-two tensor shapes, so the wrapper splits the key head dim into power-of-two
parts (576 = 512 + 64 for absorbed MLA), pads the selection to a multiple of `block_k` with -1 and
the key length to a power of two; it declines (NotImplementedError) a value head dim that is not a
power of two.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_HIGHEST = jax.lax.Precision.HIGHEST
_NEG = -1e30  # a finite "minus infinity" for the running max, so empty prefixes never give inf - inf


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning: heads per program, selected keys per step, and Triton's warps/stages."""

  block_h: int = 64
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 2

  @classmethod
  def heuristics(cls, Dk: int, Dv: int, itemsize: int) -> "Config":
    """Largest block_k whose double-buffered gathered K and V rows fit in ~160 KiB of shared memory."""
    block_k = 64
    while block_k > 16 and 2 * block_k * (Dk + Dv) * itemsize > 160 * 1024:
      block_k //= 2
    return cls(block_k=block_k)

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"Config.{name}={value} must be a power of two.")


def _power_of_two_parts(n: int) -> tuple[int, ...]:
  """n as a sum of descending powers of two (its binary digits): 576 -> (512, 64)."""
  return tuple(1 << b for b in reversed(range(n.bit_length())) if n >> b & 1)


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _sparse_attention_fwd_kernel(*refs, n_parts, scale, num_keys, block_k, has_sinks, precise):
  # Inputs: q parts [block_h, d_i] ..., k parts [S_pad, d_i] ..., v [S_pad, Dv], indices [K_pad],
  # sinks [block_h] (if any). Outputs: out [block_h, Dv], lse [block_h].
  q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
  v_ref, idx_ref = refs[2 * n_parts], refs[2 * n_parts + 1]
  sinks_ref = refs[2 * n_parts + 2] if has_sinks else None
  o_ref, lse_ref = refs[-2], refs[-1]
  block_h, dv = o_ref.shape
  precision = _HIGHEST if precise else None
  qs = [r[...] for r in q_refs]

  def step(j, carry):
    m, l, acc = carry
    ids = idx_ref[pl.ds(j * block_k, block_k)]  # [block_k]
    valid = (ids >= 0) & (ids < num_keys)
    safe = jnp.where(valid, ids, 0)
    s = jnp.zeros((block_h, block_k), jnp.float32)
    for q, k_ref in zip(qs, k_refs):
      k = k_ref[safe, :]  # gathered [block_k, d_i]
      s += jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)
    s = jnp.where(valid[None, :], s * scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])  # masked entries: exp(-inf) = 0
    correction = jnp.exp(m - m_new)
    v = v_ref[safe, :]  # [block_k, Dv]
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32, precision=precision)
    return m_new, l * correction + p.sum(axis=1), acc * correction[:, None] + pv

  init = (jnp.full((block_h,), _NEG, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          jnp.zeros((block_h, dv), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, step, init)
  if has_sinks:
    sink = sinks_ref[...].astype(jnp.float32)
    m_new = jnp.maximum(m, sink)
    correction = jnp.exp(m - m_new)
    l = l * correction + jnp.exp(sink - m_new)
    acc = acc * correction[:, None]
    m = m_new
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  o_ref[...] = jnp.where(nonempty[:, None], acc / safe_l[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe_l), -jnp.inf)


def sparse_attention_forward_pallas(q, k, v, indices, *, scale, sinks=None, config: Config | None = None,
                                    interpret: bool | None = None):
  """Forward pass: (out in q.dtype [B, T, H, Dv], lse f32[B, T, H]); see the module docstring.

  Raises:
    NotImplementedError: Dv is not a power of two, or (compiled for the GPU) a matmul dim would be
      under 16; "auto" then uses the reference backend.
  """
  config = config or Config.heuristics(q.shape[-1], v.shape[-1], jnp.dtype(k.dtype).itemsize)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  B, T, H, Dk = q.shape
  S, G, Dv = k.shape[1], k.shape[2], v.shape[3]
  if Dv & (Dv - 1):
    raise NotImplementedError(f"pallas sparse_attention needs a power-of-two value dim, got {Dv=}.")
  heads_per_group = H // G
  block_h = min(config.block_h, heads_per_group & -heads_per_group)  # a power of two dividing H // G
  K = indices.shape[2]
  block_k = min(config.block_k, _next_power_of_two(K))
  K_pad = -(-K // block_k) * block_k
  S_pad = _next_power_of_two(S)
  indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, K_pad - K)), constant_values=-1)
  k = jnp.pad(k, ((0, 0), (0, S_pad - S), (0, 0), (0, 0)))
  v = jnp.pad(v, ((0, 0), (0, S_pad - S), (0, 0), (0, 0)))
  parts = _power_of_two_parts(Dk)
  if not interpret and min(block_h, block_k, Dv, *parts) < 16:
    raise NotImplementedError(  # tl.dot needs every matmul dim >= 16 on the GPU
        f"pallas sparse_attention needs >= 16 heads per group, selected keys and head-dim parts on GPU; "
        f"got block_h={block_h}, block_k={block_k}, Dk parts {parts}, {Dv=}.")
  offsets = [sum(parts[:i]) for i in range(len(parts))]
  q_parts = [q[..., o : o + d] for o, d in zip(offsets, parts)]
  k_parts = [k[..., o : o + d] for o, d in zip(offsets, parts)]

  group = lambda h: h * block_h // heads_per_group
  in_specs = (
      [pl.BlockSpec((None, None, block_h, d), lambda b, t, h: (b, t, h, 0)) for d in parts]
      + [pl.BlockSpec((None, S_pad, None, d), lambda b, t, h: (b, 0, group(h), 0)) for d in parts]
      + [pl.BlockSpec((None, S_pad, None, Dv), lambda b, t, h: (b, 0, group(h), 0)),
         pl.BlockSpec((None, None, K_pad), lambda b, t, h: (b, t, 0))]
  )
  operands = [*q_parts, *k_parts, v, indices]
  if sinks is not None:
    in_specs.append(pl.BlockSpec((block_h,), lambda b, t, h: (h,)))
    operands.append(sinks.astype(jnp.float32))
  kernel = functools.partial(
      _sparse_attention_fwd_kernel, n_parts=len(parts), scale=float(scale), num_keys=S, block_k=block_k,
      has_sinks=sinks is not None, precise=q.dtype == jnp.float32)
  out, lse = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((B, T, H, Dv), q.dtype), jax.ShapeDtypeStruct((B, T, H), jnp.float32)),
      grid=(B, T, H // block_h),
      in_specs=in_specs,
      out_specs=(pl.BlockSpec((None, None, block_h, Dv), lambda b, t, h: (b, t, h, 0)),
                 pl.BlockSpec((None, None, block_h), lambda b, t, h: (b, t, h))),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="hyscale_sparse_attention_fwd",
  )(*operands)
  return out, lse

