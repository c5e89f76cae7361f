"""Backend registry: name resolution, "auto" order and fall-through on NotImplementedError."""

import pytest

from hyscale_jax.ops._registry import BackendRegistry


def _declines(*args, **kwargs):
  raise NotImplementedError("not for this input")


def _registry(**impls):
  order = {"gpu": ("pallas", "reference"), "default": ("pallas", "reference")}
  return BackendRegistry("toy", impls, auto_order=order)


def test_auto_skips_missing_and_declining_backends():
  registry = _registry(pallas=_declines, reference=lambda x: x + 1)
  names = registry.candidates("auto")
  assert names == ("pallas", "reference")
  assert registry.run(names, 1) == 2
  assert _registry(reference=lambda x: x).candidates("auto") == ("reference",)


def test_named_backend_runs_or_raises():
  registry = _registry(pallas=_declines, reference=lambda x: x)
  with pytest.raises(NotImplementedError, match="not for this input"):
    registry.run(registry.candidates("pallas"), 1)
  with pytest.raises(NotImplementedError, match="xla_baseline"):
    registry.candidates("xla_baseline")  # a known name with no implementation here
  with pytest.raises(ValueError, match="backend='tpu_magic'"):
    registry.candidates("tpu_magic")


def test_every_backend_declining_is_an_exception_group():
  registry = _registry(pallas=_declines, reference=_declines)
  with pytest.raises(ExceptionGroup, match="every backend"):
    registry.run(registry.candidates("auto"), 1)


def test_other_errors_propagate_without_fallback():
  def broken(x):
    raise TypeError("bug")

  registry = _registry(pallas=broken, reference=lambda x: x)
  with pytest.raises(TypeError, match="bug"):
    registry.run(registry.candidates("auto"), 1)
