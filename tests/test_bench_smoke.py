"""Every bench script's `--smoke` runs on CPU and writes sane rows, so the benchmarks never rot.

The scripts run as subprocesses (`python -m bench.<name>`), all started together once per test session
(`runs`) and each checked by its own test; on 2 shared CPU cores the whole file takes two to three minutes.
"""

import concurrent.futures
import fcntl
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (python's arguments, check of the written JSON)
_SCRIPTS = {
    "context_plan": (["-m", "bench.context_plan", "--smoke"],
                     lambda data: all(r["step_moved_bytes"] > 0 for r in data)),
    "ops_baseline": (["-m", "bench.ops_baseline", "--smoke"],
                     lambda data: data["agree"] and all(_positive(r["seconds"]) for r in data["rows"])),
    "flash_topk": (["-m", "bench.flash_topk", "--smoke"],
                   lambda data: all(_positive(r["ms"]) for r in data) and data[0]["rescued"] == 0
                   and [r["fp8_overlap_with_bf16"] > 0.9 for r in data if r["variant"] == "pallas_fp8"] == [True]),
    "sparse_attention": (["-m", "bench.sparse_attention", "table", "--smoke"],
                         lambda data: all(_positive(r.get("pallas_fwd_ms", 1.0)) for r in data["rows"])
                         and data["rows"][0]["det_bitwise_equal"] and _positive(data["rows"][0]["pallas_det_bwd_ms"])
                         and _positive(data["rows"][0]["pallas_bwd_key_order_ms"])
                         and max(data["rows"][0]["key_order_errors"].values()) < 1e-5),
    "layer_step": (["-m", "bench.layer_step", "--smoke", "--layers", "dsa", "glm",
                    "--modes", "megatron_style", "hyscale"],
                   lambda data: len(data["rows"]) == 4 and all(_positive(r["step_s"]) for r in data["rows"])
                   and all(r["check_ok"] and "parts_s" in r for r in data["rows"][1::2])
                   and _positive(data["rows"][3]["parts_s"]["moe"])),
    "causal_attention": (["-m", "bench.causal_attention", "--smoke"],
                         lambda data: len(data["rows"]) == 3 and all(_positive(r["ms"]) for r in data["rows"])
                         and all(r["max_out_diff"] < 1e-4 for r in data["rows"][1:])),
    "dense_warmup": (["-m", "bench.dense_warmup", "--smoke"],
                     lambda data: [r["part"] for r in data["rows"]] == ["attention", "kl pallas", "kl streaming"]
                     and all(_positive(r["ms"]) for r in data["rows"])
                     and abs(data["rows"][1]["loss"] - data["rows"][2]["loss"]) < 1e-5 * data["rows"][2]["loss"]
                     and data["rows"][2]["max_grad_rel_diff"] < 1e-4),
    "gated_delta_rule": (["-m", "bench.gated_delta_rule", "--smoke"],
                         lambda data: [(r["backend"], r["pass"]) for r in data["rows"]] == [
                             ("reference", "fwd"), ("reference", "fwd+bwd"), ("pallas", "fwd"), ("pallas", "fwd+bwd")]
                         and all(_positive(r["ms"]) for r in data["rows"])
                         and data["rows"][3]["max_out_diff"] < 1e-4 and data["rows"][3]["max_dq_diff"] < 1e-4),
    "model_step": (["-m", "bench.model_step", "--smoke", "--modes", "hyscale"],
                   lambda data: all(len(r["steps"]) == 3 and _positive(r["step_time"]["median_s"])
                                    and r["step_time"]["max_s"] >= r["step_time"]["median_s"]
                                    and all(_positive(s["step_time_s"]) for s in r["steps"]) for r in data["rows"])),
    "profile_ops": (["-m", "bench.profile_ops", "--smoke"],
                    lambda data: len(data["summaries"]) == 2 and len(data["difference"]) > 0
                    and all(_positive(s["busy_s"]) and s["span_s"] >= s["busy_s"] for s in data["summaries"])),
    "grouped_matmul": (["-m", "bench.grouped_matmul", "--smoke"],
                       lambda data: {r["pass"] for r in data["rows"]} == {"forward", "dx", "dw"}
                       and all(r["check_ok"] and _positive(r["ms"]) and _positive(r["tflops"]) for r in data["rows"])),
    "compile_time": (["-m", "bench.compile_time", "--smoke"],
                     lambda data: len(data["rows"]) == 4 and all(_positive(r["total_s"]) for r in data["rows"])
                     and data["depths"] == [2, 6] and set(data["deep_over_shallow"]) == {"scan", "unrolled"}),
    "context_parallel": (["-m", "bench.context_parallel", "--smoke"],
                         lambda data: {r["check"] for r in data["rows"]} == {
                             "flash_topk", "sparse_attention fwd+bwd", "indexer_loss (sparse) + grads",
                             "train.py glm5_1 tiny"}
                         and all(r.get("ok", True) and _positive(r["seconds"]) for r in data["rows"])
                         and all(r["mismatched_indices"] == 0 for r in data["rows"] if "mismatched_indices" in r)
                         and data["rows"][-1]["shard_map_calls"] > 0),
    # The second smoke case (remat "full"; tests/test_memory.py runs the first), its child given room for
    # 2 cores shared with every other script here.
    "memory_check": (["-m", "bench.memory_check", "--smoke", "--only", "1", "--case-timeout-s", "500"],
                     lambda data: [r["remat"] for r in data["rows"]] == ["full"]
                     and all(r["status"] == "ok" and r["measured_bytes"] > 0 and r["estimate_bytes"] > 0
                             and all(math.isfinite(x) for x in r["losses"]) for r in data["rows"])),
    "memory_proxy": (["-m", "bench.memory_proxy", "--smoke"],
                     lambda data: [r["T"] for r in data["rows"]] == [256]
                     and all(r["temp_size_in_bytes"] > 0 and r["total_bytes"] > r["temp_size_in_bytes"]
                             and r["estimate_bytes"] > 0 for r in data["rows"])),
    "grouped_matmul_sweep": (["-m", "bench.grouped_matmul_sweep", "--smoke"],
                             lambda data: sorted((r["pass"], r["label"].startswith("tiled")) for r in data["rows"])
                             == [(p, tiled) for p in ("dw", "dx", "forward") for tiled in (False, True)]
                             and all(_positive(r["ms"]) and r["rel_err"] < 2e-2 for r in data["rows"])),
    "xla_peak_buffers": (["-m", "bench.xla_peak_buffers", "--smoke"],
                         lambda data: len(data["rows"]) >= 1 and all(
                             0 < r["live_bytes"] <= min(r["total_bytes"], sum(v["bytes"] for v in r["live"]))
                             for r in data["rows"])),
    "tilelang_anchor": (["-m", "bench.anchors.tilelang_sparse_mla", "--smoke"],
                        lambda data: data["meta"]["tilelang"] == "0.0.0+smoke"
                        and data["meta"]["examples"]["commit"] == "smoke"
                        and all("/tilelang_anchor/" in r.get("file", "") for r in data["rows"]
                                if r.get("module") not in (None, "utils"))
                        and sum("skipped" in r for r in data["rows"]) == 4),
}


def _positive(x):
  return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
  """name -> (exit status, output, the JSON it wrote) of each selected script, run once per test session.

  The first test (of any xdist worker) that asks runs the scripts whose tests this session selected
  (`-m "not slow"` leaves out `_SLOW_SCRIPTS`) and records how each ended; the others wait for that
  and read it. A module fixture alone would run them in every worker that gets one of these tests:
  twice the CPU, and two runs racing on the same temporary folders.
  """
  names = [item.callspec.params["name"] for item in request.session.items
           if item.originalname == "test_smoke_run_writes_sane_rows"]
  base = tmp_path_factory.getbasetemp()
  # Under xdist each worker's base is popen-gwN/ inside the session's folder, which they share.
  shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bench_smoke"
  shared.mkdir(exist_ok=True)
  with open(shared / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not (shared / "done").exists():
      _run_all(shared, names)
      (shared / "done").touch()
  return {name: (int((shared / f"{name}.status").read_text()), (shared / f"{name}.log").read_text(),
                 shared / f"{name}.json") for name in names}


def _run_all(folder: pathlib.Path, names: list[str]) -> None:
  """Runs the scripts two at a time: on 2 cores, all at once took
  about 300 CPU-seconds against about 170 one after another (each imports JAX and competes for memory)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             HYSCALE_DATA_DIR=os.environ.get("HYSCALE_DATA_DIR", str(ROOT / ".data")))
  # One CPU device, as a user's run; the suite's other XLA flags (conftest.py) stay.
  env["XLA_FLAGS"] = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                              if not flag.startswith("--xla_force_host_platform_device_count"))

  def run(name):
    args, _ = _SCRIPTS[name]
    proc = subprocess.Popen([sys.executable, *args, "--out", str(folder / f"{name}.json")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
      log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      proc.kill()
      log, _ = proc.communicate()
      log += "\n(killed after 600 s)"
    (folder / f"{name}.log").write_text(log)
    (folder / f"{name}.status").write_text(str(proc.returncode))

  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    list(pool.map(run, names))


# CI time: compile_time's smoke compiles four programs for its table; it runs with SLOW=1.
_SLOW_SCRIPTS = ("compile_time",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_SCRIPTS else n
                                  for n in _SCRIPTS])
def test_smoke_run_writes_sane_rows(runs, name):
  status, log, out = runs[name]
  assert status == 0, log[-3000:]
  data = json.loads(out.read_text())
  assert _SCRIPTS[name][1](data), json.dumps(data)[:3000]


def test_layer_step_plots_from_its_json(runs, tmp_path):
  _, _, out = runs["layer_step"]
  from bench import layer_step  # noqa: PLC0415

  written = layer_step.main(["plot", "--smoke", "--out", str(out), "--plots", str(tmp_path)])
  assert all(pathlib.Path(p).stat().st_size > 1000 for p in written)


def test_model_step_row_of_a_run_cut_by_its_timeout(tmp_path):
  """A train.py run stopped by `--timeout-s` still writes its row, with the error, instead of crashing
  the sweep (the killed child's output arrives as bytes)."""
  out = tmp_path / "cut.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-m", "bench.model_step", "--smoke", "--modes", "hyscale",
                         "--timeout-s", "0.5", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert "timed out after 0.5 s" in row["error"] and "step_time" not in row, row
