"""Selection demo: a lightning indexer learns which keys a frozen attention layer attends to.

The task is DSA's indexer training in miniature, on real text: a dense KL warm-up, then the sparse
stage in which `flash_topk` selects keys, `sparse_attention` gives the teacher's LSE over them and
`indexer_loss` distils. The logged `recall` is the fraction of the teacher's own top-k keys (by
head-summed attention probability) that the indexer selects.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from tqdm import tqdm

from hyscale_jax import ops, remat
from hyscale_jax.layers import LightningIndexer
from hyscale_jax.training import data as data_lib
from hyscale_jax.training.checkpoints import Checkpointer
from hyscale_jax.training.metrics import MetricWriter


def _teacher_params(key, cfg) -> dict:
  """Frozen byte embedding and MQA projections: embed [V, D], wq [D, H, Dh], wk [D, Dh]."""
  k_embed, k_q, k_k = jax.random.split(key, 3)
  d, h, dh = cfg.d_model, cfg.attn_heads, cfg.attn_head_dim
  return dict(
      embed=jax.random.normal(k_embed, (data_lib.BYTE_VOCAB, d), jnp.float32),
      wq=jax.random.normal(k_q, (d, h, dh), jnp.float32) * d**-0.5,
      wk=jax.random.normal(k_k, (d, dh), jnp.float32) * d**-0.5,
  )


def _teacher_inputs(teacher, tokens):
  """(x [B, T, D], q [B, T, H, Dh], k [B, T, 1, Dh]) of the frozen attention."""
  x = teacher["embed"][tokens]
  q = jnp.einsum("btd,dhe->bthe", x, teacher["wq"])
  k = (x @ teacher["wk"])[:, :, None, :]
  return x, q, k


def _indexer_loss(params, graphdef, x, q, k, *, dense: bool, cfg, backends):
  """The indexer KL of one layer: dense warm-up or sparse (select, attend, distil)."""
  indexer = nnx.merge(graphdef, params)
  iq, ik, iw = indexer(x, x)
  attn_scale = cfg.attn_sharpness * cfg.attn_head_dim**-0.5
  kwargs = dict(attn_scale=attn_scale, index_scale=indexer.score_scale, backend=backends.indexer_loss)
  if dense:
    return ops.indexer_loss(iq, ik, iw, q, k, None, None, **kwargs)
  selection = ops.flash_topk(iq, ik, iw, topk=cfg.topk, scale=indexer.score_scale, backend=backends.flash_topk)
  _, lse = ops.sparse_attention(q, k, k, selection.indices, scale=attn_scale, backend=backends.sparse_attention)
  return ops.indexer_loss(iq, ik, iw, q, k, lse, selection.indices, **kwargs)


def _teacher_topk_recall(selected, q, k, attn_scale, topk):
  """Mean |selected ∩ teacher top-k| / topk over rows with more than topk visible keys.

  Evaluation only: it builds the dense [B, T, T] teacher probabilities, fine at demo lengths.
  """
  T = q.shape[1]
  logits = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], precision="highest") * attn_scale
  causal = jnp.tril(jnp.ones((T, T), bool))
  probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).sum(axis=1)  # [B, T, T]
  _, teacher_top = jax.lax.top_k(probs, topk)
  hits = (selected[..., :, None] == teacher_top[..., None, :]).any(-1).sum(-1)  # [B, T]
  rows = jnp.arange(T) >= topk
  return jnp.sum(jnp.where(rows, hits, 0)) / (jnp.sum(rows) * topk * q.shape[0])


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """Trains the indexer for `config.train.steps`, resuming from `workdir` when it holds a checkpoint.

  Returns:
    The metric rows logged in this run (also appended to `<workdir>/metrics.jsonl`).
  """
  cfg, train = config.model, config.train
  policy = remat.checkpoint_policy(cfg.remat_policy) and cfg.remat_policy  # validates the name
  teacher = _teacher_params(jax.random.key(train.seed), cfg)
  indexer = LightningIndexer(cfg.d_model, cfg.d_model, cfg.index_heads, cfg.index_head_dim,
                             rngs=nnx.Rngs(train.seed + 1))
  graphdef, params = nnx.split(indexer, nnx.Param)
  lr_warmup = config.optim.lr_warmup_steps
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.optim.learning_rate, lr_warmup, max(train.steps, lr_warmup + 1))
  tx = optax.chain(
      optax.clip_by_global_norm(config.optim.grad_clip) if config.optim.grad_clip else optax.identity(),
      optax.adamw(schedule, weight_decay=config.optim.weight_decay),
  )
  state = {"params": params, "opt_state": tx.init(params)}

  checkpointer = Checkpointer(f"{workdir}/checkpoints", every_steps=train.checkpoint_every)
  restored = checkpointer.restore_latest(state)
  start = 0
  if restored is not None:
    start, state, _ = restored
  metrics = MetricWriter(workdir)

  @functools.partial(jax.jit, static_argnames="dense", donate_argnums=0)
  def train_step(state, tokens, dense):
    x, q, k = _teacher_inputs(teacher, tokens)
    loss_fn = remat.remat(
        functools.partial(_indexer_loss, graphdef=graphdef, dense=dense, cfg=cfg, backends=config.ops), policy)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x=x, q=q, k=k))(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

  @jax.jit
  def evaluate(params, tokens):
    x, q, k = _teacher_inputs(teacher, tokens)
    iq, ik, iw = nnx.merge(graphdef, params)(x, x)
    selected = ops.flash_topk(iq, ik, iw, topk=cfg.topk, backend=config.ops.flash_topk).indices
    return _teacher_topk_recall(selected, q, k, cfg.attn_sharpness * cfg.attn_head_dim**-0.5, cfg.topk)

  batches = data_lib.ByteWindows(data_lib.bundled_text(), seq_len=config.data.seq_len,
                                 batch_size=config.data.batch_size, seed=train.seed)
  eval_tokens = data_lib.ByteWindows(data_lib.bundled_text(), seq_len=config.data.seq_len,
                                     batch_size=config.data.batch_size, seed=train.seed + 1).batch(0)
  logged, window_start, window_steps = [], time.perf_counter(), 0
  bar = tqdm(range(start, train.steps), initial=start, total=train.steps, disable=not train.progress_bar,
             desc="selection_demo", unit="step")
  for step in bar:
    dense = step < train.warmup_steps
    state, loss = train_step(state, batches.batch(step), dense)
    window_steps += 1
    done = step + 1
    if done % train.log_every == 0 or done == train.steps:
      loss = float(loss)
      elapsed = time.perf_counter() - window_start
      row = metrics.write(done, dict(
          indexer_loss=loss, recall=evaluate(state["params"], eval_tokens), dense_stage=float(dense),
          tokens_per_s=window_steps * config.data.batch_size * config.data.seq_len / elapsed))
      logged.append(row)
      bar.set_postfix(loss=f"{loss:.4f}", recall=f"{row['recall']:.3f}")
      window_start, window_steps = time.perf_counter(), 0
    checkpointer.maybe_save(done, state, {"step": done}, force=done == train.steps)
  checkpointer.close()
  logging.info("done at step %d; metrics in %s", train.steps, metrics.path)
  return logged
