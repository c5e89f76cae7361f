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
  for key in ("layer inputs", "saved selection and attention"):
    assert longer.components[key] == 2 * base.components[key], key
  # The LM loss holds one chunk's logits whatever the length; unchunked, all of them.
  chunk = _GLM_FULL.lm_loss_chunk
  assert longer.components["logits"] == base.components["logits"] == memory.LOGITS_COPIES * chunk * 154880 * 4
  unchunked = lambda T: memory.estimate_training_memory(dataclasses.replace(_GLM_FULL, lm_loss_chunk=0),
                                                        batch_size=1, seq_len=T, param_count=10**9)
  assert unchunked(1 << 17).components["logits"] == 2 * unchunked(1 << 16).components["logits"]
  split = est(seq_len=1 << 17, context_shards=4)
  assert split.components["layer inputs"] * 4 == longer.components["layer inputs"]
  assert split.components["logits"] == longer.components["logits"]  # each device chunks its T / 4 rows
  assert est(seq_len=1 << 12, context_shards=4).components["logits"] * 2 == base.components["logits"]  # 1024 rows
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


def test_train_stops_with_the_estimate_and_knobs_when_the_device_is_too_small(tmp_path, monkeypatch):
  config = glm5_1.get_config("tiny")
  config.data.update(seq_len=1 << 14, batch_size=1)  # no data is read: the preflight stops first
  cfg = ModelConfig.from_config(config.model)
  need = memory.estimate_training_memory(cfg, batch_size=1, seq_len=1 << 14).total
  monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: need // 2)
  with pytest.raises(MemoryError) as info:
    lm.train_and_evaluate(config, str(tmp_path / "run"))
  text = str(info.value)
  assert f"about {need / 2**30:.2f} GiB" in text and "logits" in text, text  # the estimate, by component
  for knob in ("remat_policy=full", "mesh.context=", "data.seq_len=", "memory_preflight=false"):
    assert knob in text, (knob, text)
  assert not (tmp_path / "run").exists()


def test_deterministic_attention_adds_its_slabs_up_to_the_kernel_budget():
  est = lambda cfg, T: memory.estimate_training_memory(cfg, batch_size=1, seq_len=T, param_count=10**9).components
  det = dataclasses.replace(_GLM_FULL, sparse_attention_deterministic=True)
  assert est(_GLM_FULL, 1 << 14)["deterministic attention slabs"] == 0
  assert est(det, 1 << 14)["deterministic attention slabs"] == 1 << 30  # capped: the kernel runs query chunks
  # Under the cap: every selected key's f32 row of width Dk, once per head block of the backward
  # kernel: bf16 MLA runs all 64 heads in one program, f32 in blocks of 32.
  _, _, key_width = memory._attention_dims(det)
  for dtype, head_blocks in (("bfloat16", 1), ("float32", 2)):
    cfg = dataclasses.replace(det, dtype=dtype)
    assert cfg.n_heads == 64
    slabs = 64 * det.index_topk * key_width * 4 * head_blocks
    assert est(cfg, 64)["deterministic attention slabs"] == slabs < 1 << 30
  # DeepSeek-V4 attends its window beside the selected entries: both have slab rows.
  from configs import deepseek_v4_flash  # noqa: PLC0415

  v4 = dataclasses.replace(ModelConfig.from_config(deepseek_v4_flash.get_config("full").model),
                           sparse_attention_deterministic=True, dtype="bfloat16")  # one 64-head block
  selected, _, key_width = memory._attention_dims(v4)
  assert selected == v4.sliding_window + v4.index_topk
  assert est(v4, 64)["deterministic attention slabs"] == 64 * selected * key_width * 4 * 1 < 1 << 30


