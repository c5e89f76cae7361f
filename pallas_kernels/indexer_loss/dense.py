"""The DSA warm-up's dense indexer KL as Pallas kernels (Triton lowering): no [T, S] table, and the
teacher's probabilities never reach memory.

Row t's support is every key it sees (causal under `compress_ratio`, within its segment). With

    I[t, s] = index_scale * sum_j w[t, j] relu(<iq[t, j], ik[s]>)         the student (FlashTopK's score)
    u[t, s] = sum_h exp(attn_scale * <aq[t, h], ak[s, g(h)]> - lse[t, h])  the teacher, head-summed

the row's KL(u / Z || softmax I) is `cross / Z - log Z + lse_I`, where Z = sum_s u and
cross = sum_s u (log u - I). The attention's own `lse` is read, never recomputed.

- `dense_kl_stats_pallas`: one pass over the visible keys per block of queries: lse_I (online), Z, cross.
- `dense_kl_grads_pallas`: the logit gradient g[t, s] = c[t] (exp(I - lse_I) - u / Z) pulled back to
  iq and w by a query-major pass and to ik by a key-major pass. Each recomputes I and u tile by tile;
  no atomics, so every sum runs in a fixed order and the gradients repeat bit for bit.

Inside a tile the heads run one at a time, each a [block_q, D] x [D, block_k] dot, so one kernel serves
MQA (absorbed MLA, one key head) and MHA (the warm-up's non-absorbed MLA, a key head per query head).
Head dims that are no power of two are loaded as power-of-two column slices (`power_of_two_parts`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shapes import next_power_of_two, power_of_two_parts
from pallas_kernels.flash_topk._common import key_visible, keys_seen, segment_first_keys

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Config:
  """Query rows per program (`block_q`), keys per tile (`block_k`), Triton's warps and stages."""

  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"dense indexer KL Config.{name}={value} must be a power of two.")

  def fitted(self, T: int, S: int) -> Config:
    """The blocks no larger than the padded lengths (short inputs, tests), at least 16 (Triton's dots)."""
    return dataclasses.replace(self, block_q=min(self.block_q, max(16, next_power_of_two(T))),
                               block_k=min(self.block_k, max(16, next_power_of_two(S))))


def _dot(a, b, precision):
  return jax.lax.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _grad_dot(d, x, precision):
  """f32 d @ x for a gradient: f32 inputs at full precision; bf16 ones on the tensor cores, d rounded to
  x's dtype (as the attention backward rounds ds)."""
  if x.dtype == jnp.float32:
    return _dot(d, x, precision)
  return _dot(d.astype(x.dtype), x, None)


def _logits(q_parts, k_parts, precision):
  """f32 [rows, block_k]: sum over head-dim parts of q_p @ k_p^T."""
  return functools.reduce(lambda acc, x: acc + x, [_dot(q, k.T, precision) for q, k in zip(q_parts, k_parts)])


