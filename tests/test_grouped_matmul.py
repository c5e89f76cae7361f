"""ops.grouped_matmul against a float64 loop over groups: values, both gradients, validation, structure.

The Pallas backend's own Mosaic GPU kernels run here in Mosaic GPU's interpret mode on the CPU
(warpgroups as threads, TMA and barriers simulated, unwritten memory NaN), and compiled on a Hopper
GPU (`JAX_PLATFORMS=cuda pytest tests/test_grouped_matmul.py -k pallas`; the short-tile variant,
whose predicated copies the interpreter does not take, is `gpu_only`). They are also exported for a
CUDA target on the CPU, which runs Mosaic's lowering and its shared-memory check. The autotune cache
and config logic is plain Python.
"""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops
from hyscale_jax.ops.grouped_matmul import REGISTRY
from pallas_kernels.grouped_matmul import autotune
from tests import jaxpr_tools
from tests.oracles import grouped_matmul_oracle

# (M, group_sizes): empty groups first/middle/last, one group taking every row, a sum below M.
_SIZES = {
    "mixed": (12, [3, 0, 5, 4]),
    "empty_ends": (12, [0, 7, 0, 5, 0]),
    "one_group": (12, [0, 12, 0]),
    "short_sum": (12, [2, 0, 3]),
}
_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # x sqrt(K) on unit-scale values


def _inputs(m, sizes, *, k=16, n=8, dtype=jnp.float32, transpose_rhs=False, seed=0):
  """lhs [M, K], rhs [G, K, N] (or [G, N, K]), sizes int32[G], a random cotangent [M, N]; all in dtype."""
  rng = np.random.default_rng(seed)
  g = len(sizes)
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((g, n, k) if transpose_rhs else (g, k, n)), dtype)
  dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32), dout


def _check_against_oracle(backend, m, sizes, dtype, transpose_rhs, k=16, n=8):
  lhs, rhs, gs, dout = _inputs(m, sizes, k=k, n=n, dtype=dtype, transpose_rhs=transpose_rhs)
  f = jax.jit(lambda a, b, s: ops.grouped_matmul(a, b, s, transpose_rhs=transpose_rhs, backend=backend))
  out, vjp = jax.vjp(lambda a, b: f(a, b, gs), lhs, rhs)
  dlhs, drhs = vjp(dout)
  want, want_dlhs, want_drhs = grouped_matmul_oracle(lhs, rhs, np.asarray(sizes), np.asarray(dout, np.float64),
                                                     transpose_rhs=transpose_rhs)
  assert out.dtype == dlhs.dtype == drhs.dtype == dtype and out.shape == (m, n)
  atol = _TOL[dtype] * math.sqrt(max(k, m))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=atol, rtol=_TOL[dtype])
  np.testing.assert_allclose(np.asarray(dlhs, np.float64), want_dlhs, atol=atol, rtol=_TOL[dtype])
  np.testing.assert_allclose(np.asarray(drhs, np.float64), want_drhs, atol=atol, rtol=_TOL[dtype])
  past = sum(sizes)
  assert not np.asarray(out[past:]).any() and not np.asarray(dlhs[past:]).any()  # exactly zero past the sum


@pytest.mark.parametrize("case", list(_SIZES))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_reference_values_and_grads_f32(case, transpose_rhs):
  m, sizes = _SIZES[case]
  _check_against_oracle("reference", m, sizes, jnp.float32, transpose_rhs)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_reference_values_and_grads_bf16(transpose_rhs):
  m, sizes = _SIZES["short_sum"]
  _check_against_oracle("auto", m, sizes, jnp.bfloat16, transpose_rhs)


def test_rows_past_the_sum_are_ignored_even_when_not_finite():
  lhs, rhs, gs, dout = _inputs(12, [2, 0, 3])
  lhs, dout = lhs.at[5:].set(jnp.nan), dout.at[5:].set(jnp.inf)
  out, vjp = jax.vjp(lambda a, b: ops.grouped_matmul(a, b, gs), lhs, rhs)
  dlhs, drhs = vjp(dout)
  assert not np.asarray(out[5:]).any() and not np.asarray(dlhs[5:]).any()
  _, _, want_drhs = grouped_matmul_oracle(lhs[:5], rhs, [2, 0, 3], np.asarray(dout[:5], np.float64))
  np.testing.assert_allclose(drhs, want_drhs, atol=1e-4)


def test_traced_group_sizes_under_jit_and_auto_is_reference_on_cpu():
  lhs, rhs, gs, _ = _inputs(12, [3, 0, 5, 4])
  out = jax.jit(ops.grouped_matmul)(lhs, rhs, gs)
  np.testing.assert_allclose(out, grouped_matmul_oracle(lhs, rhs, [3, 0, 5, 4]), atol=1e-4)
  if jax.default_backend() == "cpu":
    assert REGISTRY.candidates("auto") == ("reference",)  # the interpreted kernels only when named
  with pytest.raises(NotImplementedError, match="bf16/f16"):  # wgmma takes 2-byte floats only
    ops.grouped_matmul(lhs, rhs, gs, backend="pallas")


