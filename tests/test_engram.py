"""Engram / PLE n-gram embeddings (layers/engram.py): the hash against exact integer and float64 oracles."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import qwen3_8_flash_next
from hyscale_jax import models
from hyscale_jax.convert import hf_config
from hyscale_jax.convert.safetensors_dir import CheckpointReader
from hyscale_jax.layers import engram
from hyscale_jax.model_config import ModelConfig
from tests.lm_runs import assert_trains_both_stages_and_resumes, small_lm_config
from tests.test_convert import FIXTURES
from tests.test_qwen_next import _SMALL

_TINY = ModelConfig.from_config(qwen3_8_flash_next.get_config("tiny").model)


def _cfg(**changes) -> ModelConfig:
  return dataclasses.replace(_TINY, **changes)


def _history_oracle(tokens, segment_ids, shift, eos):
  """token[t - shift] by a walk back from t: EOS once the walk meets an EOS or another document."""
  out = np.empty_like(tokens)
  for b, t in np.ndindex(tokens.shape):
    s, ok = t - shift, t - shift >= 0
    for j in range(1, shift + 1):
      ok = ok and t - j >= 0 and tokens[b, t - j] != eos and segment_ids[b, t - j] == segment_ids[b, t]
    out[b, t] = tokens[b, s] if ok else eos
  return out


def _rows_oracle(tokens, segment_ids, cfg, ple_index):
  """Exact Python-int hash: XOR of token * multiplier (< 2^63), mod each head's prime, plus its offset."""
  sizes, offsets, _ = engram.head_tables(cfg, ple_index)
  mult = engram.hash_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.ngram_seed)
  history = [_history_oracle(tokens, segment_ids, i, cfg.eos_token_id) for i in range(cfg.ngram_size)]
  per, rows = cfg.ngram_heads_per_order, np.zeros((*tokens.shape, len(sizes)), np.int64)
  for b, t in np.ndindex(tokens.shape):
    mix = int(history[0][b, t]) * mult[0]
    for n in range(2, cfg.ngram_size + 1):
      mix ^= int(history[n - 1][b, t]) * mult[n - 1]
      assert mix < 1 << 63
      for h in range((n - 2) * per, (n - 1) * per):
        rows[b, t, h] = mix % sizes[h] + offsets[h]
  return rows


def _tokens_with_eos(rng, shape, vocab, eos):
  tokens = rng.integers(0, vocab, shape)
  tokens[:, [3, 4, 11]] = eos  # two EOS in a row, and one more
  tokens[0, -3:] = vocab - 1  # the largest id: the largest products
  return tokens.astype(np.int32)


@pytest.mark.parametrize("vocab, base, ple_index", [(96, 50, 1), (248320, 20_000_000, 0)])
def test_ngram_rows_match_the_exact_integer_hash(vocab, base, ple_index):
  cfg = _cfg(vocab_size=vocab, ngram_vocab_base=base, ple_layer_ids=(1, 2), eos_token_id=7, ngram_heads_per_order=3,
             ple_embed_dim=12)
  rng = np.random.default_rng(0)
  tokens = _tokens_with_eos(rng, (2, 24), vocab, 7)
  segment_ids = np.array([[0] * 16 + [1] * 8, [0] * 24], np.int32)
  got = np.asarray(engram.ngram_rows(jnp.asarray(tokens), jnp.asarray(segment_ids), cfg, ple_index))
  np.testing.assert_array_equal(got, _rows_oracle(tokens, segment_ids, cfg, ple_index))


def test_uint32_pair_product_and_remainder_are_exact():
  rng = np.random.default_rng(3)
  edges = np.array([0, 1, 0xFFFF, 0x10000, 0x1FFFF, 0xFFFFFFFF], np.uint64)
  t = np.concatenate([edges, rng.integers(0, 1 << 32, 58, dtype=np.uint64)])
  for m in (1, 0xFFFFFFFF, int(rng.integers(1, 1 << 32)), (1 << 32) + 12345):
    small = t if m < 1 << 32 else t & 0xFFFFFFF  # keep t * m below 2^64
    hi, lo = engram._mul_u64(jnp.asarray(small, jnp.uint32), m)
    want = [int(x) * m for x in small]
    got = [(int(h) << 32) | int(l) for h, l in zip(np.asarray(hi), np.asarray(lo))]
    assert got == want, m
    for p in (2, 3, 20_000_003, (1 << 28) - 57):
      rem = engram._mod_u64(hi, lo, jnp.asarray(p, jnp.uint32))
      assert [int(r) for r in np.asarray(rem)] == [w % p for w in want], (m, p)


def test_hash_constants_are_transformers_buffers():
  source = FIXTURES / "qwen4_exp_engram"
  cfg = hf_config.from_hf(json.loads((source / "config.json").read_text()))
  reader = CheckpointReader(str(source))
  for ple_index, layer_id in enumerate(cfg.ple_layer_ids):
    for key, value in engram.checkpoint_constants(cfg, ple_index).items():
      np.testing.assert_array_equal(reader.read(f"model.layers.{layer_id - 1}.ple.ple_embedding.{key}"), value)


