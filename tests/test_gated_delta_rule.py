"""gated_delta_rule: the chunked reference and the token baseline against the float64 oracle, in values,
final states and gradients; packed documents, ragged lengths, initial states, O(T) memory, context shards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops

try:
  from tests.jaxpr_tools import equations
  from tests.oracles import gated_delta_rule_oracle
except ImportError:  # tests/ itself is on sys.path
  from jaxpr_tools import equations
  from oracles import gated_delta_rule_oracle


def _inputs(seed, B, T, Hk, Hv, Dk, Dv, *, documents=(), decay=1.0, beta_range=(0.0, 1.0), state=True):
  """f32 (q, k, v, g, beta, segment_ids, initial_state); k has unit rows as Gated DeltaNet feeds it.

  `documents`: the first token of each later document in every row (row 1 shifted by one).
  """
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((B, T, Hk, Dk))
  q, k = rng.standard_normal((B, T, Hk, Dk)), k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((B, T, Hv, Dv))
  g = -decay * rng.uniform(0.0, 1.0, (B, T, Hv))
  beta = rng.uniform(*beta_range, (B, T, Hv))
  seg = np.stack([np.searchsorted(np.asarray(documents, int) + b, np.arange(T), side="right") for b in range(B)])
  s0 = rng.standard_normal((B, Hv, Dk, Dv)) if state else None
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  return (*map(f32, (q, k, v, g, beta)), jnp.asarray(seg, jnp.int32), f32(s0))


# (B, T, Hk, Hv, Dk, Dv, chunk, documents, decay, beta range): ragged T with grouped value heads;
# documents starting at a chunk's first and last token and one of a single token; T below one
# chunk; decays strong enough to underflow; beta = 1 with unit keys (exact overwrites).
CASES = {
    "ragged_gqa": (2, 37, 2, 4, 8, 6, 8, (10, 30), 1.0, (0.0, 1.0)),
    "boundaries": (2, 40, 1, 2, 8, 8, 8, (8, 15, 16, 31), 1.0, (0.0, 1.0)),
    "one_chunk": (1, 5, 2, 2, 4, 4, 64, (3,), 1.0, (0.0, 1.0)),
    "strong_decay": (1, 24, 1, 1, 8, 4, 8, (), 40.0, (0.0, 1.0)),
    "overwrite": (1, 24, 1, 3, 8, 4, 8, (13,), 0.0, (1.0, 1.0)),
}


# The baseline on two cases: it is the gradient test's second opinion, the reference is the subject.
@pytest.mark.parametrize("case, backend", [(c, "reference") for c in CASES] +
                         [("ragged_gqa", "xla_baseline"), ("boundaries", "xla_baseline")])
def test_values_and_final_state_match_oracle(case, backend):
  B, T, Hk, Hv, Dk, Dv, chunk, documents, decay, beta_range = CASES[case]
  q, k, v, g, beta, seg, s0 = _inputs(0, B, T, Hk, Hv, Dk, Dv, documents=documents, decay=decay,
                                      beta_range=beta_range)
  out, state = ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0, chunk=chunk,
                                    return_final_state=True, backend=backend)
  want_out, want_state = gated_delta_rule_oracle(q, k, v, g, beta, scale=Dk**-0.5, segment_ids=np.asarray(seg),
                                                 initial_state=s0)
  assert out.shape == (B, T, Hv, Dv) and out.dtype == jnp.float32 and state.shape == (B, Hv, Dk, Dv)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=2e-5)


def test_repeated_keys_with_full_writes_stay_exact():
  # Nearly one key throughout, beta = 1, no decay: each write replaces the last. The chunk's UT
  # system then has entries near 1 below the diagonal; its powers reach binomial sizes (1e18 at
  # C = 64), so an inverse built from them (a Neumann/doubling product) cancels catastrophically,
  # while the triangular solve stays exact.
  rng = np.random.default_rng(9)
  k = rng.standard_normal((1, 1, 1, 16)) + 1e-3 * rng.standard_normal((1, 128, 1, 16))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  q, v = rng.standard_normal((1, 128, 1, 16)), rng.standard_normal((1, 128, 1, 16))
  g, beta = np.zeros((1, 128, 1)), np.ones((1, 128, 1))
  want_out, want_state = gated_delta_rule_oracle(q, k, v, g, beta, scale=0.25)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out, state = ops.gated_delta_rule(*map(f32, (q, k, v, g, beta)), scale=0.25, return_final_state=True)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=2e-5)
  np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=2e-5)


def test_defaults_no_documents_no_state_and_bf16():
  q, k, v, g, beta, _, _ = _inputs(1, 2, 70, 2, 2, 8, 8, state=False)
  want, _ = gated_delta_rule_oracle(q, k, v, g, beta, scale=0.3)
  np.testing.assert_allclose(ops.gated_delta_rule(q, k, v, g, beta, scale=0.3), want, rtol=1e-5, atol=2e-5)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  out = ops.gated_delta_rule(bf16(q), bf16(k), bf16(v), g, bf16(beta), scale=0.3)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(out), want, atol=0.1)


def _loss(backend, chunk=8):
  def loss(q, k, v, g, beta, s0, seg, w_out, w_state):
    out, state = ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0, chunk=chunk,
                                      return_final_state=True, backend=backend)
    return jnp.sum(out * w_out) + jnp.sum(state * w_state)
  return loss


def test_gradients_match_the_baseline_and_the_oracles_finite_differences():
  B, T, Hk, Hv, Dk, Dv = 1, 21, 1, 2, 4, 3
  q, k, v, g, beta, seg, s0 = _inputs(2, B, T, Hk, Hv, Dk, Dv, documents=(6, 15))
  rng = np.random.default_rng(3)
  w_out, w_state = rng.standard_normal((B, T, Hv, Dv)), rng.standard_normal((B, Hv, Dk, Dv))
  args = (q, k, v, g, beta, s0)
  grads = jax.grad(_loss("reference"), range(6))(*args, seg, jnp.float32(w_out), jnp.float32(w_state))
  base = jax.grad(_loss("xla_baseline"), range(6))(*args, seg, jnp.float32(w_out), jnp.float32(w_state))
  for got, want in zip(grads, base):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

  def oracle_loss(*xs):
    out, state = gated_delta_rule_oracle(*xs[:5], scale=Dk**-0.5, segment_ids=np.asarray(seg), initial_state=xs[5])
    return np.sum(out * w_out) + np.sum(state * w_state)

  # A central difference along a random direction of each input, in float64.
  eps = 1e-5
  base64 = [np.asarray(x, np.float64) for x in args]
  for i, grad in enumerate(grads):
    d = rng.standard_normal(base64[i].shape)
    plus = [x + eps * d if j == i else x for j, x in enumerate(base64)]
    minus = [x - eps * d if j == i else x for j, x in enumerate(base64)]
    numeric = (oracle_loss(*plus) - oracle_loss(*minus)) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(grad, np.float64) * d), numeric, rtol=1e-4, atol=1e-4)


def test_reference_memory_is_linear_in_t_forward_and_backward():
  B, T, Hk, Hv, Dk, Dv = 1, 96, 1, 1, 4, 4  # every other dimension is far below T
  q, k, v, g, beta, seg, s0 = _inputs(4, B, T, Hk, Hv, Dk, Dv, documents=(50,))
  w = jnp.ones((B, T, Hv, Dv))
  jaxpr = jax.make_jaxpr(jax.grad(_loss("reference", chunk=16), range(6)))(q, k, v, g, beta, s0, seg, w, s0)
  shapes = {tuple(x.aval.shape) for e in equations(jaxpr) for x in (*e.invars, *e.outvars) if hasattr(x, "aval")}
  assert not [s for s in shapes if sum(d >= 32 for d in s) >= 2], shapes  # nothing [T, T], no chunk pair


def test_documents_are_independent_and_the_state_carries_over_calls():
  q, k, v, g, beta, seg, s0 = _inputs(5, 1, 30, 1, 2, 4, 4, documents=(12,))
  out = ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0, chunk=8)
  # The second document alone, from a zero state, gives the same rows.
  alone = ops.gated_delta_rule(*(x[:, 12:] for x in (q, k, v, g, beta)), chunk=8)
  np.testing.assert_allclose(out[:, 12:], alone, rtol=1e-5, atol=1e-6)
  # Two calls chained by the state equal one call over both halves.
  first, state = ops.gated_delta_rule(*(x[:, :17] for x in (q, k, v, g, beta)), initial_state=s0, chunk=8,
                                      return_final_state=True)
  second = ops.gated_delta_rule(*(x[:, 17:] for x in (q, k, v, g, beta)), initial_state=state, chunk=8)
  whole = ops.gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk=8)
  np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("documents", [
    (8, 17, 24),  # documents starting on shards 1 and 3's first tokens, and inside shard 2
    pytest.param((), marks=pytest.mark.slow),
])
def test_a_context_mesh_passes_the_state_between_shards_in_order(documents):
  q, k, v, g, beta, seg, s0 = _inputs(6, 2, 32, 2, 4, 4, 4, documents=documents)
  w_out = jnp.asarray(np.random.default_rng(7).standard_normal((2, 32, 4, 4)), jnp.float32)
  loss = jax.jit(jax.value_and_grad(_loss("reference"), range(6)))
  want = loss(q, k, v, g, beta, s0, seg, w_out, s0)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(loss)(q, k, v, g, beta, s0, seg, w_out, s0))
    got = loss(q, k, v, g, beta, s0, seg, w_out, s0)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("bad, match", [
    (dict(q=np.zeros((2, 8, 4), np.float32)), "q must have rank 4"),
    (dict(k=np.zeros((2, 8, 2, 5), np.float32)), "k.shape"),
    (dict(v=np.zeros((2, 8, 3, 4), np.float32)), "v.shape"),
    (dict(g=np.zeros((2, 8, 2), np.float32)), "g.shape"),
    (dict(beta=np.zeros((2, 7, 4), np.float32)), "beta.shape"),
    (dict(q=np.zeros((2, 8, 2, 4), np.int32)), "q must be a floating dtype"),
    (dict(segment_ids=np.zeros((2, 8), np.float32)), "segment_ids must be an integer"),
    (dict(segment_ids=np.zeros((2, 9), np.int32)), "segment_ids.shape"),
    (dict(initial_state=np.zeros((2, 4, 4, 3), np.float32)), "initial_state.shape"),
    (dict(chunk=0), "chunk must be a positive int"),
    (dict(scale=np.ones(2)), "scale must be"),
    (dict(backend="nope"), "unknown backend"),
])
def test_bad_input_raises_value_error_naming_the_argument(bad, match):
  args = dict(q=np.zeros((2, 8, 2, 4), np.float32), k=np.zeros((2, 8, 2, 4), np.float32),
              v=np.zeros((2, 8, 4, 4), np.float32), g=np.zeros((2, 8, 4), np.float32),
              beta=np.zeros((2, 8, 4), np.float32))
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    ops.gated_delta_rule(*[args.pop(n) for n in ("q", "k", "v", "g", "beta")], **args)


@pytest.mark.gpu_only
def test_reference_on_gpu_at_a_real_shape_matches_the_baseline():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device")
  # Qwen3.8-Flash-Next's Gated DeltaNet heads (16 q/k, 48 v, 128 dims), one row of 1000 tokens.
  q, k, v, g, beta, seg, s0 = _inputs(8, 1, 1000, 16, 48, 128, 128, documents=(300, 640))
  run = lambda backend: ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0,
                                             return_final_state=True, backend=backend)
  for got, want in zip(run("reference"), run("xla_baseline")):
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
