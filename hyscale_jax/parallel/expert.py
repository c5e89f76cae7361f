"""Expert parallelism with `jax.shard_map`: routed experts split over the `expert` mesh axis.

Outside the MoE the `expert` axis splits the batch (with `data` and `fsdp`), so each device holds
its own tokens. Inside, each device holds E / n of the experts. A device sorts its token copies by
expert, sends each copy to the device that owns its expert with one all-to-all, runs its local
experts as grouped matmuls, and a second all-to-all brings the outputs back to the tokens'
devices. No token is dropped: a device may receive every copy of every sender, so the receive
buffer is sized for that (n x the local copies); the matmuls skip the unused rows.

On GPU the two exchanges are `jax.lax.ragged_all_to_all`s instead: each device sends only its filled
rows, packed, and receives the senders' blocks back to back (the receive buffer is still sized for
the worst case, n x the local copies). XLA:CPU does not implement it ("UNIMPLEMENTED: HLO opcode
`ragged-all-to-all`"), so on CPU the dense all-to-all (every block padded to the local copies) keeps
this path testable; tests/test_expert_parallel.py runs the ragged bookkeeping on CPU with an emulated
exchange and lowers the real one for CUDA.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hyscale_jax.sharding import BATCH_AXES, CONTEXT_AXIS, EXPERT_AXIS


def expert_mesh():
  """The ambient mesh when it splits the experts (an `expert` axis of size > 1), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    return None
  if any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):  # already inside a shard_map
    return None
  return mesh if mesh.shape[EXPERT_AXIS] > 1 else None


def expert_parallel(x, expert_ids, expert_weights: tuple, grouped_fn: Callable, *, mesh, ragged: bool | None = None):
  """Runs each token copy through its expert, the experts split over `mesh`'s `expert` axis.

  Args:
    x: [B, T, D] tokens, split over the batch axes (including `expert`) and `context`.
    expert_ids: i32[B, T, K] the chosen (global) expert of each of a token's K copies.
    expert_weights: arrays [E, ...] stacked by expert; each device receives its E / n rows.
    grouped_fn: `grouped_fn(rows [R, D], group_sizes i32[E / n], *local_weights) -> f32[R, D]`, the
      experts on rows sorted by local expert (rows past sum(group_sizes) are padding).
    mesh: from `expert_mesh()`.
    ragged: exchange with `ragged_all_to_all` (only filled rows) instead of padded blocks; None
      chooses by platform (GPU: ragged).

  Returns:
    (f32[B, T, K, D] each copy's expert output, i32[E] copies per expert over the whole batch).

  Raises:
    ValueError: the expert axis does not divide E, or the token axes do not divide B or T.
  """
  n, E = mesh.shape[EXPERT_AXIS], expert_weights[0].shape[0]
  if E % n:
    raise ValueError(f"n_routed_experts={E} must divide over mesh axis {EXPERT_AXIS!r} of size {n}.")
  batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  seq = CONTEXT_AXIS if CONTEXT_AXIS in mesh.axis_names and mesh.shape[CONTEXT_AXIS] > 1 else None
  B, T = x.shape[:2]
  split_b = 1
  for a in batch:
    split_b *= mesh.shape[a]
  if B % split_b or (seq and T % mesh.shape[seq]):
    raise ValueError(f"x.shape={tuple(x.shape)}: batch must divide over {batch} ({split_b}) and length over "
                     f"{seq!r} for expert parallelism.")
  tokens = P(batch, seq)
  token_axes = batch + ((seq,) if seq else ())
  dispatch = _dispatch_ragged if (jax.default_backend() == "gpu" if ragged is None else ragged) else _dispatch

  def body(x, ids, *weights):
    b, t, D = x.shape
    K = ids.shape[-1]
    out, counts = dispatch(x.reshape(b * t, D), ids.reshape(b * t, K), weights, grouped_fn, n, E // n)
    return out.reshape(b, t, K, D), jax.lax.psum(counts, token_axes)

  return jax.shard_map(
      body, mesh=mesh, in_specs=(tokens, tokens) + (P(EXPERT_AXIS),) * len(expert_weights),
      out_specs=(tokens, P()), check_vma=False,
  )(x, expert_ids, *expert_weights)


def sort_by_expert(x, expert_ids, n_experts: int):
  """Each token's K copies sorted by expert, so each expert's rows are contiguous for a grouped matmul.

  Args:
    x: [N, D] tokens; expert_ids: i32[N, K] the expert of each copy; n_experts: E.

  Returns:
    (order i32[N*K]: sorted copy j is copy order[j] of the flattened (token, k) slots, counts i32[E]
    copies per expert, rows [N*K, D] = x[order // K]).
  """
  slots = expert_ids.reshape(-1)  # [N*K]
  order = jnp.argsort(slots, stable=True)  # [N*K]
  counts = jnp.bincount(slots, length=n_experts).astype(jnp.int32)  # [E]
  return order, counts, x[order // expert_ids.shape[1]]


def _unsort(sorted_rows, order, N: int, K: int):
  """Rows [N*K, D] in sorted-copy order back to each token's copies: [N, K, D]."""
  return jnp.zeros_like(sorted_rows).at[order].set(sorted_rows).reshape(N, K, -1)


def _dispatch(x, ids, weights, grouped_fn, n: int, e_local: int):
  """One device's part: send copies to their experts' devices, run the local experts, bring back.

  x: [N, D] local tokens; ids: i32[N, K] global experts. Returns (f32[N, K, D], i32[E] local counts).
  """
  N, D = x.shape
  K = ids.shape[1]
  C = N * K  # local copies: the most one device can send to one other
  order, counts, rows = sort_by_expert(x, ids, n * e_local)  # [C], [E], [C, D] sorted by global expert
  dest = ids.reshape(-1)[order] // e_local  # [C] owning device, non-decreasing
  send_counts = counts.reshape(n, e_local).sum(axis=1)  # [n]
  pos = jnp.arange(C) - (jnp.cumsum(send_counts) - send_counts)[dest]  # [C] row within its block
  send = jnp.zeros((n, C, D), x.dtype).at[dest, pos].set(rows)  # [n, C, D], block d goes to device d
  recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True)  # [n, C, D], block s came from s
  recv_counts = jax.lax.all_to_all(counts.reshape(n, e_local), EXPERT_AXIS, 0, 0, tiled=True)  # [n, E/n]

  # Each received block is sorted by local expert; regroup all blocks by local expert.
  ends = jnp.cumsum(recv_counts, axis=1)  # [n, E/n]
  local_expert = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(C), side="right", method="scan_unrolled"))(
      ends)  # [n, C]; unrolled: no while loop on the GPU
  regroup = jnp.argsort(local_expert.reshape(-1), stable=True)  # [n*C], padding (E/n) last
  out = grouped_fn(recv.reshape(n * C, D)[regroup], recv_counts.sum(axis=0), *weights)  # f32[n*C, D]
  out = jnp.zeros_like(out).at[regroup].set(out).reshape(n, C, D)  # back in received order

  back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=True)  # [n, C, D], block d from device d
  mine = back[dest, pos]  # [C, D] in sorted-copy order
  return _unsort(mine, order, N, K), counts