def test_backward_builds_nothing_group_by_rows():
  """No value in the forward+backward jaxpr has shape [G, M, ...] (the dense ragged_dot rewrite)."""
  m, g = 24, 5
  lhs, rhs, gs, dout = _inputs(m, [6, 0, 7, 4, 7], k=16, n=8)

  def loss(a, b, w2):
    h = ops.grouped_matmul(a, b, gs)  # [M, N]
    return (ops.grouped_matmul(h, w2, gs, transpose_rhs=True) * a).sum()  # w2 [G, K, N] read as [G, N->K]

  w2 = jnp.ones((g, 16, 8))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(lhs, rhs, w2)
  shapes = {tuple(v.aval.shape) for e in jaxpr_tools.equations(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")}
  assert not [s for s in shapes if len(s) >= 2 and s[:2] == (g, m)], shapes
  assert (g, 16, 8) in shapes  # the dW output is there, so the walk saw the backward


@pytest.mark.parametrize("bad, match", [
    (lambda l, r, s: (l[0], r, s), "lhs must have rank 2"),
    (lambda l, r, s: (l, r[0], s), "rhs must have rank 3"),
    (lambda l, r, s: (l[:, :5], r, s), r"rhs.shape=.*dimension 1 \(K"),
    (lambda l, r, s: (l, r.astype(jnp.bfloat16), s), "rhs.dtype"),
    (lambda l, r, s: (l.astype(jnp.int32), r.astype(jnp.int32), s), "lhs must be a floating"),
    (lambda l, r, s: (l, r, s.astype(jnp.float32)), "group_sizes must be an integer"),
    (lambda l, r, s: (l, r, s[:2]), r"group_sizes.shape=\(2,\) must be \[G\]"),
    (lambda l, r, s: (l, r, s.at[1].set(-1)), "group_sizes has a negative size"),
    (lambda l, r, s: (l, r, s.at[1].set(9)), "group_sizes sum to 21 > M=12"),
])
def test_bad_inputs_name_the_argument(bad, match):
  lhs, rhs, gs, _ = _inputs(12, [3, 0, 5, 4])
  with pytest.raises(ValueError, match=match):
    ops.grouped_matmul(*bad(lhs, rhs, gs))


def test_unknown_backend_is_a_value_error():
  lhs, rhs, gs, _ = _inputs(12, [3, 0, 5, 4])
  with pytest.raises(ValueError, match="unknown backend"):
    ops.grouped_matmul(lhs, rhs, gs, backend="cuda")


# ---- the Pallas backend's tuning config and cache (plain Python) ----

def test_config_validation_heuristics_and_search_space():
  with pytest.raises(ValueError, match="block_m"):
    autotune.Config(block_m=96)
  with pytest.raises(ValueError, match="grid_block_n"):
    autotune.Config(grid_block_n=3)
  with pytest.raises(ValueError, match="kind"):
    autotune.Config.heuristics("backward", 1, 1, 1, 1)
  for kind in autotune.KINDS:
    space = autotune.Config.search_space(kind, 131072, 6144, 2048, 256)
    assert 4 <= len(space) <= 10 and len(set(space)) == len(space)
    assert all(2048 % c.columns == 0 for c in space)  # no padded (copied) weights
    assert space[0] == autotune.Config.heuristics(kind, 131072, 6144, 2048, 256)
    assert all(c.smem_bytes(2) <= 227 * 1024 for c in space)
  # A CTA spans two warpgroups' columns: 208 KiB at 128 x 256 with 3 stages.
  assert autotune.Config(max_concurrent_steps=3).smem_bytes(2) == (3 * (128 + 256) * 64 + 128 * 256) * 2
  # Qwen's 320-row experts, F 640: rows on the MMA's N side, two 160-row tiles an expert and five
  # 128-column CTAs (no MMA past either), a snake band over all the column blocks (forward 5, dx 20).
  narrow = autotune.Config.heuristics("forward", 163840, 2560, 640, 512)
  assert narrow.rows_as_n and (narrow.rows, narrow.columns, narrow.grid_block_n) == (160, 128, 8)
  assert narrow.delay_release == 1 and narrow.smem_bytes(2) <= 227 * 1024
  narrow_dx = autotune.Config.heuristics("forward_transposed_rhs", 163840, 640, 2560, 512)
  assert narrow_dx.rows_as_n and (narrow_dx.rows, narrow_dx.grid_block_n, narrow_dx.delay_release) == (160, 32, 0)
  # ... and the row tiles it replaces stay in its search space: 256-column CTAs (2.5 of them; the
  # kernels read past N as zeros)
  narrow_space = autotune.Config.search_space("forward", 163840, 2560, 640, 512)
  assert [c.rows_as_n for c in narrow_space[:3]] == [True, True, False]  # either delay_release, then row tiles
  row_tiles = narrow_space[2]
  assert row_tiles.columns == 256 and row_tiles.grid_block_n == 4
  assert autotune.Config.search_space("forward", 131072, 6144, 2048, 256)[1].rows_as_n  # offered at GLM-5.1 too
  wide = autotune.Config.rows_as_n_heuristics("forward", 131072, 6144, 2048, 256)
  assert wide.rows == 256 and wide.smem_bytes(2) <= 227 * 1024
  # Rows on N by default where their tiles cover a mean group with less MMA area (at N 640: 128-column
  # CTAs against 256-column ones padding it to 768), items of at most 64 K steps, forward/dx only
  for mean, want in ((100, False), (150, True), (200, False), (300, True), (320, True), (321, False),
                     (384, False), (512, True), (1280, True)):
    assert autotune.Config.heuristics("forward", mean * 64, 2560, 640, 64).rows_as_n is want, mean
  assert autotune.Config.heuristics("forward", 1280 * 64, 2560, 640, 64).rows == 256
  assert not autotune.Config.heuristics("forward_transposed_rhs", 655360, 640, 2560, 512).rows_as_n  # equal area
  assert not autotune.Config.heuristics("forward_transposed_rhs", 131072, 2048, 6144, 256).rows_as_n  # GLM-5.1 dx
  assert not autotune.Config.heuristics("forward", 320 * 64, 4160, 640, 64).rows_as_n  # 65 K steps
  assert not autotune.Config.heuristics("transposed", 320 * 64, 2560, 640, 64).rows_as_n
  with pytest.raises(ValueError, match="not dW's"):
    autotune.Config.rows_as_n_heuristics("transposed", 163840, 2560, 640, 512)
  assert autotune.Config.heuristics("transposed", 163840, 2560, 640, 512).grid_block_n == 1
  # dW: the continuous pipeline everywhere; Qwen's Q 640 = 5 x 128 with the warpgroups splitting P.
  narrow_dw = autotune.Config.heuristics("transposed", 163840, 2560, 640, 512)
  assert narrow_dw.continuous and narrow_dw.split_rows and (narrow_dw.rows, narrow_dw.columns) == (256, 128)
  wide_dw = autotune.Config.heuristics("transposed", 131072, 6144, 2048, 256)
  assert wide_dw.continuous and not wide_dw.split_rows and wide_dw.columns == 256
  # Forward/dx: continuous at most 64 K steps per item (V4's 4096, every dx at F 2048), not at K 6144.
  assert autotune.Config.heuristics("forward", 98304, 4096, 2048, 256).continuous
  assert autotune.Config.heuristics("forward_transposed_rhs", 131072, 2048, 6144, 256).continuous
  assert not autotune.Config.heuristics("forward", 131072, 6144, 2048, 256).continuous
  # The fourth stage (output in 64-column chunks) for continuous forwards and short dx items only.
  assert autotune.Config.heuristics("forward", 98304, 4096, 2048, 256).store_cols == 64
  assert autotune.Config.heuristics("forward_transposed_rhs", 65536, 640, 2560, 128).max_concurrent_steps == 4
  assert autotune.Config.heuristics("forward_transposed_rhs", 131072, 2048, 6144, 256).store_cols == 0
  # A width 256-column CTAs would pad by over 20% (320 -> 512) takes 128-column ones.
  assert autotune.Config.heuristics("forward", 4096, 256, 320, 8).columns == 128
  # dW tiles must divide its [K, N] output: K = 192 allows only 64-row tiles.
  assert all(192 % c.block_m == 0 for c in autotune.Config.search_space("transposed", 4096, 192, 2048, 8))


def test_autotune_cache_measures_once_and_persists(tmp_path, monkeypatch):
  monkeypatch.setenv("HYSCALE_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(autotune, "_MEMORY", {})
  calls = []

  def measure(config):
    calls.append(config)
    if config.block_m == 64:
      raise ValueError("Mosaic GPU kernel exceeds available shared memory")  # skipped, recorded
    return 1.0 / (config.block_m * config.block_n * config.grid_block_n)  # fastest: 128 x 128, band 16

  args = ("NVIDIA H200", "forward", 4096, 512, 256, 8, jnp.bfloat16)
  autotune.set_autotune(False)
  try:
    assert autotune.choose(*args, measure) == autotune.Config.heuristics("forward", 4096, 512, 256, 8)
    assert not calls and not autotune.cache_path("NVIDIA H200").exists()  # tuning off: heuristics, no file
    autotune.set_autotune(True)
    best = autotune.choose(*args, measure)
    ran = [c for c in autotune.Config.search_space("forward", 4096, 512, 256, 8) if c.block_m != 64]
    assert best == min(ran, key=measure) and best.grid_block_n == 16 and best.block_m == 128
    n_calls = len(calls)
    assert autotune.choose(*args, measure) == best and len(calls) == n_calls  # cached in memory
  finally:
    autotune.set_autotune(None)
  path = autotune.cache_path("NVIDIA H200")
  assert path == tmp_path / "NVIDIA_H200" / "grouped_matmul.json"
  entry = json.loads(path.read_text())[autotune.cache_key("forward", 4096, 512, 256, 8, jnp.bfloat16)]
  assert autotune.Config(**entry["config"]) == best
  assert any("shared memory" in str(v) for v in entry["seconds"].values())
  assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # the atomic write left nothing
  monkeypatch.setattr(autotune, "_MEMORY", {})  # a new process: read from disk, tuning off
  assert autotune.choose(*args, lambda c: pytest.fail("measured again")) == best


def test_autotune_cache_entries_from_other_versions(tmp_path, monkeypatch):
  """An entry written before `rows_as_n` existed loads as row tiles; one this version cannot build (a
  field from a newer one, or values its validation refuses) counts as missing, not as an error."""
  monkeypatch.setenv("HYSCALE_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(autotune, "_MEMORY", {})
  old = {k: v for k, v in dataclasses.asdict(autotune.Config(max_concurrent_steps=3)).items() if k != "rows_as_n"}
  entries = {"old": {"config": old}, "newer": {"config": {**old, "a_later_field": 1}},
             "refused": {"config": {**old, "block_m": 96}}}
  path = autotune.cache_path("NVIDIA H200")
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps(entries))
  assert autotune.cached_config("NVIDIA H200", "old") == autotune.Config(max_concurrent_steps=3)
  assert autotune.cached_config("NVIDIA H200", "newer") is None
  assert autotune.cached_config("NVIDIA H200", "refused") is None


def test_tuning_runs_eagerly_inside_a_trace_and_falls_back_when_nothing_runs(monkeypatch, tmp_path):
  """The Pallas wrapper tunes while the caller's jit traces: measured on concrete arrays, cached."""
  from pallas_kernels.grouped_matmul import grouped_matmul as kernels  # noqa: PLC0415

  monkeypatch.setenv("HYSCALE_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(autotune, "_MEMORY", {})
  monkeypatch.setattr(kernels, "_interpreted", lambda: False)  # the tuning logic, on the reference's timings
  run = lambda a, b, s, config: ops.grouped_matmul(a, b, s, backend="reference")
  pick = lambda: kernels._config("forward", 64, 32, 16, 4, jnp.float32, run, ((64, 32), (4, 32, 16)))
  autotune.set_autotune(True)
  try:
    chosen = []
    jax.jit(lambda x: chosen.append(pick()) or x)(jnp.ones(3))
    entry = json.loads(autotune.cache_path("cpu").read_text())["forward:M=64:K=32:N=16:G=4:float32"]
    assert all(isinstance(v, float) and v > 0 for v in entry["seconds"].values())
    assert chosen[0] == autotune.Config(**entry["config"])
    with pytest.warns(UserWarning, match="autotune .* failed"):
      failing = lambda c: (_ for _ in ()).throw(ValueError("exceeds available shared memory"))
      got = autotune.choose("cpu", "transposed", 64, 32, 16, 4, jnp.float32, failing)
    assert got == autotune.Config.heuristics("transposed", 64, 32, 16, 4)
  finally:
    autotune.set_autotune(None)


def test_autotune_env_var_and_keys(monkeypatch):
  monkeypatch.setenv("HYSCALE_AUTOTUNE", "1")
  assert autotune.autotune_enabled()
  monkeypatch.setenv("HYSCALE_AUTOTUNE", "0")
  assert not autotune.autotune_enabled()
  keys = {autotune.cache_key(k, 64, 32, 16, 4, d) for k in autotune.KINDS for d in (jnp.bfloat16, jnp.float16)}
  assert len(keys) == 6 and "forward:M=64:K=32:N=16:G=4:bfloat16" in keys


# ---- the own kernel's tile table (plain jnp) ----

@pytest.mark.parametrize("tile_m", [64, 160])  # 160: rows on N, not a power of two
@pytest.mark.parametrize("sizes, m", [([0, 5, 130, 0, 256, 1, 0, 3], 420), ([1000], 1000), ([0, 0, 0], 16),
                                      ([7] * 40, 300), ("random", 5000)])
def test_tile_table_covers_every_row_of_every_group_once(sizes, m, tile_m):
  """Each group's rows (and the rows past them, as group G, which the kernel zeroes) are stored by
  exactly one tile; tiles start on 8-row boundaries."""
  from pallas_kernels.grouped_matmul import tiled  # noqa: PLC0415 - Mosaic GPU imports on CPU too

  if sizes == "random":
    sizes = list(np.random.default_rng(0).multinomial(m - 37, np.ones(64) / 64))  # sum below M
  num_tiles = tiled.max_tiles(m, len(sizes), tile_m)
  group, first, lo, hi = np.asarray(tiled.tile_table(jnp.asarray(sizes, jnp.int32), tile_m, num_tiles, m))
  owner = np.full(m, -1)
  for t in np.flatnonzero(hi > lo):
    assert first[t] % 8 == 0 and 0 <= lo[t] < hi[t] <= tile_m
    rows = np.arange(first[t] + lo[t], first[t] + hi[t])
    assert (owner[rows] == -1).all()
    owner[rows] = group[t]
  want = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)] + [np.full(m - sum(sizes), len(sizes))])
  np.testing.assert_array_equal(owner, want)
  assert (hi[hi <= lo] == 0).all() and (np.cumsum(hi > lo) == np.arange(1, num_tiles + 1))[: (hi > lo).sum()].all()


def test_tile_and_group_tables_run_no_loop():
  """The tables are straight-line XLA: a while loop (jnp.searchsorted's default binary search) runs
  its steps as separate GPU launches, 0.25 ms before every grouped matmul (docs/kernels/grouped_matmul.md)."""
  from pallas_kernels.grouped_matmul import tiled  # noqa: PLC0415

  sizes = jnp.asarray([0, 5, 130, 0, 256], jnp.int32)
  for table in (lambda s: tiled.tile_table(s, 64, tiled.max_tiles(420, 5, 64), 420), tiled.group_table):
    assert not jaxpr_tools.lowers_to_loop(table, sizes)


# ---- the Pallas backend lowered for CUDA on CPU (shapes, padding, the custom_vjp wiring) ----

@pytest.mark.parametrize("m, k, n, transpose_rhs", [(300, 96, 200, False), (1024, 256, 384, True), (7, 64, 128, False),
                                                    (450, 96, 200, False), (450, 128, 200, True)])  # 150-row groups: rows on N
def test_pallas_backend_lowers_for_cuda(m, k, n, transpose_rhs, monkeypatch, tmp_path, fake_hopper):
  """Forward and both gradients through `backend="pallas"` export for a CUDA target: three Mosaic GPU
  kernels (forward, dx, dW), odd widths padded. Catches tiling/TMA errors without a GPU."""
  monkeypatch.setenv("HYSCALE_CACHE_DIR", str(tmp_path))  # heuristics, not a cached config
  g = 3
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

  def loss(a, b, s):
    return jnp.square(ops.grouped_matmul(a, b, s, transpose_rhs=transpose_rhs, backend="pallas")).sum()

  exported = jaxpr_tools.export_for_h200(jax.value_and_grad(loss, argnums=(0, 1)), lhs, rhs, sizes)
  text = exported.mlir_module()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3 and "stablehlo.dot_general" not in text
  assert [tuple(a.shape) for a in exported.out_avals] == [(), (m, k), rhs.shape]
  rows = {m, -(-m // 8) * 8}  # as given, and padded to the 8-row tiling
  assert not [r for r in rows if f"tensor<{g}x{r}x" in text]  # nothing [G, M, ...] in the HLO either


def test_forward_kernel_lowers_for_cuda(fake_hopper):
  from pallas_kernels.grouped_matmul import grouped_matmul as kernels  # noqa: PLC0415

  config = autotune.Config(block_n=64, grid_block_n=2)
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (5, 128, 192))]
  args.append(jax.ShapeDtypeStruct((5,), jnp.int32))
  exported = jaxpr_tools.export_for_h200(lambda a, b, s: kernels._forward(a, b, s, config, False), *args)
  assert "custom_call @mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (256, 192)


# ---- the Pallas backend against the oracle: interpreted on the CPU, compiled on a Hopper GPU ----

_MANY = 64 if jax.default_backend() == "gpu" else 24  # groups in the many-group cases; fewer keep the interpreter quick

@pytest.mark.parametrize("case", list(_SIZES))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_pallas_values_and_grads(case, transpose_rhs):
  m, sizes = _SIZES[case]
  scale = 40  # rows spanning several 128-row blocks, groups straddling block edges
  _check_against_oracle("pallas", m * scale, [s * scale for s in sizes], jnp.bfloat16, transpose_rhs,
                        k=256, n=384)


def test_pallas_pads_odd_widths_and_ignores_poisoned_rows():
  lhs, rhs, gs, dout = _inputs(300, [100, 0, 37, 90], k=96, n=200, dtype=jnp.bfloat16)
  lhs, dout = lhs.at[227:].set(jnp.nan), dout.at[227:].set(jnp.nan)
  out, vjp = jax.vjp(lambda a, b: ops.grouped_matmul(a, b, gs, backend="pallas"), lhs, rhs)
  dlhs, drhs = vjp(dout)
  want, want_dlhs, want_drhs = grouped_matmul_oracle(lhs[:227], rhs, [100, 0, 37, 90],
                                                     np.asarray(dout[:227], np.float64))
  np.testing.assert_allclose(np.asarray(out[:227], np.float64), want, atol=0.3, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(dlhs[:227], np.float64), want_dlhs, atol=0.3, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(drhs, np.float64), want_drhs, atol=0.5, rtol=2e-2)
  assert not np.asarray(out[227:]).any() and not np.asarray(dlhs[227:]).any()


@pytest.mark.parametrize("aligned", [True, False])
def test_pallas_forward_kernel_with_many_groups(aligned):
  """Many groups (boundaries on tile edges, or not, and empty ones) agree with the oracle, both rhs layouts."""
  from pallas_kernels.grouped_matmul import grouped_matmul_pallas  # noqa: PLC0415

  rng = np.random.default_rng(3)
  sizes = [128] * _MANY if aligned else list(rng.multinomial(_MANY * 128 - 50, np.ones(_MANY) / _MANY))
  sizes[5] = 0
  config = autotune.Config(max_concurrent_steps=3, grid_block_n=2)  # 4 stages of 128 x 256 overflow smem
  for transpose_rhs in (False, True):
    lhs, rhs, gs, _ = _inputs(_MANY * 128, sizes, k=256, n=256, dtype=jnp.bfloat16, transpose_rhs=transpose_rhs)
    out = jax.jit(lambda a, b, s: grouped_matmul_pallas(a, b, s, transpose_rhs=transpose_rhs, config=config))(
        lhs, rhs, gs)
    want = grouped_matmul_oracle(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.35, rtol=2e-2)


def test_pallas_kernels_on_tiles_wider_than_the_output():
  """N = Q = 320 on 256-column CTAs: the second block's first half ends inside the output, its second
  half lies past it (TMA reads zeros there, nothing is stored); forward, dx layout and dW."""
  from pallas_kernels.grouped_matmul import grouped_matmul_pallas, transposed_grouped_matmul_pallas  # noqa: PLC0415

  sizes = [300, 0, 517, 207]
  config = autotune.Config(block_n=128, max_concurrent_steps=3, grid_block_n=2)
  for transpose_rhs in (False, True):
    lhs, rhs, gs, _ = _inputs(1024, sizes, k=256, n=320, dtype=jnp.bfloat16, transpose_rhs=transpose_rhs)
    out = jax.jit(lambda a, b, s: grouped_matmul_pallas(a, b, s, transpose_rhs=transpose_rhs, config=config))(
        lhs, rhs, gs)
    assert out.shape == (1024, 320)
    want = grouped_matmul_oracle(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.35, rtol=2e-2)
  a, _, gs, b = _inputs(1024, sizes, k=256, n=320, dtype=jnp.bfloat16)
  out = jax.jit(lambda a, b, s: transposed_grouped_matmul_pallas(a, b, s, config=config))(a, b, gs)
  assert out.shape == (4, 256, 320)
  _, _, want = grouped_matmul_oracle(a, np.zeros((4, 256, 320)), sizes, np.asarray(b, np.float64))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.35, rtol=2e-2)


