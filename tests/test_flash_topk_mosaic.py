"""FlashTopK's main pass with Mosaic GPU scoring (`Config.scorer="mosaic"`, `pallas_kernels.flash_topk.mosaic_pass`).

Its three steps against oracles: the listing of a candidate mask (`candidates_from_mask`) against
NumPy, the rescoring of a row's prefix (`index_scores_at_prefix`) against the full rescoring, and the
whole op on integer-valued inputs against the float64 oracle and the Triton pass, bit for bit. On the
CPU the Mosaic kernel runs in Mosaic GPU's interpret mode and the Triton ones in Pallas's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax.ops.flash_topk.pallas import flash_topk_pallas_with_stats
from pallas_kernels.flash_topk import Config, index_scores_at_pallas
from pallas_kernels.flash_topk.flash_topk import candidates_from_mask
from pallas_kernels.flash_topk.scores_at import index_scores_at_prefix
from tests.oracles import topk_oracle


def _list_oracle(mask, visible, slots, tie_slots):
  """Per row: the first `slots` visible keys marked 2, the first `tie_slots` marked 1, and both counts."""
  rows = []
  for m, v in zip(mask, visible):
    above, tied = np.flatnonzero((m == 2) & v), np.flatnonzero((m == 1) & v)
    rows.append((above[:slots], tied[:tie_slots], len(above), len(tied)))
  return rows


@pytest.mark.parametrize("Tq, Tk, q_offset, compress_ratio, slots, with_first_keys", [
    (40, 250, 7, 1, 8, False),  # rows past 16 per program (padded), a short last key tile, overflowing buffers
    (16, 128, 100, 2, 64, False),  # compressed keys, an offset chunk: buffers wide enough
    # Rows whose marking started later (bytes before their first key are garbage): whole tiles skipped
    # by the program whose rows all start late, and rows of one program starting apart.
    (40, 400, 300, 1, 128, True),
])
def test_candidates_from_mask_lists_the_marked_visible_keys(Tq, Tk, q_offset, compress_ratio, slots, with_first_keys):
  rng = np.random.default_rng(Tq)
  Tk_pad = -(-Tk // 128) * 128
  mask = rng.choice(np.array([0, 1, 2], np.int8), size=(Tq, Tk_pad), p=[0.6, 0.15, 0.25])
  visible = (np.arange(Tk_pad)[None, :] + 1) * compress_ratio <= np.arange(Tq)[:, None] + q_offset + 1
  visible &= np.arange(Tk_pad)[None, :] < Tk
  first_keys = None
  if with_first_keys:
    first_keys = np.repeat([0, 256, 128, 256, 300, 0, 130, 384, 256, 5], 4).astype(np.int32)
    visible &= np.arange(Tk_pad)[None, :] >= first_keys[:, None]
  tie_slots = 16
  fn = jax.jit(functools.partial(candidates_from_mask, num_keys=Tk, compress_ratio=compress_ratio, slots=slots,
                                 tie_slots=tie_slots, interpret=True))
  idx, tie_idx, n_gt, n_eq = (np.asarray(x) for x in fn(jnp.asarray(mask), jnp.int32(q_offset),
                                                         first_keys=None if first_keys is None else jnp.asarray(first_keys)))
  assert idx.shape == (Tq, slots) and tie_idx.shape == (Tq, tie_slots)
  for t, (above, tied, n_above, n_tied) in enumerate(_list_oracle(mask, visible, slots, tie_slots)):
    assert (n_gt[t], n_eq[t]) == (n_above, n_tied), t
    np.testing.assert_array_equal(idx[t, :len(above)], above, err_msg=f"row {t}")
    np.testing.assert_array_equal(tie_idx[t, :len(tied)], tied, err_msg=f"row {t}")
  assert (n_gt > slots).any() == (slots == 8)  # the first case overflows: its counts keep growing
  if with_first_keys:  # the rows starting late lost marked keys before their start (not listed)
    assert ((mask == 2) & ~visible & (np.arange(Tk_pad)[None, :] < np.arange(Tq)[:, None] + q_offset + 1)).any()


def test_candidates_from_mask_rejects_a_bad_mask():
  with pytest.raises(ValueError, match="must be int8"):
    candidates_from_mask(jnp.zeros((4, 128), jnp.int32), 0, num_keys=100, compress_ratio=1, slots=8, tie_slots=8)
  with pytest.raises(ValueError, match="multiple of block_k=128"):
    candidates_from_mask(jnp.zeros((4, 100), jnp.int8), 0, num_keys=100, compress_ratio=1, slots=8, tie_slots=8)
  with pytest.raises(ValueError, match="first_keys.shape"):
    candidates_from_mask(jnp.zeros((4, 128), jnp.int8), 0, num_keys=100, compress_ratio=1, slots=8, tie_slots=8,
                         first_keys=jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("keys_as_rows", [False, True])
def test_index_scores_at_prefix_is_the_full_rescoring_up_to_each_length(keys_as_rows):
  """Integer-valued inputs (every sum exact in f32), so both layouts give the full rescoring's bits."""
  rng = np.random.default_rng(3)
  B, T, H, D, S, K = 1, 6, 16, 16, 50, 40
  q = jnp.asarray(rng.integers(-2, 3, (B, T, H, D)), jnp.bfloat16)
  k = jnp.asarray(rng.integers(-2, 3, (B, S, D)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-2, 3, (B, T, H)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, S, (B, T, K)), jnp.int32)
  lengths = jnp.asarray([[0, 1, 16, 17, 40, 33]], jnp.int32)
  full = np.asarray(index_scores_at_pallas(q, k, w, idx, 0.25, block_k=16, interpret=True))
  part = np.asarray(index_scores_at_prefix(q, k, w, idx, lengths, 0.25, block_k=16, keys_as_rows=keys_as_rows,
                                           interpret=True))
  for t, n in enumerate(np.asarray(lengths[0])):
    np.testing.assert_array_equal(part[0, t, :n], full[0, t, :n])
  assert (full != 0).mean() > 0.3
  with pytest.raises(ValueError, match="lengths.shape"):
    index_scores_at_prefix(q, k, w, idx, lengths[0], 0.25)


