"""Test setup: CPU platform with 8 fake devices, configured before JAX initialises a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's LLVM backend at -O0: the tests compile many small programs and run each a few times, so
# compiling dominates; -O0 took test_step_modes.py from 75 to 59 s and the FlashTopK interpret-mode
# tests from 96 to 82 s on the 2-core CI machine, with the same results (no fast-math either way).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
# On GPU, f32 matmuls default to TF32; the oracle comparisons need full f32 (a no-op on CPU).
jax.config.update("jax_default_matmul_precision", "highest")

# Many tests compile the same train step (in-process and in train.py subprocesses): share compiled
# executables through JAX's persistent cache, keyed by the program, so each compiles once per run.
_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's in-memory executables after each test module. XLA:CPU maps each compiled program's
  code into its own memory regions (several thousand for one module's model-sized steps); a whole
  suite in one process then nears the kernel's vm.max_map_count (65530) and a later compile
  segfaults. The persistent cache above still serves recompiles."""
  yield
  jax.clear_caches()
  gc.collect()


class _FakeHopper:
  """What Mosaic GPU and our kernels' dispatch read from `jax.devices()[0]` on an H200."""
  platform, device_kind, compute_capability, core_count = "gpu", "NVIDIA H200", "9.0", 132


@pytest.fixture
def fake_hopper(monkeypatch):
  """The code under test sees an H200 (compiled kernels, not interpreted ones), for export tests on the CPU
  (`jaxpr_tools.export_for_h200`)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [_FakeHopper()])
