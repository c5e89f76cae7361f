"""Several processes on this machine (CPU devices, gloo over localhost) against one process of 8 devices.

The reference runs in the pytest process (8 fake devices, conftest.py); the multi-process runs are
`train.py` processes started by scripts/launch_local.py, as a user would start them.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import glm5_1
from hyscale_jax import parallel

# One pytest-xdist worker runs these one after another (`make test` uses --dist loadgroup): two jobs of
# several gloo processes each on 2 cores spin against each other (a 30 s test passed 240 s in CI).
pytestmark = pytest.mark.xdist_group("multiprocess")
from hyscale_jax.parallel import mesh as mesh_lib
from hyscale_jax.training import file_data, lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import launch_local  # noqa: E402

try:
  from tests.lm_runs import write_jsonl_corpus
except ImportError:  # tests/ itself is on sys.path
  from lm_runs import write_jsonl_corpus

_MODEL = dict(
    d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4, experts_per_token=2, moe_inter=16,
    index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=8, vocab_size=512)
_DATA = dict(source="pydoc", vocab_size=512, seq_len=32, batch_size=2)
_TRAIN = dict(steps=2, warmup_steps=0, log_every=1, checkpoint_every=1, progress_bar=False)
_HEARTBEAT_S = 5


def _fields(tmp_path, mesh, **train):
  return {"model": _MODEL, "data": dict(_DATA, cache_dir=str(tmp_path / "data")), "train": {**_TRAIN, **train},
          "mesh": mesh}


def _config(fields):
  config = glm5_1.get_config("tiny")
  for group, values in fields.items():
    config[group].update(values)
  return config


def _args(fields, workdir):
  return [f"--workdir={workdir}"] + [f"--config.{group}.{k}={v}" for group, values in fields.items()
                                     for k, v in values.items()]


def _losses(workdir):
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: (r["loss"], r["lm_loss"], r["indexer_loss"], r["val_lm_loss"]) for r in rows}


def _run(n, devices, args, *, timeout=480, base_env=None):
  procs = launch_local.start(n, args, devices_per_process=devices, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, base_env=base_env)
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  return [p.returncode for p in procs], outs


def _assert_close(got, want):
  assert sorted(got) == sorted(want)
  for step in want:
    np.testing.assert_allclose(got[step], want[step], rtol=1e-6, atol=1e-6, err_msg=f"step {step}")


def test_two_processes_match_one_and_their_checkpoint_resumes_in_one(tmp_path):
  # 1 x 8 devices straight to step 2; 2 x 4 to step 1 (saving it); then 1 x 8 resumes that checkpoint to 2.
  mesh = dict(data=2, context=-1)  # data spans the two processes, context (4) stays inside each
  lm.train_and_evaluate(_config(_fields(tmp_path, mesh)), str(tmp_path / "one"))
  want = _losses(tmp_path / "one")
  codes, outs = _run(2, 4, _args(_fields(tmp_path, mesh, stop_at_step=1), tmp_path / "two"))
  assert codes == [0, 0], outs
  two = tmp_path / "two"
  _assert_close(_losses(two), {1: want[1]})  # process 0 alone wrote the metrics
  assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["1"]
  # Orbax wrote each chunk once: the processes' databases share no key, and together hold one process's.
  written = _chunks_by_process(two / "checkpoints" / "1")
  assert sorted(written) == ["ocdbt.process_0", "ocdbt.process_1"] and all(written.values())
  assert not written["ocdbt.process_0"] & written["ocdbt.process_1"]
  assert set.union(*written.values()) == set.union(*_chunks_by_process(tmp_path / "one" / "checkpoints" / "1").values())
  lm.train_and_evaluate(_config(_fields(tmp_path, mesh)), str(two))
  _assert_close(_losses(two), want)


def _file_fields(tmp_path, mesh, source="jsonl", **train):
  """`_fields` on the user's corpus in `tmp_path/corpus` (`write_jsonl_corpus`): its JSONL, or its token file."""
  fields = _fields(tmp_path, mesh, **train)
  corpus = tmp_path / "corpus"
  path = corpus / ("corpus.jsonl" if source == "jsonl" else "corpus.npy")
  fields["data"] = dict(_DATA, source=source, path=str(path), tokenizer=str(corpus / "tokenizer.json"))
  return fields