def test_selection_working_memory_is_the_flash_topk_chunk_budget(monkeypatch):
  from hyscale_jax.ops.flash_topk.pallas import working_bytes  # noqa: PLC0415
  from pallas_kernels import _hopper  # noqa: PLC0415
  from pallas_kernels.flash_topk import Config  # noqa: PLC0415

  est = lambda cfg, T, **kw: memory.estimate_training_memory(cfg, batch_size=1, seq_len=T, param_count=10**9,
                                                             **kw).components["selection working memory"]
  bf16 = dataclasses.replace(_GLM_FULL, dtype="bfloat16")
  budget, mosaic_budget = Config().chunk_bytes, Config().mosaic_chunk_bytes
  # A short sequence holds every row's candidate buffers: 8 bytes a slot (4 x k slots, at most a
  # slot a key) and 4 a winner, k at most T.
  monkeypatch.setattr(_hopper, "on_hopper", lambda: False)
  assert est(bf16, 1024) == 1024 * (8 * 1024 + 4 * 1024)
  assert budget // 2 < est(bf16, 1 << 17) <= budget  # off Hopper the Triton pass, capped
  # Data shards: each device selects for its own batch rows (here one of two).
  assert memory.estimate_training_memory(bf16, batch_size=2, seq_len=1024, data_shards=2, param_count=10**9).components[
      "selection working memory"] == est(bf16, 1024)
  assert memory.estimate_training_memory(bf16, batch_size=2, seq_len=1024, param_count=10**9).components[
      "selection working memory"] == 2 * est(bf16, 1024)
  monkeypatch.setattr(_hopper, "on_hopper", lambda: True)
  assert mosaic_budget // 2 < est(bf16, 1 << 17) <= mosaic_budget  # from 32K keys, the Mosaic pass's mask
  assert budget // 2 < est(bf16, 1 << 14) <= budget
  # Each device chunks its own T / context queries over all T keys.
  assert est(bf16, 1 << 17, context_shards=4) == working_bytes(1, 1 << 15, 1 << 17, 32, 128, "bfloat16", 2048)
  # V4's CSA indexes T / 4 entries: the Mosaic pass only from 128K tokens.
  v4 = dataclasses.replace(ModelConfig.from_config(deepseek_v4_flash.get_config("full").model), dtype="bfloat16")
  assert est(v4, 1 << 16) <= budget < est(v4, 1 << 17) <= mosaic_budget
  window_only = dataclasses.replace(v4, compress_ratios=(0,) * v4.n_layers)  # no CSA layer: nothing selects
  assert est(window_only, 1 << 19) == 0


def test_selection_replay_saves_the_selection_of_indexer_layers_only():
  from configs import qwen3_8_flash_next  # noqa: PLC0415

  for get_config in (deepseek_v4_flash.get_config, qwen3_8_flash_next.get_config):
    cfg = ModelConfig.from_config(get_config("tiny").model)
    est = lambda policy: memory.estimate_training_memory(dataclasses.replace(cfg, remat_policy=policy),
                                                         batch_size=1, seq_len=1024, param_count=10**6)
    saved = {p: est(p).components["saved selection and attention"] for p in ("full", "selection_replay", "none")}
    assert saved["full"] == 0 < saved["selection_replay"] < saved["none"], saved
    assert est("full").components["one layer's transients"] > 0


