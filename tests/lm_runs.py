"""A short two-stage `train.py`-equivalent run with resume, shared by the model tests."""

import dataclasses
import json

import numpy as np

from hyscale_jax.training import lm


def small_lm_config(get_config, small_model, tmp_path, steps, **model_overrides):
  """The config's `tiny` variant shrunk to `small_model`'s sizes on 64-token pydoc text."""
  config = get_config("tiny")
  model = {k: v for k, v in dataclasses.asdict(small_model).items() if k in config.model}
  model = {k: list(v) if isinstance(v, tuple) else v for k, v in model.items()}
  config.model.update(model, vocab_size=512, **model_overrides)
  config.data.update(source="pydoc", vocab_size=512, seq_len=64, batch_size=2, cache_dir=str(tmp_path / "data"))
  config.train.update(steps=steps, warmup_steps=2, log_every=2, checkpoint_every=3, progress_bar=False)
  return config


def assert_trains_both_stages_and_resumes(make_config, workdir):
  """6 steps (2 dense warm-up, then sparse), then a resume to 8: metrics, stages and step order."""
  read = lambda: [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  lm.train_and_evaluate(make_config(6), str(workdir))
  rows = read()
  assert [r["stage"] for r in rows] == [lm.DENSE_STAGE, lm.SPARSE_STAGE, lm.SPARSE_STAGE]
  assert all(np.isfinite(r["lm_loss"]) and r["indexer_loss"] > 0 for r in rows)
  assert rows[0]["lr"] == 0.0 and rows[0]["indexer_lr"] > 0  # warm-up: only the indexer learns
  lm.train_and_evaluate(make_config(8), str(workdir))  # resumes from step 6
  assert [r["step"] for r in read()] == [2, 4, 6, 8]


def write_jsonl_corpus(folder, *, n_docs=40, vocab_size=300, extra_lines=()):
  """`folder/corpus.jsonl` (pydoc topics, one {"text": ...} per line, then `extra_lines`) and
  `folder/tokenizer.json` (a byte-level BPE of `vocab_size` trained on them); returns the documents."""
  from hyscale_jax.training import text_data  # noqa: PLC0415

  docs = text_data.pydoc_documents()[:n_docs]
  (folder / "tokenizer.json").write_text(text_data.train_tokenizer(docs, vocab_size).to_str())
  lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)] + list(extra_lines)
  (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")
  return docs
