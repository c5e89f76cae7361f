"""MLA query chunking (`model.attention_query_chunk`): the same layer, one query chunk at a time."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import glm5_1
from hyscale_jax import models, remat
from hyscale_jax.models import layer_chunks
from hyscale_jax.layers.mla import MLASparseAttention
from hyscale_jax.model_config import ModelConfig

_TINY = dataclasses.replace(ModelConfig.from_config(glm5_1.get_config("tiny").model), index_topk=8)
B, T, CHUNK = 2, 64, 16


def _inputs():
  """x, and positions / segment ids of two packed documents per row (lengths 23 + 41, 64)."""
  x = jax.random.normal(jax.random.key(0), (B, T, _TINY.d_model))
  starts = jnp.asarray([[0] * 23 + [23] * 41, [0] * T])
  positions = jnp.arange(T)[None] - starts
  segment_ids = (positions == 0).cumsum(-1).astype(jnp.int32)
  return x, positions, segment_ids


def _layer_step(chunk, policy, has_indexer=True, shared_indices=None):
  """(AttentionOutput, grads w.r.t. (params, x)) of `mean(out^2) + indexer_loss`."""
  cfg = dataclasses.replace(_TINY, attention_query_chunk=chunk, remat_policy=policy)
  graphdef, params = nnx.split(MLASparseAttention(cfg, has_indexer=has_indexer, rngs=nnx.Rngs(0)))
  x, positions, segment_ids = _inputs()

  def loss(params, x):
    out = nnx.merge(graphdef, params)(x, positions, segment_ids, shared_indices=shared_indices)
    total = jnp.mean(out.out**2) + (0.0 if out.indexer_loss is None else out.indexer_loss)
    return total, out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


def _assert_same(got, want):
  (out, grads), (want_out, want_grads) = got, want
  np.testing.assert_array_equal(out.indices, want_out.indices)
  np.testing.assert_allclose(out.out, want_out.out, rtol=1e-5, atol=1e-6)
  if want_out.indexer_loss is not None:
    np.testing.assert_allclose(out.indexer_loss, want_out.indexer_loss, rtol=1e-5)
  for (path, g), (_, w) in zip(*(jax.tree_util.tree_leaves_with_path(t) for t in (grads, want_grads))):
    scale = max(float(jnp.abs(w).max()), 1e-30)
    np.testing.assert_allclose(g / scale, w / scale, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("policy", ["selection_replay", "full"])
def test_chunked_layer_matches_the_whole_layer(policy):
  want = _layer_step(0, policy)
  assert (np.asarray(want[0].indices) >= 0).sum(-1).min() >= 1 and want[0].indexer_loss > 0
  _assert_same(_layer_step(CHUNK, policy), want)


def test_index_share_layer_slices_the_shared_selection():
  shared = _layer_step(0, "none")[0].indices
  want = _layer_step(0, "selection_replay", has_indexer=False, shared_indices=shared)
  _assert_same(_layer_step(CHUNK, "selection_replay", has_indexer=False, shared_indices=shared), want)


def test_a_model_step_selects_once_per_indexer_layer_under_replay():
  cfg = dataclasses.replace(_TINY, n_layers=2, attention_query_chunk=CHUNK)
  graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
  loss = lambda p: nnx.merge(graphdef, p, rest)(tokens).aux["indexer_loss"]
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
  assert remat.count_named_equations(jaxpr, "flash_topk") == cfg.n_layers


def test_a_length_not_a_multiple_of_the_chunk_is_named():
  x, positions, segment_ids = _inputs()
  layer = MLASparseAttention(dataclasses.replace(_TINY, attention_query_chunk=24), has_indexer=True,
                             rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"attention_query_chunk=24 .* T=64"):
    layer(x, positions, segment_ids)
  # A sequence no longer than one chunk runs whole.
  assert layer(x[:, :20], positions[:, :20], segment_ids[:, :20]).out.shape == (B, 20, _TINY.d_model)


@pytest.mark.parametrize("value", [-1, 2.5])
def test_bad_chunk_config_is_rejected(value):
  with pytest.raises(ValueError, match="model.attention_query_chunk"):
    dataclasses.replace(_TINY, attention_query_chunk=value)


def _saved_residuals(cfg, capsys) -> list[str]:
  """The "dtype[shape" of each residual a model step of `cfg` saves for its backward pass."""
  graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)

  def loss(p):
    out = nnx.merge(graphdef, p, rest)(tokens)
    return jnp.mean(out.logits**2) + out.aux["indexer_loss"]

  jax.ad_checkpoint.print_saved_residuals(loss, params)
  return [line.split("]")[0] for line in capsys.readouterr().out.splitlines() if "[" in line]


@pytest.mark.parametrize("chunk", [0, CHUNK])
def test_a_chunked_model_saves_the_selection_but_not_the_attention_output(chunk, capsys):
  """Under "selection_replay" a chunked layer keeps only its selection (the output is what chunking avoids)."""
  cfg = dataclasses.replace(_TINY, n_layers=1, attention_query_chunk=chunk)
  saved = _saved_residuals(cfg, capsys)
  attention_out = [s for s in saved if s.endswith(f",{cfg.n_heads},{cfg.kv_lora_rank}")]  # [..., T, H, L]
  selection = [s for s in saved if s.startswith("i32") and s.endswith(f",{cfg.index_topk}")]
  assert selection, saved
  assert bool(attention_out) == (chunk == 0), saved


def _model_step(cfg, tokens):
  """(loss, expert_load, grads) of one model forward and backward: mean squared logits + indexer loss."""
  graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(p):
    out = nnx.merge(graphdef, p, rest)(tokens)
    return jnp.mean(out.logits**2) + out.aux.get("indexer_loss", 0.0), out.aux["expert_load"]

  (value, load), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return value, load, grads


# CI time: DeepSeek-V4 repeats GLM-5.1's coverage of the FFN chunk loop.
@pytest.mark.parametrize("family", ["glm5_1", pytest.param("deepseek_v4_flash", marks=pytest.mark.slow)])
def test_ffn_chunks_give_the_whole_block(family):
  """`model.ffn_token_chunk`: a dense layer and MoE layers (GLM), mHC residual streams and hash routing
  (DeepSeek-V4) give the same loss, expert load and gradients one chunk of positions at a time."""
  module = __import__(f"configs.{family}", fromlist=["get_config"])
  base = ModelConfig.from_config(module.get_config("tiny").model)
  cfg = dataclasses.replace(base, index_topk=8, moe_token_chunk=0)
  if family == "deepseek_v4_flash":  # a hash-routed layer and a CSA layer are enough
    cfg = dataclasses.replace(cfg, n_layers=2, compress_ratios=cfg.compress_ratios[:2])
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
  want = _model_step(cfg, tokens)
  got = _model_step(dataclasses.replace(cfg, ffn_token_chunk=CHUNK), tokens)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
  assert float(np.asarray(want[1]).sum()) > 0
  for (path, g), (_, w) in zip(*(jax.tree_util.tree_leaves_with_path(t) for t in (got[2], want[2]))):
    scale, name = max(float(jnp.abs(w).max()), 1e-30), jax.tree_util.keystr(path)
    # The mHC connections' gradients are sums of large terms of both signs: any regrouping of the
    # f32 arithmetic moves them by ~1e-4 of their scale (the MoE's own token chunks do the same).
    hyper_connection = "hc_head" in name or "_hc'" in name
    np.testing.assert_allclose(g / scale, w / scale, atol=5e-4 if hyper_connection else 2e-5, err_msg=name)


class _TwoScales(nnx.Module):
  """A sub-block of two parameters, `inner` and `outer`, for chunked_rows' parameter filter."""

  def __init__(self):
    self.inner = nnx.Param(jnp.full((4,), 2.0))
    self.outer = nnx.Param(jnp.full((4,), 3.0))

  def __call__(self, rows, use_outer):
    return rows * self.inner + (rows * self.outer if use_outer else 0.0)


