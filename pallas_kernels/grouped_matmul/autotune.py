"""Block configs for the grouped-matmul kernels: heuristics, a small search space, and an on-disk cache.

A config is measured once per (op kind, M, K, N, G, dtype, GPU) and kept in
`$HYSCALE_CACHE_DIR/<device_kind>/grouped_matmul.json` (default root `~/.cache/hyscale_jax/autotune`).
Tuning is off by default, so a call without a cached entry takes `Config.heuristics`: set
`HYSCALE_AUTOTUNE=1` or call `set_autotune(True)` to measure missing entries (bench/grouped_matmul.py
does). Cached entries are used whether tuning is on or not.
"""

from __future__ import annotations

import dataclasses
import logging
import json
import math
import os
import pathlib
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

_LOG = logging.getLogger(__name__)
KINDS = ("forward", "forward_transposed_rhs", "transposed")
_FILE = "grouped_matmul.json"
_LOCK = threading.Lock()
_STATE = {"enabled": None}  # None: read HYSCALE_AUTOTUNE
_MEMORY: dict[str, dict] = {}  # cache file path -> its entries, read once per process


# Widest output chunk a consumer stores at once. On Hopper hardware, the power-of-two row runs of a
# partial tile 256 bf16 columns wide (split_rows at block_n 256) left the row after the last run wrong
# in its first 192 columns (`JAX_PLATFORMS=cuda pytest tests/test_grouped_matmul.py -k oracle`, variant
# c0p; the interpreter agrees with the oracle); in 128-column chunks every case is exact.
MAX_STORE_COLS = 128
# Mean rows per group up to which `Config.rows_as_n_heuristics` takes 160-row tiles (two cover
# Qwen3.8-Flash-Next's 320 at 16K tokens), 256 above.
NARROW_MEAN_ROWS = 320


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of the grouped-matmul kernels (`tiled.py`).

  A CTA computes block_m rows x 2 * block_n columns of the output, each of its two consumer
  warpgroups a block_m x block_n f32 accumulator; block_k is the K step of the TMA pipeline,
  `max_concurrent_steps` its stages in shared memory, `grid_block_n` the width (in N blocks) of the
  snake order in which the persistent grid walks output tiles (L2 reuse of the weights and rows).
  For dW (`transposed`) the output is [G, P, Q]: block_m tiles P, the columns Q, block_k the rows.
  `continuous`: one pipeline over all of a CTA's work items (the producer loads the next item's first
  steps while the consumers finish this one and store it) instead of one pipeline per item, which
  drains and refills the stages at every item. `delay_release` (continuous only): wgmma groups left
  in flight when a step's operands arrive, 0 or 1; with 1 a stage is released one step later.
  `short_tiles` (continuous forward/dx only; dW ignores it): a row tile whose group ends within its
  first 64 rows runs as a 64-row tile (half the MMAs and lhs loads). `split_rows` (continuous
  only): the warpgroups split the CTA's rows instead of its columns, a CTA of 2 * block_m x block_n.
  For dW those are P's, for a Q that 2 * block_n does not divide. For forward/dx each warpgroup
  takes block_m rows and all block_n columns (CUTLASS's cooperative split: at block_m 64 one
  m64nN wgmma per K slice), and one whose half holds none of the group's rows runs no MMAs, which
  covers what `short_tiles` does (the two do not combine). `store_cols` (continuous forward/dx; dW
  ignores it): a consumer stores its tile `store_cols` columns at a time through a buffer that
  narrow, so the output tile's shared memory can hold one more pipeline stage instead; 0 stores
  whole tiles of up to 128 columns, wider ones in 128-column chunks (`MAX_STORE_COLS`).
  `rows_as_n` (continuous forward/dx; the dW kernel refuses it): the tile's rows go on the wgmma's N
  side and its columns on M, as cuBLAS tiles narrow matmuls: each consumer computes the transpose of
  a block_m x 64 output block (block_n = 64), and block_m need not be a power of two: any multiple of
  32 (the MMA's N takes multiples of 8). Qwen3.8-Flash-Next's 320-row experts go in two tiles of 160
  and its 640 columns in five CTAs of 128: no MMA past either.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1
  continuous: bool = False
  delay_release: int = 0
  short_tiles: bool = False
  split_rows: bool = False
  store_cols: int = 0
  rows_as_n: bool = False

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      # Rows on the MMA's N side could take any multiple of 8; steps of 32 keep the tuned sizes few.
      step = 32 if name == "block_m" and self.rows_as_n else 64
      if isinstance(value, bool) or not isinstance(value, int) or value < step or value % step or value > 256:
        raise ValueError(f"Config.{name}={value!r} must be a multiple of {step} in [{step}, 256].")
    if self.rows_as_n and (not self.continuous or self.split_rows or self.short_tiles or self.block_n != 64
                           or self.store_cols):
      raise ValueError("Config.rows_as_n needs continuous=True and block_n=64 (a consumer's columns are one "
                       "wgmma's M), without split_rows, short_tiles or store_cols.")
    if not 1 <= self.max_concurrent_steps <= 8:
      raise ValueError(f"Config.max_concurrent_steps={self.max_concurrent_steps!r} must be in [1, 8].")
    if self.grid_block_n < 1 or self.grid_block_n & (self.grid_block_n - 1):
      raise ValueError(f"Config.grid_block_n={self.grid_block_n!r} must be a power of two.")
    if self.delay_release not in (0, 1) or (self.delay_release and not self.continuous):
      raise ValueError(f"Config.delay_release={self.delay_release!r} must be 0, or 1 with continuous=True.")
    if (self.short_tiles or self.split_rows) and not self.continuous:
      raise ValueError("Config.short_tiles and Config.split_rows need continuous=True.")
    if self.short_tiles and self.split_rows:
      raise ValueError("Config.short_tiles and Config.split_rows do not combine: split_rows already skips a "
                       "warpgroup's rows past the group.")
    if self.block_n > MAX_STORE_COLS and not self.continuous:
      raise ValueError(f"Config.block_n={self.block_n} > {MAX_STORE_COLS} needs continuous=True (whose stores "
                       f"go out in {MAX_STORE_COLS}-column chunks).")
    if self.store_cols and (not self.continuous or self.store_cols % 64 or self.block_n % self.store_cols):
      raise ValueError(f"Config.store_cols={self.store_cols!r} must be 0, or a multiple of 64 dividing "
                       f"block_n={self.block_n} with continuous=True.")
    if self.delay_release >= self.max_concurrent_steps:
      raise ValueError("Config.delay_release must be below max_concurrent_steps.")

  @property
  def columns(self) -> int:
    """Output columns per CTA: two warpgroups' worth (one's with `split_rows`)."""
    return self.block_n if self.split_rows else 2 * self.block_n

  @property
  def rows(self) -> int:
    """Output rows per CTA (dW: of P): one warpgroup's worth (two with `split_rows`)."""
    return 2 * self.block_m if self.split_rows else self.block_m

  @property
  def store_width(self) -> int:
    """Columns a forward/dx consumer stores at once: `store_cols`, else its tile up to MAX_STORE_COLS."""
    return self.store_cols or min(self.block_n, MAX_STORE_COLS)

  def mma_area(self, group_rows: float, n: int) -> int:
    """Output elements this tiling's MMAs compute for a group of `group_rows` x `n` (its tiles padded
    to whole rows and CTAs' columns): what forward/dx spend past the group's own."""
    return math.ceil(group_rows / self.rows) * self.rows * math.ceil(n / self.columns) * self.columns

  def smem_bytes(self, itemsize: int) -> int:
    """Shared memory of the input pipeline plus the forward/dx output buffer (`store_width` columns a
    consumer; dW's buffer holds its whole tile, the same bytes at the block_n <= 128 it is tuned
    over)."""
    out_columns = self.columns // self.block_n * self.store_width
    return (self.max_concurrent_steps * (self.rows + self.columns) * self.block_k
            + self.rows * out_columns) * itemsize

  @classmethod
  def heuristics(cls, kind: str, m: int, k: int, n: int, g: int) -> "Config":
    """The default when nothing is cached: 128 x 256 CTA tiles, 3 stages (208 KiB of bf16), snake
    bands of 4 N blocks for the forward, for dx 8 where they tile the blocks exactly (or, for items
    of at most 16 K steps, where there are 8) else 4, and for dW 4 (1 under 4 blocks): the best of
    the configs swept at the bench shapes. A fourth stage, with the output stored in 64-column
    chunks, for continuous forwards and those short dx items (`with_more_stages`). An N that 256
    does not divide still takes 256-column CTAs when that pads it by at most 20% (the kernels read
    the columns past N as zeros, and the wider CTAs measured faster at Qwen's 640 = 2.5 CTAs), else
    128-column CTAs, 4 stages.
    dW's block_m also tiles its output's K (= P) axis: 64 when 128 does not divide it, so the wrapper
    need not pad (a padded operand is a copy). The continuous pipeline for every dW and for forward/dx
    items of at most 64 K steps, where it measured faster; 64-row tail tiles are left to tuning
    (faster at Qwen's forward, slower at its dx and the skewed GLM-5.1 forward). Forward/dx of at
    most 64 K steps an item take `rows_as_n_heuristics`'s tiling instead where its tiles cover a mean
    group with less MMA area (`mma_area`): Qwen3.8-Flash-Next's 320 x 640 experts in 320 x 640
    against 384 x 768, at 64K tokens its forward's 1280 x 640 against 1280 x 768; not its dx there
    (1280 x 2560 both ways, and row tiles measured faster), nor GLM-5.1 or V4-Flash.
    docs/kernels/grouped_matmul.md has the measurements behind each choice.
    """
    _check_kind(kind)
    row_tiles = cls._row_tile_heuristics(kind, k, n)
    if kind != "transposed" and k <= 64 * 64:
      rows_as_n = cls.rows_as_n_heuristics(kind, m, k, n, g)
      mean = m / max(g, 1)
      if rows_as_n.mma_area(mean, n) < row_tiles.mma_area(mean, n):
        return rows_as_n
    return row_tiles

  @classmethod
  def rows_as_n_heuristics(cls, kind: str, m: int, k: int, n: int, g: int) -> "Config":
    """Forward/dx with the rows on the wgmma's N side (`rows_as_n`): 160-row tiles where the mean group
    has at most `NARROW_MEAN_ROWS` rows (Qwen3.8-Flash-Next's 320 in two), else 256; 128-column CTAs,
    at 160 rows in a snake band over all of N's blocks (a row tile's rows stay in L2 across them, else
    bands of 8); five stages at 160 rows (three at 256), and for the narrow forward's long items one wgmma
    group left in flight (`delay_release`). Measured faster than the row tiles at Qwen's 16K forward
    and dx and its 64K forward; slower at V4-Flash's forward (docs/kernels/grouped_matmul.md).
    """
    if kind == "transposed":
      raise ValueError("Config.rows_as_n_heuristics: rows_as_n is a forward/dx tiling, not dW's.")
    del k
    narrow = m <= NARROW_MEAN_ROWS * g
    blocks = -(-n // 128)
    band = 1 << (blocks - 1).bit_length() if narrow else 8
    return cls(block_m=160 if narrow else 256, block_n=64, max_concurrent_steps=5 if narrow else 3,
               grid_block_n=band, continuous=True, delay_release=int(narrow and kind == "forward"),
               rows_as_n=True)

  @classmethod
  def _row_tile_heuristics(cls, kind: str, k: int, n: int) -> "Config":
    """`heuristics` with the rows on the wgmma's M side (every shape but narrow experts')."""
    block_m = 128 if kind != "transposed" or k % 128 == 0 else 64
    block_n = 128 if _pads_little(n, 256) else 64
    blocks = -(-n // (2 * block_n))
    if kind == "transposed":
      band = 4 if blocks >= 4 else 1
    elif kind == "forward":  # band 4 measured faster than 8 at every forward swept
      band = 4
    elif k <= 16 * 64:  # short dx items (Qwen's 10 K steps, 4 stages below): band 8 measured faster
      band = 8 if blocks >= 8 else 4
    else:  # a remainder band cost Qwen's dx 30% at 3 stages: 8 only where it tiles the blocks
      band = 8 if blocks % 8 == 0 else 4
    stages = 3 if block_n == 128 else 4
    if kind == "transposed":
      # dW: the continuous pipeline (faster at every bench shape), and where 256 columns pad Q but
      # 128 do not (Qwen's 640), warpgroups splitting P instead (faster there).
      split = n % (2 * block_n) != 0 and n % block_n == 0 and k % (2 * block_m) == 0
      return cls(block_m=block_m, block_n=block_n, max_concurrent_steps=stages, grid_block_n=1 if split else band,
                 continuous=True, split_rows=split)
    # Forward/dx: continuous where an item is at most 64 K steps (faster at V4-Flash's forward and
    # Qwen's dx); at GLM-5.1's K 6144 it measured the same as one pipeline per item.
    continuous = k <= 64 * 64
    config = cls(block_m=block_m, block_n=block_n, max_concurrent_steps=stages, grid_block_n=band,
                 continuous=continuous)
    if continuous and block_n == 128 and (kind == "forward" or k <= 16 * 64):
      # A fourth stage where the output tile goes out in 64-column chunks (its buffer 32 KiB, not 64):
      # faster at the short items of V4-Flash's and Qwen's forwards and Qwen's dx (10 K steps an item);
      # not at dx's 32 steps (slower at GLM-5.1).
      config = config.with_more_stages()
    return config

  def with_more_stages(self) -> "Config":
    """This continuous config with one more pipeline stage in the room that storing
    the output in 64-column chunks frees (the CTA's input stages and output buffer, within 227 KiB)."""
    return dataclasses.replace(self, max_concurrent_steps=self.max_concurrent_steps + 1, store_cols=64)

  @classmethod
  def search_space(cls, kind: str, m: int, k: int, n: int, g: int, itemsize: int = 2) -> tuple["Config", ...]:
    """At most 10 configs, the heuristic first, then for forward/dx the rows on the MMA's N side
    (`rows_as_n_heuristics`, with either `delay_release`) and the row-tile heuristic, its other
    pipeline, the warpgroups splitting the CTA's rows, 64-row tail tiles, a fourth stage with the
    output stored in 64-column chunks, the other band; for dW the other way of splitting the
    tile), then snake bands of 1-16 N blocks (how long a row tile stays
    hot in L2) and tiles of 64 or 128 rows x 128 or 256 columns. Kept only if the CTA's columns pad N
    by at most 20% (and, for dW, block_m divides its K) and the kernel fits Hopper's 227 KiB of
    shared memory.
    """
    _check_kind(kind)
    heuristic = cls.heuristics(kind, m, k, n, g)
    found = [heuristic]
    if kind == "transposed":  # the continuous pipeline both ways of splitting the tile
      alternative = dataclasses.replace(heuristic, split_rows=not heuristic.split_rows)
      if k % alternative.rows == 0:
        found.append(alternative)
    else:  # rows on N (two delays) or on M, the other pipeline, the warpgroups splitting rows, 64-row tails
      rows_as_n = cls.rows_as_n_heuristics(kind, m, k, n, g)
      row_tiles = cls._row_tile_heuristics(kind, k, n)
      found += [rows_as_n, dataclasses.replace(rows_as_n, delay_release=1 - rows_as_n.delay_release), row_tiles]
      heuristic = row_tiles
      plain = dataclasses.replace(heuristic, store_cols=0,
                                  max_concurrent_steps=heuristic.max_concurrent_steps - bool(heuristic.store_cols))
      found.append(dataclasses.replace(plain, continuous=not plain.continuous))
      # CUTLASS's cooperative split: 64-row halves, each over all of the CTA's columns (and 128
      # columns where those tile N and the heuristic's pad it: Qwen's 640), with the fourth stage
      for columns in dict.fromkeys((plain.columns, 128)):
        if columns == plain.columns or (n % columns == 0 and n % plain.columns):
          blocks = -(-n // columns)
          band = plain.grid_block_n if columns == plain.columns else max(
              b for b in (8, 4, 2, 1) if blocks % b == 0)  # no remainder band (it cost Qwen's dx 30%)
          found.append(dataclasses.replace(plain, block_m=64, block_n=columns, continuous=True, split_rows=True,
                                           max_concurrent_steps=4, grid_block_n=band, store_cols=columns // 2))
      found.append(dataclasses.replace(plain, continuous=True, short_tiles=True))
      # Three or four stages (the fourth in the room of an output stored in 64-column chunks), and
      # the other snake band (4 <-> 8)
      found.append(plain if heuristic.store_cols else dataclasses.replace(plain, continuous=True).with_more_stages())
      found.append(dataclasses.replace(heuristic, grid_block_n=32 // heuristic.grid_block_n if
                                       heuristic.grid_block_n in (4, 8) else 4))
    for block_m, block_n, steps, grid_block_n in (
        (128, 128, 3, 4), (128, 128, 3, 16), (128, 128, 3, 2), (128, 128, 3, 1), (64, 128, 4, 8), (128, 64, 4, 8),
        (128, 64, 4, 4)):
      config = cls(block_m=block_m, block_n=block_n, max_concurrent_steps=steps, grid_block_n=grid_block_n)
      if kind == "transposed":
        config = dataclasses.replace(config, continuous=True)
      if not _pads_little(n, config.columns) or (kind == "transposed" and k % block_m):
        continue
      if config not in found and config.smem_bytes(itemsize) <= 227 * 1024:
        found.append(config)
    return tuple(dict.fromkeys(found))[:10]


def _pads_little(n: int, columns: int) -> bool:
  """Whether CTAs of `columns` cover N with at most 20% past it (the kernels read those as zeros)."""
  return -(-n // columns) * columns <= 1.2 * n


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"{kind=!r} must be one of {KINDS}.")


def set_autotune(enabled: bool | None) -> None:
  """Turns measuring of missing entries on or off; None goes back to the `HYSCALE_AUTOTUNE` env var."""
  _STATE["enabled"] = enabled


def autotune_enabled() -> bool:
  if _STATE["enabled"] is not None:
    return bool(_STATE["enabled"])
  return os.environ.get("HYSCALE_AUTOTUNE", "0").lower() in ("1", "true", "yes", "on")


def cache_path(device_kind: str) -> pathlib.Path:
  """`$HYSCALE_CACHE_DIR` (or ~/.cache/hyscale_jax/autotune) / <device kind, sanitised> / grouped_matmul.json."""
  root = os.environ.get("HYSCALE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hyscale_jax",
                                                             "autotune")
  return pathlib.Path(root) / re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind) / _FILE


def cache_key(kind: str, m: int, k: int, n: int, g: int, dtype) -> str:
  """The entry name: op kind, the problem's sizes and dtype (the GPU is the file's folder)."""
  _check_kind(kind)
  return f"{kind}:M={m}:K={k}:N={n}:G={g}:{np.dtype(dtype).name}"


def _load(path: pathlib.Path) -> dict:
  if str(path) not in _MEMORY:
    try:
      _MEMORY[str(path)] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # a corrupt file is re-measured, not fatal
      _MEMORY[str(path)] = {}
  return _MEMORY[str(path)]


def _store(path: pathlib.Path, key: str, entry: dict) -> None:
  """Merges one entry into the file atomically (temp file + os.replace), keeping other processes' entries."""
  with _LOCK:
    path.parent.mkdir(parents=True, exist_ok=True)
    _MEMORY.pop(str(path), None)
    entries = dict(_load(path))
    entries[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{_FILE}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    _MEMORY[str(path)] = entries


def cached_config(device_kind: str, key: str) -> Config | None:
  """The cached config for `key`, or None: also for an entry this version cannot build (a field it
  does not know, written by a newer one, or values its validation now refuses), which is re-tuned."""
  entry = _load(cache_path(device_kind)).get(key)
  if entry is None:
    return None
  try:
    return Config(**entry["config"])
  except (TypeError, ValueError, KeyError) as e:
    _LOG.warning("grouped_matmul autotune cache entry %s is unusable (%s); ignoring it", key, e)
    return None


def choose(device_kind: str, kind: str, m: int, k: int, n: int, g: int, dtype,
           measure: Callable[[Config], float]) -> Config:
  """The cached config, else (tuning on) the fastest of `search_space` by `measure`, else the heuristic.

  `measure(config)` returns seconds, or raises (a config that does not compile or fit is skipped).
  """
  key = cache_key(kind, m, k, n, g, dtype)
  found = cached_config(device_kind, key)
  if found is not None:
    return found
  if not autotune_enabled():
    return Config.heuristics(kind, m, k, n, g)
  try:
    best, timings = tune(Config.search_space(kind, m, k, n, g, np.dtype(dtype).itemsize), measure)
  except RuntimeError as e:  # nothing ran (e.g. no memory left to tune in): run on the default, uncached
    warnings.warn(f"grouped_matmul autotune for {key} failed, using the heuristic config: {e}", stacklevel=2)
    return Config.heuristics(kind, m, k, n, g)
  _store(cache_path(device_kind), key, {"config": dataclasses.asdict(best), "seconds": timings,
                                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
  return best


def tune(configs: Sequence[Config], measure: Callable[[Config], float]) -> tuple[Config, dict[str, float | str]]:
  """(fastest config, {config: seconds or the error}); raises RuntimeError when none ran."""
  timings: dict[str, float | str] = {}
  best, best_s = None, float("inf")
  for config in configs:
    name = "{block_m}x{block_n}x{block_k}/s{max_concurrent_steps}/g{grid_block_n}".format(**dataclasses.asdict(config))
    if config.continuous:
      name += (f"/c{config.delay_release}" + ("s" if config.short_tiles else "") + ("p" if config.split_rows else "")
               + ("t" if config.rows_as_n else "") + (f"w{config.store_cols}" if config.store_cols else ""))
    try:
      seconds = float(measure(config))
    except Exception as e:  # noqa: BLE001 - a config that fails to compile or overflows smem is skipped
      timings[name] = f"{type(e).__name__}: {str(e)[:120]}"
      continue
    timings[name] = seconds
    _LOG.info("grouped_matmul autotune: %s %.3f ms", name, seconds * 1e3)
    if seconds < best_s:
      best, best_s = config, seconds
  if best is None:
    raise RuntimeError(f"no grouped_matmul config ran: {timings}")
  return best, timings
