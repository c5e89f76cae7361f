"""DeepSeek-style MoE: noaux_tc top-k (or DeepSeek-V4 hash) routing, `ops.grouped_matmul` experts, shared experts."""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hyscale_jax import ops
from hyscale_jax import sharding as shd
from hyscale_jax.parallel import expert as expert_parallel
from hyscale_jax.layers.mlp import MLP, swiglu

Scoring = Literal["sigmoid", "sqrtsoftplus", "softmax"]
SCORINGS: tuple[str, ...] = ("sigmoid", "sqrtsoftplus", "softmax")


class RouterBias(nnx.Variable):
  """The noaux_tc expert-selection bias (HF `e_score_correction_bias`).

  Deliberately not an `nnx.Param`: optimisers built over `nnx.Param` never see it, and it is moved
  by `update_router_bias` from the observed expert load instead of by gradients.
  """


class RoutingTable(nnx.Variable):
  """DeepSeek-V4's hash-routing table `tid2eid`: i32[vocab, k], the experts of each token id.

  Fixed: not an `nnx.Param` (no gradient, no optimiser) and not moved by `update_router_bias`;
  it comes from the checkpoint (or `hash_routing_table` at initialisation).
  """


def hash_routing_table(key: jax.Array, vocab: int, n_experts: int, k: int) -> Int[Array, "V K"]:
  """i32[vocab, k]: k distinct experts per token id, uniformly at random (a fresh model's table)."""
  return jax.lax.top_k(jax.random.uniform(key, (vocab, n_experts)), k)[1].astype(jnp.int32)


def _scores(logits: Float[Array, "N E"], scoring: str) -> Float[Array, "N E"]:
  """Per-expert affinities from f32 router logits."""
  if scoring == "sigmoid":
    return jax.nn.sigmoid(logits)
  if scoring == "sqrtsoftplus":
    return jnp.sqrt(jax.nn.softplus(logits))
  return jax.nn.softmax(logits, axis=-1)


def _init_experts(key: jax.Array, shape: tuple[int, ...], param_dtype: jnp.dtype) -> jax.Array:
  """Normal init scaled by fan_in^{-1/2}; fan_in is the contracted (middle) axis of [E, in, out]."""
  return (jax.random.normal(key, shape, jnp.float32) * shape[1] ** -0.5).astype(param_dtype)


