"""DeepSeek-V4: compressors, SWA/CSA/HCA attention against a float64 oracle, the invariants of
architectures.md §3.6, selection replay, parameter counts, and two-stage training with resume."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import deepseek_v4_flash
from hyscale_jax import models, ops, remat
from hyscale_jax.layers.compressed_attention import CompressedSparseAttention, window_indices
from hyscale_jax.layers.compressor import Compressor, rope_tail
from hyscale_jax.model_config import ModelConfig

try:
  from tests.jaxpr_tools import equations
  from tests.lm_runs import assert_trains_both_stages_and_resumes, small_lm_config
except ImportError:  # tests/ itself is on sys.path
  from jaxpr_tools import equations
  from lm_runs import assert_trains_both_stages_and_resumes, small_lm_config

_SMALL = ModelConfig(
    architecture="deepseek_v4", vocab_size=64, d_model=32, n_layers=4, first_k_dense=0, n_heads=4,
    head_dim=16, qk_rope_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=6,
    compress_ratios=(0, 4, 8, 4), index_n_heads=2, index_head_dim=16, index_rope_dim=4, index_topk=3,
    n_routed_experts=4, experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="sqrtsoftplus",
    routed_scaling=1.5, rms_eps=1e-6, rope_theta=10000.0, compress_rope_theta=40000.0)
B, T = 2, 32


def _x(seed=0, shape=(B, T, _SMALL.d_model)):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _positions(offset=0):
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + offset, (B, T))


def _layer(kind, ratio, cfg=_SMALL, seed=0):
  return CompressedSparseAttention(cfg, kind, ratio, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("overlap", [False, True])
def test_compressed_entries_are_causal(overlap):
  m = 4
  comp = Compressor(_SMALL.d_model, 8, m, overlap=overlap, rope_dim=4, rope_theta=1e4, rngs=nnx.Rngs(1))
  comp.position_bias[...] = jax.random.normal(jax.random.key(5), comp.position_bias.shape)
  seg = jnp.zeros((B, T), jnp.int32)
  base, _ = comp(_x(), _positions(), seg)
  assert base.shape == (B, T // m, 8)
  for p in (5, 13, 31):
    x = _x().at[:, p].add(3.0)
    got, _ = comp(x, _positions(), seg)
    changed = np.abs(np.asarray(got - base)).max(axis=(0, 2)) > 1e-6
    w = np.arange(T // m)
    # entry w may depend only on tokens < (w + 1) * m; the entry holding p must see it
    assert not changed[(w + 1) * m <= p].any(), (p, changed)
    assert changed[p // m]
    if overlap and p // m + 1 < T // m:
      assert changed[p // m + 1]  # the next entry's overlap slots cover window p // m too


def test_compressor_ignores_other_documents():
  comp = Compressor(_SMALL.d_model, 8, 4, overlap=True, rope_dim=4, rope_theta=1e4, rngs=nnx.Rngs(2))
  seg = jnp.broadcast_to((jnp.arange(T) >= 10).astype(jnp.int32), (B, T))  # a document starts at 10
  base, entry_seg = comp(_x(), _positions(), seg)
  assert (np.asarray(entry_seg[0]) == (np.arange(T // 4) * 4 + 3 >= 10)).all()
  # Tokens 8, 9 end document 0 inside window 2, whose entry belongs to document 1: no entry uses them.
  got, _ = comp(_x().at[:, 8:10].add(5.0), _positions(), seg)
  np.testing.assert_allclose(got, base, atol=1e-6)
  got, _ = comp(_x().at[:, 10].add(5.0), _positions(), seg)  # document 1's first token: entries 2, 3
  changed = np.abs(np.asarray(got - base)).max(axis=(0, 2)) > 1e-5
  assert changed.tolist() == [False, False, True, True] + [False] * (T // 4 - 4)


def _oracle_core(q, keys, visible, scale, sink):
  """float64 softmax attention with a sink in the denominator: q [B,T,H,D], keys [B,S,D], visible [B,T,S]."""
  q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
  logits = np.einsum("bthd,bsd->bths", q, keys) * scale
  logits = np.where(visible[:, :, None, :], logits, -np.inf)
  top = np.maximum(logits.max(-1, keepdims=True), np.asarray(sink, np.float64)[None, None, :, None])
  p = np.exp(logits - top)
  denom = p.sum(-1, keepdims=True) + np.exp(np.asarray(sink, np.float64)[None, None, :, None] - top)
  return np.einsum("bths,bsd->bthd", p / denom, keys)


@pytest.mark.parametrize("kind, ratio", [("swa", 0), ("hca", 8), ("csa", 4)])
@pytest.mark.parametrize("sink", [-np.inf, 0.7])
def test_attention_matches_float64_oracle(kind, ratio, sink):
  layer = _layer(kind, ratio)
  layer.attn_sink[...] = jnp.full((_SMALL.n_heads,), sink, jnp.float32)
  seg = jnp.broadcast_to((jnp.arange(T) >= 19).astype(jnp.int32), (B, T))
  positions = jnp.where(seg == 0, jnp.arange(T), jnp.arange(T) - 19).astype(jnp.int32)
  x = _x(3)
  out = layer(x, positions, seg, dense=True).out  # CSA in the warm-up form: every visible entry
  _, q, kv = layer.queries_and_kv(x, positions)
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  segn = np.asarray(seg)
  visible = ((s <= t) & (s > t - _SMALL.sliding_window))[None] & (segn[:, :, None] == segn[:, None, :])
  keys = np.asarray(kv)
  if ratio:
    entries, entry_seg = layer.compressor(x, positions, seg)
    w = np.arange(T // ratio)[None, :]
    vis_c = ((w + 1) * ratio <= t + 1)[None] & (np.asarray(entry_seg)[:, None, :] == segn[:, :, None])
    visible = np.concatenate([visible, vis_c], axis=-1)
    keys = np.concatenate([keys, np.asarray(entries)], axis=1)
  core = _oracle_core(q, keys, visible, layer.scale, np.full(_SMALL.n_heads, sink))
  core = rope_tail(jnp.asarray(core, jnp.float32), -positions, rope_dim=_SMALL.qk_rope_dim,
                   theta=layer.theta)
  low = jnp.einsum("btgi,gio->btgo", core.reshape(B, T, _SMALL.o_groups, -1), layer.wo_a[...])
  want = layer.wo_b(low.reshape(B, T, -1))
  np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5)


def test_csa_with_topk_covering_every_entry_equals_dense_over_entries():
  cfg = dataclasses.replace(_SMALL, index_topk=T // 4)
  layer = _layer("csa", 4, cfg)
  seg = jnp.zeros((B, T), jnp.int32)
  sparse = layer(_x(4), _positions(), seg)
  dense = layer(_x(4), _positions(), seg, dense=True)
  assert sparse.indices.shape == (B, T, T // 4)
  np.testing.assert_allclose(sparse.out, dense.out, rtol=1e-5, atol=1e-6)
  assert np.isfinite(float(sparse.indexer_loss)) and np.isfinite(float(dense.indexer_loss))


def test_selected_indices_are_causal_and_the_window_is_always_present():
  layer = _layer("csa", 4)
  seg = jnp.zeros((B, T), jnp.int32)
  out = layer(_x(5), _positions(), seg)
  sel = np.asarray(out.indices)
  t = np.arange(T)[None, :, None]
  assert ((sel == -1) | ((sel + 1) * 4 <= t + 1)).all()
  n_visible = np.minimum((np.arange(T) + 1) // 4, _SMALL.index_topk)
  assert ((sel >= 0).sum(-1) == n_visible[None]).all()
  window = np.asarray(window_indices(seg, _SMALL.sliding_window))
  assert ((window == -1) | (window <= t)).all() and (window[:, :, -1] == np.arange(T)).all()


@pytest.mark.parametrize("kind, ratio", [("swa", 0), ("hca", 8)])
def test_derotation_makes_the_output_depend_on_relative_positions_only(kind, ratio):
  layer = _layer(kind, ratio)
  seg = jnp.zeros((B, T), jnp.int32)
  a = layer(_x(6), _positions(), seg).out
  b = layer(_x(6), _positions(offset=37), seg).out
  np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _visible_entry_indices(segment_ids, entry_segments, ratio):
  """i32[B, T, S]: every compressed entry w visible to t ((w+1)*ratio <= t+1, same document), else -1."""
  T, S = segment_ids.shape[1], entry_segments.shape[1]
  w = jnp.arange(S)
  causal = (w[None, :] + 1) * ratio <= jnp.arange(T)[:, None] + 1  # [T, S]
  visible = causal[None] & (entry_segments[:, None, :] == segment_ids[:, :, None])
  return jnp.where(visible, w[None, None, :], -1).astype(jnp.int32)


def _listed_entries_layer(layer, x, positions, seg):
  """The layer as it was before issue 19 (the oracle of the streamed path): one `sparse_attention`
  over [kv ; entries] whose index lists hold the window and every visible entry ([B, T, W + S])."""
  c_q, q, kv = layer.queries_and_kv(x, positions)
  entries, entry_seg = layer.compressor(x, positions, seg)
  chosen = _visible_entry_indices(seg, entry_seg, layer.ratio)
  window = window_indices(seg, layer.cfg.sliding_window)
  indices = jnp.concatenate([window, jnp.where(chosen >= 0, chosen + x.shape[1], -1)], -1)
  keys = jnp.concatenate([kv, entries], axis=1)[:, :, None]
  out, lse = ops.sparse_attention(q, keys, None, indices, scale=layer.scale, sinks=layer.attn_sink[...])
  loss = None
  if layer.indexer is not None:
    loss = ops.indexer_loss(*layer.indexer(x, c_q, positions, seg), q, entries[:, :, None], lse, None,
                            attn_scale=layer.scale, index_scale=layer.indexer.score_scale,
                            compress_ratio=layer.ratio, segment_ids=(seg, entry_seg))
  return layer.project_out(out, positions), loss


@pytest.mark.parametrize("kind, ratio", [("hca", 8), ("csa", 4)])
def test_streamed_entries_equal_listed_entries_in_values_and_gradients(kind, ratio):
  """HCA and the dense CSA warm-up (window by sparse_attention + every entry by causal_attention,
  merged with the sinks) equal one sparse_attention over listed entries: output, indexer loss and
  the gradients of every parameter and of x. Packed documents; tokens 0 .. ratio-2 and the second
  document's first token (18: its first entry ends at token 19) see no entry."""
  layer = _layer(kind, ratio, seed=3)
  layer.attn_sink[...] = jax.random.normal(jax.random.key(1), (_SMALL.n_heads,))
  seg = jnp.broadcast_to((jnp.arange(T) >= 18).astype(jnp.int32), (B, T))
  positions = jnp.where(seg == 0, jnp.arange(T), jnp.arange(T) - 18).astype(jnp.int32)
  _, entry_seg = layer.compressor(_x(7), positions, seg)
  sees_entry = np.asarray(_visible_entry_indices(seg, entry_seg, ratio) >= 0).any(-1)
  assert not sees_entry[:, : ratio - 1].any() and not sees_entry[:, 18].any() and sees_entry[:, 17].all()
  weights = jax.random.normal(jax.random.key(2), (B, T, _SMALL.d_model))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x, listed):
    module = nnx.merge(graphdef, params, rest)
    out, index_loss = _listed_entries_layer(module, x, positions, seg) if listed else (
        module(x, positions, seg, dense=True)[::2])
    return jnp.sum(out * weights) + (0.0 if index_loss is None else 10.0 * index_loss), (out, index_loss)

  grads = {listed: jax.grad(loss, (0, 1), has_aux=True)(params, _x(7), listed) for listed in (False, True)}
  (got, (got_out, got_index)), (want, (want_out, want_index)) = grads[False], grads[True]
  np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6)
  if kind == "csa":
    np.testing.assert_allclose(got_index, want_index, rtol=1e-5, atol=1e-7)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
    # f32 sums in another order: an absolute tolerance at the gradient's own scale.
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * float(np.abs(w).max()),
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("kind, ratio, dense", [("hca", 8, False), ("csa", 4, True)])
def test_streamed_entries_build_nothing_tokens_by_entries(kind, ratio, dense):
  """At T = 2048 (past causal_attention's 512-row query blocks) the layer's forward and backward hold no
  array with both a T and an S = T / ratio axis; the listed-entries oracle does ([B, T, W + S] indices)."""
  T_long = 2048
  S = T_long // ratio
  layer = _layer(kind, ratio)
  x = jnp.zeros((1, T_long, _SMALL.d_model), jnp.float32)
  positions = jnp.arange(T_long, dtype=jnp.int32)[None]
  seg = jnp.zeros((1, T_long), jnp.int32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def shapes(call):
    def total(params, x):
      out, index_loss = call(nnx.merge(graphdef, params, rest), x)
      return out.sum() + (0.0 if index_loss is None else index_loss)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(total, (0, 1)))(params, x)
    return {tuple(v.aval.shape) for e in equations(jaxpr) for v in (*e.invars, *e.outvars) if hasattr(v, "aval")}

  t_by_s = lambda shapes: [s for s in shapes if T_long in s and (S in s or S + _SMALL.sliding_window in s)]
  assert not t_by_s(shapes(lambda m, x: m(x, positions, seg, dense=dense)[::2]))
  assert t_by_s(shapes(lambda m, x: _listed_entries_layer(m, x, positions, seg)))  # the check sees the old path


