"""`python -m hyscale_jax.evaluate`: a run's validation loss, perplexity and loss by position, and its user errors."""

import json
import math
import shutil

import numpy as np
import pytest

from hyscale_jax import evaluate
from hyscale_jax.training import file_data, lm, run_config
from tests.tiny_glm_run import STEPS, run_command, trained_workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return trained_workdir(tmp_path_factory)


def _reference_loss(workdir, batches):
  """The mean of `model.lm_loss` (train.py's loss) over the first `batches` validation batches, by token."""
  config = run_config.load(str(workdir))
  model, _ = lm.restore_model(config, str(workdir))
  dataset = file_data.open_dataset(config.data, model_vocab_size=config.model.vocab_size, seed=config.train.seed,
                                   split="validation")
  total, count = 0.0, 0.0
  for b in range(batches):
    batch = dataset.batch(b)
    h, _ = model.hidden_states(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                               backends=config.ops)
    n = float(batch["loss_mask"].sum())
    total += float(model.lm_loss(h, batch["targets"], batch["loss_mask"])) * n
    count += n
  return total / count


def test_command_prints_and_writes_the_loss_by_position(workdir):
  result = run_command("hyscale_jax.evaluate", f"--workdir={workdir}", "--batches=2")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith(f"loaded glm_moe_dsa step {STEPS} from {workdir}: ") and "parameters" in lines[0]
  assert lines[1].startswith("validation loss ") and lines[2].split() == ["positions", "tokens", "loss", "perplexity"]
  assert [line.split()[:2] for line in lines[3:5]] == [["[0,", "16)"], ["[16,", "64)"]]
  assert lines[-1] == f"wrote {workdir / f'eval_step{STEPS}.json'}"

  saved = json.loads((workdir / f"eval_step{STEPS}.json").read_text())
  assert (saved["step"], saved["batches"], saved["attention"]) == (STEPS, 2, "sparse")
  np.testing.assert_allclose(saved["loss"], _reference_loss(workdir, 2), rtol=1e-5)
  assert math.isfinite(saved["loss"]) and saved["perplexity"] == pytest.approx(math.exp(saved["loss"]))
  buckets = saved["buckets"]
  assert [b["positions"] for b in buckets] == [[0, 16], [16, 64]]  # contiguous, all of [0, seq_len)
  assert sum(b["tokens"] for b in buckets) == saved["tokens"] > 0
  by_token = sum(b["loss"] * b["tokens"] for b in buckets) / saved["tokens"]
  assert by_token == pytest.approx(saved["loss"], rel=1e-9)
  assert all(b["perplexity"] == pytest.approx(math.exp(b["loss"])) for b in buckets)


def test_one_batch_is_trains_val_loss_and_older_steps_load(workdir, tmp_path):
  logged = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
  latest = evaluate.evaluate_workdir(str(workdir), batches=1)
  assert latest["step"] == logged["step"] == STEPS
  np.testing.assert_allclose(latest["loss"], logged["val_lm_loss"], rtol=1e-5)
  older = evaluate.evaluate_workdir(str(workdir), step=2, batches=1, dense=True)
  assert (older["step"], older["attention"]) == (2, "dense") and math.isfinite(older["loss"])
  assert older["loss"] != latest["loss"]


def test_position_buckets_cover_every_position():
  assert evaluate.position_buckets(10) == [(0, 10)]
  assert evaluate.position_buckets(64) == [(0, 16), (16, 64)]
  long = evaluate.position_buckets(100_000)
  assert long[:3] == [(0, 16), (16, 64), (64, 256)] and long[-1] == (65536, 100_000)
  assert all(a[1] == b[0] for a, b in zip(long, long[1:]))


def _without_checkpoints(workdir, tmp_path):
  shutil.copy(workdir / "config.json", tmp_path / "config.json")
  return tmp_path


@pytest.mark.parametrize("args, message", [
    (lambda w, t: [f"--workdir={t / 'missing'}"], "does not exist"),
    (lambda w, t: [f"--workdir={t}"], "config.json' does not exist"),
    (lambda w, t: [f"--workdir={_without_checkpoints(w, t)}"], "holds no checkpoint"),
    (lambda w, t: [f"--workdir={w}", "--step=7"], "--step=7: workdir"),
    (lambda w, t: [f"--workdir={w}", "--batches=0"], "--batches=0 must be >= 1"),
    (lambda w, t: [f"--workdir={w}", "--batches=two"], "argument --batches: invalid int value: 'two'"),
    (lambda w, t: [], "the following arguments are required: --workdir"),
], ids=["no_workdir", "no_config", "no_checkpoint", "bad_step", "zero_batches", "batches_not_int", "no_flags"])
def test_user_errors_are_one_line_and_status_2(workdir, tmp_path, capsys, args, message):
  with pytest.raises(SystemExit) as exit_:
    evaluate.main(args(workdir, tmp_path))
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_a_user_error_from_the_command_line(tmp_path):
  result = run_command("hyscale_jax.evaluate", f"--workdir={tmp_path / 'missing'}", timeout=120)
  assert result.returncode == 2
  assert result.stderr.startswith("error: workdir ") and "Traceback" not in result.stderr


def test_help_names_every_flag(capsys):
  with pytest.raises(SystemExit) as exit_:
    evaluate.main(["--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--workdir", "--step", "--batches", "--dense", "--out", "--traceback"):
    assert flag in out