def _zero_centred_rms(x, w, eps, group):
  g = x.reshape(*x.shape[:-1], -1, group)
  g = g / np.sqrt(np.mean(g * g, -1, keepdims=True) + eps)
  return g.reshape(x.shape) * (1 + w)


def _layer_oracle(layer, streams, rows, segment_ids, cfg):
  """The PLE layer in float64 NumPy, from the layer's weights and the oracle's table rows."""
  f64 = lambda a: np.asarray(a[...], np.float64)
  B, T, N, D = streams.shape
  e = f64(layer.ple_embedding.ngram_embedding.embedding)[rows].reshape(B, T, -1)
  key = _zero_centred_rms(e @ f64(layer.key_proj.kernel), f64(layer.norm_key.weight), cfg.rms_eps, D)
  value = e @ f64(layer.value_proj.kernel)
  query = _zero_centred_rms(streams.reshape(B, T, N * D), f64(layer.norm_query.weight), cfg.rms_eps, D)
  g = (key.reshape(B, T, N, D) * query.reshape(B, T, N, D)).sum(-1, keepdims=True) / np.sqrt(D)
  g = np.sign(g) * np.sqrt(np.maximum(np.abs(g), 1e-6))
  gated = (value[:, :, None, :] / (1 + np.exp(-g))).reshape(B, T, N * D)
  normed = _zero_centred_rms(gated, f64(layer.norm_conv.weight), cfg.rms_eps, D)
  kernel, conv = f64(layer.conv1d), np.zeros_like(gated)
  K, dil = kernel.shape[0], cfg.ngram_size
  for b, t, j in np.ndindex(B, T, K):
    s = t - (K - 1 - j) * dil
    if s >= 0 and segment_ids[b, s] == segment_ids[b, t]:
      conv[b, t] += kernel[j] * normed[b, s]
  return (gated + conv / (1 + np.exp(-conv))).reshape(B, T, N, D)


def _noised_layer(cfg, seed=0):
  layer = engram.EngramLayer(cfg, 0, rngs=nnx.Rngs(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 8))
  for name in ("norm_key", "norm_query", "norm_conv"):  # zero-initialised: noise, so the oracle sees them
    getattr(layer, name).weight[...] = 0.3 * jax.random.normal(next(keys), getattr(layer, name).weight.shape)
  layer.conv1d[...] = jax.random.normal(next(keys), layer.conv1d.shape)
  table = layer.ple_embedding.ngram_embedding.embedding
  table[...] = jax.random.normal(next(keys), table.shape)
  return layer


def test_layer_matches_float64_oracle_with_packed_documents():
  cfg = _cfg(vocab_size=96, d_model=16, hc_mult=2, ple_layer_ids=(1,), ple_embed_dim=12, ngram_heads_per_order=3,
             ngram_vocab_base=40, eos_token_id=5, ngram_vocab_multiple=8)
  layer = _noised_layer(cfg)
  rng = np.random.default_rng(1)
  tokens = _tokens_with_eos(rng, (2, 20), cfg.vocab_size, 5)
  segment_ids = np.array([[0] * 9 + [1] * 11, [0] * 20], np.int32)
  streams = rng.standard_normal((2, 20, 2, 16)).astype(np.float32)
  run = nnx.jit(lambda layer, *args: layer(*args))
  got = np.asarray(run(layer, jnp.asarray(streams), jnp.asarray(tokens), jnp.asarray(segment_ids)), np.float64)
  rows = _rows_oracle(tokens, segment_ids, cfg, 0)
  want = _layer_oracle(layer, streams.astype(np.float64), rows, segment_ids, cfg)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  # Packed: the second document's output is the one it gets alone.
  alone = run(layer, jnp.asarray(streams[:1, 9:]), jnp.asarray(tokens[:1, 9:]), jnp.zeros((1, 11), jnp.int32))
  np.testing.assert_allclose(np.asarray(alone), got[:1, 9:], rtol=1e-5, atol=1e-6)
  # Every parameter learns, and of the table exactly the rows read.
  graphdef, params = nnx.split(layer, nnx.Param)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(streams), jnp.asarray(tokens),
                                                 jnp.asarray(segment_ids)) ** 2)
  grads = nnx.to_flat_state(jax.jit(jax.grad(loss))(params))
  for path, g in grads:
    assert np.isfinite(g[...]).all() and np.abs(g[...]).max() > 0, path
  table_grad = np.asarray(dict(grads)[("ple_embedding", "ngram_embedding", "embedding")][...])
  assert set(np.flatnonzero(np.abs(table_grad).sum(-1))) <= set(rows.reshape(-1).tolist())


