"""Qwen3.8-Flash-Next (`qwen4_exp`): gated GQA with the QSA block indexer, and MoE.

Variants: `full` (the published layout: Gated DeltaNet on 3 of every 4 layers, QSA on every 4th,
the Engram n-gram embedding at layer 2) and `tiny` (the same over 4 layers, CPU-sized).
The indexer trains with the block-level KL (`model.indexer_pool` = "sum" or "max"), or not at all
with `--config.model.indexer_frozen=true --config.train.warmup_steps=0`.

Usage: python train.py --config=configs/qwen3_8_flash_next.py:tiny --workdir=DIR
"""

import ml_collections

from configs import base

_FULL = dict(
    architecture="qwen4_exp", vocab_size=248320, d_model=2560, n_layers=48, first_k_dense=0,
    rms_eps=1e-6, rope_theta=1e7, layer_types=("gated_deltanet",) * 3 + ("qsa",),
    n_heads=24, n_kv_heads=2, head_dim=256, qk_rope_dim=64,
    index_n_heads=4, index_head_dim=128, index_rope_dim=64, index_topk=512, qsa_block=4,
    n_routed_experts=512, experts_per_token=10, n_shared_experts=1, moe_inter=640,
    scoring="softmax", routed_scaling=1.0, norm_topk_prob=True,
    # architectures.md §4.1: gated-residual streams (4, low rank 320) in place of the pre-norms, and a
    # sigmoid-gated shared expert. The router keeps our load-balancing bias (transformers has none).
    hc_mult=4, hc_lowrank=320, shared_expert_gate=True,
    # Gated DeltaNet (architectures.md §4.1): 16 q/k heads and 48 value heads of 128, conv 4, sigmoid gate.
    linear_n_key_heads=16, linear_n_value_heads=48, linear_key_dim=128, linear_value_dim=128,
    linear_conv_kernel=4, linear_output_gate="sigmoid",
    # Engram / PLE (architectures.md §4.1) at layer 2 (one-indexed): orders 2 and 3, 8 hashed heads each, into
    # prime tables from 20M rows (51.2B parameters of 160 features); n-grams stop at <|endoftext|>.
    ple_layer_ids=(2,), ple_embed_dim=2560, ngram_size=3, ngram_heads_per_order=8, ngram_vocab_base=20_000_000,
    eos_token_id=248044,
)
_FULL["layer_types"] = _FULL["layer_types"] * 12
# architectures.md's tiny QSA config: a 64-token budget (16 blocks), 67 attended indices per token,
# stacked as [GDN, GDN, GDN, QSA].
_TINY = dict(
    vocab_size=2048, d_model=256, n_layers=4, layer_types=("gated_deltanet",) * 3 + ("qsa",), n_heads=4,
    n_kv_heads=2, head_dim=64, qk_rope_dim=16, index_n_heads=2, index_head_dim=32, index_rope_dim=16,
    index_topk=16,
    n_routed_experts=8, experts_per_token=2, moe_inter=96, hc_lowrank=32,
    linear_n_key_heads=2, linear_n_value_heads=4, linear_key_dim=32, linear_value_dim=32,
    # Engram at layer 2 with 16 heads of 16 in 4K-row tables (1M parameters); EOS is text data's id 0.
    ple_embed_dim=256, ngram_vocab_base=4096, eos_token_id=0,
)


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  return base.two_stage_lm("qwen3_8_flash_next", variant, _FULL, _TINY, full_seq_len=65536, full_learning_rate=2.2e-4)
