"""Output agreement of lm-eval's own generative tasks by token (issue 22, item 1): kvcal runs record each
request's generated token ids (the adapter's GenerationRecorder, cut to the text lm-eval kept), and the
comparison finds the first token where a configuration's output leaves the baseline's: Kaplan-Meier survival,
median tokens to divergence and the hazard, beside answer and text agreement."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcal.report.agreement import first_difference, stopped_difference

CORPUS = [
    "question : what is two plus two ? answer : four",
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
]
DOCS = [{"q": f"what is {w} plus two ?", "a": "four"} for w in "one two three four five six seven eight".split()]
GEN = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}
Invoke = Callable[[list[str]], tuple[int, str, str]]


def test_first_difference_is_one_based_and_censors_a_prefix() -> None:
    assert first_difference([5, 6, 7], [5, 6, 8]) == (3, True)
    assert first_difference([5, 6], [5, 6, 7, 8]) == (2, False)  # one ended first: compared that far
    assert first_difference([1], [2]) == (1, True)


@pytest.mark.slow
def test_kvcal_runs_record_token_ids_and_the_report_finds_the_first_divergence(
    tmp_path: Path, invoke: Invoke, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> None:
    from transformers import AutoTokenizer

    from kvcal.report.compare import compare_runs
    from kvcal.report.markdown import render_markdown

    model = tiny_lm_dir("llama", CORPUS, k_gain=8.0)  # larger K: an FP8 cache changes a random model's outputs
    tasks = tmp_path / "tasks"
    lm_eval_task(tasks, "tiny_gen", "generate_until", DOCS, ["exact_match"], generation_kwargs=GEN)
    for fmt in ("auto", "fp8_e4m3", "int8_per_token_head"):
        rc, _, err = invoke(["eval", str(model), "-f", fmt, "--tasks", "tiny_gen", "--include-path", str(tasks),
                             "--batch-size", "3", "-o", str(tmp_path / fmt)])  # fmt: skip
        assert rc == 0, err
    tok = AutoTokenizer.from_pretrained(model)
    runs = {}
    for fmt in ("auto", "fp8_e4m3", "int8_per_token_head"):
        recs = [json.loads(x) for x in (tmp_path / fmt / "samples_tiny_gen.jsonl").read_text().splitlines()]
        runs[fmt] = {r["doc_id"]: r for r in recs}
        for r in recs:  # the ids are the generation, cut where lm-eval cut its text
            (ids,) = r["gen_token_ids"]
            text = r["resps"][0][0]
            assert len(tok.decode(ids, skip_special_tokens=True)) >= len(text)
            assert not ids or len(tok.decode(ids[:-1], skip_special_tokens=True)) < len(text)
    cmp = compare_runs([tmp_path / f for f in ("auto", "fp8_e4m3", "int8_per_token_head")], baseline="auto", min_samples=2)
    rows = {r["config"]: r for r in cmp.text_agreement_rows}
    assert set(rows) == {"fp8_e4m3", "int8_per_token_head"}
    for fmt, row in rows.items():
        expect = [stopped_difference(runs["auto"][d]["gen_token_ids"][0], runs[fmt][d]["gen_token_ids"][0],
                                     GEN["max_gen_toks"]) for d in sorted(runs["auto"])]  # fmt: skip
        expect = [e for e in expect if e is not None]  # two empty outputs: nothing compared
        assert row["tokens"]["n"] == len(expect)
        assert row["tokens"]["diverged"] == sum(e for _, e in expect)
    assert any(r["tokens"]["diverged"] > 0 for r in rows.values())  # the tiny model's outputs do change
    assert "median tokens to divergence" in render_markdown(cmp)
