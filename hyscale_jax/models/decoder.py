"""The decoder shared by the models: embedding, pre-norm sparse-attention blocks, MoE, LM head."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Int

from hyscale_jax import remat
from hyscale_jax import sharding as shd
from hyscale_jax.layers.hyper_connections import expand_streams
from hyscale_jax.layers.lm_head import Head, chunked_lm_loss
from hyscale_jax.layers.mlp import MLP
from hyscale_jax.layers.moe import MoE
from hyscale_jax.model_config import ModelConfig
from hyscale_jax.models import layer_chunks, residual
from hyscale_jax.models.mtp import MTPLayer, depth_targets, shift_left


class ModelOutput(NamedTuple):
  """`logits` f32[B, T, V] and `aux`: `indexer_loss` (mean over indexer layers) and `expert_load`."""

  logits: jax.Array
  aux: dict


def periodic_runs(keys: list, max_period: int = 8) -> list[tuple[int, int, int]]:
  """Splits a layer sequence into runs (start, period, repeats) of a repeating block, in order.

  `keys[i]` is layer i's structure (anything comparable with ==). At each position the run takes
  the period p <= max_period whose block keys[i:i+p] repeats most often back to back (the smaller
  p on ties); a run of one repeat is one layer (p = 1). The runs cover range(len(keys)).
  E.g. [D, F, S, F, S, F, S] -> [(0, 1, 1), (1, 2, 3)].
  """
  runs, start, n = [], 0, len(keys)
  while start < n:
    best_period, best_repeats = 1, 1
    for period in range(1, min(max_period, n - start) + 1):
      block, repeats = keys[start:start + period], 1
      while keys[start + repeats * period:start + (repeats + 1) * period] == block:
        repeats += 1
      if repeats > best_repeats:
        best_period, best_repeats = period, repeats
    runs.append((start, best_period, best_repeats))
    start += best_period * best_repeats
  return runs


def _structure(graphdef, state):
  """What must agree for two layers to share a scan body: graph, state tree, leaf shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(state)
  return graphdef, treedef, tuple((a.shape, a.dtype) for a in leaves)


class LayerOutput(NamedTuple):
  """A `DecoderLayer`'s result: `x` like its input ([B, T, D], or streams [B, T, N, D]); `indices`
  i32[B, T, K] (its selection, or the shared one it used) or None; `indexer_loss` f32[] or None;
  `expert_load` f32[E] or None (MoE layers); `topk_rescued_rows` i32[] or None: the query rows whose
  selection took FlashTopK's slow exact path (None where the layer selected nothing)."""

  x: jax.Array
  indices: jax.Array | None
  indexer_loss: jax.Array | None
  expert_load: jax.Array | None
  topk_rescued_rows: jax.Array | None


