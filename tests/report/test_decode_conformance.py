"""Generated outputs of runs that kept text only, and the engine's decode beside the emulation's (issue 41, item 3).

An engine's lm-eval folder keeps each output's text, not its token ids: the comparison re-encodes both runs'
texts with the checkpoint's tokenizer (kvcal.report.text_tokens) so tokens to divergence and output length have a
unit. An output that stopped where the other went on diverged at the next token (lm-eval cuts the stop sequence
from the text); the cap ends nothing early. Planted outputs: the emulation's FP8 run leaves its BF16 output at a
known word or stops at once; a faithful engine does the same to its own BF16 outputs, a bad one stops at once on
every prompt."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcal.report import text_tokens
from kvcal.report.agreement import max_gen_toks, stopped_difference
from kvcal.report.compare import compare_runs
from kvcal.report.conformance import add_conformance, before_pairing
from kvcal.report.markdown import render_markdown

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "paris is the capital of france and rome is the capital of italy",
]
WORDS = " ".join(CORPUS).split()
CAP = 64
GEN = {"gsm8k": {"output_type": "generate_until", "generation_kwargs": {"until": ["Question:"], "max_gen_toks": CAP}}}
N = 24


def test_an_output_that_stopped_first_diverged_and_the_cap_censors() -> None:
    assert stopped_difference([5, 6, 7], [5, 6, 8], cap=10) == (3, True)
    assert stopped_difference([5, 6], [5, 6, 7, 8], cap=10) == (3, True)  # [5, 6] stopped where the other went on
    assert stopped_difference([], [4], cap=10) == (1, True)  # stopped at once
    assert stopped_difference([5, 6], [5, 6, 7, 8], cap=2) == (2, False)  # the cap ended it: compared that far
    assert stopped_difference([5, 6], [5, 6], cap=10) == (2, False)  # identical outputs
    assert stopped_difference([], [], cap=10) is None  # nothing compared


def _texts(rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """(BF16 outputs, FP8 outputs): FP8 leaves BF16 at a random word, or stops at once on a quarter of them."""
    base, quant = [], []
    for i in range(N):
        words = [WORDS[(i + j) % len(WORDS)] for j in range(int(rng.integers(6, 14)))]
        base.append(" ".join(words))
        k = int(rng.integers(1, len(words)))
        quant.append("" if i % 4 == 0 else " ".join(words[:k] + ["rome", "rome", "italy"]))
    return base, quant


def _records(texts: list[str], answers: list[str], encode: Callable[[str], list[int]] | None) -> list[dict]:
    out = []
    for i, (t, a) in enumerate(zip(texts, answers, strict=True)):
        rec: dict[str, Any] = {"doc_id": i, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 0.0,
                               "doc_hash": f"h{i}", "target": "1", "filtered_resps": [a], "resps": [[t]]}  # fmt: skip
        if encode is not None:  # a kvcal run: its generated ids (here the text's own, as the recorder cuts them)
            rec["gen_token_ids"] = [encode(t)]
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory, tiny_lm_dir: Callable[..., Path], write_run) -> dict[str, Any]:  # noqa: ANN001
    from transformers import AutoTokenizer

    model = tiny_lm_dir("llama", CORPUS)
    tok = AutoTokenizer.from_pretrained(model)

    def encode(t: str) -> list[int]:
        return tok.encode(t, add_special_tokens=False)

    root = tmp_path_factory.mktemp("decode")
    rng = np.random.default_rng(3)
    emu_b, emu_q = _texts(rng)
    eng_b = [t + " and the dog" if i % 3 == 0 else t for i, t in enumerate(emu_b)]  # its BF16 differs a little
    eng_q = [q if not q else q.replace(b, e, 1) for q, b, e in zip(emu_q, emu_b, eng_b, strict=True)]
    runs = {  # name: (kv format, outputs, kept answers, records token ids)
        "emu_bf16": ("bf16", emu_b, True), "emu_fp8": ("fp8_e4m3", emu_q, True),
        "eng_bf16": ("bf16", eng_b, False), "eng_fp8": ("fp8_e4m3", eng_q, False),
        "eng_bad": ("fp8_e4m3", [""] * N, False),
    }  # fmt: skip
    answers = {n: [t.split()[0] if t else "[invalid]" for t in o] for n, (_, o, _) in runs.items()}  # its first word
    for name, (fmt, outputs, ids) in runs.items():
        recs = _records(outputs, answers[name], encode if ids else None)
        write_run(root, name, fmt, {"gsm8k": recs}, model=str(model), granularity=None if fmt == "bf16" else "tensor",
                  dtype="bfloat16", max_length=8192, task_configs=GEN)  # fmt: skip
    return {"root": root, "encode": encode, "outputs": {n: o for n, (_, o, _) in runs.items()}, "answers": answers}


def _expected(planted: dict[str, Any], base: str, quant: str) -> list[tuple[int, bool]]:
    enc, out = planted["encode"], planted["outputs"]
    got = [stopped_difference(enc(a), enc(b), CAP) for a, b in zip(out[base], out[quant], strict=True)]
    return [g for g in got if g is not None]


def _conformance(planted: dict[str, Any], pairs: list[str]):  # noqa: ANN202
    refs = ["eng_bf16=emu_bf16"]
    c = compare_runs([planted["root"]], baseline="emu_bf16", n_boot=500, before_pairing=before_pairing(pairs, refs))
    add_conformance(c, pairs, references=refs)
    return c


def test_text_only_runs_are_measured_in_text_tokens(planted: dict[str, Any]) -> None:
    c = compare_runs([planted["root"]], baseline="emu_bf16", n_boot=200)
    rows = {r["config"]: r for r in c.text_agreement_rows}
    assert rows["emu_fp8"]["tokens"]["unit"] == text_tokens.GENERATED  # both kvcal runs recorded their ids
    assert rows["eng_fp8"]["tokens"]["unit"] == text_tokens.TEXT  # a run of the pair kept text only
    want = _expected(planted, "emu_bf16", "eng_fp8")
    assert rows["eng_fp8"]["tokens"]["n"] == len(want)
    assert rows["eng_fp8"]["tokens"]["diverged"] == sum(e for _, e in want)
    lengths = {r.config: r for r in c.length_rows}
    enc = planted["encode"]
    assert lengths["eng_fp8"].unit == text_tokens.TEXT and lengths["emu_fp8"].unit == text_tokens.GENERATED
    assert lengths["eng_fp8"].mean == pytest.approx(np.mean([len(enc(t)) for t in planted["outputs"]["eng_fp8"]]))
    md = render_markdown(c)
    assert "(text tokens)" in md


def test_the_engine_decode_beside_the_emulation(planted: dict[str, Any]) -> None:
    c = _conformance(planted, ["eng_fp8=emu_fp8", "eng_bad=emu_fp8"])
    (good,), (bad,) = (x.decode for x in c.conformance)
    assert good.task == "gsm8k" and good.n == N and good.unit == text_tokens.TEXT  # both sides alike
    ans = planted["answers"]
    kept = {n: np.mean([a == b for a, b in zip(ans[f"{n[:3]}_bf16"], ans[n], strict=True)])
            for n in ("eng_fp8", "emu_fp8", "eng_bad")}  # fmt: skip
    assert good.engine.answer_kept["value"] == pytest.approx(kept["eng_fp8"])
    assert good.emulation.answer_kept["value"] == pytest.approx(kept["emu_fp8"])
    assert good.answer_kept_gap["value"] == pytest.approx(kept["eng_fp8"] - kept["emu_fp8"])
    # faithful: the same divergences on both sides (its BF16 outputs differ only after the FP8 ones left them)
    assert good.logrank_p is not None and good.logrank_p > 0.5
    assert good.engine.median_tokens["value"] == good.emulation.median_tokens["value"]
    assert good.length_gap["lo"] <= good.length_gap["value"] <= good.length_gap["hi"]
    # an engine that stops at once everywhere: divergence at token 1 on every prompt, shorter outputs, answers lost
    assert bad.engine.median_tokens["value"] == 1 and bad.logrank_p < 1e-4
    assert bad.length_gap["hi"] < 0 and bad.length_gap["p"] < 0.01
    assert bad.answer_kept_gap["hi"] < 0
    md = render_markdown(c)
    assert "### Engine vs emulation: generated outputs" in md and "| `eng_bad` | `emu_fp8` | gsm8k | 24 |" in md


def test_no_tokenizer_no_token_rows(planted: dict[str, Any], tmp_path: Path, write_run) -> None:  # noqa: ANN001
    """A text-only run whose checkpoint is not on this machine: agreement of answers and text stays, the token
    rows are left out rather than guessed."""
    recs = _records(planted["outputs"]["eng_fp8"], planted["answers"]["eng_fp8"], None)
    base = _records(planted["outputs"]["emu_bf16"], planted["answers"]["emu_bf16"], None)
    write_run(tmp_path, "b", "bf16", {"gsm8k": base}, model="/nowhere/model", task_configs=GEN)
    write_run(tmp_path, "q", "fp8_e4m3", {"gsm8k": recs}, model="/nowhere/model", task_configs=GEN)
    c = compare_runs([tmp_path], baseline="b", n_boot=200)
    (row,) = c.text_agreement_rows
    assert "tokens" not in row and row["answer_agree"]["value"] is not None
    assert not c.length_rows


def test_the_cap_a_run_generated_under(planted: dict[str, Any]) -> None:
    c = compare_runs([planted["root"]], baseline="emu_bf16", n_boot=200)
    run = next(r for cfg in c.configs for r in cfg.runs if cfg.label == "eng_fp8")
    assert max_gen_toks(run, "gsm8k") == CAP
    run.results["configs"]["gsm8k"]["generation_kwargs"].pop("max_gen_toks")
    assert max_gen_toks(run, "gsm8k") == 256  # lm-eval's default
