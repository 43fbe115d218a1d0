"""Statistics for comparing two evaluation runs over the same samples (paired), and for a family of such tests.

Every corpus metric kvcal reports is a *ratio of weighted sums* over per-sample records:

    statistic = transform( sum_i num_i / sum_i den_i )

- a mean of per-sample scores (exact_match, acc, top1_agree): num_i = score_i, den_i = 1, transform = identity;
- lm-eval's weighted perplexity (word_perplexity, byte_perplexity): num_i = -loglikelihood_i,
  den_i = words_i (or bytes_i), transform = exp; bits_per_byte: transform = x / ln 2;
- kvcal's token-weighted KL: num_i = kl_i * n_tokens_i, den_i = n_tokens_i, transform = identity.

What is computed, and why this way:

- Binary per-sample metrics (exact_match, acc): McNemar's exact test on the discordant pairs (statsmodels) gives
  the verdict; the interval shown is Newcombe's square-and-add interval for the difference of paired proportions
  (Newcombe 1998, with his corrected phi; Fagerland, Lydersen & Laake 2017, ch. 8), widened to reach 0 where the
  exact test does not reject. Newcombe's interval has near-nominal coverage, but it is an asymptotic score
  interval and can exclude 0 where the exact test does not reject (b=6, c=16, n=161: interval [0.005, 0.119],
  p = 0.052); widening it there keeps the table from showing a significant-looking interval the verdict does not
  back. The reverse (the test rejects, the interval covers 0) is rare (4 of 55,755 tables of a grid over n <= 500
  and alpha 0.01/0.05/0.1, all at alpha 0.01 with the bound within 1e-4 of 0): the bound is then truncated just
  past 0, so p < alpha exactly when the interval excludes 0 (tests/report/test_gate_stats.py checks the grid).
  A percentile bootstrap is *not* used for these: with b=5, c=0, n=200 it excludes 0 while p = 0.0625.
- Everything else: a paired BCa bootstrap of the difference (Efron & Tibshirani 1993, ch. 14) and the two-sided
  p-value that is its exact dual (the smallest alpha whose BCa interval excludes 0), so test and interval never
  disagree. Hand-written rather than scipy.stats.bootstrap(paired=True, method='BCa'), which gives the same
  interval (tests/report/test_gate_stats.py checks it as a peer) but (1) returns no p-value, which the
  Holm-Bonferroni correction needs, and (2) computes the BCa acceleration by calling the statistic on n jackknife
  samples of n-1 (O(n^2)), where leave-one-out *sums* give it in O(n) for a ratio of sums.
- Relative change (other / base - 1) and its interval: Fieller's interval for a ratio of two correlated
  estimates (Fieller 1954), their covariance from the delta method (linearisation of each ratio of sums). It does
  not resample, so nothing is dropped when a resampled baseline would be 0; when the baseline is not
  significantly different from 0 the interval is unbounded and is reported as such. It is a normal-theory
  interval: simulated coverage of paired accuracies is 0.93-0.95 at 95% (0.92 at 40 questions, 10% right).
- Standard errors of the scores: the same linearisation (for a plain mean it is lm-eval's `*_stderr`).
- Multiple testing: Holm-Bonferroni (statsmodels.stats.multitest.multipletests, method='holm').
- A handful of paired units, each a mean over many tokens (the windows of KL by position): the paired t test and
  its t interval (scipy.stats.ttest_rel); a bootstrap over 3-10 units has too few distinct resamples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize
from scipy import stats as sps
from scipy.special import ndtr, ndtri

ALPHA = 0.05
POWER = 0.8
DEFAULT_BOOTSTRAP = 2000
DEFAULT_SEED = 1234
# Fewer paired samples than this and no verdict is given (`kvcal compare --min-samples`).
DEFAULT_MIN_SAMPLES = 10
# Bootstrap work is done in chunks of resamples so that memory stays ~ chunk * n indices.
_CHUNK_ELEMENTS = 4_000_000

Transform = Callable[[np.ndarray], np.ndarray]


def identity(x: np.ndarray) -> np.ndarray:
    return x


def exp_transform(x: np.ndarray) -> np.ndarray:
    return np.exp(x)


def bits_transform(x: np.ndarray) -> np.ndarray:
    return x / math.log(2.0)


TRANSFORMS: dict[str, Transform] = {"identity": identity, "exp": exp_transform, "bits": bits_transform}
# d transform / dx at x, for the delta method
SLOPES: dict[str, Callable[[float], float]] = {
    "identity": lambda _x: 1.0,
    "exp": math.exp,
    "bits": lambda _x: 1.0 / math.log(2.0),
}


# --------------------------------------------------------------------------------------------------------------
# Point estimates and standard errors


def ratio_statistic(num: np.ndarray, den: np.ndarray, transform: Transform = identity) -> float:
    """transform(sum(num) / sum(den)) — the point estimate of a corpus metric."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    total = den.sum()
    if total == 0:
        return float("nan")
    return float(transform(np.asarray(num.sum() / total)))


