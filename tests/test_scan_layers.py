"""Scanned layers (`ModelConfig.scan_layers`): same loss, gradients, expert loads and selections as unrolled."""

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyscale_jax import models, remat
from hyscale_jax.models.decoder import periodic_runs
from hyscale_jax.model_config import ModelConfig

_GLM = ModelConfig(  # IndexShare: full layers 0, 1, 3, 5, 7 (freq 2, offset 2); layer 0 dense
    vocab_size=64, d_model=32, n_layers=8, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4,
    experts_per_token=2, n_shared_experts=1, moe_inter=16, index_n_heads=2, index_head_dim=16,
    index_rope_dim=8, index_topk=6, rope_theta=10000.0, index_topk_freq=2, index_topk_offset=2)
_DSV4 = ModelConfig(  # SWA, then [CSA, HCA] 3 times, then CSA; mHC residual streams
    architecture="deepseek_v4", vocab_size=64, d_model=32, n_layers=8, first_k_dense=0, n_heads=4,
    head_dim=16, qk_rope_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=6,
    compress_ratios=(0, 4, 8, 4, 8, 4, 8, 4), index_n_heads=2, index_head_dim=16, index_rope_dim=4, index_topk=3,
    n_routed_experts=4, experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="sqrtsoftplus",
    routed_scaling=1.5, rms_eps=1e-6, rope_theta=10000.0, compress_rope_theta=40000.0, hc_mult=2)
_QWEN = ModelConfig(
    architecture="qwen4_exp", vocab_size=64, d_model=32, n_layers=4, first_k_dense=0,
    layer_types=("qsa",) * 4, n_heads=4, n_kv_heads=2, head_dim=16, qk_rope_dim=4,
    index_n_heads=2, index_head_dim=8, index_rope_dim=4, index_topk=3, qsa_block=4,
    n_routed_experts=4, experts_per_token=2, n_shared_experts=1, moe_inter=16, scoring="softmax",
    routed_scaling=1.0, rms_eps=1e-6, rope_theta=10000.0)
B, T = 2, 32


@pytest.mark.parametrize("keys, runs", [
    ([], []),
    (list("A"), [(0, 1, 1)]),
    (list("AAAA"), [(0, 1, 4)]),
    (list("DFSFSFS"), [(0, 1, 1), (1, 2, 3)]),
    (list("DDDFSSSFSSSFS"), [(0, 1, 3), (3, 4, 2), (11, 1, 1), (12, 1, 1)]),
    (list("ABCABCAB"), [(0, 3, 2), (6, 1, 1), (7, 1, 1)]),
    (list("AAAAAB") * 2, [(0, 1, 5), (5, 1, 1), (6, 1, 5), (11, 1, 1)]),
])
def test_periodic_runs_cover_the_layers_with_the_most_repeated_block(keys, runs):
  assert periodic_runs(keys) == runs
  covered = [i for start, period, repeats in runs for i in range(start, start + period * repeats)]
  assert covered == list(range(len(keys)))


def test_periodic_runs_stop_at_max_period():
  keys = list("ABCDEFGHI") * 2
  assert periodic_runs(keys, max_period=9)[0] == (0, 9, 2)
  assert all(period == 1 for _, period, _ in periodic_runs(keys, max_period=8))


def _split(cfg, scan):
  model = models.build(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))
  return nnx.split(model, nnx.Param, ...)


def _objective(cfg, graphdef, rest, dense=False):
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)

  def total(params):
    out = nnx.merge(graphdef, params, rest)(tokens, dense=dense)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    lm = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    return lm + out.aux["indexer_loss"], out.aux
  return total


