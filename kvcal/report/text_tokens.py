"""Generated outputs as token ids, also where a run recorded text only.

kvcal runs record each generate_until output's token ids (`gen_token_ids`, one list per repeat); an engine's
lm-eval output folder keeps the text alone. Output agreement (tokens to the first divergence) and output length
need one unit on both sides of a pair, so when either run lacks the ids both runs' texts are re-encoded with one
tokenizer (the run's own checkpoint's, read from disk, no remote code): a pair is measured in generated token ids
or in text tokens, never in a mix.

How close the two units are, measured (`studies/engine-conformance`, SmolLM2's 400 kvcal gsm8k outputs, which
carry both): the re-encoded text equals the generated ids up to the output's last token on every one of them;
only the end differs (the model writes "\\n", "\\n" before the stop sequence, the text re-encodes it as one
"\\n\\n"). A first divergence is found at the same token except at an output's very end.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

GENERATED, TEXT = "generated token ids", "text tokens"

Encode = Callable[[str], list[int]]


def token_ids(rec: dict[str, Any]) -> list[list[int]] | None:
    """The generated ids of each repeat (`gen_token_ids`); None when the record keeps none."""
    ids = rec.get("gen_token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(x, list) for x in ids):
        return None
    return [[int(t) for t in x] for x in ids]


def texts(rec: dict[str, Any]) -> list[str] | None:
    """The output text of each repeat (lm-eval's `resps[0]`); None where the record keeps no text (GPQA's private
    records)."""
    resps = rec.get("resps")
    if isinstance(resps, list) and resps and isinstance(resps[0], list) and resps[0]:
        return [str(t) for t in resps[0]]
    return None


@lru_cache(maxsize=8)
def _encoder(model_dir: str) -> Encode | None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        return None

    @cache  # a baseline's outputs are encoded once for every row and pair they are part of
    def encoded(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    def encode(text: str) -> list[int]:
        return list(encoded(text))

    return encode


def run_encoder(run: Any) -> Encode | None:
    """The tokenizer of the checkpoint the run evaluated (`model_dir`, else a model path that is a folder); None
    when it is not on this machine."""
    for where in (getattr(run, "model_dir", None), getattr(run, "model", None)):
        if where and Path(str(where)).is_dir():
            enc = _encoder(str(Path(str(where)).resolve()))
            if enc is not None:
                return enc
    return None


def paired_outputs(
    runs: tuple[Any, Any],
    recs: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]],
    docs: list[str],
    unit: str | None = None,
) -> tuple[dict[str, tuple[list[list[int]], list[list[int]]]], str] | None:
    """doc -> (the first run's outputs, the second's), every repeat as token ids in one unit, and the unit: the
    generated ids where both runs recorded them for every document, else both texts re-encoded with one
    tokenizer (the second run's, else the first's). `unit=TEXT` re-encodes the texts whatever the runs recorded
    (to measure two pairs alike). None when neither way gives ids (no tokenizer here)."""
    a, b = recs
    ids = {d: (token_ids(a[d]), token_ids(b[d])) for d in docs}
    if unit != TEXT and all(x is not None and y is not None for x, y in ids.values()):
        return {d: (x, y) for d, (x, y) in ids.items() if x is not None and y is not None}, GENERATED
    encode = run_encoder(runs[1]) or run_encoder(runs[0])
    if encode is None:
        return None
    out = {}
    for d in docs:
        ta, tb = texts(a[d]), texts(b[d])
        if ta is not None and tb is not None:
            out[d] = ([encode(t) for t in ta], [encode(t) for t in tb])
    return out, TEXT