def influence(num: np.ndarray, den: np.ndarray, transform: str = "identity") -> np.ndarray:
    """Per-sample influence values u_i of transform(sum num / sum den): Var(statistic) ~ var(u) / n.

    Linearisation of a ratio of sums R = sum num / sum den: u_i = (num_i - R den_i) / mean(den), times the
    transform's slope at R. For a plain mean (den = 1, identity) u_i = x_i - mean(x)."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    r = num.sum() / den.sum()
    return SLOPES[transform](float(r)) * (num - r * den) / den.mean()


def standard_error(num: np.ndarray, den: np.ndarray, transform: str = "identity") -> float:
    """Delta-method standard error of transform(sum num / sum den); for a plain mean sqrt(var(x, ddof=1) / n),
    what lm-eval reports as `*_stderr`. 0 for n < 2."""
    n = np.asarray(num).size
    if n < 2:
        return 0.0
    return float(np.sqrt(influence(num, den, transform).var(ddof=1) / n))


def standard_error_of_mean(x: np.ndarray) -> float:
    """Sample standard error sqrt(var(x, ddof=1) / n). 0 for n < 2."""
    x = np.asarray(x, dtype=np.float64)
    return standard_error(x, np.ones_like(x))


def relative_change(base: float, other: float) -> float | None:
    """(other - base) / |base|: for lower-is-better metrics (perplexity, KL) a positive value is a degradation."""
    if base == 0 or not math.isfinite(base) or not math.isfinite(other):
        return None
    return (other - base) / abs(base)


# --------------------------------------------------------------------------------------------------------------
# Continuous and ratio metrics: paired BCa bootstrap with its dual p-value


@dataclass(frozen=True)
class DiffTest:
    """Test and interval of statistic(other) - statistic(base) over the same samples."""

    ci_low: float
    ci_high: float
    p_value: float  # two-sided, dual to the interval: p < alpha exactly when the interval excludes 0
    se_diff: (
        float  # standard error of the difference: the bootstrap SD (BCa); McNemar's, from the pairs (binary)
    )


def _resample_sums(arrays: list[np.ndarray], n_boot: int, rng: np.random.Generator) -> list[np.ndarray]:
    """For each array a: [n], return [n_boot] sums of a over n indices drawn with replacement (shared draws)."""
    n = arrays[0].size
    out = [np.empty(n_boot, dtype=np.float64) for _ in arrays]
    chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))  # idx: [chunk, n]
        for a, o in zip(arrays, out, strict=True):
            o[start:stop] = a[idx].sum(axis=1)
    return out


def _diff_of_ratios(
    s_nb: np.ndarray | float,
    s_db: np.ndarray | float,
    s_no: np.ndarray | float,
    s_do: np.ndarray | float,
    transform: Transform,
) -> np.ndarray:
    """transform(other's ratio) - transform(base's ratio), elementwise over sums (e.g. [n_boot] resampled sums)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return transform(s_no / s_do) - transform(s_nb / s_db)


def _acceleration(nb: np.ndarray, db: np.ndarray, no: np.ndarray, do: np.ndarray, tf: Transform) -> float:
    """BCa acceleration from the jackknife: the leave-one-out statistics come from leave-one-out sums, O(n)."""
    theta_i = _diff_of_ratios(nb.sum() - nb, db.sum() - db, no.sum() - no, do.sum() - do, tf)  # [n]
    d = theta_i.mean() - theta_i
    ss = float(np.sum(d * d))
    return float(np.sum(d**3) / (6.0 * ss**1.5)) if ss > 0 else 0.0


def _share_below(theta_b: np.ndarray, x: float) -> float:
    """Where x sits in the bootstrap distribution, ties counted half (scipy's BCa uses the same), kept off 0/1."""
    b = theta_b.size
    share = (np.count_nonzero(theta_b < x) + np.count_nonzero(theta_b <= x)) / (2 * b)
    return float(min(max(share, 1 / (2 * b)), 1 - 1 / (2 * b)))


