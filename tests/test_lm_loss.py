"""The chunked LM loss (layers/lm_head.py): values and gradients against a float64 oracle and the
logits path, the whole model's gradients, no [B, T, V] array in the training step, and a mesh."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hyscale_jax import models
from hyscale_jax import sharding as shd
from hyscale_jax.layers.lm_head import chunk_layout, chunked_lm_loss, lm_loss
from hyscale_jax.model_config import ModelConfig
from tests.jaxpr_tools import equations

B, T, D, V = 3, 13, 8, 37
_untied = lambda w, h: h @ w  # w [D, V]
_tied = lambda e, h: h @ e.T  # e [V, D], as embed_tokens.attend


def _inputs(seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(ks[0], (B, T, D), dtype)
  w = (jax.random.normal(ks[1], (D, V)) * 2).astype(dtype)  # spread logits: a peaked softmax too
  targets = jax.random.randint(ks[2], (B, T), 0, V)
  mask = (jax.random.uniform(ks[3], (B, T)) < 0.7).astype(jnp.float32).at[1].set(0.0)  # row 1 masked out
  return h, w, targets, mask


def _oracle(h, w, targets, mask):
  """float64 loss, d/dh and d/dw of mean cross-entropy over mask, logits = h @ w."""
  h, w, mask = (np.asarray(x, np.float64) for x in (h, w, mask))
  z = h @ w
  z_max = z.max(-1, keepdims=True)
  lse = z_max[..., 0] + np.log(np.exp(z - z_max).sum(-1))
  nll = lse - np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0]
  count = max(mask.sum(), 1.0)
  dz = np.exp(z - lse[..., None])
  np.put_along_axis(dz, np.asarray(targets)[..., None], np.take_along_axis(dz, np.asarray(targets)[..., None], -1) - 1,
                    -1)
  dz *= (mask / count)[..., None]
  return (nll * mask).sum() / count, dz @ w.T, np.einsum("btd,btv->dv", h, dz)


def test_chunk_layout_pads_at_most_one_row_per_chunk():
  assert chunk_layout(13, 0) == (1, 13) == chunk_layout(13, 13) == chunk_layout(13, 100)
  assert chunk_layout(13, 4) == (4, 4) and chunk_layout(13, 5) == (3, 5) and chunk_layout(64, 16) == (4, 16)
  for t in range(1, 40):
    for c in range(1, 12):
      n, rows = chunk_layout(t, c)
      assert rows <= c and n * rows >= t and n * rows - t < n


@pytest.mark.parametrize("chunk", [0, 1, 4, 5, 13, 64])
def test_loss_and_gradients_match_the_float64_oracle_and_the_logits_path(chunk):
  h, w, targets, mask = _inputs()
  want_loss, want_dh, want_dw = _oracle(h, w, targets, mask)
  chunked = lambda w, h: chunked_lm_loss(_untied, w, h, targets, mask, chunk=chunk)
  whole = lambda w, h: lm_loss(_untied(w, h), targets, mask)
  loss, (dw, dh) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(w, h)
  loss0, (dw0, dh0) = jax.value_and_grad(whole, argnums=(0, 1))(w, h)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(loss0, want_loss, rtol=1e-6)
  for got, ref, want in ((dh, dh0, want_dh), (dw, dw0, want_dw)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
  assert not np.asarray(dh[1]).any()  # the masked-out row gets no gradient
  # Evaluation (no autodiff) takes the loss-only path: same value.
  np.testing.assert_allclose(jax.jit(chunked)(w, h), want_loss, rtol=1e-6)


def test_tied_head_and_a_scaled_cotangent():
  h, w, targets, mask = _inputs(1)
  e = w.T  # [V, D]
  want_loss, want_dh, want_dw = _oracle(h, w, targets, mask)
  f = lambda e, h: 3.0 * chunked_lm_loss(_tied, e, h, targets, mask, chunk=4)
  loss, (de, dh) = jax.value_and_grad(f, argnums=(0, 1))(e, h)
  np.testing.assert_allclose(loss, 3 * want_loss, rtol=1e-6)
  np.testing.assert_allclose(dh, 3 * want_dh, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(de, 3 * want_dw.T, rtol=1e-5, atol=1e-7)


def test_bf16_head_keeps_dtypes_and_tracks_the_logits_path():
  h, w, targets, mask = _inputs(2, jnp.bfloat16)
  chunked = lambda w, h: chunked_lm_loss(_untied, w, h, targets, mask, chunk=4)
  whole = lambda w, h: lm_loss(_untied(w, h), targets, mask)
  loss, (dw, dh) = jax.value_and_grad(chunked, argnums=(0, 1))(w, h)
  loss0, (dw0, dh0) = jax.value_and_grad(whole, argnums=(0, 1))(w, h)
  assert loss.dtype == jnp.float32 and dw.dtype == dh.dtype == jnp.bfloat16
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)  # the same bf16 logits, f32 softmax
  # The head gradient accumulates over chunks in f32 (the whole path sums inside one bf16 matmul).
  np.testing.assert_allclose(np.float32(dw), np.float32(dw0), rtol=2e-2, atol=2e-3)
  np.testing.assert_allclose(np.float32(dh), np.float32(dh0), rtol=1e-2, atol=1e-3)


def test_bad_arguments_are_named():
  h, w, targets, mask = _inputs()
  with pytest.raises(ValueError, match="targets.shape"):
    chunked_lm_loss(_untied, w, h, targets[:, :-1], mask, chunk=4)
  with pytest.raises(ValueError, match="chunk=-1"):
    chunked_lm_loss(_untied, w, h, targets, mask, chunk=-1)
  with pytest.raises(ValueError, match="lm_loss_chunk"):
    ModelConfig(lm_loss_chunk=-2)


_SMALL = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2,
    n_shared_experts=1, moe_inter=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=6,
    rope_theta=10000.0, lm_loss_chunk=5)


@pytest.mark.parametrize("tied", [False, True])
def test_whole_model_gradients_match_the_logits_path(tied):
  model = models.build(dataclasses.replace(_SMALL, tie_embeddings=tied), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, _SMALL.vocab_size)
  targets, mask = jnp.roll(tokens, -1, 1), jnp.ones((2, 16)).at[:, -1].set(0.0)

  def chunked(params):
    model = nnx.merge(graphdef, params, rest)
    h, aux = model.hidden_states(tokens)
    return model.lm_loss(h, targets, mask) + aux["indexer_loss"]

  def whole(params):
    out = nnx.merge(graphdef, params, rest)(tokens)
    return lm_loss(out.logits, targets, mask) + out.aux["indexer_loss"]

  (loss, grads), (loss0, grads0) = (jax.jit(jax.value_and_grad(f))(params) for f in (chunked, whole))
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  flat, flat0 = nnx.to_flat_state(grads), dict(nnx.to_flat_state(grads0))
  head = ("embed_tokens", "embedding") if tied else ("lm_head", "kernel")
  assert head in flat0 and np.abs(flat0[head][...]).max() > 0
  for path, g in flat:
    np.testing.assert_allclose(g[...], flat0[path][...], rtol=2e-4, atol=1e-6, err_msg=str(path))


def _lm_config(chunk):
  from configs import glm5_1  # noqa: PLC0415

  config = glm5_1.get_config("tiny")
  fields = {f.name: getattr(_SMALL, f.name) for f in dataclasses.fields(_SMALL)}
  # V = 97 differs from every other dimension, so an aval holding V is a logits-like array.
  config.model.update({k: v for k, v in fields.items() if not isinstance(v, tuple)}, lm_loss_chunk=chunk,
                      vocab_size=97)
  config.data.update(seq_len=48, batch_size=2)
  return config


def _large_logits(chunk):
  """(shapes of f32 avals with V in them, B, T, V) in the jaxpr of the sparse-stage training gradient."""
  from hyscale_jax.training import lm  # noqa: PLC0415

  config = _lm_config(chunk)
  cfg, mesh = lm.setup(config)
  rules = shd.rules_from_config(config.mesh)
  Bt, Tt, Vt = config.data.batch_size, config.data.seq_len, cfg.vocab_size
  tokens = jnp.zeros((Bt, Tt), jnp.int32)
  batch = dict(tokens=tokens, targets=tokens, loss_mask=jnp.ones((Bt, Tt)), segment_ids=tokens,
               positions=jnp.broadcast_to(jnp.arange(Tt, dtype=jnp.int32), (Bt, Tt)))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    training = lm.build_training(config, cfg, mesh, rules)
    params, rest = training.state["params"], training.state["rest"]
    grad = jax.grad(lambda p: training.objective(p, rest, batch, False)[0])
    jaxpr = jax.make_jaxpr(grad)(params)
  shapes = {tuple(v.aval.shape) for e in equations(jaxpr) for v in (*e.invars, *e.outvars)
            if hasattr(v, "aval") and getattr(v.aval, "dtype", None) == jnp.float32 and Vt in v.aval.shape}
  return shapes, Bt, Tt, Vt


def test_no_b_t_v_array_in_the_training_gradient():
  chunk = 16
  shapes, Bt, Tt, Vt = _large_logits(chunk)
  assert (Bt, Tt, Vt) not in shapes
  largest = max(int(np.prod(s)) for s in shapes)
  # Nothing with V larger than one chunk's logits (e.g. no [n, B, chunk, V] stack of residuals) or
  # than the head weight [D, V].
  assert largest <= max(Bt * chunk * Vt, _SMALL.d_model * Vt), shapes
  # The check sees the logits when they are whole.
  assert (Bt, Tt, Vt) in _large_logits(0)[0]


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:8])


@pytest.mark.parametrize("names,w_spec", [
    (("data", "context", "tensor"), P(None, "tensor")),  # vocabulary split over tensor
    (("fsdp", "expert", "context"), P("fsdp", None)),  # FSDP head weight
])
def test_on_a_mesh_each_device_chunks_its_rows_and_matches_one_device(names, w_spec):
  Bm, Tm = 4, 24
  ks = jax.random.split(jax.random.key(5), 4)
  h, w = jax.random.normal(ks[0], (Bm, Tm, D)), jax.random.normal(ks[1], (D, 40))
  targets = jax.random.randint(ks[2], (Bm, Tm), 0, 40)
  mask = (jax.random.uniform(ks[3], (Bm, Tm)) < 0.7).astype(jnp.float32).at[2].set(0.0)
  f = lambda w, h: chunked_lm_loss(_untied, w, h, targets, mask, chunk=5)  # 6 rows per device: 2 chunks
  step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  want_loss, (want_dw, want_dh) = step(w, h)
  mesh = _mesh((2, 2, 2), names)
  rows = NamedSharding(mesh, P(tuple(n for n in names if n != "context" and n != "tensor"), "context"))
  with jax.set_mesh(mesh):
    args = (jax.device_put(w, NamedSharding(mesh, w_spec)), jax.device_put(h, rows))
    loss, (dw, dh) = step(*args)
    hlo = step.lower(*args).compile().as_text()
    assert "shard_map" in str(jax.make_jaxpr(f)(*args))  # split over the rows' axes
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(dh, want_dh, rtol=1e-5, atol=1e-7)
  # The hidden states are never gathered: the only all-gather is the FSDP head weight's.
  gathered = re.findall(r"= (\S+) all-gather\(", hlo)
  assert all(s.startswith(f"f32[{D},40]") for s in gathered), gathered


def _head_step(shape, chunk, dtype=jnp.bfloat16):
  """The jitted (loss, (dw, dh)) of the chunked loss at h [B, T, D], w [D, V], and its compiled memory."""
  Bh, Th, Dh, Vh = shape
  f = lambda w, h, t, m: jax.value_and_grad(
      lambda w, h: chunked_lm_loss(_untied, w, h, t, m, chunk=chunk), argnums=(0, 1))(w, h)
  S = jax.ShapeDtypeStruct
  step = jax.jit(f)
  compiled = step.lower(S((Dh, Vh), dtype), S((Bh, Th, Dh), dtype), S((Bh, Th), jnp.int32),
                        S((Bh, Th), jnp.float32)).compile()
  return step, compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temporaries_hold_one_chunk_of_glm_vocabulary_logits():
  """At GLM-5.1's vocabulary, XLA's buffer plan for the loss and its gradient holds about one
  chunk's f32 logits (plus the f32 head-gradient accumulator), not the whole [B, T, V]."""
  Bh, Th, Dh, Vh, chunk = 1, 16384, 256, 154880, 1024
  _, chunked = _head_step((Bh, Th, Dh, Vh), chunk)
  _, whole = _head_step((Bh, Th, Dh, Vh), 0)
  one_chunk = Bh * chunk * Vh * 4
  assert chunked < 3 * one_chunk + Dh * Vh * 4, (chunked, one_chunk)
  assert whole > Bh * Th * Vh * 4 > 4 * chunked, (whole, chunked)


