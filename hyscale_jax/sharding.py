"""Logical axis names of parameters and activations, their mapping to mesh axes, and `shard`.

Layers name the axes of every parameter (`param(EMBED, MLP)`) and of a few activations
(`shard(x, (BATCH, LENGTH, ACT_EMBED))`) by meaning, never by mesh axis. One table of rules,
`config.mesh.rules`, maps each logical name to a mesh axis (or None: replicated), so FSDP, tensor
and expert parallelism are a change of config, not of layer code (MaxText's scheme). The rules are
applied in two places only: `state_shardings` places the training state, and `shard` constrains an
activation under the ambient mesh and `nnx.logical_axis_rules`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Mesh axes. The batch is split over BATCH_AXES (the expert axis doubles as a batch axis outside
# the MoE, as in MaxText), the sequence over CONTEXT_AXIS.
BATCH_AXES = ("data", "fsdp", "expert")
CONTEXT_AXIS = "context"
EXPERT_AXIS = "expert"

# Logical names of parameter axes.
VOCAB = "vocab"
EMBED = "embed"  # D, the model width
HEADS = "heads"  # attention heads (fused with their head dim in the projection kernels)
MLP = "mlp"  # F, the feed-forward inner width
EXP = "exp"  # E, routed experts
Q_LORA = "q_lora"
KV_LORA = "kv_lora"
KV_HEADS = "kv_heads"  # GQA key/value heads
INDEX = "index"  # the lightning indexer's heads x head dim, or its head-dim-wide key
NORM = "norm"  # norm scales and biases, sinks, small per-channel vectors
# Logical names of activation axes.
BATCH = "activation_batch"
LENGTH = "activation_length"
ACT_EMBED = "activation_embed"

Rules = tuple[tuple[str, Any], ...]


def param(*axes: str | None) -> dict:
  """Metadata that gives a parameter its logical axis names, one per array axis.

  Pass it as `kernel_metadata=` / `scale_metadata=` / `embedding_metadata=` to flax layers, or
  as `**param(...)` to `nnx.Param`. Sharding is not applied at creation (models are also built
  with no mesh, e.g. to count parameters); `state_shardings` places the state later.
  """
  return {"out_sharding": tuple(axes), "eager_sharding": False}


def rules_from_config(mesh_config) -> Rules:
  """`config.mesh.rules` as a tuple of (logical name, mesh axis or tuple of axes or None)."""
  rules = tuple((str(name), _axes(target)) for name, target in mesh_config.rules)
  names = [name for name, _ in rules]
  duplicated = sorted({n for n in names if names.count(n) > 1})
  if duplicated:
    raise ValueError(f"config.mesh.rules names {duplicated} more than once; each logical axis needs one rule.")
  return rules


def _axes(target):
  if target is None or isinstance(target, str):
    return target
  return tuple(target)


def logical_to_mesh(axes, rules: Rules) -> P:
  """The PartitionSpec of logical `axes` under `rules`.

  A name without a rule is replicated, and a mesh axis splits at most one dimension: a later
  dimension whose rule names an axis already used stays whole. So `embed` and `q_lora` can both
  map to `fsdp`, and `q_a_proj` [embed, q_lora] splits only its first dimension (MaxText's rule).
  """
  table, used, spec = dict(rules), set(), []
  for name in axes:
    target = table.get(name) if name is not None else None
    names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    names = tuple(a for a in names if a not in used)
    used.update(names)
    spec.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*spec)


def state_shardings(state, mesh: jax.sharding.Mesh, rules: Rules):
  """NamedShardings for a tree of nnx Variables (params, optimizer state) and plain arrays.

  A Variable is split by its logical axis names under `rules`; everything else is replicated.

  Raises:
    ValueError: a mesh axis does not divide the parameter dimension it splits; the message names
      the parameter, its shape and the rule.
  """
  def spec(x):
    if isinstance(x, nnx.Variable):
      axes = x.get_metadata().get("out_sharding")
      return x.replace(logical_to_mesh(axes, rules) if axes else P())
    return P()

  specs = jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  is_spec = lambda x: isinstance(x, P)
  flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
  flat_values = jax.tree.leaves(state)
  for (path, spec), value in zip(flat_specs, flat_values):
    _check_divides(jax.tree_util.keystr(path), value.shape, spec, mesh)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)


def _check_divides(name: str, shape, spec: P, mesh) -> None:
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is None:
      continue
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"parameter {name}: config.mesh.rules map it to mesh axes {unknown}, which are not among "
                       f"the mesh's {mesh.axis_names}.")
    split = math.prod(mesh.shape[a] for a in names)
    if size % split:
      raise ValueError(f"parameter {name} of shape {tuple(shape)}: dimension {dim} ({size}) does not divide over "
                       f"mesh axes {names} of size {split} (spec {spec}); change config.mesh or config.mesh.rules.")


def splitting_axes(mesh, names: tuple[str, ...], size: int) -> tuple[str, ...]:
  """The axes among `names` that split a dimension of `size` under `mesh`: those present with size > 1,
  when their product divides `size`; () otherwise (the dimension stays whole)."""
  names = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
  return names if names and size % math.prod(mesh.shape[a] for a in names) == 0 else ()


def shard(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Constrains activation `x` to logical `axes` under the ambient mesh and rules; else a no-op.

  Axes whose mesh size does not divide the dimension are left unsplit, so tiny shapes still run.
  """
  mesh = jax.sharding.get_abstract_mesh()
  rules = core_spmd.get_logical_axis_rules()
  if mesh is None or mesh.empty or not rules or any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
    return x
  spec = []
  for size, axes_ in zip(x.shape, logical_to_mesh(axes, rules)):
    names = () if axes_ is None else (axes_,) if isinstance(axes_, str) else tuple(axes_)
    spec.append(splitting_axes(mesh, names, size) or None)
  return jax.lax.with_sharding_constraint(x, P(*spec))
