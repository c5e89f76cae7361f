"""Tests for `hyscale_jax.ops.indexer_loss` (sparse and dense forms) against tests/oracles.py."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops import indexer_loss, sparse_attention
from hyscale_jax.ops.indexer_loss import indexer_loss_reference

try:
  from tests.oracles import indexer_loss_grads_oracle, indexer_loss_oracle, visibility
except ImportError:  # tests/ itself is on sys.path
  from oracles import indexer_loss_grads_oracle, indexer_loss_oracle, visibility

_INDEX_SCALE = 0.5


def _normal(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, with_weights):
  """(index_q, index_k, index_weights | None, attn_q, attn_k) and the attention scale."""
  iw = _normal(rng, B, T, HI) if with_weights else None
  return (_normal(rng, B, T, HI, DI), _normal(rng, B, S, DI), iw, _normal(rng, B, T, H, Dk),
          _normal(rng, B, S, G, Dk)), Dk**-0.5


def _sparse_indices(rng, B, T, S, K):
  """Random selections with duplicates, -1, out-of-range entries and one empty row."""
  idx = rng.integers(0, S, size=(B, T, K)).astype(np.int32)
  idx[:, :, 1] = idx[:, :, 0]
  idx[:, ::2, -1] = -1
  idx[:, 1::3, -2] = S + 1
  idx[0, 2, :] = -1
  return jnp.asarray(idx)


def _attention_lse(attn_q, attn_k, idx, scale, sinks=None):
  """The lse that `sparse_attention` returns on the same selection (the realistic teacher input)."""
  v = jnp.ones(attn_k.shape[:3] + (1,), attn_k.dtype)
  return sparse_attention(attn_q, attn_k, v, idx, scale=scale, sinks=sinks)[1]


def _np(x):
  return None if x is None else np.asarray(x, np.float64)


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


@functools.partial(jax.jit, static_argnames=("attn_scale", "compress_ratio", "chunks", "backend"))
def _loss_and_grads(iq, ik, iw, aq, ak, alse, idx, q_offset, segment_ids, *, attn_scale,
                    compress_ratio, chunks, backend="auto"):
  """(loss, grads w.r.t. the indexer inputs) from the public op on `backend` (chunks=None) or the reference."""

  def f(iq, ik, iw):
    kw = dict(attn_scale=attn_scale, index_scale=_INDEX_SCALE, compress_ratio=compress_ratio,
              q_offset=q_offset, segment_ids=segment_ids)
    if chunks is None:
      return indexer_loss(iq, ik, iw, aq, ak, alse, idx, **kw, backend=backend)
    return indexer_loss_reference(iq, ik, iw, aq, ak, alse, idx, query_chunk=chunks[0],
                                  key_chunk=chunks[1], **kw)

  return jax.value_and_grad(f, argnums=(0, 1, 2) if iw is not None else (0, 1))(iq, ik, iw)


def _check_against_oracle(inputs, alse, idx, attn_scale, chunk_list, q_offset=0, compress_ratio=1,
                          segment_ids=None, backend="auto"):
  iq, ik, iw, aq, ak = inputs
  okw = dict(index_scale=_INDEX_SCALE, attn_scale=attn_scale, compress_ratio=compress_ratio,
             q_offset=q_offset, segment_ids=segment_ids)
  args64 = (_np(iq), _np(ik), _np(iw), _np(aq), _np(ak), _np(alse),
            None if idx is None else np.asarray(idx))
  want_loss = indexer_loss_oracle(*args64, **okw)
  want_grads = [g for g in indexer_loss_grads_oracle(*args64, **okw) if g is not None]
  assert want_loss > 1e-3  # a real, non-trivial loss
  seg = None if segment_ids is None else tuple(jnp.asarray(s) for s in segment_ids)
  for chunks in chunk_list:
    loss, grads = _loss_and_grads(iq, ik, iw, aq, ak, alse, idx, q_offset, seg,
                                  attn_scale=attn_scale, compress_ratio=compress_ratio, chunks=chunks,
                                  backend=backend)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6, err_msg=str(chunks))
    assert len(grads) == len(want_grads)
    for name, g, w in zip(("d_index_q", "d_index_k", "d_index_weights"), grads, want_grads):
      assert g.shape == w.shape and np.isfinite(np.asarray(g)).all(), (name, chunks)
      assert _rel_err(g, w) < 1e-4, (name, chunks, _rel_err(g, w))


# name -> (B, T, S, HI, DI, H, G, Dk, K, with_weights, with_sinks)
_SPARSE_CASES = {
    "weights": (2, 11, 16, 2, 8, 2, 1, 8, 6, True, False),
    "no_weights_gqa": (1, 11, 9, 3, 4, 4, 2, 8, 7, False, False),
    "lse_with_sinks": (1, 11, 9, 2, 4, 4, 2, 8, 7, True, True),
}


@pytest.mark.parametrize("case", list(_SPARSE_CASES))
def test_sparse_form_matches_oracle(case):
  B, T, S, HI, DI, H, G, Dk, K, with_weights, with_sinks = _SPARSE_CASES[case]
  rng = np.random.default_rng(0)
  inputs, attn_scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, with_weights)
  idx = _sparse_indices(rng, B, T, S, K)
  sinks = _normal(rng, H) + 1.0 if with_sinks else None  # a larger lse: the teacher is renormalised
  alse = _attention_lse(inputs[3], inputs[4], idx, attn_scale, sinks)
  _check_against_oracle(inputs, alse, idx, attn_scale, (None, (3, 5)))


def _dense_lse(aq, ak, attn_scale, offset, **vis_kw):
  """Per-head log-sum-exp over the visible keys, plus `offset` (a wider window's LSE); 0 if none."""
  aq, ak = _np(aq), _np(ak)
  B, T, H, _ = aq.shape
  S, G = ak.shape[1], ak.shape[2]
  logits = attn_scale * np.einsum("bthd,bshd->bths", aq, np.repeat(ak, H // G, axis=2))
  vis = visibility(B, T, S, **vis_kw)[:, :, None, :]
  m = np.where(vis, logits, -np.inf).max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  total = np.where(vis, np.exp(logits - m), 0.0).sum(-1)
  lse = np.where(total > 0, m[..., 0] + np.log(np.where(total > 0, total, 1.0)), 0.0)
  return jnp.asarray(lse + offset, jnp.float32)


def _seg_pair(B, T):
  q_seg = np.zeros((B, T), np.int32)
  q_seg[0, 5:] = 1
  q_seg[-1, 3:] = 1
  q_seg[-1, 9:] = 2
  kv_seg = q_seg.copy()
  kv_seg[0, 5:7] = 0  # rows 5, 6 of batch 0 see no key of their own segment
  return q_seg, kv_seg


# name -> (B, T, S, HI, DI, H, G, Dk, with_weights, lse_given, visibility kwargs)
_DENSE_CASES = {
    "basic_lse_none": (2, 13, 13, 2, 8, 2, 1, 8, True, False, {}),
    "lse_given_q_offset_s_gt_t": (1, 13, 18, 2, 4, 4, 2, 8, False, True, {"q_offset": 5}),
    "compress_ratio_4": (2, 17, 4, 2, 8, 2, 1, 8, True, False, {"compress_ratio": 4}),
    "compress_ratio_4_lse_given": (1, 17, 4, 2, 4, 4, 2, 8, True, True, {"compress_ratio": 4}),
    "segments_lse_given": (2, 13, 13, 2, 4, 2, 1, 4, True, True, {"segment_ids": _seg_pair(2, 13)}),
    "segments_lse_none": (2, 13, 13, 2, 4, 4, 2, 4, False, False, {"segment_ids": _seg_pair(2, 13)}),
}


@pytest.mark.parametrize("case", list(_DENSE_CASES))
def test_dense_form_matches_oracle(case):
  B, T, S, HI, DI, H, G, Dk, with_weights, lse_given, vis_kw = _DENSE_CASES[case]
  rng = np.random.default_rng(1)
  inputs, attn_scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, with_weights)
  alse = None
  if lse_given:
    offset = rng.uniform(0.0, 1.0, size=(B, T, H))
    alse = _dense_lse(inputs[3], inputs[4], attn_scale, offset, **vis_kw)
  _check_against_oracle(inputs, alse, None, attn_scale, (None, (4, 5), (3, 7)), **vis_kw)


@pytest.mark.parametrize("sparse", [True, False])
def test_gradient_at_relu_kink_matches_oracle(sparse):
  """Integer-valued indexer inputs put many dots exactly at 0, where relu'(0) = 0 (oracle, jax.nn.relu)."""
  rng = np.random.default_rng(6)
  B, T, S, HI, DI, H, G, Dk = 1, 9, 9, 2, 4, 2, 1, 8
  (_, _, iw, aq, ak), attn_scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, True)
  iq = jnp.asarray(rng.integers(-1, 2, (B, T, HI, DI)), jnp.float32)
  ik = jnp.asarray(rng.integers(-1, 2, (B, S, DI)), jnp.float32)
  dots = np.einsum("bthd,bsd->bths", np.asarray(iq), np.asarray(ik))
  assert (dots == 0).mean() > 0.1 and (dots > 0).any()
  idx = _sparse_indices(rng, B, T, S, 6) if sparse else None
  alse = _attention_lse(aq, ak, idx, attn_scale) if sparse else None
  _check_against_oracle((iq, ik, iw, aq, ak), alse, idx, attn_scale, (None,))


@pytest.mark.parametrize("sparse", [True, False])
def test_teacher_is_detached(sparse):
  rng = np.random.default_rng(2)
  B, T, S, H, G, Dk = 1, 9, 9, 2, 1, 4
  (iq, ik, iw, aq, ak), attn_scale = _make_inputs(rng, B, T, S, 2, 4, H, G, Dk, True)
  idx = _sparse_indices(rng, B, T, S, 5) if sparse else None
  alse = _attention_lse(aq, ak, idx, attn_scale) if sparse else _dense_lse(aq, ak, attn_scale, 0.3)

  def f(aq, ak, alse):
    return indexer_loss(iq, ik, iw, aq, ak, alse, idx, attn_scale=attn_scale, index_scale=0.5)

  assert float(f(aq, ak, alse)) > 1e-3
  for g in jax.grad(f, argnums=(0, 1, 2))(aq, ak, alse):
    assert np.isfinite(np.asarray(g)).all() and not np.asarray(g).any()


@pytest.mark.parametrize("sparse", [True, False])
def test_loss_vanishes_when_indexer_equals_teacher(sparse):
  """HI = H = 1, unit weights, identical q/k, all dots positive: softmax(I) is the teacher."""
  rng = np.random.default_rng(3)
  B, T, S, D, scale = 2, 9, 9, 4, 0.4
  q = jnp.abs(_normal(rng, B, T, 1, D)) + 0.1
  k = jnp.abs(_normal(rng, B, S, 1, D)) + 0.1
  ones = jnp.ones((B, T, 1), jnp.float32)
  idx = _sparse_indices(rng, B, T, S, 6) if sparse else None
  alse = _attention_lse(q, k, idx, scale) if sparse else None

  def f(iq, ik, iw):
    return indexer_loss(iq, ik, iw, q, k, alse, idx, attn_scale=scale, index_scale=scale)

  loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(q, k[:, :, 0, :], ones)
  assert abs(float(loss)) < 1e-6
  for g in grads:
    assert np.abs(np.asarray(g)).max() < 1e-5
  # Sanity: perturbing the indexer makes the loss clearly positive.
  assert float(f(q * jnp.linspace(0.5, 2.0, D), k[:, :, 0, :], ones)) > 1e-4


@pytest.mark.parametrize("q_offset", [0, 4])
def test_sparse_over_visible_keys_equals_dense(q_offset):
  rng = np.random.default_rng(4)
  B, T, S, H, G, Dk = 2, 11, 15, 2, 1, 8
  inputs, attn_scale = _make_inputs(rng, B, T, S, 2, 4, H, G, Dk, True)
  vis = visibility(B, T, S, q_offset=q_offset)
  idx = np.full((B, T, S), -1, np.int32)
  for b in range(B):
    for t in range(T):
      keys = rng.permutation(np.flatnonzero(vis[b, t]))  # order within a row must not matter
      idx[b, t, :keys.size] = keys
  idx = jnp.asarray(idx)
  alse = _attention_lse(inputs[3], inputs[4], idx, attn_scale)
  common = dict(attn_scale=attn_scale, compress_ratio=1, chunks=(3, 4))
  sparse_loss, sparse_grads = _loss_and_grads(*inputs, alse, idx, q_offset, None, **common)
  dense_loss, dense_grads = _loss_and_grads(*inputs, None, None, q_offset, None, **common)
  assert float(dense_loss) > 1e-3
  np.testing.assert_allclose(float(sparse_loss), float(dense_loss), rtol=1e-5, atol=1e-6)
  for gs, gd in zip(sparse_grads, dense_grads):
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gd), rtol=1e-5, atol=1e-5)