class DecoderLayer(nnx.Module):
  """Pre-norm block: RMSNorm -> sparse attention -> residual -> RMSNorm -> MLP or MoE -> residual.

  `attention` is the model's attention module for this layer (MLA/DSA for GLM-5, compressed
  sparse attention for DeepSeek-V4); it returns an `AttentionOutput`. With hyper-connections
  (`attn_hc`, `mlp_hc`: layers/hyper_connections.py) the residual is [B, T, N, D] streams that
  each connection collapses into the block input and updates with its output; a connection that
  `replaces_pre_norm` leaves the block without its RMSNorm. `ple` (Qwen3.8-Flash-Next's Engram
  layer, layers/engram.py), if given, adds the tokens' n-gram embedding to the streams first.
  """

  def __init__(self, cfg: ModelConfig, layer: int, attention: nnx.Module, *, rngs: nnx.Rngs,
               attn_hc: nnx.Module | None = None, mlp_hc: nnx.Module | None = None, ple: nnx.Module | None = None):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = lambda hc: None if hc is not None and hc.replaces_pre_norm else nnx.RMSNorm(
        cfg.d_model, epsilon=cfg.rms_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype,
        scale_metadata=shd.param(shd.NORM))
    self.attn_hc, self.mlp_hc, self.ple = attn_hc, mlp_hc, ple
    self.cfg = cfg
    self.input_layernorm = norm(attn_hc)
    self.self_attn = attention
    self.post_attention_layernorm = norm(mlp_hc)
    if cfg.is_moe(layer):
      self.mlp = MoE(cfg.d_model, cfg.moe_inter, cfg.n_routed_experts, cfg.experts_per_token,
                     cfg.n_shared_experts, scoring=cfg.scoring, routed_scaling=cfg.routed_scaling,
                     norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
                     swiglu_limit=cfg.swiglu_limit, shared_expert_gate=cfg.shared_expert_gate,
                     selection_bias=cfg.router_bias and not cfg.is_hash_moe(layer), token_chunk=cfg.moe_token_chunk,
                     hash_vocab=cfg.vocab_size if cfg.is_hash_moe(layer) else 0, rngs=rngs, dtype=dtype,
                     param_dtype=pdtype)
    else:
      self.mlp = MLP(cfg.d_model, cfg.dense_inter, swiglu_limit=cfg.swiglu_limit, rngs=rngs, dtype=dtype,
                     param_dtype=pdtype)

  def __call__(self, x, positions, segment_ids, *, dense=False, shared_indices=None, backends=None, token_ids=None):
    """x [B, T, D] (or streams [B, T, N, D]) -> `LayerOutput`. `token_ids` i32[B, T]: the input tokens,
    read by hash-routed MoE layers and `ple`."""
    if self.ple is not None:
      if token_ids is None:
        raise ValueError("DecoderLayer: this layer has an n-gram embedding (`ple`) and needs token_ids=i32[B, T].")
      x = x + self.ple(x, token_ids, segment_ids)
    chunk = 0 if dense else self.layer_chunk(x.shape[1])
    if chunk:
      return self._chunked_layer(x, positions, segment_ids, shared_indices, token_ids, backends, chunk)
    h, mix = residual.enter(self.attn_hc, x)
    attn = self.self_attn(residual.prenorm(self.input_layernorm, h), positions, segment_ids, dense=dense,
                          shared_indices=shared_indices, backends=backends)
    x = residual.leave(self.attn_hc, x, attn.out, mix)
    x, load = self._chunked_ffn(x, token_ids, backends)
    return LayerOutput(x, attn.indices, attn.indexer_loss, load, attn.rescued_rows)

  def layer_chunk(self, T: int) -> int:
    """Rows per chunk when the whole sparse layer runs over sequence chunks (`_chunked_layer`), else 0.

    It does when MLA query chunking and FFN chunking are both on at this length with one chunk size,
    the attention is MLA (`query_rows`) and the residual is plain (no hyper-connections, no `ple`).
    """
    if (self.attn_hc is not None or self.mlp_hc is not None or self.ple is not None
        or not hasattr(self.self_attn, "query_rows")):
      return 0
    return self.cfg.layer_chunk(T)

  def _chunked_layer(self, x, positions, segment_ids, shared_indices, token_ids, backends, chunk):
    """The sparse layer, `chunk` positions at a time: keys first, then everything else in one loop.

    The keys (MLA's latent and rope keys, the indexer's) of all T positions come from one loop over
    the chunks' normalised rows; then a second loop runs, per chunk, the pre-norm, the queries,
    selection, attention and indexer loss, the residual, and the FFN sub-block. Every part but the
    keys is per position, so the result is `__call__`'s unchunked one; what changes is that only the
    layer's input and output (in the backward pass, their cotangents, in one buffer) and the keys
    exist at full length, not the attention output, the residual between the sub-blocks, nor their
    cotangents. The loops and their backward pass are `layer_chunks.chunked_layer`'s (a custom_vjp
    that recomputes each chunk from the saved selection).
    The indexer loss's gradient (when computed in the forward pass) is summed over the chunks in the
    loop's carry, as the index keys' gradient and the indexer weights' gradient from its queries,
    and saved once for the layer: not [T, DI] per chunk and [T, HI, DI] of query gradients.

    Returns `__call__`'s `LayerOutput`.
    """
    attn, cfg = self.self_attn, self.cfg
    indexer_params = None
    if cfg.indexer_loss_grad_in_forward and attn.indexer is not None:
      indexer_params = nnx.state(attn.indexer, nnx.Param)
    out, indices, losses, rows_counted, loads, grad_sums, index_k, rescued = layer_chunks.chunked_layer(
        self, x, positions, segment_ids, shared_indices, token_ids, backends, chunk)
    indexer_loss = None
    if losses is not None:  # the mean over all counted rows, from the chunks' means
      n = jnp.maximum(rows_counted.sum(), 1).astype(losses.dtype)
      indexer_loss = jnp.sum(losses * rows_counted.astype(losses.dtype)) / n
    if grad_sums is not None:
      # Value 0, gradient the saved one (ops.indexer_loss's grad_in_forward form): to index_k, whose
      # keys' weights it reaches, and straight to the indexer's query-side weights.
      for grad, x_ in zip(jax.tree.leaves(grad_sums), jax.tree.leaves((index_k, indexer_params)), strict=True):
        grad = remat.tag((grad / n).astype(x_.dtype), remat.INDEXER_GRADS)
        indexer_loss = indexer_loss + jnp.sum((grad * (x_ - jax.lax.stop_gradient(x_))).astype(jnp.float32))
    return LayerOutput(out, indices, indexer_loss, None if loads is None else loads.mean(axis=0),
                       None if rescued is None else rescued.sum())

  def ffn(self, x, token_ids, backends):
    """The FFN sub-block on residual rows x [B, t, ...]: (the residual after it, expert_load f32[E] or None)."""
    h, mix = residual.enter(self.mlp_hc, x)
    moe_args = {"token_ids": token_ids} if isinstance(self.mlp, MoE) else {}
    ffn = self.mlp(residual.prenorm(self.post_attention_layernorm, h), backends=backends, **moe_args)
    ffn, load = ffn if isinstance(ffn, tuple) else (ffn, None)
    return residual.leave(self.mlp_hc, x, ffn, mix), load

  def _chunked_ffn(self, x, token_ids, backends):
    """`ffn` over `cfg.ffn_token_chunk` positions at a time, each chunk recomputed in the backward pass
    (`layer_chunks.chunked_rows`: output and cotangent written in place).

    Every part of the sub-block is per position (routing included), so the chunks give the same
    rows; the expert load is the mean of the chunks' (equal chunks: the same fractions).
    """
    chunk = self.cfg.ffn_chunk(x.shape[1])
    if not chunk:
      return self.ffn(x, token_ids, backends)
    # Only the sub-block's own parameters: the attention's would be summed as zeros every chunk.
    # chunked_rows refuses a sub-block that reads one outside this filter (it would get no gradient).
    ffn_params = nnx.All(nnx.Param, nnx.Any(*map(nnx.PathContains, ("mlp", "mlp_hc", "post_attention_layernorm"))))
    out, load = layer_chunks.chunked_rows(self, lambda layer, rows, ids: layer.ffn(rows, ids, backends), x,
                                          token_ids, chunk, params=ffn_params)
    return out, None if load is None else load.mean(axis=0)