# The threshold path at a small shape: slots (16) < Tk, a sampled threshold two levels deep.
_MOSAIC = Config(block_rows=16, block_k=8, candidates=16, min_candidates=16, sample_rank=2, scorer="mosaic",
                 mosaic_block_q=2)


@functools.partial(jax.jit, static_argnames=("topk", "compress_ratio", "config"))
def _run(q, k, w, q_offset, segment_ids=None, *, topk, compress_ratio, config):
  return flash_topk_pallas_with_stats(q, k, w, topk=topk, compress_ratio=compress_ratio, q_offset=q_offset,
                                      segment_ids=segment_ids, scale=0.5, config=config, interpret=True)


def _bits(x):
  return np.asarray(x).view(np.uint32)  # -0 and +0 differ


@pytest.mark.parametrize("T, q_offset, compress_ratio, chunk_bytes, packed", [
    (48, 0, 1, 1 << 30, False),
    # An offset chunk of compressed keys (CI time: the packed case below runs both, through segments).
    pytest.param(48, 21, 2, 1 << 30, False, marks=pytest.mark.slow),
    # Three query chunks of 16 rows (the last shifted back to end at T) and rows that see no key.
    (40, 0, 2, 16 * 576, False),
    # Packed documents: each batch row its own segment layout, rows shorter than k at each start; with
    # an offset, compressed keys and three chunks; then rows padded to the listing's 16 (168 -> 176)
    # and a document starting past the first key step (128 keys): its CTAs skip it, the listing too.
    (40, 5, 2, 16 * 576, True),
    pytest.param(168, 0, 1, 1 << 30, True, marks=pytest.mark.slow),  # CI time: the 45 s case
])
def test_mosaic_scorer_matches_the_oracle_and_the_triton_pass(T, q_offset, compress_ratio, chunk_bytes, packed):
  """Integer inputs in {-1, 0, 1} (ties everywhere, rows and keys on the ReLU plateau, negative weights),
  two batch rows, rows shorter than k near the start (and near each document's start when packed):
  the same bits as the float64 oracle and as the Triton scorer, and the same stats."""
  rng = np.random.default_rng(5 + q_offset + T)
  B, H, D, topk = 2, 8, 32, 6
  q = rng.integers(-1, 2, (B, T, H, D)).astype(np.float32)
  k = rng.integers(-1, 2, (B, T, D)).astype(np.float32)
  w = rng.integers(-2, 3, (B, T, H)).astype(np.float32)
  q[:, ::7] = 0.0
  w[:, 3::11] = -np.abs(w[:, 3::11]) - 1  # rows whose plateau keys sum to -0 before the fold
  segment_ids = None
  if packed:
    late = [5, 0, 7, 8], [30, 2, 100, T - 132]  # document 8 starts at key 132
    seg = np.stack([np.repeat([1, 2, 3], [20, 3, T - 23]),
                    np.repeat(*late) if T > 132 else np.repeat([5, 0, 7], [30, 2, T - 32])]).astype(np.int32)
    segment_ids = (seg, seg)
  args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
          jnp.int32(q_offset), None if segment_ids is None else tuple(map(jnp.asarray, segment_ids)))
  config = dataclasses.replace(_MOSAIC, mosaic_chunk_bytes=chunk_bytes)
  if T > 128:  # 8 queries a CTA: the interpreter's time halves (127 -> 73 s), the late document's CTAs still skip
    config = dataclasses.replace(config, mosaic_block_q=8)
  assert config.candidate_slots(topk, T) == 16 < T
  jaxpr = str(jax.make_jaxpr(functools.partial(_run, topk=topk, compress_ratio=compress_ratio, config=config))(*args))
  assert "hyscale_flash_topk_mask_candidates" in jaxpr  # the Mosaic pass ran, not a fallback
  got_idx, got_sc, got_stats = _run(*args, topk=topk, compress_ratio=compress_ratio, config=config)
  tri_idx, tri_sc, tri_stats = _run(*args, topk=topk, compress_ratio=compress_ratio,
                                    config=dataclasses.replace(config, scorer="triton"))
  want_idx, want_sc = topk_oracle(q.astype(np.float64), k.astype(np.float64), w.astype(np.float64), topk=topk,
                                  compress_ratio=compress_ratio, q_offset=q_offset, segment_ids=segment_ids, scale=0.5)
  np.testing.assert_array_equal(np.asarray(got_idx), want_idx)
  np.testing.assert_array_equal(_bits(got_sc), _bits(want_sc.astype(np.float32) + np.float32(0)))
  np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(tri_idx))
  np.testing.assert_array_equal(_bits(got_sc), _bits(tri_sc))
  as_numbers = lambda stats: {key: float(v) for key, v in stats.items() if key != "rescued_rows"}
  assert as_numbers(got_stats) == as_numbers(tri_stats)
  np.testing.assert_array_equal(got_stats["rescued_rows"], tri_stats["rescued_rows"])
  assert int(got_stats["rescued"]) < B * T // 2  # the threshold held on most rows
  winners = want_sc[want_idx >= 0]
  assert (winners == 0).any() and len(np.unique(winners)) < len(winners)  # ties and the plateau were in play
  if packed and q_offset == 0 and compress_ratio == 1:  # a 3-token document: its rows hold at most 3 keys
    assert (np.asarray(got_idx)[0, 20:23, 3:] == -1).all() and (np.asarray(got_idx)[0, 22, :3] >= 20).all()
  if q_offset == 0 and compress_ratio == 2:
    assert (np.asarray(got_idx)[:, 0] == -1).all()  # position 0 sees no compressed key


