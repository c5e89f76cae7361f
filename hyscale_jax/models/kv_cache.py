"""Cached decoding for MLA + DSA decoders (GLM-5.1): a fixed-size KV cache and one compiled decode step.

What is cached, per layer and position: absorbed MLA's one shared key row `[c_kv ; rope(k_pe)]`
(L + R wide; the value is its latent prefix, so nothing else is kept) and, in layers with their own
lightning indexer, the index key [DI]. `extend` runs new rows through the model against the cache:
the whole prompt at prefill, one token per decode step. In each layer it writes the rows' keys into
the cache at their positions, then runs the layer's own query path (`MLASparseAttention.query_rows`,
the one the full forward takes): the indexer's top-k over the cached index keys (`ops.flash_topk`
with the rows' `q_offset`, so cache rows past a query are invisible and a query with fewer than
`index_topk` visible keys selects them all), and sparse attention over the selected cached rows
(`ops.sparse_attention`). Layers under IndexShare reuse the previous full layer's selection, as in
the forward. Everything but the attention is per token, so the rows see what the full forward would
give them, and greedy decoding picks the same tokens as `models.generate` (tests/test_kv_cache.py),
up to float rounding: one row's matmuls round differently from T rows', so where an indexer top-k or
an expert choice is a near-tie the two decoders may choose differently, and continue from there.

The cache is one buffer of `cache_length(P + N)` rows made before the prefill, so each decode step
is one jitted program per (batch, cache length), reused for every token; the prefill compiles once
per prompt length. The prefill runs every prompt row at once, without `attention_query_chunk`'s
chunks, so a prompt of 100K+ tokens needs an unchunked forward's memory. Other decoders (compressed
attention, linear attention, hyper-connections) have no cache here: `unsupported_reason` says why,
and `models.generate` decodes them without one.
"""

from __future__ import annotations

import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax.layers.mla import MLASparseAttention
from hyscale_jax.models.decoder import Decoder
from hyscale_jax.models.generate import Sampling, check_prompt, choose_tokens, frozen_backends, thawed_backends

# The cache length is rounded up to a multiple of this, so nearby lengths share compiled programs.
CACHE_BLOCK = 128


class KVCache(NamedTuple):
  """Per layer, in layer order: `keys` [B, S, 1, L+R] (MLA's shared key rows; values are their first L
  columns) and `index_keys` [B, S, DI], None for a layer that reuses another's selection. Row s holds
  position s; rows not yet written are zeros, never visible to a query before them."""

  keys: tuple
  index_keys: tuple


def unsupported_reason(model: nnx.Module) -> str | None:
  """None when `model` decodes with this cache, else one sentence saying why it does not."""
  if not isinstance(model, Decoder):
    return f"{type(model).__name__} is not a models.Decoder."
  if model.hc_head is not None:
    return f"{model.cfg.architecture} has hyper-connections (residual streams), which this cache does not carry."
  for i, layer in enumerate(model.layers):
    if not isinstance(layer.self_attn, MLASparseAttention):
      return (f"{model.cfg.architecture}'s layer {i} attention is {type(layer.self_attn).__name__}; the KV cache "
              "covers MLA + DSA (glm_moe_dsa) only.")
    if layer.attn_hc is not None or layer.mlp_hc is not None or layer.ple is not None:
      return f"{model.cfg.architecture}'s layer {i} has hyper-connections or an n-gram embedding."
  return None


def cache_length(tokens: int) -> int:
  """Rows of a cache that holds `tokens` positions: rounded up to a multiple of `CACHE_BLOCK`."""
  return max(1, math.ceil(tokens / CACHE_BLOCK)) * CACHE_BLOCK


