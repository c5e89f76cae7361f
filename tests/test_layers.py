"""The NNX LightningIndexer: shapes, dtypes, and detached inputs."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyscale_jax import ops
from hyscale_jax.layers import LightningIndexer


def _indexer():
  return LightningIndexer(d_model=16, q_lora_rank=8, num_heads=3, head_dim=4, rngs=nnx.Rngs(0))


def test_shapes_dtypes_and_param_paths():
  indexer = _indexer()
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  c = jax.random.normal(jax.random.key(2), (2, 5, 8))
  q, k, w = indexer(x, c)
  assert q.shape == (2, 5, 3, 4) and k.shape == (2, 5, 4) and w.shape == (2, 5, 3)
  assert w.dtype == jnp.float32
  assert indexer.score_scale == 0.5
  paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(indexer, nnx.Param))}
  assert paths == {"wq_b/kernel", "wk/kernel", "k_norm/scale", "k_norm/bias", "weights_proj/kernel"}
  selection = ops.flash_topk(q, k, w, topk=3, scale=indexer.score_scale)
  assert selection.indices.shape == (2, 5, 3)


def test_inputs_are_detached_but_params_learn():
  indexer = _indexer()
  x = jax.random.normal(jax.random.key(1), (1, 4, 16))
  c = jax.random.normal(jax.random.key(2), (1, 4, 8))

  def total(x, c):
    q, k, w = indexer(x, c)
    return q.sum() + k.sum() + w.sum()

  dx, dc = jax.grad(total, argnums=(0, 1))(x, c)
  assert not np.any(dx) and not np.any(dc)
  grads = nnx.grad(lambda m: sum(a.sum() for a in m(x, c)))(indexer)
  assert np.any(grads["wq_b"]["kernel"][...]) and np.any(grads["weights_proj"]["kernel"][...])
