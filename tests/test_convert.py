"""Hugging Face interop: parity with transformers on committed fixtures, round trips, errors, streaming."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from configs import glm5_1
from hyscale_jax import convert, models, ops
from hyscale_jax.convert.safetensors_dir import CheckpointReader
from hyscale_jax.layers.qsa import expand_blocks
from hyscale_jax.model_config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def _run_with_selections(model, tokens, monkeypatch):
  """Logits and each indexer layer's `flash_topk` indices, in call (layer) order; eager, no remat."""
  selections = []
  real = ops.flash_topk

  def recording(*args, **kwargs):
    out = real(*args, **kwargs)
    selection = out[0] if kwargs.get("with_stats") else out  # the layers ask for the rescued rows too
    selections.append(np.asarray(selection.indices))
    return out

  monkeypatch.setattr(ops, "flash_topk", recording)
  return np.asarray(model(jnp.asarray(tokens)).logits), selections


def _relative_error(ours, reference):
  return float(np.abs(ours - reference).max() / np.abs(reference).max())


# Per fixture: the layers whose selection transformers exposes, and the selection as one set per
# (batch, query), for transformers' output and for ours (`flash_topk` indices).
def _glm_layers(cfg):
  return [i for i in range(cfg.n_layers) if cfg.has_indexer(i)]


def _v4_layers(cfg):
  return [i for i in range(cfg.n_layers) if cfg.layer_kind(i) == "csa"]


def _qwen_layers(cfg):
  return [i for i, kind in enumerate(cfg.layer_types) if kind == "qsa"]


def _index_sets(indices, keep):
  """{(b, t): set of the indices i of indices[b, t] with keep(i, t)} for i32[B, T, K]."""
  return {(b, t): {int(i) for i in indices[b, t] if keep(i, t)} for b, t in np.ndindex(indices.shape[:2])}


def _glm_sets(ours, theirs, cfg):
  # transformers pads early queries with future positions; ours pads with -1.
  return _index_sets(ours, lambda i, t: i >= 0), _index_sets(theirs, lambda i, t: i <= t)


def _v4_sets(ours, theirs, cfg):
  # Both are indices into the compressed entries, -1 = invalid.
  return _index_sets(ours, lambda i, t: i >= 0), _index_sets(theirs, lambda i, t: i >= 0)


def _qwen_sets(ours, theirs, cfg):
  # transformers gives a boolean token mask [B, 1, T, T]; ours selects blocks, which expand to their
  # tokens plus the query's partial-block tail.
  tokens = np.asarray(expand_blocks(jnp.asarray(ours), jnp.zeros(ours.shape[:2], jnp.int32), cfg.qsa_block))
  theirs_sets = {(b, t): {int(s) for s in np.flatnonzero(theirs[b, 0, t])} for b, t in np.ndindex(ours.shape[:2])}
  return _index_sets(tokens, lambda i, t: i >= 0), theirs_sets


_PARITY = {"glm_moe_dsa": (_glm_layers, _glm_sets), "deepseek_v4": (_v4_layers, _v4_sets),
           "qwen4_exp": (_qwen_layers, _qwen_sets), "qwen4_exp_gdn": (_qwen_layers, _qwen_sets),
           "qwen4_exp_engram": (_qwen_layers, _qwen_sets),
           "glm_moe_dsa_yarn": (_glm_layers, _glm_sets), "deepseek_v4_yarn_hash": (_v4_layers, _v4_sets)}


@pytest.mark.parametrize("model_type", sorted(_PARITY))
def test_matches_transformers(model_type, monkeypatch):
  selecting_layers, selection_sets = _PARITY[model_type]
  model = convert.import_checkpoint(str(FIXTURES / model_type), remat_policy="none")
  outputs = load_file(str(FIXTURES / model_type / "outputs.safetensors"))
  logits, selections = _run_with_selections(model, outputs["input_ids"], monkeypatch)
  assert _relative_error(logits, outputs["logits"]) < 1e-5
  layers = sorted(int(k.split(".")[1]) for k in outputs if k.startswith("selection."))
  assert layers == selecting_layers(model.cfg) and len(selections) == len(layers)
  for layer, ours in zip(layers, selections):
    assert ours.shape[:2] == outputs["input_ids"].shape
    ours_sets, theirs_sets = selection_sets(ours, outputs[f"selection.{layer}"], model.cfg)
    for key, expected in theirs_sets.items():
      assert ours_sets[key] == expected, (layer, key)


