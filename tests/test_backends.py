"""Backends say what they are: a failed optional import is an error by name and one warning under "auto";
`ops.describe` names what each op runs here."""

import logging

import pytest

from hyscale_jax import ops
from hyscale_jax.ops._registry import BackendRegistry, BackendUnavailableError

_BROKEN = "hyscale_jax_test_broken_kernel"  # a module that exists and fails on import, as a kernel's could


@pytest.fixture
def toy(tmp_path, monkeypatch):
  """A registry of a made-up op whose "pallas" backend fails to import; "auto" tries it first everywhere."""
  (tmp_path / f"{_BROKEN}.py").write_text('raise ImportError("libtriton.so: cannot open shared object file")\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  registry = BackendRegistry("toy", {"reference": lambda x: x + 1},
                             auto_order={"default": ("pallas", "reference")})
  registry.register_optional("pallas", _BROKEN, "toy_pallas", kernel="Triton")
  return registry


def test_a_failed_import_is_an_error_by_name_with_its_reason(toy):
  assert "pallas" not in toy.implementations
  with pytest.raises(BackendUnavailableError, match=f"backend='pallas'.*{_BROKEN}.*libtriton.so") as raised:
    toy.candidates("pallas")
  assert isinstance(raised.value, ImportError)
  assert "cannot open shared object" in str(raised.value.__cause__)


def test_auto_warns_once_with_the_reason_and_falls_back(toy, caplog):
  with caplog.at_level(logging.WARNING, logger="hyscale_jax.ops._registry"):
    for _ in range(3):
      assert toy.run(toy.candidates("auto"), 1) == 2
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1
  assert "toy" in warnings[0].getMessage() and "libtriton.so" in warnings[0].getMessage()
  assert toy.describe("auto").startswith("reference (pallas unavailable: import " + _BROKEN)
  assert "raises" in toy.describe("pallas")


def test_describe_names_the_reference_for_every_op_on_cpu():
  described = ops.describe()
  assert list(described) == ["flash_topk", "sparse_attention", "indexer_loss", "causal_attention", "grouped_matmul",
                             "gated_delta_rule"]
  assert all(text == "reference (jnp)" for text in described.values()), described


def test_describe_honors_explicit_names_and_states_the_gpu_rule():
  described = ops.describe(backends={"flash_topk": "pallas", "sparse_attention": "xla_baseline"})
  assert described["flash_topk"] == "pallas (interpret mode)"  # off the GPU
  assert described["sparse_attention"].endswith("raises)")
  assert described["indexer_loss"] == "reference (jnp)"  # not named: "auto"
  gpu = ops.describe("gpu")  # another platform than this one: its device, and so Hopper, unknown
  assert gpu["flash_topk"].startswith("pallas (Mosaic GPU main pass from 32K keys on Hopper")
  assert gpu["causal_attention"] == "pallas (JAX's Triton flash attention)"
  assert ops.describe_line().startswith("flash_topk: reference (jnp); sparse_attention: ")


def test_describe_reads_the_device(fake_hopper):
  """On an H200 (faked) the Mosaic GPU rules apply without their Hopper condition."""
  described = ops.describe()
  assert described["flash_topk"] == "pallas (Mosaic GPU main pass from 32K keys, Triton below)"
  assert described["grouped_matmul"] == "pallas (Mosaic GPU)"
