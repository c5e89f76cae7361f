"""Pallas (Triton-style) sparse attention over gathered indices: forward, backward and the teacher.

Every kernel here runs one program per (query token, block of `block_h` heads of one KV group). In
MQA (absorbed MLA, DeepSeek-V4) all heads share the group, so each gathered key row serves them
all. A program walks the token's selected indices `block_k` at a time and gathers those key and
value rows by integer-array loads.

- Forward: online softmax; writes `out` and the f32 `lse` (sink included) that the backward and
  the indexer loss reuse.
- Backward: recomputes `P = exp(S - lse)` from the saved `lse` (no second softmax), forms
  `dS = P * (dP - delta)` with `delta = rowsum(dO * O) - dlse`, and writes `dq` directly. `dk`
  and `dv` rows are scattered to the gathered positions with relaxed-order f32 atomic adds
  (`_relaxed_atomics`) into f32 accumulators. Atomic order varies between runs, so dk/dv are not bitwise reproducible on the GPU:
  each element is a sum of n f32 terms in some order, so two runs differ by at most
  `2 (n - 1) 2^-24 sum |terms|` (Higham's bound for recursive summation), n being how many
  (query, head) pairs selected that key. The inverted alternative (key-outer, FSA-style) reads a
  whole [H, Dk] query row per selected pair instead of writing one [Dk] gradient row, 64-128x the
  bytes in MQA mode, so it loses here. The atomics scale with the head blocks, so at MLA and V4
  dims a program takes all 64 heads and runs them in slices of 32 (`Config.slice_h`): every
  matmul's M stays under Triton's wgmma threshold, so q and dout sit in shared memory once.
- Deterministic backward (`deterministic=True`): the same kernel stores each step's dK/dV rows in
  its own f32 slab instead of adding them atomically, and `key_major.py` sums the slabs key by key
  in a fixed order (bit-identical run to run), queries in chunks of `Config.chunk_bytes` of slabs.
- Values from the key row: with `v=None` (absorbed MLA's latent is the key's first 512 of 576
  dims; DeepSeek-V4 has K = V) the gathered key part doubles as the value tile, and the backward
  adds dV into that part's dK before one scatter: 576 atomics per (key, head block) instead of
  576 + 512, which the atomic-bound backward feels directly (docs/kernels/sparse_attention.md).
- Teacher (indexer loss): `sum_h exp(S - lse)` at each selected key, the DSA distillation target,
  from the saved `lse` without writing per-head probabilities.

Triton wants power-of-two tensor shapes, so the wrappers split the key head dim into power-of-two
parts (576 = 512 + 64 for absorbed MLA), pad the selection to a multiple of `block_k` with -1, the
key length to a power of two, and each group's heads to a multiple of `block_h` (QSA's 12 heads per
group become 16). They decline (NotImplementedError) a value head dim that is not a power of two.

Interpret mode (CPU tests) runs the same kernels, with one difference in the scatter
(`_relaxed_atomics.scatter_add_rows` says which).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._hopper import require_hopper
from pallas_kernels._relaxed_atomics import scatter_add_rows
from pallas_kernels._shapes import next_power_of_two, power_of_two_parts
from pallas_kernels.sparse_attention import key_major
from pallas_kernels.sparse_attention._common import row_delta

_HIGHEST = jax.lax.Precision.HIGHEST
_NEG = -1e30  # a finite "minus infinity" for the running max, so empty prefixes never give inf - inf


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning: heads per program, selected keys per step, and Triton's warps/stages.

  The backward adds `slice_h` (0: off): it computes S, P, dP, dS and dq for slices of `slice_h` of
  the program's heads, and sums the slices' dK and dV rows before one scatter. Each matmul's M then
  stays under 64, so Triton uses the older mma for all of them and keeps one shared-memory copy of
  q and dout (wgmma for S = q k^T beside dS^T q on the older mma needs two copies of each, which
  overflow Hopper's 227 KiB at 64 heads of 576 + 512); 64 heads per program halve the atomic adds of 32.
  The deterministic backward adds two: `key_block`, keys per program of its key-major pass, and
  `chunk_bytes`, the budget of its f32 contribution slabs (queries run in chunks that fit it).

  `forward` picks the forward kernel: "auto" runs the Mosaic GPU kernel (`mgpu_forward.py`) on a
  Hopper GPU where it applies (one key head, values from the key rows, 64-head blocks; several times
  faster than this file's kernel at MLA dims) and this file's Triton kernel elsewhere; "triton" always
  runs this file's; "mosaic" raises NotImplementedError where the Mosaic GPU kernel does not apply.
  `backward` picks the backward kernel the same way (`mgpu_backward.py`: one key head, values from the
  key rows, 64-head blocks, 16-bit inputs, not `deterministic`; the other `Config` fields tune only
  the Triton kernels). docs/kernels/sparse_attention.md has the measurements.
  """

  block_h: int = 64
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 2
  key_block: int = 16
  chunk_bytes: int = 1 << 30
  forward: Literal["auto", "triton", "mosaic"] = "auto"
  slice_h: int = 0
  backward: Literal["auto", "triton", "mosaic"] = "auto"

  @classmethod
  def heuristics(cls, Dk: int, Dv: int, itemsize: int) -> "Config":
    """Largest block_k whose double-buffered gathered K and V rows fit in ~160 KiB of shared memory."""
    block_k = 64
    while block_k > 16 and 2 * block_k * (Dk + Dv) * itemsize > 160 * 1024:
      block_k //= 2
    return cls(block_k=block_k)

  @classmethod
  def teacher_heuristics(cls, Dk: int, itemsize: int) -> "Config":
    """The forward's rule for block_k with no value rows, on 4 warps (measured faster than 8 at MLA dims:
    docs/kernels/indexer_loss.md)."""
    return dataclasses.replace(cls.heuristics(Dk, 0, itemsize), num_warps=4)

  @classmethod
  def backward_heuristics(cls, Dk: int, Dv: int, itemsize: int, heads_per_group: int = 0, *,
                          value_from_key: bool = False) -> "Config":
    """16-bit inputs with >= 64 heads per KV group whose values are the key rows' prefix (absorbed MLA,
    DeepSeek-V4; Dk <= 576, Dv <= 512): 64 heads per program in slices of 32, 32 keys per step, 8
    warps, 1 stage, which halves the atomic adds of 32 heads (measured faster at MLA and V4 dims, 16K
    and 64K: docs/kernels/sparse_attention.md).
    Else (f32, whose 64 heads overflow shared memory; QSA's 12 heads per group; explicit value rows,
    a second gathered tile that was never measured at 64 heads) the earlier best: 32 heads, 16 keys,
    4 warps."""
    if itemsize == 2 and value_from_key and heads_per_group >= 64 and Dk <= 576 and Dv <= 512:
      return cls(block_h=64, block_k=32, num_warps=8, num_stages=1, slice_h=32)
    return cls(block_h=32, block_k=16, num_warps=4, num_stages=1)

  def __post_init__(self):
    if self.slice_h and self.slice_h & (self.slice_h - 1):
      raise ValueError(f"Config.slice_h={self.slice_h} must be 0 or a power of two.")
    for name in ("block_h", "block_k", "key_block"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"Config.{name}={value} must be a power of two.")
    if self.chunk_bytes < 1:
      raise ValueError(f"Config.chunk_bytes={self.chunk_bytes} must be positive.")
    for name in ("forward", "backward"):
      if getattr(self, name) not in ("auto", "triton", "mosaic"):
        raise ValueError(f"Config.{name}={getattr(self, name)!r} must be 'auto', 'triton' or 'mosaic'.")


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How [B, T, H, Dk] x [B, S, G, Dk] becomes power-of-two blocks; shared by every kernel here."""

  B: int
  T: int
  H: int
  G: int
  S: int
  Dk: int
  Dv: int | None
  K: int
  block_h: int
  block_k: int
  interpret: bool

  @classmethod
  def make(cls, q, k, v_dim: int | None, indices, config: Config, interpret: bool) -> "_Layout":
    B, T, H, Dk = q.shape
    S, G = k.shape[1], k.shape[2]
    if v_dim is not None and v_dim & (v_dim - 1):
      raise NotImplementedError(f"pallas sparse_attention needs a power-of-two value dim, got Dv={v_dim}.")
    block_h = min(config.block_h, next_power_of_two(H // G))
    if not interpret:
      block_h = max(block_h, 16)  # tl.dot needs every matmul dim >= 16; padded heads fill the rest
    block_k = min(config.block_k, next_power_of_two(indices.shape[2]))
    layout = cls(B, T, H, G, S, Dk, v_dim, indices.shape[2], block_h, block_k, interpret)
    if not interpret and min(block_k, v_dim or 16, *layout.parts) < 16:
      raise NotImplementedError(
          f"pallas sparse_attention needs >= 16 selected keys and head-dim parts on GPU; got "
          f"block_k={block_k}, Dk parts {layout.parts}, Dv={v_dim}.")
    return layout

  @property
  def parts(self) -> tuple[int, ...]:
    return power_of_two_parts(self.Dk)

  @property
  def offsets(self) -> tuple[int, ...]:
    return tuple(sum(self.parts[:i]) for i in range(len(self.parts)))

  @property
  def heads_per_group(self) -> int:
    return self.H // self.G

  @property
  def padded_heads_per_group(self) -> int:
    return -(-self.heads_per_group // self.block_h) * self.block_h

  @property
  def H_pad(self) -> int:
    return self.G * self.padded_heads_per_group

  @property
  def K_pad(self) -> int:
    return -(-self.K // self.block_k) * self.block_k

  @property
  def S_pad(self) -> int:
    return next_power_of_two(self.S)

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.B, self.T, self.H_pad // self.block_h)

  def group(self, h):
    return h * self.block_h // self.padded_heads_per_group

  # Padding and unpadding.
  def pad_heads(self, x, value=0):
    """[B, T, H, ...] -> [B, T, H_pad, ...], each group's heads padded to a multiple of block_h."""
    if self.H_pad == self.H:
      return x
    x = x.reshape(x.shape[:2] + (self.G, self.heads_per_group) + x.shape[3:])
    widths = [(0, 0)] * x.ndim
    widths[3] = (0, self.padded_heads_per_group - self.heads_per_group)
    return jnp.pad(x, widths, constant_values=value).reshape(x.shape[:2] + (self.H_pad,) + x.shape[4:])

  def unpad_heads(self, x):
    if self.H_pad == self.H:
      return x
    x = x.reshape(x.shape[:2] + (self.G, self.padded_heads_per_group) + x.shape[3:])
    return x[:, :, :, : self.heads_per_group].reshape(x.shape[:2] + (self.H,) + x.shape[4:])

  def pad_sinks(self, sinks):
    """[H] -> [H_pad] f32 (padded heads get sink 0; their rows are discarded)."""
    return self.pad_heads(sinks.astype(jnp.float32)[None, None])[0, 0]

  def pad_indices(self, indices):
    return jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, self.K_pad - self.K)), constant_values=-1)

  def pad_keys(self, x):
    return jnp.pad(x, ((0, 0), (0, self.S_pad - self.S), (0, 0), (0, 0)))

  def split_dim(self, x):
    """[..., Dk] -> the power-of-two parts of the last axis."""
    return [x[..., o : o + d] for o, d in zip(self.offsets, self.parts)]

  # BlockSpecs over the grid (b, t, h).
  def head_rows(self, d=None):
    """This program's [block_h, d] (or [block_h] if d is None) rows of a [B, T, H_pad, (d)] array."""
    if d is None:
      return pl.BlockSpec((None, None, self.block_h), lambda b, t, h: (b, t, h))
    return pl.BlockSpec((None, None, self.block_h, d), lambda b, t, h: (b, t, h, 0))

  def group_keys(self, d):
    """This program's group's whole [S_pad, d] slab of a [B, S_pad, G, d] array."""
    return pl.BlockSpec((None, self.S_pad, None, d), lambda b, t, h: (b, 0, self.group(h), 0))

  def token_indices(self):
    return pl.BlockSpec((None, None, self.K_pad), lambda b, t, h: (b, t, 0))

  def sink_block(self):
    return pl.BlockSpec((self.block_h,), lambda b, t, h: (h,))

  def head_slices(self, config: Config) -> int:
    """How many slices of `config.slice_h` heads the backward splits each block of heads into."""
    return max(1, self.block_h // config.slice_h) if config.slice_h else 1

  def params(self, config: Config):
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _resolve(config, default, interpret):
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return config or default, interpret


def _matmul(a, b, contract, precision):
  """f32 `dot_general(a, b)` contracting `contract` = (a's axes, b's axes), no batch axes."""
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32, precision=precision)


