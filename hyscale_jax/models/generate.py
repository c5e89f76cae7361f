"""Greedy decoding with any model `models.build` returns: notebooks, the HF importer's users, smoke checks.

No KV cache: each new token reruns the forward pass over a fixed [B, P + N] buffer, so one
compilation serves every step. That is quadratic in the length and meant for short continuations
of small models, not for serving.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int


def generate(model: nnx.Module, prompt: Int[Array, "B P"], max_new_tokens: int, *,
             backends=None) -> Int[Array, "B P+N"]:
  """The prompt followed by `max_new_tokens` greedily chosen tokens (argmax of the logits).

  Position t's logits depend only on tokens before t (attention, selection and compression are all
  causal; routing is per token), so the token at t is predicted from the buffer with t onwards
  still zero, and the result equals decoding with the exact-length prefix at every step.

  Args:
    model: a decoder from `models.build` (or `convert.import_checkpoint`); it is not modified.
    prompt: int[B, P] token ids, P >= 1; every row is one document starting at position 0.
    max_new_tokens: N >= 0 tokens to append.
    backends: per-op backend names (`config.ops`); None means "auto" everywhere.

  Returns:
    i32[B, P + N]: the prompt, then the generated tokens.

  Raises:
    ValueError: `prompt` is not a non-empty 2-D integer array, or `max_new_tokens` is not an int >= 0.
  """
  if not hasattr(prompt, "shape") or not hasattr(prompt, "dtype") or np.ndim(prompt) != 2 or 0 in prompt.shape:
    raise ValueError(f"prompt must be a non-empty int array [B, P], got shape {getattr(prompt, 'shape', None)}.")
  if not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"prompt must hold integer token ids, got prompt.dtype={prompt.dtype}.")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be an int >= 0, got max_new_tokens={max_new_tokens!r}.")
  B, P = prompt.shape
  tokens = jnp.zeros((B, P + max_new_tokens), jnp.int32).at[:, :P].set(jnp.asarray(prompt, jnp.int32))
  if max_new_tokens == 0:
    return tokens
  graphdef, state = nnx.split(model)
  # A hashable copy of the backend names (a ConfigDict is not), read back by attribute in the layers.
  names = None if backends is None else tuple(sorted((k, str(getattr(backends, k))) for k in _op_names(backends)))
  return _decode(graphdef, state, tokens, P, names)


def _op_names(backends) -> list[str]:
  return list(backends.keys()) if hasattr(backends, "keys") else list(vars(backends))


@jax.jit(static_argnums=(0, 3, 4))
def _decode(graphdef, state, tokens, prompt_len, backends):
  model = nnx.merge(graphdef, state)
  backends = None if backends is None else types.SimpleNamespace(**dict(backends))

  def next_token(t, tokens):
    h, _ = model.hidden_states(tokens, backends=backends)
    last = jax.lax.dynamic_slice_in_dim(h, t - 1, 1, axis=1)  # only the row that predicts t: [B, 1, D]
    return tokens.at[:, t].set(jnp.argmax(model.logits(last)[:, 0], axis=-1).astype(jnp.int32))

  return jax.lax.fori_loop(prompt_len, tokens.shape[1], next_token, tokens)