class Decoder(nnx.Module):
  """A decoder-only LM over `DecoderLayer`s; subclasses choose each layer's attention.

  With `cfg.hc_mult` > 0 the residual is that many streams: the subclass supplies the per-block
  connections (`make_hyper_connection`) and the final collapse `hc_head` (`make_stream_head`),
  which runs before the final `norm` (absent when the head replaces it).

  Module paths (`embed_tokens`, `layers`, `norm`, `lm_head`) follow the HF checkpoint keys. Each
  layer runs under `jax.checkpoint` with the config's remat policy, so `"selection_replay"` saves
  the selection and never reselects in the backward pass. With `cfg.scan_layers` repeating runs
  of layers go through `jax.lax.scan` (see `_run_layers`); `layers` stays one module per layer.
  """

  def make_attention(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    raise NotImplementedError

  def make_hyper_connection(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """One sub-block's residual-stream connection (`enter`/`leave`); used when cfg.hc_mult > 0."""
    raise ValueError(f"model.hc_mult={cfg.hc_mult}: {cfg.architecture} has no hyper-connections.")

  def make_stream_head(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The final collapse of the residual streams into [B, T, D]; used when cfg.hc_mult > 0."""
    raise ValueError(f"model.hc_mult={cfg.hc_mult}: {cfg.architecture} has no hyper-connections.")

  def make_layer_embedding(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module | None:
    """Layer `layer`'s token-id embedding added to its input (`DecoderLayer.ple`), or None (the default)."""
    return None

  # MTP (models/mtp.py): whether a depth takes the previous stage's residual streams (DeepSeek-V4)
  # rather than its normalised hidden state.
  mtp_takes_streams = False

  def make_mtp_attention(self, cfg: ModelConfig, depth: int, rngs: nnx.Rngs) -> nnx.Module:
    """The attention of MTP depth `depth`'s block (layer n_layers + depth)."""
    return self.make_attention(cfg, cfg.n_layers + depth, rngs)

  def make_mtp_norm(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """One RMSNorm of an MTP depth (`enorm`, `hnorm`, `norm`)."""
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.rms_eps, rngs=rngs, param_dtype=jnp.dtype(cfg.param_dtype),
                       scale_metadata=shd.param(shd.NORM))

  def _make_mtp_layer(self, cfg: ModelConfig, depth: int, rngs: nnx.Rngs) -> MTPLayer:
    connection = lambda: self.make_hyper_connection(cfg, rngs) if cfg.hc_mult else None
    block = DecoderLayer(cfg, cfg.n_layers + depth, self.make_mtp_attention(cfg, depth, rngs), rngs=rngs,
                         attn_hc=connection(), mlp_hc=connection())
    return MTPLayer(cfg, block, make_norm=lambda: self.make_mtp_norm(cfg, rngs),
                    stream_head=self.make_stream_head(cfg, rngs) if cfg.hc_mult else None,
                    streams_in=self.mtp_takes_streams and cfg.hc_mult > 0, rngs=rngs)

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdtype = jnp.dtype(cfg.param_dtype)
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs, param_dtype=pdtype,
                                  dtype=jnp.dtype(cfg.dtype), embedding_metadata=shd.param(shd.VOCAB, shd.EMBED))
    connection = lambda: self.make_hyper_connection(cfg, rngs) if cfg.hc_mult else None
    self.layers = nnx.List([DecoderLayer(cfg, i, self.make_attention(cfg, i, rngs), rngs=rngs,
                                         attn_hc=connection(), mlp_hc=connection(),
                                         ple=self.make_layer_embedding(cfg, i, rngs))
                            for i in range(cfg.n_layers)])
    self.hc_head = self.make_stream_head(cfg, rngs) if cfg.hc_mult else None
    self.norm = None if self.hc_head is not None and self.hc_head.replaces_final_norm else nnx.RMSNorm(
        cfg.d_model, epsilon=cfg.rms_eps, rngs=rngs, param_dtype=pdtype, scale_metadata=shd.param(shd.NORM))
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs, param_dtype=pdtype,
        kernel_metadata=shd.param(shd.EMBED, shd.VOCAB))
    # After the main layers, outside their scans; built last so the main model's random init is the
    # same with or without MTP.
    self.mtp = nnx.List([self._make_mtp_layer(cfg, d, rngs) for d in range(cfg.mtp_depth)]) if cfg.mtp_depth else None

  def layer_runs(self, graphs=None) -> list[tuple[int, int, int, int]]:
    """How `_run_layers` walks the layers: (start, period, repeats, direct) per run, in order.

    The first `direct` repeats of a run's block are called one by one; the rest go through one
    `jax.lax.scan` (none when fewer than two remain). Called directly: a lone block, and the first
    block that makes `indices` when none came in (the scan's carry must keep one structure).
    `graphs`: `nnx.split` of each layer, if already at hand.
    """
    layers = list(self.layers)
    graphs = graphs or [nnx.split(layer) for layer in layers]
    if self.cfg.scan_layers:
      runs = periodic_runs([_structure(*graph) for graph in graphs])
    else:
      runs = [(i, 1, 1) for i in range(len(layers))]
    plan, have_indices = [], False
    for start, period, repeats in runs:
      owns_indexer = any(layer.self_attn.indexer is not None for layer in layers[start:start + period])
      direct = 1 if not have_indices and owns_indexer else 0
      direct = repeats if repeats - direct < 2 else direct
      plan.append((start, period, repeats, direct))
      have_indices = have_indices or owns_indexer
    return plan

  def scanned_layer_groups(self) -> list[list[int]]:
    """Layer indices that `_run_layers` stacks for one scan: per scanned run, one list per block
    position (the layers at that position in the scanned repeats, in order)."""
    return [[start + (r * period) + j for r in range(direct, repeats)]
            for start, period, repeats, direct in self.layer_runs() if repeats > direct
            for j in range(period)]

  def _run_layers(self, x, positions, segment_ids, activation_axes, *, dense, backends, token_ids=None,
                  embed_tokens=None):
    """The layer stack: x [B, T, D] (or streams [B, T, N, D]) -> (x, indexer losses, expert loads, rows
    rescued: FlashTopK's slow-path rows, i32[] per selecting layer);
    `token_ids` i32[B, T] reach every layer: hash-routed MoE layers choose their experts by them, n-gram
    embeddings (`ple`) hash them.

    The losses (f32[] each) and loads (f32[E] each) are per-layer lists in layer order. Each layer
    runs under `jax.checkpoint` with the config's remat policy. IndexShare: a layer without its own
    indexer gets the previous full layer's `indices`.

    With `cfg.scan_layers`, each run of `periodic_runs` with two or more repeats of its block
    (e.g. GLM's MoE layers, or [full, shared, shared, shared] under IndexShare with freq 4) goes
    through one `jax.lax.scan` over the repeats, so tracing and compiling cost one block, not one
    per layer; `indices` is in the scan's carry. The module tree stays one module per layer (the
    layout of the native and HF formats, sharding rules and `model.layers[i]`): the scan stacks
    the run's layer states here, inside the step. Called with per-layer parameters (a notebook, the
    converter) that is a transient stacked copy of the run's parameters and, in the backward pass,
    of their gradients, sliced back per layer. train.py stores each group of
    `scanned_layer_groups()` stacked instead (training/layer_stacks.py): the stacking here then
    folds into the stored arrays, and neither copy nor slices remain.

    With `x` None, `embed_tokens` i32[B, T] are the input tokens and the first layer (when it is
    called directly) embeds them inside its own `jax.checkpoint`: the backward pass regathers the
    embedding rather than keeping it ([B, T, D] less saved); otherwise they are embedded first.
    """
    def layer_fn(graphdef, state, x, positions, segment_ids, shared_indices, token_ids):
      layer = nnx.merge(graphdef, state)  # a pure function of the layer's state, for jax.checkpoint
      return layer(x, positions, segment_ids, dense=dense, shared_indices=shared_indices, backends=backends,
                   token_ids=token_ids)

    def first_fn(graphdefs, states, tokens, *args):
      """The first layer on the embedding of `tokens`, both under one checkpoint."""
      (embed_graph, graphdef), (embed_state, state) = graphdefs, states
      x = shd.shard(nnx.merge(embed_graph, embed_state)(tokens), activation_axes)
      return layer_fn(graphdef, state, x, *args)

    T = positions.shape[1]
    run_layer, run_first = self._remat(layer_fn, T, dense), self._remat(first_fn, T, dense)
    embed = nnx.split(self.embed_tokens) if x is None else None

    def run_block(graphdefs, owns_indexer, x, indices, states):
      """Consecutive layers: (x, indices, their indexer losses, their expert loads, their rows rescued)."""
      losses, loads, rescued = [], [], []
      for graphdef, owns, state in zip(graphdefs, owns_indexer, states, strict=True):
        if x is None:  # the first layer, embedding the tokens itself
          x, layer_indices, indexer_loss, load, layer_rescued = run_first(
              (embed[0], graphdef), (embed[1], state), embed_tokens, positions, segment_ids, indices, token_ids)
        else:
          # Between layers the activations are split over batch and sequence, whole in D: FSDP gathers
          # the weights rather than splitting the activations' width.
          x = shd.shard(x, activation_axes)
          x, layer_indices, indexer_loss, load, layer_rescued = run_layer(graphdef, state, x, positions,
                                                                          segment_ids, indices, token_ids)
        if owns:
          indices = layer_indices
        losses += [] if indexer_loss is None else [indexer_loss]
        loads += [] if load is None else [load]
        rescued += [] if layer_rescued is None else [layer_rescued]
      return x, indices, losses, loads, rescued

    layers = list(self.layers)
    graphs = [nnx.split(layer) for layer in layers]
    indices, indexer_losses, loads, rescued = None, [], [], []
    for start, period, repeats, direct in self.layer_runs(graphs):
      if x is None and not direct:  # the first layer is scanned: embed the tokens here
        x = self.embed_tokens(embed_tokens)
      graphdefs = [graphdef for graphdef, _ in graphs[start:start + period]]
      owns_indexer = [layer.self_attn.indexer is not None for layer in layers[start:start + period]]
      states = [state for _, state in graphs[start:start + period * repeats]]
      for r in range(direct):
        x, indices, block_losses, block_loads, block_rescued = run_block(graphdefs, owns_indexer, x, indices,
                                                                         states[r * period:(r + 1) * period])
        indexer_losses += block_losses
        loads += block_loads
        rescued += block_rescued
      if repeats == direct:
        continue
      rest = states[direct * period:]
      stacked = [jax.tree.map(lambda *a: jnp.stack(a), *rest[j::period]) for j in range(period)]

      def body(carry, block_states, graphdefs=graphdefs, owns_indexer=owns_indexer):
        x, indices, block_losses, block_loads, block_rescued = run_block(graphdefs, owns_indexer, *carry,
                                                                         block_states)
        return (x, indices), (block_losses, block_loads, block_rescued)

      with jax.named_scope(remat.LAYER_SCAN):
        (x, indices), (scan_losses, scan_loads, scan_rescued) = jax.lax.scan(body, (x, indices), stacked)
      # [repeats, per block] -> layer order.
      indexer_losses += list(jnp.stack(scan_losses, 1).reshape(-1)) if scan_losses else []
      loads += list(jnp.stack(scan_loads, 1).reshape(-1, scan_loads[0].shape[-1])) if scan_loads else []
      rescued += [jnp.sum(jnp.stack(scan_rescued))] if scan_rescued else []
    return x, indexer_losses, loads, rescued

  def _remat(self, run, T: int, dense: bool):
    """`run(graphdef, state, *arrays)` under jax.checkpoint with the config's remat policy."""
    policy = self.cfg.remat_policy
    if policy == "none":
      return run
    jax_policy = remat.checkpoint_policy(policy, save_attention=dense or self.cfg.saves_attention(T))
    return jax.checkpoint(run, policy=jax_policy, static_argnums=0)

  def _run_mtp(self, prev, mtp_tokens, positions, segment_ids, *, dense, backends):
    """The MTP depths in order: (h [B, T, D] per depth, their indexer losses, their expert loads, their rows
    rescued)."""
    def run_depth(graphdef, state, prev, embedded, positions, segment_ids):
      return nnx.merge(graphdef, state)(prev, embedded, positions, segment_ids, dense=dense, backends=backends)

    run_depth = self._remat(run_depth, prev.shape[1], dense)
    hidden, losses, loads, rescued = [], [], [], []
    for depth, layer in enumerate(self.mtp):
      graphdef, state = nnx.split(layer)
      embedded = self.embed_tokens(shift_left(mtp_tokens, depth))
      prev, h, indexer_loss, load, depth_rescued = run_depth(graphdef, state, prev, embedded, positions, segment_ids)
      hidden.append(h)
      losses += [] if indexer_loss is None else [indexer_loss]
      loads += [] if load is None else [load]
      rescued += [] if depth_rescued is None else [depth_rescued]
    return hidden, losses, loads, rescued

  def hidden_states(
      self,
      tokens: Int[Array, "B T"],
      *,
      positions: Int[Array, "B T"] | None = None,
      segment_ids: Int[Array, "B T"] | None = None,
      dense: bool = False,
      backends=None,
      mtp_tokens: Int[Array, "B T"] | None = None,
      final_norm: bool = True,
  ) -> tuple[jax.Array, dict]:
    """The final hidden states for int32 tokens [B, T] (the LM head's input); `dense=True` is the
    warm-up stage (no sparsification).

    Args:
      tokens: i32[B, T] token ids.
      positions: i32[B, T] positions within each packed document (default 0..T-1).
      segment_ids: i32[B, T] packed-document ids (default one document per row).
      dense: dense attention and dense indexer KL instead of selection + sparse attention.
      backends: per-op backend names (`config.ops`); None means "auto" everywhere.
      mtp_tokens: i32[B, T] the next tokens (tok[t + 1], training's `targets`): also run the MTP
        depths (when `cfg.mtp_depth` > 0), depth d embedding mtp_tokens[t + d].
      final_norm: False leaves the final RMSNorm to `lm_loss(..., prenorm=True)`, which applies it
        one loss chunk at a time (no normalised [B, T, D] copy nor its gradient at full length).

    Returns:
      (h [B, T, D] after the final collapse and norm, aux={"indexer_loss": f32[], "expert_load":
      f32[n_moe, E], "topk_rescued_rows": i32[], the query rows (summed over layers) whose selection took
      FlashTopK's slow exact path, present when a layer selected}). With `mtp_tokens`, aux["mtp_hidden"] holds each depth's h [B, T, D] (for
      `mtp_loss` or `logits`), and the MTP blocks' indexer losses and expert loads (last) are in
      the mean and the stack.
    """
    B, T = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if segment_ids is None:
      segment_ids = jnp.zeros((B, T), jnp.int32)
    # With hyper-connections the residual is hc_mult streams [B, T, N, D] between layers.
    activation_axes = (shd.BATCH, shd.LENGTH, shd.ACT_EMBED)
    x = None  # a plain residual: the first layer embeds the tokens under its checkpoint (`_run_layers`)
    if self.hc_head is not None or self.cfg.remat_policy == "none":
      x = self.embed_tokens(tokens)
    if self.hc_head is not None:
      x, activation_axes = expand_streams(x, self.cfg.hc_mult), (shd.BATCH, shd.LENGTH, None, shd.ACT_EMBED)
    x, indexer_losses, loads, rescued = self._run_layers(x, positions, segment_ids, activation_axes, dense=dense,
                                                         backends=backends, token_ids=tokens, embed_tokens=tokens)
    streams = x
    if self.hc_head is not None:
      x = self.hc_head(x)
    normed = x if self.norm is None else self.norm(x)
    x = normed if final_norm else x
    aux = {}
    if mtp_tokens is not None and self.mtp is not None:
      prev = streams if self.mtp[0].streams_in else normed
      aux["mtp_hidden"], mtp_losses, mtp_loads, mtp_rescued = self._run_mtp(prev, mtp_tokens, positions, segment_ids,
                                                                            dense=dense, backends=backends)
      indexer_losses, loads, rescued = indexer_losses + mtp_losses, loads + mtp_loads, rescued + mtp_rescued
    aux["indexer_loss"] = jnp.mean(jnp.stack(indexer_losses)) if indexer_losses else jnp.float32(0)
    if loads:
      aux["expert_load"] = jnp.stack(loads)
    if rescued:
      aux["topk_rescued_rows"] = jnp.sum(jnp.stack(rescued))
    return x, aux

  def __call__(self, tokens: Int[Array, "B T"], **kwargs) -> ModelOutput:
    """ModelOutput(logits f32[B, T, V], aux) for int32 tokens [B, T]; `kwargs` as `hidden_states`.

    For evaluation, notebooks and generation: training takes `lm_loss` of the hidden states, which
    never builds the [B, T, V] logits.
    """
    h, aux = self.hidden_states(tokens, **kwargs)
    return ModelOutput(self.logits(h), aux)

  def _head(self, prenorm: bool = False) -> tuple[Head, nnx.State]:
    """The LM head as a pure function of its parameters: (head, params), logits = head(params, h).

    Untied: `lm_head`. Tied: `embed_tokens.attend` on the f32 hidden states. With `prenorm` the
    head applies the final `norm` first (h is then `hidden_states(..., final_norm=False)`'s).
    """
    tied = self.lm_head is None
    graphdef, params = nnx.split(self.embed_tokens if tied else self.lm_head)
    norm_graph, norm_params = nnx.split(self.norm) if prenorm and self.norm is not None else (None, None)

    def head(all_params, h):
      params, norm_params = all_params
      if norm_graph is not None:
        h = nnx.merge(norm_graph, norm_params)(h)
      module = nnx.merge(graphdef, params)
      return module.attend(h.astype(jnp.float32)) if tied else module(h)

    return head, (params, norm_params)

  def logits(self, h: jax.Array) -> jax.Array:
    """f32[B, T, V] logits of the hidden states h [B, T, D] (from `hidden_states`)."""
    head, params = self._head()
    return head(params, h).astype(jnp.float32)

  def lm_loss(self, h: jax.Array, targets: Int[Array, "B T"], loss_mask: jax.Array, *,
              prenorm: bool = False) -> jax.Array:
    """f32[] mean next-token cross-entropy of h [B, T, D] over loss_mask f32[B, T], `cfg.lm_loss_chunk`
    positions at a time (layers/lm_head.py): the same value and gradients as `lm_loss(self.logits(h), ...)`.
    `prenorm`: h is before the final norm (`hidden_states(..., final_norm=False)`); each chunk applies it."""
    head, params = self._head(prenorm)
    return chunked_lm_loss(head, params, h, targets, loss_mask, chunk=self.cfg.lm_loss_chunk)

  def mtp_loss(self, mtp_hidden, targets: Int[Array, "B T"], loss_mask: jax.Array) -> jax.Array:
    """f32[] mean over the MTP depths of their cross-entropies (`depth_targets`), chunked as `lm_loss`.

    Args:
      mtp_hidden: aux["mtp_hidden"] of `hidden_states(..., mtp_tokens=targets)`: h [B, T, D] per depth.
      targets: i32[B, T] next-token ids; loss_mask: f32[B, T] (as for `lm_loss`).
    """
    if not mtp_hidden:
      raise ValueError("mtp_loss needs the hidden states of at least one MTP depth (model.mtp_depth > 0 and "
                       "hidden_states(..., mtp_tokens=targets)).")
    head, params = self._head()
    losses = []
    for depth, h in enumerate(mtp_hidden):
      _, depth_target, mask = depth_targets(targets, loss_mask, depth)
      losses.append(chunked_lm_loss(head, params, h, depth_target, mask, chunk=self.cfg.lm_loss_chunk))
    return jnp.mean(jnp.stack(losses))
