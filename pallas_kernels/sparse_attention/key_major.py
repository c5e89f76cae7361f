"""The deterministic backward's second pass: dk/dv rows summed key by key, in a fixed order, without atomics.

The first pass (`_backward_kernel` with `deterministic=True`) writes each (query token, head block,
slot) program's dK row (and dV row) into its own slot of a contribution slab instead of adding it
at the key. Here `transposed_selection` sorts one query chunk's selection by key in XLA, and
`key_major_sum` runs one program per (batch, block of `key_block` keys, KV group): each key's
accumulator row starts from the running dk (the earlier chunks' sum) and adds, one f32 add at a
time, the rows of its entries in ascending (query token, slot) order, and within an entry the
group's head blocks in ascending order. Each key is owned by one program and written once, so the
result is bit-identical run to run, and (chunks continue the same sequential sum) for any chunk
size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def transposed_selection(indices, num_keys: int, S_pad: int, n_blocks: int):
  """The chunk's selection sorted by key: (rows i32[B, T*K_pad], start i32[B, S_pad], count i32[B, S_pad]).

  Args:
    indices: int32[B, T, K_pad], the chunk's selection (-1 or anything outside [0, num_keys): skipped).
    num_keys: S, the number of real keys.
    S_pad: the padded key count (accumulator rows).
    n_blocks: head blocks per token (the slab's second axis).

  Returns:
    rows: for each valid entry in (key, token, slot) order, the slab row of its head block 0,
      `(t * n_blocks) * K_pad + j` (head block h is `h * K_pad` further); invalid entries last.
    start, count: key s's entries are `rows[start[s] : start[s] + count[s]]`; one per occurrence,
      so a duplicate index counts once each.
  """
  B, T, K_pad = indices.shape
  flat = indices.reshape(B, T * K_pad)
  key = jnp.where((flat >= 0) & (flat < num_keys), flat, S_pad)  # S_pad sorts after every key, never counted
  order = jnp.argsort(key, axis=1, stable=True)  # stable: equal keys keep (token, slot) order
  sorted_key = jnp.take_along_axis(key, order, axis=1)
  t, j = order // K_pad, order % K_pad
  rows = (t * (n_blocks * K_pad) + j).astype(jnp.int32)
  bounds = jax.vmap(lambda k: jnp.searchsorted(k, jnp.arange(S_pad + 1), side="left", method="scan_unrolled"))(
      sorted_key)  # unrolled: no while loop on the GPU
  bounds = bounds.astype(jnp.int32)
  return rows, bounds[:, :-1], bounds[:, 1:] - bounds[:, :-1]


def _key_major_sum_kernel(start_ref, count_ref, rows_ref, *refs, n_slabs, blocks_per_group, K_pad):
  # Inputs: start, count [key_block], rows [T * K_pad], slabs [T * n_blocks * K_pad, d_i] ...,
  # then the running sums [key_block, d_i] ... (aliased to the outputs).
  # Outputs: the running sums [key_block, d_i] ... with this chunk's rows added.
  slab_refs, acc_refs, out_refs = refs[:n_slabs], refs[n_slabs : 2 * n_slabs], refs[2 * n_slabs :]
  first_block = pl.program_id(2) * blocks_per_group
  start, count = start_ref[...], count_ref[...]
  steps = jnp.max(count)

  @pl.when(steps > 0)  # a key block nobody selected keeps its sums (the output aliases them)
  def _():
    def step(c, accs):
      live = c < count
      row0 = rows_ref[jnp.where(live, start + c, 0)]  # [key_block]; dead lanes read (and drop) entry 0
      accs = list(accs)
      for hb in range(blocks_per_group):
        row = row0 + (first_block + hb) * K_pad
        for i, slab_ref in enumerate(slab_refs):
          accs[i] = accs[i] + jnp.where(live[:, None], slab_ref[row, :], 0.0)
      return tuple(accs)

    accs = jax.lax.fori_loop(0, steps, step, tuple(r[...] for r in acc_refs))
    for out_ref, acc in zip(out_refs, accs):
      out_ref[...] = acc


def key_major_sum(slabs, rows, start, count, accs, *, blocks_per_group: int, key_block: int,
                  num_warps: int = 4, interpret: bool = False):
  """`accs[b, s, g] += ` every slab row of key s's entries, in the module docstring's order.

  Args:
    slabs: f32[B, T, n_blocks, K_pad, d_i] per part, the first pass's rows (n_blocks = G * blocks_per_group).
    rows, start, count: `transposed_selection` of the chunk.
    accs: f32[B, S_pad, G, d_i] per part, the running sums.
    blocks_per_group: head blocks per KV group; group g owns blocks [g * bpg, (g + 1) * bpg).
    key_block: keys per program (a power of two; capped at S_pad).

  Returns:
    The updated accs, f32[B, S_pad, G, d_i] each (aliased: XLA updates them in place).
  """
  B, T, n_blocks, K_pad, _ = slabs[0].shape
  S_pad, G = accs[0].shape[1], accs[0].shape[2]
  key_block = min(key_block, S_pad)
  n_rows = T * n_blocks * K_pad
  flat = [s.reshape(B, n_rows, s.shape[-1]) for s in slabs]
  keys = pl.BlockSpec((None, key_block), lambda b, s, g: (b, s))
  in_specs = ([keys, keys, pl.BlockSpec((None, T * K_pad), lambda b, s, g: (b, 0))]
              + [pl.BlockSpec((None, n_rows, s.shape[-1]), lambda b, s, g: (b, 0, 0)) for s in flat]
              + [pl.BlockSpec((None, key_block, None, a.shape[-1]), lambda b, s, g: (b, s, g, 0)) for a in accs])
  n_in = len(in_specs)
  return pl.pallas_call(
      functools.partial(_key_major_sum_kernel, n_slabs=len(slabs), blocks_per_group=blocks_per_group, K_pad=K_pad),
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in accs],
      grid=(B, S_pad // key_block, G),
      in_specs=in_specs,
      out_specs=in_specs[n_in - len(accs):],
      input_output_aliases={n_in - len(accs) + i: i for i in range(len(accs))},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="hyscale_sparse_attention_bwd_key_major",
  )(start, count, rows, *flat, *accs)


def chunked_backward(first_pass, lay, rows, grad_dims, config):
  """The deterministic backward: (dq parts, f32 dk/dv sums [B, S_pad, G, d] per `grad_dims`).

  Query chunks of as many rows as `config.chunk_bytes` of slabs hold run in order in one
  fori_loop (one compiled body): `first_pass` gives the chunk's dq and slabs, then `key_major_sum`
  adds the slabs onto the running sums. The last chunk starts early so that all chunks have one
  length; the rows it repeats get an empty selection (their dq is kept from before), so each
  (token, slot) is summed exactly once and the order is the module docstring's for any chunk size.

  Args:
    first_pass: `(chunk layout, chunk rows) -> (dq parts, slabs)`, the backward kernel with
      `deterministic=True` (`sparse_attention._backward_call`).
    lay: the whole call's `_Layout`; chunks use it with `T` replaced.
    rows: the per-query operands [B, T, ...]: q parts, then indices i32[B, T, K_pad], dout, lse, delta.
    grad_dims: widths of the dk parts (and dv).
    config: its `chunk_bytes`, `key_block` and `num_warps` are used.
  """
  n, n_blocks = len(lay.parts), lay.grid[2]
  per_row = lay.B * n_blocks * lay.K_pad
  # Each slab stays under 2^31 elements: Triton indexes it with int32 offsets.
  chunk = max(1, min(lay.T, config.chunk_bytes // (4 * per_row * sum(grad_dims)),
                     (2**31 - 1) // (per_row * max(grad_dims))))
  chunk_lay = dataclasses.replace(lay, T=chunk)

  def body(c, carry):
    dqs, sums = carry
    first = jnp.minimum(c * chunk, lay.T - chunk)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, chunk, axis=1)
    repeated = (first + jnp.arange(chunk) < c * chunk)[None, :, None]  # rows the previous chunk did
    chunk_rows = [take(x) for x in rows]
    chunk_rows[n] = jnp.where(repeated, -1, chunk_rows[n])
    new_dqs, slabs = first_pass(chunk_lay, chunk_rows)
    dqs = [jax.lax.dynamic_update_slice_in_dim(dq, jnp.where(repeated[..., None], take(dq), new), first, axis=1)
           for dq, new in zip(dqs, new_dqs)]
    selection = transposed_selection(chunk_rows[n], lay.S, lay.S_pad, n_blocks)
    sums = key_major_sum(slabs, *selection, sums, blocks_per_group=n_blocks // lay.G, key_block=config.key_block,
                         num_warps=config.num_warps, interpret=lay.interpret)
    return dqs, list(sums)

  init = ([jnp.zeros((lay.B, lay.T, lay.H_pad, d), rows[0].dtype) for d in lay.parts],
          [jnp.zeros((lay.B, lay.S_pad, lay.G, d), jnp.float32) for d in grad_dims])
  return jax.lax.fori_loop(0, -(-lay.T // chunk), body, init)