def _logits(qs, ks, precision):
  """f32 [block_h, block_k]: sum over head-dim parts of q_i @ k_i^T."""
  return functools.reduce(operator.add, [_matmul(q, k, ((1,), (1,)), precision) for q, k in zip(qs, ks)])


def _selected(idx_ref, j, block_k, num_keys):
  ids = idx_ref[pl.ds(j * block_k, block_k)]
  valid = (ids >= 0) & (ids < num_keys)
  return valid, jnp.where(valid, ids, 0)


# ------------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(*refs, n_parts, scale, num_keys, block_k, has_sinks, value_from_key, precise):
  # Inputs: q parts [block_h, d_i] ..., k parts [S_pad, d_i] ..., v [S_pad, Dv] (absent when the
  # values are the first key part), indices [K_pad], sinks [block_h] (if any).
  # Outputs: out [block_h, Dv], lse [block_h].
  q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
  rest = list(refs[2 * n_parts :])
  v_ref = None if value_from_key else rest.pop(0)
  idx_ref = rest.pop(0)
  sinks_ref = rest.pop(0) if has_sinks else None
  o_ref, lse_ref = refs[-2], refs[-1]
  block_h, dv = o_ref.shape
  precision = _HIGHEST if precise else None
  qs = [r[...] for r in q_refs]

  def step(j, carry):
    m, l, acc = carry
    valid, safe = _selected(idx_ref, j, block_k, num_keys)
    ks = [k_ref[safe, :] for k_ref in k_refs]  # gathered once: logits and (MLA, V4) values
    s = jnp.where(valid[None, :], _logits(qs, ks, precision) * scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])  # masked entries: exp(-inf) = 0
    correction = jnp.exp(m - m_new)
    v = ks[0] if value_from_key else v_ref[safe, :]  # [block_k, Dv]
    pv = _matmul(p.astype(v.dtype), v, ((1,), (0,)), precision)
    return m_new, l * correction + p.sum(axis=1), acc * correction[:, None] + pv

  init = (jnp.full((block_h,), _NEG, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          jnp.zeros((block_h, dv), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, step, init)
  if has_sinks:
    sink = sinks_ref[...].astype(jnp.float32)
    m_new = jnp.maximum(m, sink)
    correction = jnp.exp(m - m_new)
    l = l * correction + jnp.exp(sink - m_new)
    acc = acc * correction[:, None]
    m = m_new
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  o_ref[...] = jnp.where(nonempty[:, None], acc / safe_l[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe_l), -jnp.inf)


def _value_dim(k, v, value_dim) -> int:
  """Dv: v's last dim, else `value_dim` of k's prefix (default all of k)."""
  if v is not None:
    return v.shape[-1]
  return k.shape[-1] if value_dim is None else value_dim


def _values(k, v, value_dim):
  """(v or None, Dv): None when the values are k's first power-of-two part, read from k in-kernel."""
  Dv = _value_dim(k, v, value_dim)
  if v is not None:
    return v, Dv
  if Dv == power_of_two_parts(k.shape[-1])[0]:
    return None, Dv
  return k[..., :Dv], Dv  # another prefix width: an explicit (sliced) value array


def _check_mosaic_forward(k, v, value_dim):
  """Raises NotImplementedError unless the Mosaic GPU forward may run: a Hopper GPU, and a value dim the
  Triton backward (which reads its lse) takes, a power of two; the kernel itself declines the rest."""
  require_hopper("sparse_attention's Mosaic GPU forward")
  Dv = _value_dim(k, v, value_dim)
  if Dv & (Dv - 1):
    raise NotImplementedError(f"sparse_attention's Mosaic GPU forward: Dv={Dv} is not a power of two, which "
                              f"the Triton backward needs")


def sparse_attention_forward_pallas(q, k, v, indices, *, scale, sinks=None, value_dim: int | None = None,
                                    config: Config | None = None, interpret: bool | None = None):
  """Forward pass: (out in q.dtype [B, T, H, Dv], lse f32[B, T, H]); see the module docstring.

  `v=None` means values = `k[..., :value_dim]` (default all of Dk). When that prefix is k's first
  power-of-two part (absorbed MLA: 512 of 576; DeepSeek-V4: all 512) each gathered key row also
  serves as the value row.

  Raises:
    NotImplementedError: Dv is not a power of two, or (compiled for the GPU) a matmul dim would be
      under 16; "auto" then uses the reference backend.
  """
  config, interpret = _resolve(config, None, interpret)
  forward = "auto" if config is None else config.forward
  if forward == "mosaic" and interpret:
    raise NotImplementedError("Config.forward='mosaic': the Mosaic GPU forward needs a GPU (its cp.async gathers "
                              "are inline Mosaic GPU code, which Mosaic GPU's interpret mode cannot run)")
  if not interpret and forward != "triton":
    try:
      _check_mosaic_forward(k, v, value_dim)
      from pallas_kernels.sparse_attention import mgpu_forward  # noqa: PLC0415 - Mosaic GPU only where it runs

      return mgpu_forward.sparse_attention_forward_mgpu(q, k, v, indices, scale=scale, sinks=sinks,
                                                        value_dim=value_dim)
    except NotImplementedError:
      if forward == "mosaic":
        raise
  v, Dv = _values(k, v, value_dim)
  config = config or Config.heuristics(q.shape[-1], Dv, jnp.dtype(k.dtype).itemsize)
  lay = _Layout.make(q, k, Dv, indices, config, interpret)
  value_specs, value_operands = ([], []) if v is None else ([lay.group_keys(Dv)], [lay.pad_keys(v)])
  in_specs = ([lay.head_rows(d) for d in lay.parts] + [lay.group_keys(d) for d in lay.parts]
              + value_specs + [lay.token_indices()])
  operands = [*lay.split_dim(lay.pad_heads(q)), *lay.split_dim(lay.pad_keys(k)), *value_operands,
              lay.pad_indices(indices)]
  if sinks is not None:
    in_specs.append(lay.sink_block())
    operands.append(lay.pad_sinks(sinks))
  kernel = functools.partial(
      _forward_kernel, n_parts=len(lay.parts), scale=float(scale), num_keys=lay.S, block_k=lay.block_k,
      has_sinks=sinks is not None, value_from_key=v is None, precise=q.dtype == jnp.float32)
  out, lse = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((lay.B, lay.T, lay.H_pad, lay.Dv), q.dtype),
                 jax.ShapeDtypeStruct((lay.B, lay.T, lay.H_pad), jnp.float32)),
      grid=lay.grid,
      in_specs=in_specs,
      out_specs=(lay.head_rows(lay.Dv), lay.head_rows()),
      compiler_params=lay.params(config),
      interpret=interpret,
      name="hyscale_sparse_attention_fwd",
  )(*operands)
  return lay.unpad_heads(out), lay.unpad_heads(lse)