@pytest.mark.parametrize("sizes", ["small", "skewed"])
def test_pallas_dw_kernel_with_many_groups(sizes):
  """dW over many groups: groups of 1-40 rows (fewer K steps than pipeline stages), empty ones, group
  starts off the 8-row grid, rows past the sum poisoned; against the float64 oracle."""
  from pallas_kernels.grouped_matmul import transposed_grouped_matmul_pallas  # noqa: PLC0415

  rng = np.random.default_rng(4)
  zipf = 1.0 / np.arange(1, _MANY + 1) ** 1.2
  group_rows = list(rng.integers(0, 41, _MANY)) if sizes == "small" else list(rng.multinomial(_MANY * 96, zipf / zipf.sum()))
  group_rows[7] = 0
  m = int(sum(group_rows)) + 29
  a, _, gs, b = _inputs(m, group_rows, k=256, n=320, dtype=jnp.bfloat16)
  a, b = a.at[m - 29:].set(jnp.nan), b.at[m - 29:].set(jnp.inf)
  out = jax.jit(transposed_grouped_matmul_pallas)(a, b, gs)
  _, _, want = grouped_matmul_oracle(a[: m - 29], np.zeros((_MANY, 256, 320)), group_rows,
                                     np.asarray(b[: m - 29], np.float64))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.35, rtol=2e-2)
  assert not np.asarray(out[7]).any()


