"""`relaxed_atomic_add`: Pallas-Triton's atomic add, emitted with relaxed memory ordering.

`plgpu.atomic_add` lowers to `atom.acq_rel`: every add also orders this thread's other memory
operations. A gradient scatter-add needs none of that (nothing reads the accumulator until the
kernel has finished), and the relaxed form ran the sparse-attention backward several times faster
(docs/kernels/sparse_attention.md). jax's primitive takes no ordering argument, so this registers a
sibling primitive that reuses jax's abstract-eval and interpret-mode (discharge) rules and lowers
with `sem = relaxed`. It uses private jax modules, which the project pins (jax==0.11.2); no public
route reaches it (Pallas-Triton's public `atomic_add` has no ordering argument, and jax-triton would
mean rewriting the whole backward kernel in Triton). `tests/test_relaxed_atomics.py` fails loudly
when jax moves: it checks the pinned version, that the Triton IR for an abstract Hopper GPU has a
relaxed `tt.atomic_rmw fadd` (plgpu's is acq_rel), and the interpret-mode sums against plgpu's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives

_ADD = triton_primitives.AtomicOpType.ADD

relaxed_atomic_add_p = jax_core.Primitive("hyscale_relaxed_atomic_add")
relaxed_atomic_add_p.def_effectful_abstract_eval(triton_primitives._atomic_abstract_eval)
state_discharge.register_discharge_rule(relaxed_atomic_add_p)(triton_primitives._atomic_rmw_discharge_rule)


@lowering.register_lowering(relaxed_atomic_add_p)
def _lowering(ctx, *args_flat, args_tree, atomic_type):
  del atomic_type  # always ADD
  block_info, *_ = ctx.block_infos
  ptr, indexers, val, mask = args_tree.unflatten(args_flat)
  *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
  indexers = list(indexers)
  if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
    indexers.append(indexing.NDIndexer.make_trivial_indexer(ctx.avals_in[0].shape))
  if len(indexers) != 1:
    raise NotImplementedError("relaxed_atomic_add takes a single indexer.")
  ptr = lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
  val = lowering._ensure_ir_value(val, value_aval)
  if mask is not None:
    mask = lowering._ensure_ir_value(mask, mask_aval)
  op = tt_dialect.RMWOp.ADD if value_aval.dtype.kind in "iu" else tt_dialect.RMWOp.FADD
  return lowering._atomic_rmw(op, ptr, val, mask=mask, semantic=tt_dialect.MemSemantic.RELAXED)


def relaxed_atomic_add(ref, idx, val, *, mask=None):
  """`ref[idx] += val` atomically, with no ordering against other memory operations.

  Same indexing and masking as `plgpu.atomic_add`; in interpret mode the same caveats apply (no
  masks, duplicate lanes keep one update).
  """
  ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "relaxed_atomic_add")
  args_flat, args_tree = tree_util.tree_flatten((ref, transforms, val, mask))
  return relaxed_atomic_add_p.bind(*args_flat, args_tree=args_tree, atomic_type=_ADD)


def scatter_add_rows(acc_ref, rows, valid, values, interpret):
  """acc_ref[rows[j], :] += values[j, :] for valid j (values f32[n, d]), duplicate rows adding once each.

  The gradient scatter of the Pallas backward kernels. Interpret mode (CPU tests) differs in one
  way: Pallas's interpret rule for an atomic add reads all lanes, then writes all lanes, so two lanes
  with the same row would lose an update, and it has no masks. So there duplicate rows are first
  summed into their first occurrence, and skipped lanes point past the accumulator (the write is
  dropped); on the GPU the hardware atomics take duplicates as they come and masks skip lanes.
  """
  n, d = values.shape
  if interpret:
    same = (rows[:, None] == rows[None, :]) & valid[:, None] & valid[None, :]
    earlier = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1) < jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    first = valid & ~jnp.any(same & earlier, axis=1)
    values = jax.lax.dot_general((same & first[:, None]).astype(jnp.float32), values,
                                 (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
    rows = jnp.where(first, rows, acc_ref.shape[0])
    mask = None
  else:
    mask = jnp.broadcast_to(valid[:, None], (n, d))
  cols = jax.lax.broadcasted_iota(jnp.int32, (n, d), 1)
  relaxed_atomic_add(acc_ref, (jnp.broadcast_to(rows[:, None], (n, d)), cols), values, mask=mask)
