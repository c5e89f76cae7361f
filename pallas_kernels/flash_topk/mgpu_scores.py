"""The FlashTopK scoring pass on Hopper Mosaic GPU (warpgroup MMA + TMA): per-row counts and max, and a candidate mask.

What: for queries q bf16[Tq, H, D] (H heads) against keys k bf16[Tk, D], head weights w f32[Tq, H]
and a per-row threshold f32[Tq], the DeepSeek-V3.2 lightning-indexer score

  score[t, s] = scale * sum_h w[t, h] * relu(<q[t, h], k[s]>)      (f32; -0 -> +0, NaN -> -inf)

over the causally visible keys (with segment ids, only the keys of the query's segment), reduced per
row to `n_above` (#score > threshold), `n_tied` (#score == threshold) and `max_score` (-inf for a row
that sees no key), with segments also `n_visible`, and with `emit_mask` an int8 per (query, key)
saying which side of the threshold the key is on. The arithmetic is the Triton main
pass's (`flash_topk.py`, `_candidates_kernel`): f32 products, head sum, then `scale`.

Why: Hopper's warpgroup MMA scores well above what the Pallas-Triton main pass reaches even with
nothing to append (docs/kernels/flash_topk.md has the figures). A Mosaic GPU kernel has no
scatter to append candidates with, so it marks them (`mosaic_pass` lists and rescores them).

Layout, "keys as rows": one CTA takes `block_q` queries, whose block_q * H (query, head) rows of q,
[block_q * H, D], are the MMA's B operand (block_q * H <= 256 columns), loaded once by TMA. Keys
stream through a TMA ring of `stages` slots of 2 * block_k rows; consumer warpgroup c multiplies
its half, `acc[block_k, block_q * H] = k[c-th block_k rows] @ q_block^T` (f32, M = block_k). The
head sum is then a reduction along the accumulator's columns (axis 1), which Mosaic GPU lowers like
attention's row max: within each thread's registers and its quad, no shared memory (the kernel
reserves no reduction scratch, so a cross-warp reduction would fail to lower). Per query j the
static column slice `acc[:, j*H:(j+1)*H]` gets ReLU, the weights (a column vector broadcast along
rows) and the sum: one score per key row, in the WGMMA row layout. Each thread keeps its rows'
running counts and max per query across the key tiles; at the end the partials,
[2 consumers, block_q, block_k] per CTA (1.5 KiB per query at block_k 64, a tenth of q's row; 2 KiB
with segments, whose visible counts are a fourth),
go to global memory through shared memory and XLA sums them, instead of a cross-warp reduction
here (whose shared scratch the two consumers would share).

Pipeline and causality: a third warpgroup issues the TMA loads (q once, then the key ring, with
per-slot "loaded" and "freed" barriers; it also waits out the last "freed" phases, which interpret
mode requires). A CTA stops after the last step holding a key visible to its last query (later
tiles are never loaded or multiplied), and the steps wholly before its first query's edge skip the
mask, as in the Triton kernel. CTAs run in reverse query order, so the longest rows start first.
The last step may hold a consumer half wholly past the causal edge: computed and masked (at most
half a step per CTA). Both consumers take each step's tiles as they land, so their MMAs issue
together; `pingpong` instead makes them alternate through a barrier (FlashAttention-3's schedule,
as `attention_mgpu`), so one's epilogue runs under the other's MMA. Which is faster is for the GPU.

The mask: each consumer writes its [block_q, block_k] int8 tile to shared memory per step and TMA-stores
it, double-buffered (before reusing a tile it waits until at most one store is still reading).

Segments (packed documents): each consumer loads its key tile's segment ids in the accumulator's row
layout and every step takes the visibility mask (no unmasked fast path), comparing them with the
block's query segment ids, as the Triton pass does; a fourth partial counts each row's visible keys.
A CTA starts at the step holding the first key that shares a segment id with one of its queries
(`first_scored_keys`): with documents of L tokens packed in rows of T, the steps before a document
(up to T / L of the row) are neither loaded nor multiplied, and their mask bytes are left unwritten.

Limits: bf16 q and k; block_q * H <= 256 (H padded to 8); block_k 64 or 128; shared memory
(`smem_bytes`) within 227 KiB; one batch row. The
wrapper pads D to a multiple of 64 (the 128-byte swizzle; zeros add nothing), H to a multiple of 8
(zero weight), the queries to block_q (threshold +inf, sliced off) and the keys to 2 * block_k
(masked). Off the GPU it runs in Mosaic GPU's interpret mode (warpgroups as threads, TMA and
barriers simulated), which is how tests/test_flash_topk_mgpu.py checks it on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import smem_transforms
from pallas_kernels.flash_topk._common import key_visible, keys_seen, rank_folded, segment_first_keys

_CONSUMERS = 2  # MMA warpgroups; the third issues the TMA loads
_SWIZZLE_COLS = 64  # bf16 elements of a 128-byte swizzled row
SMEM_LIMIT = 227 * 1024  # Hopper's (sm_90) shared memory per CTA (opt-in), as Mosaic GPU checks it


def smem_bytes(block_q: int, heads: int, block_k: int, stages: int, dim: int, emit_mask: bool = False,
               segments: bool = False) -> int:
  """Shared memory of one CTA: q's block, the key ring, the partial outputs (a fourth, the visible
  counts, with `segments`), the mask's two tiles per consumer (with `emit_mask`) and the barriers.

  `heads` and `dim` as padded (multiples of 8 and 64); bf16 operands. Matches Mosaic GPU's own count
  (e.g. 235584 bytes for block_q 2, block_k 128, 3 stages at H 64, D 128, which it rejects).
  """
  operands = 2 * dim * (block_q * heads + stages * _CONSUMERS * block_k)
  partials = _partial_bytes_per_query(block_k, segments) * block_q
  masks = 2 * _CONSUMERS * block_q * block_k if emit_mask else 0  # two int8 tiles a consumer
  return operands + partials + masks + 8 * (2 + 2 * stages)


def _partial_bytes_per_query(block_k: int, segments: bool) -> int:
  """The per-row partials of one query: above, tied, max (and with segments the visible counts), one
  4-byte entry per consumer and key row of its tile."""
  return (4 if segments else 3) * 4 * _CONSUMERS * block_k


def padded_num_keys(num_keys: int, block_k: int) -> int:
  """The keys (and the mask's columns) as the kernel takes them: a multiple of a step, 2 * block_k."""
  step = _CONSUMERS * block_k
  return -(-num_keys // step) * step


def output_bytes_per_row(num_keys: int, block_k: int, segments: bool) -> int:
  """What `score_counts_mgpu(emit_mask=True)` writes per query row: its mask row and its partials."""
  return padded_num_keys(num_keys, block_k) + _partial_bytes_per_query(block_k, segments)


def _padded_heads_and_dim(num_heads: int, head_dim: int) -> tuple[int, int]:
  """H to a multiple of 8 (zero weight) and D to the 128-byte swizzle's 64 columns (zeros), as the kernel
  takes them."""
  return -(-num_heads // 8) * 8, -(-head_dim // _SWIZZLE_COLS) * _SWIZZLE_COLS


def fits(num_heads: int, head_dim: int, *, block_q: int, block_k: int, stages: int, emit_mask: bool = False,
         segments: bool = False) -> bool:
  """Whether `score_counts_mgpu` takes H heads of dim D with these blocks (MMA columns, shared memory)."""
  heads, dim = _padded_heads_and_dim(num_heads, head_dim)
  return (block_k in (64, 128) and stages >= 2 and 1 <= block_q and block_q * heads <= 256
          and smem_bytes(block_q, heads, block_k, stages, dim, emit_mask, segments) <= SMEM_LIMIT)


def _first_steps(q_seg, kv_seg, block_q: int, block_k: int):
  """i32[ceil(Tq / block_q)]: per CTA, the step (2 * block_k keys) holding the first key that shares a
  segment id with any of its block_q queries."""
  first = segment_first_keys(q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32))
  first = _pad_axis(first, 0, block_q, value=kv_seg.shape[0])  # padded rows never lower a block's start
  return jnp.min(first.reshape(-1, block_q), axis=1) // (_CONSUMERS * block_k)


def first_scored_keys(q_seg, kv_seg, *, block_q: int, block_k: int):
  """i32[Tq]: per query row, the first key its CTA scores with segment ids (q_seg int[Tq], kv_seg int[Tk]):
  the start of the step holding the first key that shares an id with any query of its block of
  block_q rows. The mask's bytes before it are unwritten; `candidates_from_mask(first_keys=)` skips them."""
  steps = _first_steps(q_seg, kv_seg, block_q, block_k)
  return jnp.repeat(steps * (_CONSUMERS * block_k), block_q)[:q_seg.shape[0]]


def _score_counts_kernel(q_offset_gmem, q_gmem, k_gmem, w_gmem, t_gmem, *refs, block_q, heads, block_k, stages,
                         num_keys, compress_ratio, scale, consumer_registers, producer_registers, pingpong,
                         emit_mask, segments):
  # Inputs: q_offset i32 [1] (row 0's position), q [Tq_pad * H, D] (a query's H head rows together),
  # k [Tk_pad, D] (a multiple of 2 block_k rows), w f32 [Tq_pad * H], t f32 [Tq_pad]; with segments
  # q_seg i32 [Tq_pad], kv_seg i32 [Tk_pad] and each block's first step i32 [n_blocks].
  # Outputs, per query block: above, tied i32 and max f32 [n_blocks, 2, block_q, block_k], one entry per
  # (consumer, query, key row of the consumer's tile), reduced by the caller; with a mask, int8
  # [Tq_pad, Tk_pad]: 2 where a visible key scores above the row's threshold, 1 where it ties, 0 at the
  # other keys of the steps the block computes (later keys, invisible to the whole block, unwritten);
  # with segments, the visible counts i32 [n_blocks, 2, block_q, block_k].
  refs = list(refs)
  q_seg_gmem, kv_seg_gmem, first_step_gmem = (refs.pop(0), refs.pop(0), refs.pop(0)) if segments else (None,) * 3
  above_gmem, tied_gmem, max_gmem = refs[:3]
  mask_gmem = [refs[3]] if emit_mask else []
  seen_gmem = refs[-1] if segments else None
  n_blocks = above_gmem.shape[0]
  cols = block_q * heads
  step_keys = _CONSUMERS * block_k
  qb = n_blocks - 1 - lax.axis_index("qb")  # the longest rows first
  first_q = qb * block_q
  first_pos = q_offset_gmem[0] + first_q
  # Steps (of step_keys keys) holding a key visible to the block's last query; the steps before the
  # first query's edge see every key for every query of the block (no mask there).
  n_steps = pl.cdiv(keys_seen(first_pos + block_q - 1, compress_ratio, num_keys), step_keys)
  # With segments every step compares segment ids (the mask everywhere), from the block's first step on
  # (the keys before it share no id with the block's queries). Steps are counted from there: r = i - first.
  first_step = jnp.minimum(first_step_gmem[qb], n_steps) if segments else 0
  n_run = n_steps - first_step
  n_unmasked = 0 if segments else keys_seen(first_pos, compress_ratio, num_keys) // step_keys

  def body(q_smem, k_smem, above_smem, tied_smem, max_smem, q_bar, k_ready, k_free, schedule, *scratch):
    scratch = list(scratch)
    mask_smem = [scratch.pop(0)] if emit_mask else []
    seen_smem = scratch.pop(0) if segments else None
    wg = lax.axis_index("wg")

    def take_turns():  # with `pingpong`: the consumers' MMAs alternate, one's epilogue under the other's MMA
      if pingpong:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(consumer_registers, action="increase")
      # Each query's head weights as a column vector of the accumulator (kept in registers).
      weights = [plgpu.load(w_gmem.at[pl.ds((first_q + j) * heads, heads)], layout=plgpu.Layout.WGMMA.reduce(0),
                            optimized=False) for j in range(block_q)]
      thresholds = [t_gmem[first_q + j] for j in range(block_q)]
      q_segs = [q_seg_gmem[first_q + j] for j in range(block_q)] if segments else None
      row = plgpu.Layout.WGMMA.reduce(1)
      key_iota = plgpu.broadcasted_iota(jnp.int32, (block_k,), 0, layout=row)
      plgpu.barrier_wait(q_bar)

      def step(r, carry, masked):
        i = first_step + r
        slot = lax.rem(r, stages)
        plgpu.barrier_wait(k_ready.at[slot])

        def mma(acc_ref):
          plgpu.wgmma(acc_ref, k_smem.at[slot, pl.ds(pl.multiple_of(wg * block_k, block_k), block_k)],
                      q_smem.transpose((1, 0)))
          take_turns()
          return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((block_k, cols), jnp.float32))  # [block_k, block_q * H]
        plgpu.barrier_arrive(k_free.at[slot])
        key0 = i * step_keys + wg * block_k
        k_pos = key0 + key_iota
        if segments:  # this consumer's key rows' segment ids, in the scores' row layout
          kv_segs = plgpu.load(kv_seg_gmem.at[pl.ds(key0, block_k)], layout=row, optimized=False)
        if emit_mask:  # the store issued two steps ago read this tile: let it finish
          tile = lax.rem(r, 2)
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out = []
        for j in range(block_q):
          above, tied, best, *seen = carry[j]
          dots = acc[:, j * heads:(j + 1) * heads]  # query j's heads: [block_k, H]
          weighted = jnp.maximum(dots, 0.0) * lax.broadcast_in_dim(weights[j], dots.shape, [1])
          score = rank_folded(weighted.sum(axis=1) * scale)  # [block_k], the row layout: a reduction within quads
          is_above, is_tied = score > thresholds[j], score == thresholds[j]
          if masked:
            visible = key_visible(k_pos, first_pos + j, compress_ratio, num_keys)
            if segments:
              visible &= kv_segs == q_segs[j]
              seen = [seen[0] + visible.astype(jnp.int32)]
            is_above, is_tied = is_above & visible, is_tied & visible
            score = jnp.where(visible, score, -jnp.inf)
          out.append((above + is_above.astype(jnp.int32), tied + is_tied.astype(jnp.int32),
                      jnp.maximum(best, score), *seen))
          if emit_mask:
            mask_smem[0][wg, tile, j] = (2 * is_above.astype(jnp.int32) + is_tied.astype(jnp.int32)).astype(jnp.int8)
        if emit_mask:
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(mask_smem[0].at[wg, tile],
                                  mask_gmem[0].at[pl.ds(first_q, block_q), pl.ds(key0, block_k)])
        return tuple(out)

      zeros = plgpu.layout_cast(jnp.zeros((block_k,), jnp.int32), row)
      init = tuple((zeros, zeros, plgpu.layout_cast(jnp.full((block_k,), -jnp.inf, jnp.float32), row),
                    *([zeros] if segments else [])) for _ in range(block_q))
      pl.when(wg == 1)(take_turns)  # consumer 1 starts a turn behind (as attention_mgpu's schedule barrier)
      carry = lax.fori_loop(0, n_unmasked, functools.partial(step, masked=False), init)
      carry = lax.fori_loop(n_unmasked, n_run, functools.partial(step, masked=True), carry)
      pl.when(wg == 0)(take_turns)  # ... and consumer 0 ends one behind: both wait out every phase
      for j, (above, tied, best, *seen) in enumerate(carry):
        above_smem[wg, j] = above
        tied_smem[wg, j] = tied
        max_smem[wg, j] = best
        if segments:
          seen_smem[wg, j] = seen[0]
      plgpu.commit_smem()
      partials = [(above_smem, above_gmem), (tied_smem, tied_gmem), (max_smem, max_gmem)]
      for smem, gmem in partials + ([(seen_smem, seen_gmem)] if segments else []):
        plgpu.copy_smem_to_gmem(smem.at[wg], gmem.at[qb, wg])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(producer_registers, action="decrease")
      plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(first_q * heads, cols)], q_smem, q_bar)

      @pl.loop(0, n_run)
      def _(r):
        slot = lax.rem(r, stages)

        @pl.when(r >= stages)
        def _():
          plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_gmem.at[pl.ds((first_step + r) * step_keys, step_keys)], k_smem.at[slot],
                                k_ready.at[slot])

      # Observe the last steps' "freed" phases too, so no barrier phase is left pending at the end.
      @pl.loop(jnp.maximum(n_run - stages, 0), n_run)
      def _(r):
        plgpu.barrier_wait(k_free.at[lax.rem(r, stages)])

  dim = q_gmem.shape[1]
  dtype = q_gmem.dtype
  pl.run_scoped(
      body,
      plgpu.SMEM((cols, dim), dtype, transforms=smem_transforms(dim, dtype)),
      plgpu.SMEM((stages, step_keys, dim), dtype, transforms=smem_transforms(dim, dtype)),
      plgpu.SMEM((_CONSUMERS, block_q, block_k), jnp.int32),
      plgpu.SMEM((_CONSUMERS, block_q, block_k), jnp.int32),
      plgpu.SMEM((_CONSUMERS, block_q, block_k), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS),
      *([plgpu.SMEM((_CONSUMERS, 2, block_q, block_k), jnp.int8)] if emit_mask else []),
      *([plgpu.SMEM((_CONSUMERS, block_q, block_k), jnp.int32)] if segments else []),
      collective_axes="wg",
  )


