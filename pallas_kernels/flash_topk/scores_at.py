"""The lightning-indexer score at listed keys, with its gradient, in Pallas (Triton style).

`index_scores_at_pallas(q, k, weights, indices, scale)` is `ops.flash_topk`'s score
`scale * sum_h w[t,h] * relu(<q[t,h], k[s]>)` at `s = indices[t, j]` (clamped into [0, S)): the
student side of the DSA indexer loss, the Pallas twin of
`hyscale_jax.ops.flash_topk.reference.index_scores_at`. XLA's version gathers a [T, K, D] copy of
the selected key rows (f32, so that its transpose adds in f32) and its backward scatter-adds a
[T, K, D] f32 array, most of the indexer loss's time at GLM-5.1's shapes (docs/kernels/indexer_loss.md).
Here one program per token walks its K selections `block_k` at a time and gathers
each block of key rows once, into registers:

- forward: `[H, D] x [D, block_k]` on the tensor cores, ReLU, head weights, the head sum in f32:
  writes the row's K scores.
- backward (`jax.custom_vjp`): from the cotangent g [K], recomputes the dots and forms
  `ds = scale * g * w * (dot > 0)`; `dq += ds @ k_rows` and `dw += scale * sum_j g relu(dot)` stay in
  registers; `dk` rows `ds^T @ q` are added into an f32 accumulator with relaxed atomics, one row
  per selected entry whose g is nonzero (adding a zero row changes nothing, so the loss's masked
  entries cost no atomics). Atomic order varies run to run on the GPU, as in the sparse-attention
  backward.

Precision: the dots are bf16 (or f32) products with f32 accumulation, as in the main pass; the
backward rounds ds to q's dtype for the tensor cores, as the sparse-attention backward does.
Triton wants power-of-two blocks and matmul dims >= 16: heads are padded with weight 0, the head
dim with zeros, the selections to a multiple of `block_k` with entries whose g is 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shapes import next_power_of_two
from pallas_kernels._relaxed_atomics import scatter_add_rows

_HIGHEST = jax.lax.Precision.HIGHEST


def _dots(a, b, precise):
  """f32 [rows of a, rows of b]: each row of `a` dotted with each row of `b` (q [heads, D] with the
  gathered key rows [block_k, D] gives [heads, block_k]; the other way round, keys as rows)."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=_HIGHEST if precise else None)


def _rows(idx_ref, k_ref, j, block_k):
  """The j-th block of selected key rows [block_k, D] and their clamped indices."""
  safe = jnp.clip(idx_ref[pl.ds(j * block_k, block_k)], 0, k_ref.shape[0] - 1)
  return k_ref[safe, :], safe


def _forward_kernel(q_ref, k_ref, w_ref, idx_ref, *refs, scale, block_k, precise, keys_as_rows=False):
  # q [heads, D], k [S, D], w [heads] f32, indices [K_pad], then the row's length [1] when given
  # -> out [K_pad] f32 (past the length: unwritten).
  *len_ref, out_ref = refs
  q, w = q_ref[...], w_ref[...]

  def step(j, carry):
    rows, _ = _rows(idx_ref, k_ref, j, block_k)
    if keys_as_rows:  # [block_k, heads]: the head sum along the accumulator's columns, within threads
      score = (jnp.maximum(_dots(rows, q, precise), 0.0) * w[None, :]).sum(axis=1)
    else:
      score = (jnp.maximum(_dots(q, rows, precise), 0.0) * w[:, None]).sum(axis=0)
    out_ref[pl.ds(j * block_k, block_k)] = score * scale
    return carry

  n_steps = idx_ref.shape[0] // block_k
  if len_ref:
    n_steps = jnp.minimum(n_steps, (len_ref[0][0] + block_k - 1) // block_k)
  jax.lax.fori_loop(0, n_steps, step, 0)


def _backward_kernel(q_ref, k_ref, w_ref, idx_ref, g_ref, dk_in_ref, dq_ref, dw_ref, dk_ref, *, scale, block_k,
                     precise, interpret):
  # q [heads, D], k [S, D], w [heads] f32, indices [K_pad], g [K_pad] f32, then the aliased f32 dk
  # accumulator [S, D]. Outputs: dq [heads, D] f32, dw [heads] f32, dk [S, D] f32.
  del dk_in_ref  # the same buffer as dk_ref
  q, w = q_ref[...], w_ref[...]

  def step(j, carry):
    dq, dw = carry
    rows, safe = _rows(idx_ref, k_ref, j, block_k)
    g = g_ref[pl.ds(j * block_k, block_k)] * scale
    dots = _dots(q, rows, precise)
    dw = dw + jnp.sum(jnp.maximum(dots, 0.0) * g[None, :], axis=1)
    ds = jnp.where(dots > 0.0, w[:, None] * g[None, :], 0.0)  # [heads, block_k]; relu'(0) = 0
    dq = dq + jax.lax.dot_general(ds.astype(rows.dtype), rows, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32, precision=_HIGHEST if precise else None)
    dk = jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=_HIGHEST if precise else None)  # [block_k, D]
    scatter_add_rows(dk_ref, safe, g != 0.0, dk, interpret)
    return dq, dw

  heads, dim = q.shape
  dq, dw = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, step,
                             (jnp.zeros((heads, dim), jnp.float32), jnp.zeros((heads,), jnp.float32)))
  dq_ref[...] = dq
  dw_ref[...] = dw


