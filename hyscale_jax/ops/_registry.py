"""One backend registry per public op: a name -> implementation table with tokamax-style dispatch."""

from __future__ import annotations

import importlib
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax

Backend = Literal["auto", "pallas", "reference", "xla_baseline"]
BACKEND_NAMES: tuple[str, ...] = ("pallas", "reference", "xla_baseline")
# What a backend runs, where its registration does not say (`register_optional(kernel=...)`).
_KERNELS = {"reference": "jnp", "xla_baseline": "jnp"}

_LOG = logging.getLogger(__name__)

# A description of what a backend runs: a fixed string, or a function of (the backend's imported module,
# whether the device is a Hopper GPU: None where that is unknown) that reads the kernel's Config.
Kernel = str | Callable[[Any, bool | None], str]


class BackendUnavailableError(ImportError):
  """A backend asked for by name whose module failed to import; the message carries the import error."""


class ImportFailure(NamedTuple):
  """Why an optional backend is missing: the module that failed to import, and its ImportError."""

  module: str
  error: ImportError

  def __str__(self) -> str:
    return f"import {self.module} failed: {type(self.error).__name__}: {self.error}"


def platform() -> str:
  """The platform of JAX's default backend: "gpu", "cpu" or "tpu"."""
  return jax.default_backend()


class BackendRegistry:
  """Maps backend names to implementations of one op and resolves `backend="auto"`.

  A named backend either runs or raises. `"auto"` tries the platform's order and moves to the next
  implementation only when one raises `NotImplementedError` ("this backend does not apply"). An optional
  backend whose module fails to import is kept with the reason (`unavailable`): by name it raises
  `BackendUnavailableError`; "auto" logs a warning, once, and skips it.
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
    self.unavailable: dict[str, ImportFailure] = {}  # optional backends whose module did not import
    self._kernels: dict[str, tuple[Kernel, Any]] = {}  # name -> (description, the module it reads)
    self._warned = False

  def register_optional(self, name: str, module: str, attribute: str | tuple[str, ...], wrap=None, *,
                        kernel: Kernel | None = None) -> None:
    """Registers `module.attribute` (or `wrap(*attributes)`) as backend `name` if the module imports.

    If it does not, the failure is kept (`unavailable`): asking for `name` then raises
    `BackendUnavailableError` with the import error, and "auto" warns once and runs the next backend.
    `kernel` says what the backend runs, for `describe` (a `Kernel`).
    """
    names = (attribute,) if isinstance(attribute, str) else attribute
    try:
      loaded = importlib.import_module(module)
      parts = [getattr(loaded, n) for n in names]
    except ImportError as e:
      self.unavailable[name] = ImportFailure(module, e)
      return
    self.implementations[name] = parts[0] if wrap is None else wrap(*parts)
    if kernel is not None:
      self._kernels[name] = (kernel, loaded)

  def candidates(self, backend: str) -> tuple[str, ...]:
    """The implementation names to try, in order, for `backend`.

    Raises:
      ValueError: `backend` is not a known name.
      BackendUnavailableError: `backend` names an optional implementation whose module failed to import.
      NotImplementedError: `backend` names an implementation that is not available here.
    """
    if backend == "auto":
      order = self.auto_order()
      names = tuple(n for n in order if n in self.implementations)
      self._warn_unavailable(order)
      if not names:
        raise NotImplementedError(f"{self.op_name}: no backend is available on {platform()!r}.")
      return names
    if backend in self.implementations:
      return (backend,)
    if backend in self.unavailable:
      raise BackendUnavailableError(
          f"{self.op_name}: backend={backend!r} is unavailable: {self.unavailable[backend]}"
      ) from self.unavailable[backend].error
    if backend in BACKEND_NAMES:
      raise NotImplementedError(
          f"{self.op_name}: backend={backend!r} is not available; available: "
          f"{sorted(self.implementations)}."
      )
    raise ValueError(
        f"{self.op_name}: unknown {backend=}; expected 'auto' or one of {sorted(self.implementations)}."
    )

  def auto_order(self, platform_name: str | None = None) -> tuple[str, ...]:
    """The backend names "auto" tries on `platform_name` (None: JAX's default backend), available or not."""
    return self._auto_order.get(platform_name or platform(), self._auto_order["default"])

  def _warn_unavailable(self, order: Sequence[str]) -> None:
    """Logs once per registry that "auto" skips a backend it would have tried first, and why."""
    missing = [n for n in order if n in self.unavailable]
    if missing and not self._warned:
      self._warned = True
      _LOG.warning("%s: backend 'auto' skips %s; using %s.", self.op_name,
                   "; ".join(f"{n!r} ({self.unavailable[n]})" for n in missing),
                   next((repr(n) for n in order if n in self.implementations), "nothing"))

  def describe(self, backend: str = "auto", platform_name: str | None = None, hopper: bool | None = None) -> str:
    """What `backend` runs on `platform_name` (None: here), e.g. "pallas (Triton)", "reference (jnp)" or
    "reference (pallas unavailable: import ... failed: ...)". `hopper`: whether the device is a Hopper
    GPU, None if unknown. Never raises: an unusable name is described as such."""
    platform_name = platform_name or platform()
    if backend == "auto":
      order = self.auto_order(platform_name)
      chosen = next((n for n in order if n in self.implementations), None)
      skipped = [n for n in itertools.takewhile(lambda n: n != chosen, order) if n in self.unavailable]
      if skipped:
        why = "; ".join(f"{n} unavailable: {self.unavailable[n]}" for n in skipped)
        return f"{chosen or 'none'} ({why})"
      if chosen is None:
        return f"none (no backend for {platform_name!r})"
      return self._describe_one(chosen, platform_name, hopper)
    if backend in self.implementations:
      return self._describe_one(backend, platform_name, hopper)
    if backend in self.unavailable:
      return f"{backend} (unavailable, raises: {self.unavailable[backend]})"
    if backend in BACKEND_NAMES:
      return f"{backend} (not implemented for this op, raises)"
    return f"{backend} (unknown name, raises)"

  def _describe_one(self, name: str, platform_name: str, hopper: bool | None) -> str:
    kernel, module = self._kernels.get(name, (_KERNELS.get(name), None))
    if module is not None and platform_name != "gpu":  # an optional backend: a Pallas kernel
      return f"{name} (interpret mode)"  # which interprets itself off the GPU
    if callable(kernel):
      kernel = kernel(module, hopper)
    return f"{name} ({kernel})" if kernel else name

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
