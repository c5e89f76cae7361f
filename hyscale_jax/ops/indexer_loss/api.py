"""`indexer_loss`: KL distillation of the lightning indexer toward the main attention (DSA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _checks, _context
from hyscale_jax.ops._registry import Backend, BackendRegistry, platform
from hyscale_jax.ops.indexer_loss.reference import DenseKernels, indexer_loss_reference

REGISTRY = BackendRegistry(
    "indexer_loss",
    {"reference": indexer_loss_reference},
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)


# The dense form's [query_chunk, H, key_chunk] f32 tiles on the GPU. The reference's 64 x 256 make a
# 128K-token pass about 520K loop steps of small kernels, so launches, not FLOPs, set its time
# (docs/kernels/indexer_loss.md).
GPU_DENSE_BLOCKS = (256, 1024)


def _pallas_dense_kernels() -> DenseKernels:
  """The dense form's row statistics and gradients from `pallas_kernels.indexer_loss` (the attention's
  LSE given)."""
  from pallas_kernels.indexer_loss import dense_kl_grads_pallas, dense_kl_stats_pallas  # noqa: PLC0415

  def stats(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, *, q_offset, segment_ids, compress_ratio,
            scales):
    lse_i, mass, cross = dense_kl_stats_pallas(
        index_q, index_k, index_weights, attn_q, attn_k, attn_lse, q_offset=q_offset, segment_ids=segment_ids,
        compress_ratio=compress_ratio, index_scale=scales[0], attn_scale=scales[1])
    return lse_i, attn_lse, mass, cross

  def grads(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, lse_i, inv_mass, coef, *, q_offset,
            segment_ids, compress_ratio, scales):
    return dense_kl_grads_pallas(
        index_q, index_k, index_weights, attn_q, attn_k, attn_lse, lse_i, inv_mass, coef, q_offset=q_offset,
        segment_ids=segment_ids, compress_ratio=compress_ratio, index_scale=scales[0], attn_scale=scales[1])

  return DenseKernels(stats, grads)


def _with_pallas_kernels(teacher_kernel):
  """The sparse form with the teacher and the indexer's scores at the selected keys (and their
  gradient) from Pallas kernels; the softmax, KL and logit gradient are XLA over [chunk, K].

  Query chunks of 1024 rows keep the kernels' grids wide on the GPU. The dense form with the
  attention's LSE runs on the dense KL kernels (`pallas_kernels.indexer_loss`); without it, on the
  reference's streaming in `GPU_DENSE_BLOCKS` tiles, which also computes each head's LSE.
  """
  from pallas_kernels.flash_topk import index_scores_at_pallas  # noqa: PLC0415 - beside the teacher's package

  dense_kernels = _pallas_dense_kernels()  # one object: a static argument of the loss's custom_vjp

  def loss(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices=None, **kwargs):
    if indices is None and attn_lse is not None:
      return indexer_loss_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, None,
                                    dense_kernels=dense_kernels, **kwargs)
    if indices is None:
      query_chunk, key_chunk = GPU_DENSE_BLOCKS
      return indexer_loss_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, None,
                                    query_chunk=min(query_chunk, index_q.shape[1]), key_chunk=key_chunk,
                                    **kwargs)
    return indexer_loss_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices,
                                  teacher_mass=teacher_kernel, scores_at=index_scores_at_pallas, query_chunk=1024,
                                  **kwargs)

  return loss


REGISTRY.register_optional("pallas", "pallas_kernels.sparse_attention", "attention_teacher_pallas",
                           wrap=_with_pallas_kernels,
                           kernel="Triton teacher and scores at the selected keys, XLA softmax and KL; Triton "
                                  "dense KL")


def _xla_baseline(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices=None, *,
                  bytes_budget=1 << 31, **kwargs):
  """The Megatron-style baseline: the backward pass rescores every key of each row (dense chunks).

  As Megatron-LM's FusedDSAIndexerLoss backward (architectures.md 1.9), the indexer logits are
  recomputed against all S keys, `query_chunk` rows at a time (as many as fit `bytes_budget` of the
  [rows, HI, S] f32 intermediate, like `flash_topk`'s `xla_baseline`), and the closed-form gradient
  is pulled back through those dense rows. The forward pass and the teacher are ours (the Pallas
  teacher on GPU), so only the rescoring differs; Megatron's dense [H, T, T] teacher would cost more.
  The dense warm-up form (`indices=None`) is the reference's streamed one, so the step modes'
  warm-up stages differ only in what they share with the sparse stage (never a [T, T] table).
  """
  kwargs.pop("grad_in_forward", None)
  if indices is None:
    return indexer_loss_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, None, **kwargs)
  B, _, HI, _ = index_q.shape
  rows = max(1, min(index_q.shape[1], bytes_budget // (4 * B * HI * index_k.shape[1])))
  teacher = {}
  if platform() == "gpu" and "pallas" in REGISTRY.implementations:
    from pallas_kernels.sparse_attention import attention_teacher_pallas  # noqa: PLC0415 - optional, as "pallas" is
    teacher = dict(teacher_mass=attention_teacher_pallas)
  return indexer_loss_reference(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices,
                                query_chunk=rows, rescore=True, **teacher, **kwargs)


REGISTRY.implementations["xla_baseline"] = _xla_baseline


def indexer_loss(
    index_q: Float[Array, "B T HI DI"],
    index_k: Float[Array, "B S DI"],
    index_weights: Float[Array, "B T HI"] | None,
    attn_q: Float[Array, "B T H Dk"],
    attn_k: Float[Array, "B S G Dk"],
    attn_lse: Float[Array, "B T H"] | None,
    indices: Int[Array, "B T K"] | None = None,
    *,
    attn_scale: float,
    index_scale: float = 1.0,
    compress_ratio: int = 1,
    q_offset: int | Int[Array, ""] = 0,
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    grad_in_forward: bool = False,
    with_row_count: bool = False,
    grads_out: bool = False,
    key_tokens: Int[Array, "B T K P"] | None = None,
    key_pool: str = "sum",
    backend: Backend = "auto",
) -> Float[Array, ""] | tuple[Float[Array, ""], Int[Array, ""]]:
  """Mean over query rows of KL(p_t || softmax(I_t)) on each row's support (DeepSeek-V3.2 §2.1).

  Student: `I[t, s] = index_scale * sum_j w[t,j] relu(<index_q[t,j], index_k[s]>)` (the
  `flash_topk` score). Teacher: `u[t, s] = sum_h exp(attn_scale * <attn_q[t,h], attn_k[s,g(h)]> -
  attn_lse[t,h])`, L1-normalised over the support into `p`. With the sparse attention's own `lse`
  this is `(1/H) sum_h P_h`; with a larger LSE (DeepSeek-V4's window + sink) it is the mass on the
  support, renormalised.

  - Sparse form (`indices` given, the selection): the support is the listed valid indices.
  - Block form (`indices` and `key_tokens` given; QSA): index key s stands for a block of attention
    keys. attn_k holds the attention keys ([B, S_attn, G, Dk], any S_attn), and the teacher at
    entry (t, j) is `key_pool` (sum or max) over p of u at attention key `key_tokens[t, j, p]`
    (-1: none). The masses at the listed keys are the same kernel's as the sparse form's.
  - Dense warm-up form (`indices=None`): the support is every key visible under
    `compress_ratio`/`q_offset`/`segment_ids` (the `flash_topk` rule), streamed in key chunks with
    no [T, S] table. `attn_lse=None` computes each head's LSE over that support.

  The teacher inputs are detached: gradients reach only index_q, index_k and index_weights, via the
  closed form `dL/dI = (softmax(I) - p) / n_rows`. Rows with an empty support (or zero teacher
  mass) are excluded from the mean; the loss is 0 when no row counts. Computes in f32.

  Under a mesh with a `context` axis (`jax.set_mesh`), the query rows are split over it (and the
  batch over `data`/`fsdp`/`expert`), the keys all-gathered, and the shards' means are weighted
  by their counted rows into the global mean (`hyscale_jax.ops._context`); the result is the same.

  Args:
    index_q: bf16|f32[B, T, HI, DI] indexer queries.
    index_k: bf16|f32[B, S, DI] indexer keys.
    index_weights: bf16|f32[B, T, HI] indexer head weights, or None for all ones.
    attn_q: bf16|f32[B, T, H, Dk] attention queries (teacher, detached).
    attn_k: bf16|f32[B, S, G, Dk] attention keys (teacher, detached); [B, S_attn, G, Dk] in the block form.
    attn_lse: f32[B, T, H] attention LSE from `sparse_attention` (required in the sparse form).
    indices: int[B, T, K] the selection, or None for the dense form.
    attn_scale: the attention's logit scale.
    index_scale: the indexer score scale.
    compress_ratio, q_offset, segment_ids: visibility of the dense form, as in `flash_topk`.
    grad_in_forward: sparse form: compute the gradient in the forward pass and save it (tagged
      `remat.INDEXER_GRADS`), so neither the backward pass nor the `"selection_replay"`
      rematerialization reruns the teacher. Same value and gradient; ignored by `xla_baseline`.
    grads_out: with grad_in_forward (sparse form): also return the loss's gradients at unit cotangent,
      f32 (d index_q, d index_k, d index_weights or None), last, and give the loss none; a caller over
      query chunks sums them (weighted by the chunks' counted rows) into what it saves, once, instead
      of [S, DI] + [T, HI, DI] per chunk. Not under a context mesh.
    with_row_count: also return how many rows the mean counted (over all shards under a context
      mesh), so that means over disjoint row sets combine as `sum_i n_i * mean_i / max(sum_i n_i, 1)`.
    key_tokens: int[B, T, K, P] the attention keys behind each selected index key (block form), or
      None (index keys are attention keys). Entries are used as given (segment_ids do not apply):
      the caller masks tokens of other documents with -1, as `layers.qsa.expand_blocks` does.
    key_pool: "sum" or "max": how the block form pools its attention keys' teacher masses.
    backend: "auto", "pallas" (the sparse form's teacher from a Pallas kernel; the dense form streamed in
      GPU-sized tiles), "reference", or "xla_baseline" (the Megatron-style backward that rescores every
      key; the dense form is the reference's).

  Returns:
    f32[] the loss, or (loss, i32[] rows counted) with `with_row_count`; `grads_out` appends the
    gradients.

  Raises:
    ValueError: on mismatched shapes, bad dtypes, or `attn_lse=None` in the sparse form.
  """
  _check_args(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, compress_ratio, q_offset,
              segment_ids, key_tokens, key_pool)
  _checks.check_static_float("attn_scale", attn_scale)
  _checks.check_static_float("index_scale", index_scale)
  attn_q, attn_k, attn_lse = jax.lax.stop_gradient((attn_q, attn_k, attn_lse))
  names = REGISTRY.candidates(backend)
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)

  def loss(row_offset, local, full, replicated, with_row_count=False):
    (index_q, index_weights, attn_q, attn_lse, indices, key_tokens, q_seg), (index_k, attn_k, kv_seg) = local, full
    (q_offset,) = replicated
    return REGISTRY.run(
        names, index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices,
        attn_scale=float(attn_scale), index_scale=float(index_scale), compress_ratio=int(compress_ratio),
        q_offset=q_offset + row_offset, segment_ids=None if q_seg is None else (q_seg, kv_seg),
        with_row_count=with_row_count, grad_in_forward=bool(grad_in_forward), key_tokens=key_tokens,
        key_pool=key_pool, **({"grads_out": True} if grads_out else {}),
    )

  local = (index_q, index_weights, attn_q, attn_lse, indices, key_tokens, q_seg)
  full = (index_k, attn_k, kv_seg)
  mesh = _context.context_mesh()
  if grads_out and not (grad_in_forward and indices is not None):
    raise ValueError("indexer_loss: grads_out needs the sparse form (indices) with grad_in_forward=True.")
  if mesh is None:
    return loss(0, local, full, (q_offset,), with_row_count=with_row_count)
  if grads_out:
    raise NotImplementedError("indexer_loss: grads_out is not available under a context mesh.")
  axes = _context.token_axes(mesh)

  def shard_loss(row_offset, local, full, replicated):
    # The global mean is sum_i n_i * mean_i / sum_i n_i over the shards' counted rows n_i.
    mean, rows = loss(row_offset, local, full, replicated, with_row_count=True)
    total = jax.lax.psum(rows, axes)
    mean = jax.lax.psum(mean * rows.astype(mean.dtype), axes) / jnp.maximum(total, 1).astype(mean.dtype)
    return (mean, total) if with_row_count else mean

  return _context.run_sequence_sharded(shard_loss, mesh, sharded=local, gathered=full,
                                       replicated=(jnp.asarray(q_offset, jnp.int32),), n_out=1,
                                       reduced=True)


def _check_args(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices, compress_ratio, q_offset,
                segment_ids, key_tokens, key_pool):
  _checks.check_rank("index_q", index_q, 4, "B, T, HI, DI")
  _checks.check_rank("index_k", index_k, 3, "B, S, DI")
  _checks.check_rank("attn_q", attn_q, 4, "B, T, H, Dk")
  _checks.check_rank("attn_k", attn_k, 4, "B, S, G, Dk")
  for name, x in (("index_q", index_q), ("index_k", index_k), ("attn_q", attn_q), ("attn_k", attn_k)):
    _checks.check_float(name, x)
  B, T, HI, DI = index_q.shape
  S = index_k.shape[1]
  where = f"from index_q.shape={tuple(index_q.shape)}"
  if index_k.shape[0] != B or index_k.shape[2] != DI:
    raise ValueError(f"index_k.shape={tuple(index_k.shape)} must be [B, S, DI] with B={B}, DI={DI} {where}.")
  if index_weights is not None:
    _checks.check_rank("index_weights", index_weights, 3, "B, T, HI")
    _checks.check_float("index_weights", index_weights)
    if index_weights.shape != (B, T, HI):
      raise ValueError(f"index_weights.shape={tuple(index_weights.shape)} must be {(B, T, HI)} {where}.")
  H = attn_q.shape[2]
  if attn_q.shape[:2] != (B, T):
    raise ValueError(f"attn_q.shape={tuple(attn_q.shape)} must start with [B, T]={(B, T)} {where}.")
  if key_tokens is not None:  # the block form's attention keys are tokens, any number of them
    if attn_k.shape[0] != B or attn_k.shape[3] != attn_q.shape[3]:
      raise ValueError(f"attn_k.shape={tuple(attn_k.shape)} must be [B, S_attn, G, Dk]=({B}, S_attn, G, "
                       f"{attn_q.shape[3]}) from attn_q.shape={tuple(attn_q.shape)}.")
  elif attn_k.shape[:2] != (B, S) or attn_k.shape[3] != attn_q.shape[3]:
    raise ValueError(
        f"attn_k.shape={tuple(attn_k.shape)} must be [B, S, G, Dk]=({B}, {S}, G, {attn_q.shape[3]}) "
        f"from index_k.shape={tuple(index_k.shape)} and attn_q.shape={tuple(attn_q.shape)}."
    )
  if H % attn_k.shape[2]:
    raise ValueError(f"attn_q heads H={H} must be divisible by attn_k groups G={attn_k.shape[2]}.")
  if attn_lse is not None:
    _checks.check_rank("attn_lse", attn_lse, 3, "B, T, H")
    _checks.check_float("attn_lse", attn_lse)
    if attn_lse.shape != (B, T, H):
      raise ValueError(f"attn_lse.shape={tuple(attn_lse.shape)} must be [B, T, H]={(B, T, H)}.")
  if indices is not None:
    _checks.check_rank("indices", indices, 3, "B, T, K")
    _checks.check_int("indices", indices)
    if indices.shape[:2] != (B, T):
      raise ValueError(f"indices.shape={tuple(indices.shape)} must start with [B, T]={(B, T)} {where}.")
    if attn_lse is None:
      raise ValueError("attn_lse is required in the sparse form (indices given): pass sparse_attention's lse.")
  if key_tokens is not None:
    if indices is None:
      raise ValueError("key_tokens (the block form) needs indices: it is a sparse form.")
    _checks.check_rank("key_tokens", key_tokens, 4, "B, T, K, P")
    _checks.check_int("key_tokens", key_tokens)
    if key_tokens.shape[:3] != indices.shape:
      raise ValueError(f"key_tokens.shape={tuple(key_tokens.shape)} must be [B, T, K, P] with "
                       f"[B, T, K]={tuple(indices.shape)} from indices.shape.")
  if key_pool not in ("sum", "max"):
    raise ValueError(f"key_pool={key_pool!r} must be 'sum' or 'max'.")
  _checks.check_positive_int("compress_ratio", compress_ratio)
  _checks.check_scalar_int("q_offset", q_offset)
  _checks.check_segment_ids(segment_ids, B, T, S)