def _padded(q, k, weights, indices, block_k, interpret):
  """Power-of-two heads (weight 0) and head dim (zeros), selections padded to block_k with index 0."""
  B, T, H, D = q.shape
  heads, dim = next_power_of_two(H), max(16, next_power_of_two(D))
  if not interpret:
    heads = max(heads, 16)  # tl.dot needs every matmul dim >= 16
  K = indices.shape[-1]
  block_k = min(block_k, max(16, next_power_of_two(K)))
  K_pad = -(-K // block_k) * block_k
  w = jnp.ones((B, T, H), jnp.float32) if weights is None else weights.astype(jnp.float32)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, heads - H), (0, dim - D)))
  k = jnp.pad(k, ((0, 0), (0, 0), (0, dim - D)))
  w = jnp.pad(w, ((0, 0), (0, 0), (0, heads - H)))
  indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, K_pad - K)))
  return q, k, w, indices, block_k


def _specs(k):
  """(token(*shape): the BlockSpec of one token's [*shape] block on grid (B, T), the BlockSpec of the
  batch's whole [S, D] key slab)."""
  token = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, t: (b, t) + (0,) * len(shape))
  return token, pl.BlockSpec((None, *k.shape[1:]), lambda b, t: (b, 0, 0))


def _resolve_interpret(interpret):
  return jax.default_backend() != "gpu" if interpret is None else interpret


def _forward(q, k, weights, indices, scale, block_k, num_warps, interpret, lengths=None, keys_as_rows=False):
  interpret = _resolve_interpret(interpret)
  B, T, _, _ = q.shape
  K = indices.shape[-1]
  qp, kp, wp, ip, block_k = _padded(q, k, weights, indices, block_k, interpret)
  heads, dim = qp.shape[2:]
  token, whole_k = _specs(kp)
  operands, in_specs = [qp, kp, wp, ip], [token(heads, dim), whole_k, token(heads), token(ip.shape[-1])]
  if lengths is not None:
    operands.append(lengths.astype(jnp.int32)[..., None])
    in_specs.append(token(1))
  out = pl.pallas_call(
      functools.partial(_forward_kernel, scale=float(scale), block_k=block_k, precise=q.dtype == jnp.float32,
                        keys_as_rows=keys_as_rows),
      out_shape=jax.ShapeDtypeStruct((B, T, ip.shape[-1]), jnp.float32),
      grid=(B, T),
      in_specs=in_specs,
      out_specs=token(ip.shape[-1]),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="hyscale_index_scores_at",
  )(*operands)
  return out[..., :K]