def _bca_p_value(theta_b: np.ndarray, z0: float, a: float) -> float:
    """Two-sided p-value dual to the BCa interval: solve BCa level(z) = share of resamples below 0 for z, then
    p = 2 Phi(-|z|). BCa level(z) = Phi(z0 + (z0 + z) / (1 - a (z0 + z)))."""
    w = float(ndtri(_share_below(theta_b, 0.0))) - z0
    if 1 + a * w <= 0:  # beyond every level the BCa map reaches: 0 lies outside every interval
        return 0.0
    z = w / (1 + a * w) - z0
    return float(min(1.0, 2 * ndtr(-abs(z))))


def bca_difference(
    num_base: np.ndarray,
    num_other: np.ndarray,
    den_base: np.ndarray | None = None,
    den_other: np.ndarray | None = None,
    transform: str = "identity",
    alpha: float = ALPHA,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
) -> DiffTest:
    """Paired BCa bootstrap interval (level 1 - alpha) of statistic(other) - statistic(base), and its dual p.

    Arrays are aligned: element i of every array belongs to sample i. Each resample draws n indices with
    replacement and applies them to both runs, so the sample-to-sample variation common to both cancels.
    Needs n >= 2."""
    nb, no = (np.asarray(x, dtype=np.float64) for x in (num_base, num_other))
    if nb.shape != no.shape or nb.ndim != 1 or nb.size < 2:
        raise ValueError(
            f"paired arrays must be 1-D, aligned and hold >= 2 samples, got {nb.shape}, {no.shape}"
        )
    db = np.ones_like(nb) if den_base is None else np.asarray(den_base, dtype=np.float64)
    do = np.ones_like(no) if den_other is None else np.asarray(den_other, dtype=np.float64)
    tf = TRANSFORMS[transform]
    theta = float(_diff_of_ratios(nb.sum(), db.sum(), no.sum(), do.sum(), tf))
    theta_b = _diff_of_ratios(*_resample_sums([nb, db, no, do], n_boot, np.random.default_rng(seed)), tf)
    theta_b = theta_b[np.isfinite(theta_b)]  # a resample whose denominators sum to 0 has no statistic
    if theta_b.size < 2 or float(np.ptp(theta_b)) == 0.0:
        # every resample gives the same difference: it is known exactly (0 for identical runs)
        return DiffTest(theta, theta, 1.0 if theta == 0 else 0.0, 0.0)
    z0 = float(ndtri(_share_below(theta_b, theta)))
    a = _acceleration(nb, db, no, do, tf)
    z = ndtri(np.array([alpha / 2, 1 - alpha / 2]))
    levels = ndtr(z0 + (z0 + z) / (1 - a * (z0 + z)))
    lo, hi = np.percentile(theta_b, 100 * levels)
    return DiffTest(float(lo), float(hi), _bca_p_value(theta_b, z0, a), float(theta_b.std(ddof=1)))


# --------------------------------------------------------------------------------------------------------------
# Binary metrics: McNemar's exact test and Newcombe's interval


def discordant_pairs(base: np.ndarray, other: np.ndarray) -> tuple[int, int, int, int]:
    """(a, b, c, d) of the paired 2x2 table: a both right, b base right & other wrong, c base wrong & other
    right, d both wrong."""
    bb = np.asarray(base, dtype=np.float64) > 0.5
    oo = np.asarray(other, dtype=np.float64) > 0.5
    a, b = int(np.sum(bb & oo)), int(np.sum(bb & ~oo))
    c, d = int(np.sum(~bb & oo)), int(np.sum(~bb & ~oo))
    return a, b, c, d


def _mcnemar_p(a: int, b: int, c: int, d: int) -> float:
    from statsmodels.stats.contingency_tables import mcnemar

    return 1.0 if b + c == 0 else float(mcnemar([[a, b], [c, d]], exact=True).pvalue)


def mcnemar_exact(base: np.ndarray, other: np.ndarray) -> tuple[float, int, int]:
    """McNemar's exact test for paired binary outcomes (statsmodels): under H0 (same accuracy) each discordant pair
    is equally likely to go either way, so b ~ Binomial(b + c, 1/2). Returns (two-sided p, b, c); p = 1 with no
    discordant pairs."""
    a, b, c, d = discordant_pairs(base, other)
    return _mcnemar_p(a, b, c, d), b, c


def _wilson(k: int, n: int, alpha: float) -> tuple[float, float]:
    from statsmodels.stats.proportion import proportion_confint

    lo, hi = proportion_confint(k, n, alpha=alpha, method="wilson")
    return float(lo), float(hi)