# ------------------------------------------------------------------------------------------------
# Backward.


def _backward_kernel(*refs, n_parts, scale, num_keys, block_k, value_from_key, precise, interpret, deterministic,
                     head_slices):
  # Inputs: q parts [block_h, d_i] ..., k parts [S_pad, d_i] ..., v [S_pad, Dv] (absent when the
  # values are the first key part), indices [K_pad], dout [block_h, Dv], lse [block_h],
  # delta [block_h], then (atomic form) the aliased zero accumulators.
  # Outputs: dq parts [block_h, d_i] ..., dk parts ..., dv (absent when the values are the first key
  # part: their gradient is added into dk's first part). dk/dv are f32[S_pad, d] accumulators that
  # take atomic adds at the selected rows or, `deterministic`, this program's own f32[K_pad, d]
  # slab: row j holds slot j's contribution, for the key-major pass to sum.
  # The heads run as `head_slices` slices (see Config): per-slice S, P, dP, dS and dq; dK and dV
  # rows summed over the slices before their one scatter.
  q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
  rest = list(refs[2 * n_parts :])
  v_ref = None if value_from_key else rest.pop(0)
  idx_ref, do_ref, lse_ref, delta_ref = rest[:4]
  outs = refs[-(2 * n_parts + (0 if value_from_key else 1)):]
  dq_refs, dk_refs = outs[:n_parts], outs[n_parts : 2 * n_parts]
  dv_ref = None if value_from_key else outs[-1]
  precision = _HIGHEST if precise else None
  slice_rows = do_ref.shape[0] // head_slices
  slices = [pl.ds(i * slice_rows, slice_rows) for i in range(head_slices)]
  qs = [[r[h, :] for r in q_refs] for h in slices]  # [slice][part]: [slice_rows, d_i]
  dos = [do_ref[h, :] for h in slices]
  lses = [jnp.where(x > -jnp.inf, x, 0.0) for x in (lse_ref[h] for h in slices)]  # empty rows: p is 0 anyway
  deltas = [delta_ref[h] for h in slices]

  def step(j, dqs):  # dqs: [slice][part] f32 accumulators
    valid, safe = _selected(idx_ref, j, block_k, num_keys)

    def emit(ref, rows):  # [block_k, d] gradient rows of slots j * block_k ...
      if deterministic:
        ref[pl.ds(j * block_k, block_k), :] = rows  # invalid slots hold zeros and are never read
      else:
        scatter_add_rows(ref, safe, valid, rows, interpret)

    def head_sum(xs, ws):  # sum over slices of w^T x: [block_k, d]
      return functools.reduce(operator.add, [_matmul(w.astype(x.dtype), x, ((0,), (0,)), precision)
                                             for x, w in zip(xs, ws)])

    ks = [k_ref[safe, :] for k_ref in k_refs]  # gathered once for S, dq and (MLA, V4) the values
    v = ks[0] if value_from_key else v_ref[safe, :]
    ps, dss = [], []
    for q, do, lse, delta in zip(qs, dos, lses, deltas):
      s = _logits(q, ks, precision) * scale
      p = jnp.where(valid[None, :], jnp.exp(s - lse[:, None]), 0.0)  # [slice_rows, block_k]
      dp = _matmul(do, v, ((1,), (1,)), precision)
      ps.append(p)
      dss.append(p * (dp - delta[:, None]))
    dv = head_sum(dos, ps)
    if not value_from_key:
      emit(dv_ref, dv)
    new_dqs = [[None] * n_parts for _ in slices]
    for i, (k, dk_ref) in enumerate(zip(ks, dk_refs)):
      for h, ds in enumerate(dss):
        new_dqs[h][i] = dqs[h][i] + _matmul(ds.astype(k.dtype), k, ((1,), (0,)), precision)
      dk = head_sum([q[i] for q in qs], dss) * scale
      if value_from_key and i == 0:
        dk = dk + dv  # one row carries the key and the value gradient
      emit(dk_ref, dk)
    return new_dqs

  init = [[jnp.zeros(q.shape, jnp.float32) for q in part_qs] for part_qs in qs]
  dqs = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, step, init)
  for h, part_dqs in zip(slices, dqs):
    for dq_ref, dq in zip(dq_refs, part_dqs):
      dq_ref[h, :] = (dq * scale).astype(dq_ref.dtype)


