"""The `pallas` backend's glue: XLA's chunk terms, the kernels' inter-chunk pass, one custom_vjp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hyscale_jax.ops.gated_delta_rule.reference import chunk_terms


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _scan(scan_fwd, scan_bwd, chunk, terms, state0):
  out, _, final = scan_fwd(terms, state0, chunk=chunk)
  return out, final


def _scan_fwd(scan_fwd, scan_bwd, chunk, terms, state0):
  out, states, final = scan_fwd(terms, state0, chunk=chunk)
  return (out, final), (terms, states)


def _scan_bwd(scan_fwd, scan_bwd, chunk, residuals, cotangents):
  """The kernel's reverse pass gives du and the state cotangents per chunk; every other term's
  cotangent is a product of those with the saved states, batched over the chunks here."""
  terms, states = residuals  # states [BH, n, Dk, Dv] before each chunk
  dout, dfinal = cotangents
  w, u0, _, _, reach_last, _ = terms
  du, dstates, dstate0 = scan_bwd(terms, dout, dfinal, chunk=chunk)  # dstates: after each chunk
  BH, n = reach_last.shape
  per_chunk = lambda x: x.reshape(BH, n, chunk, x.shape[-1])  # [BH, n, C, ...]
  flat = lambda x: x.reshape(BH, n * chunk, x.shape[-1])
  mm = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
  t = lambda x: jnp.swapaxes(x, -1, -2)
  dout_c, du_c = per_chunk(dout.astype(jnp.float32)), per_chunk(du)
  u = per_chunk(u0) - mm(per_chunk(w), states)  # the forward's written values, recomputed
  d_w = -mm(du_c, t(states))
  d_q_reach = mm(dout_c, t(states))
  d_scores = mm(dout_c, t(u))
  d_k_last = mm(u, t(dstates))
  d_reach_last = jnp.sum(states * dstates, axis=(-2, -1))
  return (tuple(map(flat, (d_w, du_c, d_q_reach, d_scores))) + (d_reach_last, flat(d_k_last)), dstate0)


_scan.defvjp(_scan_fwd, _scan_bwd)


def gated_delta_rule_with_scan_kernels(scan_fwd, scan_bwd, check_applies, q, k, v, g, beta, *, scale,
                                       segment_ids=None, initial_state=None, chunk=64):
  """`gated_delta_rule_reference`'s chunked form with its `lax.scan` over chunks replaced by kernels.

  Each chunk's WY/UT terms come from the reference's `chunk_terms` (XLA, all chunks at once, in
  head-major order), the pass over the chunks from `scan_fwd`, and its backward from `scan_bwd`
  under one custom_vjp, which saves the terms and the state before each chunk (f32[B Hv, n, Dk,
  Dv], as the reference's scan does). The terms' own backward (the triangular solve's) is XLA's
  autodiff of `chunk_terms`. T is padded to a multiple of `chunk` (the reference uses
  min(chunk, T) when T is shorter), so a short T costs a whole chunk.

  Args:
    scan_fwd, scan_bwd: `pallas_kernels.gated_delta_rule`'s `gated_delta_rule_scan_{fwd,bwd}`.
    check_applies: `(chunk, Dk, Dv)` -> None, or NotImplementedError where the kernels do not apply.
    q, k, v, g, beta, scale, segment_ids, initial_state, chunk: as `gated_delta_rule_reference`'s.

  Returns:
    (out [B, T, Hv, Dv] in q.dtype, final state f32[B, Hv, Dk, Dv]).
  """
  B, T, _, Dk = q.shape
  Hv, Dv = v.shape[2:]
  check_applies(chunk, Dk, Dv)
  terms = chunk_terms(q, k, v, g, beta, segment_ids, scale=scale, chunk=chunk, chunk_axis=3)
  # [B, Hk, R, n, C, X] -> [B Hv, n C, X] (value head h = hk R + r); reach_last [B, Hk, R, n] -> [B Hv, n].
  terms = tuple(x.reshape(B * Hv, -1) if x.ndim == 4 else x.reshape(B * Hv, -1, x.shape[-1]) for x in terms)
  if initial_state is None:
    state0 = jnp.zeros((B * Hv, Dk, Dv), jnp.float32)
  else:
    state0 = initial_state.astype(jnp.float32).reshape(B * Hv, Dk, Dv)
  out, final = _scan(scan_fwd, scan_bwd, chunk, terms, state0)  # [B Hv, n C, Dv], [B Hv, Dk, Dv]
  out = jnp.swapaxes(out.reshape(B, Hv, -1, Dv), 1, 2)[:, :T]  # [B, T, Hv, Dv]
  return out.astype(q.dtype), final.reshape(B, Hv, Dk, Dv)
