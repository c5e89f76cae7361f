"""train.py's parameters with each scanned group of layers stored stacked (issue 19: compile time).

The model keeps one module per layer (the native and Hugging Face formats, sharding rules and
`model.layers[i]` read that layout), and `Decoder._run_layers` stacks the layer states of a scanned
run inside the step. Trained from per-layer arrays, every step would also slice the stacked
gradient back into one array per (layer, parameter) and update each on its own: at GLM-5.1's 78
layers XLA then compiles about 1,600 slices and their AdamW updates, which made the scanned step
3.3x as slow to compile as a 4-layer one. So the training state holds each group of
`Decoder.scanned_layer_groups()` stacked under `params["layer_stacks"][g]` (leading axis: the
group's layers, unsharded), and with it the AdamW moments. The step's forward takes them `per_layer`
into per-layer views; the decoder's stacking of those views is a concatenation of consecutive
slices of the stored array, which XLA folds back into that array, forward and backward.

A checkpoint written with per-layer parameters (before this layout) restores through
`per_layer`/`stacked` (see `lm._restore`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

STACKS = "layer_stacks"


def _slices(count: int):
  """x [count, ...] -> count arrays x[i]; the backward stacks their cotangents (no per-slice pads)."""

  @jax.custom_vjp
  def split(x):
    return tuple(x[i] for i in range(count))

  split.defvjp(lambda x: (split(x), None), lambda _, cotangents: (jnp.stack(cotangents),))
  return split


def _leaf_stack(*leaves):
  """One leaf of a group: arrays stacked; a Variable keeps its kind, its sharding axes get a leading None."""
  first = leaves[0]
  if isinstance(first, nnx.Variable):
    axes = first.get_metadata().get("out_sharding")
    updates = {} if axes is None else {"out_sharding": (None, *axes)}
    return first.replace(_stack_values([leaf.get_value() for leaf in leaves]), **updates)
  return _stack_values(list(leaves))


def _stack_values(values):
  if isinstance(values[0], jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(values), *values[0].shape), values[0].dtype)
  return jnp.stack(values)


def _leaf_unstack(leaf, count: int) -> list:
  if isinstance(leaf, nnx.Variable):
    axes = leaf.get_metadata().get("out_sharding")
    updates = {} if axes is None else {"out_sharding": tuple(axes[1:])}
    return [leaf.replace(value, **updates) for value in _leaf_unstack(leaf.get_value(), count)]
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)] * count
  return list(_slices(count)(leaf))


_is_leaf = lambda x: isinstance(x, nnx.Variable)
# An nnx.State keeps nested levels as plain dicts (and flattens them so): edit those, rewrap the top.
_raw = lambda m: m.raw_mapping if isinstance(m, nnx.State) else m


def _stack_mapping(tree: Mapping, groups: Sequence[Sequence[int]]):
  layers = dict(_raw(_raw(tree)["layers"]))
  stacks = {g: jax.tree.map(_leaf_stack, *[layers.pop(i) for i in group], is_leaf=_is_leaf)
            for g, group in enumerate(groups)}
  return type(tree)({**_raw(tree), "layers": layers, STACKS: stacks})


def _unstack_mapping(tree: Mapping, groups: Sequence[Sequence[int]]):
  raw = _raw(tree)
  layers = dict(_raw(raw["layers"]))
  for g, group in enumerate(groups):
    leaves, treedef = jax.tree.flatten(_raw(raw[STACKS])[g], is_leaf=_is_leaf)
    parts = [_leaf_unstack(leaf, len(group)) for leaf in leaves]
    for r, layer in enumerate(group):
      layers[layer] = jax.tree.unflatten(treedef, [part[r] for part in parts])
  out = {k: v for k, v in raw.items() if k != STACKS}
  out["layers"] = {i: layers[i] for i in sorted(layers)}
  return type(tree)(out)


def _map_param_trees(tree, fn, holds):
  """`fn` on every mapping of `tree` that `holds` (a params tree: the params, each AdamW moment)."""
  if isinstance(tree, Mapping):
    if holds(_raw(tree)):
      return fn(tree)
    return type(tree)({k: _map_param_trees(v, fn, holds) for k, v in _raw(tree).items()})
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # optax states are NamedTuples
    return type(tree)(*[_map_param_trees(v, fn, holds) for v in tree])
  if isinstance(tree, (list, tuple)):
    return type(tree)(_map_param_trees(v, fn, holds) for v in tree)
  return tree


def stacked(tree, groups: Sequence[Sequence[int]]):
  """`tree` (params, or a state holding params-shaped trees) with each group's layers stacked.

  Every mapping with a `layers` entry holding the groups' layers becomes the same mapping without
  them and with `layer_stacks[g]`: the layer trees of group g, each leaf stacked on a new leading
  axis (an nnx Variable keeps its metadata, its `out_sharding` led by None). Arrays or
  ShapeDtypeStructs. `groups`: `Decoder.scanned_layer_groups()`; empty leaves `tree` as it is.
  """
  if not groups:
    return tree
  members = [i for group in groups for i in group]
  holds = lambda m: isinstance(m.get("layers"), Mapping) and all(i in m["layers"] for i in members)
  return _map_param_trees(tree, lambda m: _stack_mapping(m, groups), holds)


def per_layer(tree, groups: Sequence[Sequence[int]]):
  """The inverse of `stacked`: one tree per layer again, under `layers[i]`.

  On arrays each layer is a slice of the stack whose gradient is the stack of the layers'
  gradients (a custom VJP), so `stacked(per_layer(x))` costs XLA nothing, forward or backward.
  """
  if not groups:
    return tree
  return _map_param_trees(tree, lambda m: _unstack_mapping(m, groups), lambda m: STACKS in m)


__all__ = ["STACKS", "per_layer", "stacked"]
