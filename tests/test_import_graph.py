"""The import graph of hyscale_jax and pallas_kernels, read with `ast` (nothing is imported): no circles, and
imports run one way, training -> models -> layers -> ops -> kernels (`parallel` between layers and ops)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("hyscale_jax", "pallas_kernels")
# importer's layer -> layers it must not import (nothing imports upward); the kernels import no hyscale_jax.
FORBIDDEN = {
    "kernels": ("hyscale_jax",),
    "ops": ("parallel", "layers", "models", "training"),
    "parallel": ("layers", "models", "training"),
    "layers": ("models", "training"),
    "models": ("training",),
}
# Calls that import a module named by a string: the registries' optional backends.
_STRING_IMPORTS = ("import_module", "register_optional")
# Files that still reach into another file's private names, to be cut as the circles were (issue 55):
# mgpu_backward runs mgpu_forward's gather pipeline (`fwd._gather_steps`, `fwd._c`, ...); file_data
# writes and tokenizes with text_data's `_atomic_write` and `_tokenizers`.
_PRIVATE_USE_TO_CUT = {
    ("pallas_kernels.sparse_attention.mgpu_backward", "pallas_kernels.sparse_attention.mgpu_forward"),
    ("hyscale_jax.training.file_data", "hyscale_jax.training.text_data"),
}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every .py file of the packages (a package is its __init__.py)."""
  modules = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


MODULES = _modules()
# Each file's nodes that the checks read, from one walk of its tree.
NODES = {name: [node for node in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(node, (ast.Import, ast.ImportFrom, ast.Call, ast.Attribute))]
         for name, path in MODULES.items()}


def _project_module(name: str | None) -> str | None:
  """The project module `name` imports: itself, or the longest package prefix of an attribute path."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(module: str) -> dict[str, int]:
  """Project modules that `module` imports anywhere in its file (functions included) -> the first line.
  `from package import name` counts as importing `package.name` where that is a module, else `package`;
  relative imports are resolved, and so are string-named imports (`_STRING_IMPORTS`)."""
  package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
  found = {}

  def add(target, node):
    target = _project_module(target)
    if target and target != module:
      found.setdefault(target, node.lineno)

  for node in NODES[module]:
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name, node)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
      for alias in node.names:
        add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base, node)
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in _STRING_IMPORTS:
      for arg in node.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.split(".")[0] in PACKAGES:
          add(arg.value, node)
  return found


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> str:
  """A module's layer: "kernels" for pallas_kernels, else its hyscale_jax subpackage or module ("ops", ...)."""
  if module.startswith("pallas_kernels"):
    return "kernels"
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "hyscale_jax"


def _upward(layer: str, target: str) -> bool:
  if layer == "kernels":
    return target.startswith("hyscale_jax")
  return _layer(target) in FORBIDDEN[layer]


def _cycle() -> list[str] | None:
  """One import circle as [a, b, ..., a], or None (depth-first search, colouring the modules)."""
  state, stack = {}, []

  def visit(module):
    state[module] = "open"
    stack.append(module)
    for target in GRAPH[module]:
      if state.get(target) == "open":
        return stack[stack.index(target):] + [target]
      if target not in state and (found := visit(target)):
        return found
    stack.pop()
    state[module] = "done"
    return None

  for module in sorted(GRAPH):
    if module not in state and (found := visit(module)):
      return found
  return None


def test_graph_sees_every_kind_of_import():
  """The parser finds the forms the checks rely on (else an empty graph would pass them)."""
  assert "pallas_kernels.flash_topk.flash_topk" in GRAPH["pallas_kernels.flash_topk.mosaic_pass"]  # from a.b import c
  assert "hyscale_jax.ops._streaming" in GRAPH["hyscale_jax.ops.flash_topk.pallas"]  # from package import module
  assert "hyscale_jax.ops.flash_topk.pallas" in GRAPH["hyscale_jax.ops.flash_topk.api"]  # register_optional
  assert "pallas_kernels.flash_topk.mgpu_scores" in GRAPH["pallas_kernels.flash_topk.flash_topk"]  # in a function
  assert sum(map(len, GRAPH.values())) > 200


def test_no_import_circles():
  cycle = _cycle()
  assert cycle is None, "import circle: " + " -> ".join(
      f"{a} (line {GRAPH[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_run_one_way(layer):
  upward = [f"{module}:{line} imports {target} ({_layer(target)})"
            for module, targets in sorted(GRAPH.items()) if _layer(module) == layer
            for target, line in sorted(targets.items()) if _upward(layer, target)]
  assert not upward, "\n".join(upward)


def test_no_private_names_across_files():
  """A name two files share is public in a module both import (`from m import _x` or `m._x` is not)."""
  found = []
  for module, nodes in sorted(NODES.items()):
    aliases, attributes = {}, []  # local name -> the project module it binds; `name._private` nodes
    for node in nodes:
      if isinstance(node, ast.Attribute):
        if node.attr.startswith("_") and not node.attr.startswith("__") and isinstance(node.value, ast.Name):
          attributes.append(node)
      elif isinstance(node, ast.ImportFrom):
        for alias in node.names:
          target = _project_module(f"{node.module}.{alias.name}") if node.module and not node.level else None
          if target == f"{node.module}.{alias.name}":
            aliases[alias.asname or alias.name] = target
          elif alias.name.startswith("_") and node.module and node.module.split(".")[0] in PACKAGES:
            found.append(f"{module}:{node.lineno} imports {node.module}.{alias.name}")
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.asname and _project_module(alias.name) == alias.name:
            aliases[alias.asname] = alias.name
    for node in attributes:
      target = aliases.get(node.value.id)
      if target and f"{target}.{node.attr}" not in MODULES and (module, target) not in _PRIVATE_USE_TO_CUT:
        found.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
  assert not found, "\n".join(found)
