"""Gate statistics a release decision can rest on (issue 13 item 3): each test fails on the statistics kvcal had
before (percentile bootstrap for everything, no minimum sample size, alpha not passed to the intervals, no
multiple-testing correction, relative interval from the resamples whose baseline is not 0)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from kvcal.report import stats
from kvcal.report.compare import compare_runs
from kvcal.report.markdown import render_markdown

Invoke = Callable[[list[str]], tuple[int, str, str]]


def _table(a: int, b: int, c: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (base, other) correctness of a paired 2x2 table: a both right, b only base right, c only
    other right, d both wrong."""
    base = np.array([1] * a + [1] * b + [0] * c + [0] * d, dtype=float)
    other = np.array([1] * a + [0] * b + [1] * c + [0] * d, dtype=float)
    return base, other


def _exact_mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar by hand: 2 P(Binomial(b + c, 1/2) <= min(b, c)), capped at 1."""
    m = b + c
    return 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, k) for k in range(min(b, c) + 1)) / 2**m)


# ---- binary metrics: the interval agrees with McNemar's exact test -----------------------------------------


def test_b5_c0_n200_interval_includes_zero_and_p_above_alpha() -> None:
    """5 discordant pairs, all one way, of 200: p = 2 / 2^5 = 0.0625, not significant; the interval shown must
    include 0 (a percentile bootstrap gives [-0.045, -0.005] here: 'significant')."""
    base, other = _table(100, 5, 0, 95)
    r, b, c = stats.binary_difference(base, other, alpha=0.05)
    assert (b, c) == (5, 0)
    assert r.p_value == pytest.approx(0.0625, rel=1e-12) and r.p_value > 0.05
    assert r.ci_low < 0 <= r.ci_high


def test_newcombe_matches_published_value_and_is_widened_where_mcnemar_does_not_reject() -> None:
    """Cavo et al. 2012 (complete response before/after consolidation: 59, 6, 16, 80), worked in Fagerland,
    Lydersen & Laake, Statistical Analysis of Contingency Tables (2017) ch. 8: Newcombe's square-and-add 95%
    interval for p_before - p_after is -0.1186 to -0.0046. McNemar's exact p is 0.0525: the shown interval of
    after - before reaches 0."""
    lo, hi = stats.newcombe_paired(59, 6, 16, 80)
    assert (round(-hi, 4), round(-lo, 4)) == (-0.1186, -0.0046)
    r, b, c = stats.binary_difference(*_table(59, 6, 16, 80))
    assert (b, c) == (6, 16)
    assert r.p_value == pytest.approx(_exact_mcnemar(6, 16), rel=1e-12) and 0.05 < r.p_value < 0.053
    assert (r.ci_low, round(r.ci_high, 4)) == (0.0, 0.1186)


@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.1])
def test_binary_interval_excludes_zero_exactly_when_mcnemar_rejects(alpha: float) -> None:
    """Over a grid of paired tables (n 20 and 500, up to 20 discordant pairs each way, concordant pairs all
    right or all wrong, where Newcombe and the exact test part most): p < alpha <=> the interval excludes 0."""
    for n in (20, 500):
        for b in range(21):
            for c in range(21):
                for a in (0, n - b - c):
                    r = stats.paired_binary_test(a, b, c, n - a - b - c, alpha)
                    assert r.p_value == pytest.approx(_exact_mcnemar(b, c), rel=1e-9)
                    assert (r.p_value < alpha) == (r.ci_low > 0 or r.ci_high < 0), (n, a, b, c, r)


def test_binary_interval_reverse_case_is_truncated_past_zero() -> None:
    """0 of 8 discordant pairs go the baseline's way among 500 all-wrong pairs: exact p = 2/256 < 0.01, while
    Newcombe's 99% interval starts just below 0 (-0.0001); the shown interval starts just above it."""
    lo, _ = stats.newcombe_paired(0, 0, 8, 492, alpha=0.01)
    assert -1e-3 < lo < 0
    r = stats.paired_binary_test(0, 0, 8, 492, alpha=0.01)
    assert r.p_value == pytest.approx(2 / 256) and 0 < r.ci_low < 1e-300 and r.ci_high > 0.03


# ---- continuous metrics: BCa bootstrap and its dual p-value ------------------------------------------------


