"""DeepSeek-V4-Flash (`deepseek_v4`): SWA / CSA / HCA attention, hash-routed and scored MoE, YaRN on the
compressed layers. Variants `full` and `tiny`.

Usage: python train.py --config=configs/deepseek_v4_flash.py:tiny --workdir=DIR [--config.train.steps=N]
"""

import ml_collections

from configs import base

# The published V4-Flash config (architectures.md §3.5): 2 SWA layers, then CSA (even) / HCA (odd).
_FULL = dict(
    architecture="deepseek_v4", vocab_size=129280, d_model=4096, n_layers=43, first_k_dense=0,
    rms_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    # The compressed layers' YaRN (architectures.md §3.1): factor 16 over 65536 tokens, beta 32 / 1, and
    # transformers' attention factor 1.0 (cos/sin unscaled).
    rope_yarn_factor=16.0, rope_yarn_original_max_len=65536, rope_yarn_beta_fast=32.0, rope_yarn_beta_slow=1.0,
    rope_yarn_attention_factor=1.0,
    n_heads=64, head_dim=512, qk_rope_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, compress_ratios=(0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43)),
    csa_ratio=4, index_n_heads=64, index_head_dim=128, index_topk=512, index_rope_dim=64,
    n_routed_experts=256, experts_per_token=6, n_shared_experts=1, moe_inter=2048,
    scoring="sqrtsoftplus", routed_scaling=1.5, norm_topk_prob=True,
    n_hash_layers=3,  # the first 3 MoE layers route by the token table tid2eid (§3.4)
    # mHC residual streams (architectures.md §3.5: hc_mult 4, 20 Sinkhorn iterations); tiny keeps them.
    hc_mult=4, hc_sinkhorn_iters=20,
)
# architectures.md's tiny V4 test config at T=256: 64 CSA entries (top 32) and 16 HCA entries.
_TINY = dict(
    vocab_size=2048, d_model=256, n_layers=4, n_heads=4, head_dim=64, qk_rope_dim=16, q_lora_rank=64,
    o_groups=2, o_lora_rank=64, sliding_window=32, compress_ratios=(0, 4, 16, 4),
    index_n_heads=4, index_head_dim=32, index_topk=32, index_rope_dim=16,
    n_routed_experts=8, experts_per_token=2, moe_inter=96,
    # Every feature of `full` stays on: one hash-routed layer, and YaRN whose blend falls inside the
    # tiny rope slice at the 256-token training length.
    n_hash_layers=1, rope_yarn_original_max_len=64,
)


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  return base.two_stage_lm("deepseek_v4_flash", variant, _FULL, _TINY, full_seq_len=65536, full_learning_rate=2.2e-4)
