"""The dense indexer KL's Pallas kernels (`pallas_kernels.indexer_loss`, interpret mode here): the op's
`"pallas"` backend against the float64 oracle, and the kernels' row statistics and gradients against
the jnp streaming they replace, over several query blocks and key tiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops.indexer_loss import reference
from pallas_kernels.indexer_loss import Config, dense_kl_grads_pallas, dense_kl_stats_pallas

try:
  from tests.test_indexer_loss import _DENSE_CASES, _check_against_oracle, _dense_lse, _make_inputs, _seg_pair
except ImportError:  # tests/ itself is on sys.path
  from test_indexer_loss import _DENSE_CASES, _check_against_oracle, _dense_lse, _make_inputs, _seg_pair


@pytest.mark.parametrize("case", list(_DENSE_CASES))
def test_pallas_dense_kernels_match_oracle(case):
  """Every dense case of the op's tests (offsets, S != T, compressed keys, segments with empty rows, GQA,
  no weights), with the attention's LSE given (as the warm-up passes it), on the kernels."""
  B, T, S, HI, DI, H, G, Dk, with_weights, _, vis_kw = _DENSE_CASES[case]
  rng = np.random.default_rng(3)
  inputs, attn_scale = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, with_weights)
  # A wider window's LSE (as DeepSeek-V4's sinks give): the teacher's mass on the support is below H.
  alse = _dense_lse(inputs[3], inputs[4], attn_scale, rng.uniform(0.0, 1.0, size=(B, T, H)), **vis_kw)
  _check_against_oracle(inputs, alse, None, attn_scale, (None,), backend="pallas", **vis_kw)


def _inputs(rng, B, T, S, HI, DI, H, G, Dk, *, dtype=jnp.float32, plateau=False):
  iq, ik, iw, aq, ak = _make_inputs(rng, B, T, S, HI, DI, H, G, Dk, True)[0]
  if plateau:  # index head 0's dots all <= 0 and head 1's mostly: ReLU's zero plateau, scores tied at 0
    ik = jnp.abs(ik)
    iq = iq.at[:, :, 0].set(-jnp.abs(iq[:, :, 0])).at[:, :, 1].add(-0.25)
  return tuple(x.astype(dtype) for x in (iq, ik, iw, aq, ak))


# name -> (B, T, S, HI, DI, H, G, Dk, options): several 16-row blocks and 16-key tiles each.
_KERNEL_CASES = {
    "mha_parts_segments": (2, 45, 45, 3, 12, 4, 4, 24, dict(segments=True)),  # Dk 24 = 16 + 8 and DI 12 = 8 + 4
    "mqa_offset_s_gt_t": (1, 20, 40, 2, 16, 4, 1, 32, dict(q_offset=13)),
    "compressed_keys": (1, 70, 17, 2, 16, 2, 1, 16, dict(compress_ratio=4)),
    "relu_plateau": (1, 40, 40, 2, 16, 4, 2, 16, dict(plateau=True)),
}


def _kernel_case(case, dtype=jnp.float32):
  B, T, S, HI, DI, H, G, Dk, opt = _KERNEL_CASES[case]
  rng = np.random.default_rng(5)
  iq, ik, iw, aq, ak = _inputs(rng, B, T, S, HI, DI, H, G, Dk, dtype=dtype, plateau=opt.get("plateau", False))
  segments = None
  if opt.get("segments"):
    q_seg = np.repeat(np.arange(4), 12)[None, :T].repeat(B, 0).astype(np.int32)
    kv_seg = q_seg.copy()
    kv_seg[0, 12:15] = 7  # a document's first keys elsewhere: its first rows see nothing
    segments = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  positions = dict(q_offset=opt.get("q_offset", 0), segment_ids=segments, compress_ratio=opt.get("compress_ratio", 1))
  scales = (0.5, Dk**-0.5)
  _, alse, _, _ = reference.dense_stats_reference(iq, ik, iw, aq, ak, None, scales=scales, blocks=(8, 8),
                                                  **{**positions, "q_offset": jnp.int32(positions["q_offset"])})
  return (iq, ik, iw, aq, ak, alse), positions, scales