def test_hyper_connections_are_refused_for_glm():
  with pytest.raises(ValueError, match="glm_moe_dsa has no hyper-connections"):
    ModelConfig(hc_mult=2)


def _flat_arrays(model):
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, convert.CHECKPOINT_VARIABLES))}


@pytest.mark.parametrize("model_type", sorted(_PARITY))
def test_export_then_import_is_bit_for_bit(model_type, tmp_path):
  source = FIXTURES / model_type
  model = convert.import_checkpoint(str(source))
  convert.export_checkpoint(model, str(tmp_path), max_shard_bytes=100_000)
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  again = convert.import_checkpoint(str(tmp_path))
  assert again.cfg == model.cfg
  first, second = _flat_arrays(model), _flat_arrays(again)
  assert first.keys() == second.keys()
  for path in first:
    assert first[path].dtype == second[path].dtype and np.array_equal(first[path], second[path]), path
  # The exported tensors are transformers' own, bit for bit.
  original, exported = CheckpointReader(str(source)), CheckpointReader(str(tmp_path))
  assert original.names() == exported.names()
  for name in sorted(original.names()):
    assert np.array_equal(original.read(name), exported.read(name)), name


def _copy_with_index_edit(source, target, edit):
  shutil.copytree(source, target)
  index_path = target / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  edit(index["weight_map"])
  index_path.write_text(json.dumps(index))


def _copy_with_config(source, target, **changes) -> pathlib.Path:
  """A copy of the checkpoint folder `source` at `target` whose config.json has `changes`."""
  shutil.copytree(source, target)
  config_path = target / "config.json"
  config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
  return target


def test_missing_and_unknown_tensors_are_listed(tmp_path):
  def edit(weight_map):
    shard = weight_map.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    weight_map["model.layers.1.mlp.extra_bias"] = shard

  _copy_with_index_edit(FIXTURES / "glm_moe_dsa", tmp_path / "ckpt", edit)
  with pytest.raises(convert.CheckpointMismatchError) as error:
    convert.import_checkpoint(str(tmp_path / "ckpt"))
  assert "model.layers.1.mlp.experts.3.up_proj.weight" in str(error.value)
  assert "model.layers.1.mlp.extra_bias" in str(error.value)
  assert "1 missing" in str(error.value) and "1 unknown" in str(error.value)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
  ckpt = _copy_with_config(FIXTURES / "glm_moe_dsa", tmp_path / "ckpt", vocab_size=100)
  with pytest.raises(convert.CheckpointMismatchError, match=r"model.embed_tokens.weight.*\(96, 48\).*\(100, 48\)"):
    convert.import_checkpoint(str(ckpt))


def test_one_expert_of_the_wrong_shape_is_named(tmp_path):
  shutil.copytree(FIXTURES / "glm_moe_dsa", tmp_path / "ckpt")
  name = "model.layers.1.mlp.experts.2.up_proj.weight"
  shard = tmp_path / "ckpt" / CheckpointReader(str(tmp_path / "ckpt")).weight_map[name]
  tensors = load_file(str(shard))
  tensors[name] = tensors[name][:-1]
  save_file(tensors, str(shard), metadata={"format": "pt"})
  with pytest.raises(convert.CheckpointMismatchError, match=r"experts\.0\.up_proj.*stack.*expert 2 has shape"):
    convert.import_checkpoint(str(tmp_path / "ckpt"))


# Every fixture, the MTP ones (tests/test_mtp.py) included.
_ALL_FIXTURES = sorted(path.name for path in FIXTURES.iterdir() if (path / "config.json").exists())