def test_a_context_mesh_gives_the_layers_values_and_gradients():
  # 4 context shards of 7 tokens: the n-grams reach 2 tokens back, the dilated conv 9 (across two shards).
  cfg = _cfg(vocab_size=96, d_model=16, hc_mult=2, ple_layer_ids=(1,), ple_embed_dim=12, ngram_heads_per_order=3,
             ngram_vocab_base=40, eos_token_id=5, ngram_vocab_multiple=8)
  graphdef, params = nnx.split(_noised_layer(cfg))
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(_tokens_with_eos(rng, (2, 28), cfg.vocab_size, 5))
  segment_ids = jnp.asarray(np.array([[0] * 13 + [1] * 15, [0] * 28], np.int32))
  streams = jnp.asarray(rng.standard_normal((2, 28, 2, 16)), jnp.float32)
  f = lambda p, x, t, s: jnp.sum(nnx.merge(graphdef, p)(x, t, s) ** 2)
  loss = jax.jit(jax.value_and_grad(f, (0, 1)))
  want = loss(params, streams, tokens, segment_ids)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  split = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context")))
  with jax.set_mesh(mesh):
    got = loss(params, split(streams), split(tokens), split(segment_ids))
  # f32 sums over tokens regroup by shard (the gradients' relative error is about 4e-5 of their largest entry).
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), (a.shape, np.abs(a - b).max(), np.abs(b).max())


def _small_hybrid(n_layers: int) -> ModelConfig:
  """(GDN x3, QSA) repeated, on gated-residual streams, with the Engram embedding at layer 2 (one-indexed)."""
  return dataclasses.replace(
      _SMALL, n_layers=n_layers, layer_types=(("gated_deltanet",) * 3 + ("qsa",)) * (n_layers // 4),
      linear_n_key_heads=2, linear_n_value_heads=4, linear_key_dim=8, linear_value_dim=8, linear_chunk=16,
      hc_mult=2, hc_lowrank=4, shared_expert_gate=True, router_bias=False, ple_layer_ids=(2,), ple_embed_dim=16,
      ngram_heads_per_order=2, ngram_vocab_base=256, ngram_vocab_multiple=8, eos_token_id=0, remat_policy="none")


def test_layer_scan_runs_around_the_engram_layer():
  assert _TINY.ple_layer_ids == (2,)
  cfg = dataclasses.replace(_small_hybrid(4), layer_types=("gated_deltanet",) * 4)
  model = models.build(cfg, rngs=nnx.Rngs(0))
  assert [layer.ple is not None for layer in model.layers] == [False, True, False, False]
  # Layer 1 (with `ple`) is a run of its own; layers 2 and 3 are one scan.
  assert model.layer_runs() == [(0, 1, 1, 1), (1, 1, 1, 1), (2, 1, 2, 0)]
  tokens = jax.random.randint(jax.random.key(0), (1, 16), 0, cfg.vocab_size).at[0, 5].set(0)
  forward = nnx.jit(lambda m, t: m(t).logits)
  scanned = forward(model, tokens)
  unrolled = forward(models.build(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0)), tokens)
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)


def test_full_config_engram_is_the_published_one():
  cfg = ModelConfig.from_config(qwen3_8_flash_next.get_config("full").model)
  assert (cfg.ple_layer_ids, cfg.ple_embed_dim, cfg.ngram_size, cfg.ngram_heads_per_order) == ((2,), 2560, 3, 8)
  sizes, _, rows = engram.head_tables(cfg, 0)
  assert len(sizes) == 16 and sizes[0] == 20_000_003 and rows % 128 == 0
  # 16 prime tables of about 20M rows of 160 features: the "51B of n-gram embeddings" beside the 125B.
  assert round(rows * 160 / 1e9, 1) == 51.2


@pytest.mark.parametrize("changes, match", [
    (dict(ple_layer_ids=(0,)), r"ple_layer_ids=\(0,\) must be increasing one-indexed"),
    (dict(ple_layer_ids=(2,), eos_token_id=-1), "eos_token_id=-1 must be a token id"),
    (dict(ple_layer_ids=(2,), ple_embed_dim=250), "ple_embed_dim=250 a multiple of the 16 n-gram heads"),
])
def test_bad_engram_config_is_named(changes, match):
  with pytest.raises(ValueError, match=match):
    _cfg(**changes)


def test_engram_is_qwen_only():
  with pytest.raises(ValueError, match="only qwen4_exp has n-gram"):
    ModelConfig(ple_layer_ids=(1,), ple_embed_dim=16, eos_token_id=0)


def test_fixture_plants_eos_tokens():
  outputs = load_file(str(FIXTURES / "qwen4_exp_engram" / "outputs.safetensors"))
  assert (outputs["input_ids"][:, [5, 6, 17, 30]] == 1).all()


@pytest.mark.slow
def test_hybrid_stack_with_engram_trains_both_stages_and_resumes(tmp_path):
  # [GDN, GDN + Engram, GDN, QSA] on gated-residual streams, through train.py's loop (scanned layer stacks).
  hybrid = dataclasses.replace(_small_hybrid(4), remat_policy="selection_replay")
  make = lambda steps: small_lm_config(qwen3_8_flash_next.get_config, hybrid, tmp_path, steps)
  assert_trains_both_stages_and_resumes(make, tmp_path / "run")
