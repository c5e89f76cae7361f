"""A sparse decoder layer over sequence chunks, with a backward pass that writes in place (issue 19).

`DecoderLayer._chunked_layer` runs the whole layer `chunk` positions at a time: the keys of all T
positions first, then per chunk the pre-norm, queries, selection, attention, indexer loss, residual
and FFN. Written as `jax.lax.scan`s and left to autodiff, every loop's stacked output and every
transposed loop's stacked input cotangent is a fresh [T, D] buffer that XLA zero-fills: one
broadcast shared by all of them (CSE) and copied out of it at the start of the step, so at 1M tokens
five [T, D] buffers of 12 GiB are live before the first layer has run (`bench/memory_proxy.py`).

Here the layer is one `jax.custom_vjp` that owns its buffers:

- forward: the output is written chunk by chunk into a copy of the layer's input (each chunk reads
  its own rows before overwriting them), the selection into a buffer made after the input exists;
- backward: each chunk is recomputed from the saved selection (selection replay: no top-k) and
  pulled back with `jax.vjp`, newest first; its input rows' cotangent overwrites its rows of the
  output's cotangent, so the input's cotangent is the same buffer. The keys' cotangents are summed
  in f32 over the chunks, then pulled back through the keys one chunk at a time into that buffer.

Residuals: the layer's inputs (parameters, x, positions, segment ids, shared indices, token ids)
and the selection, tagged `remat.SELECTION` with the rows counted per chunk (the layer's indexer
loss reads them in its backward pass), so an enclosing `jax.checkpoint` with the
`"selection_replay"` policy keeps them and recomputes nothing else of the forward pass ("full"
recomputes the forward pass, selection included, as its baseline asks). Every policy recomputes
each chunk once in the backward pass, "none" too: keeping every chunk's intermediates is what
running over chunks avoids.

The per-chunk outputs that carry no gradient get none: the expert load (a fraction of routing
slots), the rows counted, and the indexer loss's forward-pass gradient sums (used only in a
value-zero term). The indexer loss itself is differentiated when it has a gradient
(`indexer_loss_grad_in_forward` off). Parameter cotangents are summed over the chunks in the
parameters' dtype, as the scan's transpose sums them.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
from flax import nnx

from hyscale_jax import remat
from hyscale_jax.models.residual import prenorm
from hyscale_jax.ops._streaming import fresh_zeros


def _row_slicing(chunk: int):
  """(take, put) of chunk i's rows along axis 1 of [B, T, ...]: a slice (None passes through), and
  an update in place of those rows."""
  take = lambda a, i: None if a is None else jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1)
  put = lambda buf, rows, i: jax.lax.dynamic_update_slice_in_dim(buf, rows, i * chunk, axis=1)
  return take, put


def _cotangent_rows(take, d_x, i):
  """Chunk i's rows of the cotangent buffer d_x, read out whole before the chunk overwrites them: left
  fused into their readers (some of which, the weights' gradients, the update does not wait for),
  they would make XLA copy all of d_x each step to update it safely."""
  return jax.lax.optimization_barrier(take(d_x, i))


def _accumulate(sums, parts):
  """sums + parts leaf by leaf, in the sums' dtypes."""
  return jax.tree.map(lambda u, v: u + v.astype(u.dtype), sums, parts)


def _zeros_after(tree, after):
  """`fresh_zeros` like each leaf of `tree`, made after `after`."""
  return jax.tree.map(lambda a: fresh_zeros(a.shape, a.dtype, after), tree)


def chunked_layer(layer, x, positions, segment_ids, shared_indices, token_ids, backends, chunk: int):
  """`DecoderLayer.__call__`'s sparse path over `chunk`-row sequence chunks (T a multiple of `chunk`).

  Args:
    layer: the `DecoderLayer` (MLA attention with `keys`/`query_rows`, plain residual).
    x: [B, T, D] the layer input.
    positions, segment_ids: i32[B, T].
    shared_indices: i32[B, T, K] the previous layer's selection (IndexShare) or None.
    token_ids: i32[B, T] or None (hash-routed MoE).
    backends: the ops' backend names (an object with attributes) or None.
    chunk: rows per chunk.

  Returns:
    (x [B, T, D], indices i32[B, T, K], indexer losses f32[n] per chunk or None, rows counted i32[n]
    or None, expert loads f32[n, E] or None, the indexer loss's forward-pass gradient sums (f32
    [B, T, DI] for the index keys, and the indexer's `nnx.Param` state) or None, and with those the
    index keys [B, T, DI], whose cotangent (that gradient, applied by the caller) reaches the keys'
    weights), rows rescued i32[n] per chunk or None (FlashTopK's slow-path rows); n = T // chunk.
  """
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  cfg = layer.cfg
  B, T = x.shape[:2]
  n = T // chunk
  grads_out = cfg.indexer_loss_grad_in_forward and layer.self_attn.indexer is not None
  take, put = _row_slicing(chunk)

  def keys_of(params, rest, rows, positions):
    """(k [B, c, 1, L+R], index_k [B, c, DI] or None) of input rows [B, c, D]."""
    layer = nnx.merge(graphdef, params, rest)
    return layer.self_attn.keys(prenorm(layer.input_layernorm, rows), positions)

  def all_keys(params, rest, x, positions):
    """The keys of all T rows, a chunk at a time, read from x in place (no chunk-major copy of x)."""
    chunk_keys = lambda i: keys_of(params, rest, take(x, i), take(positions, i))
    shapes = jax.eval_shape(chunk_keys, 0)
    keys = jax.tree.map(lambda s: fresh_zeros((B, T, *s.shape[2:]), s.dtype, x), shapes)
    return jax.lax.fori_loop(0, n, lambda i, keys: jax.tree.map(lambda buf, rows: put(buf, rows, i), keys,
                                                                  chunk_keys(i)), keys)

  def rows_of(params, rest, keys, dtypes, rows, i, positions, segment_ids, indices, token_ids, *, replay):
    """Chunk i of the layer: (output rows [B, c, D], indexer loss or None, (indices, rows counted, load,
    gradient sums, rows rescued)). `keys` may be f32 copies of keys of `dtypes`, cast back inside (so that
    their cotangents are f32); `indices` are chunk i's shared indices, or with `replay` its selection."""
    layer = nnx.merge(graphdef, params, rest)
    keys_thunk = lambda: jax.tree.map(lambda a, d: a.astype(d), keys, dtypes)
    query_rows = layer.self_attn.query_rows(keys_thunk, segment_ids, backends, grads_out=grads_out and not replay,
                                            replay=replay)
    out, indices, loss, rows_counted, grads, rescued = query_rows(
        prenorm(layer.input_layernorm, rows), take(positions, i), take(segment_ids, i), i * chunk, indices)
    rows, load = layer.ffn(rows + out, take(token_ids, i), backends)
    return rows, loss, (indices, rows_counted, load, grads, rescued)

  def forward(params, rest, x, positions, segment_ids, shared_indices, token_ids):
    keys = all_keys(params, rest, x, positions)
    dtypes = jax.tree.map(lambda a: a.dtype, keys)
    chunk_fn = lambda out, i: rows_of(params, rest, keys, dtypes, take(out, i), i, positions, segment_ids,
                                      take(shared_indices, i), token_ids, replay=False)
    probe = jax.eval_shape(lambda: chunk_fn(x, 0))
    _, loss_shape, (sel_shape, count_shape, load_shape, grads_shape, rescued_shape) = probe
    stacked = lambda s: None if s is None else jnp.zeros((n, *s.shape), s.dtype)
    carry = (x, fresh_zeros((B, T, sel_shape.shape[-1]), sel_shape.dtype, x), stacked(loss_shape),
             stacked(count_shape), stacked(load_shape),
             jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), grads_shape), stacked(rescued_shape))

    def body(i, carry):
      out, sel, losses, counts, loads, grad_sums, rescued = carry
      rows, loss, (indices, rows_counted, load, grads, chunk_rescued) = chunk_fn(out, i)
      at = lambda buf, value: None if buf is None else buf.at[i].set(value)
      if grads is not None:  # the gradients of the chunk's mean KL: its sum's are them times its rows
        grad_sums = jax.tree.map(lambda a, g: a + g * rows_counted.astype(jnp.float32), grad_sums, grads)
      return (put(out, rows, i), put(sel, indices.astype(sel.dtype), i), at(losses, loss), at(counts, rows_counted),
              at(loads, load), grad_sums, at(rescued, chunk_rescued))

    out, sel, losses, counts, loads, grad_sums, rescued = jax.lax.fori_loop(0, n, body, carry)
    return out, sel, losses, counts, loads, grad_sums, keys[1] if grads_out else None, rescued

  @jax.custom_vjp
  def run(params, rest, x, positions, segment_ids, shared_indices, token_ids):
    return forward(params, rest, x, positions, segment_ids, shared_indices, token_ids)

  def run_fwd(params, rest, x, positions, segment_ids, shared_indices, token_ids):
    out, selection, losses, counts, *rest_of_outs, rescued = forward(params, rest, x, positions, segment_ids,
                                                                     shared_indices, token_ids)
    # The rows counted weigh the chunks' losses in the layer's mean, so its backward pass reads them, and
    # the rows rescued are an output like them: untagged, an enclosing checkpoint would rerun this whole
    # forward loop (selection included) to get them back.
    selection, counts, rescued = remat.tag((selection, counts, rescued), remat.SELECTION)
    outs = (out, selection, losses, counts, *rest_of_outs, rescued)
    return outs, (params, rest, x, positions, segment_ids, shared_indices, token_ids, selection)

  def run_bwd(residuals, cotangents):
    params, rest, x, positions, segment_ids, shared_indices, token_ids, selection = residuals
    d_out, _, d_losses, _, _, _, d_index_k, _ = cotangents
    keys = all_keys(params, rest, x, positions)
    dtypes = jax.tree.map(lambda a: a.dtype, keys)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), keys)
    d_params, d_wide = _zeros_after(params, d_out), _zeros_after(wide, d_out)
    if d_index_k is not None:  # the index keys' own cotangent (the indexer loss's saved gradient)
      d_wide = (d_wide[0], d_index_k.astype(jnp.float32))

    def chunk_back(j, carry):
      d_x, d_params, d_wide = carry
      i = n - 1 - j
      chunk_fn = lambda p, w, r: rows_of(p, rest, w, dtypes, r, i, positions, segment_ids, take(selection, i),
                                         token_ids, replay=True)[:2]
      (_, loss), pullback = jax.vjp(chunk_fn, params, wide, take(x, i))
      d_loss = None if loss is None else d_losses[i].astype(loss.dtype)
      dp, dw, d_rows = pullback((_cotangent_rows(take, d_x, i), d_loss))
      return put(d_x, d_rows, i), _accumulate(d_params, dp), _accumulate(d_wide, dw)

    d_x, d_params, d_wide = jax.lax.fori_loop(0, n, chunk_back, (d_out, d_params, d_wide))

    def keys_back(i, carry):
      d_x, d_params = carry
      _, pullback = jax.vjp(lambda p, r: keys_of(p, rest, r, take(positions, i)), params, take(x, i))
      d_keys = jax.tree.map(lambda a, dtype: take(a, i).astype(dtype), d_wide, dtypes)
      dp, d_rows = pullback(d_keys)
      return put(d_x, take(d_x, i) + d_rows, i), _accumulate(d_params, dp)

    d_x, d_params = jax.lax.fori_loop(0, n, keys_back, (d_x, d_params))
    return d_params, None, d_x, None, None, None, None

  run.defvjp(run_fwd, run_bwd)
  return run(params, rest, x, positions, segment_ids, shared_indices, token_ids)


