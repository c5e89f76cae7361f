"""GLM-5.1 (`glm_moe_dsa`): MLA + DSA indexer + MoE. Variants: `full` (published) and `tiny` (CPU).

Usage: python train.py --config=configs/glm5_1.py:tiny --workdir=DIR [--config.train.steps=N]
"""

import ml_collections

from configs import base

_TINY = dict(
    vocab_size=2048, d_model=128, n_layers=4, first_k_dense=1, dense_inter=256,
    n_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_dim=48, qk_rope_dim=16, v_head_dim=64,
    n_routed_experts=8, experts_per_token=2, n_shared_experts=1, moe_inter=96, routed_scaling=2.5,
    index_n_heads=2, index_head_dim=32, index_topk=64, index_rope_dim=16, rope_theta=10000.0,
)


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  # 16K tokens of routed experts at a time: 128K routed rows, the size the grouped matmul was measured at.
  return base.two_stage_lm("glm5_1", variant, {"moe_token_chunk": 16384}, _TINY, full_seq_len=131072, full_learning_rate=7.3e-6)