# ---- the continuous pipeline (one pipeline over all of a CTA's items, `Config.continuous`) ----

_CONTINUOUS = {name: autotune.Config(block_n=128, max_concurrent_steps=3, grid_block_n=2, continuous=True,
                                     delay_release=d, short_tiles=short, split_rows=split)
               for name, d, short, split in (("c0", 0, False, False), ("c1", 1, False, False),
                                             ("c0s", 0, True, False))}
# c0p: the warpgroups split the CTA's rows as the tuner offers it (forward: 64-row halves over 256
# columns, one skipped past the group, stored in 128-column chunks: whole 256-column partial stores
# were wrong on the H100; dW: P); c0s: 64-row tail tiles, whose predicated TMA copies
# Mosaic GPU's interpreter does not take (it miscounts a predicate operand), so their oracle test
# needs the GPU.
_CONTINUOUS["c0p"] = autotune.Config(block_m=64, block_n=256, max_concurrent_steps=3, grid_block_n=2, continuous=True,
                                     split_rows=True)
# c0w: the output stored in 64-column chunks through one narrow buffer (`store_cols`), with a chunk
# of the N = 320 tile's last CTA wholly past N
_CONTINUOUS["c0w"] = autotune.Config(block_n=128, max_concurrent_steps=3, grid_block_n=2, continuous=True, store_cols=64)
# c0t: rows on the wgmma's N side (`rows_as_n`): 160-row tiles (not a power of two: partial tiles
# store in runs of 128, 16, 8 ...), each consumer the transpose of a 160 x 64 block, stored through a
# transposed view of the output buffer; forward and dx only
_CONTINUOUS["c0t"] = autotune.Config(block_m=160, block_n=64, max_concurrent_steps=3, grid_block_n=2, continuous=True,
                                     rows_as_n=True)
_ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU")


@pytest.mark.parametrize("variant", list(_CONTINUOUS))
def test_continuous_kernels_lower_for_cuda(variant, fake_hopper):
  """Forward, dx layout and dW with the continuous pipeline export for a CUDA target (Mosaic's lowering
  and its shared-memory check run on CPU)."""
  from pallas_kernels.grouped_matmul import grouped_matmul as kernels  # noqa: PLC0415

  config = _CONTINUOUS[variant]
  sizes = jax.ShapeDtypeStruct((5,), jnp.int32)
  for transpose_rhs in (False, True):
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (5, 192, 128) if transpose_rhs else (5, 128, 192))]
    forward = lambda a, b, s: kernels._forward(a, b, s, config, transpose_rhs)  # noqa: E731
    exported = jaxpr_tools.export_for_h200(forward, *args, sizes)
    assert "custom_call @mosaic_gpu" in exported.mlir_module() and exported.out_avals[0].shape == (256, 192)
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (256, 320))]
  if config.rows_as_n:  # a forward/dx tiling
    with pytest.raises(ValueError, match="dW kernel does not take it"):
      jaxpr_tools.export_for_h200(lambda a, b, s: kernels._transposed(a, b, s, config), *args, sizes)
    return
  exported = jaxpr_tools.export_for_h200(lambda a, b, s: kernels._transposed(a, b, s, config), *args, sizes)
  assert "custom_call @mosaic_gpu" in exported.mlir_module() and exported.out_avals[0].shape == (5, 128, 320)