def _dispatch_ragged(x, ids, weights, grouped_fn, n: int, e_local: int):
  """`_dispatch` with ragged exchanges: only filled rows travel, packed sender after sender.

  x: [N, D] local tokens; ids: i32[N, K] global experts. Returns (f32[N, K, D], i32[E] local counts).
  """
  N, D = x.shape
  K = ids.shape[1]
  C = N * K
  order, counts, rows = sort_by_expert(x, ids, n * e_local)  # sorted by global expert, so by owning device
  me = jax.lax.axis_index(EXPERT_AXIS)
  every = jax.lax.all_gather(counts, EXPERT_AXIS).reshape(n, n, e_local)  # [sender, owner, local expert]
  sent = every.sum(-1)  # [sender, receiver] rows
  recv_counts = jax.lax.dynamic_index_in_dim(every, me, axis=1, keepdims=False)  # [sender, E/n]
  exclusive = lambda a, axis: jnp.cumsum(a, axis=axis) - a
  send_sizes, recv_sizes = sent[me], sent[:, me]  # [n], [n]
  send_starts, recv_starts = exclusive(send_sizes, 0), exclusive(recv_sizes, 0)  # [n], [n]
  # My block lands on receiver j after the blocks of the senders before me.
  recv = _ragged_all_to_all(rows, jnp.zeros((n * C, D), x.dtype), send_starts, send_sizes,
                            exclusive(sent, 0)[me], recv_sizes, axis_name=EXPERT_AXIS)  # [n*C, D] packed

  # Received rows run (sender, local expert)-major; regroup by local expert, unused rows last.
  segment = jnp.searchsorted(jnp.cumsum(recv_counts.reshape(-1)), jnp.arange(n * C), side="right",
                             method="scan_unrolled")  # [n*C]; unrolled: no while loop on the GPU
  local_expert = jnp.where(segment < n * e_local, segment % e_local, e_local)
  regroup = jnp.argsort(local_expert, stable=True)  # [n*C]
  out = grouped_fn(recv[regroup], recv_counts.sum(axis=0), *weights)  # f32[n*C, D]
  out = jnp.zeros_like(out).at[regroup].set(out)  # back in received order

  # Sender s gets its rows back where it sent them from: its send start for me.
  mine = _ragged_all_to_all(out, jnp.zeros((C, D), out.dtype), recv_starts, recv_sizes,
                            exclusive(sent, 1)[:, me], send_sizes, axis_name=EXPERT_AXIS)  # [C, D]
  return _unsort(mine, order, N, K), counts


# The exchange `_dispatch_ragged` uses; tests swap in an emulation to run it on CPU devices.
_ragged_all_to_all = jax.lax.ragged_all_to_all
