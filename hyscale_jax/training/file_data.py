"""The user's own corpus: JSONL text or pre-tokenized token files, memory-mapped, packed row by row.

Two sources (`config.data.source`):

  "jsonl"   one JSON object per line with the document in a text field (`data.text_field`, default
            "text"), tokenized once with a `tokenizer.json` (`data.tokenizer`: the file, or a folder
            holding it, such as an imported Hugging Face checkpoint). The token ids are cached beside
            the JSONL file in `<file>.tokens-<key>/`, key = hash of (the tokenizer file, the EOS token,
            the text field, the JSONL's size and mtime): a changed file or tokenizer is tokenized again.
  "tokens"  token ids already made: a `.npy` array, or a flat binary of `data.token_dtype` (uint16,
            uint32 or int32), with document offsets in `data.offsets` (default `<file stem>.offsets.npy`):
            i64[D + 1], document d is `tokens[offsets[d]:offsets[d + 1]]`, without EOS.

The token ids are memory-mapped, never read whole: the packing layout (`text_data.pack_plan`) is computed
from the document lengths, and a batch reads only the pieces of its rows. Documents are packed with
EOS appended and segment ids, exactly as the bundled corpora are (`text_data.PackedRows`), so a
process reads only its rows of the global batch, deterministically from (seed, step, row).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import time
import uuid
from typing import TYPE_CHECKING

import numpy as np

from hyscale_jax.training import console, text_data

if TYPE_CHECKING:
  import tokenizers

FILE_SOURCES = ("jsonl", "tokens")
TOKEN_DTYPES = ("uint16", "uint32", "int32")
# End-of-document tokens of common tokenizers, tried in order when neither `data.eos_token` nor a
# tokenizer_config.json beside the tokenizer names one.
EOS_CANDIDATES = (text_data.EOS_TOKEN, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
# Bump when the cache layout changes, so old caches are rebuilt, not reused.
CACHE_FORMAT = 1
_ENCODE_BATCH = 512  # lines per `encode_batch` call: the tokenizer's threads get work, memory stays small
_VOCAB_CHUNK = 1 << 24  # tokens per chunk of the vocabulary scan of a token file
_PROGRESS_EVERY_S = 10.0

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_file(path: str | os.PathLike) -> pathlib.Path:
  """`path` itself when it is a file, else `path/tokenizer.json` (a Hugging Face checkpoint folder)."""
  path = pathlib.Path(path).expanduser()
  found = path / "tokenizer.json" if path.is_dir() else path
  if not found.is_file():
    raise ValueError(f"data.tokenizer={str(path)!r}: no tokenizer file at {found}.")
  return found


def load_tokenizer(path: str | os.PathLike, eos_token: str = "") -> tuple[tokenizers.Tokenizer, int, str]:
  """The tokenizer of `path` (see `tokenizer_file`), its end-of-document id, and a hash of the file.

  The EOS token is `eos_token` when given, else `eos_token` of the tokenizer_config.json beside the
  file (Hugging Face checkpoints), else the first of `EOS_CANDIDATES` in the vocabulary.

  Raises:
    ValueError: no tokenizer file, an unreadable one, or no EOS token; the message names the path.
  """
  tk = text_data._tokenizers()
  file = tokenizer_file(path)
  raw = file.read_bytes()
  try:
    tokenizer = tk.Tokenizer.from_str(raw.decode("utf-8"))
  except Exception as e:  # tokenizers raises its own exception type for any malformed file
    raise ValueError(f"data.tokenizer: {file} is not a readable tokenizer.json ({e}).") from e
  names = [eos_token] if eos_token else [*_configured_eos(file.parent / "tokenizer_config.json"), *EOS_CANDIDATES]
  eos_id = next((i for name in names if (i := tokenizer.token_to_id(name)) is not None), None)
  if eos_id is None:
    raise ValueError(f"data.eos_token={eos_token!r}: none of {names} is a token of {file}; set "
                     f"--config.data.eos_token to the tokenizer's end-of-document token.")
  return tokenizer, eos_id, hashlib.sha256(raw).hexdigest()


def _configured_eos(config_file: pathlib.Path) -> list[str]:
  try:
    eos = json.loads(config_file.read_text()).get("eos_token")
  except (OSError, ValueError, AttributeError):
    return []
  eos = eos.get("content") if isinstance(eos, dict) else eos
  return [eos] if isinstance(eos, str) and eos else []


# ----------------------------------------------------------------------------------------------------
# Token files


def default_offsets_path(tokens_path: str | os.PathLike) -> pathlib.Path:
  """`corpus.bin` -> `corpus.offsets.npy`, beside the token file."""
  path = pathlib.Path(tokens_path)
  return path.with_name(path.name.rsplit(".", 1)[0] + ".offsets.npy")


def open_token_file(path: str | os.PathLike, *, offsets: str | os.PathLike | None = None,
                    dtype: str = "uint16") -> tuple[np.ndarray, np.ndarray]:
  """Memory-maps a token file and reads its document offsets.

  Args:
    path: a `.npy` file of a 1-D integer array, or a flat binary of `dtype` values (no header).
    offsets: the `.npy` of i64[D + 1] document boundaries; None or "" means `default_offsets_path(path)`.
    dtype: the flat binary's element type, one of `TOKEN_DTYPES` (a `.npy` file carries its own).

  Returns:
    (tokens int[N], a read-only memmap; offsets i64[D + 1]).

  Raises:
    ValueError: a missing or empty file, a size that is not whole elements, or offsets that do not
      cover the tokens (not starting at 0, decreasing, or not ending at N); the message names the file.
  """
  path = pathlib.Path(path).expanduser()
  if not path.is_file():
    raise ValueError(f"data.path={str(path)!r}: no such token file.")
  if path.stat().st_size == 0:
    raise ValueError(f"{path} is empty: no tokens.")
  if path.suffix == ".npy":
    try:
      tokens = np.load(path, mmap_mode="r")
    except ValueError as e:
      raise ValueError(f"{path} is not a readable .npy file ({e}).") from e
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"{path} holds {tokens.dtype}{list(tokens.shape)}; token ids must be a 1-D integer array.")
  else:
    if dtype not in TOKEN_DTYPES:
      raise ValueError(f"data.token_dtype={dtype!r} must be one of {TOKEN_DTYPES}.")
    itemsize = np.dtype(dtype).itemsize
    if path.stat().st_size % itemsize:
      raise ValueError(f"{path} has {path.stat().st_size} bytes, not a whole number of {dtype} tokens "
                       f"({itemsize} bytes each): is data.token_dtype={dtype!r} right?")
    tokens = np.memmap(path, dtype=dtype, mode="r")
  if len(tokens) == 0:
    raise ValueError(f"{path} is empty: no tokens.")
  offsets_path = pathlib.Path(offsets).expanduser() if offsets else default_offsets_path(path)
  if not offsets_path.is_file():
    raise ValueError(f"data.offsets={str(offsets_path)!r}: no offsets file for {path} (i64[D + 1], document d "
                     f"is tokens[offsets[d]:offsets[d + 1]]).")
  bounds = np.load(offsets_path)
  if (bounds.ndim != 1 or len(bounds) < 2 or not np.issubdtype(bounds.dtype, np.integer) or bounds[0] != 0
      or bounds[-1] != len(tokens) or np.any(np.diff(bounds) < 0)):
    raise ValueError(f"{offsets_path}: offsets must be a non-decreasing integer array from 0 to the "
                     f"{len(tokens)} tokens of {path}; got {bounds.dtype}{list(bounds.shape)} "
                     f"from {bounds[:1].tolist()} to {bounds[-1:].tolist()}.")
  return tokens, bounds.astype(np.int64)


def check_vocabulary(tokens: np.ndarray, offsets: np.ndarray, vocab_size: int, path) -> None:
  """Scans `tokens` in chunks (never whole into memory) for ids outside [0, vocab_size).

  Raises:
    ValueError: naming the file, the first bad token's position, its document and its id.
  """
  for begin in range(0, len(tokens), _VOCAB_CHUNK):
    chunk = np.asarray(tokens[begin : begin + _VOCAB_CHUNK])
    bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
    if bad.size:
      at = begin + int(bad[0])
      doc = int(np.searchsorted(offsets, at, side="right")) - 1
      raise ValueError(f"{path}: token {at} (document {doc}, token {at - offsets[doc]} of it) is "
                       f"{int(chunk[bad[0]])}, outside the vocabulary [0, {vocab_size}) of model.vocab_size.")


# ----------------------------------------------------------------------------------------------------
# JSONL


def jsonl_cache_dir(path: pathlib.Path, *, tokenizer_hash: str, eos_id: int, text_field: str) -> pathlib.Path:
  """`<file>.tokens-<key>/` beside the JSONL file; the key changes with the file and the tokenizer."""
  stat = path.stat()
  key = json.dumps([CACHE_FORMAT, tokenizer_hash, eos_id, text_field, stat.st_size, stat.st_mtime_ns])
  return path.with_name(f"{path.name}.tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def tokenize_jsonl(path: str | os.PathLike, tokenizer: tokenizers.Tokenizer, *, tokenizer_hash: str, eos_id: int,
                   text_field: str = "text") -> pathlib.Path:
  """Tokenizes a JSONL corpus once into a token-file folder beside it; later calls reuse it.

  The folder holds `tokens.bin` (uint32, flat), `offsets.npy` and `meta.json`. It is written under a
  temporary name and renamed into place, so a killed run leaves no half-written cache. The processes
  of a host take turns on a lock of the file (one tokenizes); hosts sharing the folder each end with
  the same complete folder. Lines are
  read and encoded in batches: the corpus is never in memory. Blank lines and empty texts are
  skipped, counted and logged; progress is logged every 10 s (a tqdm bar on a terminal).

  Returns:
    The cache folder.

  Raises:
    ValueError: naming the file and line: an empty file, a line that is not UTF-8 or not a JSON
      object with a string `text_field`, or a file without any document.
  """
  path = pathlib.Path(path).expanduser()
  if not path.is_file():
    raise ValueError(f"data.path={str(path)!r}: no such JSONL file.")
  if path.stat().st_size == 0:
    raise ValueError(f"{path} is empty: no documents.")
  folder = jsonl_cache_dir(path, tokenizer_hash=tokenizer_hash, eos_id=eos_id, text_field=text_field)
  if (folder / "meta.json").is_file():
    return folder
  # The processes of one host (one per GPU) take turns on a lock of the JSONL file itself: one
  # tokenizes, the others then find the cache. The kernel drops the lock of a process that dies.
  with open(path, "rb") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      log.info("waiting for another process tokenizing %s", path)
      fcntl.flock(lock, fcntl.LOCK_EX)
    if (folder / "meta.json").is_file():
      return folder
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    staging.mkdir()
    try:
      meta = _tokenize_into(path, staging, tokenizer, text_field)
      meta |= {"format": CACHE_FORMAT, "source": str(path), "tokenizer_sha256": tokenizer_hash, "eos_id": eos_id,
               "text_field": text_field}
      text_data._atomic_write(staging / "meta.json", lambda f: f.write(json.dumps(meta, indent=2).encode()))
      try:
        os.rename(staging, folder)
      except OSError:  # a process of another host, sharing the folder, renamed its identical one first
        if not (folder / "meta.json").is_file():
          raise
    finally:
      shutil.rmtree(staging, ignore_errors=True)
  return folder


def _tokenize_into(path: pathlib.Path, out: pathlib.Path, tokenizer, text_field: str) -> dict:
  """Writes tokens.bin and offsets.npy of `path` into `out`; returns the counts for meta.json."""
  total = path.stat().st_size
  lengths, texts, skipped = [], [], {"blank line": 0, "empty text": 0}
  start = last_report = time.monotonic()
  bar = None
  if sys.stderr.isatty():
    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {path.name}")
  console.say(f"tokenizing {path} ({total / 1e6:.1f} MB, once; cached in {out})")

  def flush(f):
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
      ids = np.asarray(encoding.ids, dtype=np.uint32)
      f.write(ids.tobytes())
      lengths.append(len(ids))
    texts.clear()

  with open(path, "rb") as src, open(out / "tokens.bin", "wb") as f:
    for line_no, raw in enumerate(src, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start} of the line).") from None
      if not line.strip():
        skipped["blank line"] += 1
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not a JSON object ({e.msg} at column {e.colno}).") from None
      if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        got = type(record.get(text_field)).__name__ if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}:{line_no}: needs a string field {text_field!r} (data.text_field); got {got}.")
      if not record[text_field]:
        skipped["empty text"] += 1
        continue
      texts.append(record[text_field])
      if len(texts) == _ENCODE_BATCH:
        flush(f)
        now = time.monotonic()
        if bar is not None:
          bar.n = src.tell()
          bar.refresh()
        elif now - last_report >= _PROGRESS_EVERY_S:
          console.say(f"tokenizing {path.name}: {100 * src.tell() / total:.0f}% ({len(lengths)} documents, "
                      f"{now - start:.0f} s)")
          last_report = now
    flush(f)
    f.flush()
    os.fsync(f.fileno())
  if bar is not None:
    bar.close()
  if not lengths:
    raise ValueError(f"{path}: no documents ({skipped['blank line']} blank lines, {skipped['empty text']} "
                     f"empty {text_field!r} fields).")
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  text_data._atomic_write(out / "offsets.npy", lambda f: np.save(f, offsets))
  n_skipped = sum(skipped.values())
  message = (f"tokenized {path}: {len(lengths)} documents, {int(offsets[-1])} tokens in "
             f"{time.monotonic() - start:.1f} s; skipped {n_skipped} lines "
             f"({', '.join(f'{n} {kind}' for kind, n in skipped.items())})")
  (log.warning if n_skipped else log.info)(message)
  return {"num_documents": len(lengths), "num_tokens": int(offsets[-1]), "skipped_lines": skipped}


# ----------------------------------------------------------------------------------------------------
# Dataset


class FileTextDataset(text_data.PackedRows):
  """Packed batches of the user's JSONL or token file, in `PackedRows`' deterministic order.

  Only document lengths are held in memory (and the packing layout, one entry per piece of a
  document); tokens stay memory-mapped and a batch reads the pieces of its rows.

  Args:
    source: "jsonl" or "tokens" (see the module docstring).
    path: the JSONL file or the token file.
    vocab_size: model.vocab_size; every token id must lie below it.
    seq_len, batch_size, seed, split: as in `text_data.PackedTextDataset`.
    tokenizer: tokenizer.json, or a folder holding it; required for "jsonl", optional for "tokens"
      (then only to find the EOS id and to decode).
    text_field: the JSON field holding each document ("jsonl").
    offsets, token_dtype: the offsets file and the flat binary's dtype ("tokens").
    eos_id: the id appended to each document and used as padding; -1 takes the tokenizer's.
    eos_token: the tokenizer's end-of-document token; "" looks it up (`load_tokenizer`).

  Raises:
    ValueError: a bad argument or bad data, naming the argument or the file (and line).
  """

  def __init__(self, *, source: str, path: str | os.PathLike, vocab_size: int, seq_len: int = 256,
               batch_size: int = 8, seed: int = 0, split: str = "train", tokenizer: str | os.PathLike = "",
               text_field: str = "text", offsets: str | os.PathLike = "", token_dtype: str = "uint16",
               eos_id: int = -1, eos_token: str = ""):
    if source not in FILE_SOURCES:
      raise ValueError(f"data.source={source!r} is not one of {FILE_SOURCES}.")
    if not path:
      raise ValueError(f"data.source={source!r} needs data.path, the corpus file.")
    if split not in text_data.SPLITS:
      raise ValueError(f"{split=} is not one of {text_data.SPLITS}.")
    for name, value, least in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1), ("seed", seed, 0),
                               ("vocab_size", vocab_size, 1)):
      if not isinstance(value, int) or value < least:
        raise ValueError(f"{name}={value!r} must be an int >= {least}.")
    self.source, self.split = source, split
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
    self._tokenizer = None
    if tokenizer:
      self._tokenizer, tokenizer_eos, tokenizer_hash = load_tokenizer(tokenizer, eos_token)
      eos_id = tokenizer_eos if eos_id < 0 else eos_id
    if source == "jsonl":
      if self._tokenizer is None:
        raise ValueError("data.source='jsonl' needs data.tokenizer: a tokenizer.json or a folder holding one.")
      if self._tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"data.tokenizer has {self._tokenizer.get_vocab_size()} tokens > "
                         f"model.vocab_size={vocab_size}.")
      folder = tokenize_jsonl(path, self._tokenizer, tokenizer_hash=tokenizer_hash, eos_id=eos_id,
                              text_field=text_field)
      tokens, offsets_ = open_token_file(folder / "tokens.bin", offsets=folder / "offsets.npy", dtype="uint32")
      self.path = pathlib.Path(path)
    else:
      tokens, offsets_ = open_token_file(path, offsets=offsets, dtype=token_dtype)
      self.path = pathlib.Path(path)
      check_vocabulary(tokens, offsets_, vocab_size, self.path)
    if not 0 <= eos_id < vocab_size:
      raise ValueError(f"data.eos_id={eos_id} must lie in [0, model.vocab_size={vocab_size}) (or give "
                       f"data.tokenizer to take its EOS).")
    self._eos_id = eos_id
    self._tokens, self._offsets = tokens, offsets_
    docs = np.asarray(text_data.split_documents(len(offsets_) - 1, split))
    lengths = offsets_[docs + 1] - offsets_[docs]
    self._plan = text_data.pack_plan(lengths, seq_len)
    self._plan["doc"] = docs[self._plan["doc"]]  # back to the file's document numbers
    self._piece = functools.partial(text_data.stream_piece, tokens, offsets_, eos_id)

  @property
  def num_rows(self) -> int:
    """R, the number of packed rows in this split (one epoch)."""
    return len(self._plan["row_starts"]) - 1

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def tokens(self) -> np.ndarray:
    """int[N] all token ids, memory-mapped."""
    return self._tokens

  @property
  def tokenizer(self) -> tokenizers.Tokenizer | None:
    return self._tokenizer

  @property
  def fingerprint(self) -> str:
    return (f"{self.source} {self.path.name} ({len(self._offsets) - 1} documents, {len(self._tokens)} tokens, "
            f"{self.num_rows} rows of {self.seq_len})")

  def _read_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    return text_data.packed_rows(self._plan, rows, self._piece, self.seq_len, self._eos_id)


# What a `data.path` suffix says the file holds, for `data.source` "" (inferred).
SOURCE_BY_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".npy": "tokens", ".bin": "tokens"}


def resolve_source(data) -> str:
  """`data.source`, or for "" the source `data.path`'s suffix names (no path: the bundled "shakespeare").

  Raises:
    ValueError: a bundled corpus named together with `data.path` or `data.tokenizer`, which it would not
      read (training would silently run on the bundled text); a path whose suffix names no source.
  """
  source, path, tokenizer = data.get("source", ""), data.get("path", ""), data.get("tokenizer", "")
  if source in text_data.SOURCES and (path or tokenizer):
    given = " and ".join(f"data.{k}={v!r}" for k, v in (("path", path), ("tokenizer", tokenizer)) if v)
    raise ValueError(f"{given} is set, but data.source={source!r} reads the bundled corpus, not your file. Set "
                     f"data.source to one of {FILE_SOURCES} (or to '' to infer it from the path's suffix), or "
                     f"unset {given.split('=')[0]}.")
  if source:
    return source
  if not path:
    if tokenizer:
      raise ValueError(f"data.tokenizer={tokenizer!r} is set but data.path is not: set data.path to your corpus "
                       "(.jsonl, or tokens in .npy/.bin), or unset data.tokenizer to train on the bundled text.")
    return "shakespeare"
  suffix = pathlib.Path(path).suffix.lower()
  if suffix not in SOURCE_BY_SUFFIX:
    raise ValueError(f"data.path={path!r}: cannot tell its format from the suffix {suffix!r} (known: "
                     f"{sorted(SOURCE_BY_SUFFIX)}); set data.source to one of {FILE_SOURCES}.")
  return SOURCE_BY_SUFFIX[suffix]


def open_dataset(data, *, model_vocab_size: int, seed: int, split: str = "train") -> text_data.PackedRows:
  """The dataset of `config.data`: a bundled corpus (`text_data.SOURCES`) or the user's file (`FILE_SOURCES`);
  `data.source` "" is inferred (`resolve_source`).

  Raises:
    ValueError: an unknown `data.source`, or a bad setting or file of it (named).
  """
  source = resolve_source(data)
  common = dict(seq_len=data.seq_len, batch_size=data.batch_size, seed=seed, split=split)
  if source in text_data.SOURCES:
    dataset = text_data.PackedTextDataset(source=source, vocab_size=data.vocab_size,
                                          cache_dir=data.get("cache_dir") or None, **common)
    if dataset.vocab_size > model_vocab_size:
      raise ValueError(f"the tokenizer has {dataset.vocab_size} tokens > model.vocab_size={model_vocab_size}.")
    return dataset
  if source in FILE_SOURCES:
    return FileTextDataset(
        source=source, path=data.get("path", ""), vocab_size=model_vocab_size,
        tokenizer=data.get("tokenizer", ""), text_field=data.get("text_field", "text"),
        offsets=data.get("offsets", ""), token_dtype=data.get("token_dtype", "uint16"),
        eos_id=data.get("eos_id", -1), eos_token=data.get("eos_token", ""), **common)
  raise ValueError(f"data.source={source!r} is not one of {text_data.SOURCES + FILE_SOURCES} (or '': inferred).")