class _Tile:
  """What every kernel computes for one (query block, key tile): visibility, student and teacher.

  Query-side arrays are laid out head-major per query block (`_head_rows`): the rows of head j of query
  block i are `(i * heads + j) * block_q ...`; `q_block` is that block's index in the refs (0 when the
  ref holds just the program's block). Keys are [S_pad, d] (the student's) and [G * S_pad, d] (the
  teacher's, group g's rows from g * S_pad).
  """

  def __init__(self, refs: dict, *, static: dict):
    self.refs, self.static = refs, static

  def visible(self, q_pos, k_pos, q_seg, k_seg):
    s = self.static
    vis = key_visible(k_pos[None, :], q_pos[:, None], s["compress_ratio"], s["num_keys"])
    if q_seg is not None:
      vis &= q_seg[:, None] == k_seg[None, :]
    return vis

  def index_dots(self, q_block, j, k_parts):
    """[block_q, block_k] <iq[t, j], ik[s]> of index head j."""
    bq = self.static["block_q"]
    rows = pl.ds((q_block * self.static["index_heads"] + j) * bq, bq)
    return _logits([r[rows, :] for r in self.refs["iq"]], k_parts, self.static["precision"])

  def index_weight(self, q_block, j):
    if self.refs["iw"] is None:
      return None
    bq = self.static["block_q"]
    return self.refs["iw"][pl.ds((q_block * self.static["index_heads"] + j) * bq, bq)].astype(jnp.float32)

  def student(self, q_block, k_parts):
    """[block_q, block_k] I before `index_scale`: sum_j w_j relu(<iq_j, ik>)."""
    s = self.static

    def head(j, acc):
      relu = jnp.maximum(self.index_dots(q_block, j, k_parts), 0.0)
      w = self.index_weight(q_block, j)
      return acc + (relu if w is None else relu * w[:, None])

    return jax.lax.fori_loop(0, s["index_heads"], head, jnp.zeros((s["block_q"], k_parts[0].shape[0]), jnp.float32))

  def teacher(self, q_block, k_start, vis):
    """[block_q, block_k] u = sum_h exp(attn_scale <aq_h, ak_g(h)> - lse_h), 0 where not visible."""
    s = self.static
    bq, bk = s["block_q"], vis.shape[1]

    def head(h, u):
      rows = pl.ds((q_block * s["heads"] + h) * bq, bq)
      key_rows = pl.ds((h // s["heads_per_group"]) * s["keys_padded"] + k_start, bk)
      logits = _logits([r[rows, :] for r in self.refs["aq"]], [r[key_rows, :] for r in self.refs["ak"]],
                       s["precision"]) * s["attn_scale"]
      lse = self.refs["alse"][rows]
      seen = lse > -jnp.inf  # a head that saw no key adds nothing
      p = jnp.exp(logits - jnp.where(seen, lse, 0.0)[:, None])
      return u + jnp.where(vis & seen[:, None], p, 0.0)

    return jax.lax.fori_loop(0, s["heads"], head, jnp.zeros((bq, bk), jnp.float32))


def _unpack(refs, counts: dict) -> dict:
  """Splits a kernel's flat refs into named groups by `counts`: name -> (how many, whether a list: the
  column parts of one operand); a single name counted 0 is None."""
  refs, out = list(refs), {}
  for name, (n, is_list) in counts.items():
    group = [refs.pop(0) for _ in range(n)]
    out[name] = group if is_list else (group[0] if group else None)
  assert not refs, f"{len(refs)} refs left over"
  return out


def _query_block_range(q_offset, static, first_ref):
  """(q_pos [block_q], first key tile, key tiles) of this program's query block."""
  bq, bk = static["block_q"], static["block_k"]
  q_pos = q_offset + pl.program_id(1) * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
  n_tiles = (keys_seen(jnp.max(q_pos), static["compress_ratio"], static["num_keys"]) + bk - 1) // bk
  # Packed documents: tiles before the first key sharing an id with one of the block's queries are skipped.
  first_tile = jnp.min(first_ref[...]) // bk if first_ref is not None else 0
  return q_pos, first_tile, n_tiles


def _stats_kernel(q_offset_ref, *refs, counts, static):
  r = _unpack(refs, counts)
  tile = _Tile(r, static=static)
  bk = static["block_k"]
  q_pos, first_tile, n_tiles = _query_block_range(q_offset_ref[0], static, r["first"])
  q_seg = r["q_seg"][...] if r["q_seg"] is not None else None

  def step(j, carry):
    m, l, mass, cross = carry
    k_start = j * bk
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k_seg = r["kv_seg"][pl.ds(k_start, bk)] if q_seg is not None else None
    vis = tile.visible(q_pos, k_pos, q_seg, k_seg)
    k_parts = [ref[pl.ds(k_start, bk), :] for ref in r["ik"]]
    student = jnp.where(vis, tile.student(0, k_parts) * static["index_scale"], -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(student, axis=1))
    shift = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    l = l * jnp.exp(m - shift) + jnp.sum(jnp.exp(student - shift[:, None]), axis=1)
    u = tile.teacher(0, k_start, vis)
    positive = u > 0
    term = jnp.where(positive, u * (jnp.log(jnp.where(positive, u, 1.0)) - jnp.where(vis, student, 0.0)), 0.0)
    return m_new, l, mass + jnp.sum(u, axis=1), cross + jnp.sum(term, axis=1)

  bq = static["block_q"]
  zero = jnp.zeros((bq,), jnp.float32)
  m, l, mass, cross = jax.lax.fori_loop(first_tile, n_tiles, step, (jnp.full((bq,), -jnp.inf), zero, zero, zero))
  r["lse_out"][...] = jnp.where(l > 0, jnp.where(m > -jnp.inf, m, 0.0) + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  r["mass_out"][...] = mass
  r["cross_out"][...] = cross


def _logit_grad(tile, static, q_block, row_stats, vis, k_parts, k_start):
  """[block_q, block_k] dL/dI * index_scale: c (softmax(I) - u / Z) at visible keys, 0 elsewhere."""
  lse_i, inv_mass, coef = row_stats
  student = tile.student(q_block, k_parts) * static["index_scale"]
  u = tile.teacher(q_block, k_start, vis)
  seen = lse_i > -jnp.inf
  softmax = jnp.exp(student - jnp.where(seen, lse_i, 0.0)[:, None])
  g = coef[:, None] * (softmax - u * inv_mass[:, None])
  return jnp.where(vis & seen[:, None], g, 0.0) * static["index_scale"]


def _query_grads_kernel(q_offset_ref, *refs, counts, static):
  r = _unpack(refs, counts)
  tile = _Tile(r, static=static)
  bq, bk = static["block_q"], static["block_k"]
  q_pos, first_tile, n_tiles = _query_block_range(q_offset_ref[0], static, r["first"])
  q_seg = r["q_seg"][...] if r["q_seg"] is not None else None
  row_stats = (r["lse_i"][...], r["inv_mass"][...], r["coef"][...])
  for ref in r["dq"]:
    ref[...] = jnp.zeros(ref.shape, jnp.float32)
  if r.get("dw") is not None:
    r.get("dw")[...] = jnp.zeros(r.get("dw").shape, jnp.float32)

  def step(t, carry):
    k_start = t * bk
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k_seg = r["kv_seg"][pl.ds(k_start, bk)] if q_seg is not None else None
    vis = tile.visible(q_pos, k_pos, q_seg, k_seg)
    k_parts = [ref[pl.ds(k_start, bk), :] for ref in r["ik"]]
    g = _logit_grad(tile, static, 0, row_stats, vis, k_parts, k_start)

    def head(j, c):
      rows = pl.ds(j * bq, bq)
      dots = tile.index_dots(0, j, k_parts)
      w = tile.index_weight(0, j)
      d_dots = jnp.where(dots > 0, g if w is None else g * w[:, None], 0.0)
      for dq_ref, k in zip(r["dq"], k_parts):
        dq_ref[rows, :] += _grad_dot(d_dots, k, static["precision"])
      if r.get("dw") is not None:
        r.get("dw")[rows] += jnp.sum(g * jnp.maximum(dots, 0.0), axis=1)
      return c

    jax.lax.fori_loop(0, static["index_heads"], head, 0)
    return carry

  jax.lax.fori_loop(first_tile, n_tiles, step, 0)


def _key_grads_kernel(q_offset_ref, *refs, counts, static):
  r = _unpack(refs, counts)
  tile = _Tile(r, static=static)
  bq, bk, m = static["block_q"], static["block_k"], static["compress_ratio"]
  k_start = pl.program_id(1) * bk
  k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
  k_parts = [ref[pl.ds(k_start, bk), :] for ref in r["ik"]]
  k_seg = r["kv_seg"][pl.ds(k_start, bk)] if r["kv_seg"] is not None else None
  q_offset = q_offset_ref[0]
  # The first query that sees the tile's first key: position (k_start + 1) * m - 1.
  first_block = jnp.maximum((k_start + 1) * m - 1 - q_offset, 0) // bq
  n_blocks = static["query_blocks"]
  if r["last"] is not None:  # packed documents: query blocks past the last query sharing an id are skipped
    n_blocks = jnp.minimum(n_blocks, (jnp.max(r["last"][...]) + bq - 1) // bq)

  def block(i, acc):
    rows = pl.ds(i * bq, bq)
    q_pos = q_offset + i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
    q_seg = r["q_seg"][rows] if k_seg is not None else None
    vis = tile.visible(q_pos, k_pos, q_seg, k_seg)
    row_stats = (r["lse_i"][rows], r["inv_mass"][rows], r["coef"][rows])
    g = _logit_grad(tile, static, i, row_stats, vis, k_parts, k_start)

    def head(j, acc):
      head_rows = pl.ds((i * static["index_heads"] + j) * bq, bq)
      q_parts = [ref[head_rows, :] for ref in r["iq"]]
      dots = _logits(q_parts, k_parts, static["precision"])
      w = tile.index_weight(i, j)
      d_dots = jnp.where(dots > 0, g if w is None else g * w[:, None], 0.0)
      return tuple(a + _grad_dot(d_dots.T, q, static["precision"]) for a, q in zip(acc, q_parts))

    return jax.lax.fori_loop(0, static["index_heads"], head, acc)

  zeros = tuple(jnp.zeros((bk, ref.shape[1]), jnp.float32) for ref in r["dk"])
  acc = jax.lax.fori_loop(first_block, n_blocks, block, zeros)
  for ref, a in zip(r["dk"], acc):
    ref[...] = a


# ------------------------------------------------------------------------------------------------
# Layout and launch.


def _head_rows(x, block_q):
  """[B, T, H, ...] -> [B, n_blocks * H * block_q, ...]: each query block's rows head by head."""
  B, T, H = x.shape[:3]
  n = -(-T // block_q)
  x = jnp.pad(x, [(0, 0), (0, n * block_q - T)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(B, n, block_q, H, *x.shape[3:])
  x = jnp.moveaxis(x, 3, 2)
  return x.reshape(B, n * H * block_q, *x.shape[4:])


def _from_head_rows(x, T, H, block_q):
  """Inverse of `_head_rows` (f32 gradients): [B, n * H * block_q, ...] -> [B, T, H, ...]."""
  B, rest = x.shape[0], x.shape[2:]
  n = x.shape[1] // (H * block_q)
  x = x.reshape(B, n, H, block_q, *rest)
  x = jnp.moveaxis(x, 2, 3).reshape(B, n * block_q, H, *rest)
  return x[:, :T]


def _split_columns(x):
  """x [..., D] as power-of-two column slices, each its own operand."""
  parts, start = [], 0
  for width in power_of_two_parts(x.shape[-1]):
    parts.append(x[..., start:start + width])
    start += width
  return parts


@dataclasses.dataclass(frozen=True)
class _Launch:
  """Operands and block specs shared by the three kernels."""

  operands: dict
  static: dict
  shapes: tuple  # (B, T, T_pad, S, S_pad)


def _prepare(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, q_offset, segment_ids, compress_ratio,
             index_scale, attn_scale, config: Config):
  B, T, HI, _ = index_q.shape
  S = index_k.shape[1]
  H, G = attn_q.shape[2], attn_k.shape[2]
  if H % G:
    raise ValueError(f"attn_q heads H={H} must be divisible by attn_k heads G={G}.")
  config = config.fitted(T, S)
  bq, bk = config.block_q, config.block_k
  T_pad, S_pad = -(-T // bq) * bq, -(-S // bk) * bk
  pad_keys = lambda x: jnp.pad(x, [(0, 0), (0, S_pad - S)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  attn_k = jnp.moveaxis(pad_keys(attn_k), 2, 1).reshape(B, G * S_pad, attn_k.shape[-1])
  operands = dict(
      iq=_split_columns(_head_rows(index_q, bq)),
      ik=_split_columns(pad_keys(index_k)),
      iw=None if index_weights is None else _head_rows(index_weights[..., None], bq)[..., 0],
      aq=_split_columns(_head_rows(attn_q, bq)),
      ak=_split_columns(attn_k),
      # Padded rows see no key: lse -inf drops them from the teacher.
      alse=_head_rows(jnp.pad(attn_lse.astype(jnp.float32), ((0, 0), (0, T_pad - T), (0, 0)),
                              constant_values=-jnp.inf), bq),
  )
  if segment_ids is not None:
    q_seg, kv_seg = (s.astype(jnp.int32) for s in segment_ids)
    first = jax.vmap(segment_first_keys)(q_seg, kv_seg)
    # For each key, one past the last query sharing its id (0 if none): from the reversed queries.
    last = T - jax.vmap(segment_first_keys)(kv_seg, q_seg[:, ::-1])
    operands.update(q_seg=jnp.pad(q_seg, ((0, 0), (0, T_pad - T)), constant_values=-1),
                    kv_seg=jnp.pad(kv_seg, ((0, 0), (0, S_pad - S)), constant_values=-2),
                    first=jnp.pad(first, ((0, 0), (0, T_pad - T)), constant_values=S_pad),
                    last=jnp.pad(last, ((0, 0), (0, S_pad - S))))
  else:
    operands.update(q_seg=None, kv_seg=None, first=None, last=None)
  static = dict(block_q=bq, block_k=bk, index_heads=HI, heads=H, heads_per_group=H // G, keys_padded=S_pad,
                num_keys=S, compress_ratio=int(compress_ratio), query_blocks=T_pad // bq,
                index_scale=float(index_scale), attn_scale=float(attn_scale),
                precision=_HIGHEST if index_q.dtype == jnp.float32 else None)
  q_offset = jnp.asarray(q_offset, jnp.int32).reshape(1)
  return _Launch(operands, static, (B, T, T_pad, S, S_pad)), q_offset, config


def _spec(kind, launch: _Launch, x):
  """Block spec of operand `x` for a grid over (batch, query blocks) ("query") or (batch, key tiles) ("key")."""
  s = launch.static
  bq, bk = s["block_q"], s["block_k"]
  rank = len(x.shape)
  full = pl.BlockSpec((None, *x.shape[1:]), lambda b, i: (b,) + (0,) * (rank - 1))
  return {"full": full,
          "rows": pl.BlockSpec((None, x.shape[1] // s["query_blocks"], *x.shape[2:]),
                               lambda b, i: (b, i) + (0,) * (rank - 2)),
          "key_rows": pl.BlockSpec((None, bk, *x.shape[2:]), lambda b, i: (b, i) + (0,) * (rank - 2)),
          "query_rows": pl.BlockSpec((None, bq), lambda b, i: (b, i))}[kind]


def _call(kernel, launch, q_offset, names_kinds, extra, out_shapes, out_kinds, grid, config, interpret, name):
  """pallas_call of `kernel` over `grid` with the named operands (None: absent) and outputs."""
  operands, specs, counts = [q_offset], [pl.BlockSpec((1,), lambda b, i: (0,))], {}
  for op_name, kind in names_kinds:
    value = extra[op_name] if op_name in extra else launch.operands[op_name]
    group = value if isinstance(value, list) else ([] if value is None else [value])
    counts[op_name] = (len(group), isinstance(value, list))
    operands += group
    specs += [_spec(kind, launch, v) for v in group]
  flat_shapes, out_specs = [], []
  for out_name, shapes in out_shapes.items():
    group = shapes if isinstance(shapes, list) else [shapes]
    counts[out_name] = (len(group), isinstance(shapes, list))
    flat_shapes += group
    out_specs += [_spec(out_kinds[out_name], launch, shape) for shape in group]
  return pl.pallas_call(
      functools.partial(kernel, counts=counts, static=launch.static),
      out_shape=flat_shapes, grid=grid, in_specs=specs, out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name=name,
  )(*operands)


def _resolve(config, interpret):
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return config or Config(), interpret


def dense_kl_stats_pallas(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, *, q_offset=0,
                          segment_ids=None, compress_ratio: int = 1, index_scale: float, attn_scale: float,
                          config: Config | None = None, interpret: bool | None = None):
  """Per-row statistics of the dense indexer KL, one pass over the visible keys.

  Args:
    index_q: bf16|f32[B, T, HI, DI]; index_k: [B, S, DI]; index_weights: [B, T, HI] or None (all 1).
    attn_q: bf16|f32[B, T, H, Dk]; attn_k: [B, S, G, Dk] (query head h reads key head h // (H / G)).
    attn_lse: f32[B, T, H], the attention's log-sum-exp over the same support (-inf: the head adds nothing).
    q_offset: i32 scalar, the absolute position of query 0 (may be traced); segment_ids: (q_seg int[B, T],
      kv_seg int[B, S]) or None.

  Returns:
    (lse_I, Z, cross), each f32[B, T]: the student's log-sum-exp (-inf for a row that sees no key), the
    teacher's mass and sum_s u (log u - I).
  """
  config, interpret = _resolve(config, interpret)
  launch, q_offset, config = _prepare(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, q_offset,
                                      segment_ids, compress_ratio, index_scale, attn_scale, config)
  B, T, T_pad, _, _ = launch.shapes
  row = jax.ShapeDtypeStruct((B, T_pad), jnp.float32)
  outs = _call(_stats_kernel, launch, q_offset,
               [("iq", "rows"), ("ik", "full"), ("iw", "rows"), ("aq", "rows"), ("ak", "full"), ("alse", "rows"),
                ("q_seg", "query_rows"), ("kv_seg", "full"), ("first", "query_rows")],
               {}, dict(lse_out=row, mass_out=row, cross_out=row),
               dict(lse_out="query_rows", mass_out="query_rows", cross_out="query_rows"),
               (B, launch.static["query_blocks"]), config, interpret, "hyscale_dense_indexer_kl_stats")
  return tuple(o[:, :T] for o in outs)


def dense_kl_grads_pallas(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, lse_i, inv_mass, coef, *,
                          q_offset=0, segment_ids=None, compress_ratio: int = 1, index_scale: float,
                          attn_scale: float, config: Config | None = None, interpret: bool | None = None):
  """Gradients of `sum_t coef[t] * KL_t` in the student's inputs, from `dense_kl_stats_pallas`' rows.

  Args:
    The inputs of `dense_kl_stats_pallas`, and per row f32[B, T]: `lse_i` (its lse_I), `inv_mass`
    (1 / Z, 0 for a row left out) and `coef` (the row's weight in the loss, 0 for a row left out).

  Returns:
    f32 (d index_q [B, T, HI, DI], d index_k [B, S, DI], d index_weights [B, T, HI] or None).
  """
  config, interpret = _resolve(config, interpret)
  launch, q_offset, config = _prepare(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, q_offset,
                                      segment_ids, compress_ratio, index_scale, attn_scale, config)
  B, T, T_pad, S, S_pad = launch.shapes
  HI = index_q.shape[2]
  pad_rows = lambda x, value=0.0: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, T_pad - T)),  # noqa: E731
                                          constant_values=value)
  rows = dict(lse_i=pad_rows(lse_i, -jnp.inf), inv_mass=pad_rows(inv_mass), coef=pad_rows(coef))
  iq_parts = launch.operands["iq"]
  dq_shapes = [jax.ShapeDtypeStruct(p.shape, jnp.float32) for p in iq_parts]
  has_w = index_weights is not None
  out_shapes = dict(dq=dq_shapes)
  out_kinds = dict(dq="rows")
  if has_w:
    out_shapes["dw"] = jax.ShapeDtypeStruct(launch.operands["iw"].shape, jnp.float32)
    out_kinds["dw"] = "rows"
  inputs = [("iq", "rows"), ("ik", "full"), ("iw", "rows"), ("aq", "rows"), ("ak", "full"), ("alse", "rows"),
            ("q_seg", "query_rows"), ("kv_seg", "full"), ("first", "query_rows"),
            ("lse_i", "query_rows"), ("inv_mass", "query_rows"), ("coef", "query_rows")]
  outs = _call(_query_grads_kernel, launch, q_offset, inputs, rows, out_shapes, out_kinds,
               (B, launch.static["query_blocks"]), config, interpret, "hyscale_dense_indexer_kl_query_grads")
  dq = jnp.concatenate([_from_head_rows(o, T, HI, launch.static["block_q"]) for o in outs[:len(iq_parts)]], axis=-1)
  dw = _from_head_rows(outs[-1][..., None], T, HI, launch.static["block_q"])[..., 0] if has_w else None

  key_inputs = [("iq", "full"), ("ik", "full"), ("iw", "full"), ("aq", "full"), ("ak", "full"), ("alse", "full"),
                ("q_seg", "full"), ("kv_seg", "full"), ("last", "key_rows"),
                ("lse_i", "full"), ("inv_mass", "full"), ("coef", "full")]
  ik_parts = launch.operands["ik"]
  dk = _call(_key_grads_kernel, launch, q_offset, key_inputs, rows,
             dict(dk=[jax.ShapeDtypeStruct(p.shape, jnp.float32) for p in ik_parts]), dict(dk="key_rows"),
             (B, S_pad // launch.static["block_k"]), config, interpret, "hyscale_dense_indexer_kl_key_grads")
  dk = jnp.concatenate(dk, axis=-1)[:, :S]
  return dq, dk, dw
