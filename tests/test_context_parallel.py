"""Context parallelism on 8 fake CPU devices: exact selection, attention and its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from hyscale_jax import ops, parallel


def _mesh(n):
  return jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def _ints(rng, shape, lo=-2, hi=2):
  return jnp.asarray(rng.integers(lo, hi + 1, size=shape).astype(np.float32))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_flash_topk_is_bit_identical_to_one_device(n, layout):
  rng = np.random.default_rng(n)
  B, T, H, D, topk = 2, 64, 3, 8, 6
  q, k, w = _ints(rng, (B, T, H, D)), _ints(rng, (B, T, D)), _ints(rng, (B, T, H))
  want = ops.flash_topk(q, k, w, topk=topk, scale=0.5)
  lay = lambda x: parallel.to_layout(x, n, layout)
  got = parallel.context_parallel_flash_topk(lay(q), lay(k), lay(w), mesh=_mesh(n), topk=topk, layout=layout,
                                             scale=0.5)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(parallel.from_layout(a, n, layout)), np.asarray(b))
  assert (np.asarray(want.indices) >= 0).any()


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_unsorted_pallas_selection_is_bit_identical_to_one_device(layout):
  """`sorted=False` on the Pallas kernel (interpret mode): each row's order is the kernel's own, so
  splitting the rows over devices leaves it unchanged, bit for bit."""
  rng = np.random.default_rng(5)
  n, B, T, H, D, topk = 4, 1, 64, 2, 8, 6
  q, k, w = _ints(rng, (B, T, H, D)), _ints(rng, (B, T, D)), _ints(rng, (B, T, H))
  want = ops.flash_topk(q, k, w, topk=topk, backend="pallas", sorted=False)
  lay = lambda x: parallel.to_layout(x, n, layout)
  got = parallel.context_parallel_flash_topk(lay(q), lay(k), lay(w), mesh=_mesh(n), topk=topk, layout=layout,
                                             backend="pallas", sorted=False)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(parallel.from_layout(a, n, layout)), np.asarray(b))
  assert not np.array_equal(np.asarray(want.indices), np.asarray(ops.flash_topk(q, k, w, topk=topk).indices))


def test_flash_topk_with_compressed_keys_and_documents():
  rng = np.random.default_rng(9)
  n, B, T, H, D, topk = 4, 1, 64, 2, 8, 5
  q, w = _ints(rng, (B, T, H, D)), _ints(rng, (B, T, H))
  k = _ints(rng, (B, T // 4, D))
  q_seg = jnp.asarray((np.arange(T) >= 23).astype(np.int32))[None]
  kv_seg = q_seg[:, 3::4]
  want = ops.flash_topk(q, k, w, topk=topk, compress_ratio=4, segment_ids=(q_seg, kv_seg))
  got = parallel.context_parallel_flash_topk(q, k, w, mesh=_mesh(n), topk=topk, compress_ratio=4,
                                             segment_ids=(q_seg, kv_seg))
  np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_sparse_attention_and_gradients_match_one_device(layout):
  n, B, T, H, Dk, Dv, K = 4, 2, 32, 4, 8, 8, 6
  ks = jax.random.split(jax.random.key(0), 6)
  q = jax.random.normal(ks[0], (B, T, H, Dk))
  k = jax.random.normal(ks[1], (B, T, 1, Dk))
  v = jax.random.normal(ks[2], (B, T, 1, Dv))
  pos = jnp.arange(T)[None, :, None]
  idx = jnp.where(jax.random.uniform(ks[3], (B, T, K)) < 0.9,
                  jax.random.randint(ks[4], (B, T, K), 0, T) % (pos + 1), -1).astype(jnp.int32)
  sinks = jax.random.normal(ks[5], (H,))
  dout = jax.random.normal(ks[5], (B, T, H, Dv))
  lay = lambda x: parallel.to_layout(x, n, layout)

  def single(q, k, v, sinks):
    out, lse = ops.sparse_attention(q, k, v, idx, scale=0.4, sinks=sinks)
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  def sharded(q, k, v, sinks):
    out, lse = parallel.context_parallel_sparse_attention(lay(q), lay(k), lay(v), lay(idx), mesh=_mesh(n),
                                                          scale=0.4, sinks=sinks, layout=layout)
    out, lse = parallel.from_layout(out, n, layout), parallel.from_layout(lse, n, layout)
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  want_v, want_g = jax.value_and_grad(single, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  got_v, got_g = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_zigzag_balances_causal_work():
  contiguous = parallel.causal_work(1 << 16, 8, "contiguous")
  zigzag = parallel.causal_work(1 << 16, 8, "zigzag")
  assert contiguous.sum() == zigzag.sum() == (1 << 16) * ((1 << 16) + 1) // 2
  assert contiguous.max() / contiguous.min() > 10  # 15x: the last shard does most of the work
  assert zigzag.max() / zigzag.min() < 1.001


def test_layout_round_trip_and_bad_lengths():
  x = jnp.arange(2 * 48).reshape(2, 48)
  for layout in parallel.LAYOUTS:
    np.testing.assert_array_equal(parallel.from_layout(parallel.to_layout(x, 4, layout), 4, layout), x)
  with pytest.raises(ValueError, match="divisible by 16"):
    parallel.causal_work(40, 8, "zigzag")


def test_ops_split_the_sequence_by_themselves_under_a_context_mesh():
  rng = np.random.default_rng(3)
  B, T, H, D, topk = 2, 32, 2, 8, 5
  q, k, w = _ints(rng, (B, T, H, D)), _ints(rng, (B, T, D)), _ints(rng, (B, T, H))
  want = ops.flash_topk(q, k, w, topk=topk)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
  select = jax.jit(lambda q, k, w: ops.flash_topk(q, k, w, topk=topk))
  with jax.set_mesh(mesh):
    jaxpr = jax.make_jaxpr(select)(q, k, w)
    got = select(q, k, w)
  assert "shard_map" in str(jaxpr)  # it really ran split over the mesh
  np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
  np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))


def _lm_config(tmp_path, steps, **mesh):
  from configs import glm5_1  # noqa: PLC0415

  config = glm5_1.get_config("tiny")
  config.model.update(d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4,
                      experts_per_token=2, moe_inter=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8,
                      index_topk=8, vocab_size=512)
  config.data.update(source="pydoc", vocab_size=512, seq_len=64, batch_size=2, cache_dir=str(tmp_path / "data"))
  config.train.update(steps=steps, warmup_steps=2, log_every=1, checkpoint_every=3, progress_bar=False)
  config.mesh.update(mesh)
  return config


def test_training_on_a_data_by_context_mesh_matches_one_device(tmp_path):
  from hyscale_jax.training import lm  # noqa: PLC0415

  one = lm.train_and_evaluate(_lm_config(tmp_path, 5), str(tmp_path / "one"))
  split = lm.train_and_evaluate(_lm_config(tmp_path, 5, data=2, context=4), str(tmp_path / "split"))
  assert [r["stage"] for r in split] == [lm.DENSE_STAGE] * 2 + [lm.SPARSE_STAGE] * 3
  for a, b in zip(one, split):
    for key in ("loss", "lm_loss", "indexer_loss"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, err_msg=f"step {a['step']} {key}")
  # A checkpoint written on the 2 x 4 mesh resumes on one device and continues the same run.
  resumed = lm.train_and_evaluate(_lm_config(tmp_path, 7), str(tmp_path / "split"))
  straight = lm.train_and_evaluate(_lm_config(tmp_path, 7), str(tmp_path / "one"))
  assert [r["step"] for r in resumed] == [6, 7] == [r["step"] for r in straight]
  for a, b in zip(straight, resumed):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4)


@pytest.mark.parametrize("mesh", [
    dict(fsdp=2, expert=2, context=2),
    pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.slow),
])
def test_training_with_fsdp_expert_and_tensor_parallelism_matches_one_device(tmp_path, monkeypatch, mesh):
  from hyscale_jax.parallel import expert  # noqa: PLC0415
  from hyscale_jax.training import lm  # noqa: PLC0415

  dispatches = []  # count the all-to-all MoE calls traced into the train step
  real = expert.expert_parallel
  monkeypatch.setattr(expert, "expert_parallel", lambda *a, **kw: dispatches.append(1) or real(*a, **kw))

  def config(**mesh):
    config = _lm_config(tmp_path, 5, **mesh)
    config.data.batch_size = 4  # divides over data x fsdp x expert
    return config

  one = lm.train_and_evaluate(config(), str(tmp_path / "one"))
  split = lm.train_and_evaluate(config(**mesh), str(tmp_path / "split"))
  assert len(split) == 5
  assert bool(dispatches) == (mesh.get("expert", 1) > 1)
  for a, b in zip(one, split):
    for key in ("loss", "lm_loss", "indexer_loss"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, err_msg=f"step {a['step']} {key}")


def test_bad_meshes_are_named_before_compute(tmp_path):
  from hyscale_jax.training import lm  # noqa: PLC0415

  with pytest.raises(ValueError, match="batch_size"):
    lm.train_and_evaluate(_lm_config(tmp_path, 1, data=4), str(tmp_path / "a"))
  with pytest.raises(ValueError, match="devices"):
    lm.train_and_evaluate(_lm_config(tmp_path, 1, data=-1, context=3), str(tmp_path / "b"))
  with pytest.raises(ValueError, match="n_heads=2 must divide over mesh.tensor=4"):
    lm.train_and_evaluate(_lm_config(tmp_path, 1, tensor=4), str(tmp_path / "c"))
  with pytest.raises(ValueError, match="n_routed_experts=4 must divide over mesh.expert=8"):
    lm.train_and_evaluate(_lm_config(tmp_path, 1, expert=8), str(tmp_path / "d"))


@pytest.mark.parametrize("form", ["sparse", "dense"])
def test_indexer_loss_and_gradients_match_one_device(form):
  B, T, HI, DI, H, Dk, K = 2, 32, 2, 8, 4, 8, 6
  ks = jax.random.split(jax.random.key(4), 8)
  iq, ik = jax.random.normal(ks[0], (B, T, HI, DI)), jax.random.normal(ks[1], (B, T, DI))
  iw = jax.random.normal(ks[2], (B, T, HI))
  aq, ak = jax.random.normal(ks[3], (B, T, H, Dk)), jax.random.normal(ks[4], (B, T, 1, Dk))
  seg = jnp.asarray((np.arange(T) >= 11).astype(np.int32))[None].repeat(B, 0)  # two documents per row
  pos = jnp.arange(T)[None, :, None]
  # Rows with nothing selected (all -1) are left out of the mean: the shards count different rows.
  idx = jnp.where(jax.random.uniform(ks[5], (B, T, K)) < 0.8,
                  jax.random.randint(ks[6], (B, T, K), 0, T) % (pos + 1), -1).astype(jnp.int32)
  idx = idx.at[:, 20:24].set(-1)
  lse = ops.sparse_attention(aq, ak, ak, idx, scale=0.3)[1] if form == "sparse" else None
  kw = dict(attn_scale=0.3, index_scale=0.5)
  kw.update(dict(segment_ids=(seg, seg)) if form == "dense" else {})

  def loss(iq, ik, iw):
    return ops.indexer_loss(iq, ik, iw, aq, ak, lse, idx if form == "sparse" else None, **kw)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  want, want_g = grad(iq, ik, iw)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(loss)(iq, ik, iw))
    got, got_g = grad(iq, ik, iw)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_one_device_context_axis_takes_the_shard_map_path_when_asked():
  from hyscale_jax.ops import _context  # noqa: PLC0415

  rng = np.random.default_rng(5)
  B, T, H, D, topk = 1, 32, 2, 8, 5
  q, k, w = _ints(rng, (B, T, H, D)), _ints(rng, (B, T, D)), _ints(rng, (B, T, H))
  select = lambda q, k, w: ops.flash_topk(q, k, w, topk=topk)
  want = select(q, k, w)
  with jax.set_mesh(_mesh(1)):
    assert "shard_map" not in str(jax.make_jaxpr(select)(q, k, w))  # a 1-way split is skipped by default
    with _context.shard_map_on_one_device():
      assert "shard_map" in str(jax.make_jaxpr(select)(q, k, w))
      got = jax.jit(select)(q, k, w)
    assert "shard_map" not in str(jax.make_jaxpr(select)(q, k, w))  # restored on exit
  np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