class MoE(nnx.Module):
  """Routed SwiGLU experts plus optional shared experts (DeepSeek-V3 / GLM-5 / DeepSeek-V4 layout).

  Routing (DeepSeek-V3 "noaux_tc"): f32 router logits -> scores (`sigmoid`, `sqrtsoftplus` or
  `softmax`). The `e_score_correction_bias` is added to the scores only to *choose* experts,
  optionally after group-limited pruning (`n_group > 1`). The combine weights are the chosen
  experts' *unbiased* scores, optionally renormalised to sum to 1, times `routed_scaling`.

  Experts are stored stacked (`experts_gate_proj` [E, D, F], `experts_up_proj` [E, D, F],
  `experts_down_proj` [E, F, D]) and run as grouped matmuls (`ops.grouped_matmul`, whose backward is
  grouped matmuls too) over expert-sorted token copies, so time and memory are O(N * k) rows x width,
  never O(N * E).

  Hash routing (DeepSeek-V4's first MoE layers, `hash_vocab` > 0): the experts of a token are the
  fixed row `tid2eid[token_id]` (a `RoutingTable`), whatever its hidden state; the combine weights
  are the router's scores of those experts, renormalised (`norm_topk_prob`) and scaled, as above.
  There is no selection bias, and groups do not apply.
  """

  def __init__(
      self,
      d_model: int,
      moe_inter: int,
      n_routed_experts: int,
      experts_per_token: int,
      n_shared_experts: int,
      *,
      scoring: Scoring = "sigmoid",
      routed_scaling: float = 1.0,
      norm_topk_prob: bool = True,
      n_group: int = 1,
      topk_group: int = 1,
      swiglu_limit: float = 0.0,
      shared_expert_gate: bool = False,
      selection_bias: bool = True,
      token_chunk: int = 0,
      hash_vocab: int = 0,
      rngs: nnx.Rngs,
      dtype: jnp.dtype = jnp.float32,
      param_dtype: jnp.dtype = jnp.float32,
  ):
    """Builds the router, the stacked routed experts and the shared experts.

    Args:
      d_model: D, the model width.
      moe_inter: F, the inner width of each routed expert (and of each shared expert).
      n_routed_experts: E, the number of routed experts.
      experts_per_token: k, the experts chosen per token, in [1, E].
      n_shared_experts: shared experts, fused into one MLP of width `moe_inter * n_shared_experts`;
        0 for none.
      scoring: `"sigmoid"` (DeepSeek-V3, GLM-5), `"sqrtsoftplus"` (DeepSeek-V4) or `"softmax"`.
      routed_scaling: factor on the routed combine weights (2.5 for V3/GLM-5, 1.5 for V4-Flash).
      norm_topk_prob: renormalise the k chosen scores to sum to 1 before scaling.
      n_group: expert groups for group-limited routing; must divide E (1 disables it).
      topk_group: groups kept per token, in [1, n_group].
      swiglu_limit: the SwiGLU clamp of routed and shared experts (`mlp.swiglu`); 0 disables it.
      shared_expert_gate: scale the shared experts' output per token by `sigmoid(x W)` (Qwen4-Exp's
        `shared_expert_gate`, W [D, 1]); needs n_shared_experts > 0.
      selection_bias: keep the noaux_tc `e_score_correction_bias`; False for routers without one
        (Qwen4-Exp), which then choose by the scores alone and have no bias to update.
      token_chunk: run the routed experts over this many tokens at a time, each chunk rematerialized
        (memory O(token_chunk * k) rows instead of O(N * k)); 0 for all at once. Without an `expert`
        mesh axis only; it must divide the tokens it sees when there are more.
      hash_vocab: route by a `tid2eid` table of this many token ids (`__call__` then needs
        `token_ids`); 0 routes by score. Needs `selection_bias=False` and `n_group=1`.
      rngs: supplies the `params` stream.
      dtype: compute dtype of the expert matmuls (they accumulate in f32).
      param_dtype: storage dtype of the expert weights; the router is always f32.

    Raises:
      ValueError: a size or the scoring is invalid; the message names the argument.
    """
    if scoring not in SCORINGS:
      raise ValueError(f"{scoring=!r} is not one of {SCORINGS}.")
    if not 1 <= experts_per_token <= n_routed_experts:
      raise ValueError(f"{experts_per_token=} must be in [1, {n_routed_experts=}].")
    if n_group < 1 or n_routed_experts % n_group:
      raise ValueError(f"{n_routed_experts=} must be divisible by {n_group=} (>= 1).")
    if not 1 <= topk_group <= n_group:
      raise ValueError(f"{topk_group=} must be in [1, {n_group=}].")
    if experts_per_token > topk_group * (n_routed_experts // n_group):
      raise ValueError(
          f"{experts_per_token=} exceeds the {topk_group=} kept groups of "
          f"{n_routed_experts // n_group} experts each."
      )
    if n_shared_experts < 0:
      raise ValueError(f"{n_shared_experts=} must be >= 0.")
    if hash_vocab < 0 or (hash_vocab and (selection_bias or n_group > 1)):
      raise ValueError(f"{hash_vocab=} must be >= 0; hash routing has no selection bias and no groups "
                       f"(got {selection_bias=}, {n_group=}).")
    if shared_expert_gate and not n_shared_experts:
      raise ValueError(f"{shared_expert_gate=} needs shared experts, got {n_shared_experts=}.")
    self.experts_per_token = experts_per_token
    self.scoring, self.routed_scaling, self.norm_topk_prob = scoring, routed_scaling, norm_topk_prob
    self.n_group, self.topk_group = n_group, topk_group
    self.dtype, self.swiglu_limit, self.token_chunk = dtype, swiglu_limit, token_chunk
    E, D, F = n_routed_experts, d_model, moe_inter
    # The router stays f32 end to end: near-tied scores flip top-k choices under bf16 rounding.
    self.gate = nnx.Linear(
        D, E, use_bias=False, rngs=rngs, dtype=jnp.float32, param_dtype=jnp.float32,
        kernel_metadata=shd.param(shd.EMBED, None),
    )
    self.e_score_correction_bias = RouterBias(jnp.zeros((E,), jnp.float32)) if selection_bias else None
    self.tid2eid = RoutingTable(hash_routing_table(rngs.params(), hash_vocab, E, experts_per_token)) \
        if hash_vocab else None
    in_axes, out_axes = shd.param(shd.EXP, shd.EMBED, shd.MLP), shd.param(shd.EXP, shd.MLP, shd.EMBED)
    self.experts_gate_proj = nnx.Param(_init_experts(rngs.params(), (E, D, F), param_dtype), **in_axes)
    self.experts_up_proj = nnx.Param(_init_experts(rngs.params(), (E, D, F), param_dtype), **in_axes)
    self.experts_down_proj = nnx.Param(_init_experts(rngs.params(), (E, F, D), param_dtype), **out_axes)
    self.shared_experts = (
        MLP(D, F * n_shared_experts, swiglu_limit=swiglu_limit, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if n_shared_experts > 0
        else None
    )
    self.shared_expert_gate = nnx.Linear(
        D, 1, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
        kernel_metadata=shd.param(shd.EMBED, None),
    ) if shared_expert_gate else None

  @property
  def n_routed_experts(self) -> int:
    """E, read from the stacked expert weights."""
    return self.experts_gate_proj.shape[0]

  def route(self, x: Float[Array, "N D"], token_ids: Int[Array, "N"] | None = None,
            ) -> tuple[Int[Array, "N K"], Float[Array, "N K"]]:
    """Chooses k experts per token and their combine weights.

    Args:
      x: bf16|f32[N, D] flattened tokens; upcast to f32 for the router.
      token_ids: i32[N] the tokens' ids; required by (and only used for) hash routing.

    Returns:
      (expert_ids int32[N, K], weights f32[N, K]); the weights use the unbiased scores.

    Raises:
      ValueError: a hash-routed layer gets no `token_ids`, or ids of the wrong shape.
    """
    scores = _scores(self.gate(x.astype(jnp.float32)), self.scoring)  # [N, E]
    if self.tid2eid is not None:
      if token_ids is None or token_ids.shape != x.shape[:1]:
        raise ValueError(f"hash-routed MoE needs token_ids of shape {x.shape[:1]}, got "
                         f"{None if token_ids is None else token_ids.shape}.")
      return self._combine(scores, self.tid2eid[...][token_ids])
    choice = scores  # [N, E], used only for selection
    if self.e_score_correction_bias is not None:
      choice = scores + self.e_score_correction_bias[...]
    if self.n_group > 1:
      N, E = choice.shape
      grouped = choice.reshape(N, self.n_group, E // self.n_group)  # [N, G, E/G]
      # DeepSeek-V3 ranks a group by the sum of its two best biased scores.
      top2 = jax.lax.top_k(grouped, min(2, E // self.n_group))[0].sum(-1)  # [N, G]
      _, kept = jax.lax.top_k(top2, self.topk_group)  # [N, topk_group]
      keep = jax.nn.one_hot(kept, self.n_group, dtype=jnp.bool_).any(axis=-2)  # [N, G]
      # -inf, not HF's 0.0: a negative bias could otherwise let a masked expert win.
      choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, E)
    _, expert_ids = jax.lax.top_k(choice, self.experts_per_token)  # [N, K]
    return self._combine(scores, expert_ids)

  def _combine(self, scores, expert_ids):
    """(expert_ids, combine weights f32[N, K]): the chosen experts' scores, renormalised and scaled."""
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [N, K]
    if self.norm_topk_prob:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return expert_ids, weights * self.routed_scaling

  def __call__(self, x: Float[Array, "B T D"], *, token_ids: Int[Array, "B T"] | None = None,
               backends=None) -> tuple[Float[Array, "B T D"], Float[Array, "E"]]:
    """Routes each token to k experts, runs them as grouped matmuls, adds the shared experts.

    Args:
      x: bf16|f32[B, T, D].
      token_ids: i32[B, T] the input token ids; needed by hash routing, ignored otherwise.
      backends: an object whose `grouped_matmul` names the op's backend (`config.ops`); None or a
        missing attribute means "auto".

    Returns:
      (y [B, T, D] in `x.dtype`, expert_load f32[E]). The expert matmuls run in the module `dtype`
      with f32 accumulation (their outputs rounded to `dtype`); SwiGLU and the combine are in f32.
      `expert_load` is the fraction of the N*k routing slots sent to each expert (it sums to 1), for
      `update_router_bias` and logging.
    """
    B, T, D = x.shape
    K, E = self.experts_per_token, self.n_routed_experts
    flat = x.reshape(B * T, D)  # [N, D]
    flat_ids = None if token_ids is None or self.tid2eid is None else token_ids.reshape(-1)
    expert_ids, weights = self.route(flat, flat_ids)  # [N, K], [N, K]
    experts = (self.experts_gate_proj[...], self.experts_up_proj[...], self.experts_down_proj[...])
    grouped = functools.partial(self._grouped_swiglu, backend=getattr(backends, "grouped_matmul", "auto"))
    mesh = expert_parallel.expert_mesh()
    if mesh is None:
      y, group_sizes = self._chunked_local_experts(flat.astype(self.dtype), expert_ids, weights, experts, grouped)
    else:  # the experts are split over the mesh's `expert` axis: all-to-all dispatch
      out, group_sizes = expert_parallel.expert_parallel(
          x.astype(self.dtype), expert_ids.reshape(B, T, K), experts, grouped, mesh=mesh)
      y = jnp.einsum("NKD,NK->ND", out.reshape(B * T, K, D), weights,
                     preferred_element_type=jnp.float32)  # f32[N, D]

    if self.shared_experts is not None:
      shared = self.shared_experts(flat)
      if self.shared_expert_gate is not None:
        shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * shared
      y = y + shared.astype(jnp.float32)
    expert_load = group_sizes.astype(jnp.float32) / (B * T * K)  # [E]
    return y.reshape(B, T, D).astype(x.dtype), expert_load

  def _chunked_local_experts(self, flat, expert_ids, weights, experts, grouped):
    """`_local_experts` over `token_chunk` tokens at a time, each chunk rematerialized in the backward pass.

    Routing is per token, so chunks give the same result; what changes is that the dispatched rows,
    the experts' activations and their gradients exist for one chunk at a time: O(token_chunk * k *
    width) instead of O(N * k * width) (at GLM-5.1's 64K tokens, 0.5M routed rows of 6144 and 2048
    wide activations: tens of GB). The cost is one more forward of the experts per chunk.
    """
    N, D = flat.shape
    chunk = self.token_chunk
    if not chunk or N <= chunk:
      return self._local_experts(flat, expert_ids, weights, experts, grouped)
    if N % chunk:
      raise ValueError(f"model.moe_token_chunk={chunk} must divide the tokens per device N={N} "
                       "(or be >= N, or 0 for one chunk).")
    split = lambda a: a.reshape(N // chunk, chunk, *a.shape[1:])  # [N / chunk, chunk, ...]
    body = jax.checkpoint(lambda xs: self._local_experts(*xs, experts, grouped), prevent_cse=False)
    y, group_sizes = jax.lax.map(body, (split(flat), split(expert_ids), split(weights)))
    return y.reshape(N, D), group_sizes.sum(axis=0)

  def _local_experts(self, flat, expert_ids, weights, experts, grouped):
    """All experts on this device: (f32[N, D] the weighted sum of each token's k expert outputs, i32[E] copies per expert)."""
    N, K = expert_ids.shape
    order, group_sizes, rows = expert_parallel.sort_by_expert(flat, expert_ids, self.n_routed_experts)
    out = grouped(rows, group_sizes, *experts)  # [N*K, D] in the compute dtype
    # The combine adds each weighted copy into its token's row: no [N*K, D] copy in token order, and in
    # the backward one gather of dy per copy.
    weighted = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # [N*K, D]
    return jnp.zeros((N, out.shape[1]), jnp.float32).at[order // K].add(weighted), group_sizes

  def _grouped_swiglu(self, rows, group_sizes, w_gate, w_up, w_down, *, backend="auto"):
    """The experts' SwiGLU on expert-sorted rows [R, D] -> [R, D] in the compute dtype (rows past the groups give 0)."""
    gmm = lambda lhs, w: ops.grouped_matmul(lhs, w.astype(self.dtype), group_sizes, backend=backend)
    f32 = lambda w: gmm(rows, w).astype(jnp.float32)  # SwiGLU in f32, as with ragged_dot's f32 outputs
    h = swiglu(f32(w_gate), f32(w_up), self.swiglu_limit)  # f32[R, F]
    return gmm(h.astype(self.dtype), w_down)  # [R, D]


def update_router_bias(moe: MoE, expert_load: Float[Array, "E"], rate: float) -> None:
  """The DeepSeek-V3 auxiliary-loss-free balancing step: `bias += rate * sign(mean(load) - load)`.

  Under-loaded experts get a larger selection bias and over-loaded ones a smaller one. It runs
  outside the gradient: call it after the optimiser step with the `expert_load` the forward pass
  returned (a non-differentiable count). The bias is a `RouterBias`, not an `nnx.Param`, so no
  optimiser touches it, and it never enters the combine weights: it changes which experts are
  chosen, not how their outputs are weighted. Updates the variable in place.

  A router without the bias (`selection_bias=False`) is left as it is.

  Args:
    moe: the layer whose `e_score_correction_bias` is moved.
    expert_load: f32[E], as returned by `MoE.__call__`.
    rate: the bias update speed (DeepSeek-V3 uses 0.001).
  """
  bias = moe.e_score_correction_bias
  if bias is None:
    return
  load = jnp.asarray(expert_load, jnp.float32)
  bias[...] = bias[...] + rate * jnp.sign(load.mean() - load)
