"""`models.kv_cache`: cached decoding gives `models.generate`'s tokens; `choose_tokens`' sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyscale_jax import models
from hyscale_jax.models import kv_cache
from hyscale_jax.models.generate import Sampling, choose_tokens
from tests.test_deepseek_v4 import _SMALL as DEEPSEEK_V4_SMALL
from tests.test_glm5 import _SMALL as GLM_SMALL
from tests.test_qwen_next import _SMALL as QWEN_SMALL

P, N = 5, 12  # 17 positions > index_topk 6: the later tokens come from sparse selections


def _glm(**overrides):
  return models.build(dataclasses.replace(GLM_SMALL, **overrides), rngs=nnx.Rngs(0))


def _prompt(seed=1):
  return jax.random.randint(jax.random.key(seed), (2, P), 0, GLM_SMALL.vocab_size)


# index_topk_freq=2: IndexShare, every other layer reuses the previous layer's selection.
@pytest.mark.parametrize("overrides", [{}, {"index_topk_freq": 2}], ids=["own_indexers", "index_share"])
def test_greedy_tokens_are_the_uncached_ones(overrides):
  model = _glm(**overrides)
  cached = kv_cache.generate(model, _prompt(), N)
  assert cached.shape == (2, P + N) and cached.dtype == jnp.int32
  np.testing.assert_array_equal(cached, models.generate(model, _prompt(), N))


def test_sampled_tokens_are_the_uncached_ones():
  model, sampling = _glm(), Sampling(temperature=1.5, top_k=20, top_p=0.9)
  cached = kv_cache.generate(model, _prompt(), N, sampling=sampling, seed=3)
  # The same key per position, and logits equal up to rounding: the same draws.
  np.testing.assert_array_equal(cached, models.generate(model, _prompt(), N, sampling=sampling, seed=3))
  assert not np.array_equal(cached, kv_cache.generate(model, _prompt(), N))


def test_prefill_in_pieces_equals_one_prefill():
  model, prompt = _glm(), _prompt()[:, :4]
  extend = nnx.jit(kv_cache.extend)  # two programs: 4 rows, and 2 rows at any start
  whole, _ = extend(model, kv_cache.init_cache(model, 2, 8), prompt, 0)
  _, cache = extend(model, kv_cache.init_cache(model, 2, 8), prompt[:, :2], 0)
  pieces, _ = extend(model, cache, prompt[:, 2:], 2)
  np.testing.assert_allclose(pieces, whole, rtol=1e-5, atol=1e-5)


def test_stop_token_ends_each_row():
  model = _glm()
  full = np.asarray(kv_cache.generate(model, _prompt(), N))
  stop = int(full[0, P + 2])  # row 0 stops at its third new token (or earlier)
  out = np.asarray(kv_cache.generate(model, _prompt(), N, stop_token=stop))
  assert out.shape == full.shape
  for row, expected in zip(out, full):
    hits = np.flatnonzero(expected[P:] == stop)
    first = P + (hits[0] if hits.size else N)
    np.testing.assert_array_equal(row[:first + 1], expected[:first + 1])
    assert np.all(row[first:] == stop)


@pytest.mark.parametrize("cfg", [DEEPSEEK_V4_SMALL, QWEN_SMALL], ids=["deepseek_v4", "qwen4_exp"])
def test_other_architectures_say_why_they_have_no_cache(cfg):
  model = models.build(cfg, rngs=nnx.Rngs(0))
  reason = kv_cache.unsupported_reason(model)
  assert reason and cfg.architecture in reason
  with pytest.raises(ValueError, match="no KV cache for this model"):
    kv_cache.generate(model, _prompt(), 2)
  assert kv_cache.unsupported_reason(_glm()) is None


def test_cache_length_is_rounded_up():
  assert [kv_cache.cache_length(n) for n in (1, 128, 129, 300)] == [128, 128, 256, 384]


def test_choose_tokens_keeps_to_top_k_and_top_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 512))
  draw = lambda sampling: np.asarray(choose_tokens(logits, jax.random.key(0), sampling))
  assert set(draw(Sampling(1.0, 2, 1.0))) == {0, 1}
  assert set(draw(Sampling(1.0, 0, 0.7))) == {0, 1}  # 0.5 < 0.7 <= 0.8
  assert set(draw(Sampling(1.0, 0, 0.1))) == {0}  # the likeliest always stays
  assert set(draw(Sampling(1.0, 0, 1.0))) == {0, 1, 2, 3}
  np.testing.assert_array_equal(draw(None), 0)


@pytest.mark.parametrize("sampling, match", [
    (Sampling(-1.0), "temperature=-1.0"), (Sampling(1.0, -2), "top_k=-2"), (Sampling(1.0, 1.5), "top_k=1.5"),
    (Sampling(1.0, 0, 0.0), "top_p=0.0"), (Sampling(1.0, 0, 1.2), "top_p=1.2"),
])
def test_bad_sampling_values_are_named(sampling, match):
  with pytest.raises(ValueError, match=match):
    kv_cache.generate(_glm(), _prompt(), 2, sampling=sampling)
