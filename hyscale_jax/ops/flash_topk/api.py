"""`flash_topk`: the exact per-query top-k of the lightning-indexer score, with no score table."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax import remat
from hyscale_jax.ops import _checks, _context
from hyscale_jax.ops._registry import Backend, BackendRegistry
from hyscale_jax.ops.flash_topk.reference import flash_topk_reference, flash_topk_xla_baseline

REGISTRY = BackendRegistry(
    "flash_topk",
    {"reference": flash_topk_reference, "xla_baseline": flash_topk_xla_baseline},
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)
REGISTRY.register_optional("pallas", "hyscale_jax.ops.flash_topk.pallas", "flash_topk_pallas")


class TopK(NamedTuple):
  """The selection: `indices` i32[B, Tq, topk] (-1 = empty slot) and `scores` f32[B, Tq, topk]."""

  indices: Int[Array, "B Tq topk"]
  scores: Float[Array, "B Tq topk"]


def flash_topk(
    q: Float[Array, "B Tq H D"],
    k: Float[Array, "B Tk D"],
    weights: Float[Array, "B Tq H"] | None = None,
    *,
    topk: int,
    compress_ratio: int = 1,
    q_offset: int | Int[Array, ""] = 0,
    segment_ids: tuple[Int[Array, "B Tq"], Int[Array, "B Tk"]] | None = None,
    scale: float = 1.0,
    backend: Backend = "auto",
) -> TopK:
  """Exact top-k of `score[b,t,s] = scale * sum_h weights[b,t,h] * relu(<q[b,t,h], k[b,s]>)`.

  Under a mesh with a `context` axis (`jax.set_mesh`), the query rows are split over it and the
  keys all-gathered (`hyscale_jax.ops._context`); the result is the same.

  Query `t` sits at absolute position `p = q_offset + t`; key `s` is visible iff
  `(s + 1) * compress_ratio <= p + 1` (and, with `segment_ids`, iff the segment ids are equal).
  The result lists the `topk` greatest visible keys under "score descending, then index ascending",
  in that order. Products accumulate in f32 and the head sum is f32. The outputs carry no gradient;
  they are tagged `remat.SELECTION`, so the `"selection_replay"` remat policy saves them.

  Args:
    q: bf16|f32[B, Tq, H, D] indexer queries.
    k: bf16|f32[B, Tk, D] indexer keys, one per key position, shared by all heads.
    weights: bf16|f32[B, Tq, H] per-head weights, or None for all ones (QSA).
    topk: how many keys to select per query (>= 1; may exceed the visible count).
    compress_ratio: tokens per key (1 for token keys, m for compressed blocks).
    q_offset: absolute position of query 0 (int or 0-d int array, e.g. a shard offset).
    segment_ids: optional (q_seg int[B, Tq], kv_seg int[B, Tk]) for packed documents.
    scale: multiplies the score (static Python float).
    backend: "auto", "pallas", "reference" or "xla_baseline".

  Returns:
    TopK(indices=i32[B, Tq, topk], scores=f32[B, Tq, topk]). When fewer than `topk` keys are
    visible, the tail slots hold index -1 and score -inf.

  Raises:
    ValueError: on a wrong rank, a mismatched batch/head/dim size, a bad dtype or `topk < 1`.
  """
  _check_args(q, k, weights, topk, compress_ratio, q_offset, segment_ids, scale)
  names = REGISTRY.candidates(backend)
  indices, scores = _flash_topk(
      q, k, weights, jnp.asarray(q_offset, jnp.int32), segment_ids,
      topk=int(topk), compress_ratio=int(compress_ratio), scale=float(scale), names=names,
  )
  return TopK(*remat.tag((indices, scores), remat.SELECTION))


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale", "names"))
def _flash_topk(q, k, weights, q_offset, segment_ids, *, topk, compress_ratio, scale, names):
  """The single jaxpr equation (named `_flash_topk`) that tools count as one selection."""
  q, k, weights = jax.lax.stop_gradient((q, k, weights))
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)

  def select(row_offset, local, full, replicated):
    (q, weights, q_seg), (k, kv_seg), (q_offset,) = local, full, replicated
    return REGISTRY.run(
        names, q, k, weights, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset + row_offset,
        segment_ids=None if q_seg is None else (q_seg, kv_seg), scale=scale,
    )

  mesh = _context.context_mesh()
  if mesh is None:
    indices, scores = select(0, (q, weights, q_seg), (k, kv_seg), (q_offset,))
  else:  # context parallelism: this device's query rows against all-gathered keys
    indices, scores = _context.run_sequence_sharded(
        select, mesh, sharded=(q, weights, q_seg), gathered=(k, kv_seg), replicated=(q_offset,), n_out=2)
  return indices, jax.lax.stop_gradient(scores)


def _check_args(q, k, weights, topk, compress_ratio, q_offset, segment_ids, scale):
  _checks.check_rank("q", q, 4, "B, Tq, H, D")
  _checks.check_rank("k", k, 3, "B, Tk, D")
  _checks.check_float("q", q)
  _checks.check_float("k", k)
  B, Tq, H, D = q.shape
  _checks.check_dim("k", k, 0, B, f"batch, from q.shape={tuple(q.shape)}")
  _checks.check_dim("k", k, 2, D, f"head dim, from q.shape={tuple(q.shape)}")
  if weights is not None:
    _checks.check_rank("weights", weights, 3, "B, Tq, H")
    _checks.check_float("weights", weights)
    if weights.shape != (B, Tq, H):
      raise ValueError(
          f"weights.shape={tuple(weights.shape)} must be [B, Tq, H]={(B, Tq, H)} from "
          f"q.shape={tuple(q.shape)}."
      )
  _checks.check_positive_int("topk", topk)
  _checks.check_positive_int("compress_ratio", compress_ratio)
  _checks.check_scalar_int("q_offset", q_offset)
  _checks.check_static_float("scale", scale)
  _checks.check_segment_ids(segment_ids, B, Tq, k.shape[1])
