"""Engram / PLE (Qwen3.8-Flash-Next): hashed n-gram embeddings added to the residual streams of a layer.

Per PLE layer, each token's n-grams of orders 2..`ngram_size` (the token and the ones before it) are
hashed `ngram_heads_per_order` ways each into prime-sized tables; the rows found, concatenated, are the
token's n-gram embedding [E]. It is projected to one value [D] and one key per residual stream [N, D];
each stream's normalised state gates the value (a signed square root of the key.query score, then a
sigmoid), and a dilated causal depthwise conv adds local context. The result is added to the streams
before the layer's attention hyper-connection. Parameter names are transformers' (`Qwen4ExpTextPLELayer`).

The hash (transformers' `Qwen4ExpTextNGramEmbedding`) is exact 64-bit integer arithmetic:
  mix_n(t) = XOR_{i < n} (token[t - i] * m_i),  row_h(t) = mix_n(t) mod p_h + offset_h,
with odd multipliers m_i < 2^63 / vocab_size (so each product fits in 63 bits) from a splitmix64 of
`ngram_seed` and the PLE layer's index, and p_h the h-th prime >= `ngram_vocab_base` counting every PLE
layer's heads. A token before an EOS (or before the document start) is replaced by EOS. JAX runs
without 64-bit integers by default, so the products and the remainder are computed on uint32 pairs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import sharding as shd
from hyscale_jax.layers.gated_deltanet import causal_depthwise_conv
from hyscale_jax.layers.norms import ZeroCenteredRMSNorm
from hyscale_jax.model_config import ModelConfig

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_LAYER_STRIDE = 10007  # seed offset per PLE layer (transformers' _PRIME_1)


def _splitmix64(value: int) -> int:
  value = (value + _GOLDEN) & _MASK64
  value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
  return (value ^ (value >> 31)) & _MASK64


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
  """The odd multipliers m_0..m_{ngram_size-1} of PLE layer `ple_index` (Python ints < 2^63 / vocab_size)."""
  half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
  base = seed + _LAYER_STRIDE * ple_index
  return [2 * (_splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
  if n < 2 or n % 2 == 0:
    return n == 2
  return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@functools.lru_cache(maxsize=None)
def _primes_from(start: int, count: int) -> tuple[int, ...]:
  primes, n = [], start
  while len(primes) < count:
    if _is_prime(n):
      primes.append(n)
    n += 1
  return tuple(primes)


def head_tables(cfg: ModelConfig, ple_index: int) -> tuple[list[int], list[int], int]:
  """(prime table size per head, row offset per head, padded total rows) of PLE layer `ple_index`."""
  heads = (cfg.ngram_size - 1) * cfg.ngram_heads_per_order
  sizes = list(_primes_from(cfg.ngram_vocab_base, (ple_index + 1) * heads)[ple_index * heads:])
  offsets = [sum(sizes[:h]) for h in range(heads)]
  multiple = cfg.ngram_vocab_multiple
  return sizes, offsets, -(-sum(sizes) // multiple) * multiple


def checkpoint_constants(cfg: ModelConfig, ple_index: int) -> dict[str, np.ndarray]:
  """The int64 buffers transformers stores beside each PLE table (fixed by the config), by their names."""
  sizes, offsets, _ = head_tables(cfg, ple_index)
  multipliers = hash_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.ngram_seed)
  return {"layer_multipliers": np.array(multipliers, np.int64),
          "ngram_heads_vocab_sizes": np.array(sizes, np.int64),
          "ngram_heads_offsets": np.array(offsets, np.int64)}


def _split16(x):
  return x & 0xFFFF, x >> 16


def _mul_u64(t: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """(hi, lo) uint32 words of t * m for uint32 t and a Python int m, exact when the product is < 2^64."""
  m_hi, m_lo = np.uint32(m >> 32), np.uint32(m & 0xFFFFFFFF)
  t0, t1 = _split16(t)
  b0, b1 = np.uint32(int(m_lo) & 0xFFFF), np.uint32(int(m_lo) >> 16)
  p00, p01, p10, p11 = t0 * b0, t0 * b1, t1 * b0, t1 * b1  # 16 x 16 bits: no overflow
  mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
  carry = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)  # the high word of t * m_lo
  return t * m_hi + carry, t * m_lo


def _mod_u64(hi: jax.Array, lo: jax.Array, p: jax.Array) -> jax.Array:
  """(hi * 2^32 + lo) mod p, uint32, for p < 2^28: Horner over 4-bit digits keeps r * 16 below 2^32."""
  r = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32)
  for word in (hi, lo):
    for shift in range(28, -1, -4):
      r = ((r << 4) | ((word >> shift) & 0xF)) % p
  return r


def shifted_tokens(tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"], shift: int, eos: int
                   ) -> Int[Array, "B T"]:
  """token[t - shift] where no EOS lies in [t - shift, t - 1] and t - shift is in t's document, else EOS."""
  T = tokens.shape[1]
  if shift == 0:
    return tokens
  before = lambda a, s, fill: jnp.pad(a, ((0, 0), (s, 0)), constant_values=fill)[:, :T]
  ok = (jnp.arange(T) >= shift) & (before(segment_ids, shift, -1) == segment_ids)
  for s in range(1, shift + 1):
    ok = ok & (before(tokens, s, eos) != eos)
  return jnp.where(ok, before(tokens, shift, eos), eos)