def init_cache(model: nnx.Module, batch: int, length: int) -> KVCache:
  """An empty (zero) cache of `length` positions for `batch` rows, in the dtypes the layers' keys have."""
  row = jax.ShapeDtypeStruct((batch, 1, model.cfg.d_model), jnp.dtype(model.cfg.dtype))
  position = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  keys, index_keys = [], []
  for layer in model.layers:
    k, index_k = jax.eval_shape(layer.self_attn.keys, row, position)  # [B, 1, 1, L+R], [B, 1, DI] or None
    keys.append(jnp.zeros((batch, length, *k.shape[2:]), k.dtype))
    index_keys.append(None if index_k is None else jnp.zeros((batch, length, *index_k.shape[2:]), index_k.dtype))
  return KVCache(tuple(keys), tuple(index_keys))


def extend(model: nnx.Module, cache: KVCache, tokens: Int[Array, "B n"], start: int | Int[Array, ""], *,
           backends=None) -> tuple[Float[Array, "B V"], KVCache]:
  """Runs the rows `tokens` at positions start..start+n-1 against the cache, and adds their keys to it.

  Positions before `start` must already be in the cache (from earlier calls); with `start` 0 and the
  prompt this is the prefill. Attention and selection are causal from `q_offset=start`, so the
  rows after start+n-1 may hold anything.

  Args:
    model: a decoder that `unsupported_reason` accepts.
    cache: `init_cache`'s, or the last call's, with room for start + n positions.
    tokens: i32[B, n] the next tokens of every row (one document per row, starting at position 0).
    start: the position of tokens[:, 0] (an int or an i32[] array, traced under jit).
    backends: per-op backend names (`config.ops`-like, read by attribute); None means "auto".

  Returns:
    (f32[B, V] the logits after the last row, which predict position start+n; the cache with rows
    start..start+n-1 written).
  """
  B, n = tokens.shape
  positions = start + jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
  # One document per row: every segment id is 0, as in the forward's default.
  row_segments = jnp.zeros((B, n), jnp.int32)
  key_segments = jnp.zeros((B, cache.keys[0].shape[1]), jnp.int32)
  x = model.embed_tokens(tokens)  # [B, n, D]
  indices, keys, index_keys = None, [], []
  for layer, k_cache, index_cache in zip(model.layers, cache.keys, cache.index_keys, strict=True):
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    k, index_k = attn.keys(h, positions)  # [B, n, 1, L+R], [B, n, DI] or None
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
    if index_k is not None:
      index_cache = jax.lax.dynamic_update_slice_in_dim(index_cache, index_k.astype(index_cache.dtype), start, axis=1)
    rows = attn.query_rows(lambda k=k_cache, i=index_cache: (k, i), key_segments, backends)
    # The indexer loss it also returns is unused, and jit drops its computation.
    out, layer_indices, *_ = rows(h, positions, row_segments, start, indices)
    if attn.indexer is not None:
      indices = layer_indices  # [B, n, K]: IndexShare layers after this one reuse it
    x, _ = layer.ffn(x + out, tokens, backends)  # the residual, then the MLP/MoE sub-block (per token)
    keys.append(k_cache)
    index_keys.append(index_cache)
  last = x[:, -1:]
  last = last if model.norm is None else model.norm(last)
  return model.logits(last)[:, 0], KVCache(tuple(keys), tuple(index_keys))