_B, _T, _S, _HI, _DI, _H, _G, _Dk, _K = 2, 4, 6, 2, 4, 2, 1, 8, 3
_GOOD = dict(
    index_q=jnp.ones((_B, _T, _HI, _DI)), index_k=jnp.ones((_B, _S, _DI)),
    index_weights=jnp.ones((_B, _T, _HI)), attn_q=jnp.ones((_B, _T, _H, _Dk)),
    attn_k=jnp.ones((_B, _S, _G, _Dk)), attn_lse=jnp.zeros((_B, _T, _H)),
    indices=jnp.zeros((_B, _T, _K), jnp.int32),
)
# name -> (overrides, argument name, offending shape/dtype fragment)
_BAD_INPUTS = {
    "index_k_batch": (dict(index_k=jnp.ones((1, _S, _DI))), "index_k", "index_k.shape=(1, 6, 4)"),
    "index_k_di": (dict(index_k=jnp.ones((_B, _S, _DI + 1))), "index_k", "index_k.shape=(2, 6, 5)"),
    "index_q_rank": (dict(index_q=jnp.ones((_B, _T, _DI))), "index_q", "index_q.shape=(2, 4, 4)"),
    "attn_q_batch": (dict(attn_q=jnp.ones((1, _T, _H, _Dk))), "attn_q", "attn_q.shape=(1, 4, 2, 8)"),
    "weights_shape": (dict(index_weights=jnp.ones((_B, _T, _HI + 1))),
        "index_weights", "index_weights.shape=(2, 4, 3)"),
    "attn_k_s": (dict(attn_k=jnp.ones((_B, _S + 1, _G, _Dk))), "attn_k", "attn_k.shape=(2, 7, 1, 8)"),
    "attn_k_batch": (dict(attn_k=jnp.ones((1, _S, _G, _Dk))), "attn_k", "attn_k.shape=(1, 6, 1, 8)"),
    "attn_lse_shape": (dict(attn_lse=jnp.zeros((_B, _T, _H + 1))), "attn_lse", "attn_lse.shape=(2, 4, 3)"),
    "indices_float": (dict(indices=jnp.zeros((_B, _T, _K), jnp.float32)), "indices", "indices.dtype=float32"),
    "indices_shape": (dict(indices=jnp.zeros((_B, _T + 1, _K), jnp.int32)),
        "indices", "indices.shape=(2, 5, 3)"),
    "sparse_without_lse": (dict(attn_lse=None), "attn_lse", "sparse form"),
}


