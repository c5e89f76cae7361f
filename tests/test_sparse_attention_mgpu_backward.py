"""The Mosaic GPU sparse-attention backward: it lowers for an H200 on CPU; on the GPU it matches the reference.

GPU tests: `JAX_PLATFORMS=cuda pytest -m gpu_only tests/test_sparse_attention_mgpu_backward.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops.sparse_attention.reference import (
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from pallas_kernels.sparse_attention import sparse_attention as pallas_sa
from pallas_kernels.sparse_attention.mgpu_backward import (Config, check_applies, rows_ascending, sorted_by_key,
                                                           sparse_attention_backward_mgpu)
from pallas_kernels.sparse_attention.mgpu_forward import rotated_block
from tests.jaxpr_tools import export_for_h200

_ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU")


def _avals(B, T, H, K, S, Dk, Dv):
  shapes = [((B, T, H, Dk), jnp.bfloat16), ((B, S, 1, Dk), jnp.bfloat16), ((B, T, K), jnp.int32),
            ((B, T, H, Dv), jnp.bfloat16), ((B, T, H), jnp.float32), ((B, T, H, Dv), jnp.bfloat16),
            ((B, T, H), jnp.float32)]
  return [jax.ShapeDtypeStruct(s, d) for s, d in shapes]


@pytest.mark.parametrize("B, T, H, K, Dk, Dv, config", [
    (1, 5, 64, 200, 576, 512, None),  # absorbed MLA, the selection padded to the step
    (2, 3, 128, 64, 576, 512, Config(dkv_cols=64)),  # two head blocks a token
    (1, 3, 64, 130, 512, 512, None),  # DeepSeek-V4: K = V
    (1, 3, 64, 64, 576, 512, Config(consumer_registers=232, producer_registers=40, skip_scatter=True)),
    (1, 3, 64, 64, 576, 512, Config(dk_evict_last=False)),  # the adds without the L2 hint
    (2, 5, 128, 100, 576, 512, Config(schedule="one_launch")),  # one launch for all tokens
    (2, 5, 128, 100, 576, 512, Config(schedule="sweep", sweep_start=3000)),  # one launch, walks started at the sweep
    (1, 5, 64, 100, 576, 512, Config(schedule="waves")),
])
def test_lowers_for_h200(B, T, H, K, Dk, Dv, config, fake_hopper):
  f = functools.partial(sparse_attention_backward_mgpu, scale=Dk**-0.5, config=config)
  exported = export_for_h200(f, *_avals(B, T, H, K, 77, Dk, Dv))
  assert exported.mlir_module().count("custom_call @mosaic_gpu") == 1
  assert [(a.shape, a.dtype) for a in exported.out_avals] == [((B, T, H, Dk), jnp.bfloat16), ((B, 77, 1, Dk), jnp.float32)]


def test_config():
  with pytest.raises(ValueError, match="dkv_cols"):
    Config(dkv_cols=256)
  from pallas_kernels.sparse_attention.mgpu_backward import _column_groups, _dkv_chunks  # noqa: PLC0415
  assert _column_groups(576, 512) == ([(0, 256), (512, 64)], [(256, 256)])
  assert _dkv_chunks(576, 512, 128) == ([(0, 128), (128, 128), (512, 64)], [(256, 128), (384, 128)])
  assert _dkv_chunks(512, 512, 64) == ([(0, 64), (64, 64), (128, 64), (192, 64)],
                                       [(256, 64), (320, 64), (384, 64), (448, 64)])


def test_rotated_block_visits_every_block_once():
  """The sweep's walk: from any start, each of a row's blocks once (the producer's MLIR is the same formula)."""
  for n in range(1, 40):
    for first in range(n):
      blocks = np.asarray(rotated_block(jnp.arange(n), jnp.int32(first), jnp.int32(n)))
      assert blocks[0] == first and sorted(blocks.tolist()) == list(range(n)), (n, first)


def test_sorted_by_key():
  """The sweep's and the waves' row order: the valid keys ascending (repeats kept), then -1 for the rest."""
  rng = np.random.default_rng(3)
  idx = rng.integers(-3, 40, (2, 5, 37)).astype(np.int32)  # -1s, out-of-range keys past 32, repeats
  idx[0, 0] = -1  # an empty row
  idx[1, 2] = 7  # one key in every slot
  def reference(rows):
    flat = [np.r_[np.sort(row[(row >= 0) & (row < 32)]), np.full(37, -1)][:37] for row in rows.reshape(-1, 37)]
    return np.stack(flat).reshape(rows.shape)

  expected = reference(idx)
  np.testing.assert_array_equal(np.asarray(sorted_by_key(jnp.asarray(idx), 32)), expected)
  # Rows that arrive in order (as FlashTopK's do) skip the sort; out-of-range keys and -1s past the
  # valid ones, and one unsorted row among sorted ones, still come out the same.
  past = np.where(expected < 0, np.iinfo(np.int32).max, expected)
  assert bool(rows_ascending(jnp.asarray(past))) and not bool(rows_ascending(jnp.asarray(idx)))
  in_order = expected.copy()
  in_order[0, 1, -1] = 40  # out of range, after the valid keys and the -1s: dropped to -1
  np.testing.assert_array_equal(np.asarray(sorted_by_key(jnp.asarray(in_order), 32)), reference(in_order))
  one_off = expected.copy()
  one_off[1, 4, :2] = [20, 3]  # one row out of order among sorted ones
  np.testing.assert_array_equal(np.asarray(sorted_by_key(jnp.asarray(one_off), 32)), reference(one_off))


@pytest.mark.parametrize("change", ["values", "heads", "groups", "f32", "wide_keys", "deterministic"])
def test_declines(change):
  H, G = (48 if change == "heads" else 64), (2 if change == "groups" else 1)
  dtype = jnp.float32 if change == "f32" else jnp.bfloat16
  Dk = 640 if change == "wide_keys" else 576
  q, k = jnp.zeros((1, 2, H, Dk), dtype), jnp.zeros((1, 8, G, Dk), dtype)
  v = jnp.zeros((1, 8, G, 512), dtype) if change == "values" else None
  with pytest.raises(NotImplementedError):
    check_applies(q, k, v, 512, deterministic=change == "deterministic")


def _lowered_backward(config, heads=64, deterministic=False):
  """The custom calls of the `pallas` backward compiled for a (faked) H200 at MLA dims (with `fake_hopper`)."""
  B, T, K, S = 1, 3, 64, 40
  avals = _avals(B, T, heads, K, S, 576, 512)

  def bwd(q, k, idx, out, lse, dout, dlse):
    return pallas_sa.sparse_attention_backward_pallas((q, k, None, idx, None, out, lse), (dout, dlse), scale=0.04,
                                                      config=config, interpret=False,
                                                      deterministic=deterministic)[:2]

  text = export_for_h200(bwd, *avals).mlir_module()
  return {name for name in ("mosaic_gpu", "__gpu$xla.gpu.triton") if f"custom_call @{name}" in text}


@pytest.mark.parametrize("backward, heads, deterministic, expected", [
    ("auto", 64, False, {"mosaic_gpu"}),
    ("mosaic", 64, False, {"mosaic_gpu"}),
    ("triton", 64, False, {"__gpu$xla.gpu.triton"}),
    ("auto", 32, False, {"__gpu$xla.gpu.triton"}),  # 32 heads: the Mosaic kernel declines
    ("auto", 64, True, {"__gpu$xla.gpu.triton"}),  # deterministic: Triton's slabs
])
def test_pallas_backward_dispatch(backward, heads, deterministic, expected, fake_hopper):
  config = pallas_sa.Config(backward=backward)
  assert _lowered_backward(config, heads, deterministic) == expected


def test_pallas_backward_mosaic_request_raises_where_it_does_not_apply(fake_hopper):
  with pytest.raises(NotImplementedError, match="H % 64"):
    _lowered_backward(pallas_sa.Config(backward="mosaic"), heads=32)
  with pytest.raises(ValueError, match="Config.backward"):
    pallas_sa.Config(backward="cuda")


# ---- GPU only: against the reference ----

def _inputs(B, T, S, H, K, Dk, seed=0):
  """Random causal selections with the adversarial rows: shorter than K (-1 tails), one empty row, one
  index only in the last slot, an out-of-range index, and a row with repeated indices."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, Dk)).astype(np.float32)
  k = rng.standard_normal((B, S, 1, Dk)).astype(np.float32)
  t = np.arange(T)[:, None] + (S - T)
  idx = rng.integers(0, S, (B, T, K)) % (t + 1)
  idx = np.where(np.arange(K)[None] > t, -1, idx).astype(np.int32)
  idx[0, 1] = -1  # an empty row
  idx[0, 2] = -1
  idx[0, 2, -1] = 0  # one valid index, in the last slot
  idx[-1, -1, 3] = S + 2  # out of range: skipped
  idx[-1, -1, 4:70] = idx[-1, -1, 70]  # repeated within a row and across steps: added once per occurrence
  idx[-1, -2, :] = 5  # every slot the same key
  dout = rng.standard_normal((B, T, H, min(Dk, 512))).astype(np.float32)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  return bf(q), bf(k), jnp.asarray(idx), bf(dout)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.gpu_only
@_ON_GPU
@pytest.mark.parametrize("B, T, S, H, K, Dk, sinks, variant", [
    (1, 130, 130, 64, 2048, 576, False, "default"),
    (2, 70, 300, 128, 200, 576, False, "default"),
    (1, 130, 130, 64, 700, 576, True, "default"),
    (2, 70, 300, 64, 200, 512, True, "default"),  # DeepSeek-V4: K = V, sinks
    (2, 70, 300, 128, 200, 576, True, "cols64"),
    (2, 70, 300, 128, 200, 576, True, "one_launch"),
    (2, 70, 300, 128, 200, 576, True, "sweep"),
    (1, 130, 130, 64, 2048, 576, False, "sweep"),
    (2, 70, 300, 64, 200, 576, False, "waves"),
    # 32 steps a row, the counter started so that rows begin mid-row, at the last block, and at 0
    (1, 40, 4096, 64, 2048, 576, False, "sweep@2048"),
    (1, 40, 4096, 64, 2048, 576, True, "sweep@4095"),
    (1, 40, 4096, 64, 2048, 576, False, "sweep@-1"),
    (1, 40, 4096, 64, 2048, 576, False, f"sweep@{-2**31}"),
])
def test_matches_reference(B, T, S, H, K, Dk, sinks, variant):
  q, k, idx, dout = _inputs(B, T, S, H, K, Dk)
  Dv, scale = min(Dk, 512), Dk**-0.5
  sink = jnp.asarray(np.random.default_rng(5).standard_normal(H) * 2, jnp.float32) if sinks else None
  out, lse = sparse_attention_forward_reference(q, k, k[..., :Dv], idx, scale=scale, sinks=sink)
  dlse = jnp.asarray(np.random.default_rng(6).standard_normal(lse.shape) * 0.1, jnp.float32)
  dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
  res = (q, k, None, idx, sink, out, lse)
  for shape, dtype in ((q.shape, q.dtype), ((B, S, Dk), jnp.float32)):  # poison: freed NaN buffers of dq's and dk's sizes
    jnp.full(shape, jnp.nan, dtype).block_until_ready().delete()
  if variant == "default":  # through the pallas backend's dispatch
    dq, dk, dv, dsinks = jax.jit(functools.partial(pallas_sa.sparse_attention_backward_pallas, scale=scale,
                                                   config=pallas_sa.Config(backward="mosaic")))(res, (dout, dlse))
    assert dv is None
  else:
    if variant.startswith("sweep@"):
      config = Config(schedule="sweep", sweep_start=int(variant.split("@")[1]))
    elif variant == "cols64":
      config = Config(dkv_cols=64)
    else:
      config = Config(schedule=variant)
    dq, dk = jax.jit(functools.partial(sparse_attention_backward_mgpu, scale=scale, config=config))(
        q, k, idx, out, lse, dout, dlse)
    dsinks, sinks = None, False
  dq_r, dk_r, dv_r, dsinks_r = sparse_attention_backward_reference(
      (q, k, k[..., :Dv], idx, sink, out, lse), (dout, dlse), scale=scale)
  dk_r = dk_r.astype(jnp.float32).at[..., :Dv].add(dv_r.astype(jnp.float32))
  dq, dk = np.asarray(dq, np.float32), np.asarray(dk, np.float32)
  assert not np.isnan(dq).any() and not np.isnan(dk).any()
  np.testing.assert_array_equal(dq[0, 1], 0.0)  # the empty row
  assert _rel(dq, dq_r) < 1e-2, _rel(dq, dq_r)
  assert _rel(dk, dk_r) < 1e-2, _rel(dk, dk_r)
  never = np.setdiff1d(np.arange(S), np.asarray(idx).ravel())
  np.testing.assert_array_equal(dk[:, never], 0.0)  # keys nobody selected get nothing
  if sinks:
    np.testing.assert_allclose(np.asarray(dsinks), np.asarray(dsinks_r), rtol=1e-3, atol=1e-3)
