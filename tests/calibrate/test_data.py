"""Calibration data: readers, field choice, chat rendering, seeded sampling, token hash, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcal.calibrate.data import build_samples, choose_field, load_texts, token_sha256
from kvcal.calibrate.default_corpus import generate_corpus
from kvcal.errors import KvcalError, UsageError


@pytest.fixture(scope="module")
def tok(tiny_tokenizer: Any) -> Any:
    return tiny_tokenizer


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_readers_agree_and_folder_reads_one_file_per_stem(tmp_path: Path, tok) -> None:  # noqa: ANN001
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"text": f"document number {i} about {w}", "url": f"u{i}"} for i, w in enumerate("abcdefghij")]
    folder = tmp_path / "slice"
    folder.mkdir()
    _write_jsonl(folder / "part.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), folder / "part.parquet")
    (folder / "README.md").write_text("# not data")
    (tmp_path / "rows.json").write_text(json.dumps({"data": rows}))
    (tmp_path / "rows.txt").write_text("\n\n".join(r["text"] for r in rows))
    sources = [
        load_texts(folder / "part.jsonl"),
        load_texts(folder / "part.parquet"),
        load_texts(tmp_path / "rows.json"),
        load_texts(tmp_path / "rows.txt"),
        load_texts(folder),  # same rows twice on disk: read once (jsonl preferred)
    ]
    shas = {build_samples(s, tok, num_samples=10, seq_len=16, seed=3).token_sha256 for s in sources}
    assert len(shas) == 1
    assert "part.jsonl" in sources[-1].description and "parquet" not in sources[-1].description


def test_field_choice_chat_rendering_and_errors(tmp_path: Path, tok) -> None:  # noqa: ANN001
    assert choose_field([{"id": 1, "question": "why?"}], None) == "question"
    assert choose_field([{"content": "x", "text": "y"}], None) == "text"
    with pytest.raises(UsageError, match="fields found: id, label"):
        choose_field([{"id": 1, "label": 0}], None)
    with pytest.raises(UsageError, match="'body' not in the dataset; fields found: id, text"):
        choose_field([{"id": 1, "text": "a"}], "body")
    chats = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "ok"}]}
        for i in range(4)
    ]
    data = build_samples(load_texts(_write_jsonl(tmp_path / "chat.jsonl", chats)), tok, 4, 64, seed=0)
    assert data.text_field == "messages"
    decoded = tok.decode(data.samples[0])
    assert decoded.startswith("<bos><|user|>hi") and "<|assistant|>ok" in decoded
    assert decoded.count("<bos>") == 1  # the template's BOS, not a second one from the tokenizer


def test_seeded_sampling_truncation_and_short_datasets(tmp_path: Path, tok) -> None:  # noqa: ANN001
    src = load_texts(None)
    a = build_samples(src, tok, num_samples=6, seq_len=24, seed=1)
    b = build_samples(src, tok, num_samples=6, seq_len=24, seed=1)
    c = build_samples(src, tok, num_samples=6, seq_len=24, seed=2)
    assert a.token_sha256 == b.token_sha256 != c.token_sha256
    assert all(1 <= s.numel() <= 24 for s in a.samples) and a.num_samples == 6
    assert a.manifest()["token_ids_sha256"] == token_sha256(a.samples)
    rows = [{"text": "one"}, {"text": ""}, {"text": "two three"}]
    few = build_samples(load_texts(_write_jsonl(tmp_path / "few.jsonl", rows)), tok, num_samples=5, seq_len=8)
    assert few.num_samples == 2
    assert few.warnings and "only 2 usable texts" in few.warnings[0] and "instead of 5" in few.warnings[0]
    with pytest.raises(UsageError, match="exceeds the model's maximum of 64"):
        build_samples(src, tok, num_samples=2, seq_len=65, max_len=64)


def test_missing_and_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_texts(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(UsageError, match="unsupported extension"):
        load_texts(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(KvcalError, match="bad.jsonl:2 is not valid JSON"):
        load_texts(tmp_path / "bad.jsonl")
    with pytest.raises(UsageError, match="cannot be loaded from the hub"):
        load_texts("some-org/some-dataset-that-is-not-here")  # HF_DATASETS_OFFLINE=1 in the test session


def test_generated_corpus_is_deterministic_and_varied() -> None:
    a, b = generate_corpus(64, seed=0), generate_corpus(64, seed=0)
    assert a == b and len(set(a)) == 64
    joined = "\n".join(a)
    assert "def " in joined and "The answer is" in joined and "| name |" in joined


def test_tiny_tokenizer_round_trips(tok: Any) -> None:
    """The shared tiny tokenizer (tests/conftest.py) prepends <bos> and decodes back to the text."""
    ids = tok("Hello, kvcal: 12 + 30 = 42.")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, kvcal: 12 + 30 = 42."