def _call(args, **kw):
  names = ("index_q", "index_k", "index_weights", "attn_q", "attn_k", "attn_lse", "indices")
  return indexer_loss(*(args[n] for n in names), attn_scale=1.0, **kw)


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
def test_bad_input_raises_value_error(case):
  overrides, arg, fragment = _BAD_INPUTS[case]
  with pytest.raises(ValueError, match=re.escape(arg)) as info:
    _call(dict(_GOOD, **overrides))
  assert fragment in str(info.value), str(info.value)


_SEG = jnp.zeros((_B, _T), jnp.int32)
_KV_SEG = jnp.zeros((_B, _S), jnp.int32)


@pytest.mark.parametrize("segment_ids,fragment", [
    ((_SEG[:1], _KV_SEG), "(1, 4)"),  # would silently broadcast batch 0's ids over the batch
    ((_SEG, _KV_SEG[:, :4]), "(2, 4)"),  # kv_seg shorter than S: silently padded
    ((jnp.zeros((_B, _T + 3), jnp.int32), _KV_SEG), "(2, 7)"),
    ((_SEG.astype(jnp.float32), _KV_SEG), "float32"),
])
def test_bad_segment_ids_raise_value_error(segment_ids, fragment):
  """The dense form's segment_ids are checked as in `flash_topk` (DESIGN: ValueError on bad shapes)."""
  with pytest.raises(ValueError, match="segment_ids") as info:
    _call(dict(_GOOD, indices=None, attn_lse=None), segment_ids=segment_ids)
  assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("variant", ["xla_baseline", "grad_in_forward"])