def _backward_call(lay: _Layout, config: Config, rows, keys, grad_dims, *, deterministic, **kernel_args):
  """The backward kernel over `lay.T` query rows: (dq parts, dk/dv parts).

  `rows` are the per-query operands (q parts, then indices, dout, lse, delta; heads padded), `keys`
  the k parts (and v). The dk/dv parts (widths `grad_dims`) are f32[B, S_pad, G, d] atomic sums,
  or `deterministic` f32[B, T, n_blocks, K_pad, d] slabs of per-(token, head block, slot) rows.
  """
  n = len(lay.parts)
  in_specs = ([lay.head_rows(d) for d in lay.parts] + [lay.group_keys(x.shape[-1]) for x in keys]
              + [lay.token_indices(), lay.head_rows(lay.Dv), lay.head_rows(), lay.head_rows()])
  operands = [*rows[:n], *keys, *rows[n:]]
  if deterministic:
    accumulators, aliases = [], {}
    grads = [jax.ShapeDtypeStruct((lay.B, lay.T, lay.grid[2], lay.K_pad, d), jnp.float32) for d in grad_dims]
    grad_specs = [pl.BlockSpec((None, None, None, lay.K_pad, d), lambda b, t, h: (b, t, h, 0, 0)) for d in grad_dims]
  else:
    accumulators = [jnp.zeros((lay.B, lay.S_pad, lay.G, d), jnp.float32) for d in grad_dims]
    aliases = {len(operands) + i: n + i for i in range(len(accumulators))}
    grads = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in accumulators]
    grad_specs = [lay.group_keys(d) for d in grad_dims]
  outs = pl.pallas_call(
      functools.partial(_backward_kernel, n_parts=n, num_keys=lay.S, block_k=lay.block_k, interpret=lay.interpret,
                        deterministic=deterministic, head_slices=lay.head_slices(config), **kernel_args),
      out_shape=[jax.ShapeDtypeStruct((lay.B, lay.T, lay.H_pad, d), rows[0].dtype) for d in lay.parts] + grads,
      grid=lay.grid,
      in_specs=in_specs + grad_specs[: len(accumulators)],
      out_specs=[lay.head_rows(d) for d in lay.parts] + grad_specs,
      input_output_aliases=aliases,
      compiler_params=lay.params(config),
      interpret=lay.interpret,
      name="hyscale_sparse_attention_bwd",
  )(*operands, *accumulators)
  return outs[:n], outs[n:]