def test_continuous_config_validation():
  with pytest.raises(ValueError, match="delay_release"):
    autotune.Config(delay_release=1)  # only with the continuous pipeline
  with pytest.raises(ValueError, match="delay_release"):
    autotune.Config(continuous=True, delay_release=2)
  with pytest.raises(ValueError, match="short_tiles"):
    autotune.Config(short_tiles=True)
  with pytest.raises(ValueError, match="do not combine"):
    autotune.Config(continuous=True, short_tiles=True, split_rows=True)
  with pytest.raises(ValueError, match="store_cols"):
    autotune.Config(store_cols=64)  # only with the continuous pipeline
  with pytest.raises(ValueError, match="block_n=256"):
    autotune.Config(block_n=256)  # stores of 256 columns: only in the continuous pipeline's chunks
  with pytest.raises(ValueError, match="store_cols"):
    autotune.Config(continuous=True, block_n=128, store_cols=96)
  with pytest.raises(ValueError, match="rows_as_n needs continuous"):
    autotune.Config(block_m=160, block_n=64, rows_as_n=True)
  with pytest.raises(ValueError, match="rows_as_n needs continuous"):
    autotune.Config(block_m=160, block_n=128, continuous=True, rows_as_n=True)  # a consumer's columns are one M
  with pytest.raises(ValueError, match="block_m=100 must be a multiple of 32"):
    autotune.Config(block_m=100, block_n=64, continuous=True, rows_as_n=True)
  assert autotune.Config(block_m=96, block_n=64, continuous=True, rows_as_n=True).rows == 96
  # The output buffer shrinks to the chunk's width: a fourth stage of 128 x 256 fits beside it.
  more = autotune.Config(max_concurrent_steps=3, continuous=True).with_more_stages()
  assert (more.max_concurrent_steps, more.store_cols) == (4, 64)
  assert more.smem_bytes(2) == (4 * (128 + 256) * 64 + 128 * 128) * 2 <= 227 * 1024


