"""One backend registry per public op: a name -> implementation table with tokamax-style dispatch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax

Backend = Literal["auto", "pallas", "reference", "xla_baseline"]
BACKEND_NAMES: tuple[str, ...] = ("pallas", "reference", "xla_baseline")


def platform() -> str:
  """The platform of JAX's default backend: "gpu", "cpu" or "tpu"."""
  return jax.default_backend()


class BackendRegistry:
  """Maps backend names to implementations of one op and resolves `backend="auto"`.

  A named backend either runs or raises. `"auto"` tries the platform's order and moves to the next
  implementation only when one raises `NotImplementedError` ("this backend does not apply").
  """

  def __init__(
      self,
      op_name: str,
      implementations: Mapping[str, Callable[..., Any]],
      auto_order: Mapping[str, Sequence[str]],
  ):
    self.op_name = op_name
    self.implementations: dict[str, Callable[..., Any]] = dict(implementations)
    self._auto_order = {k: tuple(v) for k, v in auto_order.items()}

  def register_optional(self, name: str, module: str, attribute: str | tuple[str, ...], wrap=None) -> None:
    """Registers `module.attribute` (or `wrap(*attributes)`) as backend `name` if the module imports."""
    names = (attribute,) if isinstance(attribute, str) else attribute
    try:
      loaded = importlib.import_module(module)
      parts = [getattr(loaded, n) for n in names]
    except ImportError:
      return
    self.implementations[name] = parts[0] if wrap is None else wrap(*parts)

  def candidates(self, backend: str) -> tuple[str, ...]:
    """The implementation names to try, in order, for `backend`.

    Raises:
      ValueError: `backend` is not a known name.
      NotImplementedError: `backend` names an implementation that is not available here.
    """
    if backend == "auto":
      order = self._auto_order.get(platform(), self._auto_order["default"])
      names = tuple(n for n in order if n in self.implementations)
      if not names:
        raise NotImplementedError(f"{self.op_name}: no backend is available on {platform()!r}.")
      return names
    if backend in self.implementations:
      return (backend,)
    if backend in BACKEND_NAMES:
      raise NotImplementedError(
          f"{self.op_name}: backend={backend!r} is not available; available: "
          f"{sorted(self.implementations)}."
      )
    raise ValueError(
        f"{self.op_name}: unknown {backend=}; expected 'auto' or one of {sorted(self.implementations)}."
    )

  def run(self, names: Sequence[str], *args, **kwargs):
    """Calls the first implementation in `names` that does not raise `NotImplementedError`."""
    errors = []
    for name in names:
      try:
        return self.implementations[name](*args, **kwargs)
      except NotImplementedError as e:
        errors.append(e)
    if len(errors) == 1:
      raise errors[0]
    raise ExceptionGroup(f"{self.op_name}: every backend in {tuple(names)} declined", errors)