def generate(model: nnx.Module, prompt: Int[Array, "B P"], max_new_tokens: int, *, backends=None,
             sampling: Sampling | None = None, seed: int = 0, stop_token: int | None = None,
             timings: dict | None = None) -> Int[Array, "B P+N"]:
  """`models.generate` with a KV cache: the prompt followed by `max_new_tokens` chosen tokens.

  The prefill runs the prompt through `extend` in one call; then each step runs the last token alone
  (one compiled program for every step). Tokens are chosen by `generate.choose_tokens` with the same
  keys as `models.generate` (`fold_in(key(seed), t)` for position t), so greedy decoding gives its
  tokens, and sampling its draws up to float rounding of the logits.

  Args:
    model: a decoder that `unsupported_reason` accepts; it is not modified.
    prompt: int[B, P] token ids, P >= 1; every row is one document starting at position 0.
    max_new_tokens: N >= 0 tokens to append.
    backends: per-op backend names (`config.ops`); None means "auto" everywhere.
    sampling: how each token is chosen (`Sampling`); None is greedy.
    seed: the draws' PRNG seed; unused when greedy.
    stop_token: stop early once every row has produced this token (an EOS id); the positions after
      it are filled with it. None decodes all N.
    timings: a dict to fill with wall seconds: "prefill_s" (to the first new token, the prefill's
      compilation included), "first_step_s" (the first decode step, which compiles it), "decode_s"
      and "decode_steps" (the steps after it). Waiting for those two tokens costs nothing else.

  Returns:
    i32[B, P + N]: the prompt, then the generated tokens.

  Raises:
    ValueError: a bad prompt, `max_new_tokens` or sampling value, or a model without cache support.
  """
  check_prompt(prompt, max_new_tokens)
  sampling = (Sampling() if sampling is None else sampling).check()
  reason = unsupported_reason(model)
  if reason is not None:
    raise ValueError(f"no KV cache for this model: {reason} Use models.generate.")
  prompt = jnp.asarray(prompt, jnp.int32)
  B, P = prompt.shape
  if max_new_tokens == 0:
    return prompt
  graphdef, state = nnx.split(model)
  run = functools.partial(_extend_and_choose, graphdef, frozen_backends(backends),
                          None if sampling.greedy else sampling, jax.random.key(seed))
  clock = _Clock(timings)
  cache = init_cache(model, B, cache_length(P + max_new_tokens))
  token, cache = run(state, cache, prompt, jnp.int32(0))
  clock.lap("prefill_s", token)
  new, stopped = [token], token == stop_token if stop_token is not None else None
  for t in range(P + 1, P + max_new_tokens):
    # Reading `stopped` waits for the step; without a stop token the steps queue up asynchronously.
    if stopped is not None and bool(jnp.all(stopped)):
      break
    token, cache = run(state, cache, token[:, None], jnp.int32(t - 1))
    new.append(token)
    if len(new) == 2:
      clock.lap("first_step_s", token)
    if stopped is not None:
      stopped = stopped | (token == stop_token)
  clock.lap("decode_s", token)
  if timings is not None:
    timings["decode_steps"] = max(len(new) - 2, 0)
  new = jnp.stack(new, axis=1)  # [B, n <= N]
  if stop_token is not None:  # everything after a row's first stop token is the stop token
    after_stop = jnp.cumsum(new == stop_token, axis=1) - (new == stop_token) > 0
    new = jnp.where(after_stop, stop_token, new)
    new = jnp.pad(new, ((0, 0), (0, max_new_tokens - new.shape[1])), constant_values=stop_token)
  return jnp.concatenate([prompt, new], axis=1)


class _Clock:
  """Wall seconds between laps, written into `timings` (nothing, and no waiting, when it is None)."""

  def __init__(self, timings: dict | None):
    self.timings, self.start = timings, time.perf_counter()

  def lap(self, name: str, ready: jax.Array) -> None:
    if self.timings is None:
      return
    jax.block_until_ready(ready)
    now = time.perf_counter()
    self.timings[name] = self.timings.get(name, 0.0) + now - self.start
    self.start = now


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5,))
def _extend_and_choose(graphdef, backends, sampling, key, state, cache, tokens, start):
  """(i32[B] the token after `tokens` [B, n] at positions start.., the updated cache); the cache buffer
  is donated, so each step writes its key rows in place."""
  model = nnx.merge(graphdef, state)
  logits, cache = extend(model, cache, tokens, start, backends=thawed_backends(backends))
  position = start + tokens.shape[1]  # of the chosen token
  return choose_tokens(logits, jax.random.fold_in(key, position), sampling), cache