def ngram_rows(tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"], cfg: ModelConfig, ple_index: int
               ) -> Int[Array, "B T H"]:
  """i32[B, T, H] table rows of each token's n-gram heads (order 2 first), H = (ngram_size - 1) * heads_per_order."""
  sizes, offsets, _ = head_tables(cfg, ple_index)
  if max(sizes) >= 1 << 28:
    raise ValueError(f"model.ngram_vocab_base={cfg.ngram_vocab_base} gives a table of {max(sizes)} rows; "
                     "the uint32 remainder needs fewer than 2^28.")
  multipliers = hash_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.ngram_seed)
  per = cfg.ngram_heads_per_order
  history = [shifted_tokens(tokens, segment_ids, i, cfg.eos_token_id).astype(jnp.uint32) for i in range(cfg.ngram_size)]
  hi, lo = _mul_u64(history[0], multipliers[0])
  blocks = []
  for n in range(2, cfg.ngram_size + 1):
    term_hi, term_lo = _mul_u64(history[n - 1], multipliers[n - 1])
    hi, lo = hi ^ term_hi, lo ^ term_lo
    heads = slice((n - 2) * per, (n - 1) * per)
    p = jnp.asarray(sizes[heads], jnp.uint32)
    rows = _mod_u64(hi[..., None], lo[..., None], p).astype(jnp.int32)
    blocks.append(rows + jnp.asarray(offsets[heads], jnp.int32))
  return jnp.concatenate(blocks, axis=-1)


class NGramEmbedding(nnx.Module):
  """The hashed n-gram lookup: one table `ngram_embedding` [rows, E / H] for all H heads of this layer."""

  def __init__(self, cfg: ModelConfig, ple_index: int, *, rngs: nnx.Rngs):
    heads = (cfg.ngram_size - 1) * cfg.ngram_heads_per_order
    self.cfg, self.ple_index = cfg, ple_index
    rows = head_tables(cfg, ple_index)[2]
    self.ngram_embedding = nnx.Embed(
        rows, cfg.ple_embed_dim // heads, rngs=rngs, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
        embedding_init=nnx.initializers.normal(0.02), embedding_metadata=shd.param(shd.VOCAB, shd.EMBED))

  def __call__(self, tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"]) -> Float[Array, "B T E"]:
    """The concatenated rows [B, T, E] in cfg.dtype."""
    rows = self.ngram_embedding(ngram_rows(tokens, segment_ids, self.cfg, self.ple_index))  # [B, T, H, E / H]
    return rows.reshape(*tokens.shape, -1)


class EngramLayer(nnx.Module):
  """One PLE layer (transformers' `ple`): streams [B, T, N, D] -> the addition to them [B, T, N, D].

  e = `ple_embedding`(tokens) [B, T, E]; key = `norm_key`(`key_proj` e) [N, D]; value = `value_proj` e [D];
  query = `norm_query`(streams); g = (key . query) / sqrt(D) per stream, gate = sigmoid(sign(g) sqrt(max(|g|,
  1e-6))); v = gate * value [N, D]; out = v + silu(conv(`norm_conv`(v))) with `conv1d` a causal depthwise
  conv [K, N * D] of dilation `ngram_size` (zero-initialised, as in transformers), cut at document starts.
  The norms are zero-centred, one group per stream. Computed in f32; returns the streams' dtype.
  """

  def __init__(self, cfg: ModelConfig, ple_index: int, *, rngs: nnx.Rngs):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    N, D, E = cfg.hc_mult, cfg.d_model, cfg.ple_embed_dim
    if N < 1:
      raise ValueError(f"EngramLayer: model.hc_mult={N} must be >= 1 (the n-gram gate reads each residual stream).")
    linear = lambda o: nnx.Linear(E, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                  kernel_metadata=shd.param(None, shd.EMBED))
    norm = lambda: ZeroCenteredRMSNorm(N * D, eps=cfg.rms_eps, group_size=D, param_dtype=pdtype)
    self.cfg = cfg
    self.ple_embedding = NGramEmbedding(cfg, ple_index, rngs=rngs)
    self.key_proj, self.value_proj = linear(N * D), linear(D)
    self.norm_key, self.norm_query, self.norm_conv = norm(), norm(), norm()
    self.conv1d = nnx.Param(jnp.zeros((cfg.ple_conv_kernel, N * D), pdtype), **shd.param(None, shd.EMBED))

  def __call__(self, streams: Float[Array, "B T N D"], tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"]
               ) -> Float[Array, "B T N D"]:
    B, T, N, D = streams.shape
    e = self.ple_embedding(tokens, segment_ids)  # [B, T, E]
    key = self.norm_key(self.key_proj(e)).reshape(B, T, N, D).astype(jnp.float32)
    value = self.value_proj(e).astype(jnp.float32)  # [B, T, D]
    query = self.norm_query(streams.reshape(B, T, N * D)).reshape(B, T, N, D).astype(jnp.float32)
    g = jnp.sum(key * query, axis=-1, keepdims=True) / math.sqrt(D)  # [B, T, N, 1]
    g = jnp.sign(g) * jnp.sqrt(jnp.maximum(jnp.abs(g), 1e-6))
    gated = (jax.nn.sigmoid(g) * value[:, :, None, :]).reshape(B, T, N * D)
    conv = causal_depthwise_conv(self.norm_conv(gated), self.conv1d[...], segment_ids, dilation=self.cfg.ngram_size)
    return (gated + jax.nn.silu(conv)).reshape(B, T, N, D).astype(streams.dtype)
