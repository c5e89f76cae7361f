"""MoE: ragged_dot dispatch vs a per-expert loop oracle, noaux_tc bias, gradients, load balance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyscale_jax.layers.mlp import MLP, swiglu
from hyscale_jax.layers.moe import MoE, RouterBias, update_router_bias

D, F, E, K, B, T = 16, 8, 8, 2, 2, 5


def _moe(**kw):
  kw = {"n_shared_experts": 0, **kw}
  return MoE(D, F, E, K, rngs=nnx.Rngs(0), **kw)


def _x(seed=1, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), (B, T, D), dtype)


def _np(v):
  return np.asarray(v[...], np.float64)


def _silu(a):
  return a / (1.0 + np.exp(-a))


def _loop_route(moe, scores):
  """Oracle routing for one token: biased choice, group pruning, unbiased combine weights."""
  biased = scores + _np(moe.e_score_correction_bias)
  allowed, size = list(range(E)), E // moe.n_group
  if moe.n_group > 1:
    rank = [np.sort(biased[g * size : (g + 1) * size])[-2:].sum() for g in range(moe.n_group)]
    kept = np.argsort(rank)[-moe.topk_group :]
    allowed = [e for e in allowed if e // size in kept]
  chosen = sorted(allowed, key=lambda e: -biased[e])[:K]
  w = scores[chosen]
  if moe.norm_topk_prob:
    w = w / (w.sum() + 1e-20)
  return chosen, w * moe.routed_scaling


def _moe_loop_block(moe, x):
  """MaxText-style MoeLoopBlock in float64 numpy: each token, each chosen expert, one SwiGLU."""
  tokens = np.asarray(x, np.float64).reshape(-1, D)
  wg, wu, wd = _np(moe.experts_gate_proj), _np(moe.experts_up_proj), _np(moe.experts_down_proj)
  logits = tokens @ _np(moe.gate.kernel)
  scores = {
      "sigmoid": lambda l: 1.0 / (1.0 + np.exp(-l)),
      "sqrtsoftplus": lambda l: np.sqrt(np.log1p(np.exp(l))),
      "softmax": lambda l: np.exp(l - l.max()) / np.exp(l - l.max()).sum(),
  }[moe.scoring]
  out, all_chosen, all_w = np.zeros_like(tokens), [], []
  for n, tok in enumerate(tokens):
    chosen, weights = _loop_route(moe, scores(logits[n]))
    for e, w in zip(chosen, weights):
      out[n] += w * ((_silu(tok @ wg[e]) * (tok @ wu[e])) @ wd[e])
    if moe.shared_experts is not None:
      s = moe.shared_experts
      h = _silu(tok @ _np(s.gate_proj.kernel)) * (tok @ _np(s.up_proj.kernel))
      out[n] += h @ _np(s.down_proj.kernel)
    all_chosen.append(chosen)
    all_w.append(weights)
  return out.reshape(x.shape), np.array(all_chosen), np.array(all_w)


@pytest.mark.parametrize(
    "kw",
    [
        dict(scoring="sigmoid", routed_scaling=2.5),
        dict(scoring="sigmoid", norm_topk_prob=False, n_shared_experts=1),
        dict(scoring="sqrtsoftplus", routed_scaling=1.5, n_shared_experts=2),
        dict(scoring="sqrtsoftplus", norm_topk_prob=False),
        dict(scoring="softmax", norm_topk_prob=False, n_shared_experts=1),
        dict(scoring="softmax"),
        dict(scoring="sigmoid", n_group=2, topk_group=1, n_shared_experts=1, routed_scaling=2.5),
        dict(scoring="sqrtsoftplus", n_group=4, topk_group=2, norm_topk_prob=False),
    ],
)
def test_matches_loop_oracle(kw):
  moe = _moe(**kw)
  x = _x()
  y, load = moe(x)
  want, chosen, weights = _moe_loop_block(moe, x)
  assert y.shape == x.shape and y.dtype == jnp.float32 and load.shape == (E,)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  ids, w = moe.route(x.reshape(-1, D))
  np.testing.assert_array_equal(np.sort(ids, -1), np.sort(chosen, -1))
  np.testing.assert_allclose(np.sort(w, -1), np.sort(weights, -1), rtol=1e-5, atol=1e-6)
  if kw.get("n_group", 1) > 1:  # every token's experts lie in its topk_group kept groups
    groups = np.asarray(ids) // (E // kw["n_group"])
    assert all(len(set(g)) <= kw["topk_group"] for g in groups)


def test_bias_changes_choice_not_weights():
  moe = _moe(scoring="sigmoid", norm_topk_prob=False)
  x = _x()
  flat = x.reshape(-1, D)
  ids_before, _ = moe.route(flat)
  moe.e_score_correction_bias[...] = jnp.zeros((E,)).at[3].set(10.0)
  ids, w = moe.route(flat)
  assert np.all(np.any(np.asarray(ids) == 3, axis=-1)), "the biased expert is always chosen"
  assert not np.array_equal(ids, ids_before), "the bias must change some choices"
  # Weights are the unbiased sigmoid scores of the chosen experts (no +10 leaks in).
  scores = jax.nn.sigmoid(flat @ moe.gate.kernel[...])
  np.testing.assert_allclose(w, jnp.take_along_axis(scores, ids, -1), rtol=1e-6)
  assert np.all(np.asarray(w) < 1.0)
  y, _ = moe(x)
  want, chosen, _ = _moe_loop_block(moe, x)
  np.testing.assert_array_equal(np.sort(ids, -1), np.sort(chosen, -1))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_param_and_bias_is_not_a_param():
  moe = _moe(n_shared_experts=1, routed_scaling=2.5)
  x = _x()
  grads = nnx.grad(lambda m: (m(x)[0] ** 2).sum())(moe)
  flat = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(grads)}
  assert set(flat) == {
      "gate/kernel",
      "experts_gate_proj",
      "experts_up_proj",
      "experts_down_proj",
      "shared_experts/gate_proj/kernel",
      "shared_experts/up_proj/kernel",
      "shared_experts/down_proj/kernel",
  }
  for path, g in flat.items():
    assert np.all(np.isfinite(g)) and np.any(g != 0), path
  params = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(moe, nnx.Param))}
  assert "e_score_correction_bias" not in params
  assert not isinstance(moe.e_score_correction_bias, nnx.Param)
  bias = nnx.state(moe, RouterBias)
  assert bias["e_score_correction_bias"][...].dtype == jnp.float32


def _dense_moe(moe, x):
  """Every expert on every token, masked by the combine weights: a differentiable jnp oracle."""
  flat = x.reshape(-1, D)
  ids, w = moe.route(flat)
  combine = jnp.zeros((flat.shape[0], E)).at[jnp.arange(flat.shape[0])[:, None], ids].add(w)
  wg, wu, wd = moe.experts_gate_proj[...], moe.experts_up_proj[...], moe.experts_down_proj[...]
  h = jax.nn.silu(jnp.einsum("ND,EDF->NEF", flat, wg)) * jnp.einsum("ND,EDF->NEF", flat, wu)
  y = jnp.einsum("NEF,EFD,NE->ND", h, wd, combine)
  if moe.shared_experts is not None:
    y = y + moe.shared_experts(flat)
  return y.reshape(x.shape)


def test_vjp_matches_dense_oracle():
  moe = _moe(n_shared_experts=1, scoring="sqrtsoftplus", routed_scaling=1.5)
  x = _x()
  ct = jax.random.normal(jax.random.key(7), x.shape)
  loss = lambda f: lambda m, x: (f(m, x) * ct).sum()
  g_moe, dx_moe = nnx.grad(loss(lambda m, x: m(x)[0]), argnums=(0, 1))(moe, x)
  g_ref, dx_ref = nnx.grad(loss(_dense_moe), argnums=(0, 1))(moe, x)
  np.testing.assert_allclose(dx_moe, dx_ref, rtol=1e-4, atol=1e-5)
  ref = dict(nnx.to_flat_state(g_ref))
  for path, g in nnx.to_flat_state(g_moe):
    np.testing.assert_allclose(g[...], ref[path][...], rtol=1e-4, atol=1e-5, err_msg=str(path))


def test_expert_load_and_router_bias_update():
  moe = _moe()
  x = _x()
  _, load = moe(x)
  ids, _ = moe.route(x.reshape(-1, D))
  np.testing.assert_allclose(load.sum(), 1.0, rtol=1e-6)
  np.testing.assert_allclose(load, np.bincount(np.ravel(ids), minlength=E) / (B * T * K))
  assert load.dtype == jnp.float32
  crafted = jnp.array([0.5, 0.25, 0.125, 0.125, 0.0, 0.0, 0.0, 0.0])  # mean 1/8
  update_router_bias(moe, crafted, rate=0.01)
  np.testing.assert_allclose(
      moe.e_score_correction_bias[...], [-0.01, -0.01, 0, 0, 0.01, 0.01, 0.01, 0.01], atol=1e-7
  )
  before = np.asarray(moe.e_score_correction_bias[...])
  update_router_bias(moe, load, rate=1e-3)
  delta = np.asarray(moe.e_score_correction_bias[...]) - before
  mean = 1.0 / E
  assert np.all(delta[np.asarray(load) < mean] > 0) and np.all(delta[np.asarray(load) > mean] < 0)


def test_jit_split_merge_and_ragged_dot_in_jaxpr():
  moe = _moe(n_shared_experts=1, n_group=2, topk_group=1)
  x = _x()
  y, load = moe(x)
  graphdef, state = nnx.split(moe)
  fwd = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  y_jit, load_jit = fwd(state, x)
  np.testing.assert_allclose(y_jit, y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(load_jit, load)
  y_nnx, _ = nnx.jit(lambda m, x: m(x))(moe, x)
  np.testing.assert_allclose(y_nnx, y, rtol=1e-5, atol=1e-6)
  assert "ragged_dot" in str(jax.make_jaxpr(fwd)(state, x))


def test_bf16_compute_returns_input_dtype():
  moe = MoE(D, F, E, K, 1, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  assert moe.gate.kernel[...].dtype == jnp.float32  # the router stays f32
  assert moe.experts_gate_proj[...].dtype == jnp.bfloat16
  x = _x(dtype=jnp.bfloat16)
  y, load = moe(x)
  assert y.dtype == jnp.bfloat16 and load.dtype == jnp.float32
  want, _, _ = _moe_loop_block(moe, x)
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=5e-2, atol=5e-2)


def test_mlp_swiglu():
  mlp = MLP(D, F, rngs=nnx.Rngs(0))
  x = _x()
  h = jax.nn.silu(x @ mlp.gate_proj.kernel[...]) * (x @ mlp.up_proj.kernel[...])
  np.testing.assert_allclose(mlp(x), h @ mlp.down_proj.kernel[...], rtol=1e-5, atol=1e-6)
  assert mlp.gate_proj.bias is None and mlp.down_proj.kernel.shape == (F, D)


@pytest.mark.parametrize(
    "args, kw, name",
    [
        ((D, F, E, 0, 0), {}, "experts_per_token"),
        ((D, F, E, E + 1, 0), {}, "experts_per_token"),
        ((D, F, E, K, 0), dict(n_group=3), "n_group"),
        ((D, F, E, K, 0), dict(n_group=2, topk_group=3), "topk_group"),
        ((D, F, E, 5, 0), dict(n_group=2, topk_group=1), "experts_per_token"),
        ((D, F, E, K, 0), dict(scoring="relu"), "scoring"),
        ((D, F, E, K, -1), {}, "n_shared_experts"),
    ],
)
def test_bad_args_raise(args, kw, name):
  with pytest.raises(ValueError, match=name):
    MoE(*args, rngs=nnx.Rngs(0), **kw)


def test_swiglu_limit_clamps_gate_above_and_up_both_ways():
  gate = jnp.asarray([-20.0, 0.5, 20.0])
  up = jnp.asarray([-20.0, 0.5, 20.0])
  clamped = swiglu(gate, up, limit=10.0)
  expected = jax.nn.silu(jnp.asarray([-20.0, 0.5, 10.0])) * jnp.asarray([-10.0, 0.5, 10.0])
  np.testing.assert_allclose(clamped, expected, rtol=1e-6)
  np.testing.assert_allclose(swiglu(gate, up), jax.nn.silu(gate) * up, rtol=1e-6)


def test_token_chunks_give_the_same_output_load_and_gradients():
  """`token_chunk` runs the routed experts over token chunks (each rematerialized): same numbers."""
  x = jax.random.normal(jax.random.key(3), (2, 24, 16))

  def run(chunk):
    moe = MoE(16, 24, 6, 2, 1, token_chunk=chunk, rngs=nnx.Rngs(0))

    def loss(moe, x):
      y, load = moe(x)
      return jnp.sum(y * jnp.cos(y)), (y, load)

    return nnx.value_and_grad(loss, has_aux=True, argnums=(0, 1))(moe, x)

  (value, (y, load)), grads = run(0)
  for chunk in (16, 48):  # 3 chunks of the 48 tokens, and one chunk (= N: unchunked path)
    (value_c, (y_c, load_c)), grads_c = run(chunk)
    np.testing.assert_allclose(y_c, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(load_c, load)
    np.testing.assert_allclose(value_c, value, rtol=1e-5)
    # Weight gradients are summed over the chunks in another order: an entry whose terms cancel is off
    # by the rounding of its terms, so the absolute tolerance scales with the leaf's largest entry.
    for g_c, g in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads), strict=True):
      np.testing.assert_allclose(g_c, g, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(g))))
  with pytest.raises(ValueError, match="moe_token_chunk=20"):
    MoE(16, 24, 6, 2, 1, token_chunk=20, rngs=nnx.Rngs(0))(x)


def _hash_oracle(moe, x, token_ids):
  """float64 hash routing: experts tid2eid[token], weights = their renormalised scores x scaling."""
  tokens = np.asarray(x, np.float64).reshape(-1, D)
  table = np.asarray(moe.tid2eid[...])
  wg, wu, wd = _np(moe.experts_gate_proj), _np(moe.experts_up_proj), _np(moe.experts_down_proj)
  scores = np.sqrt(np.log1p(np.exp(tokens @ _np(moe.gate.kernel))))  # sqrtsoftplus
  out = np.zeros_like(tokens)
  for n, (tok, t) in enumerate(zip(tokens, np.asarray(token_ids).reshape(-1))):
    chosen = table[t]
    w = scores[n, chosen] / scores[n, chosen].sum() * moe.routed_scaling
    for e, we in zip(chosen, w):
      out[n] += we * ((_silu(tok @ wg[e]) * (tok @ wu[e])) @ wd[e])
  return out.reshape(x.shape)


def test_hash_routing_matches_oracle_and_ignores_the_hidden_state():
  V = 11
  moe = _moe(scoring="sqrtsoftplus", routed_scaling=1.5, selection_bias=False, hash_vocab=V)
  table = np.asarray(moe.tid2eid[...])
  # A fresh table: k distinct experts per token id, all in range; not a Param, no router bias.
  assert table.shape == (V, K) and table.dtype == np.int32 and table.min() >= 0 and table.max() < E
  assert all(len(set(row)) == K for row in table)
  assert moe.e_score_correction_bias is None and not jax.tree.leaves(nnx.state(moe, RouterBias))
  assert "tid2eid" not in {p[0] for p, _ in nnx.to_flat_state(nnx.state(moe, nnx.Param))}
  # Adversarial ids: the first and last row, repeats, and a row that names one expert twice.
  moe.tid2eid[...] = moe.tid2eid[...].at[3].set(jnp.array([5, 5], jnp.int32))
  token_ids = jnp.array([[0, V - 1, 3, 3, 7], [3, 0, 0, V - 1, 2]], jnp.int32)
  x = _x()
  y, load = moe(x, token_ids=token_ids)
  np.testing.assert_allclose(y, _hash_oracle(moe, x, token_ids), rtol=1e-5, atol=1e-5)
  ids, _ = moe.route(x.reshape(-1, D), token_ids.reshape(-1))
  np.testing.assert_array_equal(ids, np.asarray(moe.tid2eid[...])[np.asarray(token_ids).reshape(-1)])
  expected_load = np.bincount(np.asarray(ids).reshape(-1), minlength=E) / ids.size
  np.testing.assert_allclose(load, expected_load, rtol=1e-6)
  # Gradients reach the router (through the combine weights) though the choice is fixed.
  grads = nnx.grad(lambda m: m(x, token_ids=token_ids)[0].sum())(moe)
  assert float(jnp.abs(grads.gate.kernel[...]).max()) > 0


def test_hash_routing_needs_token_ids_and_no_bias():
  moe = _moe(selection_bias=False, hash_vocab=4)
  with pytest.raises(ValueError, match="token_ids of shape"):
    moe(_x())
  with pytest.raises(ValueError, match="hash_vocab=4"):
    _moe(hash_vocab=4)  # selection_bias defaults to True