def test_memory_check_smoke_runs_and_writes_json(tmp_path):
  """bench/memory_check.py --smoke: a child process per config, the table, the JSON (CPU: compiled figures)."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "memory_check.json"
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "bench/memory_check.py", "--smoke", "--only", "0", "--out", str(out),
                         "--data-dir", str(tmp_path / "data")], cwd=root, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  assert len(rows) == 1 and rows[0]["status"] == "ok", rows
  row = rows[0]
  assert row["measured_bytes"] > 0 and row["estimate_bytes"] > 0 and "ratio" in row
  assert row["measured_source"].startswith("compiled memory_analysis")  # CPU: no device memory stats
  assert all(abs(x) < 20 for x in row["losses"]) and "est GiB" in proc.stdout


def test_moe_ragged_dot_expansion_scales_with_experts_and_tokens_and_matches_the_h200():
  """Under ragged_dot the MoE term is E x R x (D, F) bytes (expanded to a dense masked dot off TPU).

  Calibration: the 2L-mid GLM-5.1 at 16K measured a 128.5 GiB peak on an H200 before the grouped
  kernel (0.213 GiB for the tiny config at 8 x 256); the estimate must stay within 25% of both.
  """
  mid = dict(vocab_size=32768, dtype="bfloat16", param_dtype="float32", n_layers=2, first_k_dense=1,
             n_routed_experts=16, moe_token_chunk=0)
  cfg = dataclasses.replace(_GLM_FULL, **mid)
  est = lambda c=cfg, T=16384, **kw: memory.estimate_training_memory(c, batch_size=1, seq_len=T,
                                                                     grouped_kernel=False, **kw)
  term = lambda e: e.components["MoE routed experts"]
  base = est()
  assert term(est(T=32768)) == 2 * term(base)
  assert term(est(dataclasses.replace(cfg, n_routed_experts=32))) == 2 * term(base)
  assert term(est(dataclasses.replace(cfg, first_k_dense=2))) == 0  # no MoE layer
  # Every remat policy runs the MoE backward: the term does not depend on it.
  assert term(est(dataclasses.replace(cfg, remat_policy="full"))) == term(base)
  assert abs(base.total / (128.5 * 2**30) - 1) < 0.25, base.describe()
  tiny = ModelConfig.from_config(glm5_1.get_config("tiny").model)
  small = memory.estimate_training_memory(tiny, batch_size=8, seq_len=256)
  assert abs(small.total / (0.213 * 2**30) - 1) < 0.25, small.describe()


def test_deepseek_v4_layer_transients_grow_linearly_with_the_length():
  """HCA (and CSA's warm-up) stream every visible entry through `causal_attention`: no per-token list of
  T / ratio indices, so one layer's transients per token stay flat from 64K to 1M tokens."""
  cfg = ModelConfig.from_config(deepseek_v4_flash.get_config("tiny").model)  # HCA at ratio 16, narrow layers
  assert "hca" in [cfg.layer_kind(i) for i in range(cfg.n_layers)]
  est = lambda T, policy: memory.estimate_training_memory(dataclasses.replace(cfg, remat_policy=policy), batch_size=1,
                                                          seq_len=T, param_count=10**6).components
  for policy, part in (("full", "one layer's transients"), ("selection_replay", "saved selection and attention")):
    per_token = {T: est(T, policy)[part] / T for T in (1 << 16, 1 << 20)}
    assert per_token[1 << 16] == pytest.approx(per_token[1 << 20], rel=1e-6), (policy, per_token)


def test_grouped_kernel_moe_term_is_one_token_chunk_without_the_expert_factor():
  cfg = dataclasses.replace(_GLM_FULL, n_layers=2, first_k_dense=1, dtype="bfloat16", moe_token_chunk=16384)
  est = lambda T, **kw: memory.estimate_training_memory(cfg, batch_size=1, seq_len=T, param_count=10**9,
                                                        **kw).components["MoE routed experts"]
  grouped, expanded = est(16384, grouped_kernel=True), est(16384, grouped_kernel=False)
  assert 0 < grouped < expanded / 100  # no [E, R, ...] copies: E = 256
  assert est(131072, grouped_kernel=True) == grouped  # one chunk of tokens, whatever T
  unchunked = dataclasses.replace(cfg, moe_token_chunk=0)
  assert memory.estimate_training_memory(unchunked, batch_size=1, seq_len=131072, param_count=10**9,
                                         grouped_kernel=True).components["MoE routed experts"] == 8 * grouped
  assert not memory.grouped_matmul_kernel_applies(cfg)  # CPU: the op runs ragged_dot


# Whole-model peaks of train.py on an H200 (bench/results/model_step.json, 2026-12-04): GLM-5.1 at
# real width, 2 layers (1 dense + 1 MoE of 64 routed experts), bf16 parameters, vocab 32768, AdamW.
# The 256K run predates the FFN chunk (its config had none); 512K ran with 32K query and FFN chunks
# (2026-12-04, third session); the 1M figure is what the allocator was asked for when that run ran
# out of memory (203.71 GiB of temporaries + the 19.19 GiB of parameters and moments), not a peak.
_GLM2_H200_PEAKS_GB = {("megatron_style", 65536, ()): 75.5, ("megatron_style", 131072, ()): 123.2,
                       ("hyscale", 65536, ()): 58.7, ("hyscale", 131072, ()): 87.2,
                       ("hyscale", 262144, (("ffn_token_chunk", 0),)): 113.0,
                       # The whole layer over sequence chunks (equal query and FFN chunks; the in-place
                       # layer_chunks loops, 2026-12-05, bench/memory_proxy.py --run): 512K and 1M.
                       ("hyscale", 524288, (("attention_query_chunk", 32768), ("ffn_token_chunk", 32768))): 75.3,
                       ("hyscale", 1048576, (("attention_query_chunk", 32768), ("ffn_token_chunk", 32768))): 100.3,
                       ("hyscale", 1048576, (("attention_query_chunk", 16384), ("ffn_token_chunk", 16384),
                                             ("moe_token_chunk", 8192))): 93.3}


def _glm2(mode: str, seq_len: int, overrides=()) -> ModelConfig:
  """train.py's GLM-5.1 2-layer model (bench/model_step.py's `glm2`) in step mode `mode`, with the
  model `overrides` (name, value) set over the mode's own."""
  from hyscale_jax.training import step_modes  # noqa: PLC0415

  config = glm5_1.get_config("full")
  config.model.update(n_layers=2, first_k_dense=1, vocab_size=32768, n_routed_experts=64, dtype="bfloat16",
                      param_dtype="bfloat16", **dict(overrides))
  config.data.update(vocab_size=32768, batch_size=1, seq_len=seq_len)
  config.step_mode = mode
  config = step_modes.apply(config)
  config.model.update(dict(overrides))  # the measured run's own chunks (0: off) over the mode's
  return lm.setup(config)[0]


@pytest.mark.parametrize("mode, seq_len, overrides", list(_GLM2_H200_PEAKS_GB))
def test_estimate_is_within_25_percent_of_the_whole_model_h200_peak(mode, seq_len, overrides):
  """The preflight on train.py's GLM-5.1 2-layer model, both remat policies, 64K-1M (query chunked past 128K)."""
  cfg = _glm2(mode, seq_len, overrides)
  estimate = memory.estimate_training_memory(cfg, batch_size=1, seq_len=seq_len, grouped_kernel=True)
  measured = _GLM2_H200_PEAKS_GB[mode, seq_len, overrides] * 1e9
  assert abs(estimate.total / measured - 1) < 0.25, estimate.describe()


def test_preflight_proposes_the_largest_sequence_chunk_that_fits(monkeypatch):
  """GLM-5.1's 2-layer model at 1M on a device that `hyscale`'s 128K chunks overflow: the knob is the
  whole layer over the largest power-of-two chunk whose estimate fits."""
  monkeypatch.setattr(memory, "grouped_matmul_kernel_applies", lambda cfg: True)  # the H200's MoE term
  cfg = _glm2("hyscale", 1 << 20)
  at = lambda chunk: memory.estimate_training_memory(
      dataclasses.replace(cfg, attention_query_chunk=chunk, ffn_token_chunk=chunk), batch_size=1, seq_len=1 << 20).total
  assert cfg.layer_chunk(1 << 20) == 1 << 17 and at(1 << 17) > at(1 << 16) > at(1 << 15)
  available = at(1 << 15)  # 32K chunks fit, 64K do not
  assert memory.MEASURED_OVER_ESTIMATE[0] * at(1 << 17) > available  # beyond the estimate's error: refused
  with pytest.raises(MemoryError) as info:
    memory.preflight(cfg, batch_size=1, seq_len=1 << 20, mesh_shape={}, available=available)
  text = str(info.value)
  assert "--config.model.attention_query_chunk=32768 --config.model.ffn_token_chunk=32768" in text, text
  assert f"{at(1 << 15) / 2**30:.2f} GiB" in text, text


def test_preflight_warns_within_the_estimates_measured_error_and_refuses_beyond(caplog):
  """An estimate a little over the device runs with a warning (peaks have come in under it); only one that
  would not fit even at the lowest measured peak / estimate ratio is refused."""
  cfg = ModelConfig.from_config(glm5_1.get_config("tiny").model)
  need = memory.estimate_training_memory(cfg, batch_size=8, seq_len=1 << 12).total
  low, high = memory.MEASURED_OVER_ESTIMATE
  assert 0 < low < 1 < high
  run = lambda available: memory.preflight(cfg, batch_size=8, seq_len=1 << 12, mesh_shape={}, available=available)
  with caplog.at_level("WARNING"):
    assert run(int(need * (low + 1) / 2)).total == need  # over the device, within the error: runs
  assert "within the estimate's measured error" in caplog.text
  with pytest.raises(MemoryError, match="per device"):
    run(int(need * low * 0.99))