@pytest.mark.parametrize("use_outer", [False, True])
def test_chunked_rows_names_a_parameter_its_filter_leaves_out(use_outer):
  """A sub-block that reads a parameter outside `params` would get no gradient for it through the
  chunk loop: chunked_rows refuses it, naming the parameter; with the filter covering what it
  reads, the gradient is the unchunked one."""
  module, x = _TwoScales(), jax.random.normal(jax.random.key(0), (1, 8, 4))
  fn = lambda m, rows, ids: (m(rows, use_outer), None)
  run = lambda m, x: layer_chunks.chunked_rows(m, fn, x, None, 4, params=nnx.PathContains("inner"))[0]
  if use_outer:
    with pytest.raises(ValueError, match=r"outside its `params` filter.*outer"):
      run(module, x)
    return
  whole = lambda m, x: fn(m, x, None)[0]
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  loss = lambda block, p: jnp.sum(block(nnx.merge(graphdef, p, rest), x) ** 2)
  got, want = (jax.grad(functools.partial(loss, block))(params) for block in (run, whole))
  np.testing.assert_allclose(got["inner"][...], want["inner"][...], rtol=1e-6)


def test_ffn_chunk_not_dividing_the_length_is_named():
  cfg = dataclasses.replace(_TINY, n_layers=1, ffn_token_chunk=24)
  model = models.build(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"ffn_token_chunk=24 .* T=64"):
    model(jnp.zeros((1, T), jnp.int32))
  with pytest.raises(ValueError, match="model.ffn_token_chunk"):
    dataclasses.replace(_TINY, ffn_token_chunk=-16)


