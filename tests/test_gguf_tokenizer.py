"""The GGUF SentencePiece repair: score-ranked BPE instead of a character-splitting Unigram lattice."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from kvcal.gguf_tokenizer import needs_repair, repair_tokenizer_json


def _unigram_json(pieces: list[str]) -> dict:
    # Scores as Gemma 3's GGUF stores them: -token_id (merge priority, not log-probabilities).
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 1,
                "content": "<bos>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "Unigram",
            "unk_id": 0,
            "byte_fallback": False,
            "vocab": [[p, -float(i) * 1000] for i, p in enumerate(pieces)],
        },
    }


PIECES = [
    "<unk>",
    "<bos>",
    "\u2581the",
    "\u2581cat",
    "he",
    "at",
    "\u2581t",
    "\u2581c",
    "\u2581",
    "t",
    "h",
    "e",
    "c",
    "a",
]


def test_repair_builds_score_ranked_bpe_with_bos(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_unigram_json(PIECES)))
    assert repair_tokenizer_json(path, bos_token="<bos>") is True
    tok = Tokenizer.from_file(str(path))
    enc = tok.encode(" the cat")
    assert enc.tokens == ["<bos>", "\u2581the", "\u2581cat"]
    assert enc.ids == [1, 2, 3]
    # A pair is merged only when its merged piece is in the vocabulary, highest score first.
    assert tok.encode(" tea").tokens == ["<bos>", "\u2581t", "e", "a"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == " the cat"
    # Idempotent: a repaired file is BPE and left alone.
    assert repair_tokenizer_json(path, bos_token="<bos>") is False


def test_log_probability_unigram_is_left_alone() -> None:
    data = _unigram_json(PIECES)
    data["model"]["vocab"] = [[p, -1.0 - i * 0.1] for i, p in enumerate(PIECES)]  # real log-probs
    assert needs_repair(data) is False
