"""GLM-5.1 (`glm_moe_dsa`): MLA + DSA indexer + MoE. Variants: `full` (published) and `tiny` (CPU).

Usage: python train.py --config=configs/glm5_1.py:tiny --workdir=DIR [--config.train.steps=N]
"""

import dataclasses

import ml_collections

from configs import base
from hyscale_jax.model_config import ModelConfig

_TINY = dict(
    vocab_size=2048, d_model=128, n_layers=4, first_k_dense=1, dense_inter=256,
    n_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_dim=48, qk_rope_dim=16, v_head_dim=64,
    n_routed_experts=8, experts_per_token=2, n_shared_experts=1, moe_inter=96, routed_scaling=2.5,
    index_n_heads=2, index_head_dim=32, index_topk=64, index_rope_dim=16, rope_theta=10000.0,
)


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  if variant not in ("tiny", "full"):
    raise ValueError(f"configs/glm5_1.py: unknown variant {variant!r}; use 'tiny' or 'full'.")
  config = base.get_config()
  config.task = "lm"
  model = dataclasses.asdict(ModelConfig())  # the published architecture (HF GlmMoeDsaConfig)
  if variant == "tiny":
    model.update(_TINY)
  config.model = ml_collections.ConfigDict(model)

  config.data.source = "shakespeare"
  config.data.vocab_size = config.model.vocab_size
  config.data.seq_len = 256 if variant == "tiny" else 131072
  config.data.batch_size = 8 if variant == "tiny" else 1
  config.data.cache_dir = ""

  # Indexer KL coefficient in the sparse stage, and the indexer's own learning rate.
  config.optim.indexer_loss_coeff = 1.0
  config.optim.indexer_learning_rate = 1e-3
  config.optim.learning_rate = 3e-3 if variant == "tiny" else 7.3e-6
  config.optim.weight_decay = 0.01
  # Auxiliary-loss-free MoE balancing: router bias step per optimizer step.
  config.optim.router_bias_rate = 1e-3

  config.train.steps = 200 if variant == "tiny" else 16000
  # Dense warm-up: indexer only, dense KL, attention not sparsified (architectures.md 1.6).
  config.train.warmup_steps = 40 if variant == "tiny" else 1000
  config.train.log_every = 10
  config.train.checkpoint_every = 50
  return config