def _backward(q, k, weights, indices, g, scale, block_k, num_warps, interpret):
  interpret = _resolve_interpret(interpret)
  B, T, H, D = q.shape
  K = indices.shape[-1]
  qp, kp, wp, ip, block_k = _padded(q, k, weights, indices, block_k, interpret)
  heads, dim = qp.shape[2:]
  gp = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, 0), (0, ip.shape[-1] - K)))
  token, whole_k = _specs(kp)
  dk = jnp.zeros(kp.shape, jnp.float32)
  dq, dw, dk = pl.pallas_call(
      functools.partial(_backward_kernel, scale=float(scale), block_k=block_k, precise=q.dtype == jnp.float32,
                        interpret=interpret),
      out_shape=(jax.ShapeDtypeStruct(qp.shape, jnp.float32), jax.ShapeDtypeStruct(wp.shape, jnp.float32),
                 jax.ShapeDtypeStruct(dk.shape, jnp.float32)),
      grid=(B, T),
      in_specs=[token(heads, dim), whole_k, token(heads), token(ip.shape[-1]), token(ip.shape[-1]), whole_k],
      out_specs=(token(heads, dim), token(heads), whole_k),
      input_output_aliases={5: 2},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="hyscale_index_scores_at_bwd",
  )(qp, kp, wp, ip, gp, dk)
  dq = dq[:, :, :H, :D].astype(q.dtype)
  dk = dk[..., :D].astype(k.dtype)
  dw = None if weights is None else dw[:, :, :H].astype(weights.dtype)
  return dq, dk, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _scores_at(q, k, weights, indices, scale, block_k, num_warps, interpret):
  return _forward(q, k, weights, indices, scale, block_k, num_warps, interpret)


def _scores_at_fwd(q, k, weights, indices, scale, block_k, num_warps, interpret):
  return _forward(q, k, weights, indices, scale, block_k, num_warps, interpret), (q, k, weights, indices)


def _scores_at_bwd(scale, block_k, num_warps, interpret, residuals, g):
  q, k, weights, indices = residuals
  dq, dk, dw = _backward(q, k, weights, indices, g, scale, block_k, num_warps, interpret)
  return dq, dk, dw, None


_scores_at.defvjp(_scores_at_fwd, _scores_at_bwd)


def index_scores_at_pallas(q, k, weights, indices, scale, *, block_k: int = 64, num_warps: int = 4,
                           interpret: bool | None = None):
  """f32[B, T, K]: `scale * sum_h w[b,t,h] * relu(<q[b,t,h], k[b, indices[b,t,j]]>)`, indices clamped.

  Differentiable in q, k and weights (custom_vjp; see the module docstring).

  Args:
    q: bf16|f32[B, T, H, D] indexer queries.
    k: bf16|f32[B, S, D] indexer keys, q's dtype.
    weights: [B, T, H] head weights, or None (all ones).
    indices: int[B, T, K] key positions; entries outside [0, S) score the clamped key.
    scale: the score scale (static float).
    block_k: selections per step (a power of two).
    num_warps: Triton warps per program.
    interpret: Pallas interpret mode; None = whenever JAX's backend is not a GPU.
  """
  if block_k < 1 or block_k & (block_k - 1):
    raise ValueError(f"index_scores_at_pallas: block_k={block_k} must be a power of two.")
  return _scores_at(q, k, weights, indices, float(scale), int(block_k), int(num_warps), interpret)


def index_scores_at_prefix(q, k, weights, indices, lengths, scale, *, block_k: int = 64, num_warps: int = 4,
                           keys_as_rows: bool = False, interpret: bool | None = None):
  """f32[B, T, K]: `index_scores_at_pallas`'s forward at each row's first `lengths[b, t]` entries only.

  For the FlashTopK candidates, whose buffers are wider than most rows' counts: a row costs its
  length, rounded up to `block_k`, instead of K. Entries past the length are unspecified. No
  gradient (the selection is not differentiated).

  Args:
    q, k, weights, indices, scale, block_k, num_warps, interpret: as in `index_scores_at_pallas`.
    lengths: int[B, T], the entries to score per row (clamped to [0, K]).
    keys_as_rows: multiply [block_k keys, D] by [D, heads] (the head sum within each thread's
      registers and quad) instead of heads by keys (a sum across warps). Same products, summed in
      another order.
  """
  if block_k < 1 or block_k & (block_k - 1):
    raise ValueError(f"index_scores_at_prefix: block_k={block_k} must be a power of two.")
  if lengths.shape != indices.shape[:-1]:
    raise ValueError(f"lengths.shape={lengths.shape} must be indices' [B, T] = {indices.shape[:-1]}.")
  return _forward(q, k, weights, indices, float(scale), int(block_k), int(num_warps), interpret, lengths=lengths,
                  keys_as_rows=keys_as_rows)
