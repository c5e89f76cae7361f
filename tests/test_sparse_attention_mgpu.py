"""The Mosaic GPU sparse-attention forward: it lowers for an H200 on CPU; on the GPU it matches the reference.

GPU tests: `JAX_PLATFORMS=cuda pytest -m gpu_only tests/test_sparse_attention_mgpu.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops.sparse_attention.reference import sparse_attention_forward_reference
from pallas_kernels.sparse_attention import sparse_attention as triton_forward
from pallas_kernels.sparse_attention.mgpu_forward import Config, live_steps, sparse_attention_forward_mgpu
from tests.jaxpr_tools import export_for_h200

_ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU")


def _forward(config=None, value_dim=512, scale=576**-0.5):
  return functools.partial(sparse_attention_forward_mgpu, scale=scale, value_dim=value_dim, config=config)


_OLD = Config(gather_signal="wait_group", zero_fill=False, trim_steps=False)  # the first version's hand-over


@pytest.mark.parametrize("B, T, H, K, config, sinks, Dk", [
    (1, 5, 64, 200, None, False, 576),
    (2, 3, 128, 96, Config(consumer_registers=240, producer_registers=24), False, 576),
    (1, 5, 64, 200, _OLD, False, 576),
    (1, 5, 64, 200, Config(gather_signal="wait_group", gathers_in_flight=2), False, 576),
    (1, 5, 64, 130, Config(zero_fill=False, trim_steps=False), True, 512),  # DeepSeek-V4: K = V, sinks
])
def test_lowers_for_h200(B, T, H, K, config, sinks, Dk, fake_hopper):
  """One Mosaic GPU kernel at MLA dims (Dk 576, Dv 512), selections padded to the step, heads in blocks of 64."""
  args = [jax.ShapeDtypeStruct((B, T, H, Dk), jnp.bfloat16), jax.ShapeDtypeStruct((B, 77, 1, Dk), jnp.bfloat16),
          jax.ShapeDtypeStruct((B, T, K), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.float32)]
  fwd = _forward(config)
  f = (lambda q, k, i, s: fwd(q, k, None, i, sinks=s)) if sinks else (lambda q, k, i: fwd(q, k, None, i))
  exported = export_for_h200(f, *args[:4 if sinks else 3])
  assert exported.mlir_module().count("custom_call @mosaic_gpu") == 1
  assert [a.shape for a in exported.out_avals] == [(B, T, H, 512), (B, T, H)]
  assert exported.out_avals[1].dtype == jnp.float32


@pytest.mark.parametrize("change", ["values", "heads", "groups", "f32", "wide_keys"])
def test_declines_what_v1_lacks(change):
  """NotImplementedError (the caller's cue to fall back), before anything is traced for the GPU. Keys
  wider than 576 leave shared memory one gathered stage, which Mosaic would refuse at compile time."""
  H, G, dtype = (48 if change == "heads" else 64), (2 if change == "groups" else 1), jnp.bfloat16
  dtype = jnp.float32 if change == "f32" else dtype
  Dk = 640 if change == "wide_keys" else 576
  q = jnp.zeros((1, 2, H, Dk), dtype)
  k = jnp.zeros((1, 8, G, Dk), dtype)
  v = jnp.zeros((1, 8, G, 512), dtype) if change == "values" else None
  with pytest.raises(NotImplementedError):
    sparse_attention_forward_mgpu(q, k, v, jnp.zeros((1, 2, 64), jnp.int32), scale=0.1, value_dim=512)


def test_config_heuristics_fit_shared_memory():
  assert Config.heuristics(576, 2) == Config(block_k=64, num_stages=2)
  assert Config.heuristics(512, 2).num_stages == 2 and Config.heuristics(256, 2).num_stages == 4
  for bad in (dict(block_k=32), dict(gather_signal="tma"), dict(gathers_in_flight=3), dict(num_stages=1)):
    with pytest.raises(ValueError):
      Config(**bad)


def _live_steps_oracle(indices, num_keys, block_k):
  B, T, K = indices.shape
  out = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(T):
      for j in range(K // block_k):
        ids = indices[b, t, j * block_k:(j + 1) * block_k]
        if np.any((ids >= 0) & (ids < num_keys)):
          out[b, t] = j + 1
  return out


def test_live_steps_matches_a_loop():
  """1 + the last step holding a valid index: gaps of invalid steps inside a row still run, the tail does not."""
  rng = np.random.default_rng(3)
  S, block_k = 50, 8
  idx = rng.integers(-1, S + 3, (2, 6, 5 * block_k)).astype(np.int32)
  idx[0, 0] = -1  # empty
  idx[0, 1] = S  # out of range only: empty
  idx[0, 2] = -1
  idx[0, 2, 3] = 7  # first step only
  idx[0, 3] = -1
  idx[0, 3, -1] = 0  # last slot only, all-invalid steps before it
  idx[1, 0, block_k:] = -1  # a row shorter than k
  got = np.asarray(live_steps(jnp.asarray(idx), S, block_k))
  np.testing.assert_array_equal(got, _live_steps_oracle(idx, S, block_k))
  assert got[0, :4].tolist() == [0, 0, 1, 5] and got[1, 0] == 1


# ---- GPU only: against the reference ----

def _causal_inputs(B, T, S, H, K, Dk=576, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, Dk)).astype(np.float32)
  k = rng.standard_normal((B, S, 1, Dk)).astype(np.float32)
  t = np.arange(T)[:, None] + (S - T)
  idx = rng.integers(0, S, (B, T, K)) % (t + 1)
  idx = np.where(np.arange(K)[None] > t, -1, idx).astype(np.int32)  # rows shorter than K
  idx[0, 1] = -1  # an empty row
  idx[0, 2] = -1
  idx[0, 2, -1] = 0  # one valid index, in the last slot: all-invalid steps before it still run
  idx[-1, -1, 3] = S + 2  # out of range: skipped
  idx[-1, -1, 4:9] = idx[-1, -1, 9]  # duplicates count once per occurrence
  return jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(idx)


_VARIANTS = {"default": None, "old": _OLD, "mbarrier": Config(zero_fill=False, trim_steps=False),
             "wait_group trimmed": Config(gather_signal="wait_group"), "3 stages": Config(num_stages=3)}


@pytest.mark.gpu_only
@_ON_GPU
@pytest.mark.parametrize("B, T, S, H, K, variant, Dk, sinks", [
    (1, 130, 130, 64, 2048, "default", 576, False),
    (2, 70, 300, 128, 200, "default", 576, False),
    (2, 70, 300, 128, 200, "old", 576, False),
    (2, 70, 300, 128, 200, "mbarrier", 576, False),
    (2, 70, 300, 128, 200, "wait_group trimmed", 576, False),
    (1, 130, 130, 64, 700, "default", 576, True),
    (2, 70, 300, 64, 200, "default", 512, True),  # DeepSeek-V4: K = V (Dk = Dv = 512), sinks
    (1, 40, 90, 64, 300, "3 stages", 256, False),
    (1, 40, 90, 64, 300, "default", 256, False),  # the heuristics' 4 stages at Dk 256
])
def test_matches_reference(B, T, S, H, K, variant, Dk, sinks):
  q, k, idx = _causal_inputs(B, T, S, H, K, Dk)
  Dv = min(Dk, 512)
  sink = jnp.asarray(np.random.default_rng(5).standard_normal(H) * 2, jnp.float32) if sinks else None
  out, lse = jax.jit(functools.partial(_forward(_VARIANTS[variant], value_dim=Dv, scale=Dk**-0.5), sinks=sink))(
      q, k, None, idx)
  out_r, lse_r = sparse_attention_forward_reference(q, k, k[..., :Dv], idx, scale=Dk**-0.5, sinks=sink)
  finite = np.isfinite(np.asarray(lse_r))
  assert finite.all() if sinks else not finite[0, 1].any()  # the empty row: lse = sink, or -inf
  assert not np.isnan(np.asarray(out, np.float32)).any()
  np.testing.assert_array_equal(np.asarray(lse)[~finite], -np.inf)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[~finite], 0.0)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[0, 1], 0.0)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_r)[finite], atol=2e-2)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_r, np.float32), atol=3e-2)


def _lowered_kernels(config, sinks, monkeypatch, heads=64, value_dim=512):
  """The custom calls of the `pallas` forward compiled for a (faked) H200 at MLA dims (with `fake_hopper`)."""
  monkeypatch.setattr(triton_forward, "require_hopper", lambda what: None)
  args = [jax.ShapeDtypeStruct((1, 3, heads, 576), jnp.bfloat16), jax.ShapeDtypeStruct((1, 40, 1, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 3, 64), jnp.int32)]
  fwd = functools.partial(triton_forward.sparse_attention_forward_pallas, scale=0.04, value_dim=value_dim, config=config,
                          sinks=sinks, interpret=False)
  text = export_for_h200(lambda q, k, i: fwd(q, k, None, i), *args).mlir_module()
  return {name for name in ("mosaic_gpu", "__gpu$xla.gpu.triton") if f"custom_call @{name}" in text}


@pytest.mark.parametrize("forward, sinks, heads, expected", [
    ("auto", False, 64, {"mosaic_gpu"}),
    ("mosaic", False, 64, {"mosaic_gpu"}),
    ("triton", False, 64, {"__gpu$xla.gpu.triton"}),
    ("auto", True, 64, {"mosaic_gpu"}),  # sinks
    ("auto", False, 32, {"__gpu$xla.gpu.triton"}),  # 32 heads: the Mosaic kernel declines, the Triton kernel runs
])
def test_pallas_forward_picks_the_mosaic_kernel_where_it_applies(forward, sinks, heads, expected, monkeypatch,
                                                                 fake_hopper):
  config = triton_forward.Config(forward=forward)
  sinks = jnp.zeros((heads,), jnp.float32) if sinks else None
  assert _lowered_kernels(config, sinks, monkeypatch, heads) == expected


def test_pallas_forward_mosaic_request_raises_where_it_does_not_apply(monkeypatch, fake_hopper):
  with pytest.raises(NotImplementedError, match="H % 64"):
    _lowered_kernels(triton_forward.Config(forward="mosaic"), None, monkeypatch, heads=32)
  with pytest.raises(ValueError, match="Config.forward"):
    triton_forward.Config(forward="cuda")
  q, k, idx = jnp.zeros((1, 2, 64, 576), jnp.bfloat16), jnp.zeros((1, 8, 1, 576), jnp.bfloat16), jnp.zeros((1, 2, 64), jnp.int32)
  with pytest.raises(NotImplementedError, match="interpret"):
    triton_forward.sparse_attention_forward_pallas(q, k, None, idx, scale=0.1, value_dim=512, interpret=True,
                                                   config=triton_forward.Config(forward="mosaic"))


def test_pallas_forward_keeps_the_mosaic_kernel_to_what_the_triton_backward_takes(monkeypatch, fake_hopper):
  """Dv 384 (a multiple of 128, not a power of two) would run forward on Mosaic GPU but has no
  backward: the pallas forward declines it as the Triton kernel always did, so "auto" falls back."""
  for forward in ("auto", "mosaic"):
    with pytest.raises(NotImplementedError, match="power"):
      _lowered_kernels(triton_forward.Config(forward=forward), None, monkeypatch, value_dim=384)