def test_sparse_variants_match_reference(variant):
  """The Megatron-style rescoring backward and the forward-pass gradient: same loss and gradients."""
  rng = np.random.default_rng(3)
  B, T, S, HI, DI, H, G, Dk, K = 2, 12, 12, 3, 8, 4, 2, 8, 5
  (iq, ik, iw, aq, ak), scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, True)
  idx = _sparse_indices(rng, B, T, S, K)
  alse = _attention_lse(aq, ak, idx, scale)
  kw = dict(attn_scale=scale, index_scale=_INDEX_SCALE)
  run = (dict(backend="xla_baseline") if variant == "xla_baseline" else dict(grad_in_forward=True))
  f = lambda run: lambda q, k, w: 3.0 * indexer_loss(q, k, w, aq, ak, alse, idx, **kw, **run)
  want = jax.value_and_grad(f(dict(backend="reference")), argnums=(0, 1, 2))(iq, ik, iw)
  got = jax.value_and_grad(f(run), argnums=(0, 1, 2))(iq, ik, iw)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_xla_baseline_dense_form_is_the_reference():
  """`megatron_style` runs the dense warm-up too: xla_baseline's dense form is the streamed reference."""
  rng = np.random.default_rng(4)
  B, T, S, HI, DI, H, G, Dk = 1, 10, 10, 2, 8, 4, 2, 8
  (iq, ik, iw, aq, ak), scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, True)
  f = lambda backend: lambda q, k, w: indexer_loss(q, k, w, aq, ak, None, None, attn_scale=scale,
                                                   index_scale=_INDEX_SCALE, backend=backend)
  want = jax.value_and_grad(f("reference"), argnums=(0, 1, 2))(iq, ik, iw)
  got = jax.value_and_grad(f("xla_baseline"), argnums=(0, 1, 2))(iq, ik, iw)
  assert float(want[0]) > 0
  np.testing.assert_array_equal(got[0], want[0])
  for g, w in zip(got[1], want[1]):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("blocks", [None, (4, 8)])
