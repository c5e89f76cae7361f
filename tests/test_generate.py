"""`models.generate`: greedy decoding over a fixed buffer equals decoding from each exact-length prefix."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from hyscale_jax import models
from tests.test_deepseek_v4 import _SMALL as DEEPSEEK_V4_SMALL
from tests.test_glm5 import _SMALL as GLM_SMALL


def _argmax_logits(model, tokens):
  """i32[B, T]: the argmax of the model's logits at every position, one jitted forward."""
  return nnx.jit(lambda model, tokens: jnp.argmax(model(tokens).logits, axis=-1))(model, tokens)


# Both prompts end up longer than index_topk, so the later tokens come from sparse selections
# (DeepSeek-V4's also from compressed blocks completed during decoding).
@pytest.mark.parametrize("cfg", [GLM_SMALL, DEEPSEEK_V4_SMALL], ids=["glm5_1", "deepseek_v4"])
def test_greedy_tokens_are_the_argmax_of_their_prefix(cfg):
  model = models.build(cfg, rngs=nnx.Rngs(0))
  P, N = 5, 7
  prompt = jax.random.randint(jax.random.key(1), (2, P), 0, cfg.vocab_size)
  out = models.generate(model, prompt, N)
  assert out.shape == (2, P + N) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :P], prompt)
  # Teacher forcing on the finished sequence: each token is the argmax after the tokens before it,
  # which holds for decoding from the prefix only if nothing reads later (zero-filled) positions.
  np.testing.assert_array_equal(out[:, P:], _argmax_logits(model, out)[:, P - 1:-1])
  # And the first new token from the exact-length prompt alone.
  np.testing.assert_array_equal(out[:, P], _argmax_logits(model, prompt)[:, -1])


def test_backends_and_no_new_tokens():
  model = models.build(GLM_SMALL, rngs=nnx.Rngs(0))
  prompt = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
  np.testing.assert_array_equal(models.generate(model, prompt, 0), prompt)
  backends = ml_collections.ConfigDict(dict(flash_topk="xla_baseline", sparse_attention="reference"))
  np.testing.assert_array_equal(models.generate(model, prompt, 3, backends=backends),
                                models.generate(model, prompt, 3))


@pytest.mark.parametrize("prompt, n, match", [
    (jnp.zeros((4,), jnp.int32), 2, r"prompt must be a non-empty int array \[B, P\], got shape \(4,\)"),
    (jnp.zeros((1, 0), jnp.int32), 2, r"got shape \(1, 0\)"),
    (jnp.zeros((1, 3), jnp.float32), 2, "prompt.dtype=float32"),
    (jnp.zeros((1, 3), jnp.int32), -1, "max_new_tokens=-1"),
    (jnp.zeros((1, 3), jnp.int32), 2.0, "max_new_tokens=2.0"),
])
def test_bad_arguments_are_named(prompt, n, match):
  model = models.build(GLM_SMALL, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    models.generate(model, prompt, n)