def sparse_attention_backward_pallas(residuals, cotangents, *, scale, deterministic: bool = False,
                                     config: Config | None = None, interpret: bool | None = None):
  """Gradients (dq, dk, dv, dsinks) from the saved (q, k, v, indices, sinks, out, lse).

  Args:
    residuals: (q [B, T, H, Dk], k [B, S, G, Dk], v [B, S, G, Dv] or None (values =
      `k[..., :Dv]`, Dv read from `out`), indices int[B, T, K], sinks f32[H] or None,
      out [B, T, H, Dv], lse f32[B, T, H]) as the forward saved them.
    cotangents: (dout [B, T, H, Dv], dlse f32[B, T, H]).
    deterministic: sum dk/dv key by key in a fixed order (`key_major.py`) instead of by atomic
      adds: bit-identical run to run and for any `config.chunk_bytes`, at the cost of writing and
      reading f32 slabs of every selected row (query chunks of `config.chunk_bytes`). dq is the
      same either way.

  Returns:
    dq in q.dtype, dk in k.dtype, dv in v.dtype (None when v is None: the value gradient is then
    part of dk), dsinks in sinks' dtype (or None). dk and dv are accumulated in f32, by atomic adds
    (see the module docstring for the run-to-run bound) or, deterministic, in the fixed order.
  """
  q, k, v, indices, sinks, out, lse = residuals
  dout, dlse = cotangents
  mosaic = _mosaic_backward(residuals, cotangents, scale=scale, deterministic=deterministic, config=config,
                            interpret=interpret)
  if mosaic is not None:
    return mosaic
  value_is_prefix = v is None
  v, Dv = _values(k, v, out.shape[-1])
  default = Config.backward_heuristics(q.shape[-1], Dv, jnp.dtype(k.dtype).itemsize, q.shape[2] // k.shape[2],
                                       value_from_key=v is None)
  config, interpret = _resolve(config, default, interpret)
  lay = _Layout.make(q, k, Dv, indices, config, interpret)
  delta = row_delta(out, dout, dlse)
  rows = [*lay.split_dim(lay.pad_heads(q)), lay.pad_indices(indices), lay.pad_heads(dout.astype(q.dtype)),
          lay.pad_heads(lse, -jnp.inf), lay.pad_heads(delta)]
  keys = [*lay.split_dim(lay.pad_keys(k))] + ([] if v is None else [lay.pad_keys(v)])
  grad_dims = (*lay.parts,) + (() if v is None else (Dv,))
  kernel_args = dict(scale=float(scale), value_from_key=v is None, precise=q.dtype == jnp.float32)
  if deterministic:
    first_pass = lambda chunk_lay, chunk_rows: _backward_call(chunk_lay, config, chunk_rows, keys, grad_dims,
                                                              deterministic=True, **kernel_args)
    dqs, grads = key_major.chunked_backward(first_pass, lay, rows, grad_dims, config)
  else:
    dqs, grads = _backward_call(lay, config, rows, keys, grad_dims, deterministic=False, **kernel_args)
  n = len(lay.parts)
  dq = lay.unpad_heads(jnp.concatenate(dqs, axis=-1))
  dk = jnp.concatenate(grads[:n], axis=-1)[:, : lay.S]
  if v is None:
    dv = None  # already inside dk's first part
  else:
    dv = grads[-1][:, : lay.S]
    if value_is_prefix:  # values were an explicit slice of k: fold their gradient back
      dk, dv = dk + jnp.pad(dv, ((0, 0), (0, 0), (0, 0), (0, lay.Dk - Dv))), None
  dk = dk.astype(k.dtype)
  dv = None if dv is None else dv.astype(v.dtype)
  return dq, dk, dv, _dsinks(sinks, lse, delta)