@pytest.mark.gpu_only
@pytest.mark.parametrize("kind, ratio", [("hca", 128), ("csa", 4)])
def test_streamed_entries_on_gpu_match_listed_entries_in_bf16(kind, ratio):
  """On the GPU with the auto backends (Pallas sparse_attention for the window and for the listed
  entries; causal_attention's reference, since its Pallas kernel declines compressed keys) at
  T = 4096, bf16, 512-dim heads: the streamed path equals the listed one in output and gradients."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device")
  T_long = 4096
  cfg = dataclasses.replace(_SMALL, d_model=256, n_heads=16, head_dim=512, qk_rope_dim=64, q_lora_rank=128,
                            o_lora_rank=64, sliding_window=128, index_n_heads=8, index_head_dim=64,
                            index_rope_dim=16, dtype="bfloat16")
  layer = CompressedSparseAttention(cfg, kind, ratio, rngs=nnx.Rngs(0))
  layer.attn_sink[...] = jax.random.normal(jax.random.key(1), (cfg.n_heads,))
  x = jax.random.normal(jax.random.key(2), (1, T_long, cfg.d_model), jnp.bfloat16)
  seg = (jnp.arange(T_long) >= 1500).astype(jnp.int32)[None]
  positions = jnp.where(seg == 0, jnp.arange(T_long), jnp.arange(T_long) - 1500).astype(jnp.int32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  @functools.partial(jax.jit, static_argnums=2)
  def step(params, x, listed):
    def loss(params, x):
      module = nnx.merge(graphdef, params, rest)
      out = _listed_entries_layer(module, x, positions, seg)[0] if listed else module(x, positions, seg, dense=True).out
      return jnp.sum(out.astype(jnp.float32) ** 2), out
    return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)

  ((_, got_out), got), ((_, want_out), want) = step(params, x, False), step(params, x, True)
  np.testing.assert_allclose(np.float32(got_out), np.float32(want_out), atol=3e-2, rtol=3e-2)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
    g, w = np.float32(g), np.float32(w)
    assert np.abs(g - w).max() <= 3e-2 * np.abs(w).max(), jax.tree_util.keystr(path)


@pytest.mark.parametrize("kind, ratio", [("hca", 8), ("csa", 4)])
def test_streamed_entries_under_a_context_mesh_equal_one_device(kind, ratio):
  """Under a data x context mesh every op splits the queries and all-gathers the keys (entries too):
  same output, indexer loss and gradients as one device."""
  layer = _layer(kind, ratio, seed=4)
  seg = jnp.broadcast_to((jnp.arange(T) >= 18).astype(jnp.int32), (B, T))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    out, index_loss = nnx.merge(graphdef, params, rest)(x, _positions(), seg, dense=True)[::2]
    return jnp.sum(out**2) + (0.0 if index_loss is None else index_loss)

  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  want = step(params, _x(8))
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(step)(params, _x(8)))
    got = step(params, _x(8))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(np.asarray(b)).max()))


def _losses(model, tokens, dense=False):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def total(params):
    out = nnx.merge(graphdef, params, rest)(tokens, dense=dense)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean() + out.aux["indexer_loss"]

  return params, total


@pytest.mark.parametrize("policy, per_csa_layer", [("selection_replay", 1),
                                                   pytest.param("full", 2, marks=pytest.mark.slow)])  # CI time
def test_one_selection_per_csa_layer_under_selection_replay(policy, per_csa_layer):
  model = models.build(dataclasses.replace(_SMALL, remat_policy=policy), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, _SMALL.vocab_size)
  params, total = _losses(model, tokens)
  jaxpr = jax.make_jaxpr(jax.grad(total))(params)
  assert remat.count_named_equations(jaxpr, "flash_topk") == per_csa_layer * 2  # two CSA layers
  grads = jax.grad(total)(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_full_config_parameter_counts_and_layer_pattern():
  cfg = ModelConfig.from_config(deepseek_v4_flash.get_config("full").model)
  kinds = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
  assert kinds[:2] == ["swa", "swa"] and kinds.count("csa") == 21 and kinds.count("hca") == 20
  total, active = models.count_params(cfg)
  # Published: 284B total / 13B active. Measured: 284.3B / 13.80B (active includes the 0.53B
  # embedding and 0.53B LM head, and the 0.03B of mHC weights; MTP weights are not built).
  assert abs(total - 284e9) / 284e9 < 0.02, total
  assert abs(active - 13e9) / 13e9 < 0.07, active


def test_config_rejects_a_wrong_layer_pattern():
  with pytest.raises(ValueError, match="compress_ratios"):
    dataclasses.replace(_SMALL, compress_ratios=(0, 4))
  with pytest.raises(ValueError, match="o_groups"):
    dataclasses.replace(_SMALL, o_groups=3)


# CI time: resuming is the same code for every model (tests/test_reliability.py); V4's steps train in
# tests/test_step_modes.py's and tests/test_hyper_connections.py's tests.
@pytest.mark.slow
def test_trains_both_stages_and_resumes(tmp_path):
  # With the published model's features on: a hash-routed first layer and YaRN on the compressed layers.
  make = lambda steps: small_lm_config(deepseek_v4_flash.get_config, _SMALL, tmp_path, steps, n_hash_layers=1,
                                       rope_yarn_factor=16.0, rope_yarn_original_max_len=16,
                                       rope_yarn_attention_factor=1.0)
  assert_trains_both_stages_and_resumes(make, tmp_path / "run")


def test_hash_layers_in_scanned_groups_route_by_token_and_equal_unrolled():
  # Four HCA layers, the first two hash-routed: two scanned runs of two structurally equal layers; the
  # token ids reach the hash layers inside the scan.
  cfg = dataclasses.replace(_SMALL, compress_ratios=(8,) * 4, n_hash_layers=2, remat_policy="none",
                            rope_yarn_factor=16.0, rope_yarn_original_max_len=16)
  model = models.build(cfg, rngs=nnx.Rngs(0))
  assert model.layer_runs() == [(0, 1, 2, 0), (2, 1, 2, 0)]
  assert model.scanned_layer_groups() == [[0, 1], [2, 3]]
  assert [layer.mlp.tid2eid is not None for layer in model.layers] == [True] * 2 + [False] * 2
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, cfg.vocab_size)
  scanned = model(tokens)
  unrolled = models.build(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))(tokens)
  np.testing.assert_allclose(scanned.logits, unrolled.logits, rtol=1e-5, atol=1e-5)
  # A hash layer's expert load is its table's rows of the tokens, whatever the hidden states.
  table = np.asarray(model.layers[1].mlp.tid2eid[...])
  want = np.bincount(table[np.asarray(tokens)].reshape(-1), minlength=cfg.n_routed_experts) / (B * T * 2)
  np.testing.assert_allclose(scanned.aux["expert_load"][1], want, rtol=1e-6)
  # Other tokens, other experts: the ids are really threaded through.
  other = model((tokens + 1) % cfg.vocab_size).aux["expert_load"][1]
  assert not np.allclose(other, scanned.aux["expert_load"][1])
