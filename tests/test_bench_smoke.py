"""Every bench script's `--smoke` runs on CPU and writes sane rows, so the benchmarks never rot.

The scripts run as subprocesses, all started together (module fixture) and each checked by its own
test; on 2 CPU cores the whole file takes about a minute.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (arguments after the script, check of the written JSON)
_SCRIPTS = {
    "context_plan": (["bench/context_plan.py", "--smoke"],
                     lambda data: all(r["step_moved_bytes"] > 0 for r in data)),
    "ops_baseline": (["bench/ops_baseline.py", "--smoke"],
                     lambda data: data["agree"] and all(_positive(r["seconds"]) for r in data["rows"])),
    "flash_topk": (["bench/flash_topk.py", "--smoke"],
                   lambda data: all(_positive(r["ms"]) for r in data) and data[0]["rescued"] == 0
                   and [r["fp8_overlap_with_bf16"] > 0.9 for r in data if r["variant"] == "pallas_fp8"] == [True]),
    "sparse_attention": (["bench/sparse_attention.py", "table", "--smoke"],
                         lambda data: all(_positive(r.get("pallas_fwd_ms", 1.0)) for r in data["rows"])
                         and data["rows"][0]["det_bitwise_equal"] and _positive(data["rows"][0]["pallas_det_bwd_ms"])
                         and _positive(data["rows"][0]["pallas_bwd_key_order_ms"])
                         and max(data["rows"][0]["key_order_errors"].values()) < 1e-5),
    "layer_step": (["bench/layer_step.py", "--smoke", "--layers", "dsa", "glm", "--modes", "megatron_style", "hyscale"],
                   lambda data: len(data["rows"]) == 4 and all(_positive(r["step_s"]) for r in data["rows"])
                   and all(r["check_ok"] and "parts_s" in r for r in data["rows"][1::2])
                   and _positive(data["rows"][3]["parts_s"]["moe"])),
    "causal_attention": (["bench/causal_attention.py", "--smoke"],
                         lambda data: len(data["rows"]) == 3 and all(_positive(r["ms"]) for r in data["rows"])
                         and all(r["max_out_diff"] < 1e-4 for r in data["rows"][1:])),
    "gated_delta_rule": (["bench/gated_delta_rule.py", "--smoke"],
                         lambda data: [(r["backend"], r["pass"]) for r in data["rows"]] == [
                             ("reference", "fwd"), ("reference", "fwd+bwd"), ("pallas", "fwd"), ("pallas", "fwd+bwd")]
                         and all(_positive(r["ms"]) for r in data["rows"])
                         and data["rows"][3]["max_out_diff"] < 1e-4 and data["rows"][3]["max_dq_diff"] < 1e-4),
    "model_step": (["bench/model_step.py", "--smoke", "--modes", "hyscale"],
                   lambda data: all(_positive(r.get("steps_per_s", -1.0)) for r in data["rows"])),
    "grouped_matmul": (["bench/grouped_matmul.py", "--smoke"],
                       lambda data: {r["pass"] for r in data["rows"]} == {"forward", "dx", "dw"}
                       and all(r["check_ok"] and _positive(r["ms"]) and _positive(r["tflops"]) for r in data["rows"])),
    "compile_time": (["bench/compile_time.py", "--smoke"],
                     lambda data: len(data["rows"]) == 4 and all(_positive(r["total_s"]) for r in data["rows"])
                     and data["depths"] == [2, 6] and set(data["deep_over_shallow"]) == {"scan", "unrolled"}),
}


def _positive(x):
  return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Starts every script at once; name -> (Popen, output JSON path)."""
  tmp = tmp_path_factory.mktemp("bench_smoke")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             HYSCALE_DATA_DIR=os.environ.get("HYSCALE_DATA_DIR", str(ROOT / ".data")))
  # One CPU device, as a user's run; the suite's other XLA flags (conftest.py) stay.
  env["XLA_FLAGS"] = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                              if not flag.startswith("--xla_force_host_platform_device_count"))
  started = {}
  for name, (args, _) in _SCRIPTS.items():
    out = tmp / f"{name}.json"
    started[name] = (subprocess.Popen([sys.executable, *args, "--out", str(out)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
  yield started
  for proc, _ in started.values():
    if proc.poll() is None:
      proc.kill()


@pytest.mark.parametrize("name", list(_SCRIPTS))
def test_smoke_run_writes_sane_rows(runs, name):
  proc, out = runs[name]
  log, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, log[-3000:]
  data = json.loads(out.read_text())
  assert _SCRIPTS[name][1](data), json.dumps(data)[:3000]


def test_layer_step_plots_from_its_json(runs, tmp_path):
  proc, out = runs["layer_step"]
  proc.communicate(timeout=600)
  sys.path.insert(0, str(ROOT / "bench"))
  import layer_step  # noqa: PLC0415

  written = layer_step.main(["plot", "--smoke", "--out", str(out), "--plots", str(tmp_path)])
  assert all(pathlib.Path(p).stat().st_size > 1000 for p in written)


def test_model_step_row_of_a_run_cut_by_its_timeout(tmp_path):
  """A train.py run stopped by `--timeout-s` still writes its row, with the error, instead of crashing
  the sweep (the killed child's output arrives as bytes)."""
  out = tmp_path / "cut.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "bench/model_step.py", "--smoke", "--modes", "hyscale", "--timeout-s", "0.5",
                         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert "timed out after 0.5 s" in row["error"] and "steps_per_s" not in row, row
