"""Continuation-only scoring of lm-eval loglikelihood requests (kvcal.evaluate.scoring through KvcalLM).

On tiny random models through kvcal's quantized cache: choices scored on one shared prefill of their context equal
the same requests scored one window at a time and lm-eval's own every-position path (scoring=full); the head sees
only continuation rows, a bounded block at a time; a model whose head the scorer cannot reproduce is refused.
Against `lm_eval --model hf` itself (simple_evaluate, per sample): tests/evaluate/test_eval.py (tiny models) and
the SmolLM2 test here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "paris is the capital of france and rome is the capital of italy",
    "one two three four five six seven eight nine ten",
]
# (context, choices): continuations of one and several tokens, of different lengths within a question
QUESTIONS = [
    ("the cat sat on the mat and the dog sat on the", [" log", " mat and the dog", " capital of italy"]),
    ("paris is the capital of", [" france", " italy and rome", " one two"]),
    ("one two three four five six seven", [" eight nine ten", " eight", " cat sat on the mat"]),
]
LL_RTOL = (
    2.0**-16
)  # float32 rounding of the same rows in forwards of other shapes (tests/evaluate/conftest.py)


def _requests(lm: Any) -> list[tuple[Any, list[int], list[int]]]:
    """HFLM's (key, context tokens, continuation tokens) requests of QUESTIONS, as lm-eval encodes them."""
    reqs = []
    for ctx, choices in QUESTIONS:
        for cont in choices:
            c, k = lm._encode_pair(ctx, cont)
            reqs.append(((ctx, cont), c, k))
    return reqs


def _close(a: list[tuple[float, bool]], b: list[tuple[float, bool]]) -> None:
    assert len(a) == len(b) == sum(len(c) for _, c in QUESTIONS)
    for (x, gx), (y, gy) in zip(a, b, strict=True):
        assert abs(x - y) <= LL_RTOL * (1.0 + abs(x)), (x, y)
        assert gx == gy


@contextmanager
def _counting_tokens(model: Any) -> Iterator[list[int]]:
    """Tokens run through `model` per forward call, while active."""
    seen: list[int] = []
    h = model.register_forward_pre_hook(
        lambda _m, args, kw: seen.append(int((args[0] if args else kw["input_ids"]).numel())),
        with_kwargs=True,
    )
    try:
        yield seen
    finally:
        h.remove()


@pytest.fixture(scope="module")
def tiny(tiny_lm_dir: Callable[..., Path]) -> dict[str, Path]:
    return {"llama": tiny_lm_dir("llama", CORPUS), "gemma3": tiny_lm_dir("gemma3", CORPUS)}


def _lm(path: Path, **args: Any) -> Any:
    from kvcal.evaluate.adapter import KvcalLM

    args.setdefault("scoring", "continuation")  # kvcal's default is lm-eval's own path (scoring=full)
    return KvcalLM(pretrained=str(path), dtype="float32", device="cpu", batch_size=2, impl="torch", **args)


@pytest.mark.parametrize(("kind", "fmt"), [("llama", "fp8_e4m3"), ("gemma3", "nvfp4")])
def test_shared_context_equals_separate_and_full_scoring(tiny: dict[str, Path], kind: str, fmt: str) -> None:
    """gemma3: sliding layers of window 6, shorter than the shared contexts (the repeated cache keeps the window)."""
    lm = _lm(tiny[kind], kv_format=fmt)
    reqs = _requests(lm)
    with _counting_tokens(lm.model) as shared_tokens:
        shared = lm._loglikelihood_tokens(reqs)
    lm._prefix_shareable = lambda: False  # every window alone, as lm-eval runs them (one forward each)
    with _counting_tokens(lm.model) as alone_tokens:
        alone = lm._loglikelihood_tokens(reqs)
    lm.scoring = "full"
    full = lm._loglikelihood_tokens(reqs)
    _close(shared, alone)
    _close(shared, full)
    # the contexts were prefilled once per question, not once per choice: per question one prefill and one batch
    # of every choice's rest
    assert len(shared_tokens) == 2 * len(QUESTIONS)
    assert sum(shared_tokens) < sum(alone_tokens)
    assert all(ll < 0 for ll, _ in shared)


