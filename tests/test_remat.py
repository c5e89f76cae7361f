"""Selection replay: under remat, the backward pass reuses the selection and the attention residuals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops, remat
from hyscale_jax.ops.flash_topk.api import REGISTRY as FLASH_TOPK_REGISTRY
from hyscale_jax.ops.flash_topk.reference import flash_topk_reference
from hyscale_jax.ops.sparse_attention import reference as sa_reference
from hyscale_jax.ops.sparse_attention.api import REGISTRY as SPARSE_ATTENTION_REGISTRY
from hyscale_jax.ops.sparse_attention.vjp import attention_with_saved_residuals

B, T, D_MODEL, HI, DI, H, D, K = 1, 24, 16, 2, 8, 2, 8, 6


def _params(key, n_layers=2):
  def layer(key):
    ks = jax.random.split(key, 6)
    n = lambda k, *s: jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0])
    return dict(iq=n(ks[0], D_MODEL, HI, DI), ik=n(ks[1], D_MODEL, DI), iw=n(ks[2], D_MODEL, HI),
                q=n(ks[3], D_MODEL, H, D), kv=n(ks[4], D_MODEL, D), o=n(ks[5], H * D, D_MODEL))
  return [layer(k) for k in jax.random.split(key, n_layers)]


def _layer(p, x, topk_backend="reference", attention_backend="reference"):
  """A tiny DSA block: detached indexer -> flash_topk -> sparse MQA attention -> indexer KL."""
  xi = jax.lax.stop_gradient(x)
  iq = jnp.einsum("btm,mhd->bthd", xi, p["iq"])
  ik = xi @ p["ik"]
  iw = xi @ p["iw"]
  sel = ops.flash_topk(iq, ik, iw, topk=K, backend=topk_backend)
  q = jnp.einsum("btm,mhd->bthd", x, p["q"])
  kv = (x @ p["kv"])[:, :, None, :]
  out, lse = ops.sparse_attention(q, kv, kv, sel.indices, scale=D**-0.5, backend=attention_backend)
  aux = ops.indexer_loss(iq, ik, iw, q, kv, lse, sel.indices, attn_scale=D**-0.5)
  return x + out.reshape(B, T, H * D) @ p["o"], aux


def _loss(params, x, policy, **backends):
  aux_total = 0.0
  for p in params:
    x, aux = remat.remat(functools.partial(_layer, **backends), policy)(p, x)
    aux_total = aux_total + aux
  return jnp.mean(x**2) + aux_total


def _inputs():
  params = _params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (B, T, D_MODEL), jnp.float32)
  return params, x


@pytest.mark.parametrize("policy, expected", [("selection_replay", 2), ("full", 4), ("none", 2)])
def test_flash_topk_equations_in_gradient_jaxpr(policy, expected):
  params, x = _inputs()
  jaxpr = jax.make_jaxpr(jax.grad(_loss), static_argnums=2)(params, x, policy)
  assert remat.count_named_equations(jaxpr, "flash_topk") == expected


class _Counter:
  def __init__(self):
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    return np.asarray(x)


def _counting_flash_topk(counter):
  def backend(q, k, weights, **kwargs):
    indices, scores, *stats = flash_topk_reference(q, k, weights, **kwargs)
    indices = jax.pure_callback(counter, jax.ShapeDtypeStruct(indices.shape, indices.dtype), indices)
    return indices, scores, *stats
  return backend


def _counting_sparse_attention(counter):
  """The reference attention with a host counter on its forward pass (what remat would rerun)."""
  def forward(q, k, v, indices, **kwargs):
    out, lse = sa_reference.sparse_attention_forward_reference(q, k, v, indices, **kwargs)
    return out, jax.pure_callback(counter, jax.ShapeDtypeStruct(lse.shape, lse.dtype), lse)

  return functools.partial(attention_with_saved_residuals, forward,
                           sa_reference.sparse_attention_backward_reference)


@pytest.mark.parametrize("policy, selections, attention_forwards", [
    ("selection_replay", 2, 2), ("full", 4, 4), ("none", 2, 2)])
def test_real_executions_counted_by_pure_callback(monkeypatch, policy, selections, attention_forwards):
  topk_counter, attention_counter = _Counter(), _Counter()
  # A fresh backend name per case: flash_topk's jit cache is keyed by the backend name.
  name = f"counting_{policy}"
  monkeypatch.setitem(FLASH_TOPK_REGISTRY.implementations, name, _counting_flash_topk(topk_counter))
  monkeypatch.setitem(SPARSE_ATTENTION_REGISTRY.implementations, name,
                      _counting_sparse_attention(attention_counter))
  params, x = _inputs()
  loss = functools.partial(_loss, policy=policy, topk_backend=name, attention_backend=name)
  # Not jitted: XLA may CSE a recomputed pure_callback into the forward one within one program.
  jax.block_until_ready(jax.grad(loss)(params, x))
  assert topk_counter.calls == selections
  assert attention_counter.calls == attention_forwards


def test_gradients_agree_across_policies():
  params, x = _inputs()
  grads = {p: jax.grad(_loss)(params, x, p) for p in remat.REMAT_POLICIES}
  for policy in ("full", "none"):
    for a, b in zip(jax.tree.leaves(grads["selection_replay"]), jax.tree.leaves(grads[policy])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_indexer_gets_gradient_only_from_indexer_loss():
  params, x = _inputs()
  lm_only = lambda ps, x: jnp.mean(
      functools.reduce(lambda h, p: _layer(p, h)[0], ps, x) ** 2)
  aux_only = lambda ps, x: sum(_layer(p, x)[1] for p in ps)
  g_lm, g_aux = jax.grad(lm_only)(params, x), jax.grad(aux_only)(params, x)
  for layer_lm, layer_aux in zip(g_lm, g_aux):
    for name in ("iq", "ik", "iw"):
      assert not np.any(layer_lm[name]), f"LM loss reached indexer param {name}"
      assert np.any(layer_aux[name]), f"indexer loss did not reach {name}"
    for name in ("q", "kv", "o"):
      assert not np.any(layer_aux[name]), f"indexer loss reached attention param {name}"
      assert np.any(layer_lm[name])


def test_unknown_policy_is_rejected():
  with pytest.raises(ValueError, match="policy"):
    remat.checkpoint_policy("everything")


def _counting_teacher(counter):
  from hyscale_jax.ops.indexer_loss.reference import teacher_mass_reference  # noqa: PLC0415

  def teacher(*args, **kwargs):
    mass = teacher_mass_reference(*args, **kwargs)
    return jax.pure_callback(counter, jax.ShapeDtypeStruct(mass.shape, mass.dtype), mass)
  return teacher


@pytest.mark.parametrize("grad_in_forward, policy, teachers", [
    (False, "selection_replay", 3), (True, "selection_replay", 1), (True, "full", 2)])
def test_indexer_loss_grad_in_forward_runs_the_teacher_once(grad_in_forward, policy, teachers):
  """Unfused: forward, remat recompute and backward each run the teacher; fused and saved: once."""
  from hyscale_jax.ops.indexer_loss import indexer_loss_reference  # noqa: PLC0415
  counter = _Counter()
  teacher = _counting_teacher(counter)
  params, x = _inputs()
  p = params[0]

  def layer(p, x):
    iq = jnp.einsum("btm,mhd->bthd", x, p["iq"])
    ik, iw = x @ p["ik"], x @ p["iw"]
    sel = ops.flash_topk(iq, ik, iw, topk=K)
    q = jnp.einsum("btm,mhd->bthd", x, p["q"])
    kv = (x @ p["kv"])[:, :, None, :]
    _, lse = ops.sparse_attention(q, kv, kv, sel.indices, scale=D**-0.5)
    return indexer_loss_reference(iq, ik, iw, q, kv, lse, sel.indices, attn_scale=D**-0.5,
                                  teacher_mass=teacher, grad_in_forward=grad_in_forward, query_chunk=T)

  jax.block_until_ready(jax.grad(remat.remat(layer, policy))(p, x))
  assert counter.calls == teachers
