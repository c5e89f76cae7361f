"""The custom_vjp glue every sparse-attention backend shares: forward once, residuals saved by name."""

from __future__ import annotations

import functools

import jax

from hyscale_jax import remat


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attach_backward(backward, scale, deterministic, q, k, v, indices, sinks, out, lse):
  del backward, scale, deterministic, q, k, v, indices, sinks
  return out, lse


def _attach_backward_fwd(backward, scale, deterministic, q, k, v, indices, sinks, out, lse):
  return (out, lse), (q, k, v, indices, sinks, out, lse)


def _attach_backward_bwd(backward, scale, deterministic, residuals, cotangents):
  # Only a deterministic call passes the option: backwards without it (causal_attention's) never see it.
  option = {"deterministic": True} if deterministic else {}
  dq, dk, dv, dsinks = backward(residuals, cotangents, scale=scale, **option)
  return dq, dk, dv, None, dsinks, None, None


_attach_backward.defvjp(_attach_backward_fwd, _attach_backward_bwd)


def attention_with_saved_residuals(forward, backward, q, k, v, indices, *, scale, sinks=None, value_dim=None,
                                   deterministic=False):
  """Runs `forward` once, tags (out, lse) for remat, and differentiates through `backward`.

  The forward runs outside any custom_vjp rule, on detached inputs, and its outputs are named
  `remat.ATTENTION_OUT` / `remat.ATTENTION_LSE` right there. The custom_vjp that follows takes
  them as plain inputs and keeps them (with `indices`) as its residuals, so the
  `"selection_replay"` policy saves exactly what the backward reads and never reruns `forward`.

  With `v=None` (values = `k[..., :value_dim]`) the forward is called with `v=None, value_dim=...`,
  and the backward sees `v=None` in the residuals and returns the value gradient inside dk (dv None).

  Args:
    forward: `(q, k, v, indices, *, scale, sinks[, value_dim]) -> (out, lse)`.
    backward: `((q, k, v, indices, sinks, out, lse), (dout, dlse), *, scale[, deterministic])
      -> (dq, dk, dv, dsinks)`.
    deterministic: if True, `backward` gets `deterministic=True` (bit-identical dk/dv run to run).
  """
  detached = jax.lax.stop_gradient((q, k, v, sinks))
  value_kw = {"value_dim": value_dim} if v is None else {}
  out, lse = forward(*detached[:3], indices, scale=scale, sinks=detached[3], **value_kw)
  out, lse = remat.tag(out, remat.ATTENTION_OUT), remat.tag(lse, remat.ATTENTION_LSE)
  return _attach_backward(backward, scale, deterministic, q, k, v, indices, sinks, out, lse)
