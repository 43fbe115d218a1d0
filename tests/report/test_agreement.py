"""kvcal.report.agreement: Kaplan-Meier, hazard, constant-hazard test, projection, clustered intervals."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from kvcal.evaluate.divergence import first_divergence, logprobs_close
from kvcal.report import agreement


def _product_limit(times: list[int], events: list[bool]) -> dict[int, Fraction]:
    """S(t) at each event time by the product-limit formula, in exact fractions (the test's own reference)."""
    s, out = Fraction(1), {}
    for t in sorted({t for t, e in zip(times, events, strict=True) if e}):
        at_risk = sum(1 for x in times if x >= t)
        d = sum(1 for x, e in zip(times, events, strict=True) if e and x == t)
        s *= Fraction(at_risk - d, at_risk)
        out[t] = s
    return out


def test_kaplan_meier_on_censored_data_is_the_product_limit() -> None:
    # outputs censored at 5 and 10 (one ended first / the cap) stay at risk until then, not "agreeing forever"
    times = [3, 5, 5, 8, 10, 12, 12, 20]
    events = [True, False, True, True, False, True, False, False]
    km = agreement.kaplan_meier(times, events)
    want = _product_limit(times, events)
    assert km["times"] == sorted(want)
    assert km["surv"] == pytest.approx([float(want[t]) for t in sorted(want)], abs=1e-12)
    # median: the first event time where S <= 0.5 (statsmodels' quantile)
    assert km["median"]["value"] == min(t for t, s in want.items() if s <= Fraction(1, 2))
    # and not the naive estimate that drops the censored outputs (or counts them as never diverging)
    naive = 1 - sum(1 for t, e in zip(times, events, strict=True) if e and t <= 8) / len(times)
    assert km["surv"][km["times"].index(8)] != pytest.approx(naive)


def test_censoring_when_one_output_ends_first() -> None:
    assert first_divergence([5, 6, 7, 8], [5, 6, 7]) == (3, False)
    assert first_divergence([5, 6], [5, 6, 7, 8]) == (2, False)
    assert first_divergence([], [1]) == (0, False)
    km = agreement.kaplan_meier([3, 4], [False, False])
    assert km["times"] == [] and km["median"]["value"] is None


def test_identical_outputs_agree_and_never_diverge() -> None:
    a = [11, 12, 13, 14, 15]
    assert first_divergence(a, list(a)) == (5, False)
    assert logprobs_close(a, list(a), [[0]] * 5, [[0]] * 5)
    s = agreement.summarize([5, 5, 5], [False, False, False], at_lengths=(100,))
    assert s["diverged"] == 0 and s["hazard_per_1k"]["value"] == 0.0
    assert s["projection"]["100"]["value"] == 1.0
    assert agreement.proportion(3, 3)["value"] == 1.0


@pytest.mark.parametrize("t", [1, 2, 7, 30])
def test_a_planted_one_token_change_is_found_at_its_position(t: int) -> None:
    base = list(range(100, 140))
    other = list(base)
    other[t - 1] = 999
    assert first_divergence(base, other) == (t, True)
    top_base = [[b, b + 1] for b in base]
    top_other = [[o, o + 1] for o in other]
    # vLLM's rule: at the first difference each side's token must be in the other's top-k
    assert not logprobs_close(base, other, top_base, top_other)
    top_base[t - 1] = [base[t - 1], 999]
    top_other[t - 1] = [999, base[t - 1]]
    assert logprobs_close(base, other, top_base, top_other)
    # later differences are never looked at (the sequences diverge from t on)
    other2 = list(other)
    other2[-1] = 5
    top_other2 = [list(x) for x in top_other]
    assert logprobs_close(base, other2, top_base, top_other2)


def test_hazard_is_events_per_exposure_with_the_exact_poisson_interval() -> None:
    from scipy.stats import chi2

    times, events = [100, 200, 50, 400], [True, False, True, True]
    hz = agreement.hazard(times, events)
    assert hz["value"] == pytest.approx(3 / 750 * 1000)
    # Garwood's exact interval from the chi-square quantiles
    assert hz["lo"] == pytest.approx(chi2.ppf(0.025, 6) / 2 / 750 * 1000)
    assert hz["hi"] == pytest.approx(chi2.ppf(0.975, 8) / 2 / 750 * 1000)
    proj = agreement.project(hz, [1000])
    assert proj["value"] == pytest.approx(math.exp(-3 / 750 * 1000))
    assert proj["lo"] < proj["value"] < proj["hi"]


def test_constant_hazard_test_rejects_a_hazard_that_grows() -> None:
    rng = np.random.default_rng(0)
    # constant: exponential times, censored at 400
    t = rng.exponential(100, 400)
    times = [int(min(x, 400)) + 1 for x in t]
    events = [bool(x < 400) for x in t]
    assert agreement.constant_hazard_test(times, events)["p_value"] > 0.01
    # growing: nothing diverges before token 200, then it does fast
    times2 = [200 + int(x) + 1 for x in rng.exponential(20, 400)]
    res = agreement.constant_hazard_test(times2, [True] * 400, cut=200)
    assert res["early"]["events"] == 0 and res["p_value"] < 1e-6


def test_repeats_cluster_by_document() -> None:
    # 10 documents x 5 repeats; a document's repeats agree with one another (all 1 or all 0)
    docs = [d for d in range(10) for _ in range(5)]
    flags = [float(d % 3 != 0) for d in docs]
    ours = agreement.cluster_mean_interval(flags, docs)
    naive = agreement.proportion(int(sum(flags)), len(flags))  # as if the 50 pairs were independent
    per_doc = agreement.cluster_mean_interval([float(d % 3 != 0) for d in range(10)], list(range(10)))
    assert ours["value"] == pytest.approx(0.6)
    assert (naive["hi"] - naive["lo"]) < (ours["hi"] - ours["lo"])
    # clustering 5 identical repeats gives the interval of the 10 documents themselves
    assert ours["hi"] - ours["lo"] == pytest.approx(per_doc["hi"] - per_doc["lo"], rel=0.1)


def _gen_records(outputs: list[str], answers: list[str]) -> list[dict]:
    """lm-eval generate_until records: one per (doc, filter), the output text in resps, the answer filtered."""
    return [
        {"doc_id": i, "filter": flt, "metrics": ["exact_match"], "exact_match": float(a == "1"),
         "resps": [[o]], "filtered_resps": [a if flt == "strict-match" else "x"], "doc_hash": f"h{i}"}
        for i, (o, a) in enumerate(zip(outputs, answers, strict=True))
        for flt in ("strict-match", "flexible-extract")
    ]  # fmt: skip


def test_generative_tasks_agree_by_answer_and_text_with_the_baseline_run(write_run, tmp_path) -> None:
    import json

    from kvcal.report.compare import compare_runs
    from kvcal.report.markdown import render_markdown

    n = 12
    base_out = [f"so the answer is {i} #### 1" for i in range(n)]
    base_ans = ["1"] * n
    # doc 0: other text, same answer; doc 1: other text and answer; the rest identical
    q_out = ["the answer is 1 #### 1", "#### 2", *base_out[2:]]
    q_ans = ["1", "2", *base_ans[2:]]
    for name, fmt, out, ans in (("bf16", "bf16", base_out, base_ans), ("fp8", "fp8_e4m3", q_out, q_ans)):
        d = write_run(tmp_path, name, fmt, {"gsm8k": _gen_records(out, ans)})
        res = json.loads((d / "results.json").read_text())
        res["configs"]["gsm8k"] = {"output_type": "generate_until"}
        (d / "results.json").write_text(json.dumps(res))
    cmp = compare_runs([tmp_path / "bf16", tmp_path / "fp8"], min_samples=2)
    (row,) = cmp.text_agreement_rows
    assert row["config"] == "fp8" and row["n"] == n
    assert row["answer_agree"]["value"] == pytest.approx((n - 1) / n)  # the first filter (strict-match) only
    assert row["identical"]["value"] == pytest.approx((n - 2) / n)
    assert row["answer_agree"]["lo"] < row["answer_agree"]["value"] < row["answer_agree"]["hi"]
    assert "## Output agreement with the baseline run (generative tasks)" in render_markdown(cmp)


def test_generative_runs_of_other_generation_settings_are_not_compared(write_run, tmp_path) -> None:
    import json

    import yaml

    from kvcal.errors import UsageError
    from kvcal.report.compare import compare_runs

    for name, fmt in (("bf16", "bf16"), ("fp8", "fp8_e4m3")):
        d = write_run(tmp_path, name, fmt, {"gsm8k": _gen_records(["#### 1"] * 4, ["1"] * 4)})
        res = json.loads((d / "results.json").read_text())
        res["configs"]["gsm8k"] = {"output_type": "generate_until"}
        (d / "results.json").write_text(json.dumps(res))
    cfg = yaml.safe_load((tmp_path / "fp8" / "config.yaml").read_text())
    cfg["max_gen_toks"] = 64
    (tmp_path / "fp8" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(UsageError, match="max_gen_toks=64"):
        compare_runs([tmp_path / "bf16", tmp_path / "fp8"], min_samples=2)
