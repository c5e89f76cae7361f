"""Pure-jnp backends of `gated_delta_rule`: the chunked WY/UT form and the token-by-token baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _streaming as st


def _resets(segment_ids, B: int, T: int) -> jax.Array:
  """bool[B, T]: token t starts a new document (its state starts from zero); never at t = 0."""
  if segment_ids is None:
    return jnp.zeros((B, T), bool)
  return jnp.concatenate([jnp.zeros((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _grouped(q, k, v, g, beta):
  """f32 views with the value heads grouped by their q/k head: v head h reads q/k head h // R.

  q, k [B, T, Hk, Dk]; v [B, T, Hk, R, Dv]; g, beta [B, T, Hk, R].
  """
  B, T, Hk, _ = q.shape
  Hv = v.shape[2]
  f32 = lambda x: x.astype(jnp.float32)
  return (f32(q), f32(k), f32(v).reshape(B, T, Hk, Hv // Hk, -1), f32(g).reshape(B, T, Hk, Hv // Hk),
          f32(beta).reshape(B, T, Hk, Hv // Hk))


def _chunk_terms(xs, *, scale):
  """A chunk's state-independent terms: (w, u0, q_reach, scores, reach_last, k_last).

  With gam the within-chunk cumulative log decay, D[i, j] = exp(gam_i - gam_j) for j <= i of one
  document (else 0), and d_i = exp(gam_i) where the incoming state S0 still reaches i (no reset in
  the chunk up to i), the delta rule's written values u = beta * (v - decayed state^T k) satisfy
  (I + A) u = beta v - beta d k S0 with A[i, j] = beta_i D[i, j] <k_i, k_j> strictly below the
  diagonal: one unit-lower-triangular solve (the UT transform) replaces C sequential updates, and
  u = u0 - w S0 with [u0 | w] = (I + A)^-1 [beta v | beta d k]. Then out = (q d) S0 + (q k^T * D) u
  and the chunk's last state is d_C S0 + (k * D[C-1])^T u (`_chunk_step`).

  xs: q, k [B, Hk, C, Dk], v [B, Hk, R, C, Dv], g, beta [B, Hk, R, C], reset bool[B, C].
  """
  q, k, v, g, beta, reset = xs
  C = q.shape[2]
  gam = jnp.cumsum(g, axis=-1)
  run = jnp.cumsum(reset.astype(jnp.int32), axis=-1)  # tokens with equal counts share a document
  lower = jnp.tril(jnp.ones((C, C), bool))
  same_doc = (run[:, :, None] == run[:, None, :])[:, None, None] & lower  # [B, 1, 1, C, C]
  # Masked before the exp: above the diagonal gam_i - gam_j > 0 can overflow.
  decay = jnp.where(same_doc, jnp.exp(jnp.where(same_doc, gam[..., :, None] - gam[..., None, :], 0.0)), 0.0)
  reach = jnp.where((run == 0)[:, None, None], jnp.exp(gam), 0.0)  # [B, Hk, R, C]
  kk = jnp.einsum("bhcd,bhed->bhce", k, k)[:, :, None]  # [B, Hk, 1, C, C]
  system = jnp.eye(C) + jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), beta[..., :, None] * decay * kk, 0.0)
  rhs = jnp.concatenate([beta[..., None] * v, (beta * reach)[..., None] * k[:, :, None]], axis=-1)
  # A substitution, not an inverse from powers of the strictly lower part: with near-equal keys and
  # beta ~ 1 those powers reach binomial sizes and cancel catastrophically in f32 (a test holds this).
  solved = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
  Dv = v.shape[-1]
  qs = q * scale
  scores = jnp.einsum("bhcd,bhed->bhce", qs, k)[:, :, None] * decay  # [B, Hk, R, C, C]
  k_last = decay[..., -1, :, None] * k[:, :, None]  # [B, Hk, R, C, Dk]
  return solved[..., Dv:], solved[..., :Dv], qs[:, :, None] * reach[..., None], scores, reach[..., -1], k_last


def chunk_terms(q, k, v, g, beta, segment_ids, *, scale: float, chunk: int, chunk_axis: int = 0):
  """`_chunk_terms` of every chunk of `chunk` tokens (T padded with tokens that leave the state
  unchanged: beta = 0, g = 0), computed for all chunks at once.

  Arguments as `gated_delta_rule_reference`'s. Returns (w, u0, q_reach, scores, reach_last, k_last),
  f32, each with the chunk axis n at `chunk_axis` of [B, Hk, R, ...]: 0 gives the scan's
  [n, B, Hk, R, C, ...], 3 the head-major [B, Hk, R, n, C, ...] (reach_last [B, Hk, R, n]).
  """
  B, T = q.shape[:2]
  C = chunk
  resets = _resets(segment_ids, B, T)
  qf, kf, vf, gf, bf = _grouped(q, k, v, g, beta)
  # [n, B, Hk, (R,) C, ...]: the chunk axis leads for the vmap, heads before the chunk's tokens.
  blocks = lambda x: jnp.moveaxis(st.to_blocks(x, 1, C), 2, -1)  # [n, B, Hk, R, C]
  q_heads = lambda x: jnp.swapaxes(st.to_blocks(x, 1, C), 2, 3)  # [n, B, Hk, C, Dk]
  v_heads = lambda x: jnp.moveaxis(st.to_blocks(x, 1, C), 2, 4)  # [n, B, Hk, R, C, Dv]
  xs = (q_heads(qf), q_heads(kf), v_heads(vf), blocks(gf), blocks(bf), st.to_blocks(resets, 1, C))
  return jax.vmap(lambda x: _chunk_terms(x, scale=scale), out_axes=chunk_axis)(xs)


def _chunk_step(state, terms):
  """(state after the chunk, out f32[B, Hk, R, C, Dv]) from the state before it [B, Hk, R, Dk, Dv]."""
  w, u0, q_reach, scores, reach_last, k_last = terms
  u = u0 - w @ state
  out = q_reach @ state + scores @ u
  return reach_last[..., None, None] * state + jnp.swapaxes(k_last, -1, -2) @ u, out


def gated_delta_rule_reference(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B T"] | None = None,
    initial_state: Float[Array, "B Hv Dk Dv"] | None = None,
    chunk: int = 64,
) -> tuple[Float[Array, "B T Hv Dv"], Float[Array, "B Hv Dk Dv"]]:
  """The gated delta rule chunk by chunk (WY/UT form), a `lax.scan` over chunks of `chunk` tokens.

  The state-independent terms of every chunk (the UT solve, the intra-chunk scores) are computed
  for all chunks at once; the scan over chunks then does three matmuls per chunk. Memory is O(T):
  [C, C] matrices per chunk and head ([T, C] per head, never [T, T]) and one f32 state per chunk,
  which the backward pass keeps. T is padded to a multiple of `chunk` with tokens that leave the
  state unchanged (beta = 0, g = 0).
  Arguments as `gated_delta_rule`'s; returns (out [B, T, Hv, Dv] in q.dtype, final state f32).
  """
  B, T, Hk, Dk = q.shape
  Hv, Dv = v.shape[2:]
  if initial_state is None:
    state = jnp.zeros((B, Hk, Hv // Hk, Dk, Dv), jnp.float32)
  else:
    state = initial_state.astype(jnp.float32).reshape(B, Hk, Hv // Hk, Dk, Dv)
  # Everything that does not read the state, for all chunks at once (batched solves and matmuls);
  # the scan then carries the state through three matmuls per chunk.
  terms = chunk_terms(q, k, v, g, beta, segment_ids, scale=scale, chunk=min(chunk, T))
  state, out = jax.lax.scan(_chunk_step, state, terms)  # out [n, B, Hk, R, C, Dv]
  out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, -1, Hv, Dv)[:, :T]
  return out.astype(q.dtype), state.reshape(B, Hv, Dk, Dv)


def gated_delta_rule_xla_baseline(q, k, v, g, beta, *, scale, segment_ids=None, initial_state=None, chunk=64):
  """The recurrence one token at a time (`lax.scan` over T); same arguments and result as the reference.

  S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  out_t = S^T (scale q_t), with S zeroed
  where a document starts. Its backward keeps a [Hv, Dk, Dv] state per token: short lengths only.
  """
  del chunk
  B, T, Hk, Dk = q.shape
  Hv, Dv = v.shape[2:]
  qf, kf, vf, gf, bf = _grouped(q, k, v, g, beta)
  resets = _resets(segment_ids, B, T)

  def step(state, xs):
    q_t, k_t, v_t, g_t, b_t, reset = xs  # [B, Hk, Dk] x2, [B, Hk, R, Dv], [B, Hk, R] x2, [B]
    state = jnp.where(reset[:, None, None, None, None], 0.0, state) * jnp.exp(g_t)[..., None, None]
    delta = b_t[..., None] * (v_t - jnp.einsum("bhd,bhrde->bhre", k_t, state))
    state = state + jnp.einsum("bhd,bhre->bhrde", k_t, delta)
    return state, jnp.einsum("bhd,bhrde->bhre", q_t * scale, state)

  if initial_state is None:
    state = jnp.zeros((B, Hk, Hv // Hk, Dk, Dv), jnp.float32)
  else:
    state = initial_state.astype(jnp.float32).reshape(B, Hk, Hv // Hk, Dk, Dv)
  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  state, out = jax.lax.scan(step, state, tuple(map(time_major, (qf, kf, vf, gf, bf, resets))))
  return jnp.moveaxis(out, 0, 1).reshape(B, T, Hv, Dv).astype(q.dtype), state.reshape(B, Hv, Dk, Dv)
