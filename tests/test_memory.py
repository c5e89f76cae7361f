"""The memory preflight: the estimate's scaling, and train.py stopping before compute with knobs."""

import dataclasses

import pytest

from configs import deepseek_v4_flash, glm5_1
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training import lm, memory

_GLM_FULL = ModelConfig.from_config(glm5_1.get_config("full").model)


def test_estimate_scales_with_sequence_context_and_remat():
  est = lambda **kw: memory.estimate_training_memory(_GLM_FULL, batch_size=1, param_count=10**9, **kw)
  base, longer = est(seq_len=1 << 16), est(seq_len=1 << 17)
  for key in ("layer inputs", "saved selection and attention", "logits"):
    assert longer.components[key] == 2 * base.components[key], key
  split = est(seq_len=1 << 17, context_shards=4)
  assert split.components["layer inputs"] * 4 == longer.components["layer inputs"]
  assert split.components["parameters"] == longer.components["parameters"]  # replicated
  full = memory.estimate_training_memory(dataclasses.replace(_GLM_FULL, remat_policy="full"), batch_size=1,
                                         seq_len=1 << 16, param_count=10**9)
  assert full.components["saved selection and attention"] == 0 < base.components["saved selection and attention"]
  # AdamW: two moments; gradients as large as the parameters (f32 here).
  assert base.components["optimizer"] == 2 * base.components["parameters"] == 2 * 4 * 10**9


def test_preflight_names_the_knobs_that_would_fit():
  cfg = ModelConfig.from_config(deepseek_v4_flash.get_config("tiny").model)
  small = memory.preflight(cfg, batch_size=8, seq_len=256, mesh_shape={}, available=1 << 34)
  assert 0 < small.total < 1 << 34
  need = memory.estimate_training_memory(cfg, batch_size=8, seq_len=1 << 16).total
  with pytest.raises(MemoryError) as info:
    memory.preflight(cfg, batch_size=8, seq_len=1 << 16, mesh_shape={}, available=need // 3)
  text = str(info.value)
  assert "per device" in text and "mesh.context=" in text and "data.seq_len=" in text, text


def test_train_stops_before_compute_when_the_model_cannot_fit(tmp_path):
  config = glm5_1.get_config("full")  # 744B parameters: terabytes per device on this machine
  with pytest.raises(MemoryError, match="parameters, gradients and AdamW state alone"):
    lm.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()  # nothing was written or computed
