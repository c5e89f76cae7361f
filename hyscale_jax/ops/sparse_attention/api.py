"""`sparse_attention`: softmax attention of each query over its own list of selected keys."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hyscale_jax.ops import _checks, _context
from hyscale_jax.ops._registry import Backend, BackendRegistry
from hyscale_jax.ops.sparse_attention.reference import sparse_attention_reference
from hyscale_jax.ops.sparse_attention.vjp import attention_with_saved_residuals


def _pallas_kernel(config, hopper):
  """Which passes `config.forward` / `config.backward` put on Mosaic GPU (Hopper, where the kernel applies:
  one key head, values from the key rows, 64-head blocks), the rest on Triton."""
  passes = [name for name, choice in (("forward", config.forward), ("backward", config.backward))
            if choice == "mosaic" or (choice == "auto" and hopper is not False)]
  if not passes:
    return "Triton"
  where = "on Hopper " if hopper is None and "auto" in (config.forward, config.backward) else ""
  where += "where they apply" if len(passes) > 1 else "where it applies"
  return f"Mosaic GPU {' and '.join(passes)} {where}, Triton otherwise"


REGISTRY = BackendRegistry(
    "sparse_attention",
    {"reference": sparse_attention_reference},
    auto_order={"gpu": ("pallas", "reference"), "default": ("reference",)},
)
# The Pallas forward and backward kernels, joined by the same residual-saving custom_vjp.
REGISTRY.register_optional(
    "pallas", "pallas_kernels.sparse_attention",
    ("sparse_attention_forward_pallas", "sparse_attention_backward_pallas"),
    wrap=lambda forward, backward: functools.partial(attention_with_saved_residuals, forward, backward),
    kernel=lambda kernels, hopper: _pallas_kernel(kernels.Config(), hopper))


def sparse_attention(
    q: Float[Array, "B T H Dk"],
    k: Float[Array, "B S G Dk"],
    v: Float[Array, "B S G Dv"] | None,
    indices: Int[Array, "B T K"],
    *,
    scale: float,
    sinks: Float[Array, "H"] | None = None,
    backend: Backend = "auto",
    value_dim: int | None = None,
    deterministic: bool = False,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B T H"]]:
  """Attention of query t over keys `indices[b, t, :]`, shared by all G key/value groups.

  Under a mesh with a `context` axis (`jax.set_mesh`), the queries are split over it and k, v
  all-gathered; dk and dv are reduce-scattered back.

  Head h reads group `h // (H // G)` (G = 1 is MQA, as in absorbed MLA and DeepSeek-V4). A duplicate
  index counts once per occurrence; -1 (or any index outside [0, S)) is skipped. Logits, the
  softmax and the value sum are f32; `out` is returned in q's dtype. Differentiable in q, k, v and
  sinks (indices get none); the backward reuses the saved `lse`.

  `v=None` says the values are the keys' first `value_dim` columns: absorbed MLA's latent (the key
  is [latent, rope]) and DeepSeek-V4's K = V. Same result as passing `k[..., :value_dim]`, but the
  Pallas kernels then gather each selected row once and scatter its key and value gradients as one
  row (about half the backward's atomics at MLA dims). `out` and `lse` are tagged
  `remat.ATTENTION_OUT` / `remat.ATTENTION_LSE` so `"selection_replay"` saves them.

  The Pallas backward adds dk/dv rows with f32 atomics, so their bits vary run to run on the GPU.
  `deterministic=True` makes them bit-identical: the kernel writes each selected row's gradient to
  its own slot and a key-major pass sums each key's rows in a fixed order (ascending query token,
  then slot, then head block), queries in chunks of about 1 GiB of f32 rows; the reference sums
  with a sort and a segmented scan instead of XLA's scatter-add. Values agree with the default to
  f32 rounding. Under context parallelism the reduce-scatter of dk/dv across devices is the
  collective's own order.

  Args:
    q: bf16|f32[B, T, H, Dk] queries.
    k: bf16|f32[B, S, G, Dk] keys.
    v: bf16|f32[B, S, G, Dv] values, or None for `k[..., :value_dim]`.
    indices: int[B, T, K] key positions per query.
    scale: logit scale (static Python float).
    sinks: optional f32[H]: adds exp(sinks[h]) to the softmax denominator and no value.
    backend: "auto", "pallas" or "reference".
    value_dim: with `v=None`, Dv (default: all of Dk). Not allowed with an explicit `v`.
    deterministic: bit-identical dk/dv (and dq, dsinks) run to run; costs backward time and memory.

  Returns:
    (out [B, T, H, Dv] in q.dtype, lse f32[B, T, H]). A row with no valid index gives out = 0 and
    lse = -inf, or lse = sinks[h] with sinks; never NaN.

  Raises:
    ValueError: on a wrong rank, mismatched batch/length/group/dim sizes, H not divisible by G,
      non-integer indices, non-float inputs or a non-bool `deterministic`.
  """
  value_dim = _check_args(q, k, v, indices, scale, sinks, value_dim)
  if not isinstance(deterministic, bool):
    raise ValueError(f"deterministic={deterministic!r} must be a bool (True: bit-identical dk/dv run to run).")
  names = REGISTRY.candidates(backend)

  def attend(row_offset, local, full, replicated):
    del row_offset  # indices name global key positions
    (q, indices), (k, *v), (sinks,) = local, full, replicated
    return REGISTRY.run(names, q, k, v[0] if v else None, indices, scale=float(scale), sinks=sinks,
                        value_dim=value_dim, deterministic=deterministic)

  gathered = (k,) if v is None else (k, v)
  mesh = _context.context_mesh()
  if mesh is None:
    return attend(0, (q, indices), gathered, (sinks,))
  # Context parallelism: this device's queries against all-gathered keys and values.
  return _context.run_sequence_sharded(attend, mesh, sharded=(q, indices), gathered=gathered,
                                       replicated=(sinks,), n_out=2)


def _check_args(q, k, v, indices, scale, sinks, value_dim) -> int | None:
  """Validates the call; returns the value width when `v` is None (else None)."""
  _checks.check_rank("q", q, 4, "B, T, H, Dk")
  _checks.check_rank("k", k, 4, "B, S, G, Dk")
  if v is not None:
    _checks.check_rank("v", v, 4, "B, S, G, Dv")
  _checks.check_rank("indices", indices, 3, "B, T, K")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x is not None:
      _checks.check_float(name, x)
  _checks.check_int("indices", indices)
  B, T, H, Dk = q.shape
  where = f"from q.shape={tuple(q.shape)}"
  _checks.check_dim("k", k, 0, B, f"batch, {where}")
  _checks.check_dim("k", k, 3, Dk, f"head dim, {where}")
  if v is not None and v.shape[:3] != k.shape[:3]:
    raise ValueError(
        f"v.shape={tuple(v.shape)} must match k.shape={tuple(k.shape)} in [B, S, G]."
    )
  if v is not None and value_dim is not None:
    raise ValueError(f"value_dim={value_dim} is for v=None (values = k[..., :value_dim]); v.shape={tuple(v.shape)} "
                     "already gives Dv.")
  if v is None:
    value_dim = Dk if value_dim is None else value_dim
    if not isinstance(value_dim, int) or isinstance(value_dim, bool) or not 0 < value_dim <= Dk:
      raise ValueError(f"value_dim={value_dim!r} must be an int in [1, Dk={Dk}] (k.shape={tuple(k.shape)}).")
  G = k.shape[2]
  if H % G:
    raise ValueError(f"q heads H={H} must be divisible by k groups G={G} ({q.shape=}, {k.shape=}).")
  if indices.shape[:2] != (B, T):
    raise ValueError(f"indices.shape={tuple(indices.shape)} must start with [B, T]={(B, T)} {where}.")
  _checks.check_static_float("scale", scale)
  if sinks is not None:
    _checks.check_rank("sinks", sinks, 1, "H")
    _checks.check_float("sinks", sinks)
    if sinks.shape != (H,):
      raise ValueError(f"sinks.shape={tuple(sinks.shape)} must be [H]=({H},) {where}.")
  return value_dim
