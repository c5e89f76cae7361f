"""`flash_topk`: the exact per-query top-k of the lightning-indexer score, with no score table."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hyscale_jax import remat
from hyscale_jax.ops import _checks, _context
from hyscale_jax.ops._registry import Backend, BackendRegistry
from hyscale_jax.ops.flash_topk.reference import FP8, flash_topk_reference, flash_topk_xla_baseline, fold_q_scale

REGISTRY = BackendRegistry(
    "flash_topk",
    {"reference": flash_topk_reference, "xla_baseline": flash_topk_xla_baseline},
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)


def _pallas_kernel(pallas, hopper):
  """The main pass `Config.scorer` picks (`Config.scores_on_mosaic`); the threshold, finish and rescue are
  the same either way."""
  config = pallas.Config()
  if config.scorer == "triton" or (config.scorer == "auto" and hopper is False):
    return "Triton"
  if config.scorer == "mosaic":
    return "Mosaic GPU main pass where the inputs allow (bf16, no key scales), Triton otherwise"
  keys = f"{config.mosaic_min_keys // 1024}K keys"
  return (f"Mosaic GPU main pass from {keys}, Triton below" if hopper
          else f"Mosaic GPU main pass from {keys} on Hopper, Triton below and elsewhere")


REGISTRY.register_optional("pallas", "hyscale_jax.ops.flash_topk.pallas", "flash_topk_pallas", kernel=_pallas_kernel)


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
    q_scale: Float[Array, "B Tq H"] | None = None,
    k_scale: Float[Array, "B Tk"] | None = None,
    backend: Backend = "auto",
    sorted: bool = True,  # noqa: A002 - torch.topk's name for the same switch
    with_stats: bool = False,
) -> TopK | tuple[TopK, Bool[Array, "B Tq"]]:
  """Exact top-k of `score[b,t,s] = scale * sum_h weights[b,t,h] * relu(<q[b,t,h], k[b,s]>)`.

  Under a mesh with a `context` axis (`jax.set_mesh`), the query rows are split over it and the
  keys all-gathered (`hyscale_jax.ops._context`); the result is the same.

  Query `t` sits at absolute position `p = q_offset + t`; key `s` is visible iff
  `(s + 1) * compress_ratio <= p + 1` (and, with `segment_ids`, iff the segment ids are equal).
  The result lists the `topk` greatest visible keys under "score descending, then index ascending",
  in that order (with `sorted=False`, the same entries in an order of the backend's choosing).
  Products accumulate in f32 and the head sum is f32. The outputs carry no gradient; they are
  tagged `remat.SELECTION` (with `with_stats`, the rescued rows too), so the `"selection_replay"` remat
  policy saves them.

  fp8 (DeepSeek-V3.2's indexer): q and k in float8_e4m3fn, with their scales from `quantize_fp8`.
  The score is then the f32 function
  `(sum_h (weights[b,t,h] * q_scale[b,t,h]) * relu(<q[b,t,h], k[b,s]>)) * (k_scale[b,s] * scale)`,
  each parenthesis one f32 product (a missing scale is 1): the dequantized score for scales >= 0,
  with the scales applied where DeepSeek's `fp8_index` applies them. Products of two e4m3 values are
  exact in f32, so every backend selects the top-k of this one function.

  Args:
    q: bf16|f32|float8_e4m3fn[B, Tq, H, D] indexer queries.
    k: bf16|f32|float8_e4m3fn[B, Tk, D] indexer keys, one per key position, shared by all heads
      (fp8 only together with fp8 q).
    weights: bf16|f32[B, Tq, H] per-head weights, or None for all ones (QSA).
    topk: how many keys to select per query (>= 1; may exceed the visible count).
    compress_ratio: tokens per key (1 for token keys, m for compressed blocks).
    q_offset: absolute position of query 0 (int or 0-d int array, e.g. a shard offset).
    segment_ids: optional (q_seg int[B, Tq], kv_seg int[B, Tk]) for packed documents.
    scale: multiplies the score (static Python float).
    q_scale: f32[B, Tq, H] fp8 q's per-(token, head) scales, or None (1); only with fp8 inputs.
    k_scale: f32[B, Tk] fp8 k's per-key scales, or None (1); only with fp8 inputs.
    backend: "auto", "pallas", "reference" or "xla_baseline".
    sorted: list the entries in the order above (True), or leave them in an order the backend finds
      cheapest (False): deterministic for one backend and input, the empty slots (-1) still last.
      The Pallas backend then skips sorting each row's winners (docs/kernels/flash_topk.md says
      what that saves); the reference backends return the sorted order. DSA's consumers (sparse
      attention, the indexer KL, IndexShare) treat the selection as a set, so the layers ask for this.

  Returns:
    TopK(indices=i32[B, Tq, topk], scores=f32[B, Tq, topk]). When fewer than `topk` keys are
    visible, the tail slots hold index -1 and score -inf.

  Raises:
    ValueError: on a wrong rank, a mismatched batch/head/dim size, a bad dtype, `topk < 1`, one
      fp8 input without the other, or a scale without fp8 inputs.
  """
  _check_args(q, k, weights, topk, compress_ratio, q_offset, segment_ids, scale)
  _check_fp8(q, k, q_scale, k_scale)
  names = REGISTRY.candidates(backend)
  indices, scores, rescued = _flash_topk(
      q, k, weights, jnp.asarray(q_offset, jnp.int32), segment_ids, q_scale, k_scale,
      topk=int(topk), compress_ratio=int(compress_ratio), scale=float(scale), names=names, by_score=bool(sorted),
      with_stats=bool(with_stats),
  )
  selection = TopK(*remat.tag((indices, scores), remat.SELECTION))
  if not with_stats:
    return selection
  if rescued is None:  # a backend without a fallback: made here, outside the selection's equation, so that a
    # loop over query chunks does not hoist a constant copy of that equation out of itself
    return selection, jnp.zeros(q.shape[:2], bool)
  # Saved with the selection: a remat that needed it again would otherwise rerun the selection.
  return selection, remat.tag(rescued, remat.SELECTION)


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "scale", "names", "by_score", "with_stats"))
def _flash_topk(q, k, weights, q_offset, segment_ids, q_scale, k_scale, *, topk, compress_ratio, scale,
                names, by_score, with_stats):
  """The single jaxpr equation (named `_flash_topk`) that tools count as one selection: (indices, scores,
  rescued bool[B, Tq] or None: not asked for, or a backend without a fallback)."""
  q, k, weights, q_scale, k_scale = jax.lax.stop_gradient((q, k, weights, q_scale, k_scale))
  weights = fold_q_scale(weights, q_scale)  # backends see q's scales only through the head weights
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)

  def select(row_offset, local, full, replicated):
    (q, weights, q_seg), (k, kv_seg, k_scale), (q_offset,) = local, full, replicated
    return REGISTRY.run(
        names, q, k, weights, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset + row_offset,
        segment_ids=None if q_seg is None else (q_seg, kv_seg), scale=scale, k_scale=k_scale, sorted=by_score,
        **({"with_stats": True} if with_stats else {}),
    )

  mesh = _context.context_mesh()
  if mesh is None:
    indices, scores, *rescued = select(0, (q, weights, q_seg), (k, kv_seg, k_scale), (q_offset,))
  else:  # context parallelism: this device's query rows against all-gathered keys
    indices, scores, *rescued = _context.run_sequence_sharded(
        _rescued_as_array(select) if with_stats else select, mesh, sharded=(q, weights, q_seg), gathered=(k, kv_seg, k_scale), replicated=(q_offset,),
        n_out=3 if with_stats else 2)
  return indices, jax.lax.stop_gradient(scores), rescued[0] if with_stats else None


def _rescued_as_array(select):
  """`select` with a backend's None rescued rows (no fallback) as all False: a shard_map returns arrays."""
  def run(*args):
    indices, scores, rescued = select(*args)
    return indices, scores, jnp.zeros(indices.shape[:2], bool) if rescued is None else rescued
  return run


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


def _check_fp8(q, k, q_scale, k_scale):
  """fp8 means float8_e4m3fn q and k together; the scales come only with them, shaped per row."""
  fp8 = [x.dtype == FP8 for x in (q, k)]
  for name, x in (("q", q), ("k", k)):
    if x.dtype.itemsize == 1 and x.dtype != FP8:
      raise ValueError(f"{name}.dtype={x.dtype}: the fp8 path takes float8_e4m3fn.")
  if fp8[0] != fp8[1]:
    raise ValueError(f"q.dtype={q.dtype} and k.dtype={k.dtype}: fp8 q and k come together.")
  B, Tq, H, _ = q.shape
  for name, x, shape in (("q_scale", q_scale, (B, Tq, H)), ("k_scale", k_scale, (B, k.shape[1]))):
    if x is None:
      continue
    if not fp8[0]:
      raise ValueError(f"{name} dequantizes fp8 inputs, but q.dtype={q.dtype}.")
    _checks.check_float(name, x)
    if tuple(x.shape) != shape:
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be {shape} from q.shape={tuple(q.shape)} "
                       f"and k.shape={tuple(k.shape)}.")