def _oracle_param(variant):
  """Short tiles need the GPU. On CPU, delay_release=1, split rows and 64-column stores are `slow`:
  the race-detector test checks their values there too (c1, c0p, c0pw, c0w), at smaller shapes."""
  config = _CONTINUOUS[variant]
  if config.short_tiles:
    return pytest.param(variant, marks=[pytest.mark.gpu_only, _ON_GPU])
  if (config.delay_release or config.split_rows or config.store_cols) and jax.default_backend() != "gpu":
    return pytest.param(variant, marks=pytest.mark.slow)
  return variant


@pytest.mark.parametrize("variant", [_oracle_param(v) for v in _CONTINUOUS])
def test_pallas_continuous_kernels_against_the_oracle(variant):
  """The continuous pipeline over items that carry different step counts and skip: forward and dx
  layout with empty groups, a group taking most rows, a sum below M (zero tiles), K = 320 (5 steps,
  not a multiple of the 3 stages), N = 320 (a half wholly past N), group tails of every length
  (64-row tiles with `short_tiles`); dW with groups of 1-40 rows (fewer steps than stages), empty
  ones, rows past the sum poisoned."""
  from pallas_kernels.grouped_matmul import grouped_matmul_pallas, transposed_grouped_matmul_pallas  # noqa: PLC0415

  config = _CONTINUOUS[variant]
  rng = np.random.default_rng(5)
  for sizes, m in (([300, 0, 517, 207, 0], 1100), ([0, 1024, 0], 1024),
                   (list(rng.multinomial(_MANY * 96 - 50, np.ones(_MANY) / _MANY)), _MANY * 96)):
    for transpose_rhs in (False, True):
      lhs, rhs, gs, _ = _inputs(m, sizes, k=320, n=320, dtype=jnp.bfloat16, transpose_rhs=transpose_rhs)
      out = jax.jit(lambda a, b, s: grouped_matmul_pallas(a, b, s, transpose_rhs=transpose_rhs, config=config))(
          lhs, rhs, gs)
      want = grouped_matmul_oracle(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
      np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.4, rtol=2e-2)
      assert not np.asarray(out[sum(sizes):]).any()
  if config.store_cols or config.rows_as_n:  # dW ignores store_cols (its kernel is c0's); rows_as_n is forward/dx's
    return
  group_rows = list(rng.integers(0, 41, _MANY))
  group_rows[7] = 0
  m = int(sum(group_rows)) + 29
  a, _, gs, b = _inputs(m, group_rows, k=256, n=320, dtype=jnp.bfloat16)
  a, b = a.at[m - 29:].set(jnp.nan), b.at[m - 29:].set(jnp.inf)
  out = jax.jit(lambda a, b, s: transposed_grouped_matmul_pallas(a, b, s, config=config))(a, b, gs)
  _, _, want = grouped_matmul_oracle(a[: m - 29], np.zeros((_MANY, 256, 320)), group_rows,
                                     np.asarray(b[: m - 29], np.float64))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.35, rtol=2e-2)
  assert not np.asarray(out[7]).any()


