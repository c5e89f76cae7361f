"""Test setup: CPU platform with 8 fake devices, configured before JAX initialises a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
# On GPU, f32 matmuls default to TF32; the oracle comparisons need full f32 (a no-op on CPU).
jax.config.update("jax_default_matmul_precision", "highest")