def newcombe_paired(a: int, b: int, c: int, d: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Newcombe's square-and-add interval (level 1 - alpha) for p_other - p_base of a paired 2x2 table (a, b, c,
    d as in discordant_pairs): Wilson intervals of the two accuracies combined with the correlation phi between
    them, phi's numerator ad - bc shrunk by n/2 when positive (Newcombe 1998, method 10)."""
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n  # base, other
    l1, u1 = _wilson(a + b, n, alpha)
    l2, u2 = _wilson(a + c, n, alpha)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    num = cross - n / 2 if cross > n / 2 else (0.0 if cross >= 0 else cross)
    phi = num / math.sqrt(margins) if margins > 0 else 0.0
    # Interval of p1 - p2 (Newcombe's orientation), then flipped to other - base.
    lo = (p1 - p2) - math.sqrt(max((p1 - l1) ** 2 + (u2 - p2) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2), 0.0))
    hi = (p1 - p2) + math.sqrt(max((p2 - l2) ** 2 + (u1 - p1) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1), 0.0))
    return -hi, -lo


def paired_binary_test(a: int, b: int, c: int, d: int, alpha: float = ALPHA) -> DiffTest:
    """McNemar's exact p and Newcombe's interval of accuracy(other) - accuracy(base) for a paired 2x2 table (a, b,
    c, d as in discordant_pairs), widened to reach 0 where the test does not reject and, in the rare reverse
    case, truncated just past 0 (see the module docstring): p < alpha exactly when the interval excludes 0."""
    n = a + b + c + d
    if b + c == 0:
        return DiffTest(0.0, 0.0, 1.0, 0.0)
    p = _mcnemar_p(a, b, c, d)
    lo, hi = newcombe_paired(a, b, c, d, alpha)
    if p >= alpha:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    elif lo <= 0.0 <= hi:  # the bound is within ~1e-4 of 0
        lo, hi = (math.ulp(0.0), hi) if c > b else (lo, -math.ulp(0.0))
    # SE of the difference: the sd of the per-pair differences (-1: b, +1: c, 0: concordant) / sqrt(n)
    mean = (c - b) / n
    var = (b + c - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return DiffTest(lo, hi, p, math.sqrt(max(var, 0.0) / n))


def binary_difference(base: np.ndarray, other: np.ndarray, alpha: float = ALPHA) -> tuple[DiffTest, int, int]:
    """paired_binary_test of per-sample correctness arrays; returns (test, b, c)."""
    a, b, c, d = discordant_pairs(base, other)
    return paired_binary_test(a, b, c, d, alpha), b, c


def is_binary(x: np.ndarray) -> bool:
    x = np.asarray(x, dtype=np.float64)
    return bool(np.all((x == 0.0) | (x == 1.0)))


# --------------------------------------------------------------------------------------------------------------
# Relative change: Fieller's interval


def fieller_relative(
    base: float, other: float, var_base: float, var_other: float, cov: float, alpha: float = ALPHA
) -> tuple[float, float] | None:
    """Interval (level 1 - alpha) of other / base - 1 from Fieller's theorem: the ratios t with
    (other - t base)^2 <= z^2 Var(other - t base). Bounded only when the baseline is significantly different
    from 0 (base^2 > z^2 var_base); None (unbounded) otherwise."""
    z2 = float(ndtri(1 - alpha / 2)) ** 2
    qa = base * base - z2 * var_base
    if not qa > 0:
        return None
    qb = base * other - z2 * cov
    qc = other * other - z2 * var_other
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))
    t_lo, t_hi = (qb - root) / qa, (qb + root) / qa
    return (t_lo - 1, t_hi - 1) if base > 0 else (1 - t_hi, 1 - t_lo)


def paired_covariance(
    num_base: np.ndarray,
    den_base: np.ndarray,
    num_other: np.ndarray,
    den_other: np.ndarray,
    transform: str = "identity",
) -> tuple[float, float, float]:
    """(Var base, Var other, Cov) of the two paired statistics from the delta method; needs n >= 2."""
    ub = influence(num_base, den_base, transform)
    uo = influence(num_other, den_other, transform)
    m = np.cov(np.stack([ub, uo]), ddof=1) / ub.size  # [2, 2]
    return float(m[0, 0]), float(m[1, 1]), float(m[0, 1])


# --------------------------------------------------------------------------------------------------------------
# A family of tests, and what a test can detect


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> list[float]:
    """Holm-Bonferroni adjusted p-values (statsmodels multipletests, method='holm'): reject where adjusted < alpha;
    controls the family-wise error rate at alpha for any dependence between the tests."""
    if not p_values:
        return []
    from statsmodels.stats.multitest import multipletests

    return [float(p) for p in multipletests(list(p_values), alpha=alpha, method="holm")[1]]


