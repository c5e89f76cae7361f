"""Probe: where the DSA indexer loss's time goes at 16K on the GPU (teacher kernel configs; student side alone).

GLM-5.1 shapes: attention MQA H 64, Dk 576; indexer 32 heads x 128; k 2048; random causal selections.
"""
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from hyscale_jax.ops.flash_topk.reference import index_scores_at  # noqa: E402
from hyscale_jax.ops.indexer_loss.reference import indexer_loss_reference  # noqa: E402
from pallas_kernels.flash_topk import index_scores_at_pallas  # noqa: E402
from pallas_kernels.sparse_attention import Config, attention_teacher_pallas, sparse_attention_forward_pallas  # noqa: E402
from sparse_attention import SHAPES, make_inputs  # noqa: E402
from timing import timed  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
shape = SHAPES["mla64"]
shape = dataclasses.replace(shape, index_heads=32)
x = make_inputs(shape, T)
scale = shape.Dk ** -0.5
out, lse = jax.jit(functools.partial(sparse_attention_forward_pallas, scale=scale, value_dim=512))(
    x["q"], x["k"], None, x["idx"])
flops = 2 * T * shape.H * shape.K * shape.Dk
base = None
CFGS = [Config(64, 64, 8, 2), Config(64, 64, 4, 2), Config(64, 64, 4, 3), Config(64, 64, 4, 1), Config(32, 64, 4, 2),
        Config(64, 32, 4, 2)]
for cfg in (CFGS if jax.default_backend() == "gpu" else CFGS[:1]):
  fn = jax.jit(functools.partial(attention_teacher_pallas, scale=scale, config=cfg))
  try:
    got = fn(x["q"], x["k"], lse, x["idx"])
    base = got if base is None else base
    err = float(jnp.max(jnp.abs(got - base)))
    ms = timed(fn, x["q"], x["k"], lse, x["idx"], reps=5) * 1e3
    print(f"teacher all {T} rows {cfg}: {ms:.2f} ms = {flops / ms / 1e9:.1f} TF/s (max diff vs first {err:.1e})", flush=True)
  except Exception as e:  # noqa: BLE001
    print(f"teacher {cfg}: failed {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def loss_fn(teacher, grad_in_forward, chunk=1024, scores_at=index_scores_at):
  def f(iq, ik, iw):
    return indexer_loss_reference(iq, ik, iw, x["q"], x["k"], lse, x["idx"], attn_scale=scale,
                                  index_scale=shape.index_dim ** -0.5, teacher_mass=teacher, query_chunk=chunk,
                                  grad_in_forward=grad_in_forward, scores_at=scores_at)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


ones = lambda q, k, lse, idx, scale: jnp.ones(idx.shape, jnp.float32)
want = None
for name, teacher in (("pallas teacher", attention_teacher_pallas), ("constant teacher (student side only)", ones)):
  for student, scores_at in (("XLA scores", index_scores_at), ("Pallas scores", index_scores_at_pallas)):
    for gif in (True, False):
      fn = loss_fn(teacher, gif, scores_at=scores_at)
      loss, grads = fn(x["iq"], x["ik"], x["iw"])
      if name == "pallas teacher":
        want = want or (loss, grads)
        diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b.astype(jnp.float32))))
                 for a, b in zip((loss, *grads), (want[0], *want[1]))]
      else:
        diffs = []
      ms = timed(fn, x["iq"], x["ik"], x["iw"], reps=3) * 1e3
      print(f"indexer loss value_and_grad, {name}, {student}, grad_in_forward={gif}: {ms:.1f} ms "
            f"(loss, dq, dk, dw max diff / max vs the first: {[f'{d:.1e}' for d in diffs]})", flush=True)
for chunk in ((512, 2048, 4096) if jax.default_backend() == "gpu" else ()):
  fn = loss_fn(ones, True, chunk, scores_at=index_scores_at_pallas)
  ms = timed(fn, x["iq"], x["ik"], x["iw"], reps=3) * 1e3
  print(f"indexer loss value_and_grad, student side only (Pallas scores), chunk {chunk}: {ms:.1f} ms", flush=True)