def _ppl_data(seed: int, n: int, shift: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    words = rng.integers(50, 150, n).astype(float)
    base = rng.normal(3.0, 0.3, n) * words
    return base, base + rng.normal(shift, 0.1, n) * words, words


def test_bca_interval_matches_scipy_as_peer() -> None:
    """The hand-written paired BCa gives scipy.stats.bootstrap(paired=True, method='BCa')'s interval (to Monte
    Carlo error, 20000 resamples each) for the perplexity difference."""
    base, other, words = _ppl_data(3, 60, 0.05)

    def diff(nb: np.ndarray, db: np.ndarray, no: np.ndarray, do: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.exp(no.sum(axis) / do.sum(axis)) - np.exp(nb.sum(axis) / db.sum(axis))

    peer = sps.bootstrap((base, words, other, words), diff, paired=True, method="BCa", n_resamples=20000,
                         rng=np.random.default_rng(2))  # fmt: skip
    ours = stats.bca_difference(base, other, words, words, "exp", alpha=0.05, n_boot=20000, seed=1)
    width = peer.confidence_interval.high - peer.confidence_interval.low
    assert ours.ci_low == pytest.approx(peer.confidence_interval.low, abs=0.03 * width)
    assert ours.ci_high == pytest.approx(peer.confidence_interval.high, abs=0.03 * width)
    assert ours.se_diff == pytest.approx(peer.standard_error, rel=0.03)


def test_bca_p_value_is_dual_to_the_interval() -> None:
    """p < alpha exactly when the (1 - alpha) interval, from the same resamples, excludes 0."""
    base, other, words = _ppl_data(4, 60, 0.0)
    p = stats.bca_difference(base, other, words, words, "exp", n_boot=4000, seed=1).p_value
    assert 0.02 < p < 0.9
    for alpha in (p * 0.9, p * 1.1, 0.01, 0.05, 0.2):
        r = stats.bca_difference(base, other, words, words, "exp", alpha=alpha, n_boot=4000, seed=1)
        assert r.p_value == p
        assert (p < alpha) == (r.ci_low > 0 or r.ci_high < 0), alpha


def test_why_not_scipy_bootstrap() -> None:
    """scipy's BootstrapResult carries no p-value (Holm needs one), and its BCa acceleration calls the statistic
    on n jackknife samples of n - 1: n (n - 1) values per array, quadratic in n (2000 samples: 4 million; the
    hand-written one uses leave-one-out sums, O(n))."""
    n = 2000
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=n), rng.normal(size=n)
    seen = {"values": 0}

    def mean_diff(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        seen["values"] += a.size
        return b.mean(axis) - a.mean(axis)

    res = sps.bootstrap((x, y), mean_diff, paired=True, method="BCa", n_resamples=100, rng=rng)
    assert not hasattr(res, "pvalue")
    assert seen["values"] >= n * (n - 1)


# ---- the relative change: Fieller, nothing dropped ---------------------------------------------------------


def test_fieller_interval_by_hand() -> None:
    """base 2.0, other 2.5, Var 0.01 / 0.02, Cov 0.005, 95%: the t with (2.5 - 2 t)^2 <= z^2 (0.02 - 0.01 t +
    0.01 t^2) solve 3.96159 t^2 - 9.96159 t + 6.17317 = 0 (z^2 = 3.84146), so t = 1.1074 .. 1.4072."""
    z2 = sps.norm.ppf(0.975) ** 2
    qa, qb, qc = 4 - 0.01 * z2, 2 * 2.5 - 0.005 * z2, 2.5**2 - 0.02 * z2
    t_lo = (qb - math.sqrt(qb * qb - qa * qc)) / qa
    t_hi = (qb + math.sqrt(qb * qb - qa * qc)) / qa
    assert (round(t_lo, 4), round(t_hi, 4)) == (1.1074, 1.4072)
    lo, hi = stats.fieller_relative(2.0, 2.5, 0.01, 0.02, 0.005)
    assert (lo, hi) == pytest.approx((t_lo - 1, t_hi - 1), rel=1e-12)
    # a baseline not significantly above 0: unbounded
    assert stats.fieller_relative(0.025, 0.075, 0.025 * 0.975 / 40, 0.075 * 0.925 / 40, 0.0) is None


def test_relative_change_with_one_in_forty_baseline_is_unbounded(tmp_path: Path, write_run) -> None:  # noqa: ANN001
    """Baseline 1/40 right, other 3/40: 36% of bootstrap resamples have a baseline of 0. Dropping them gave a
    finite interval; the ratio is not estimable here and the report says 'unbounded'."""
    base = np.zeros(40)
    base[0] = 1
    other = np.zeros(40)
    other[[0, 1, 2]] = 1

    def recs(x: np.ndarray) -> list[dict]:
        return [{"doc_id": i, "filter": "none", "metrics": ["exact_match"], "exact_match": float(v)}
                for i, v in enumerate(x)]  # fmt: skip

    write_run(tmp_path, "base", "bf16", {"aime25": recs(base)})
    write_run(tmp_path, "fp4", "fp4_e2m1", {"aime25": recs(other)})
    c = compare_runs([tmp_path], n_boot=500)
    r = c.results[0]
    assert r.rel_change == pytest.approx(2.0)
    assert r.rel_ci_unbounded and r.rel_ci_low is None and r.rel_ci_high is None
    assert "+200.00% [unbounded]" in render_markdown(c)


def test_fieller_covers_planted_ratio() -> None:
    """Paired accuracies 0.2 -> 0.23 (+15%: 5% of wrong answers become right, 5% of right ones wrong) over 120
    questions: Fieller's interval covers the relative change at about the stated rate (Binomial(300, 0.95):
    277..298 is its central ~99.8%)."""
    rng = np.random.default_rng(9)
    n, reps, covered = 120, 300, 0
    for _ in range(reps):
        base = (rng.random(n) < 0.2).astype(float)
        u = rng.random(n)
        other = np.where(base == 1, u >= 0.05, u < 0.05).astype(float)
        vb, vo, cov = stats.paired_covariance(base, np.ones(n), other, np.ones(n))
        ci = stats.fieller_relative(base.mean(), other.mean(), vb, vo, cov)
        covered += ci is None or ci[0] <= 0.15 <= ci[1]
    assert 277 <= covered <= 298, covered


# ---- minimum paired samples ---------------------------------------------------------------------------------


def _wikitext(ll: list[float], words: list[int]) -> list[dict]:
    return [{"doc_id": i, "filter": "none", "metrics": ["word_perplexity"], "word_perplexity": [a, w]}
            for i, (a, w) in enumerate(zip(ll, words, strict=True))]  # fmt: skip


def test_too_few_samples_is_insufficient_data_never_a_pass(tmp_path: Path, write_run, invoke: Invoke) -> None:  # noqa: ANN001
    """Two documents whose perplexity doubles: a zero-width-ish interval made that 'significant' and a gate
    FAIL. Below --min-samples (10) it is 'insufficient data': no test, no FAIL of the metric, listed by the report
    and JSON — and the gate does not pass on it (issue 23): --fail-on-regression exits 1 unless --allow-unjudged."""
    ll, words = [-300.0, -280.0], [100, 90]
    write_run(tmp_path, "base", "bf16", {"wikitext": _wikitext(ll, words)})
    doubled = [a - math.log(2) * w for a, w in zip(ll, words, strict=True)]
    write_run(tmp_path, "fp4", "fp4_e2m1", {"wikitext": _wikitext(doubled, words)})
    c = compare_runs([tmp_path], n_boot=200)
    (r,) = [x for x in c.results if x.key]
    assert r.rel_change == pytest.approx(1.0)
    assert r.insufficient and r.status == "insufficient data" and r.verdict.startswith("insufficient data")
    assert not (r.significant or r.worse or r.gate_fail)
    assert r.p_value is None and r.ci_low is None and r.p_adjusted is None
    assert c.failures == [] and c.insufficient == [r] and c.config_gate("fp4") == "insufficient data"
    assert any("only 2 paired samples" in w for w in c.warnings)
    md = render_markdown(c)
    assert "FAILED: 1 key result(s) had insufficient data" in md and "## Insufficient data" in md
    assert not c.gate_passed and c.unjudged_configs == ["fp4"]
    code, out, err = invoke(["compare", str(tmp_path), "--json", "--fail-on-regression"])
    assert code == 1, out + err
    assert "gate FAILED: not judged" in err and "fp4: insufficient data" in err
    payload = json.loads(out)
    assert payload["min_samples"] == 10 and payload["gate"]["passed"] is False
    code, out, err = invoke(["compare", str(tmp_path), "--json", "--fail-on-regression", "--allow-unjudged"])
    assert code == 0, out + err
    assert json.loads(out)["gate"]["passed"] is True and "passed by --allow-unjudged" in err
    assert [x["config"] for x in payload["gate"]["insufficient_data"]] == ["fp4"]
    assert payload["results"][0]["verdict"].startswith("insufficient data")
    assert payload["configurations"][1]["gate"] == "insufficient data"
    # with --min-samples 2 the same runs are judged (and the doubling fails the gate)
    code, out, _ = invoke(["compare", str(tmp_path), "--json", "--fail-on-regression", "--min-samples", "2"])
    assert json.loads(out)["min_samples"] == 2
    assert json.loads(out)["results"][0]["verdict"] != "insufficient data"


def test_min_samples_boundary(tmp_path: Path, write_run, gsm8k_records) -> None:  # noqa: ANN001
    right = np.array([True] * 6 + [False] * 4)
    write_run(tmp_path, "base", "bf16", {"gsm8k": gsm8k_records(right)})
    write_run(tmp_path, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(right)})
    assert not any(r.insufficient for r in compare_runs([tmp_path], n_boot=100).results)  # n = 10
    assert all(r.insufficient for r in compare_runs([tmp_path], n_boot=100, min_samples=11).results)


# ---- alpha everywhere ---------------------------------------------------------------------------------------


def test_alpha_sets_every_interval(tmp_path: Path, write_run, wikitext_records, invoke: Invoke) -> None:  # noqa: ANN001
    base, other, words = _ppl_data(5, 50, 0.02)
    w95 = stats.bca_difference(base, other, words, words, "exp", alpha=0.05, seed=1)
    w99 = stats.bca_difference(base, other, words, words, "exp", alpha=0.01, seed=1)
    assert w99.ci_low < w95.ci_low and w99.ci_high > w95.ci_high
    write_run(tmp_path, "base", "bf16", {"wikitext": wikitext_records(-base, words)})
    write_run(tmp_path, "fp8", "fp8_e4m3", {"wikitext": wikitext_records(-other, words)})
    at = {
        a: next(r for r in compare_runs([tmp_path], alpha=a, n_boot=1000).results if r.key)
        for a in (0.05, 0.01)
    }
    assert at[0.01].ci_low < at[0.05].ci_low and at[0.01].ci_high > at[0.05].ci_high
    assert at[0.01].rel_ci_low < at[0.05].rel_ci_low and at[0.01].rel_ci_high > at[0.05].rel_ci_high
    assert at[0.01].mdd > at[0.05].mdd
    md = tmp_path / "r.md"
    code, out, err = invoke(["compare", str(tmp_path), "--alpha", "0.01", "--json", "-o", str(md)])
    assert code == 0, out + err
    assert json.loads(out)["alpha"] == 0.01 and "difference [99% CI]" in md.read_text()


# ---- Holm-Bonferroni over the gate's family ------------------------------------------------------------------


def test_holm_over_the_gate_family(tmp_path: Path, write_run, invoke: Invoke) -> None:  # noqa: ANN001
    """Three configurations on one single-filter task, 200 questions each, with discordant pairs (b, c) =
    (12, 1), (10, 2), (9, 3): exact p = 28/8192, 158/4096, 598/4096. Holm (m = 3): 3 x 28/8192, then
    max(that, 2 x 158/4096), then max(that, 598/4096). (10, 2) is significant alone (p = 0.039) but not after
    the correction (0.077), so only (12, 1) fails the gate; without the correction both do."""

    def recs(x: np.ndarray) -> list[dict]:
        return [{"doc_id": i, "filter": "none", "metrics": ["exact_match"], "exact_match": float(v)}
                for i, v in enumerate(x)]  # fmt: skip

    base, _ = _table(100, 12, 0, 88)
    write_run(tmp_path, "base", "bf16", {"quiz": recs(base)})
    for name, (b, c) in {"cfg_a": (12, 1), "cfg_b": (10, 2), "cfg_c": (9, 3)}.items():
        other = base.copy()
        other[np.flatnonzero(base == 1)[:b]] = 0
        other[np.flatnonzero(base == 0)[:c]] = 1
        write_run(tmp_path, name, "fp8_e4m3", {"quiz": recs(other)})
    c = compare_runs([tmp_path], n_boot=200)
    res = {r.config: r for r in c.results}
    assert [res[k].p_value for k in ("cfg_a", "cfg_b", "cfg_c")] == pytest.approx(
        [28 / 8192, 158 / 4096, 598 / 4096], rel=1e-12
    )
    assert [res[k].p_adjusted for k in ("cfg_a", "cfg_b", "cfg_c")] == pytest.approx(
        [84 / 8192, 316 / 4096, 598 / 4096], rel=1e-12
    )
    assert {f.config for f in c.failures} == {"cfg_a"}
    assert not res["cfg_b"].significant and res["cfg_b"].p_value < 0.05
    none = compare_runs([tmp_path], n_boot=200, multiple_testing="none")
    assert {f.config for f in none.failures} == {"cfg_a", "cfg_b"}
    assert all(r.p_adjusted is None for r in none.results)
    # the CLI: holm by default, --no-multiple-testing-correction to opt out
    code, out, _ = invoke(["compare", str(tmp_path), "--json", "--fail-on-regression"])
    payload = json.loads(out)
    assert code == 1 and payload["multiple_testing"] == "holm"
    assert {f["config"] for f in payload["gate"]["failures"]} == {"cfg_a"}
    assert {r["config"]: r["p_adjusted"] for r in payload["results"]}["cfg_b"] == pytest.approx(316 / 4096)
    code, out, _ = invoke(["compare", str(tmp_path), "--json", "--no-multiple-testing-correction"])
    payload = json.loads(out)
    assert code == 0 and payload["multiple_testing"] == "none"
    assert {f["config"] for f in payload["gate"]["failures"]} == {"cfg_a", "cfg_b"}
