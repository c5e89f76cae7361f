"""Every command in the README's shell blocks runs as written: here (with its placeholders filled and a
few steps of a small run), or in the test named beside it when it needs what a test machine lacks."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from hyscale_jax import convert
from hyscale_jax.convert import __main__ as convert_cli
from hyscale_jax.training import lm, run_config, text_data

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "glm_moe_dsa"
# Commands another test or CI runs, by their start: what runs them.
ELSEWHERE = {
    "make test": ".ci/run",
    "make train": "the README's `python train.py ... --workdir=runs/a` line below, its default config",
    "JAX_COORDINATOR_ADDRESS=": "tests/test_multihost.py",
    "srun ": "tests/test_multihost.py",
    "python scripts/launch_local.py": "tests/test_multihost.py",
}
# A small run of any train.py command: appended, so they win over the README's values.
SMALL = ["--config.train.steps=2", "--config.train.warmup_steps=1", "--config.data.seq_len=32",
         "--config.data.batch_size=2", "--config.train.progress_bar=false", "--config.train.checkpoint_every=2",
         "--config.train.memory_preflight=false"]
# The slow ones: each another model or mesh to compile (minutes of CPU together), and the default
# config's run, whose config and stage schedule tests/test_train_cli.py's console test trains.
SLOW = ("deepseek_v4_flash", "qwen3_8_flash_next", "megatron_style", "mesh.", "--workdir=runs/a ")


def readme_commands() -> list[str]:
  """The commands of the README's ```bash blocks, continuation lines joined, comments dropped."""
  text = (ROOT / "README.md").read_text()
  commands = []
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split(" #")[0].strip()
      if line and not line.startswith("#"):
        commands.append(" ".join(line.split()))
  return commands


def _covered_elsewhere(command: str) -> str | None:
  return next((where for start, where in ELSEWHERE.items() if command.startswith(start)), None)


def test_every_readme_command_is_run_by_a_test():
  commands = readme_commands()
  assert len(commands) >= 10, commands
  for command in commands:
    where = _covered_elsewhere(command)
    if where is None:
      assert command.startswith("python "), f"README command {command!r} is run by no test"
    elif where.startswith("tests/"):
      assert (ROOT / where).exists() and "launch_local" in (ROOT / where).read_text(), where


def _filled(command: str, tmp: pathlib.Path) -> list[str]:
  """The command's arguments with the README's placeholders pointing into `tmp` and the fixtures."""
  args = shlex.split(command)
  replaced = []
  for arg in args:
    arg = arg.replace("path/to/hf_checkpoint", str(FIXTURE)).replace("path/to/tokenizer.json",
                                                                       str(FIXTURE / "tokenizer.json"))
    arg = arg.replace("path/to/hf_out", str(tmp / "hf_out")).replace("my_corpus.jsonl", str(tmp / "my_corpus.jsonl"))
    arg = re.sub(r"(?<![\w/])runs/", f"{tmp}/runs/", arg)
    replaced.append(arg)
  if replaced[:2] == ["python", "train.py"]:
    replaced += SMALL
    if not any(a.startswith("--config.data.path") for a in replaced) and "--config=" not in command:
      replaced += ["--config.data.source=pydoc", f"--config.data.cache_dir={ROOT / '.data'}"]
  return [sys.executable if a == "python" else a for a in replaced]


def _run(command: str, tmp: pathlib.Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run(_filled(command, tmp), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
  return proc


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
  """A folder with the README's own-data corpus (40 pydoc topics as JSONL)."""
  tmp = tmp_path_factory.mktemp("readme")
  with open(tmp / "my_corpus.jsonl", "w") as f:
    for doc in text_data.pydoc_documents()[:40]:
      f.write(json.dumps({"text": doc}) + "\n")
  return tmp


def _commands(start: str) -> list[str]:
  return [c for c in readme_commands() if c.startswith(start)]


@pytest.mark.parametrize("command", [
    pytest.param(c, marks=pytest.mark.slow) if any(s in c for s in SLOW) else c
    for c in _commands("python train.py") if "runs/imported" not in c])
def test_training_commands(command, workspace):
  proc = _run(command, workspace)
  assert "done: steps 1-2" in proc.stderr and "schedule" in proc.stderr, proc.stderr


def test_hugging_face_commands_in_order(workspace, capsys):
  """Import, fine-tune, evaluate, generate and export, one after the other as the README lists them; the
  export, imported again, holds the trained parameters bit for bit, the imported config.json and tokenizer."""
  block = [c for c in readme_commands() if "hyscale_jax.convert" in c or "hyscale_jax.evaluate" in c
           or "hyscale_jax.generate" in c or "runs/imported/config.py" in c]
  assert [c.split()[1:3] for c in block] == [["-m", "hyscale_jax.convert"], ["train.py", "--config=runs/imported/config.py"],
                                              ["-m", "hyscale_jax.evaluate"], ["-m", "hyscale_jax.generate"],
                                              ["-m", "hyscale_jax.convert"]], block
  outputs = [_run(command, workspace) for command in block]
  imported, workdir, hf = (workspace / p for p in ("runs/imported", "runs/finetune", "hf_out"))
  assert len(outputs[0].stdout.splitlines()) == 1 and f"--config={imported}/config.py" in outputs[0].stdout
  assert "done: steps 1-2" in outputs[1].stderr
  assert "perplexity" in outputs[2].stdout.lower()
  assert outputs[3].stdout.startswith("def fib(n):")

  again = workspace / "again"
  assert convert_cli.main(["import", str(hf), str(again)]) == 0
  trained, step = lm.restore_model(run_config.load(str(workdir)), str(workdir))
  params = lambda model: {path: np.asarray(v[...]) for path, v in  # noqa: E731
                          nnx.to_flat_state(nnx.state(model, convert.CHECKPOINT_VARIABLES))}
  exported, start = params(convert.load_native(str(again))), params(convert.load_native(str(imported)))
  assert step == 2 and exported.keys() == params(trained).keys()
  for path, value in params(trained).items():
    assert value.dtype == exported[path].dtype and np.array_equal(value, exported[path]), path
  assert any(not np.array_equal(exported[path], start[path]) for path in exported)  # trained weights, not the import
  assert json.loads((hf / "config.json").read_text()) == json.loads((FIXTURE / "config.json").read_text())
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (again / name).read_bytes() == (FIXTURE / name).read_bytes(), name
  capsys.readouterr()
  assert convert_cli.main(["export", str(workdir), str(workspace / "hf_7"), "--step", "7"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --step=7") and "[2]" in err and err.count("\n") == 1, err