@pytest.mark.gpu_only
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA device")
def test_glm5_1_head_at_16k_tokens_on_the_gpu():
  """GLM-5.1's head (D 6144, V 154,880, bf16) at 16K tokens: the chunked loss matches the whole-logits
  path, holds a fraction of its temporaries, and is not slower (timings printed)."""
  import time  # noqa: PLC0415

  shape, chunk = (1, 16384, 6144, 154880), ModelConfig().lm_loss_chunk
  ks = jax.random.split(jax.random.key(0), 4)
  w = (jax.random.normal(ks[0], shape[2:], jnp.float32) * shape[2] ** -0.5).astype(jnp.bfloat16)
  h = jax.random.normal(ks[1], shape[:3], jnp.bfloat16)
  t = jax.random.randint(ks[2], shape[:2], 0, shape[3])
  m = (jax.random.uniform(ks[3], shape[:2]) < 0.9).astype(jnp.float32)
  results = {}
  for name, c in (("chunked", chunk), ("whole", 0)):
    step, temp = _head_step(shape, c)
    out = jax.block_until_ready(step(w, h, t, m))
    times = []
    for _ in range(3):
      start = time.perf_counter()
      jax.block_until_ready(step(w, h, t, m))
      times.append(time.perf_counter() - start)
    results[name] = (out, temp, min(times))
    print(f"{name}: temp {temp / 2**30:.2f} GiB, {min(times) * 1e3:.1f} ms, loss {float(out[0]):.6f}")
  (loss, (dw, dh)), temp, seconds = results["chunked"]
  (loss0, (dw0, dh0)), temp0, seconds0 = results["whole"]
  np.testing.assert_allclose(loss, loss0, rtol=1e-5)
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
  assert rel(dw, dw0) < 1e-2 and rel(dh, dh0) < 1e-2, (rel(dw, dw0), rel(dh, dh0))
  assert temp < 3 * chunk * shape[3] * 4 + shape[2] * shape[3] * 4 < temp0, (temp, temp0)
  assert seconds < 1.25 * seconds0, (seconds, seconds0)
