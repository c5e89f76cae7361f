"""`python -m hyscale_jax.generate`: text through the run's tokenizer, cached decoding with the uncached
decoder's greedy tokens, sampling, the fallback without a cache, and the user errors."""

import json
import os

import numpy as np
import pytest

from hyscale_jax import generate, models
from hyscale_jax.models import kv_cache
from hyscale_jax.models.generate import Sampling
from hyscale_jax.training import file_data, lm, run_config
from tests.tiny_glm_run import STEPS, run_command, trained_workdir

PROMPT = "The return value of the function"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return trained_workdir(tmp_path_factory)


@pytest.fixture(scope="module")
def run(workdir):
  """(config, the restored model, the run's validation split: tokenizer and EOS id)."""
  config = run_config.load(str(workdir))
  model, _ = lm.restore_model(config, str(workdir))
  dataset = file_data.open_dataset(config.data, model_vocab_size=config.model.vocab_size, seed=config.train.seed,
                                   split="validation")
  return config, model, dataset


def _main(capsys, *args):
  """`generate.main(args)` in this process: (exit status, stdout, stderr)."""
  with pytest.raises(SystemExit) as exit_:
    generate.main(list(args))
  out, err = capsys.readouterr()
  return exit_.value.code, out, err


def test_greedy_text_is_the_uncached_decoders(workdir, run, tmp_path):
  # 6 prompt tokens + 72 new ones > index_topk 64: the last tokens attend over sparse selections. The
  # decoders round differently (one row's matmuls against T rows'), so a near-tied top-k or expert
  # choice could part them on other hardware; on this CPU the first such tie comes after ~140 tokens.
  out_file = tmp_path / "out.json"
  result = run_command("hyscale_jax.generate", f"--workdir={workdir}", f"--prompt={PROMPT}", "--greedy",
                       "--max_new_tokens=72", "--ignore_eos", f"--out={out_file}")
  assert result.returncode == 0, result.stderr[-3000:]
  err = result.stderr.splitlines()
  assert err[0].startswith(f"loaded glm_moe_dsa step {STEPS} from {workdir}: ")
  assert err[-1].startswith("72 new tokens in ") and "(greedy, KV cache)" in err[-1]
  record = json.loads(out_file.read_text())
  config, model, dataset = run
  assert record["prompt_ids"] == dataset.tokenizer.encode(PROMPT, add_special_tokens=False).ids
  assert len(record["ids"]) == 72 and record["kv_cache"] and record["sampling"] is None
  assert record["text"] == dataset.tokenizer.decode(record["ids"]) and result.stdout == PROMPT + record["text"] + "\n"
  uncached = models.generate(model, np.asarray([record["prompt_ids"]]), 72, backends=config.ops)
  np.testing.assert_array_equal(np.asarray(uncached)[0, len(record["prompt_ids"]):], record["ids"])


def test_sampling_follows_the_seed_and_stops_at_eos(workdir, run, tmp_path, capsys):
  out_file = tmp_path / "out.json"
  status, out, err = _main(capsys, f"--workdir={workdir}", f"--prompt={PROMPT}", "--max_new_tokens=24", "--seed=5",
                           f"--out={out_file}")
  assert status == 0, err
  record = json.loads(out_file.read_text())
  assert record["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.95} and record["seed"] == 5
  config, model, dataset = run
  expected = kv_cache.generate(model, np.asarray([record["prompt_ids"]]), 24, backends=config.ops,
                               sampling=Sampling(0.8, 40, 0.95), seed=5)
  expected = np.asarray(expected)[0, len(record["prompt_ids"]):].tolist()
  if dataset.eos_id in expected:
    expected = expected[:expected.index(dataset.eos_id)]
  assert record["ids"] == expected and out == PROMPT + dataset.tokenizer.decode(expected) + "\n"


def test_a_model_without_a_cache_decodes_without_one(workdir, run, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(kv_cache, "unsupported_reason", lambda model: "pretend it is another architecture")
  out_file = tmp_path / "out.json"
  status, _, err = _main(capsys, f"--workdir={workdir}", f"--prompt={PROMPT}", "--greedy", "--max_new_tokens=8",
                         "--ignore_eos", f"--out={out_file}")
  assert status == 0, err
  assert "note: no KV cache (pretend it is another architecture)" in err and "no KV cache)" in err
  record = json.loads(out_file.read_text())
  config, model, _ = run
  monkeypatch.undo()
  cached = kv_cache.generate(model, np.asarray([record["prompt_ids"]]), 8, backends=config.ops)
  assert not record["kv_cache"] and record["ids"] == np.asarray(cached)[0, len(record["prompt_ids"]):].tolist()


def _without_tokenizer(workdir, folder):
  """A workdir whose run read token ids without a tokenizer (data.source "tokens"), sharing `workdir`'s checkpoints."""
  np.save(folder / "ids.npy", np.arange(200, dtype=np.uint16) % 100)
  np.save(folder / "ids.offsets.npy", np.asarray([0, 100, 200], np.int64))
  config = run_config.load(str(workdir))
  config.data.update(source="tokens", path=str(folder / "ids.npy"), eos_id=0)
  run_config.save(config, str(folder))
  os.symlink(workdir / "checkpoints", folder / "checkpoints")
  return folder


@pytest.mark.parametrize("args, message", [
    (lambda w, t: [f"--workdir={t / 'missing'}", "--prompt=hi"], "does not exist"),
    (lambda w, t: [f"--workdir={w}", "--prompt=hi", "--step=9"], "--step=9: workdir"),
    (lambda w, t: [f"--workdir={w}", "--prompt="], "--prompt is empty"),
    (lambda w, t: [f"--workdir={w}", "--prompt=hi", "--temperature=-1"], "--temperature=-1.0 must be >= 0"),
    (lambda w, t: [f"--workdir={w}", "--prompt=hi", "--top_p=0"], "--top_p=0.0 must lie in (0, 1]"),
    (lambda w, t: [f"--workdir={w}", "--prompt=hi", "--top_k=-3"], "--top_k=-3 must be an int >= 0"),
    (lambda w, t: [f"--workdir={w}", "--prompt=hi", "--max_new_tokens=0"], "--max_new_tokens=0 must be >= 1"),
    (lambda w, t: [f"--workdir={w}", "--prompt=hi", "--temperature=hot"], "invalid float value: 'hot'"),
    (lambda w, t: [f"--workdir={w}"], "the following arguments are required: --prompt"),
    (lambda w, t: [f"--workdir={_without_tokenizer(w, t)}", "--prompt=hi"], "has no tokenizer"),
], ids=["no_workdir", "bad_step", "empty_prompt", "negative_temperature", "zero_top_p", "negative_top_k",
        "no_new_tokens", "temperature_not_float", "no_prompt", "no_tokenizer"])
def test_user_errors_are_one_line_and_status_2(workdir, tmp_path, capsys, args, message):
  status, _, err = _main(capsys, *args(workdir, tmp_path))
  assert status == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_a_user_error_from_the_command_line(workdir):
  result = run_command("hyscale_jax.generate", f"--workdir={workdir}", "--prompt=", timeout=120)
  assert result.returncode == 2
  assert result.stderr == "error: --prompt is empty: give the text to continue.\n"


def test_help_names_every_flag(capsys):
  status, out, _ = _main(capsys, "--help")
  assert status == 0
  for flag in ("--workdir", "--step", "--prompt", "--max_new_tokens", "--temperature", "--top_k", "--top_p",
               "--greedy", "--seed", "--ignore_eos", "--no_kv_cache", "--out", "--traceback"):
    assert flag in out
