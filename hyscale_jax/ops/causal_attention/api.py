"""`causal_attention`: dense causal softmax attention (GQA/MQA, packed segments) without [T, T] arrays."""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _checks, _context
from hyscale_jax.ops._registry import Backend, BackendRegistry
from hyscale_jax.ops.causal_attention.reference import (
    attend_with_saved_residuals,
    causal_attention_reference,
    causal_attention_xla_baseline,
)

REGISTRY = BackendRegistry(
    "causal_attention",
    {"reference": causal_attention_reference, "xla_baseline": causal_attention_xla_baseline},
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)
# JAX's Triton flash-attention kernel (forward and backward), behind the shared residual-saving vjp.
REGISTRY.register_optional(
    "pallas", "pallas_kernels.causal_attention",
    ("causal_attention_forward_pallas", "causal_attention_backward_pallas"),
    wrap=lambda forward, backward: functools.partial(attend_with_saved_residuals, forward, backward),
    kernel="JAX's Triton flash attention")


def causal_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    compress_ratio: int = 1,
    return_lse: bool | Literal["detached"] = False,
    backend: Backend = "auto",
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
  """Softmax attention of each token over every earlier token (itself included) of its segment.

  With `compress_ratio` m > 1 the keys are compressed entries, key s standing for tokens
  [s*m, (s+1)*m): token t sees key s iff `(s + 1) * m <= t + 1` (the whole block is in its past),
  `ops.flash_topk`'s visibility; this is DeepSeek-V4's HCA (and the dense CSA warm-up) attending to
  every visible entry. `return_lse=True` also returns the softmax's log-denominator, differentiable,
  so a caller can merge this softmax with another (a sliding window, sinks) into one.

  Query head n reads key/value head `n // (N // K)` (K = 1 is MQA). Logits, softmax and the value
  sum are f32; the output is in q's dtype. Differentiable in q, k and v. The `reference` and
  `pallas` backends stream over key blocks (flash attention): no [T, T] array in the forward or
  the backward, which recomputes the probabilities from the saved `out` and `lse` (tagged
  `remat.ATTENTION_OUT` / `remat.ATTENTION_LSE`, so `"selection_replay"` keeps them).
  `xla_baseline` builds the [B, N, T, T] logits (the old warm-up path; short lengths only).

  Under a mesh with a `context` axis (`jax.set_mesh`), the queries are split over it and k, v
  all-gathered, as in `sparse_attention`.

  Args:
    q: bf16|f32[B, T, N, H] queries.
    k: bf16|f32[B, S, K, H] keys; S = T when compress_ratio is 1.
    v: bf16|f32[B, S, K, Hv] values (may be k itself: K = V).
    scale: logit scale (static Python float).
    segment_ids: int[B, T] document ids (nothing attends across them; only when S = T), or a pair
      (q_seg int[B, T], kv_seg int[B, S]) (query t sees key s when q_seg[t] == kv_seg[s]), or None
      (one document).
    compress_ratio: tokens per key (static positive int): 1 for token keys, m for compressed entries.
    return_lse: also return lse: True, differentiable (its cotangent flows into q, k; the `pallas`
      backend declines it); "detached", under `stop_gradient` (every backend: a teacher's LSE, as the
      dense indexer KL reads it).
    backend: "auto" (on GPU "pallas", then "reference"), "pallas", "reference" or "xla_baseline".

  Returns:
    out [B, T, N, Hv] in q.dtype, or (out, lse f32[B, T, N]) with `return_lse`. A query that sees
    no key (with a pair of segment ids, or compressed keys) gets out 0, lse -inf and zero
    gradients; never NaN.

  Raises:
    ValueError: on a wrong rank, mismatched batch/length/head/dim sizes, N not divisible by K,
      non-float inputs, non-integer segment ids or a compress_ratio that is not a positive int.
  """
  q_seg, kv_seg = _check_args(q, k, v, scale, segment_ids, compress_ratio)
  names = REGISTRY.candidates(backend)
  if return_lse not in (False, True, "detached"):
    raise ValueError(f"return_lse={return_lse!r} must be False, True or 'detached'.")
  # A detached lse has no cotangent: backends that cannot take one serve it (`attend_with_saved_residuals`).
  kwargs = dict(scale=float(scale), compress_ratio=int(compress_ratio), return_lse=return_lse)

  def attend(row_offset, local, full, replicated):
    del replicated
    (q, q_seg), (k, v, kv_seg) = local, full
    segments = None if q_seg is None else (q_seg, kv_seg)
    result = REGISTRY.run(names, q, k, v, q_offset=row_offset, segment_ids=segments, **kwargs)
    if return_lse == "detached":
      return result[0], jax.lax.stop_gradient(result[1])
    return result

  mesh = _context.context_mesh()
  if mesh is None:
    return attend(0, (q, q_seg), (k, v, kv_seg), ())
  # Context parallelism: this device's queries against all-gathered keys and values.
  return _context.run_sequence_sharded(attend, mesh, sharded=(q, q_seg), gathered=(k, v, kv_seg),
                                       n_out=2 if return_lse else 1)


def _check_args(q, k, v, scale, segment_ids, compress_ratio):
  """Validates the call; returns (q_seg, kv_seg), the same array twice for a single [B, T] array."""
  _checks.check_rank("q", q, 4, "B, T, N, H")
  _checks.check_rank("k", k, 4, "B, S, K, H")
  _checks.check_rank("v", v, 4, "B, S, K, Hv")
  for name, x in (("q", q), ("k", k), ("v", v)):
    _checks.check_float(name, x)
  _checks.check_positive_int("compress_ratio", compress_ratio)
  B, T, N, H = q.shape
  S = k.shape[1] if compress_ratio != 1 else T  # token keys: one per query position
  if k.shape[:2] != (B, S) or k.shape[3] != H:
    raise ValueError(f"k.shape={tuple(k.shape)} must be [B, S, K, H] with (B, H)={(B, H)} from {q.shape=} "
                     f"(S = T = {T} when compress_ratio is 1).")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v.shape={tuple(v.shape)} must match k.shape={tuple(k.shape)} in [B, T, K].")
  if N % k.shape[2]:
    raise ValueError(f"q heads N={N} must be divisible by k heads K={k.shape[2]} ({q.shape=}, {k.shape=}).")
  _checks.check_static_float("scale", scale)
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    _checks.check_segment_ids(segment_ids, B, T, S)
    return tuple(segment_ids)
  _checks.check_rank("segment_ids", segment_ids, 2, "B, T")
  _checks.check_int("segment_ids", segment_ids)
  if tuple(segment_ids.shape) != (B, T):
    raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} must be [B, T]={(B, T)} from {q.shape=}.")
  if S != T:
    raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)}: one array needs S = T, but "
                     f"k.shape={tuple(k.shape)}; pass (q_seg [B, T], kv_seg [B, S]).")
  return segment_ids, segment_ids