# CI time: the layer loop is the same either way; grad_in_forward=True (what hyscale runs) also takes grads_out.
@pytest.mark.parametrize("grad_in_forward", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_whole_layer_over_chunks_gives_the_whole_layer(grad_in_forward):
  """Equal query and FFN chunks run the whole layer over sequence chunks (`DecoderLayer._chunked_layer`):
  the same loss, expert load and gradients as the unchunked model (a dense and an MoE layer, two
  documents per row), and one selection per indexer layer under "selection_replay"."""
  cfg = dataclasses.replace(_TINY, n_layers=2, moe_token_chunk=0, indexer_loss_grad_in_forward=grad_in_forward)
  starts = jnp.asarray([[0] * 23 + [23] * 41, [0] * T])
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
  chunked = dataclasses.replace(cfg, attention_query_chunk=CHUNK, ffn_token_chunk=CHUNK)
  model = models.build(chunked, rngs=nnx.Rngs(0))
  assert all(layer.layer_chunk(T) == CHUNK for layer in model.layers)

  def step(cfg):
    graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    positions = jnp.arange(T)[None] - starts
    segment_ids = (positions == 0).cumsum(-1).astype(jnp.int32)

    def loss(p):
      out = nnx.merge(graphdef, p, rest)(tokens, positions=positions, segment_ids=segment_ids)
      return jnp.mean(out.logits**2) + out.aux["indexer_loss"], (out.aux["indexer_loss"], out.aux["expert_load"])

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params), jax.make_jaxpr(jax.grad(lambda p: loss(p)[0]))(params)

  ((value, (indexer_loss, load)), grads), _ = step(cfg)
  ((got_value, (got_indexer_loss, got_load)), got_grads), jaxpr = step(chunked)
  assert float(indexer_loss) > 0
  np.testing.assert_allclose(got_value, value, rtol=1e-5)
  np.testing.assert_allclose(got_indexer_loss, indexer_loss, rtol=1e-5)
  np.testing.assert_allclose(got_load, load, rtol=1e-5, atol=1e-7)
  for (path, g), (_, w) in zip(*(jax.tree_util.tree_leaves_with_path(t) for t in (got_grads, grads))):
    scale = max(float(jnp.abs(w).max()), 1e-30)
    np.testing.assert_allclose(g / scale, w / scale, atol=2e-5, err_msg=jax.tree_util.keystr(path))
  assert remat.count_named_equations(jaxpr, "flash_topk") == cfg.n_layers


def test_the_whole_layer_over_chunks_saves_one_index_key_gradient(capsys):
  """With the indexer loss's gradient in the forward pass, a layer over chunks saves its selection and
  one index-key gradient [B, T, DI] in all (not one per chunk), and no index-query gradient [.., HI, DI]
  (its weights' gradient instead)."""
  cfg = dataclasses.replace(_TINY, n_layers=1, attention_query_chunk=CHUNK, ffn_token_chunk=CHUNK,
                            indexer_loss_grad_in_forward=True)
  saved = _saved_residuals(cfg, capsys)
  key_grads = [s for s in saved if s.endswith(f"{T},{cfg.index_head_dim}")]
  assert len(key_grads) == 1 and key_grads[0].endswith(f"[1,{T},{cfg.index_head_dim}"), saved
  assert [s for s in saved if s.startswith("i32") and s.endswith(f",{cfg.index_topk}")] == [
      f"i32[1,{T},{cfg.index_topk}"], saved  # one selection, no per-chunk copy
  assert not [s for s in saved if s.endswith(f",{cfg.index_n_heads},{cfg.index_head_dim}")], saved


@pytest.mark.parametrize("policy,selections,attentions", [("selection_replay", 1, 2), ("full", 2, 3), ("none", 1, 2)])
def test_the_whole_layer_over_chunks_selects_as_its_policy_says(policy, selections, attentions):
  """The chunked layer's backward pass (`models/layer_chunks.py`) replays the forward pass's selection:
  one top-k per indexer layer per step, two under "full" (its recomputed forward pass reselects); and
  one attention forward per chunk in each pass (the backward's recomputation), one more under "full"."""
  cfg = dataclasses.replace(_TINY, n_layers=2, attention_query_chunk=CHUNK, ffn_token_chunk=CHUNK,
                            remat_policy=policy)
  graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tokens = jnp.zeros((1, T), jnp.int32)

  def loss(p):  # the indexer loss too: its backward reads the layer's rows counted
    out = nnx.merge(graphdef, p, rest)(tokens)
    return jnp.mean(out.logits**2) + out.aux["indexer_loss"]

  jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
  assert remat.count_named_equations(jaxpr, "flash_topk") == selections * cfg.n_layers
  assert remat.count_named_equations(jaxpr, remat.ATTENTION_OUT) == attentions * cfg.n_layers
