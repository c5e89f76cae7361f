"""The user's own corpus (file_data.py): JSONL and token files, their packing, cache and errors."""

import json
import logging
import pathlib

import jax
import numpy as np
import pytest

from hyscale_jax import parallel
from hyscale_jax.training import file_data, text_data

try:
  from tests.lm_runs import write_jsonl_corpus
except ImportError:  # tests/ itself is on sys.path
  from lm_runs import write_jsonl_corpus

KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(folder, documents, tokenizer path): 40 pydoc topics as JSONL, and a 300-token BPE trained on them."""
  folder = tmp_path_factory.mktemp("corpus")
  # A blank line and an empty text at the end: skipped and counted.
  docs = write_jsonl_corpus(folder, extra_lines=["", json.dumps({"text": ""})])
  return folder, docs, folder / "tokenizer.json"


def _jsonl(folder, tokenizer, **kw):
  args = dict(source="jsonl", path=folder / "corpus.jsonl", tokenizer=tokenizer, vocab_size=VOCAB, seq_len=48,
              batch_size=6, seed=3)
  return file_data.FileTextDataset(**(args | kw))


def _oracle(documents, seq_len, eos_id):
  """Every packed row of the train split, from the documents in memory (`pack_documents`)."""
  train = [documents[d] for d in text_data.split_documents(len(documents), "train")]
  return text_data.pack_documents(train, seq_len, eos_id)


def _assert_rows(got, want):
  for k in KEYS:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_jsonl_packs_like_the_documents_in_memory_and_reads_any_rows(corpus, caplog):
  folder, docs, tokenizer_path = corpus
  with caplog.at_level(logging.INFO, logger="hyscale_jax.training.file_data"):
    ds = _jsonl(folder, tokenizer_path)
  # The two skipped lines are counted in a warning, with the document count.
  assert "40 documents" in caplog.text and "skipped 2 lines (1 blank line, 1 empty text)" in caplog.text
  tokenizer, eos_id, _ = file_data.load_tokenizer(tokenizer_path)
  assert eos_id == tokenizer.token_to_id(text_data.EOS_TOKEN) == ds.eos_id
  assert isinstance(ds.tokens, np.memmap)  # memory-mapped, not read into RAM
  encoded = [np.array(e.ids) for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
  want = _oracle(encoded, 48, eos_id)
  assert ds.num_rows == len(want["tokens"])
  _assert_rows(ds._read_rows(np.arange(ds.num_rows)), want)
  # A batch is rows of the seeded epoch permutation; any subset of its rows reads the same values.
  perm = np.random.default_rng((3, 0)).permutation(ds.num_rows)
  _assert_rows(ds.batch(1), {k: v[perm[6:12]] for k, v in want.items()})
  rows = np.array([1, 4, 5])
  _assert_rows(ds.batch(7, rows=rows), {k: v[rows] for k, v in ds.batch(7).items()})
  with pytest.raises(ValueError, match=r"rows=\[6\] must lie in \[0, batch_size=6\)"):
    ds.batch(0, rows=[6])


def test_jsonl_cache_is_reused_and_keyed_by_tokenizer_and_file(corpus, tmp_path, monkeypatch):
  folder, docs, tokenizer_path = corpus
  first = _jsonl(folder, tokenizer_path)
  caches = sorted(folder.glob("corpus.jsonl.tokens-*"))
  assert len(caches) == 1 and sorted(p.name for p in caches[0].iterdir()) == ["meta.json", "offsets.npy", "tokens.bin"]

  def fail(*args, **kwargs):
    raise AssertionError("a complete cache must not be tokenized again")

  with monkeypatch.context() as m:
    m.setattr(file_data, "_tokenize_into", fail)
    _assert_rows(_jsonl(folder, tokenizer_path).batch(2), first.batch(2))
  # Another tokenizer (an HF checkpoint folder whose tokenizer_config.json names the EOS), another cache.
  hf = tmp_path / "checkpoint"
  hf.mkdir()
  other = text_data.train_tokenizer(docs[:10], 280)
  (hf / "tokenizer.json").write_text(other.to_str())
  (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": text_data.EOS_TOKEN}}))
  second = _jsonl(folder, hf)
  assert len(sorted(folder.glob("corpus.jsonl.tokens-*"))) == 2
  assert not np.array_equal(second.batch(0)["tokens"], first.batch(0)["tokens"])
  assert not list(folder.glob(".*.tmp"))  # no staging folder is left behind


def test_token_files_npy_and_flat_binary_match_the_documents(tmp_path):
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, VOCAB - 1, size=n) for n in rng.integers(0, 90, size=30)]
  flat = np.concatenate(docs)
  offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
  np.save(tmp_path / "corpus.npy", flat.astype(np.int32))
  np.save(tmp_path / "corpus.offsets.npy", offsets)
  flat.astype(np.uint16).tofile(tmp_path / "flat.bin")
  np.save(tmp_path / "bounds.npy", offsets)
  want = _oracle(docs, 32, VOCAB - 1)
  common = dict(source="tokens", vocab_size=VOCAB, seq_len=32, batch_size=4, eos_id=VOCAB - 1)
  for ds in (file_data.FileTextDataset(path=tmp_path / "corpus.npy", **common),
             file_data.FileTextDataset(path=tmp_path / "flat.bin", offsets=tmp_path / "bounds.npy", **common)):
    assert isinstance(ds.tokens, np.memmap)
    _assert_rows(ds._read_rows(np.arange(ds.num_rows)), want)
  val = file_data.FileTextDataset(path=tmp_path / "corpus.npy", split="validation", **common)
  held_out = [docs[d] for d in text_data.split_documents(len(docs), "validation")]
  _assert_rows(val._read_rows(np.arange(val.num_rows)), text_data.pack_documents(held_out, 32, VOCAB - 1))


def _write(path: pathlib.Path, data: bytes) -> pathlib.Path:
  path.write_bytes(data)
  return path


_BAD_JSONL = {
    "empty": (b"", r"corpus.jsonl is empty: no documents"),
    "non_utf8": (b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n', r"corpus.jsonl:3: not UTF-8"),
    "not_json": (b'{"text": "a"}\n{"text": oops}\n', r"corpus.jsonl:2: not a JSON object"),
    "no_text": (b'{"text": "a"}\n{"body": "b"}\n', r"corpus.jsonl:2: needs a string field 'text' \(data.text_field\); got NoneType"),
    "only_blank": (b'\n{"text": ""}\n', r"no documents \(1 blank lines, 1 empty 'text' fields\)"),
}


@pytest.mark.parametrize("case", sorted(_BAD_JSONL))
def test_bad_jsonl_names_file_and_line(corpus, tmp_path, case):
  data, message = _BAD_JSONL[case]
  path = _write(tmp_path / "corpus.jsonl", data)
  with pytest.raises(ValueError, match=message):
    file_data.FileTextDataset(source="jsonl", path=path, tokenizer=corpus[2], vocab_size=VOCAB, seq_len=8, batch_size=1)
  assert not list(tmp_path.glob("*.tokens-*")) and not list(tmp_path.glob(".*.tmp"))


def test_bad_token_files_name_file_and_position(tmp_path):
  common = dict(source="tokens", vocab_size=VOCAB, seq_len=8, batch_size=1, eos_id=0)
  np.save(tmp_path / "c.offsets.npy", np.array([0, 3, 5]))
  np.save(tmp_path / "c.npy", np.array([1, 2, 3, 4, VOCAB], dtype=np.int32))
  with pytest.raises(ValueError, match=rf"c.npy: token 4 \(document 1, token 1 of it\) is {VOCAB}, outside the "
                                       rf"vocabulary \[0, {VOCAB}\)"):
    file_data.FileTextDataset(path=tmp_path / "c.npy", **common)
  _write(tmp_path / "c.bin", b"")
  with pytest.raises(ValueError, match=r"c.bin is empty: no tokens"):
    file_data.FileTextDataset(path=tmp_path / "c.bin", **common)
  _write(tmp_path / "c.bin", b"\x01\x00\x02")
  with pytest.raises(ValueError, match=r"c.bin has 3 bytes, not a whole number of uint16 tokens"):
    file_data.FileTextDataset(path=tmp_path / "c.bin", **common)
  _write(tmp_path / "c.bin", np.arange(1, 5, dtype=np.uint16).tobytes())  # 4 tokens, offsets end at 5
  with pytest.raises(ValueError, match=r"c.offsets.npy: offsets must be a non-decreasing integer array from 0 to the 4"):
    file_data.FileTextDataset(path=tmp_path / "c.bin", **common)
  with pytest.raises(ValueError, match=r"data.offsets='.*missing.npy': no offsets file"):
    file_data.FileTextDataset(path=tmp_path / "c.bin", offsets=tmp_path / "missing.npy", **common)
  with pytest.raises(ValueError, match=r"data.eos_id=-1 must lie in \[0, model.vocab_size=512\)"):
    np.save(tmp_path / "c.npy", np.array([1, 2, 3, 4, 5], dtype=np.int32))
    file_data.FileTextDataset(path=tmp_path / "c.npy", **(common | {"eos_id": -1}))


def test_tokenizer_without_eos_and_oversized_vocabulary_are_refused(corpus, tmp_path):
  folder, _, tokenizer_path = corpus
  with pytest.raises(ValueError, match=r"data.eos_token='<nope>': none of \['<nope>'\] is a token of"):
    file_data.load_tokenizer(tokenizer_path, "<nope>")
  with pytest.raises(ValueError, match=r"data.tokenizer has 300 tokens > model.vocab_size=299"):
    _jsonl(folder, tokenizer_path, vocab_size=299)
  with pytest.raises(ValueError, match=r"no tokenizer file at .*tokenizer.json"):
    _jsonl(folder, tmp_path)


def test_process_rows_and_global_batch_from_rows():
  mesh = parallel.make_mesh({"data": 2, "context": -1})
  rows = parallel.process_rows(mesh, 4)
  np.testing.assert_array_equal(rows, np.arange(4))  # one process holds every row
  batch = {"tokens": np.arange(4 * 8, dtype=np.int32).reshape(4, 8)}
  out = parallel.global_batch(mesh, {"tokens": batch["tokens"][[0, 1, 2, 3]]}, rows=rows, batch_size=4)
  np.testing.assert_array_equal(jax.device_get(out["tokens"]), batch["tokens"])
  with pytest.raises(ValueError, match=r"rows=\[0, 1\] miss rows \[2, 3\]"):
    parallel.global_batch(mesh, {"tokens": batch["tokens"][:2]}, rows=[0, 1], batch_size=4)


def _first_fit_by_scan(lengths, seq_len):
  """(row, column) of every piece, by a linear scan of the rows oldest first (the obvious first fit)."""
  fill, placed = [], []
  for n in lengths:
    for s in range(0, n + 1, seq_len):
      size = min(seq_len, n + 1 - s)
      row = next((r for r in range(len(fill)) if size < seq_len and fill[r] + size <= seq_len), None)
      if row is None:
        row = len(fill)
        fill.append(0)
      placed.append((row, fill[row]))
      fill[row] += size
  return sorted(placed)


@pytest.mark.parametrize("seed", range(4))
def test_pack_plan_is_first_fit(seed):
  rng = np.random.default_rng(seed)
  seq_len = int(rng.integers(1, 20))
  # Adversarial mixes: empty documents (EOS only), exact multiples of seq_len, and long ones.
  lengths = rng.choice([0, seq_len - 1, seq_len, 2 * seq_len, int(rng.integers(0, 5 * seq_len))], size=60)
  plan = text_data.pack_plan(lengths, seq_len)
  rows = np.repeat(np.arange(len(plan["row_starts"]) - 1), np.diff(plan["row_starts"]))
  assert sorted(zip(rows.tolist(), plan["column"].tolist())) == _first_fit_by_scan(lengths.tolist(), seq_len)
  assert plan["length"].sum() == lengths.sum() + len(lengths)  # every token and one EOS per document


@pytest.mark.slow
def test_fine_tune_an_imported_checkpoint_on_own_jsonl(tmp_path, corpus, caplog):
  # The README's command: init_from and data.tokenizer both name the Hugging Face folder, whose
  # tokenizer_config.json names the EOS token.
  from flax import nnx  # noqa: PLC0415

  from configs import glm5_1  # noqa: PLC0415
  from hyscale_jax import convert, models  # noqa: PLC0415
  from hyscale_jax.model_config import ModelConfig  # noqa: PLC0415
  from hyscale_jax.training import lm  # noqa: PLC0415

  folder, _, tokenizer_path = corpus
  config = glm5_1.get_config("tiny")
  config.model.update(d_model=32, n_layers=2, first_k_dense=1, dense_inter=32, n_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16, n_routed_experts=4,
                      experts_per_token=2, moe_inter=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8,
                      index_topk=8, vocab_size=320)
  hf = tmp_path / "hf"
  convert.export_checkpoint(models.build(ModelConfig.from_config(config.model), rngs=nnx.Rngs(1)), str(hf))
  (hf / "tokenizer.json").write_text(tokenizer_path.read_text())
  (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": text_data.EOS_TOKEN}))
  config.init_from = str(hf)
  config.data.update(source="jsonl", path=str(folder / "corpus.jsonl"), tokenizer=str(hf), seq_len=32, batch_size=2)
  config.train.update(steps=2, warmup_steps=1, log_every=1, checkpoint_every=2, progress_bar=False)
  rows = lm.train_and_evaluate(config, str(tmp_path / "run"))
  assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["lm_loss"]) for r in rows)
  # The imported model starts near the uniform loss over its 320 tokens (random init, small weights).
  assert abs(rows[0]["lm_loss"] - np.log(320)) < 1.0
  # Resuming on another corpus is allowed (fine-tuning in stages) but said: its batches differ.
  (tmp_path / "other.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} " * 20}) for i in range(30)))
  config.data.path = str(tmp_path / "other.jsonl")
  config.train.steps = 3
  with caplog.at_level(logging.WARNING):
    assert [r["step"] for r in lm.train_and_evaluate(config, str(tmp_path / "run"))] == [3]
  assert "checkpoint step 2 was trained on jsonl corpus.jsonl (40 documents" in caplog.text
  assert "this run reads jsonl other.jsonl (30 documents" in caplog.text


def test_tokenization_prints_progress_and_fingerprints_name_the_corpus(corpus, tmp_path, monkeypatch, capsys):
  """Tokenizing tells the user how far it is (plain lines at the default verbosity, no terminal here)."""
  folder, _, tokenizer_path = corpus
  (tmp_path / "corpus.jsonl").write_text((folder / "corpus.jsonl").read_text())
  monkeypatch.setattr(file_data, "_ENCODE_BATCH", 8)
  monkeypatch.setattr(file_data, "_PROGRESS_EVERY_S", 0.0)
  ds = _jsonl(tmp_path, tokenizer_path)
  progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing corpus.jsonl: ")]
  percents = [int(m.split(": ")[1].split("%")[0]) for m in progress]
  assert len(progress) == 5 and percents == sorted(percents) and "(40 documents" in progress[-1], progress
  assert ds.fingerprint == f"jsonl corpus.jsonl (40 documents, {len(ds.tokens)} tokens, {ds.num_rows} rows of 48)"


def test_processes_of_a_host_take_turns_to_tokenize(corpus, tmp_path, caplog):
  import fcntl  # noqa: PLC0415
  import threading  # noqa: PLC0415

  folder, _, tokenizer_path = corpus
  path = tmp_path / "corpus.jsonl"
  path.write_text((folder / "corpus.jsonl").read_text())
  tokenizer, eos_id, digest = file_data.load_tokenizer(tokenizer_path)
  tokenize = lambda: file_data.tokenize_jsonl(path, tokenizer, tokenizer_hash=digest, eos_id=eos_id)  # noqa: E731
  done = []
  with caplog.at_level(logging.INFO, logger="hyscale_jax.training.file_data"), open(path, "rb") as other:
    fcntl.flock(other, fcntl.LOCK_EX)  # another process is tokenizing
    waiter = threading.Thread(target=lambda: done.append(tokenize()))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not done and not list(tmp_path.glob("corpus.jsonl.tokens-*"))
    fcntl.flock(other, fcntl.LOCK_UN)
    waiter.join(timeout=60)
  assert "waiting for another process tokenizing" in caplog.text
  assert done and (done[0] / "meta.json").is_file() and tokenize() == done[0]