def _dsinks(sinks, lse, delta):
  """The sink's probability exp(sink - lse) only meets the row term: dsink = -sum p_sink * delta."""
  if sinks is None:
    return None
  p_sink = jnp.exp(sinks.astype(jnp.float32) - lse)
  return (-jnp.sum(p_sink * delta, axis=(0, 1))).astype(sinks.dtype)


def _mosaic_backward(residuals, cotangents, *, scale, deterministic, config, interpret):
  """The Mosaic GPU backward's (dq, dk, None, dsinks) where `config.backward` asks for it and it applies,
  else None (the Triton kernel runs); "mosaic" raises NotImplementedError where it does not apply."""
  backward = "auto" if config is None else config.backward
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if backward == "triton":
    return None
  if interpret:
    if backward == "mosaic":
      raise NotImplementedError("Config.backward='mosaic': the Mosaic GPU backward needs a GPU (its f32 atomic "
                                "adds are inline Mosaic GPU code, which Mosaic GPU's interpret mode cannot run)")
    return None
  q, k, v, indices, sinks, out, lse = residuals
  dout, dlse = cotangents
  try:
    require_hopper("sparse_attention's Mosaic GPU backward")
    from pallas_kernels.sparse_attention import mgpu_backward  # noqa: PLC0415 - Mosaic GPU only where it runs

    mgpu_backward.check_applies(q, k, v, out.shape[-1], deterministic)
  except NotImplementedError:
    if backward == "mosaic":
      raise
    return None
  dq, dk = mgpu_backward.sparse_attention_backward_mgpu(q, k, indices, out, lse, dout, dlse, scale=scale)
  return dq, dk.astype(k.dtype), None, _dsinks(sinks, lse, row_delta(out, dout, dlse))


