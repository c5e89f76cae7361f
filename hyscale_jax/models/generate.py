"""Decoding without a cache for any model `models.build` returns, and the token choice every decoder shares.

`generate` reruns the forward pass over a fixed [B, P + N] buffer for each new token, so one
compilation serves every step. That is quadratic in the length and meant for short continuations
of small models and as the oracle of the cached decoder (`models/kv_cache.py`), not for serving.
`choose_tokens` turns one row of logits into the next tokens: greedy, or sampled with a
temperature, top-k and top-p, the same way in both decoders.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int


class Sampling(NamedTuple):
  """How the next token is drawn from the logits; the default (temperature 0) is greedy.

  temperature: divides the logits; 0 takes the argmax (nothing is drawn).
  top_k: draw among the k likeliest tokens only (0: all).
  top_p: then among the fewest likeliest tokens whose probability sums to at least top_p (1: all).
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def check(self) -> Sampling:
    """Itself, once its values are in range.

    Raises:
      ValueError: temperature < 0, top_k < 0 or top_p outside (0, 1], naming the value.
    """
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0: greedy).")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0: every token).")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1] (1: every token).")
    return self


def choose_tokens(logits: Float[Array, "B V"], key: jax.Array, sampling: Sampling | None) -> Int[Array, "B"]:
  """i32[B] next tokens from f32 logits [B, V]: the argmax for `sampling` None, else a draw with `key`.

  The draw follows Hugging Face's order: the logits are divided by the temperature, cut to the
  top_k likeliest, then to the smallest prefix of those (by probability) whose mass reaches top_p
  (the likeliest token always stays), and one token is drawn from the renormalised rest. The values
  may be traced (one program for any values), so greedy decoding is said with None, not temperature 0.
  """
  if sampling is None:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  V = logits.shape[-1]
  scaled = logits.astype(jnp.float32) / sampling.temperature
  ranked, order = jax.lax.top_k(scaled, V)  # [B, V] descending, and their token ids
  rank = jnp.arange(V)
  keep = (sampling.top_k == 0) | (rank < sampling.top_k)
  ranked = jnp.where(keep, ranked, -jnp.inf)
  probs = jax.nn.softmax(ranked, axis=-1)
  # A token stays while the mass before it is below top_p: the likeliest always does.
  keep = keep & (jnp.cumsum(probs, axis=-1) - probs < sampling.top_p)
  pick = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf), axis=-1)  # [B] ranks
  return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def check_prompt(prompt, max_new_tokens) -> None:
  """Raises ValueError unless `prompt` is a non-empty int array [B, P] and `max_new_tokens` an int >= 0."""
  if not hasattr(prompt, "shape") or not hasattr(prompt, "dtype") or np.ndim(prompt) != 2 or 0 in prompt.shape:
    raise ValueError(f"prompt must be a non-empty int array [B, P], got shape {getattr(prompt, 'shape', None)}.")
  if not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"prompt must hold integer token ids, got prompt.dtype={prompt.dtype}.")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be an int >= 0, got max_new_tokens={max_new_tokens!r}.")


def frozen_backends(backends) -> tuple | None:
  """A hashable copy of the per-op backend names (a ConfigDict is not), for a static jit argument."""
  if backends is None:
    return None
  names = list(backends.keys()) if hasattr(backends, "keys") else list(vars(backends))
  return tuple(sorted((name, str(getattr(backends, name))) for name in names))


def thawed_backends(frozen: tuple | None):
  """`frozen_backends`' names back as an object the layers read by attribute (None stays None)."""
  return None if frozen is None else types.SimpleNamespace(**dict(frozen))


def generate(model: nnx.Module, prompt: Int[Array, "B P"], max_new_tokens: int, *,
             backends=None, sampling: Sampling | None = None, seed: int = 0) -> Int[Array, "B P+N"]:
  """The prompt followed by `max_new_tokens` tokens, greedy (the argmax of the logits) by default.

  Position t's logits depend only on tokens before t (attention, selection and compression are all
  causal; routing is per token), so the token at t is predicted from the buffer with t onwards
  still zero, and the result equals decoding with the exact-length prefix at every step.

  Args:
    model: a decoder from `models.build` (or `convert.import_checkpoint`); it is not modified.
    prompt: int[B, P] token ids, P >= 1; every row is one document starting at position 0.
    max_new_tokens: N >= 0 tokens to append.
    backends: per-op backend names (`config.ops`); None means "auto" everywhere.
    sampling: how each token is chosen (`Sampling`); None is greedy.
    seed: the draws' PRNG seed (token t uses `fold_in(key(seed), t)`); unused when greedy.

  Returns:
    i32[B, P + N]: the prompt, then the generated tokens.

  Raises:
    ValueError: `prompt` is not a non-empty 2-D integer array, `max_new_tokens` is not an int >= 0,
      or a sampling value is out of range.
  """
  check_prompt(prompt, max_new_tokens)
  sampling = (Sampling() if sampling is None else sampling).check()
  B, P = prompt.shape
  tokens = jnp.zeros((B, P + max_new_tokens), jnp.int32).at[:, :P].set(jnp.asarray(prompt, jnp.int32))
  if max_new_tokens == 0:
    return tokens
  graphdef, state = nnx.split(model)
  values = None if sampling.greedy else sampling  # traced: one program for any values
  return _decode(graphdef, state, tokens, P, frozen_backends(backends), values, jax.random.key(seed))


@jax.jit(static_argnums=(0, 3, 4))
def _decode(graphdef, state, tokens, prompt_len, backends, sampling, key):
  model = nnx.merge(graphdef, state)
  backends = thawed_backends(backends)

  def next_token(t, tokens):
    h, _ = model.hidden_states(tokens, backends=backends)
    last = jax.lax.dynamic_slice_in_dim(h, t - 1, 1, axis=1)  # only the row that predicts t: [B, 1, D]
    return tokens.at[:, t].set(choose_tokens(model.logits(last)[:, 0], jax.random.fold_in(key, t), sampling))

  return jax.lax.fori_loop(prompt_len, tokens.shape[1], next_token, tokens)