@pytest.mark.parametrize("model_type", _ALL_FIXTURES)
def test_exported_config_json_is_the_imported_one(model_type, tmp_path):
  original = json.loads((FIXTURES / model_type / "config.json").read_text())
  model = convert.import_checkpoint(str(FIXTURES / model_type))
  convert.save_native(model, str(tmp_path / "ours"))  # the original config travels through our own folder too
  convert.export_checkpoint(convert.load_native(str(tmp_path / "ours")), str(tmp_path / "hf"))
  assert json.loads((tmp_path / "hf" / "config.json").read_text()) == original


@pytest.mark.parametrize("model_type", _ALL_FIXTURES)
def test_config_of_a_model_not_imported_is_complete(model_type):
  original = json.loads((FIXTURES / model_type / "config.json").read_text())
  cfg = dataclasses.replace(convert.read_config(str(FIXTURES / model_type)), hf_config="")
  exported = convert.to_hf(cfg)
  # Every field transformers writes, at transformers' defaults where the model does not fix it.
  assert set(exported) == set(original) - {"transformers_version"}
  ours = convert.from_hf(exported)
  assert dataclasses.replace(ours, hf_config="") == cfg


def test_unsupported_fields_are_one_line_naming_all_before_any_tensor(tmp_path):
  config = json.loads((FIXTURES / "qwen4_exp" / "config.json").read_text())
  config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "yarn", "factor": 4.0}
  config["indexer_kv_heads"] = 2
  (tmp_path / "ckpt").mkdir()  # config.json alone: reading any tensor would fail differently
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  result = subprocess.run([sys.executable, "-m", "hyscale_jax.convert", "import", str(tmp_path / "ckpt"),
                           str(tmp_path / "ours")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
  assert lines[0].startswith("error: qwen4_exp_text: ")
  assert "rope_parameters.rope_type='yarn'" in lines[0] and "indexer_kv_heads=2" in lines[0]
  assert not (tmp_path / "ours").exists()


def test_hash_constants_that_differ_from_the_config_are_refused(tmp_path):
  ckpt = _copy_with_config(FIXTURES / "qwen4_exp_engram", tmp_path / "ckpt", seed=4321)
  with pytest.raises(convert.CheckpointMismatchError, match=r"layers.1.ple.ple_embedding.layer_multipliers holds"):
    convert.import_checkpoint(str(ckpt))


def test_unsupported_config_value_is_named(tmp_path):
  shutil.copytree(FIXTURES / "glm_moe_dsa", tmp_path / "ckpt")
  config_path = tmp_path / "ckpt" / "config.json"
  config = json.loads(config_path.read_text())
  config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
  config_path.write_text(json.dumps(config))
  with pytest.raises(convert.UnsupportedConfigError, match="rope_type='longrope'"):
    convert.import_checkpoint(str(tmp_path / "ckpt"))


def test_import_places_each_array_with_its_sharding():
  mesh = jax.make_mesh((8,), ("fsdp",))
  split_rows = lambda path, shape: jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("fsdp") if shape and shape[0] % 8 == 0 else jax.sharding.PartitionSpec())
  model = convert.import_checkpoint(str(FIXTURES / "glm_moe_dsa"), sharding=split_rows)
  embedding = model.embed_tokens.embedding[...]  # [96, 48]: 12 rows per device
  assert embedding.sharding.spec == jax.sharding.PartitionSpec("fsdp")
  assert {shard.data.shape for shard in embedding.addressable_shards} == {(12, 48)}


def _mid_size_config() -> ModelConfig:
  """A GLM of about 60M parameters (240 MB in f32); its largest array is 16 MB."""
  return ModelConfig(vocab_size=8192, d_model=512, n_layers=4, first_k_dense=1, dense_inter=1024, n_heads=8,
                     q_lora_rank=256, kv_lora_rank=128, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=64,
                     n_routed_experts=16, experts_per_token=2, moe_inter=512, index_n_heads=16,
                     index_head_dim=32, index_rope_dim=16, index_topk=16, rope_theta=10000.0)


def test_import_streams_one_tensor_at_a_time(tmp_path):
  cfg = _mid_size_config()
  convert.export_checkpoint(models.build(cfg, rngs=nnx.Rngs(0)), str(tmp_path), max_shard_bytes=64 << 20)
  total = sum(os.path.getsize(p) for p in tmp_path.glob("model-*.safetensors"))
  largest_array = 16 * 512 * 512 * 4  # one stacked expert projection [E, D, F] in f32
  abstract = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
  # A first load outside the window: lazy imports and trace caches are Python allocations that
  # tracemalloc would count as staged (they tipped the bound with unrelated code changes).
  convert.load_weights(nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))), str(tmp_path))
  tracemalloc.start()
  try:
    convert.load_weights(abstract, str(tmp_path))
    placed, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  # On CPU the placed arrays may alias host buffers (they are `placed`, at most the model). What is
  # staged on top of them peaks at one array and its sources (2x for a transposed one, one expert
  # beside a stack), never the whole model.
  staged = peak - placed
  assert total > 200 << 20 and placed <= total
  assert largest_array <= staged < 3 * largest_array < total / 4, (staged, placed, total)


