"""Rematerialization vocabulary: the checkpoint names the ops tag, and the policies built from them.

Selection replay: `ops.flash_topk` tags its outputs with `SELECTION` right where they are made, and
`ops.sparse_attention` tags its `out` and `lse` with `ATTENTION_OUT` / `ATTENTION_LSE`. The
`"selection_replay"` policy saves exactly these, so the backward pass of a rematerialized layer
reuses the forward pass's selection (no second top-k) and the attention's residuals (no second
attention forward), and recomputes everything else. It also saves `INDEXER_GRADS` where the
indexer loss computes its gradient in the forward pass, so the loss is not recomputed either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar, get_args

import jax
from jax.ad_checkpoint import checkpoint_name

SELECTION = "hyscale_selection"
ATTENTION_OUT = "hyscale_attention_out"
ATTENTION_LSE = "hyscale_attention_lse"
# The indexer loss's gradient, computed in its forward pass (`ops.indexer_loss(grad_in_forward=True)`).
INDEXER_GRADS = "hyscale_indexer_grads"
# The named scope (`jax.named_scope`) of a scan over layers: `count_named_equations` counts its body
# per layer. Scopes reach the scan equations, forward and transposed, not the equations inside them.
LAYER_SCAN = "hyscale_layer_scan"

RematPolicy = Literal["selection_replay", "full", "none"]
REMAT_POLICIES: tuple[str, ...] = get_args(RematPolicy)

F = TypeVar("F", bound=Callable)


def tag(x, name: str):
  """Names every array in the pytree `x` for the remat policies (identity otherwise)."""
  return jax.tree.map(lambda a: checkpoint_name(a, name), x)


def checkpoint_policy(policy: RematPolicy, *, save_attention: bool = True):
  """The `jax.checkpoint` policy for a policy name, or None for `"none"` (no rematerialization).

  - `"selection_replay"`: save the selection, the attention's out/lse and (when present) the
    indexer loss's forward-pass gradient; recompute the rest. With `save_attention=False` the
    attention's out/lse are recomputed too (one more attention forward, [B, T, H, Dv] less saved).
  - `"full"`: save nothing; the backward pass reruns selection (the Megatron-style baseline).
  - `"none"`: no remat; every residual is kept.

  Raises:
    ValueError: `policy` is not one of REMAT_POLICIES.
  """
  if policy == "selection_replay":
    attention = (ATTENTION_OUT, ATTENTION_LSE) if save_attention else ()
    return jax.checkpoint_policies.save_only_these_names(SELECTION, *attention, INDEXER_GRADS)
  if policy == "full":
    return jax.checkpoint_policies.nothing_saveable
  if policy == "none":
    return None
  raise ValueError(f"remat {policy=!r} is not one of {REMAT_POLICIES}.")


def remat(fn: F, policy: RematPolicy = "selection_replay", *, prevent_cse: bool = True,
          save_attention: bool = True) -> F:
  """Wraps `fn` in `jax.checkpoint` with the named policy (returns `fn` itself for `"none"`)."""
  jax_policy = checkpoint_policy(policy, save_attention=save_attention)
  if policy == "none":
    return fn
  return jax.checkpoint(fn, policy=jax_policy, prevent_cse=prevent_cse)


def count_named_equations(jaxpr, fragment: str = "flash_topk") -> int:
  """Counts equations whose `name` parameter contains `fragment`, without looking inside them.

  `count_named_equations(jax.make_jaxpr(jax.grad(loss))(...))` is how many selections a training
  step asks for: one per indexer layer under `"selection_replay"`, two under `"full"`. A scan over
  layers (called under `jax.named_scope(LAYER_SCAN)`) appears once in the jaxpr and counts `length`
  times; other loops (a layer's query chunks) count once.
  """
  import jax.extend.core  # noqa: PLC0415  (jax.extend must be imported explicitly)

  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  # Autodiff hoists the loop-invariant part of a scan body's equations (a flash_topk's masks and
  # initial values) out of the loop as an equation of the same name that only feeds the scan.
  consumers: dict = {}
  for eqn in jaxpr.eqns:
    for var in eqn.invars:
      if isinstance(var, jax.extend.core.Var):
        consumers.setdefault(var, set()).add(eqn.primitive.name)
  for var in jaxpr.outvars:
    if isinstance(var, jax.extend.core.Var):
      consumers.setdefault(var, set()).add("output")
  hoisted = lambda eqn: all(consumers.get(var, set()) <= {"scan"} for var in eqn.outvars)
  count = 0
  for eqn in jaxpr.eqns:
    if fragment in str(eqn.params.get("name", "")):
      count += not hoisted(eqn)
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      inner = count_named_equations(sub, fragment)
      layer_scan = eqn.primitive.name == "scan" and LAYER_SCAN in str(eqn.source_info.name_stack)
      count += inner * (eqn.params["length"] if layer_scan else 1)
  return count
