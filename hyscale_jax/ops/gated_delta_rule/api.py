"""`gated_delta_rule`: Gated DeltaNet's linear-attention recurrence, chunked, with packed documents."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _checks, _context
from hyscale_jax.ops._registry import Backend, BackendRegistry
from hyscale_jax.ops.gated_delta_rule.reference import gated_delta_rule_reference, gated_delta_rule_xla_baseline
from hyscale_jax.ops.gated_delta_rule.scan_vjp import gated_delta_rule_with_scan_kernels
from hyscale_jax.sharding import CONTEXT_AXIS

REGISTRY = BackendRegistry(
    "gated_delta_rule",
    {"reference": gated_delta_rule_reference, "xla_baseline": gated_delta_rule_xla_baseline},
    # "pallas" first on GPU: measured faster than the reference on XLA, forward and backward, at the
    # Qwen3.8-Flash-Next shape (docs/kernels/gated_delta_rule.md).
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)
# The reference's chunk terms with the pass over the chunks in Triton kernels (forward and backward).
REGISTRY.register_optional(
    "pallas", "pallas_kernels.gated_delta_rule",
    ("gated_delta_rule_scan_fwd", "gated_delta_rule_scan_bwd", "check_applies"),
    wrap=lambda fwd, bwd, check: functools.partial(gated_delta_rule_with_scan_kernels, fwd, bwd, check),
    kernel="Triton pass over the chunks, XLA chunk terms")


def gated_delta_rule(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    initial_state: Float[Array, "B Hv Dk Dv"] | None = None,
    scale: float | None = None,
    chunk: int = 64,
    return_final_state: bool = False,
    backend: Backend = "auto",
) -> Float[Array, "B T Hv Dv"] | tuple[Float[Array, "B T Hv Dv"], Float[Array, "B Hv Dk Dv"]]:
  """The gated delta rule (Gated DeltaNet, Yang et al. 2024) over each packed document.

  Per value head, with the state S f32[Dk, Dv] (zero at each document's first token, or
  `initial_state` for the first document of a row), token by token:

      S <- exp(g_t) S
      S <- S + beta_t k_t (v_t - S^T k_t)^T      (the delta rule: write the prediction's error)
      out_t = S^T (scale q_t)

  Value head h reads q/k head h // (Hv // Hk) (grouped value heads, as transformers' qwen4_exp).
  q and k are used as given: Gated DeltaNet L2-normalises them before the call. All arithmetic is
  f32; out is in q's dtype. Differentiable in q, k, v, g, beta and initial_state.

  The `reference` computes it `chunk` tokens at a time in the WY/UT form of flash-linear-attention
  (one triangular solve per chunk, a `lax.scan` over chunks): O(T) memory, no [T, T] array.
  `xla_baseline` is the token-by-token recurrence (short lengths: its backward keeps T states).

  Under a mesh with a `context` axis (`jax.set_mesh`), each device runs its contiguous part of the
  sequence; the state crosses the shards in order (each shard's affine state map is composed
  across the shards before it), so the result is the single-device one.

  Args:
    q: bf16|f32[B, T, Hk, Dk] queries.
    k: bf16|f32[B, T, Hk, Dk] keys (unit norm for the delta rule to be stable).
    v: bf16|f32[B, T, Hv, Dv] values; Hv a multiple of Hk.
    g: f32[B, T, Hv] log decay per token (<= 0; 0 keeps the state, -inf would forget it).
    beta: bf16|f32[B, T, Hv] write strength per token, usually in (0, 1).
    segment_ids: int[B, T] packed-document ids (the state resets where the id changes), or None.
    initial_state: f32[B, Hv, Dk, Dv] state before token 0 (zeros when None).
    scale: query scale (static float); None means Dk ** -0.5.
    chunk: tokens per chunk of the reference (static positive int); T need not be a multiple.
    return_final_state: also return the state after the last token.
    backend: "auto" ("pallas" then "reference" on a GPU, "reference" elsewhere), "pallas" (Triton
      kernels for the pass over the chunks; interpret mode off a GPU; chunk, Dk and Dv powers of two
      >= 16), "reference" or "xla_baseline".

  Returns:
    out [B, T, Hv, Dv] in q.dtype, or (out, final state f32[B, Hv, Dk, Dv]) with `return_final_state`.

  Raises:
    ValueError: on a wrong rank, mismatched sizes, Hv not a multiple of Hk, a non-float input,
      non-integer segment ids, a bad chunk or scale.
  """
  _check_args(q, k, v, g, beta, segment_ids, initial_state, scale, chunk)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  run = functools.partial(REGISTRY.run, REGISTRY.candidates(backend), scale=scale, chunk=int(chunk))
  mesh = _context.context_mesh()
  if mesh is None:
    out, state = run(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state)
  else:
    out, state = _context_parallel(run, mesh, q, k, v, g, beta, segment_ids, initial_state)
  return (out, state) if return_final_state else out


def _context_parallel(run, mesh, q, k, v, g, beta, segment_ids, initial_state):
  """Each `context` shard runs its rows; the state enters shard i composed over shards 0..i-1.

  A shard's final state is affine in its incoming state, S_out = M S_in + N (M [Dk, Dk]): one run
  of the shard from state [I | 0] with values [0 | v] gives [M | N]. The maps are all-gathered and
  composed in shard order (zeroing S_in where a document starts at the shard's first token), and
  the shard reruns its rows from its incoming state for the output.
  """
  B, _, Hv, Dv = v.shape
  Dk = q.shape[-1]
  batch = tuple(a for a in _context.token_axes(mesh) if a != CONTEXT_AXIS) or None
  rows, per_row = P(batch, CONTEXT_AXIS), P(batch)
  if initial_state is None:
    initial_state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
  if segment_ids is None:
    segment_ids = jnp.zeros(q.shape[:2], jnp.int32)

  def shard(q, k, v, g, beta, seg, s0):
    b, t = q.shape[:2]
    eye = jnp.broadcast_to(jnp.eye(Dk, dtype=jnp.float32), (b, Hv, Dk, Dk))
    v_ext = jnp.concatenate([jnp.zeros((b, t, Hv, Dk), v.dtype), v], axis=-1)
    s_ext = jnp.concatenate([eye, jnp.zeros((b, Hv, Dk, Dv), jnp.float32)], axis=-1)
    _, maps = run(q, k, v_ext, g, beta, segment_ids=seg, initial_state=s_ext)
    gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS)
    maps, first, last = gather(maps), gather(seg[:, 0]), gather(seg[:, -1])  # [n, b, ...], [n, b] x2
    n, me = maps.shape[0], jax.lax.axis_index(CONTEXT_AXIS)
    carried = jnp.concatenate([jnp.ones((1, b), bool), first[1:] == last[:-1]])  # [n, b]
    entering, state = s0.astype(jnp.float32), s0.astype(jnp.float32)
    for j in range(n):
      state = jnp.where(carried[j][:, None, None, None], state, 0.0)
      entering = jnp.where(j == me, state, entering)
      state = maps[j, ..., :Dk] @ state + maps[j, ..., Dk:]
    out, _ = run(q, k, v, g, beta, segment_ids=seg, initial_state=entering)
    return out, state

  return jax.shard_map(shard, mesh=mesh, in_specs=(rows,) * 6 + (per_row,), out_specs=(rows, per_row),
                       check_vma=False)(q, k, v, g, beta, segment_ids, initial_state)


def _check_args(q, k, v, g, beta, segment_ids, initial_state, scale, chunk):
  _checks.check_rank("q", q, 4, "B, T, Hk, Dk")
  _checks.check_rank("k", k, 4, "B, T, Hk, Dk")
  _checks.check_rank("v", v, 4, "B, T, Hv, Dv")
  _checks.check_rank("g", g, 3, "B, T, Hv")
  _checks.check_rank("beta", beta, 3, "B, T, Hv")
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    _checks.check_float(name, x)
  B, T, Hk, Dk = q.shape
  Hv, Dv = v.shape[2:]
  if k.shape != q.shape:
    raise ValueError(f"k.shape={tuple(k.shape)} must equal q.shape={tuple(q.shape)} [B, T, Hk, Dk].")
  if v.shape[:2] != (B, T) or Hv % Hk:
    raise ValueError(f"v.shape={tuple(v.shape)} must be [B, T, Hv, Dv] with (B, T)={(B, T)} from {q.shape=} "
                     f"and Hv a multiple of Hk={Hk}.")
  for name, x in (("g", g), ("beta", beta)):
    if tuple(x.shape) != (B, T, Hv):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B, T, Hv]={(B, T, Hv)} from {v.shape=}.")
  if segment_ids is not None:
    _checks.check_rank("segment_ids", segment_ids, 2, "B, T")
    _checks.check_int("segment_ids", segment_ids)
    if tuple(segment_ids.shape) != (B, T):
      raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} must be [B, T]={(B, T)} from {q.shape=}.")
  if initial_state is not None:
    _checks.check_rank("initial_state", initial_state, 4, "B, Hv, Dk, Dv")
    _checks.check_float("initial_state", initial_state)
    if tuple(initial_state.shape) != (B, Hv, Dk, Dv):
      raise ValueError(f"initial_state.shape={tuple(initial_state.shape)} must be [B, Hv, Dk, Dv]="
                       f"{(B, Hv, Dk, Dv)} from {q.shape=}, {v.shape=}.")
  _checks.check_positive_int("chunk", chunk)
  if scale is not None:
    _checks.check_static_float("scale", scale)
