"""Multi-head latent attention with DSA: absorbed (MQA 576/512-style) sparse attention over a selection."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import ops, remat
from hyscale_jax import sharding as shd
from hyscale_jax.layers.indexer import LightningIndexer
from hyscale_jax.layers.rope import apply_rope, yarn_of
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.ops import _streaming as st


class AttentionOutput(NamedTuple):
  """`out` [B, T, D]; `indices` i32[B, T, K] or None (dense); `indexer_loss` f32[] or None;
  `rescued_rows` i32[] or None: the rows whose selection took FlashTopK's slow exact path (`ops.flash_topk`
  `with_stats`), None where this call selected nothing."""

  out: jax.Array
  indices: jax.Array | None
  indexer_loss: jax.Array | None
  rescued_rows: jax.Array | None = None


class MLASparseAttention(nnx.Module):
  """GLM-5 / DeepSeek-V3.2 attention: MLA projections, a lightning indexer, and sparse attention.

  The sparse core runs in the absorbed (MQA) form: per head the query is
  `[W_UK^T q_nope (kv_lora) ; rope(q_pe)]` and every head shares one key `[c_kv ; rope(k_pe)]`
  and one value `c_kv`, so a gathered key row serves all heads. The dense warm-up runs non-absorbed
  (per-head keys and values from `kv_b_proj`): half the FLOPs when every key is attended. Attribute
  names follow the HF checkpoints (`q_a_proj`, `q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`,
  `kv_a_layernorm`, `kv_b_proj`, `o_proj`, `indexer`). Under IndexShare a layer without its own indexer reuses the
  previous full layer's selection and owns no indexer weights.
  """

  def __init__(self, cfg: ModelConfig, *, has_indexer: bool, rngs: nnx.Rngs):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    linear = lambda i, o, axes: nnx.Linear(i, o, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                           kernel_metadata=shd.param(*axes))
    norm = lambda n: nnx.RMSNorm(n, epsilon=cfg.latent_norm_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                 scale_metadata=shd.param(shd.NORM))
    H, qk = cfg.n_heads, cfg.qk_nope_dim + cfg.qk_rope_dim
    self.cfg = cfg
    self.yarn = yarn_of(cfg)  # None without YaRN
    self.q_a_proj = linear(cfg.d_model, cfg.q_lora_rank, (shd.EMBED, shd.Q_LORA))
    self.q_a_layernorm = norm(cfg.q_lora_rank)
    self.q_b_proj = linear(cfg.q_lora_rank, H * qk, (shd.Q_LORA, shd.HEADS))
    # [c_kv ; k_pe]: the latent and the rope part are used whole by every head.
    self.kv_a_proj_with_mqa = linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_dim, (shd.EMBED, None))
    self.kv_a_layernorm = norm(cfg.kv_lora_rank)
    self.kv_b_proj = linear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_head_dim), (shd.KV_LORA, shd.HEADS))
    self.o_proj = linear(H * cfg.v_head_dim, cfg.d_model, (shd.HEADS, shd.EMBED))
    self.indexer = LightningIndexer(
        cfg.d_model, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
        rope_dim=cfg.index_rope_dim, rope_theta=cfg.rope_theta, rope_yarn=self.yarn,
        rope_interleave=cfg.indexer_rope_interleave, rope_first=cfg.indexer_rope_first,
        scoring_relu=cfg.indexer_scoring_relu, hadamard=cfg.indexer_hadamard,
        rngs=rngs, dtype=dtype, param_dtype=pdtype) if has_indexer else None

  @property
  def scale(self) -> float:
    """The softmax scale: `cfg.attention_scale` times YaRN's `softmax_scale` (mscale_all_dim^2, V3 convention)."""
    return self.cfg.attention_scale * (self.yarn.softmax_scale if self.yarn is not None else 1.0)

  def _absorption(self):
    """W_UK [L, H, qk_nope] and W_UV [L, H, v_head_dim], the two halves of kv_b_proj."""
    cfg = self.cfg
    L, nope = cfg.kv_lora_rank, cfg.qk_nope_dim
    w_kv_b = self.kv_b_proj.kernel[...].reshape(L, cfg.n_heads, nope + cfg.v_head_dim)
    return w_kv_b[..., :nope], w_kv_b[..., nope:]

  def _query_heads(self, x, positions):
    """Per-head q_nope [B, t, H, nope], roped q_pe [B, t, H, R] and latent c_q [B, t, q_lora] of rows x."""
    cfg = self.cfg
    B, T, _ = x.shape
    nope = cfg.qk_nope_dim
    c_q = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, q_lora]
    q = self.q_b_proj(c_q).reshape(B, T, cfg.n_heads, nope + cfg.qk_rope_dim)
    return q[..., :nope], apply_rope(q[..., nope:], positions, theta=cfg.rope_theta, interleaved=True,
                                                yarn=self.yarn), c_q

  def _latent_keys(self, x, positions):
    """The shared latent c_kv [B, T, L] and roped k_pe [B, T, R] of all T rows."""
    L = self.cfg.kv_lora_rank
    kv = self.kv_a_proj_with_mqa(x)  # [B, T, L + R]
    return self.kv_a_layernorm(kv[..., :L]), apply_rope(kv[..., L:], positions, theta=self.cfg.rope_theta,
                                                          interleaved=True, yarn=self.yarn)

  def _mqa_queries(self, x, positions, w_uk):
    """Absorbed q [B, t, H, L+R] and latent c_q [B, t, q_lora] of query rows x [B, t, D] (row-local)."""
    q_nope, q_pe, c_q = self._query_heads(x, positions)
    q_latent = jnp.einsum("bthn,lhn->bthl", q_nope, w_uk.astype(q_nope.dtype))  # [B, T, H, L]
    return jnp.concatenate([q_latent, q_pe], axis=-1), c_q

  def _mqa_keys(self, x, positions):
    """Shared k [B, T, 1, L+R] and v [B, T, 1, L] (k's latent prefix) of all T rows."""
    c_kv, k_pe = self._latent_keys(x, positions)
    return jnp.concatenate([c_kv, k_pe], axis=-1)[:, :, None, :], c_kv[:, :, None, :]

  def _mqa_inputs(self, x, positions):
    """Absorbed q [B, T, H, L+R], shared k [B, T, 1, L+R], v [B, T, 1, L], latent c_q, and W_UV."""
    w_uk, w_uv = self._absorption()
    q, c_q = self._mqa_queries(x, positions, w_uk)
    k, v = self._mqa_keys(x, positions)
    return q, k, v, c_q, w_uv

  def _dense_inputs(self, x, positions):
    """The non-absorbed (per-head) q, k [B, T, H, nope+R], v [B, T, H, v_head_dim] and latent c_q.

    The warm-up's dense attention runs in this form: kv_b_proj expands the latent into per-head
    keys and values, so each (query, key) pair costs nope+R + v_head_dim (256 + 256 at GLM-5.1)
    multiply-adds per head instead of the absorbed form's (L+R) + L (576 + 512), and the head dims
    are ones a flash kernel tiles. `q . k` equals the absorbed form's logit exactly in real arithmetic.
    """
    cfg = self.cfg
    B, T, _ = x.shape
    H, nope, R = cfg.n_heads, cfg.qk_nope_dim, cfg.qk_rope_dim
    q_nope, q_pe, c_q = self._query_heads(x, positions)
    c_kv, k_pe = self._latent_keys(x, positions)
    kv_heads = self.kv_b_proj(c_kv).reshape(B, T, H, nope + cfg.v_head_dim)
    k_pe = jnp.broadcast_to(k_pe[:, :, None], (B, T, H, R)).astype(kv_heads.dtype)
    k = jnp.concatenate([kv_heads[..., :nope], k_pe], axis=-1)  # [B, T, H, nope + R]
    return jnp.concatenate([q_nope, q_pe], axis=-1), k, kv_heads[..., nope:], c_q

  def keys(self, x, positions):
    """(k [B, T, 1, L+R], index_k [B, T, DI] or None) of the normalised rows x [B, T, D]; row-local,
    so a caller may compute them a chunk of rows at a time (v is k's latent prefix)."""
    k, _ = self._mqa_keys(x, positions)
    return k, None if self.indexer is None else self.indexer.keys(x, positions)

  def query_rows(self, keys, segment_ids, backends, *, grads_out: bool = False, replay: bool = False):
    """The sparse path for some query rows against all keys: a function of (x [B, t, D] normalised rows,
    positions, their segment ids, q_offset i32[] of their first row, shared indices or None) ->
    (out [B, t, D], indices i32[B, t, K], indexer loss f32[] or None, rows counted or None, grads,
    rows rescued i32[] or None: those whose selection took FlashTopK's slow exact path).

    `keys()` returns (k, index_k) of all T rows (`keys`; a thunk, so a chunk loop may close over f32
    copies, `st.summed_in_f32`); `segment_ids` i32[B, T] are the keys'. With `grads_out` (and the
    indexer loss's gradient computed in the forward pass) the indexer loss carries no gradient and
    `grads` is its gradient (of this call's mean, at unit cotangent): (f32[B, T, DI] w.r.t. index_k,
    the indexer's `nnx.Param` state w.r.t. its query side's weights, pulled back here), for the
    caller to sum over chunks and save once (`ops.indexer_loss(grads_out=True)`); None otherwise.
    With `replay` the given indices are the forward pass's selection of these rows (a backward pass
    recomputing them, `models/layer_chunks.py`): no top-k runs, and the indexer loss only where it
    carries a gradient (not with `indexer_loss_grad_in_forward`; its value is then None).
    """
    cfg = self.cfg
    scale = self.scale
    backend = lambda name: getattr(backends, name, "auto") if backends is not None else "auto"
    w_uk, w_uv = self._absorption()
    grads_out = grads_out and cfg.indexer_loss_grad_in_forward and self.indexer is not None

    def rows(x, positions, q_seg, q_offset, indices):
      k, index_k = keys()
      B, t = x.shape[:2]
      q, c_q = self._mqa_queries(x, positions, w_uk)
      loss = rows_counted = grads = rescued = None
      indexer = None if replay and cfg.indexer_loss_grad_in_forward else self.indexer
      if indexer is not None:
        index_q, index_w = indexer.queries(x, c_q, positions)
      if self.indexer is not None and not replay:
        selection, rescued = ops.flash_topk(
            index_q, index_k, index_w, topk=cfg.index_topk, scale=self.indexer.score_scale, q_offset=q_offset,
            segment_ids=(q_seg, segment_ids), sorted=False, backend=backend("flash_topk"), with_stats=True)
        indices, rescued = selection.indices, jnp.sum(rescued, dtype=jnp.int32)
      # v is k's latent prefix: passing None lets the kernels gather and scatter one row for both.
      out, lse = ops.sparse_attention(q, k, None, indices, scale=scale, value_dim=cfg.kv_lora_rank,
                                      deterministic=cfg.sparse_attention_deterministic,
                                      backend=backend("sparse_attention"))
      if indexer is not None:
        loss, rows_counted, *grads = ops.indexer_loss(
            index_q, index_k, index_w, q, k, lse, indices, attn_scale=scale, index_scale=self.indexer.score_scale,
            grad_in_forward=cfg.indexer_loss_grad_in_forward, with_row_count=True, grads_out=grads_out,
            backend=backend("indexer_loss"))
        if grads:
          dq, dk, dw = grads[0]
          grads = (dk, self._indexer_query_grads(x, c_q, positions, dq.astype(index_q.dtype),
                                                  dw.astype(index_w.dtype)))
        else:
          grads = None
      heads = jnp.einsum("bthl,lhv->bthv", out, w_uv.astype(out.dtype))  # [B, t, H, v_head_dim]
      return self.o_proj(heads.reshape(B, t, -1)), indices, loss, rows_counted, grads, rescued

    return rows

  def _indexer_query_grads(self, x, c_q, positions, d_index_q, d_index_w):
    """The indexer's `nnx.Param` state's gradient from its queries' and head weights' cotangents (f32
    leaves; zero for the key side). The queries read detached inputs, so this is all they pass on."""
    graphdef, params, rest = nnx.split(self.indexer, nnx.Param, ...)
    queries = lambda params: nnx.merge(graphdef, params, rest).queries(x, c_q, positions)
    _, pullback = jax.vjp(queries, jax.lax.stop_gradient(params))
    return jax.tree.map(lambda g: g.astype(jnp.float32), pullback((d_index_q, d_index_w))[0])

  def __call__(
      self,
      x: Float[Array, "B T D"],
      positions: Int[Array, "B T"],
      segment_ids: Int[Array, "B T"],
      *,
      dense: bool = False,
      shared_indices: Int[Array, "B T K"] | None = None,
      backends=None,
  ) -> AttentionOutput:
    """Attention of each token over its selection (or over all causal keys when `dense`).

    With `cfg.attention_query_chunk` > 0 and T above it, the sparse path runs over query chunks of
    that many rows (T must be a multiple): the keys (k, the indexer's keys) are computed once for
    all T, and each chunk computes its queries, selection, attention, indexer loss and output
    projection under `remat.remat(..., cfg.remat_policy)`, so (with a remat policy other than
    "none") no [B, T, H, ...] query-side array exists at once. Queries are independent given the
    keys, so the result is the same.

    Args:
      x: [B, T, D] the normalised block input.
      positions: i32[B, T] positions within each packed document (RoPE).
      segment_ids: i32[B, T] document ids; nothing attends or selects across them.
      dense: the warm-up stage: dense attention in the non-absorbed form (`ops.causal_attention`,
        streamed: nothing [T, T]), the dense indexer KL, no selection.
      shared_indices: the previous full layer's selection, for a layer without its own indexer.
      backends: an object with `flash_topk`, `sparse_attention`, `indexer_loss`, `causal_attention`
        backend names.

    Returns:
      AttentionOutput(out [B, T, D] in the module dtype, indices [B, T, K], indexer_loss).

    Raises:
      ValueError: a layer without an indexer gets no `shared_indices`, or T is above
        `attention_query_chunk` but not a multiple of it.
    """
    cfg = self.cfg
    B, T, _ = x.shape
    scale = self.scale
    backend = lambda name: getattr(backends, name, "auto") if backends is not None else "auto"
    if dense:
      q, k, v, c_q = self._dense_inputs(x, positions)
      # out [B, T, H, v_head_dim]; lse f32[B, T, H], the teacher's, read by the indexer KL and not recomputed.
      out, lse = ops.causal_attention(q, k, v, scale=scale, segment_ids=segment_ids, return_lse="detached",
                                      backend=backend("causal_attention"))
      indexer_loss = None
      if self.indexer is not None:  # the same logits as the absorbed form's, streamed over key chunks
        indexer_loss = ops.indexer_loss(*self.indexer(x, c_q, positions), q, k, lse, None, attn_scale=scale,
                                        index_scale=self.indexer.score_scale,
                                        segment_ids=(segment_ids, segment_ids), backend=backend("indexer_loss"))
      return AttentionOutput(self.o_proj(out.reshape(B, T, -1)), None, indexer_loss)
    if self.indexer is None and shared_indices is None:
      raise ValueError("a layer without its own indexer needs shared_indices from a full layer.")
    chunk = cfg.query_chunk(T)
    k, index_k = self.keys(x, positions)
    # Every query chunk adds to the keys' gradients: sum them in f32, not in the keys' dtype.
    keys = st.summed_in_f32((k, index_k)) if chunk else lambda: (k, index_k)
    query_rows = self.query_rows(keys, segment_ids, backends)
    rows = lambda xs: _without_grads(query_rows(*xs))

    if not chunk:
      out, indices, indexer_loss, _, rescued = rows((x, positions, segment_ids, 0, shared_indices))
      return AttentionOutput(out, indices, indexer_loss, rescued)
    split = lambda a: None if a is None else st.to_blocks(a, 1, chunk)  # [T // chunk, B, chunk, ...]
    starts = jnp.arange(T // chunk, dtype=jnp.int32) * chunk
    # Without remat, lax.map would keep every chunk's residuals, the [B, T, H, ...] arrays chunking
    # avoids; scan already keeps iterations apart, so CSE prevention is not needed. Each chunk keeps
    # only its selection (see ModelConfig.query_chunk; the enclosing layer's policy must agree).
    out, indices, losses, rows_counted, rescued = jax.lax.map(
        remat.remat(rows, cfg.remat_policy, prevent_cse=False, save_attention=False),
        (split(x), split(positions), split(segment_ids), starts, split(shared_indices)))
    indexer_loss = None
    if losses is not None:  # the mean over all counted rows, from the chunks' means
      n = rows_counted.sum()
      indexer_loss = jnp.sum(losses * rows_counted.astype(losses.dtype)) / jnp.maximum(n, 1).astype(losses.dtype)
    return AttentionOutput(st.from_blocks(out, 1, T), st.from_blocks(indices, 1, T), indexer_loss,
                           None if rescued is None else rescued.sum())


def _without_grads(rows_out):
  """`query_rows`' result without its gradient sums (the unchunked layer's own autodiff computes them)."""
  out, indices, loss, rows_counted, _, rescued = rows_out
  return out, indices, loss, rows_counted, rescued