def test_mosaic_pass_lowers_for_h200(fake_hopper):
  """DeepSeek-V3.2's indexer at 16K (H 64, D 128, k 2048) with the Mosaic scorer: the whole op lowers
  for an H200 on the CPU (the Mosaic kernel, the Triton listing over a 16,384-key mask with int8
  tiles, the prefix rescoring, the finish), with one Mosaic kernel per main pass: the top level's and
  the sampled threshold's."""
  from tests.jaxpr_tools import export_for_h200

  T, H, D = 16384, 64, 128
  args = (jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((1, T, D), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, T, H), jnp.float32))
  fn = lambda q, k, w: flash_topk_pallas_with_stats(q, k, w, topk=2048, scale=D**-0.5, config=Config(scorer="mosaic"),
                                                    sorted=False)[:2]
  mlir = export_for_h200(fn, *args).mlir_module()
  assert mlir.count("custom_call @mosaic_gpu") == 2  # the main pass and the threshold's (its sampled keys)
  assert "hyscale_flash_topk_mask_candidates" in mlir and "hyscale_index_scores_at" in mlir


def test_scorer_choice(fake_hopper):
  """"auto" scores on Mosaic only where it was measured faster: compiled, on Hopper, from 32K keys, bf16
  without key scales (segments or not); "mosaic" asks for it wherever its inputs allow; a bad name is an error."""
  auto, mosaic, triton = Config(), Config(scorer="mosaic"), Config(scorer="triton")
  on = lambda config, num_keys=131072, heads=64, dim=128, dtype=jnp.bfloat16, scales=False, interpret=False: (
      config.scores_on_mosaic(num_keys, heads, dim, dtype, segments=True, key_scales=scales, interpret=interpret))
  assert on(auto) and on(auto, heads=32) and on(auto, heads=4, dim=64)
  assert on(auto, num_keys=32768) and not on(auto, num_keys=32767) and not on(auto, num_keys=16384)
  assert not on(auto, interpret=True)
  assert not on(auto, dtype=jnp.float8_e4m3fn) and not on(auto, scales=True)
  assert auto.scores_on_mosaic(131072, 64, 128, jnp.bfloat16, segments=False, key_scales=False, interpret=False)
  # Past the kernel's limits the Triton pass takes it: 4 x 128 heads > 256 MMA columns; D 256 at 64
  # heads over the shared memory.
  assert not on(auto, heads=128) and not on(mosaic, heads=128) and not on(auto, dim=256)
  assert on(mosaic, num_keys=64, interpret=True)
  assert not on(mosaic, num_keys=64, dtype=jnp.float32, interpret=True)
  assert not on(triton, num_keys=1 << 20)
  with pytest.raises(ValueError, match="Config.scorer='wgmma'"):
    Config(scorer="wgmma")
