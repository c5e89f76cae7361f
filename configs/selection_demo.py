"""Selection demo: train a lightning indexer to predict a frozen attention's top-k on real text.

Usage: python train.py --config=configs/selection_demo.py --workdir=runs/demo [--config.train.steps=300]
"""

from configs import base


def get_config():
  config = base.get_config()
  config.task = "selection_demo"
  # The frozen teacher: MQA attention over byte embeddings.
  config.model.d_model = 64
  config.model.attn_heads = 4
  config.model.attn_head_dim = 32
  # Logit multiplier of the teacher beyond head_dim^-0.5 (peakier attention is easier to see).
  config.model.attn_sharpness = 4.0
  # The student: DSA indexer heads x head dim, and the selection budget.
  config.model.index_heads = 4
  config.model.index_head_dim = 32
  config.model.topk = 32
  config.train.steps = 200
  # Steps of the dense warm-up (dense KL, no selection) before the sparse stage.
  config.train.warmup_steps = 40
  return config