def test_cli_import_then_export_round_trips(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  run = lambda *args: subprocess.run([sys.executable, "-m", "hyscale_jax.convert", *args], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=300)
  imported = run("import", str(FIXTURES / "glm_moe_dsa"), str(tmp_path / "ours"))
  assert imported.returncode == 0, imported.stderr[-3000:]
  # One line with the train command; the model settings are in the config.py it names (tests/test_finetune.py).
  assert len(imported.stdout.splitlines()) == 1 and f"--config={tmp_path / 'ours'}/config.py" in imported.stdout
  assert "    index_topk_freq=2,\n" in (tmp_path / "ours" / "config.py").read_text()
  exported = run("export", str(tmp_path / "ours"), str(tmp_path / "hf"))
  assert exported.returncode == 0, exported.stderr[-3000:]
  original, back = CheckpointReader(str(FIXTURES / "glm_moe_dsa")), CheckpointReader(str(tmp_path / "hf"))
  assert original.names() == back.names()
  assert all(np.array_equal(original.read(n), back.read(n)) for n in original.names())
  for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer travels through our folder
    assert (tmp_path / "hf" / name).read_bytes() == (FIXTURES / "glm_moe_dsa" / name).read_bytes(), name


# CI time: tests/test_readme_commands.py's Hugging Face chain imports and fine-tunes as well.
@pytest.mark.slow
def test_train_starts_from_imported_weights(tmp_path):
  cfg = ModelConfig.from_config(glm5_1.get_config("tiny").model)
  source = models.build(cfg, rngs=nnx.Rngs(7))
  convert.export_checkpoint(source, str(tmp_path / "hf"))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # One warm-up step: only the indexer learns, so every other parameter must still be the imported one.
  cmd = [sys.executable, "train.py", "--config=configs/glm5_1.py:tiny", f"--workdir={tmp_path / 'run'}",
         f"--config.init_from={tmp_path / 'hf'}", "--config.train.steps=1", "--config.train.warmup_steps=1",
         "--config.data.seq_len=64", "--config.data.batch_size=2", "--config.train.progress_bar=false",
         "--config.train.memory_preflight=false"]
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  import orbax.checkpoint as ocp  # noqa: PLC0415
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.restore(str(tmp_path / "run" / "checkpoints" / "1" / "state"))["params"]
  expected = nnx.to_pure_dict(nnx.state(source, nnx.Param))
  # train.py stores each scanned group of layers stacked (training/layer_stacks.py): layer 1 is row r
  # of its group's stack.
  (group, row), = [(g, r) for g, layers in enumerate(source.scanned_layer_groups()) for r, i in enumerate(layers)
                   if i == 1]
  saved_moe, expected_moe = saved["layer_stacks"][str(group)]["mlp"], expected["layers"][1]["mlp"]
  for name in ("experts_up_proj", "gate"):  # orbax keeps each NNX variable as {"value": array}
    saved_leaf = saved_moe[name]["value"] if name.startswith("experts") else saved_moe[name]["kernel"]["value"]
    expected_leaf = expected_moe[name] if name.startswith("experts") else expected_moe[name]["kernel"]
    assert np.array_equal(saved_leaf[row], np.asarray(expected_leaf)), name


def test_init_from_refuses_a_different_model(tmp_path):
  cfg = ModelConfig.from_config(glm5_1.get_config("tiny").model)
  with pytest.raises(ValueError, match="vocab_size: checkpoint 96 vs config 2048"):
    convert.load_pretrained(str(FIXTURES / "glm_moe_dsa"), cfg)


def test_yarn_and_hash_routing_fixtures_are_within_1e_5_and_use_their_features():
  # The YaRN and hash-routing fixtures: logits within 1e-5 relative (the parity test's bound is looser
  # for the older fixtures), and YaRN really matters: without it the logits are off.
  for name in ("glm_moe_dsa_yarn", "deepseek_v4_yarn_hash"):
    outputs = load_file(str(FIXTURES / name / "outputs.safetensors"))
    error = lambda model: _relative_error(np.asarray(model(jnp.asarray(outputs["input_ids"])).logits),
                                          outputs["logits"])
    assert error(convert.import_checkpoint(str(FIXTURES / name), remat_policy="none", rope_yarn_factor=0.0)) > 1e-3
    model = convert.import_checkpoint(str(FIXTURES / name), remat_policy="none")
    assert error(model) < 1e-5 and model.cfg.rope_yarn_factor > 1
  assert model.cfg.n_hash_layers == 2 and model.cfg.rope_yarn_attention_factor == 1.0
  table = np.asarray(model.layers[0].mlp.tid2eid[...])
  hf_table = CheckpointReader(str(FIXTURES / "deepseek_v4_yarn_hash")).read("model.layers.0.ffn.gate.tid2eid")
  assert table.dtype == np.int32 and np.array_equal(table, hf_table) and len(np.unique(table)) > 1


def test_deepseek_v4_config_forms_read_as_transformers_reads_them():
  base = json.loads((FIXTURES / "deepseek_v4_yarn_hash" / "config.json").read_text())
  edited = lambda **changes: {**json.loads(json.dumps(base)), **changes}
  without_types = edited()
  del without_types["mlp_layer_types"]
  assert convert.from_hf(without_types).n_hash_layers == 3  # transformers' default
  assert convert.from_hf({**without_types, "num_hash_layers": 1}).n_hash_layers == 1
  with pytest.raises(convert.UnsupportedConfigError, match=r"mlp_layer_types=\['moe', 'hash_moe'"):
    convert.from_hf(edited(mlp_layer_types=["moe", "hash_moe", "moe", "moe"]))
  # The published form: a flat (legacy) rope_scaling is the compressed layers' YaRN, attention factor 1.
  flat = edited(rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                              "beta_fast": 32, "beta_slow": 1})
  del flat["rope_parameters"]
  cfg = convert.from_hf(flat)
  assert (cfg.rope_yarn_factor, cfg.rope_yarn_attention_factor, cfg.compress_rope_theta) == (16.0, 1.0, 160000.0)
  nested = edited()
  del nested["rope_parameters"]["compress"]["attention_factor"]  # transformers then derives 0.1 ln 16 + 1
  assert convert.from_hf(nested).rope_yarn_attention_factor == 0.0
  nested["rope_parameters"]["main"]["rope_type"] = "yarn"
  with pytest.raises(convert.UnsupportedConfigError, match="rope_parameters.main.rope_type='yarn'"):
    convert.from_hf(nested)
  # The YaRN and hash-routing checks join the others in one error naming every field.
  both = edited(mlp_layer_types=["moe", "hash_moe", "moe", "moe"], num_key_value_heads=2)
  both["rope_parameters"]["compress"]["rope_type"] = "longrope"
  with pytest.raises(convert.UnsupportedConfigError, match=r"^deepseek_v4: mlp_layer_types=.*; num_key_value_heads=2 "
                     r".*; rope_parameters.compress.rope_type='longrope' [^;]*$"):
    convert.from_hf(both)