# ---- Mosaic GPU's race detector over the kernels' barrier protocol (interpret mode, CPU) ----

_RACE_CONFIGS = {"per_item": autotune.Config(block_n=64, max_concurrent_steps=2, grid_block_n=2),
                 "c0": autotune.Config(block_n=64, max_concurrent_steps=2, grid_block_n=2, continuous=True),
                 "c1": autotune.Config(block_n=64, max_concurrent_steps=2, grid_block_n=2, continuous=True,
                                       delay_release=1),
                 "c0p": autotune.Config(block_m=64, block_n=128, max_concurrent_steps=4, grid_block_n=2,
                                        continuous=True, split_rows=True),
                 "c1p": autotune.Config(block_m=64, block_n=64, max_concurrent_steps=2, grid_block_n=2,
                                        continuous=True, split_rows=True, delay_release=1),
                 "c0pw": autotune.Config(block_m=64, block_n=128, max_concurrent_steps=4, grid_block_n=2,
                                         continuous=True, split_rows=True, store_cols=64),
                 "c0w": autotune.Config(block_n=128, max_concurrent_steps=2, grid_block_n=2, continuous=True,
                                        store_cols=64),
                 "c0t": autotune.Config(block_m=96, block_n=64, max_concurrent_steps=2, grid_block_n=2,
                                        continuous=True, rows_as_n=True),
                 # the narrow experts' forward default: 160 rows, 5 stages, one wgmma group in flight
                 "c1t": autotune.Config.rows_as_n_heuristics("forward", 163840, 2560, 640, 512)}


def _races(output: str) -> list[str]:
  """The reports Mosaic GPU's race detector printed, one string per race."""
  return [block for block in output.split("RACE DETECTED")[1:] if block.strip()]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpret mode runs off the GPU")
@pytest.mark.parametrize("variant", list(_RACE_CONFIGS))
def test_kernels_race_free_under_the_race_detector(variant, capfd):
  """The kernel variants (all but short tiles, which the interpreter cannot take) under the
  happens-before race detector, with more items per CTA than stages (slots reused across items), a
  zero tile and an empty group. The forward and dx kernels
  race nowhere: the producer's slot reuse is ordered by the consumers' releases, stores by the TMA
  waits. dW's only reports are the two consumers' unordered, value-identical masking of a block
  they share (`tiled._mask_rows`), never the producer or TMA against a consumer. Values against the
  float64 oracle."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  from pallas_kernels.grouped_matmul import tiled  # noqa: PLC0415

  config = _RACE_CONFIGS[variant]
  detect = plgpu.InterpretGPUParams(detect_races=True)
  sizes = [60, 0, 100, 40, 40]  # 240 of 256 rows: a zero tile past the groups
  for transpose_rhs in (False, True):
    lhs, rhs, gs, _ = _inputs(256, sizes, k=192, n=320, dtype=jnp.bfloat16, transpose_rhs=transpose_rhs)
    out = tiled.grouped_matmul_tiled(lhs, rhs, gs, config=config, transpose_rhs=transpose_rhs, num_sms=2,
                                     interpret=detect)
    want = grouped_matmul_oracle(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.4, rtol=2e-2)
    assert not np.asarray(out[240:]).any()
  assert _races(capfd.readouterr().out) == []
  if config.rows_as_n:  # a forward/dx tiling
    return
  a, _, gs, b = _inputs(256, sizes, k=128, n=320, dtype=jnp.bfloat16)
  a, b = a.at[240:].set(jnp.nan), b.at[240:].set(jnp.inf)
  out = tiled.transposed_grouped_matmul_tiled(a, b, gs, config=config, num_sms=2, interpret=detect)
  _, _, want = grouped_matmul_oracle(a[:240], np.zeros((5, 128, 320)), sizes, np.asarray(b[:240], np.float64))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.35, rtol=2e-2)
  assert not np.asarray(out[1]).any()
  for race in _races(capfd.readouterr().out):
    assert race.count("from Warpgroup(") == 2 and race.count("_mask_rows") == 2, race
    assert set(re.findall(r"warpgroup_id=(\d+)", race)) <= {"0", "1"}, race
