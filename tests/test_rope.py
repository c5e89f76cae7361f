"""RoPE with YaRN scaling: frequencies and scales against a float64 NumPy oracle, rotations, config errors."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.layers.compressor import rope_tail
from hyscale_jax.layers.rope import YaRN, apply_rope, rope_inverse_frequencies, yarn_mscale, yarn_of
from hyscale_jax.model_config import ModelConfig


def _yarn_oracle(rope_dim, theta, factor, original, beta_fast, beta_slow, truncate):
  """float64 YaRN inverse frequencies, transformers' dimension-space ramp (a linear blend over pair indices)."""
  i = np.arange(rope_dim // 2, dtype=np.float64)
  kept = theta ** (-2 * i / rope_dim)
  pair_of = lambda turns: rope_dim * np.log(original / (turns * 2 * np.pi)) / (2 * np.log(theta))
  low, high = pair_of(beta_fast), pair_of(beta_slow)
  if truncate:
    low, high = np.floor(low), np.ceil(high)
  low, high = max(low, 0), min(high, rope_dim - 1)
  if low == high:
    high += 0.001
  interpolated_share = np.clip((i - low) / (high - low), 0, 1)
  return kept / factor * interpolated_share + kept * (1 - interpolated_share)


# (rope_dim, theta, factor, original length, beta_fast, beta_slow, truncate): DeepSeek-V4's compressed
# layers, V3.2 / GLM's MLA, a tiny rope slice, no truncation, and a degenerate one-point ramp.
_CASES = [(64, 160000.0, 16.0, 65536, 32.0, 1.0, True), (64, 10000.0, 40.0, 4096, 32.0, 1.0, True),
          (8, 10000.0, 4.0, 64, 32.0, 1.0, True), (64, 10000.0, 40.0, 4096, 32.0, 1.0, False),
          (16, 10000.0, 8.0, 4096, 2.0, 1.9, True), (32, 500.0, 1.0, 128, 32.0, 1.0, True)]


@pytest.mark.parametrize("case", _CASES)
def test_yarn_frequencies_match_float64_oracle(case):
  rope_dim, theta, factor, original, fast, slow, truncate = case
  yarn = YaRN(factor=factor, original_max_len=original, beta_fast=fast, beta_slow=slow, truncate=truncate)
  ours = np.asarray(rope_inverse_frequencies(rope_dim, theta, yarn))
  want = _yarn_oracle(rope_dim, theta, factor, original, fast, slow, truncate)
  assert ours.dtype == np.float32 and ours.shape == (rope_dim // 2,)
  np.testing.assert_allclose(ours, want, rtol=2e-6)
  # High-frequency pairs are kept, the lowest are divided by `factor` (when the ramp ends inside).
  plain = np.asarray(rope_inverse_frequencies(rope_dim, theta))
  low, high = yarn.correction_range(rope_dim, theta)
  np.testing.assert_allclose(ours[: int(low)], plain[: int(low)], rtol=1e-6)
  np.testing.assert_allclose(ours[int(math.ceil(high)) + 1:], plain[int(math.ceil(high)) + 1:] / factor, rtol=1e-6)


def test_v4_published_ramp_spans_the_middle_pairs():
  yarn = YaRN(factor=16.0, original_max_len=65536)
  assert yarn.correction_range(64, 160000.0) == (15, 25)  # pairs 15..25 of 32 blend


def test_attention_scale_conventions():
  # DeepSeek-V3 / V3.2 (mscale = mscale_all_dim = 1): cos/sin unscaled, softmax scale x mscale(40)^2,
  # tau = 192^-0.5 * 1.3689^2 ~ 0.13523 (architectures.md section 1.4).
  v3 = YaRN(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0)
  assert v3.rope_scale == 1.0
  np.testing.assert_allclose(192**-0.5 * v3.softmax_scale, 0.13523, atol=5e-6)
  np.testing.assert_allclose(yarn_mscale(40.0), 0.1 * np.log(40.0) + 1, rtol=1e-15)
  # Neither given: cos/sin carry 0.1 ln(f) + 1 and the softmax scale is untouched.
  bare = YaRN(factor=16.0, original_max_len=65536)
  np.testing.assert_allclose(bare.rope_scale, 0.1 * np.log(16.0) + 1, rtol=1e-15)
  assert bare.softmax_scale == 1.0
  # Only mscale: transformers ignores it (it needs both) and derives from the factor alone.
  assert YaRN(factor=16.0, original_max_len=64, mscale=0.5).rope_scale == bare.rope_scale
  mixed = YaRN(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=0.707)
  np.testing.assert_allclose(mixed.rope_scale, (0.1 * np.log(40) + 1) / (0.0707 * np.log(40) + 1), rtol=1e-12)
  np.testing.assert_allclose(mixed.softmax_scale, (0.0707 * np.log(40) + 1) ** 2, rtol=1e-12)
  # DeepSeek-V4's compressed layers: an explicit attention_factor wins.
  assert YaRN(factor=16.0, original_max_len=65536, attention_factor=1.0).rope_scale == 1.0
  assert yarn_mscale(0.5) == 1.0 == yarn_mscale(1.0)


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_with_yarn_matches_float64_rotation(interleaved):
  rng = np.random.default_rng(0)
  B, T, N, R = 2, 7, 3, 16
  x = rng.standard_normal((B, T, N, R)).astype(np.float32)
  positions = np.stack([np.arange(T), np.array([0, 1, 2, 0, 1, 2, 3])]).astype(np.int32)  # packed docs
  yarn = YaRN(factor=8.0, original_max_len=64, mscale=1.0, mscale_all_dim=0.5)
  ours = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), theta=500.0, interleaved=interleaved, yarn=yarn))
  freqs = _yarn_oracle(R, 500.0, 8.0, 64, 32.0, 1.0, True)
  angle = positions[..., None, None].astype(np.float64) * freqs  # [B, T, 1, R/2]
  cos, sin = np.cos(angle) * yarn.rope_scale, np.sin(angle) * yarn.rope_scale
  x64 = x.astype(np.float64)
  a, b = (x64[..., 0::2], x64[..., 1::2]) if interleaved else (x64[..., : R // 2], x64[..., R // 2:])
  ra, rb = a * cos - b * sin, a * sin + b * cos
  want = np.stack([ra, rb], -1).reshape(x.shape) if interleaved else np.concatenate([ra, rb], -1)
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
  assert yarn.rope_scale != 1.0


def test_v4_derotation_undoes_the_rotation_up_to_the_rope_scale_squared():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((1, 5, 2, 12)).astype(np.float32))
  positions = jnp.arange(5, dtype=jnp.int32)[None] * 1000
  yarn = YaRN(factor=16.0, original_max_len=256)
  back = rope_tail(rope_tail(x, positions, rope_dim=8, theta=160000.0, yarn=yarn), -positions, rope_dim=8,
                   theta=160000.0, yarn=yarn)
  np.testing.assert_allclose(back[..., :4], x[..., :4], rtol=0, atol=0)  # the nope dims are untouched
  np.testing.assert_allclose(back[..., 4:], x[..., 4:] * yarn.rope_scale**2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,name", [
    (dict(factor=0.5, original_max_len=64), "factor"),
    (dict(factor=4.0, original_max_len=0), "original_max_len"),
    (dict(factor=4.0, original_max_len=64, beta_fast=0.0), "beta_fast"),
])
def test_bad_yarn_raises(kw, name):
  with pytest.raises(ValueError, match=name):
    YaRN(**kw)


def test_config_yarn_fields():
  assert yarn_of(ModelConfig()) is None
  cfg = ModelConfig(rope_yarn_factor=40.0, rope_yarn_original_max_len=4096, rope_yarn_mscale=1.0,
                    rope_yarn_mscale_all_dim=1.0)
  assert yarn_of(cfg) == YaRN(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0)
  with pytest.raises(ValueError, match="rope_yarn_original_max_len=0"):
    ModelConfig(rope_yarn_factor=40.0)
  with pytest.raises(ValueError, match="n_hash_layers=1: only deepseek_v4"):
    ModelConfig(n_hash_layers=1)