# ------------------------------------------------------------------------------------------------
# The indexer loss's teacher.


def _teacher_kernel(*refs, n_parts, scale, num_keys, block_k, precise):
  # Inputs: q parts [block_h, d_i] ..., k parts [S_pad, d_i] ..., indices [K_pad], lse [block_h].
  # Output: [K_pad] f32, this head block's sum_h exp(s - lse).
  q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
  idx_ref, lse_ref, out_ref = refs[2 * n_parts :]
  precision = _HIGHEST if precise else None
  qs = [r[...] for r in q_refs]
  lse = lse_ref[...]
  finite = lse > -jnp.inf  # padded heads and empty rows contribute nothing
  lse = jnp.where(finite, lse, 0.0)

  def step(j, carry):
    valid, safe = _selected(idx_ref, j, block_k, num_keys)
    s = _logits(qs, [k_ref[safe, :] for k_ref in k_refs], precision) * scale
    p = jnp.where(valid[None, :] & finite[:, None], jnp.exp(s - lse[:, None]), 0.0)
    out_ref[pl.ds(j * block_k, block_k)] = p.sum(axis=0)
    return carry

  jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, step, 0)


def attention_teacher_pallas(q, k, lse, indices, *, scale, config: Config | None = None,
                             interpret: bool | None = None):
  """f32[B, T, K]: `sum_h exp(scale <q[t,h], k[indices[t,j], g(h)]> - lse[t,h])`, 0 at invalid entries.

  The DSA indexer loss's teacher mass at each selected key (divide by H for the head mean), read
  from the attention's saved `lse`; heads are summed inside the kernel, so no per-head
  probabilities reach memory.

  Args:
    q: bf16|f32[B, T, H, Dk]; k: bf16|f32[B, S, G, Dk]; lse: f32[B, T, H]; indices: int[B, T, K].
  """
  config, interpret = _resolve(config, Config.teacher_heuristics(q.shape[-1], jnp.dtype(k.dtype).itemsize), interpret)
  lay = _Layout.make(q, k, None, indices, config, interpret)
  n_blocks = lay.grid[2]
  partial_mass = pl.pallas_call(
      functools.partial(_teacher_kernel, n_parts=len(lay.parts), scale=float(scale), num_keys=lay.S,
                        block_k=lay.block_k, precise=q.dtype == jnp.float32),
      out_shape=jax.ShapeDtypeStruct((lay.B, lay.T, n_blocks, lay.K_pad), jnp.float32),
      grid=lay.grid,
      in_specs=([lay.head_rows(d) for d in lay.parts] + [lay.group_keys(d) for d in lay.parts]
                + [lay.token_indices(), lay.head_rows()]),
      out_specs=pl.BlockSpec((None, None, None, lay.K_pad), lambda b, t, h: (b, t, h, 0)),
      compiler_params=lay.params(config),
      interpret=interpret,
      name="hyscale_sparse_attention_teacher",
  )(*lay.split_dim(lay.pad_heads(q)), *lay.split_dim(lay.pad_keys(k)), lay.pad_indices(indices),
    lay.pad_heads(lse, -jnp.inf))
  return partial_mass.sum(axis=2)[..., : lay.K]