@pytest.mark.parametrize("case", list(_KERNEL_CASES))
def test_kernels_match_the_streaming_they_replace(case):
  args, positions, scales = _kernel_case(case)
  ref_kw = dict(scales=scales, blocks=(8, 8), **{**positions, "q_offset": jnp.int32(positions["q_offset"])})
  kernel_kw = dict(index_scale=scales[0], attn_scale=scales[1], config=Config(block_q=16, block_k=16), **positions)
  want = reference.dense_stats_reference(*args, **ref_kw)
  got = dense_kl_stats_pallas(*args, **kernel_kw)
  for name, g, w in zip(("lse_I", "mass", "cross"), got, (want[0], want[2], want[3])):
    g, w = np.asarray(g), np.asarray(w)
    np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w), err_msg=name)
    np.testing.assert_allclose(np.where(np.isfinite(g), g, 0), np.where(np.isfinite(w), w, 0), rtol=2e-5,
                               atol=2e-5, err_msg=name)
  lse_i = got[0]
  assert not np.isfinite(np.asarray(lse_i)).all() or case != "mha_parts_segments"  # the empty rows
  valid = jnp.isfinite(lse_i) & (got[1] > 0)
  coef = jnp.where(valid, jnp.linspace(0.5, 1.5, lse_i.size).reshape(lse_i.shape), 0.0)
  inv_mass = jnp.where(valid, 1.0 / jnp.where(valid, got[1], 1.0), 0.0)
  want = reference.dense_grads_reference(*args, lse_i, inv_mass, coef, **ref_kw)
  got = dense_kl_grads_pallas(*args, lse_i, inv_mass, coef, **kernel_kw)
  for name, g, w in zip(("dq", "dk", "dw"), got, want):
    assert g.shape == w.shape and g.dtype == jnp.float32, name
    scale = float(jnp.abs(w).max())
    assert scale > 0, name
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5 * scale, err_msg=name)
  again = dense_kl_grads_pallas(*args, lse_i, inv_mass, coef, **kernel_kw)
  for g, a in zip(got, again):  # no atomics: the same sums in the same order
    np.testing.assert_array_equal(np.asarray(g), np.asarray(a))


def test_bf16_inputs_stay_close_to_f32():
  """bf16 inputs (the model's): the kernels' dots on bf16, gradients rounded to bf16 before the pullback."""
  args, positions, scales = _kernel_case("relu_plateau")
  kernel_kw = dict(index_scale=scales[0], attn_scale=scales[1], config=Config(block_q=16, block_k=16), **positions)
  low = tuple(x if x.dtype != jnp.float32 or i == 5 else x.astype(jnp.bfloat16) for i, x in enumerate(args))
  rounded = tuple(x if i == 5 else x.astype(jnp.float32) for i, x in enumerate(low))
  want = dense_kl_stats_pallas(*rounded, **kernel_kw)
  got = dense_kl_stats_pallas(*low, **kernel_kw)
  for g, w in zip(got, want):
    finite = np.isfinite(np.asarray(w))
    np.testing.assert_allclose(np.asarray(g)[finite], np.asarray(w)[finite], rtol=2e-2, atol=2e-2)
  lse_i, mass = want[0], want[1]
  valid = jnp.isfinite(lse_i) & (mass > 0)
  coef, inv_mass = jnp.where(valid, 1.0, 0.0), jnp.where(valid, 1.0 / jnp.where(valid, mass, 1.0), 0.0)
  for g, w in zip(dense_kl_grads_pallas(*low, lse_i, inv_mass, coef, **kernel_kw),
                  dense_kl_grads_pallas(*rounded, lse_i, inv_mass, coef, **kernel_kw)):
    assert float(jnp.abs(g - w).max()) <= 2e-2 * float(jnp.abs(w).max())


def test_bad_config_raises():
  with pytest.raises(ValueError, match="block_q=24 must be a power of two"):
    Config(block_q=24)
