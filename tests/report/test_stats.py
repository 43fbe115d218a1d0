"""kvcal.report.stats against known answers: interval coverage, McNemar's exact p, MDD power, standard errors.

The gate statistics of issue 13 (insufficient data, Newcombe vs McNemar, Fieller, alpha, Holm) are in
test_gate_stats.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from kvcal.report import stats


def test_binary_interval_covers_planted_difference_at_stated_rate() -> None:
    """200 replications of paired binary data with a known difference: the 95% interval (Newcombe, widened to 0
    where McNemar does not reject) covers it ~95% of the time (accept the central ~99.7% of Binomial(200, 0.95):
    181..199)."""
    rng = np.random.default_rng(7)
    n, reps = 150, 200
    p_base, p_lose, p_gain = 0.6, 0.15, 0.05
    true_diff = (1 - p_base) * p_gain - p_base * p_lose  # E[other] - E[base] = -0.07
    covered = 0
    for _ in range(reps):
        base = (rng.random(n) < p_base).astype(float)
        u = rng.random(n)
        other = np.where(base == 1, (u >= p_lose).astype(float), (u < p_gain).astype(float))
        r, _, _ = stats.binary_difference(base, other)
        covered += r.ci_low <= true_diff <= r.ci_high
    assert 181 <= covered <= 199, covered


def test_bca_covers_planted_ratio_difference() -> None:
    """The paired BCa interval of a perplexity-like ratio statistic exp(sum(-ll) / sum(words)) with a planted 3%
    increase covers the truth at the stated rate."""
    rng = np.random.default_rng(11)
    n, reps = 60, 120
    covered = 0
    for rep in range(reps):
        words = rng.integers(50, 150, size=n).astype(float)
        nll_per_word = rng.normal(3.0, 0.3, size=n)  # per-doc difficulty, shared by both runs
        base_nll = nll_per_word * words + rng.normal(0, 3, size=n)
        shift = math.log(1.03)  # +3% perplexity in expectation
        other_nll = (nll_per_word + shift) * words + rng.normal(0, 3, size=n)
        # the population-level truth: exp(E[nll/word] + shift) - exp(E[nll/word])
        true_diff = math.exp(3.0 + shift) - math.exp(3.0)
        r = stats.bca_difference(base_nll, other_nll, words, words, "exp", n_boot=800, seed=rep)
        covered += r.ci_low <= true_diff <= r.ci_high
    # Binomial(120, 0.95): mean 114, sd 2.4
    assert 106 <= covered <= 120, covered


def test_paired_is_tighter_than_unpaired_and_identical_is_zero() -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(0.5, 0.2, 300)
    r = stats.bca_difference(base, base.copy(), n_boot=500)
    assert (r.ci_low, r.ci_high, r.se_diff, r.p_value) == (0.0, 0.0, 0.0, 1.0)
    other = base + rng.normal(0.0, 0.02, 300)
    r = stats.bca_difference(base, other, n_boot=2000)
    unpaired = math.hypot(stats.standard_error_of_mean(base), stats.standard_error_of_mean(other))
    assert r.se_diff < unpaired / 3


def test_seeded_and_reproducible() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.random(100), rng.random(100)
    assert stats.bca_difference(a, b, seed=5) == stats.bca_difference(a, b, seed=5)
    assert stats.bca_difference(a, b, seed=5) != stats.bca_difference(a, b, seed=6)


@pytest.mark.parametrize(("b", "c"), [(10, 2), (0, 0), (5, 5), (40, 4), (0, 7), (123, 98)])
def test_mcnemar_exact_matches_scipy_binomtest(b: int, c: int) -> None:
    n_concordant = 50
    base = np.array([1] * b + [0] * c + [1] * n_concordant + [0] * n_concordant, dtype=float)
    other = np.array([0] * b + [1] * c + [1] * n_concordant + [0] * n_concordant, dtype=float)
    p, bb, cc = stats.mcnemar_exact(base, other)
    assert (bb, cc) == (b, c)
    expect = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
    assert p == pytest.approx(expect, rel=1e-12)


def test_mcnemar_known_value() -> None:
    # b=10, c=2: p = 2 * sum_{k<=2} C(12, k) / 2^12 = 2 * 79 / 4096
    base = np.array([1] * 10 + [0] * 2, dtype=float)
    p, _, _ = stats.mcnemar_exact(base, 1 - base)
    assert p == pytest.approx(158 / 4096, rel=1e-12)


def test_mcnemar_matches_statsmodels_when_installed() -> None:
    sm = pytest.importorskip("statsmodels.stats.contingency_tables")
    base = np.array([1] * 13 + [0] * 4 + [1] * 30 + [0] * 20, dtype=float)
    other = np.array([0] * 13 + [1] * 4 + [1] * 30 + [0] * 20, dtype=float)
    table = [[30, 13], [4, 20]]
    assert stats.mcnemar_exact(base, other)[0] == pytest.approx(
        sm.mcnemar(table, exact=True).pvalue, rel=1e-9
    )


def test_mdd_paired_binary_has_the_stated_power() -> None:
    """Simulate McNemar's exact test at the MDD: power should be ~0.8 (the exact test is a bit conservative)."""
    rng = np.random.default_rng(1)
    n, pd = 200, 0.2
    d = stats.mdd_paired_binary(n, pd)
    assert 0.05 < d < 0.15
    # the formula, solved back: n == (za sqrt(pd) + zb sqrt(pd - d^2))^2 / d^2
    za, zb = sps.norm.ppf(0.975), sps.norm.ppf(0.8)
    assert (za * math.sqrt(pd) + zb * math.sqrt(pd - d * d)) ** 2 / d**2 == pytest.approx(n, rel=1e-6)
    counts = rng.multinomial(n, [(pd + d) / 2, (pd - d) / 2, 1 - pd], size=4000)  # [sims, (b, c, concordant)]
    b, c = counts[:, 0], counts[:, 1]
    p = np.minimum(1.0, 2 * sps.binom.cdf(np.minimum(b, c), b + c, 0.5))
    power = float(np.mean(p < 0.05))
    assert 0.7 <= power <= 0.88, power
    # no observed discordance: ~ (za + zb)^2 / n, never 0
    assert stats.mdd_paired_binary(30, 0.0) == pytest.approx(7.85 / 30, rel=0.1)
    assert stats.mdd_paired_binary(3, 0.0) == 1.0
    # more samples -> smaller MDD
    assert stats.mdd_paired_binary(1000, 0.1) < stats.mdd_paired_binary(100, 0.1)