def mdd_paired_binary(n: int, discordance_rate: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable difference in accuracy for McNemar's test with n pairs.

    Sample-size formula for McNemar's test (Connor 1987; Lachin 1992), with discordance rate
    p_d = P(pairs disagree) and true accuracy difference d:

        n = ( z_{1-alpha/2} * sqrt(p_d) + z_{power} * sqrt(p_d - d^2) )^2 / d^2

    solved here for d at the given n. A difference of d forces at least |d| of the pairs to disagree, so p_d is
    taken as max(observed discordance rate, d): with no discordant pairs observed (identical runs) the answer
    is about (z_{1-alpha/2} + z_{power})^2 / n (7.85 / n at the defaults) rather than a meaningless 0. Returns a
    difference in accuracy units (0.05 = 5 points); 1.0 when even a total flip cannot be detected at this n.
    """
    if n <= 0:
        return float("inf")
    za = sps.norm.ppf(1 - alpha / 2)
    zb = sps.norm.ppf(power)
    pd_obs = min(max(discordance_rate, 0.0), 1.0)

    def gap(d: float) -> float:
        pd = max(pd_obs, d)
        need = (za * math.sqrt(pd) + zb * math.sqrt(max(pd - d * d, 0.0))) ** 2 / (d * d)
        return need - n  # > 0: d too small to detect with n pairs

    if gap(1.0) > 0:
        return 1.0
    return float(optimize.brentq(gap, 1e-9, 1.0, xtol=1e-9))


def mdd_continuous(se_diff: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable difference for a paired continuous statistic: (z_{1-alpha/2} + z_{power}) * SE(diff)
    (2.80 x SE at the defaults)."""
    za = sps.norm.ppf(1 - alpha / 2)
    zb = sps.norm.ppf(power)
    return float((za + zb) * se_diff)


def noninferiority_sample_size(margin: float, sd: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Paired samples a one-sided non-inferiority bound needs to fall under its threshold with probability
    `power`, when the true degradation lies `margin` below the threshold and a paired sample's degradation has
    standard deviation `sd`: the one-sample (paired) t test's sample size at effect size margin / sd, one-sided
    at alpha (statsmodels.stats.power.TTestPower.solve_power, alternative='larger'), rounded up. For a paired
    binary metric sd is the SD of the per-pair differences, sqrt(p_d - d^2): the normal approximation of
    McNemar's setting (Connor 1987). Needs margin > 0 and sd > 0."""
    from statsmodels.stats.power import TTestPower

    if not (margin > 0 and sd > 0):
        raise ValueError(f"a sample size needs margin > 0 and sd > 0, got {margin}, {sd}")
    n = TTestPower().solve_power(effect_size=margin / sd, alpha=alpha, power=power, alternative="larger")
    return max(2, math.ceil(float(np.asarray(n).item())))


# --------------------------------------------------------------------------------------------------------------
# Few paired units (windows): the paired t test


def t_interval(mean: float, se: float | None, n: int, alpha: float = ALPHA) -> tuple[float, float] | None:
    """mean +- t_{n-1, 1-alpha/2} * se: the interval of a mean over n independent units (windows) whose standard
    error is `se`; None with fewer than 2 units or no standard error."""
    if n < 2 or se is None or not math.isfinite(se):
        return None
    half = float(sps.t.ppf(1 - alpha / 2, n - 1)) * se
    return mean - half, mean + half


def paired_t(base: np.ndarray, other: np.ndarray, alpha: float = ALPHA) -> DiffTest:
    """Paired t test (scipy.stats.ttest_rel, two-sided) of mean(other - base) and its t interval (level 1 - alpha).

    For a handful of paired units, e.g. the windows of a KL-by-position measurement, each unit a mean over
    hundreds of tokens (close to normal): the BCa bootstrap needs more units than that (3 windows allow 10
    distinct resamples) and the Wilcoxon signed-rank test cannot reach p < 0.05 with fewer than 6. Differences
    that are all equal are known exactly: p = 1 when they are 0, else 0 (as bca_difference does). Needs n >= 2."""
    b, o = (np.asarray(x, dtype=np.float64) for x in (base, other))
    if b.shape != o.shape or b.ndim != 1 or b.size < 2:
        raise ValueError(f"paired arrays must be 1-D, aligned and hold >= 2 units, got {b.shape}, {o.shape}")
    d = o - b
    mean = float(d.mean())
    if float(np.ptp(d)) == 0.0:
        return DiffTest(mean, mean, 1.0 if mean == 0 else 0.0, 0.0)
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    p = float(sps.ttest_rel(o, b).pvalue)
    lo, hi = t_interval(mean, se, d.size, alpha) or (mean, mean)
    return DiffTest(lo, hi, p, se)
