"""`pallas_kernels/_relaxed_atomics.py` builds a primitive from private jax modules (no public route
gives Pallas-Triton a relaxed atomic add; the relaxed form ran the sparse-attention backward 2.6x
faster on the H200). These tests fail loudly when jax changes under it: the pinned version, the
Triton IR it emits for an abstract H200 (relaxed, where `plgpu.atomic_add` is acq_rel), and its
interpret-mode values against `plgpu.atomic_add`."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._relaxed_atomics import relaxed_atomic_add

try:
  from tests.jaxpr_tools import export_for_h200
except ImportError:  # tests/ itself is on sys.path
  from jaxpr_tools import export_for_h200

VALIDATED_JAX = "0.11.2"


def _scatter_add(add, values, targets, *, interpret=False, debug=False):
  """out[targets[i]] += values[i] over 4 programs of 8 lanes each, with `add` (relaxed or plgpu's)."""

  def kernel(v_ref, t_ref, acc_ref, o_ref):
    del acc_ref  # the zeros `o_ref` aliases
    add(o_ref, t_ref[...], v_ref[...])

  block, whole = pl.BlockSpec((8,), lambda i: (i,)), pl.BlockSpec((16,), lambda i: (0,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(4,),
                        in_specs=[block, block, whole], out_specs=whole, input_output_aliases={2: 0},
                        interpret=interpret, debug=debug)(values, targets, jnp.zeros((16,), jnp.float32))


def test_jax_is_the_version_the_private_primitive_was_validated_on():
  assert jax.__version__ == VALIDATED_JAX, (
      f"jax {jax.__version__} is not {VALIDATED_JAX}: pallas_kernels/_relaxed_atomics.py uses private jax "
      "modules. Re-run this file and the sparse-attention GPU tests (pytest -m gpu_only "
      "tests/test_sparse_attention_pallas.py on an H200), then update VALIDATED_JAX.")


def test_triton_ir_has_a_relaxed_atomic_add_where_plgpu_has_acq_rel(capsys):
  spec = jax.ShapeDtypeStruct((32,), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32)
  ir = {}
  for name, add in (("relaxed", relaxed_atomic_add), ("plgpu", plgpu.atomic_add)):
    export_for_h200(functools.partial(_scatter_add, add, debug=True), *spec)
    ir[name] = re.findall(r"tt\.atomic_rmw\s+fadd,\s*(\w+)", capsys.readouterr().out)
  assert ir["relaxed"] == ["relaxed"], ir
  assert ir["plgpu"] == ["acq_rel"], ir


def test_interpret_mode_adds_like_plgpu_atomic_add():
  rng = np.random.default_rng(0)
  values = jnp.asarray(rng.normal(size=32), jnp.float32)
  # Each target gets two adds, from different programs (interpret mode, like plgpu's, keeps one
  # update of lanes that repeat a target within a program).
  targets = jnp.asarray((4 * np.arange(4)[:, None] + rng.permutation(8)[None]) % 16, jnp.int32).reshape(32)
  got = _scatter_add(relaxed_atomic_add, values, targets, interpret=True)
  want = _scatter_add(plgpu.atomic_add, values, targets, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_allclose(np.asarray(got), np.bincount(np.asarray(targets), np.asarray(values), 16), rtol=1e-6)