def test_delta_method_standard_errors() -> None:
    """The score SEs: a plain mean's is sqrt(var / n) (lm-eval's *_stderr); a perplexity's (delta method) agrees
    with scipy's bootstrap standard error as a peer."""
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, 400)
    assert stats.standard_error_of_mean(x) == pytest.approx(x.std(ddof=1) / 20)
    assert stats.standard_error_of_mean(np.array([1.0])) == 0.0
    words = rng.integers(50, 150, 300).astype(float)
    nll = rng.normal(3.0, 0.4, 300) * words

    def ppl(nll_: np.ndarray, words_: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.exp(nll_.sum(axis) / words_.sum(axis))

    peer = sps.bootstrap((nll, words), ppl, paired=True, n_resamples=4000, rng=np.random.default_rng(0))
    assert stats.standard_error(nll, words, "exp") == pytest.approx(peer.standard_error, rel=0.08)
    assert stats.mdd_continuous(0.01) == pytest.approx(0.01 * (1.959964 + 0.841621), rel=1e-5)


def test_relative_change() -> None:
    assert stats.relative_change(10.0, 11.0) == pytest.approx(0.1)
    assert stats.relative_change(0.0, 1.0) is None
    assert stats.ratio_statistic(
        np.array([2.0, 4.0]), np.array([1.0, 1.0]), stats.exp_transform
    ) == pytest.approx(math.exp(3.0))
