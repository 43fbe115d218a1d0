"""The gold choice's log-probability of multiple-choice samples (kvcal.report.choices), and engine vs emulation
tested on it: a 0/1 `acc` per question cannot tell a faithful engine from a damaging one at GPQA's 198 questions,
the continuous score `acc` thresholds can."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

from kvcal.report.choices import GOLD_LOGPROB, gold_index, gold_logprob
from kvcal.report.compare import compare_runs
from kvcal.report.conformance import EQUIVALENT, NOT_EQUIVALENT, add_conformance, before_pairing


def _rec(lls: list, target: object, **extra: object) -> dict:
    return {"doc_id": 0, "metrics": ["acc", "acc_norm"], "acc": 1.0, "acc_norm": 1.0, "target": target,
            "filtered_resps": [[x, False] for x in lls], **extra}  # fmt: skip


def test_the_gold_index_from_what_the_record_holds() -> None:
    assert gold_index(_rec([0, 0, 0], 2), 3) == 2  # lm-eval's doc_to_target as an index
    assert gold_index(_rec([0, 0, 0], "1"), 3) == 1
    assert gold_index(_rec([0, 0, 0], 3), 3) is None and gold_index(_rec([0, 0], True), 2) is None
    args = {"gen_args_0": {"arg_0": "q", "arg_1": " mat"}, "gen_args_1": {"arg_0": "q", "arg_1": " dog"}}
    assert gold_index(_rec([0, 0], " dog", arguments=args), 2) == 1  # the choice whose continuation is the target
    assert gold_index(_rec([0, 0], "(B)", arguments=args), 2) is None  # arguments that do not hold it: no guess
    assert gold_index(_rec([0, 0, 0, 0], "(C)"), 4) == 2  # GPQA's lettered target, kvcal's private record
    assert gold_index(_rec([0, 0], "(C)"), 2) is None
    assert gold_index(_rec([0, 0], "paris"), 2) is None


def test_gold_logprob_values() -> None:
    lls = [-5.038, -6.937, -7.161, -5.634]
    assert gold_logprob(_rec(lls, "(A)")) == pytest.approx(lls[0] - logsumexp(lls), rel=1e-12)
    as_strings = _rec([str(x) for x in lls], "(A)")  # lm-eval's vllm output writes them as strings
    as_strings["filtered_resps"] = [[str(x), "False"] for x in lls]
    assert gold_logprob(as_strings) == gold_logprob(_rec(lls, "(A)"))
    assert math.isnan(gold_logprob(_rec([-1.0, float("nan")], 0)))  # flagged as non-finite, not dropped
    assert gold_logprob({**_rec(lls, 0), "metrics": ["exact_match"]}) is None  # not a multiple-choice record
    assert gold_logprob(_rec([-1.0], 0)) is None  # one choice: a loglikelihood task


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-60, 0), min_size=2, max_size=8), st.floats(-30, 30), st.data())
def test_gold_logprob_is_a_log_probability_over_the_choices(lls: list[float], shift: float, data) -> None:  # noqa: ANN001
    g = data.draw(st.integers(0, len(lls) - 1))
    v = gold_logprob(_rec(lls, g))
    assert v <= 1e-12
    assert gold_logprob(_rec([x + shift for x in lls], g)) == pytest.approx(v, abs=1e-9)  # only differences count
    total = sum(math.exp(gold_logprob(_rec(lls, i))) for i in range(len(lls)))
    assert total == pytest.approx(1.0, rel=1e-9)


N = 198  # GPQA Diamond


def _mc_records(gold_ll: np.ndarray, other_ll: np.ndarray) -> list[dict]:
    """4 choices: the gold one (index 0) and three others at `other_ll`; acc = gold is the largest."""
    out = []
    for i, (g, o) in enumerate(zip(gold_ll, other_ll, strict=True)):
        lls = [float(g), float(o), float(o) - 0.7, float(o) - 1.1]
        acc = float(g >= max(lls))
        out.append({"doc_id": i, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": acc, "acc_norm": acc,
                    "target": 0, "doc_hash": f"h{i}", "filtered_resps": [[x, False] for x in lls]})  # fmt: skip
    return out


def test_engine_vs_emulation_on_a_multiple_choice_task_tests_gold_logprob(tmp_path: Path, write_run) -> None:  # noqa: ANN001
    rng = np.random.default_rng(5)
    base = rng.normal(-6.0, 0.8, N)
    other = rng.normal(-5.8, 0.8, N)
    drop = 0.03 + rng.normal(0, 0.03, N)  # the emulation's FP8 damage to the gold choice, nats
    r = rng.normal(0, 0.08, N)  # the engine's BF16 minus kvcal's
    runs = {
        "emu_bf16": base, "emu_fp8": base - drop, "eng_bf16": base + r,
        "eng_fp8": base + r - drop - rng.normal(0, 0.03, N),  # faithful, with an implementation's scatter
        "eng_bad": base + r - 6 * drop,  # six times the damage
    }  # fmt: skip
    mc = {"gpqa_diamond_zeroshot": {"output_type": "multiple_choice"}}
    for name, gold in runs.items():
        fmt = "bf16" if name.endswith("bf16") else "fp8_e4m3"
        write_run(tmp_path, name, fmt, {"gpqa_diamond_zeroshot": _mc_records(gold, other)},
                  granularity=None if fmt == "bf16" else "tensor", dtype="bfloat16", task_configs=mc)  # fmt: skip
    pairs, refs = ["eng_fp8=emu_fp8", "eng_bad=emu_fp8"], ["eng_bf16=emu_bf16"]
    c = compare_runs([tmp_path], baseline="emu_bf16", n_boot=200, before_pairing=before_pairing(pairs, refs))
    add_conformance(c, pairs, references=refs)
    good, bad = c.conformance
    (g,), (b,) = good.results, bad.results
    assert g.metric == GOLD_LOGPROB and g.unit == "nats (gold choice)"  # acc is not what is tested
    lp = {k: v - logsumexp(np.stack([v, other, other - 0.7, other - 1.1]), axis=0) for k, v in runs.items()}
    want = np.mean((lp["eng_bf16"] - lp["eng_fp8"]) - (lp["emu_bf16"] - lp["emu_fp8"]))
    assert g.gap == pytest.approx(want, rel=1e-9)  # damage: positive is worse (gold_logprob: higher is better)
    assert g.verdict == EQUIVALENT and good.conforms is True
    assert b.verdict == NOT_EQUIVALENT and bad.conforms is False
    assert f"gpqa_diamond_zeroshot/{GOLD_LOGPROB}" not in good.agreement  # continuous values never tie