def test_pallas_dense_form_matches_oracle(blocks, monkeypatch):
  """The pallas backend's dense form is the reference's streaming in GPU-sized tiles (no kernel, so it
  runs here): at its own tiles (one block at this T) and at small ones over a ragged length."""
  from hyscale_jax.ops.indexer_loss import api  # noqa: PLC0415

  if blocks is not None:
    monkeypatch.setattr(api, "GPU_DENSE_BLOCKS", blocks)
  rng = np.random.default_rng(9)
  B, T, HI, DI, H, G, Dk = 2, 13, 2, 8, 4, 2, 8
  inputs, scale = _make_inputs(rng, B, T, T, HI, DI, H, G, Dk, True)
  _check_against_oracle(inputs, None, None, scale, (None,), q_offset=2, segment_ids=_seg_pair(B, T),
                        backend="pallas")


@pytest.mark.parametrize("context", [1, 4])
def test_with_row_count_returns_the_rows_with_a_support(context):
  """`with_row_count=True`: the same loss, and the rows counted (non-empty support), summed over a
  context mesh's shards; this is what lets callers combine means over row chunks."""
  rng = np.random.default_rng(7)
  B, T, S, HI, DI, H, G, Dk, K = 2, 16, 16, 2, 8, 4, 1, 8, 5
  (iq, ik, iw, aq, ak), scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, True)
  idx = _sparse_indices(rng, B, T, S, K)
  idx = idx.at[1, 9:13].set(-1).at[0, 5].set(S + 2)  # empty supports: 1 + 4 + 1 rows
  alse = _attention_lse(aq, ak, idx, scale)
  call = lambda **kw: indexer_loss(iq, ik, iw, aq, ak, alse, idx, attn_scale=scale, index_scale=_INDEX_SCALE, **kw)
  want = call()
  mesh = jax.make_mesh((context,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:context])
  with jax.set_mesh(mesh):
    loss, rows = call(with_row_count=True)
  assert int(rows) == B * T - 6
  np.testing.assert_allclose(loss, want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Block form (QSA): index key j stands for the attention keys key_tokens[t, j, :], pooled.


def _block_form_inputs(rng, B=2, T=13, blk=4, K=3, HI=2, DI=8, H=4, G=2, Dk=8):
  """QSA-like inputs: blocks of `blk` tokens, causal block selections with -1, a repeated block,
  an empty row, a row of blocks without tokens (zero teacher mass), tokens of another document
  masked, a row whose student scores are all zero (the ReLU plateau: a tie between two blocks whose
  teacher masses differ), and the sparse attention's lse over the expanded tokens."""
  N = T // blk
  (iq, ik, _, aq, ak), scale = _make_inputs(rng, B, T, N, HI, DI, H, G, Dk, False)
  ak = _normal(rng, B, T, G, Dk)  # attention keys are the T tokens
  iq = iq.at[1, 7].set(0.0)  # row (1, 7): relu(<q, k>) = 0 at every block, a tie on the zero plateau
  t = np.arange(T)[None, :, None]
  blocks = rng.integers(0, N, (B, T, K))
  blocks[:, :, 1] = blocks[:, :, 0]  # a repeated block: its own support slot, as in the sparse form
  blocks = np.where((blocks + 1) * blk <= t + 1, blocks, -1)
  blocks[0, 12, :] = -1  # an empty row
  blocks[1, 7] = blocks[0, 9] = [0, 1, -1]  # two distinct blocks: the plateau row's tie is a real one
  tokens = blocks[..., None] * blk + np.arange(blk)
  tokens = np.where(blocks[..., None] >= 0, tokens, -1)
  tokens[0, 9] = -1  # valid blocks without a token (zero teacher mass): the row is not counted
  tokens[1, :, :, 0] = np.where(tokens[1, :, :, 0] == 4, -1, tokens[1, :, :, 0])  # another document's token
  blocks, tokens = jnp.asarray(blocks, jnp.int32), jnp.asarray(tokens, jnp.int32)
  attn_idx = tokens.reshape(B, T, K * blk)
  alse = _attention_lse(aq, ak, attn_idx, scale)
  return (iq, ik, aq, ak, alse, blocks, tokens), scale


@pytest.mark.parametrize("pool", ["sum", "max"])
@pytest.mark.parametrize("variant", ["reference", "chunked", "xla_baseline", "grad_in_forward", "pallas_teacher"])
def test_block_form_matches_oracle(pool, variant):
  """The block form (QSA's selected blocks) against the float64 oracle: loss and gradients, for the
  reference, row chunks, the Megatron-style rescoring backward, the forward-pass gradient, and the
  Pallas teacher kernel (interpret mode) pooled over each block's tokens."""
  (iq, ik, aq, ak, alse, blocks, tokens), scale = _block_form_inputs(np.random.default_rng(11))
  okw = dict(index_scale=_INDEX_SCALE, attn_scale=scale, key_tokens=np.asarray(tokens), key_pool=pool)
  args64 = (_np(iq), _np(ik), None, _np(aq), _np(ak), _np(alse), np.asarray(blocks))
  want_loss = indexer_loss_oracle(*args64, **okw)
  want_grads = indexer_loss_grads_oracle(*args64, **okw)[:2]
  assert want_loss > 1e-3
  kw = dict(attn_scale=scale, index_scale=_INDEX_SCALE, key_tokens=tokens, key_pool=pool)
  if variant == "chunked":
    f = lambda q, k: indexer_loss_reference(q, k, None, aq, ak, alse, blocks, query_chunk=5, **kw)
  elif variant == "pallas_teacher":
    from pallas_kernels.sparse_attention import attention_teacher_pallas  # noqa: PLC0415
    teacher = functools.partial(attention_teacher_pallas, interpret=True)
    f = lambda q, k: indexer_loss_reference(q, k, None, aq, ak, alse, blocks, query_chunk=8,
                                            teacher_mass=teacher, **kw)
  else:
    run = dict(grad_in_forward=True) if variant == "grad_in_forward" else dict(backend=variant)
    f = lambda q, k: indexer_loss(q, k, None, aq, ak, alse, blocks, **kw, **run)
  loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(iq, ik)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
  for name, g, w in zip(("d_index_q", "d_index_k"), grads, want_grads):
    assert g.shape == w.shape and np.isfinite(np.asarray(g)).all(), name
    assert _rel_err(g, w) < 1e-4, (name, _rel_err(g, w))
  assert not np.asarray(grads[0])[1, 7].any()  # the ReLU plateau row: no gradient through relu'(0)
  if variant == "reference":  # rows counted: a valid block with at least one token
    _, rows = indexer_loss(iq, ik, None, aq, ak, alse, blocks, with_row_count=True, **kw)
    has_token = ((np.asarray(tokens) >= 0).any(-1) & (np.asarray(blocks) >= 0)).any(-1)
    assert int(rows) == int(has_token.sum()) and not has_token[0, 9] and has_token[1, 7]


@pytest.mark.parametrize("pool", ["sum", "max"])
def test_block_form_under_a_context_mesh(pool):
  """Rows (and their key_tokens) split over a 4-way context mesh: the same loss and gradients."""
  (iq, ik, aq, ak, alse, blocks, tokens), scale = _block_form_inputs(np.random.default_rng(13), T=16)
  f = lambda q, k: indexer_loss(q, k, None, aq, ak, alse, blocks, attn_scale=scale, index_scale=_INDEX_SCALE,
                                key_tokens=tokens, key_pool=pool)
  want = jax.value_and_grad(f, argnums=(0, 1))(iq, ik)
  mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(iq, ik)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_block_form_with_one_token_per_block_is_the_sparse_form():
  """key_tokens = indices[..., None] (blocks of one key): exactly the sparse form."""
  rng = np.random.default_rng(12)
  (iq, ik, iw, aq, ak), scale = _make_inputs(rng, 2, 9, 9, 2, 8, 4, 2, 8, True)
  idx = _sparse_indices(rng, 2, 9, 9, 5)
  alse = _attention_lse(aq, ak, idx, scale)
  f = lambda **kw: jax.value_and_grad(
      lambda q, k: indexer_loss(q, k, iw, aq, ak, alse, idx, attn_scale=scale, **kw), argnums=(0, 1))(iq, ik)
  (want, want_g), (got, got_g) = f(), f(key_tokens=jnp.where(idx < 9, idx, -1)[..., None], key_pool="max")
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides,arg,fragment", [
    (dict(key_tokens=jnp.zeros((_B, _T, _K, 4), jnp.float32)), "key_tokens", "key_tokens.dtype=float32"),
    (dict(key_tokens=jnp.zeros((_B, _T, _K + 1, 4), jnp.int32)), "key_tokens", "key_tokens.shape=(2, 4, 4, 4)"),
    (dict(key_tokens=jnp.zeros((_B, _T, _K), jnp.int32)), "key_tokens", "key_tokens.shape=(2, 4, 3)"),
    (dict(key_tokens=jnp.zeros((_B, _T, _K, 0), jnp.int32)), "key_tokens", "empty axis"),
    (dict(key_tokens=jnp.zeros((_B, _T, _K, 4), jnp.int32), indices=None, attn_lse=None), "key_tokens",
     "needs indices"),
    (dict(key_tokens=jnp.zeros((_B, _T, _K, 4), jnp.int32), key_pool="mean"), "key_pool", "'mean'"),
])
def test_bad_block_form_raises_value_error(overrides, arg, fragment):
  args = dict(_GOOD, **{k: v for k, v in overrides.items() if k in _GOOD})
  with pytest.raises(ValueError, match=re.escape(arg)) as info:
    _call(args, **{k: v for k, v in overrides.items() if k not in _GOOD})
  assert fragment in str(info.value), str(info.value)