@pytest.mark.parametrize(("kind", "fmt"), [("llama", "fp8_e4m3"), ("gemma3", "nvfp4")])
def test_long_sequences_prefill_chunk_by_chunk(tiny: dict[str, Path], kind: str, fmt: str) -> None:
    """A shared prefix or a lone window longer than prefill_chunk runs as forwards of at most that many tokens on
    one cache (each chunk attending to the quantized K/V of the earlier ones), with the same log-likelihoods as one
    forward. gemma3: chunks of 4 against sliding windows of 6."""
    whole = _lm(tiny[kind], kv_format=fmt)
    reqs = _requests(whole)
    ref = whole._loglikelihood_tokens(reqs)
    chunked = _lm(tiny[kind], kv_format=fmt, prefill_chunk="4")  # lm-eval's model_args hand strings
    for shareable in (True, False):
        chunked._prefix_shareable = lambda s=shareable: s
        shapes: list[tuple[int, int]] = []
        h = chunked.model.register_forward_pre_hook(
            lambda _m, args, kw, seen=shapes: seen.append(
                tuple((args[0] if args else kw["input_ids"]).shape)
            ),
            with_kwargs=True,
        )
        try:  # one window per batch where nothing is shared: each alone is chunked
            got = chunked._loglikelihood_tokens(reqs, override_bs=None if shareable else 1)
        finally:
            h.remove()
        _close(ref, got)
        assert all(t <= 4 for b, t in shapes if b == 1), shapes
        windows = len(QUESTIONS) if shareable else len(reqs)
        assert len([1 for b, _ in shapes if b == 1]) > windows  # some sequence took several chunks


@pytest.mark.parametrize(("kind", "fmt"), [("llama", "fp8_e4m3"), ("gemma3", "nvfp4")])
def test_whole_windows_run_lm_evals_forwards(tiny: dict[str, Path], kind: str, fmt: str) -> None:
    """scoring=continuation-whole: the forwards of lm-eval's own path (every request's whole window, its batches:
    the same input shapes, no shared prefix, no chunking even past prefill_chunk), so the quantized cache holds the
    same codes; only the head meets fewer rows. gemma3: sliding windows of 6."""
    lm = _lm(tiny[kind], kv_format=fmt, scoring="continuation-whole", prefill_chunk="4")
    reqs = _requests(lm)
    runs = {}
    for scoring in ("continuation-whole", "full"):
        lm.scoring = scoring
        shapes: list[tuple[int, ...]] = []
        h = lm.model.register_forward_pre_hook(
            lambda _m, args, kw, seen=shapes: seen.append(tuple((args[0] if args else kw["input_ids"]).shape)),
            with_kwargs=True,
        )
        try:
            runs[scoring] = (lm._loglikelihood_tokens(reqs), shapes)
        finally:
            h.remove()
    (whole, whole_shapes), (full, full_shapes) = runs["continuation-whole"], runs["full"]
    _close(whole, full)
    assert whole_shapes == full_shapes
    assert max(t for _, t in whole_shapes) > 4  # windows longer than prefill_chunk ran whole


def test_prefill_chunk_is_checked(tiny: dict[str, Path]) -> None:
    from kvcal.errors import UsageError

    with pytest.raises(UsageError, match="--prefill-chunk"):
        _lm(tiny["llama"], prefill_chunk=0)