def _chunks_by_process(checkpoint):
  """{`ocdbt.process_<i>`: the array chunk keys that process wrote} of an orbax checkpoint folder."""
  import tensorstore as ts  # noqa: PLC0415 (orbax's storage layer)

  return {db.name: set(ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result().list().result())
          for db in (checkpoint / "state").glob("ocdbt.process_*")}


def _truncate_all_files(folder):
  for path in folder.rglob("*"):
    if path.is_file():
      path.write_bytes(path.read_bytes()[: max(path.stat().st_size // 2, 1) - 1])


def _resume_copy(run, name):
  """A copy of workdir `run` whose checkpoint 2 does not read: a resume redoes step 2 from checkpoint 1."""
  copy = run.with_name(name)
  shutil.copytree(run, copy)
  _truncate_all_files(copy / "checkpoints" / "2")
  return copy


@pytest.mark.slow  # 43 s alone, but its 2 x 4 gloo processes spun past the 480 s timeout beside another worker in CI
def test_jsonl_corpus_trains_per_process_and_resumes_bit_for_bit(tmp_path):
  # 2 x 4 processes straight to step 2 (checkpoints 1, 2); then again from a copy whose step 2 does not
  # read: process 0 alone moves it aside, both resume from step 1 and redo step 2 exactly.
  (tmp_path / "corpus").mkdir()
  write_jsonl_corpus(tmp_path / "corpus")
  fields = _file_fields(tmp_path, dict(data=2, context=-1))
  run = tmp_path / "straight"
  codes, outs = _run(2, 4, _args(fields, run) + ["--verbosity=0"])
  assert codes == [0, 0], outs
  for i, out in enumerate(outs):  # data spans the processes: each reads only its own row
    assert f"process {i} reads rows [{i}] of each global batch of 2" in out, out[-3000:]
  resumed = _resume_copy(run, "resumed")
  codes, outs = _run(2, 4, _args(fields, resumed))
  assert codes == [0, 0], outs
  assert ["checkpoint step 2 is unreadable" in out for out in outs] == [True, False], outs
  assert sorted(p.name[:14] for p in (resumed / "checkpoints").iterdir()) == ["1", "2", "2.unreadable-2"]
  straight, again = _losses(run), _losses(resumed)
  assert len((resumed / "metrics.jsonl").read_text().splitlines()) == 3  # step 2 logged twice
  assert again == straight, (again, straight)  # exact float equality


@pytest.mark.slow
def test_token_file_trains_per_process_and_resumes_in_two_and_in_one(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  docs = write_jsonl_corpus(corpus)
  tokenizer, eos_id, _ = file_data.load_tokenizer(corpus / "tokenizer.json")
  ids = [e.ids for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
  np.save(corpus / "corpus.npy", np.concatenate(ids).astype(np.uint16))
  np.save(corpus / "corpus.offsets.npy", np.cumsum([0] + [len(i) for i in ids]))
  # The sequence spans the processes (context 8): each process reads both rows, half of each used.
  fields = _file_fields(tmp_path, dict(context=-1), source="tokens")
  fields["data"]["seq_len"] = 64
  run = tmp_path / "straight"
  codes, outs = _run(2, 4, _args(fields, run) + ["--verbosity=0"])
  assert codes == [0, 0], outs
  assert all(f"process {i} reads rows [0, 1] of each global batch of 2" in out for i, out in enumerate(outs))
  resumed = _resume_copy(run, "resumed")
  codes, outs = _run(2, 4, _args(fields, resumed))
  assert codes == [0, 0], outs
  assert _losses(resumed) == _losses(run)  # exact float equality
  in_one = _resume_copy(run, "in_one")
  lm.train_and_evaluate(_config(fields), str(in_one))
  _assert_close(_losses(in_one), _losses(run))


@pytest.mark.slow
def test_checkpoints_of_one_and_four_processes_resume_in_four_and_two(tmp_path):
  mesh = dict(data=2, context=-1)
  lm.train_and_evaluate(_config(_fields(tmp_path, mesh, steps=3)), str(tmp_path / "straight"))
  run = tmp_path / "run"
  lm.train_and_evaluate(_config(_fields(tmp_path, mesh, steps=3, stop_at_step=1)), str(run))
  codes, outs = _run(4, 2, _args(_fields(tmp_path, mesh, steps=3, stop_at_step=2), run))  # 1 -> 4
  assert codes == [0] * 4, outs
  codes, outs = _run(2, 4, _args(_fields(tmp_path, mesh, steps=3), run))  # 4 -> 2
  assert codes == [0, 0], outs
  _assert_close(_losses(run), _losses(tmp_path / "straight"))
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2", "3"]
  written = _chunks_by_process(run / "checkpoints" / "2")  # by 4 processes: each chunk once
  assert len(written) == 4 and sum(map(len, written.values())) == len(set.union(*written.values()))
  assert set.union(*written.values()) == set.union(*_chunks_by_process(run / "checkpoints" / "1").values())


# Each axis across processes: data x context (data spans them), fsdp x expert (fsdp spans them, the
# expert all-to-all stays inside), tensor (data spans them, tensor inside).
_MESHES = {"data_context": dict(data=2, context=-1), "fsdp_expert": dict(fsdp=2, expert=-1),
           "tensor": dict(data=-1, tensor=2)}


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("mesh", sorted(_MESHES))
def test_processes_x_devices_match_one_process_of_eight(tmp_path, mesh, processes):
  fields = _fields(tmp_path, _MESHES[mesh], warmup_steps=1, steps=3, checkpoint_every=0)
  fields["data"]["batch_size"] = 8
  lm.train_and_evaluate(_config(fields), str(tmp_path / "one"))
  codes, outs = _run(processes, 8 // processes, _args(fields, tmp_path / "many"))
  assert codes == [0] * processes, outs
  _assert_close(_losses(tmp_path / "many"), _losses(tmp_path / "one"))


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_four(tmp_path):
  mesh = dict(data=2, context=-1)
  lm.train_and_evaluate(_config(_fields(tmp_path, mesh)), str(tmp_path / "one"))
  codes, outs = _run(2, 4, _args(_fields(tmp_path, mesh, stop_at_step=1), tmp_path / "many"))
  assert codes == [0, 0], outs
  codes, outs = _run(4, 2, _args(_fields(tmp_path, mesh), tmp_path / "many"))
  assert codes == [0] * 4, outs
  _assert_close(_losses(tmp_path / "many"), _losses(tmp_path / "one"))
  assert sorted(p.name for p in (tmp_path / "many" / "checkpoints").iterdir()) == ["1", "2"]


def _popen(i, n, devices, port, args, out, base_env=None):
  env = launch_local.process_env(i, n, devices_per_process=devices, port=port, base=base_env)
  return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=out,
                          stderr=subprocess.STDOUT, text=True)


def test_mismatched_config_stops_every_process_naming_the_field(tmp_path):
  args = _args(_fields(tmp_path, dict(data=-1)), tmp_path / "run")
  port = launch_local.free_port()
  procs = [_popen(i, 2, 1, port, args + [f"--config.train.seed={i}"], subprocess.PIPE) for i in range(2)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode != 0, out[-2000:]
    assert "config.train.seed (processes [1] differ from process 0)" in out, out[-2000:]
  assert "train.seed=1." in outs[1] and "train.seed=0." in outs[0]
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _kill_one(tmp_path, victim, *, when):
  """Starts 2 x 2 processes and SIGKILLs `victim` once `when(workdir, logs)`; (survivor's rc, seconds, log)."""
  workdir = tmp_path / "run"
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  env = dict(os.environ, HYSCALE_HEARTBEAT_TIMEOUT_S=str(_HEARTBEAT_S))
  args = _args(_fields(tmp_path, dict(data=-1), steps=1000, checkpoint_every=0), workdir) + ["--verbosity=0"]
  port = launch_local.free_port()
  procs = [_popen(i, 2, 2, port, args, open(log, "w"), env) for i, log in enumerate(logs)]
  try:
    deadline = time.time() + 200
    while not when(workdir, logs) and time.time() < deadline and all(p.poll() is None for p in procs):
      time.sleep(0.05)
    assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.time()
    survivor = procs[1 - victim]
    rc = survivor.wait(timeout=_HEARTBEAT_S + 60)
    return rc, time.time() - killed, logs[1 - victim].read_text()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def _joined(workdir, logs):
  return all("process" in log.read_text() and " of 2" in log.read_text() for log in logs)


def test_sigkill_of_one_process_stops_the_other_naming_it(tmp_path):
  rc, seconds, log = _kill_one(tmp_path, 1, when=_joined)
  assert rc != 0 and seconds < _HEARTBEAT_S + 30, (rc, seconds)
  # JAX's coordination service names the silent task (process id) on the line after this one.
  lines = log.splitlines()
  at = next(i for i, line in enumerate(lines) if "tasks are unhealthy (stopped sending heartbeats)" in line)
  assert lines[at + 1].strip() == "1", lines[at : at + 3]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_during_training_stops_the_other(tmp_path, victim):
  rc, seconds, log = _kill_one(tmp_path, victim, when=lambda workdir, logs: (workdir / "metrics.jsonl").exists())
  assert rc != 0 and seconds < _HEARTBEAT_S + 30, (rc, seconds)
  named = "unhealthy (stopped sending heartbeats)" if victim else "Failed to send RPC to coordination service"
  assert named in log, log[-3000:]


def test_plain_environment_must_be_complete(monkeypatch):
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert parallel.maybe_initialize_distributed() is False  # nothing set: one process
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
  with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES, \$JAX_PROCESS_ID missing"):
    parallel.maybe_initialize_distributed()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  with pytest.raises(ValueError, match=r"JAX_PROCESS_ID=2 must be in \[0, \$JAX_NUM_PROCESSES=2\)"):
    parallel.maybe_initialize_distributed()
  monkeypatch.setenv("JAX_PROCESS_ID", "one")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' must be an integer"):
    parallel.maybe_initialize_distributed()


def test_config_fields_are_flattened_without_per_process_ones(tmp_path):
  fields = mesh_lib._flat_fields(_config(_fields(tmp_path, dict(data=2))))
  assert fields["mesh.data"] == "2" and fields["train.seed"] == "0" and fields["model.d_model"] == "32"
  assert not set(mesh_lib.PER_PROCESS_FIELDS) & set(fields)


@pytest.mark.parametrize("cluster", ["slurm", "openmpi", "plain", "slurm_batch_script"])
def test_start_up_passes_plain_values_and_leaves_clusters_to_jax(monkeypatch, cluster):
  for name in list(os.environ):
    if name.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "HYSCALE_")):
      monkeypatch.delenv(name)
  env = {"slurm": dict(SLURM_NTASKS="16", SLURM_PROCID="3", SLURM_STEP_NODELIST="n[1-2]"),
         "slurm_batch_script": dict(SLURM_NTASKS="16", SLURM_PROCID="0"),
         "openmpi": dict(OMPI_COMM_WORLD_SIZE="4"),
         "plain": dict(JAX_COORDINATOR_ADDRESS="h0:1234", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="3",
                       HYSCALE_HEARTBEAT_TIMEOUT_S="7")}[cluster]
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  calls = []
  monkeypatch.setattr(mesh_lib.jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(mesh_lib.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(mesh_lib.logging, "info", lambda *a: None)  # process_index() is 0 here anyway
  many = parallel.maybe_initialize_distributed()
  if cluster == "slurm_batch_script":  # no srun step: one process, nothing joined
    assert many is False and calls == []
    return
  assert many is True and len(calls) == 1
  call = calls[0]
  assert call["initialization_timeout"] == mesh_lib.INIT_TIMEOUT_S
  if cluster == "plain":
    assert (call["coordinator_address"], call["num_processes"], call["process_id"]) == ("h0:1234", 4, 3)
    assert call["heartbeat_timeout_seconds"] == 7
  else:  # SLURM / Open MPI: JAX's own detection fills them in
    assert (call["coordinator_address"], call["num_processes"], call["process_id"]) == (None, None, None)
    assert call["heartbeat_timeout_seconds"] == mesh_lib.HEARTBEAT_TIMEOUT_S


def test_launcher_stops_the_rest_when_one_process_fails(tmp_path, capsys):
  sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
  failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
  start = time.time()
  assert launch_local.wait_all([sleepers[0], failing, sleepers[1]], grace_s=5) == 3
  assert time.time() - start < 20 and all(p.returncode is not None for p in sleepers)
  assert "launch_local: process 1 exited with status 3; stopping the others" in capsys.readouterr().err
