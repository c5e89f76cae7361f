"""Triton kernels of the gated delta rule's sequential inter-chunk pass, forward and backward.

The chunked gated delta rule (flash-linear-attention's `chunk_gated_delta_rule`) has two kinds of
work. Each chunk's WY/UT terms (its triangular solve, its intra-chunk scores) read no state and are
computed for all chunks at once, by XLA (`ops.gated_delta_rule`'s glue). What remains is a pass
over the chunks in order, three matmuls a chunk, which `lax.scan` runs as one small launch per chunk.
These kernels run that pass with the state in registers: one program per (batch x value head,
value block), a `fori_loop` over the chunks, as fla's `chunk_gated_delta_rule_fwd_h` does.

Per chunk, with the state S f32[Dk, Dv] before it (`ops.gated_delta_rule`'s reference names):
    u   = u0 - w S                      (the delta rule's written values)
    out = q_reach S + scores u
    S'  = reach_last S + k_last^T u
and backward, with dS' the cotangent of S' (the forward's S saved per chunk):
    du  = scores^T dout + k_last dS'
    dS  = reach_last dS' + q_reach^T dout - w^T du
The forward writes out, S per chunk and the final state; the backward writes du (= du0), dS' per
chunk and dS before chunk 0. Every term's other cotangent is a batched product of those (dw = -du S^T,
...) that XLA does in parallel over the chunks (`ops/gated_delta_rule/scan_vjp.py`).

Layout: heads flattened with the batch, BH = B * Hv; tokens padded to n chunks of C.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_PRECISIONS = {
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
}


@dataclasses.dataclass(frozen=True)
class Config:
  """Value columns per program (block_v), Triton's warps and stages, and the f32 matmul algorithm.

  precision: "tf32" (tensor cores, 10-bit mantissa inputs; what XLA's default f32 dot does on Hopper
  GPUs), "tf32x3" (three tf32 products, about f32 accuracy), "ieee" (f32 FMAs, slow), or None:
  follow `jax_default_matmul_precision` as XLA's dots in the same program do ("ieee" under
  "highest"/"float32", else "tf32").
  """

  block_v: int = 32
  num_warps: int = 4
  num_stages: int = 2
  precision: str | None = None

  def __post_init__(self):
    if self.block_v < 16 or self.block_v & (self.block_v - 1):
      raise ValueError(f"Config.block_v={self.block_v} must be a power of two >= 16.")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"Config.num_warps={self.num_warps} must be 1, 2, 4, 8 or 16.")
    if self.num_stages < 1:
      raise ValueError(f"Config.num_stages={self.num_stages} must be >= 1.")
    if self.precision is not None and self.precision not in _PRECISIONS:
      raise ValueError(f"Config.precision={self.precision!r} must be one of {sorted(_PRECISIONS)}.")

  @classmethod
  def heuristics(cls, Dk: int, Dv: int, C: int) -> "Config":
    """block_v 32 (fla's choice at 128 dims): a [Dk, 32] f32 state and a chunk's [C, Dk] terms stay
    in 4 warps' registers, and B * Hv * Dv / 32 programs (192 at one row of Qwen3.8-Flash-Next's 48
    value heads) cover a Hopper GPU's 132 SMs; 8 warps once the chunk's [C, Dk] tiles pass 64 x 128.
    Two pipeline stages only while two copies of a chunk's f32 tiles (three [C, Dk], one [C, C])
    fit 160 KiB of shared memory (of Hopper's 227): at C 64 and Dk 128 they are 224 KiB, so one.
    Chosen from offline compiles for sm_90 (registers, spills and shared memory per config:
    docs/kernels/gated_delta_rule.md); not yet timed on a device (`search_space`)."""
    tiles = 4 * (3 * C * Dk + C * C)
    return cls(block_v=min(32, Dv), num_warps=8 if C * Dk > 64 * 128 else 4,
               num_stages=2 if 2 * tiles <= 160 * 1024 else 1)

  def search_space(self, Dv: int) -> list["Config"]:
    """The configs worth timing at value width Dv."""
    return [dataclasses.replace(self, block_v=b, num_warps=w, num_stages=s)
            for b in (16, 32, 64) if b <= Dv for w in (4, 8) for s in (1, 2, 3)]


def check_applies(C: int, Dk: int, Dv: int, config: Config | None = None) -> None:
  """NotImplementedError where Triton's tiles do not fit: C, Dk and Dv must be powers of two >= 16
  (`tl.dot` operands), and block_v must divide Dv."""
  config = config or Config.heuristics(Dk, Dv, C)
  for name, n in (("chunk", C), ("Dk", Dk), ("Dv", Dv)):
    if n < 16 or n & (n - 1):
      raise NotImplementedError(f"gated_delta_rule pallas: {name}={n} is not a power of two >= 16.")
  if Dv % config.block_v:
    raise NotImplementedError(f"gated_delta_rule pallas: Config.block_v={config.block_v} does not divide {Dv=}.")


def _dot(a, b, precision):
  return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _gated_delta_rule_fwd_kernel(
    # Inputs
    w_ref,  # [n C, Dk]
    u0_ref,  # [n C, block_v]
    q_reach_ref,  # [n C, Dk]
    scores_ref,  # [n C, C]
    reach_last_ref,  # [n]
    k_last_ref,  # [n C, Dk]
    state0_ref,  # [Dk, block_v]
    # Outputs
    out_ref,  # [n C, block_v]
    states_ref,  # [n, Dk, block_v]: the state before each chunk
    final_ref,  # [Dk, block_v]
    *,
    n: int,
    C: int,
    precision,
):
  def chunk(i, state):
    rows = pl.ds(i * C, C)
    states_ref[i] = state
    u = u0_ref[rows, :] - _dot(w_ref[rows, :], state, precision)
    out_ref[rows, :] = _dot(q_reach_ref[rows, :], state, precision) + _dot(scores_ref[rows, :], u, precision)
    return reach_last_ref[i] * state + _dot(k_last_ref[rows, :].T, u, precision)

  final_ref[...] = jax.lax.fori_loop(0, n, chunk, state0_ref[...])


def _gated_delta_rule_bwd_kernel(
    # Inputs
    w_ref,  # [n C, Dk]
    q_reach_ref,  # [n C, Dk]
    scores_ref,  # [n C, C]
    reach_last_ref,  # [n]
    k_last_ref,  # [n C, Dk]
    dout_ref,  # [n C, block_v]
    dfinal_ref,  # [Dk, block_v]
    # Outputs
    du_ref,  # [n C, block_v]
    dstates_ref,  # [n, Dk, block_v]: the cotangent of the state after each chunk
    dstate0_ref,  # [Dk, block_v]
    *,
    n: int,
    C: int,
    precision,
):
  def chunk(j, dstate):
    i = n - 1 - j
    rows = pl.ds(i * C, C)
    dstates_ref[i] = dstate
    dout = dout_ref[rows, :]
    w = w_ref[rows, :]
    du = _dot(scores_ref[rows, :].T, dout, precision) + _dot(k_last_ref[rows, :], dstate, precision)
    du_ref[rows, :] = du
    return (reach_last_ref[i] * dstate + _dot(q_reach_ref[rows, :].T, dout, precision) - _dot(w.T, du, precision))

  dstate0_ref[...] = jax.lax.fori_loop(0, n, chunk, dfinal_ref[...])


def _pass(kernel, name, operands, *, chunk, config, interpret):
  """One pass over the chunks on the grid (BH, Dv // block_v): `kernel` reads `operands`, pairs of an
  array and its layout name, and writes ([BH, n C, Dv], [BH, n, Dk, Dv], [BH, Dk, Dv]) in f32."""
  BH, Dk, Dv = operands[-1][0].shape  # the state (or its cotangent) comes last
  n = next(x.shape[1] for x, layout in operands if layout == "per_chunk")  # reach_last [BH, n]
  config, interpret, precision = _resolve(config, interpret, chunk, Dk, Dv)
  bv, C = config.block_v, chunk
  largest = max(BH * n * Dk * Dv, *(x.size for x, _ in operands))  # the per-chunk states are [BH, n, Dk, Dv]
  if largest >= 2**31:
    raise NotImplementedError(f"gated_delta_rule pallas: an array of {largest} elements; Triton's offsets are int32.")
  specs = dict(
      rows_k=pl.BlockSpec((None, n * C, Dk), lambda h, j: (h, 0, 0)),
      rows_c=pl.BlockSpec((None, n * C, C), lambda h, j: (h, 0, 0)),
      rows_v=pl.BlockSpec((None, n * C, bv), lambda h, j: (h, 0, j)),
      per_chunk=pl.BlockSpec((None, n), lambda h, j: (h, 0)),
      state=pl.BlockSpec((None, Dk, bv), lambda h, j: (h, 0, j)),
      states=pl.BlockSpec((None, n, Dk, bv), lambda h, j: (h, 0, 0, j)),
  )
  return pl.pallas_call(
      functools.partial(kernel, n=n, C=C, precision=precision),
      grid=(BH, Dv // bv),
      in_specs=[specs[layout] for _, layout in operands],
      out_specs=[specs["rows_v"], specs["states"], specs["state"]],
      out_shape=[jax.ShapeDtypeStruct((BH, n * C, Dv), jnp.float32),
                 jax.ShapeDtypeStruct((BH, n, Dk, Dv), jnp.float32),
                 jax.ShapeDtypeStruct((BH, Dk, Dv), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(*(x for x, _ in operands))


def _resolve(config, interpret, C, Dk, Dv):
  """(config, interpret, the in-kernel dot precision): interpret mode evaluates the body with XLA's
  CPU dots, which take no tf32 algorithm, so it computes in f32."""
  config = config or Config.heuristics(Dk, Dv, C)
  check_applies(C, Dk, Dv, config)
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  if interpret:
    return config, interpret, jax.lax.Precision.HIGHEST
  name = config.precision
  if name is None:
    name = "ieee" if str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32") else "tf32"
  return config, interpret, _PRECISIONS[name]


@functools.partial(jax.jit, static_argnames=("chunk", "config", "interpret"))
def gated_delta_rule_scan_fwd(terms, state0, *, chunk: int, config: Config | None = None,
                              interpret: bool | None = None):
  """The pass over the chunks in order: (out, states before each chunk, final state), all f32.

  Args:
    terms: (w f32[BH, n C, Dk], u0 f32[BH, n C, Dv], q_reach f32[BH, n C, Dk], scores f32[BH, n C, C],
      reach_last f32[BH, n], k_last f32[BH, n C, Dk]): each chunk's state-independent terms.
    state0: f32[BH, Dk, Dv] the state before chunk 0.
    chunk: C (static). config: tiles; None = `Config.heuristics`. interpret: None = off a GPU.

  Returns:
    (out f32[BH, n C, Dv], states f32[BH, n, Dk, Dv], final f32[BH, Dk, Dv]).
  Raises:
    NotImplementedError: C, Dk or Dv not a power of two >= 16 (see `check_applies`).
  """
  w, u0, q_reach, scores, reach_last, k_last = terms
  return _pass(_gated_delta_rule_fwd_kernel, "hyscale_gated_delta_rule_fwd",
               ((w, "rows_k"), (u0, "rows_v"), (q_reach, "rows_k"), (scores, "rows_c"), (reach_last, "per_chunk"),
                (k_last, "rows_k"), (state0, "state")), chunk=chunk, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("chunk", "config", "interpret"))
def gated_delta_rule_scan_bwd(terms, dout, dfinal, *, chunk: int, config: Config | None = None,
                              interpret: bool | None = None):
  """The pass over the chunks in reverse: (du, cotangents of the state after each chunk, dstate0).

  Args:
    terms: as `gated_delta_rule_scan_fwd`'s (u0 is not read).
    dout: f32[BH, n C, Dv] the cotangent of out. dfinal: f32[BH, Dk, Dv] that of the final state.

  Returns:
    (du f32[BH, n C, Dv], dstates f32[BH, n, Dk, Dv], dstate0 f32[BH, Dk, Dv]).
  """
  w, _, q_reach, scores, reach_last, k_last = terms
  return _pass(_gated_delta_rule_bwd_kernel, "hyscale_gated_delta_rule_bwd",
               ((w, "rows_k"), (q_reach, "rows_k"), (scores, "rows_c"), (reach_last, "per_chunk"), (k_last, "rows_k"),
                (dout.astype(jnp.float32), "rows_v"), (dfinal.astype(jnp.float32), "state")),
               chunk=chunk, config=config, interpret=interpret)