def _pad_axis(x, axis: int, multiple: int, value=0):
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def score_counts_mgpu(q, k, weights, threshold, *, scale: float, q_offset=0, compress_ratio: int = 1,
                      segment_ids=None, block_q: int = 4, block_k: int = 64, stages: int = 3,
                      consumer_registers: int = 232, producer_registers: int = 40, pingpong: bool = False,
                      emit_mask: bool = False, interpret=None):
  """Per query row: how many visible keys score above and at its threshold, and its best score.

  Args:
    q: bf16[Tq, H, D] queries at positions q_offset .. q_offset+Tq-1.
    k: bf16[Tk, D] keys; key s sums positions [s*cr, (s+1)*cr) (cr = compress_ratio), so the query at
      position p sees keys s with (s+1)*cr <= p+1 (cr 1: s <= p).
    weights: f32|bf16[Tq, H] head weights (any sign).
    threshold: f32[Tq] per-row threshold (+-inf allowed).
    scale: multiplies each head sum.
    q_offset: i32 scalar (may be traced): the position of q's first row.
    compress_ratio: positions per key (static, >= 1).
    segment_ids: None, or (q_seg int[Tq], kv_seg int[Tk]): a query sees only the keys of its own
      segment (packed documents), as `flash_topk`'s segment_ids.
    block_q: queries per CTA; block_q * H (H padded to a multiple of 8) must be <= 256, the MMA's N.
    block_k: keys per consumer warpgroup per step, 64 or 128 (the MMA's M).
    stages: key steps in flight (>= 2), within shared memory (`smem_bytes`).
    consumer_registers, producer_registers: the warpgroups' register budgets (setmaxnreg).
    pingpong: make the two consumers' MMAs alternate through a barrier (FlashAttention-3's
      schedule), so one's epilogue runs under the other's MMA; off, they issue together.
    emit_mask: also return where each row's candidates are: one int8 per (query, key), written per
      key tile as it is scored (the filter of the candidate pass, without a scatter).
    interpret: None to pick (interpret mode off the GPU), False to compile, True to interpret, or a
      `plgpu.InterpretGPUParams`.

  Returns:
    (n_above i32[Tq], n_tied i32[Tq], max_score f32[Tq]); with `emit_mask` then
    int8[Tq, Tk_pad] (Tk padded to 2 * block_k): at each visible key 2 where its score is above the
    row's threshold, 1 where it equals it, else 0; 0 at the keys of other segments; unspecified at
    causally invisible keys and, with segments, before the row's `first_scored_keys`; with
    `segment_ids` last n_visible i32[Tq], the keys each row sees. Scores accumulate
    in f32 (products, head sum, then scale, as `index_scores`); max_score is -inf for a row that sees
    no key, and a row's NaN scores count as -inf.

  Raises:
    ValueError: shapes, dtypes, block sizes or shared memory outside the above.
  """
  if q.ndim != 3 or k.ndim != 2 or q.shape[2] != k.shape[1]:
    raise ValueError(f"{q.shape=} must be [Tq, H, D] and {k.shape=} [Tk, D], with the same D.")
  Tq, H, D = q.shape
  Tk = k.shape[0]
  if weights.shape != (Tq, H):
    raise ValueError(f"{weights.shape=} must be {(Tq, H)}, q's [Tq, H].")
  if threshold.shape != (Tq,):
    raise ValueError(f"{threshold.shape=} must be {(Tq,)}.")
  if q.dtype != jnp.bfloat16 or k.dtype != jnp.bfloat16:
    raise ValueError(f"{q.dtype=} and {k.dtype=} must be bfloat16.")
  if Tq < 1 or Tk < 1:
    raise ValueError(f"{Tq=} and {Tk=} must be >= 1.")
  if block_k not in (64, 128):
    raise ValueError(f"{block_k=} must be 64 or 128 (the MMA's M per consumer warpgroup).")
  if stages < 2:
    raise ValueError(f"{stages=} must be >= 2.")
  if compress_ratio < 1:
    raise ValueError(f"{compress_ratio=} must be >= 1.")
  segments = segment_ids is not None
  if segments:
    q_seg, kv_seg = segment_ids
    if q_seg.shape != (Tq,) or kv_seg.shape != (Tk,):
      raise ValueError(f"segment_ids shapes {q_seg.shape} and {kv_seg.shape} must be {(Tq,)} and {(Tk,)}.")
  heads, dim = _padded_heads_and_dim(H, D)
  if block_q < 1 or block_q * heads > 256:
    raise ValueError(f"{block_q=} times {heads} heads (H={H} padded to 8) must be 1 to 256 MMA columns.")
  if (need := smem_bytes(block_q, heads, block_k, stages, dim, emit_mask, segments)) > SMEM_LIMIT:
    raise ValueError(f"{stages=} key steps of {_CONSUMERS * block_k} x {dim} beside q's {block_q * heads} x {dim} "
                     f"need {need} bytes of shared memory, over {SMEM_LIMIT}.")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  interpret = interpret or None
  q = _pad_axis(_pad_axis(_pad_axis(q, 2, _SWIZZLE_COLS), 1, 8), 0, block_q)
  k = _pad_axis(_pad_axis(k, 1, _SWIZZLE_COLS), 0, _CONSUMERS * block_k)
  weights = _pad_axis(_pad_axis(weights.astype(jnp.float32), 1, 8), 0, block_q)  # padded heads weigh 0
  threshold = _pad_axis(threshold.astype(jnp.float32), 0, block_q, value=jnp.inf)
  # Padded queries (threshold +inf) and keys (past num_keys, never visible) take segment -1.
  seg_operands = []
  if segments:
    first_steps = _first_steps(q_seg, kv_seg, block_q, block_k)
    seg_operands = [_pad_axis(q_seg.astype(jnp.int32), 0, block_q, value=-1),
                    _pad_axis(kv_seg.astype(jnp.int32), 0, _CONSUMERS * block_k, value=-1), first_steps]
  Tq_pad = q.shape[0]
  n_blocks = Tq_pad // block_q
  kernel = functools.partial(
      _score_counts_kernel, block_q=block_q, heads=heads, block_k=block_k, stages=stages, num_keys=Tk,
      compress_ratio=int(compress_ratio), scale=float(scale), consumer_registers=consumer_registers,
      producer_registers=producer_registers, pingpong=pingpong, emit_mask=emit_mask, segments=segments)
  part = (n_blocks, _CONSUMERS, block_q, block_k)
  mask_type = [jax.ShapeDtypeStruct((Tq_pad, k.shape[0]), jnp.int8)] if emit_mask else []
  seen_type = [jax.ShapeDtypeStruct(part, jnp.int32)] if segments else []
  above, tied, best, *rest = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(part, jnp.int32), jax.ShapeDtypeStruct(part, jnp.int32),
                jax.ShapeDtypeStruct(part, jnp.float32), *mask_type, *seen_type),
      grid=(n_blocks,),
      grid_names=("qb",),
      num_threads=_CONSUMERS + 1,
      thread_name="wg",
      # The head sums stay within a thread's quad: no shared-memory scratch for cross-warp reductions.
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
      interpret=interpret,
      kernel_name="hyscale_flash_topk_score_counts",
  )(jnp.asarray(q_offset, jnp.int32).reshape(1), q.reshape(Tq_pad * heads, dim), k, weights.reshape(-1), threshold,
    *seg_operands)
  per_row = lambda x, reduce: reduce(x, axis=(1, 3)).reshape(Tq_pad)[:Tq]
  outs = [per_row(above, jnp.sum), per_row(tied, jnp.sum), per_row(best, jnp.max)]
  if emit_mask:
    outs.append(rest.pop(0)[:Tq])
  if segments:
    outs.append(per_row(rest.pop(0), jnp.sum))
  return tuple(outs)
