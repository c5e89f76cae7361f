"""The fine-tune path's pieces: the imported config, `init_from` on every mesh and source, export's tokenizer and
errors. The path itself, as the README writes it, runs in tests/test_readme_commands.py."""

import codecs
import contextlib
import importlib.util
import io
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import glm5_1
from hyscale_jax import convert, workdir_export
from hyscale_jax import sharding as shd
from hyscale_jax.convert import __main__ as cli
from hyscale_jax.convert import hf_config
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.training import lm, run_config, text_data

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
# Per fixture, fields of the other architectures that its config must not carry.
_FOREIGN_FIELDS = {
    "glm_moe_dsa": {"compress_ratios", "o_groups", "sliding_window", "hc_mult", "layer_types", "n_kv_heads",
                    "linear_n_key_heads", "ple_layer_ids", "qsa_block"},
    "deepseek_v4_yarn_hash": {"kv_lora_rank", "qk_nope_dim", "v_head_dim", "index_topk_freq", "layer_types",
                              "n_kv_heads", "linear_n_key_heads", "qsa_block"},
    "qwen4_exp_engram": {"kv_lora_rank", "qk_nope_dim", "compress_ratios", "o_groups", "sliding_window",
                         "index_topk_freq", "n_hash_layers"},
}


def _import(fixture: str, out: pathlib.Path):
  """`python -m hyscale_jax.convert import`, in this process; returns the written config.py as a module."""
  assert cli.main(["import", str(FIXTURES / fixture), str(out)]) == 0
  spec = importlib.util.spec_from_file_location(f"imported_{fixture}", out / "config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _flat_params(model) -> dict:
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, convert.CHECKPOINT_VARIABLES))}


@pytest.mark.parametrize("fixture", sorted(_FOREIGN_FIELDS))
def test_imported_config_lists_only_the_architecture_fields(fixture, tmp_path):
  module = _import(fixture, tmp_path / "out")
  config = module.get_config()
  imported = convert.read_config(str(FIXTURES / fixture))
  assert set(module.MODEL) == {*hf_config.checkpoint_fields(imported), "param_dtype"}
  assert not _FOREIGN_FIELDS[fixture] & (set(module.MODEL) | set(config.model))
  # The fields left out are ModelConfig's defaults, and the imported config.json rides along for export.
  assert ModelConfig.from_config(config.model) == imported
  assert config.init_from == config.data.tokenizer == str(tmp_path / "out")
  assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (FIXTURES / fixture / "tokenizer.json").read_bytes()


def test_init_from_on_an_fsdp_mesh_and_a_token_file(tmp_path):
  config = _import("glm_moe_dsa", tmp_path / "out").get_config()
  config.mesh.fsdp = 2
  config.data.update(source="tokens", path=str(tmp_path / "corpus.npy"), seq_len=32, batch_size=2)
  config.train.update(steps=1, warmup_steps=1, progress_bar=False)
  # Both folders load under train.py's mesh and rules (ours once failed: P('fsdp', 'fsdp') for q_a_proj).
  cfg, mesh = lm.setup(config)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(shd.rules_from_config(config.mesh)):
    for folder in (tmp_path / "out", FIXTURES / "glm_moe_dsa"):
      convert.load_pretrained(str(folder), cfg, sharding=NamedSharding(mesh, P()))
  tokens = np.random.default_rng(0).integers(2, cfg.vocab_size, 3200).astype(np.uint16)
  np.save(tmp_path / "corpus.npy", tokens)
  np.save(tmp_path / "corpus.offsets.npy", np.arange(0, 3201, 80, dtype=np.int64))
  rows = lm.train_and_evaluate(config, str(tmp_path / "run"))
  assert rows[-1]["step"] == 1 and np.isfinite(rows[-1]["lm_loss"])


def _zen_corpus(path: pathlib.Path) -> pathlib.Path:
  """A JSONL of the text the fixtures' tokenizer was trained on (tests/fixtures/make_hf_fixtures.py)."""
  with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
    import this
  lines = [line for line in codecs.decode(this.s, "rot13").splitlines() if line]
  docs = [" ".join(lines[(i + j) % len(lines)] for j in range(3)) for i in range(60)]
  path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
  return path


def _run(*args) -> str:
  result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_export_of_a_folder_without_a_model_is_one_line_and_status_2(tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  run_config.save(glm5_1.get_config("tiny"), str(tmp_path / "fresh"))  # what train.py writes before step 1
  expected = {"empty": "is neither a train.py workdir", "fresh": "holds no checkpoint"}
  for folder, message in expected.items():
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / folder), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
  assert not (tmp_path / "hf").exists()


def test_export_carries_the_bundled_corpus_tokenizer(tmp_path):
  data = glm5_1.get_config("tiny").data
  data.update(source="pydoc", vocab_size=512, cache_dir=str(tmp_path / "data"))
  assert workdir_export.write_tokenizer(data, str(tmp_path / "hf"))
  tokenizer = text_data.build_or_load_cache("pydoc", 512, tmp_path / "data")[0]
  assert (tmp_path / "hf" / "tokenizer.json").read_text() == tokenizer.to_str()
  assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["eos_token"] == text_data.EOS_TOKEN
  data.update(source="tokens", path=str(tmp_path / "corpus.npy"))  # token ids without a tokenizer: none travels
  assert not workdir_export.write_tokenizer(data, str(tmp_path / "none")) and not (tmp_path / "none").exists()
