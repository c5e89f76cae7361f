"""Model FLOPs per training step (hyscale_jax/training/flops.py): parameters, XLA's count, hand values, peaks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import deepseek_v4_flash, glm5_1, qwen3_8_flash_next
from hyscale_jax import models, ops
from hyscale_jax.layers.mla import MLASparseAttention
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training.flops import StepFlops, forward_flops, peak_tflops, step_flops

_CONFIGS = {"glm5_1": glm5_1, "deepseek_v4_flash": deepseek_v4_flash, "qwen3_8_flash_next": qwen3_8_flash_next}


def _cfg(name: str, variant: str = "tiny", **overrides) -> ModelConfig:
  return dataclasses.replace(ModelConfig.from_config(_CONFIGS[name].get_config(variant).model), **overrides)


def _parts(flops: StepFlops) -> dict[str, float]:
  return dataclasses.asdict(flops)


@pytest.mark.parametrize("mtp_depth, index_topk_freq", [(0, 1), (1, 2)])
def test_matmul_parts_are_twice_the_active_matmul_parameters_per_token(mtp_depth, index_topk_freq):
  # IndexShare (freq 2) leaves some layers without indexer weights; an MTP depth adds a block and a head pass.
  cfg = _cfg("glm5_1", mtp_depth=mtp_depth, index_topk_freq=index_topk_freq)
  B, T = 2, 64
  _, active = models.count_params(cfg)
  # What is not a matmul weight, read off the model's own state: the embedding table (a gather), every
  # norm's scale and bias. What remains must be Linear kernels and the stacked routed experts.
  abstract = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  not_matmul, head = 0, 0
  for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    names = [str(p) for p in path]
    size = int(np.prod(leaf.shape))
    if "embed_tokens" in names or any("norm" in n for n in names[:-1]):
      assert names[-1] in ("embedding", "scale", "bias"), names
      not_matmul += size
    else:
      assert names[-1] == "kernel" or names[-1].startswith("experts_"), names
    head += size if names[:1] == ["lm_head"] else 0
  # The LM head is one parameter set that every MTP depth runs once more.
  want = 2 * (active - not_matmul + mtp_depth * head) * B * T
  for dense in (False, True):
    got = forward_flops(cfg, batch_size=B, seq_len=T, dense=dense)
    assert got.projections + got.experts + got.lm_head == want, dense


def test_sparse_attention_core_agrees_with_xla_cost_analysis():
  # The sparse stage's attention core of one GLM layer against XLA's own count of the op the layer
  # runs (the reference backend on the CPU), on the shapes of the layer's absorbed q and k. k = 16
  # keys at T = 1024 keeps the slots XLA computes but the count skips (the -1 padding of the first
  # k - 1 rows: k (k - 1) / 2 of T k slots, 0.7%) small, so what is left is XLA's element-wise
  # softmax (about 8 FLOPs per logit against 2 (L + R + L) = 288 of matmul per logit and head).
  cfg = _cfg("glm5_1", index_topk=16, n_layers=1, first_k_dense=1)
  T, K = 1024, cfg.index_topk
  layer = MLASparseAttention(cfg, has_indexer=True, rngs=nnx.Rngs(0))
  positions = jnp.arange(T)[None]
  q, k, _, _, _ = jax.eval_shape(lambda x: layer._mqa_inputs(x, positions),
                                 jax.ShapeDtypeStruct((1, T, cfg.d_model), jnp.float32))
  p, j = np.arange(T)[:, None], np.arange(K)[None]
  indices = jnp.asarray(np.where(j <= p, p - j, -1)[None], jnp.int32)  # min(p + 1, k) causal keys per row

  def attention(q, k):
    return ops.sparse_attention(q, k, None, indices, scale=layer.scale, value_dim=cfg.kv_lora_rank,
                                backend="reference")[0]

  cotangent = jax.random.normal(jax.random.key(0), (1, T, cfg.n_heads, cfg.kv_lora_rank))
  grads = jax.grad(lambda q, k: jnp.sum(attention(q, k) * cotangent), argnums=(0, 1))
  xla = lambda f: jax.jit(f).lower(q, k).compile().cost_analysis()["flops"]
  ours = forward_flops(cfg, batch_size=1, seq_len=T, dense=False).attention
  assert ours <= xla(attention) <= 1.06 * ours
  # Forward + backward: the count's 3.5x is FlashAttention's (the backward recomputes the logits:
  # 2.5x the forward); in one XLA program the backward reuses the forward's logits (2x), so XLA
  # lands between 3x and 3.5x of the forward, plus element-wise work.
  ours_step = step_flops(cfg, batch_size=1, seq_len=T, dense=False).attention
  assert ours_step == 3.5 * ours
  assert 3.0 / 3.5 * ours_step <= xla(grads) <= 1.1 * ours_step


def test_hand_counts_at_t8():
  B, T = 2, 8
  # GLM tiny with k = 4: H 4, L 64, R 16, nope 48, v 64; 4 layers, each with its indexer (H_I 2, D_I 32).
  glm = _cfg("glm5_1", index_topk=4)
  sparse, dense = (step_flops(glm, batch_size=B, seq_len=T, dense=d) for d in (False, True))
  # Sparse: min(p + 1, 4) keys = 1 + 2 + 3 + 5 * 4 = 26, 2 * 4 * (64 + 16 + 64) FLOPs each, x 3.5.
  assert sparse.attention == 4 * B * 26 * 1152 * 3.5
  # Dense: p + 1 keys = 36, non-absorbed 2 * 4 * (48 + 16 + 64) each, forward only.
  assert dense.attention == 4 * B * 36 * 1024
  # Indexer, 2 * 2 * 32 = 128 per pair: sparse, scoring the 36 causal pairs plus the KL on the 26
  # selected x 3; dense, the KL on all 36 x 3.
  assert sparse.indexer == 4 * B * (36 * 128 + 3 * 26 * 128)
  assert dense.indexer == 4 * B * 3 * 36 * 128
  # The warm-up trains only the indexer: the LM head counts its forward; the sparse stage, 3x.
  head = forward_flops(glm, batch_size=B, seq_len=T, dense=True).lm_head
  assert dense.lm_head == head == 2 * 128 * 2048 * B * T and sparse.lm_head == 3 * head

  # DeepSeek-V4, one CSA layer (ratio 4), window 2, top-1 entry: H 4, hd 64 (K = V), H_I 4, D_I 32.
  v4 = _cfg("deepseek_v4_flash", n_layers=1, compress_ratios=(4,), sliding_window=2, index_topk=1)
  sparse, dense = (step_flops(v4, batch_size=B, seq_len=T, dense=d) for d in (False, True))
  # Window min(p + 1, 2): 15 keys; entries (w + 1) 4 <= p + 1: 0 0 0 1 1 1 1 2 = 6, top-1 of them 5.
  assert sparse.attention == B * (15 + 5) * 2 * 4 * 128 * 3.5
  assert dense.attention == B * (15 + 6) * 2 * 4 * 128
  assert sparse.indexer == B * (6 + 3 * 5) * 256 and dense.indexer == B * 3 * 6 * 256

  # Qwen, one QSA layer, blocks of 2, top-1 block: complete blocks 0 1 1 2 2 3 3 4 (top-1: 0 1 1 1 1 1 1 1)
  # give 0 2 2 2 2 2 2 2 tokens, plus tails 1 0 1 0 1 0 1 0: 18 keys; the warm-up 36. H 4, hd 64.
  qwen = _cfg("qwen3_8_flash_next", n_layers=1, layer_types=("qsa",), ple_layer_ids=(), qsa_block=2,
              index_topk=1)
  sparse, dense = (step_flops(qwen, batch_size=B, seq_len=T, dense=d) for d in (False, True))
  assert sparse.attention == B * 18 * 2 * 4 * 128 * 3.5 and dense.attention == B * 36 * 2 * 4 * 128
  # Weight-free block scores, 2 * 2 * 32 per pair: 16 visible blocks, 7 selected.
  assert sparse.indexer == B * (16 + 3 * 7) * 128 and dense.indexer == B * 3 * 16 * 128


@pytest.mark.parametrize("T", [65536, 131072])
def test_glm5_1_two_layer_benchmark_model(T):
  # bench/model_step.py's `glm2`: GLM-5.1 at full width, 2 layers (one dense FFN, one MoE of 64 routed
  # experts), vocab 32768; built only as a config. By hand, at T = 65536 (batch 1):
  #   matmul weights a token meets: MLA 6144*2048 + 2048*64*256 + 6144*576 + 512*64*448 + 64*256*6144
  #   = 165.0M per layer; dense FFN 3*6144*12288 = 226.5M; router 6144*64 + shared expert
  #   3*6144*2048 = 38.1M; 8 routed experts 8*3*6144*2048 = 302.0M; LM head 6144*32768 = 201.3M:
  #   1097.9M, x 6 x T = 431.7 TFLOP; indexer weights 2*(2048*4096 + 6144*160) = 18.7M, x 4 x T = 4.9.
  #   attention: 2 layers x 3.5 x 2*64*1088 x (2048*2049/2 + 63488*2048 keys) = 128.8 TFLOP.
  #   indexer: 2 layers x 8192 x (T(T+1)/2 scored + 3 x 132.1M KL pairs) = 35.2 + 6.5 = 41.7 TFLOP.
  #   Sparse stage: 607 TFLOP. Warm-up: matmuls 1097.9M x 2 x T = 143.9, indexer weights 4.9, dense
  #   attention 2 x 2*64*512 x T(T+1)/2 = 281.5, KL 2 x 3 x 8192 x T(T+1)/2 = 105.6: 536 TFLOP.
  # At 2T the matmuls double and the T^2 terms (the scoring, the dense attention and KL) quadruple.
  cfg = _cfg("glm5_1", "full", n_layers=2, first_k_dense=1, n_routed_experts=64, vocab_size=32768)
  sparse = step_flops(cfg, batch_size=1, seq_len=T, dense=False).total
  dense = step_flops(cfg, batch_size=1, seq_len=T, dense=True).total
  if T == 65536:
    assert 600e12 < sparse < 615e12 and 530e12 < dense < 542e12
  else:  # about 2 x (436.6 + 128.8 + 6.5) + 4 x 35.2 (the scoring) and 2 x 148.8 + 4 x 387.1
    assert 1280e12 < sparse < 1295e12 and 1835e12 < dense < 1855e12


def test_peak_tflops():
  assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
  assert peak_tflops("NVIDIA H200") == 989.4
  assert peak_tflops("NVIDIA H100 PCIe") == 756.0  # the longest match, not "H100"
  assert peak_tflops("NVIDIA GH200 480GB") == 989.4
  assert peak_tflops("cpu") is None
  assert peak_tflops("cpu", override=123.0) == peak_tflops("NVIDIA H200", 123.0) == 123.0


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_every_tiny_model_counts_both_stages(name):
  cfg = _cfg(name)
  for dense in (False, True):
    parts = _parts(step_flops(cfg, batch_size=2, seq_len=256, dense=dense))
    assert all(isinstance(v, float) and v > 0 for v in parts.values()), (dense, parts)
  # Far above the selection, dense causal attention (p + 1 keys, forward only) outweighs the
  # sparse stage's (k keys, forward and backward).
  T = 256 * cfg.index_topk
  attention = lambda dense: step_flops(cfg, batch_size=1, seq_len=T, dense=dense).attention
  assert attention(True) > attention(False)
  with pytest.raises(ValueError, match="seq_len"):
    step_flops(cfg, batch_size=1, seq_len=0, dense=False)