def _layer_scans(jaxpr):
  """(length of each scan over layers) in the jaxpr, nested ones included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and remat.LAYER_SCAN in str(eqn.source_info.name_stack):
      found.append(eqn.params["length"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _layer_scans(sub)
  return found


# CI time (the slowest model test, about 2 minutes on CI's machine): DeepSeek-V4's layers in scanned
# groups are also checked against unrolled ones in test_deepseek_v4 (hash routing in the scan), and its
# mHC streams' gradients in test_hyper_connections.
@pytest.mark.parametrize("cfg, scan_lengths", [(_GLM, [3]), pytest.param(_DSV4, [2], marks=pytest.mark.slow),
                                               (_QWEN, [3])],
                         ids=["glm5_1_index_share", "deepseek_v4_mhc", "qwen4_exp"])
def test_scanned_layers_match_unrolled_layers(cfg, scan_lengths):
  results = {}
  for scan in (False, True):
    graphdef, params, rest = _split(cfg, scan)
    total = _objective(cfg, graphdef, rest)
    step = jax.value_and_grad(total, has_aux=True)
    # Forward and backward scans.
    assert _layer_scans(jax.make_jaxpr(step)(params)) == (scan_lengths * 2 if scan else [])
    results[scan] = jax.jit(step)(params)
  (loss, aux), grads = results[False]
  (scan_loss, scan_aux), scan_grads = results[True]
  np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)
  np.testing.assert_allclose(scan_aux["indexer_loss"], aux["indexer_loss"], rtol=1e-6)
  assert scan_aux["expert_load"].shape == aux["expert_load"].shape
  np.testing.assert_allclose(scan_aux["expert_load"], aux["expert_load"], rtol=1e-6, atol=1e-7)
  flat, scan_flat = nnx.to_flat_state(grads), nnx.to_flat_state(scan_grads)
  assert [path for path, _ in flat] == [path for path, _ in scan_flat]
  for (path, a), (_, b) in zip(flat, scan_flat):
    np.testing.assert_allclose(b[...], a[...], rtol=1e-5, atol=1e-6, err_msg="/".join(map(str, path)))
  assert sum(np.abs(np.asarray(g[...])).sum() > 0 for _, g in flat) > len(flat) // 2


@pytest.mark.parametrize("policy", ["selection_replay", "full"])
def test_selections_per_step_do_not_depend_on_scanning(policy):
  cfg = dataclasses.replace(_GLM, remat_policy=policy)
  counts = []
  for scan in (False, True):
    graphdef, params, rest = _split(cfg, scan)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: _objective(cfg, graphdef, rest)(p)[0]))(params)
    counts.append(remat.count_named_equations(jaxpr, "flash_topk"))
  full_layers = sum(cfg.has_indexer(i) for i in range(cfg.n_layers))
  assert counts == [full_layers * (2 if policy == "full" else 1)] * 2


@pytest.mark.slow
def test_dense_warm_up_scans_without_indices():
  grads = []
  for scan in (False, True):
    graphdef, params, rest = _split(_GLM, scan)
    grads.append(jax.jit(jax.grad(lambda p: _objective(_GLM, graphdef, rest, dense=True)(p)[0]))(params))
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_stored_layer_stacks_round_trip_and_cost_xla_no_slices():
  """train.py stores each scanned group stacked (training/layer_stacks.py): per_layer(stacked(p)) is p,
  the groups follow the decoder's scan (IndexShare's period 2 here), the AdamW moments take the same
  layout, and the gradient through per_layer and the decoder's restacking compiles without a slice
  or a concatenation (XLA folds them), so the stored stack's gradient is the scan's."""
  import optax  # noqa: PLC0415

  from hyscale_jax.training import layer_stacks  # noqa: PLC0415

  model = models.build(_GLM, rngs=nnx.Rngs(0))
  groups = model.scanned_layer_groups()
  assert groups == [[1, 3, 5], [2, 4, 6]], (groups, model.layer_runs())  # [full, shared] x 3 after layer 0
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  stacked = layer_stacks.stacked(params, groups)
  assert sorted(stacked["layers"]) == [0, 7] and sorted(stacked[layer_stacks.STACKS]) == [0, 1]
  kernel = stacked[layer_stacks.STACKS][0]["mlp"]["experts_up_proj"]
  per = params["layers"][3]["mlp"]["experts_up_proj"]
  assert kernel[...].shape == (3, *per[...].shape)
  assert kernel.get_metadata()["out_sharding"] == (None, *per.get_metadata()["out_sharding"])
  back = layer_stacks.per_layer(stacked, groups)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params))
  moments = optax.adamw(1e-3).init(stacked)
  assert jax.tree.structure(layer_stacks.stacked(layer_stacks.per_layer(moments, groups), groups)) == \
      jax.tree.structure(moments)

  tokens = jnp.arange(16, dtype=jnp.int32).reshape(1, 16) % _GLM.vocab_size

  def loss(layout, p):
    model = nnx.merge(graphdef, layout(p), rest)
    h, aux = model.hidden_states(tokens)
    return model.lm_loss(h, tokens, jnp.ones(tokens.shape, jnp.float32)) + aux["indexer_loss"]

  want_loss, want = jax.jit(jax.value_and_grad(lambda p: loss(lambda q: q, p)))(params)
  step = jax.jit(jax.value_and_grad(lambda p: loss(lambda q: layer_stacks.per_layer(q, groups), p)))
  got_loss, got = step(stacked)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  got = layer_stacks.per_layer(got, groups)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
  # Per layer, the backward slices each stacked gradient into one array per (layer, leaf); stored
  # stacked, those slices (and the forward's concatenations) are gone.
  copies = lambda hlo: hlo.count(" slice(") + hlo.count(" concatenate(")
  stored = copies(step.lower(stacked).compile().as_text())
  apart = copies(jax.jit(jax.value_and_grad(lambda p: loss(lambda q: q, p))).lower(params).compile().as_text())
  stacked_leaves = sum(len(group) * len(jax.tree.leaves(params["layers"][group[0]])) for group in groups)
  assert stored <= apart - stacked_leaves, (stored, apart, stacked_leaves)
