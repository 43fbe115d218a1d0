"""Repair of SentencePiece tokenizers converted from GGUF.

transformers 5.17 turns a GGUF `llama`-type (SentencePiece) vocabulary into a Unigram model. For vocabularies
whose scores are merge priorities rather than log-probabilities — Gemma 3's GGUF stores score = -token_id — the
Unigram lattice then splits text into single characters ('The' -> 'T','h','e'), and no BOS is added: every
perplexity, KL and calibration number on such a model would be measured on garbage token streams.

llama.cpp tokenizes these vocabularies by repeatedly merging the adjacent pair whose merged piece has the
highest score. That is BPE with merges ranked by the merged piece's score, which is what this module builds
(the same extraction transformers uses for SentencePiece BPE models), keeping byte fallback, the normalizer
and the decoder of the converted tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcal.io import atomic_write_text


def _merges_from_scores(vocab_scores: list[list[Any]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab = {str(piece): i for i, (piece, _score) in enumerate(vocab_scores)}
    scores = [float(score) for _piece, score in vocab_scores]
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                ranked.append((-scores[pid], pid, lid, rid, left, right))
    ranked.sort()  # highest-scoring merged piece first; ties by ids, deterministic
    return vocab, [(m[4], m[5]) for m in ranked]


def needs_repair(tokenizer_json: dict[str, Any]) -> bool:
    """A Unigram model whose scores are not log-probabilities (some are far below any plausible log-prob)."""
    model = tokenizer_json.get("model", {})
    if model.get("type") != "Unigram":
        return False
    scores = [float(s) for _p, s in model.get("vocab", [])]
    return bool(scores) and min(scores) < -1000.0


def repair_tokenizer_json(path: str | Path, bos_token: str | None) -> bool:
    """Rewrite `path` (a tokenizer.json converted from GGUF) as score-ranked BPE; returns whether it changed."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not needs_repair(data):
        return False
    vocab, merges = _merges_from_scores(data["model"]["vocab"])
    unk_id = data["model"].get("unk_id")
    unk = data["model"]["vocab"][unk_id][0] if isinstance(unk_id, int) else None
    data["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": bool(data["model"].get("byte_fallback", True)),
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [[a, b] for a, b in merges],
    }
    if bos_token is not None and bos_token in vocab:
        # SentencePiece models of this kind (Gemma, Llama 2) prepend BOS to every sequence.
        bos_id = vocab[bos_token]
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos_token, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}},
        }
    atomic_write_text(path, json.dumps(data, ensure_ascii=False))
    return True