def test_head_sees_only_continuation_rows_in_bounded_blocks(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcal.evaluate import scoring

    lm = _lm(tiny["llama"], kv_format="fp8_e4m3")
    reqs = _requests(lm)
    ref = lm._loglikelihood_tokens(reqs)
    vocab = lm.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(scoring, "_HEAD_BUDGET", 2 * vocab)  # two rows of logits per head call
    rows: list[int] = []
    head = lm.model.get_output_embeddings()
    h = head.register_forward_hook(lambda _m, _a, out: rows.append(int(out.shape[:-1].numel())))
    try:
        blocked = lm._loglikelihood_tokens(reqs)
    finally:
        h.remove()
    _close(ref, blocked)
    assert max(rows) <= 2
    # rows that met the head: the continuations' tokens but each first one, which the model's own row of its shared
    # prefix predicts (once per question)
    assert sum(rows) == sum(len(k) - 1 for _, _, k in reqs) + len(QUESTIONS)


def test_dynamic_scales_are_not_shared(tiny: dict[str, Path]) -> None:
    """nvfp4's per-sequence global comes from a sequence's first write: a prefix written alone would fix another
    global than the whole window does, so each window runs alone (the same numbers as lm-eval's path)."""
    lm = _lm(tiny["gemma3"], kv_format="nvfp4", nvfp4_global="per_sequence")
    assert not lm._prefix_shareable()
    assert _lm(tiny["gemma3"], kv_format="nvfp4")._prefix_shareable()
    reqs = _requests(lm)
    ours = lm._loglikelihood_tokens(reqs)
    lm.scoring = "full"
    _close(ours, lm._loglikelihood_tokens(reqs))


def test_a_head_it_cannot_reproduce_is_refused(tiny: dict[str, Path]) -> None:
    lm = _lm(tiny["llama"])
    lm.model.config.final_logit_softcapping = 0.5  # Llama's forward applies none; the scorer would
    with pytest.raises(RuntimeError, match="scoring=full"):
        lm._loglikelihood_tokens(_requests(lm))


def test_unknown_scoring_is_a_usage_error(tiny: dict[str, Path]) -> None:
    from kvcal.errors import UsageError

    with pytest.raises(UsageError, match="model_args scoring= must be one of .*continuation-whole, got 'rows'"):
        _lm(tiny["llama"], scoring="rows")


# ---- SmolLM2 against lm-eval's own HFLM ------------------------------------------------------------------------

MC_DOCS = [
    {"q": "The capital of France is", "choices": [" Paris", " Rome", " a large city in Europe"], "label": 0},
    {"q": "Two plus two equals", "choices": [" four", " five", " twenty-two"], "label": 0},
    {"q": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit", " Kelvin"], "label": 0},
]
ROLL_DOCS = [{"text": " ".join(CORPUS)}]


@pytest.mark.realmodel
def test_smollm2_per_sample_equal_to_lm_eval_hf(
    real_model_path: Callable[[str], str],
    lm_eval_task: Callable[..., None],
    same_loglikelihoods: Callable[..., None],
    tmp_path: Path,
) -> None:
    real_model_path("smollm2")  # skips when the model package is not installed
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import kvcal.evaluate.adapter  # noqa: F401  (registers model "kvcal")
    from kvcal.models.resolve import resolve_model

    lm_eval_task(tmp_path, "smol_mc", "multiple_choice", MC_DOCS, ["acc"])
    lm_eval_task(tmp_path, "smol_roll", "loglikelihood_rolling", ROLL_DOCS, ["word_perplexity"])
    args = f"pretrained={resolve_model('smollm2')},dtype=float32"
    runs = {}
    for name, model, extra in (
        ("hf", "hf", ""),
        ("continuation", "kvcal", ",kv_format=auto,scoring=continuation"),
        ("continuation-whole", "kvcal", ",kv_format=auto,scoring=continuation-whole"),
    ):
        runs[name] = simple_evaluate(
            model=model,
            model_args=args + extra,
            tasks=["smol_mc", "smol_roll"],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            batch_size=2,
            device="cpu",
            log_samples=True,
            bootstrap_iters=0,
        )
    for task in ("smol_mc", "smol_roll"):
        for scoring in ("continuation", "continuation-whole"):
            same_loglikelihoods(runs["hf"]["samples"][task], runs[scoring]["samples"][task])