def chunked_rows(module, fn, x, token_ids, chunk: int, *, params=nnx.Param):
  """`fn(module, rows, token_ids rows) -> (rows out, aux or None)` over `chunk`-row chunks of x, as
  one custom_vjp that writes in place like `chunked_layer` (T a multiple of `chunk`).

  For a per-position sub-block on the residual (the FFN: `DecoderLayer._chunked_ffn`): the output
  is written into a copy of x and the backward pass recomputes each chunk and overwrites the
  output cotangent's rows with the input's, so neither a stacked output nor a stacked cotangent is
  zero-filled at the start of the step. `aux` (the expert load) gets no gradient.

  Args:
    module: the `nnx.Module` that `fn` runs (its `nnx.Param`s get gradients).
    fn: (module, rows [B, c, ...], token_ids [B, c] or None) -> (rows out [B, c, ...] like rows, aux
      f32 array or None), the same function of every chunk.
    x: [B, T, ...] the rows (e.g. [B, T, D], or [B, T, N, D] residual streams).
    token_ids: i32[B, T] or None.
    chunk: rows per chunk.
    params: an `nnx` filter of the parameters `fn` reads (default all of the module's): only these
      get gradients from it and are summed over the chunks in the backward pass.

  Returns:
    (out like x, aux stacked per chunk [n, ...] or None).

  Raises:
    ValueError: `fn` reads an `nnx.Param` outside `params`, which would get no gradient.
  """
  graphdef, params, others, state = nnx.split(module, params, nnx.Param, ...)
  n = x.shape[1] // chunk
  take, put = _row_slicing(chunk)
  apply = lambda params, rest, rows, i, token_ids: fn(nnx.merge(graphdef, params, *rest), rows, take(token_ids, i))
  aux_shape = _checked_trace(lambda others: apply(params, (others, state), take(x, 0), 0, token_ids), others)[1]
  rest = (others, state)  # no gradient: the parameters outside the filter (unread, checked) and the rest

  def forward(params, rest, x, token_ids):
    aux = None if aux_shape is None else jnp.zeros((n, *aux_shape.shape), aux_shape.dtype)

    def body(i, carry):
      out, aux = carry
      rows, chunk_aux = apply(params, rest, take(out, i), i, token_ids)
      return put(out, rows, i), None if aux is None else aux.at[i].set(chunk_aux)

    return jax.lax.fori_loop(0, n, body, (x, aux))

  @jax.custom_vjp
  def run(params, rest, x, token_ids):
    return forward(params, rest, x, token_ids)

  def run_fwd(params, rest, x, token_ids):
    return forward(params, rest, x, token_ids), (params, rest, x, token_ids)

  def run_bwd(residuals, cotangents):
    params, rest, x, token_ids = residuals
    d_out = cotangents[0]

    def chunk_back(j, carry):
      d_x, d_params = carry
      i = n - 1 - j
      _, pullback = jax.vjp(lambda p, rows: apply(p, rest, rows, i, token_ids)[0], params, take(x, i))
      dp, d_rows = pullback(_cotangent_rows(take, d_x, i))
      return put(d_x, d_rows, i), _accumulate(d_params, dp)

    d_x, d_params = jax.lax.fori_loop(0, n, chunk_back, (d_out, _zeros_after(params, d_out)))
    return d_params, None, d_x, None

  run.defvjp(run_fwd, run_bwd)
  return run(params, rest, x, token_ids)


def _checked_trace(fn, others):
  """fn(others)'s output shapes, after checking that its program reads no leaf of `others`.

  `others` are the parameters outside `chunked_rows`' filter: the chunk loop passes them without a
  gradient, so a sub-block that read one (a module added under a name the filter does not match)
  would train silently without that parameter's gradient. A leaf counts as read when an equation
  of fn's traced program takes it, or returns it.
  """
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(others)
  program = closed.jaxpr
  read = {v for eqn in program.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
  read |= {v for v in program.outvars if isinstance(v, jax.extend.core.Var)}
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(others)[0]]
  unfiltered = [path for path, var in zip(paths, program.invars, strict=True) if var in read]
  if unfiltered:
    raise ValueError(f"chunked_rows: fn reads parameters outside its `params` filter, which would get no "
                     f"gradient through the chunk loop: {', '.join(unfiltered)}. Add them to the filter.")
  return shapes
