"""Statistics for comparing two evaluation runs over the same samples.

Every corpus metric kvcal reports is a *ratio of weighted sums* over per-sample records:

    statistic = transform( sum_i num_i / sum_i den_i )

- a mean of per-sample scores (exact_match, acc, top1_agree): num_i = score_i, den_i = 1, transform = identity;
- lm-eval's weighted perplexity (word_perplexity, byte_perplexity): num_i = -loglikelihood_i,
  den_i = words_i (or bytes_i), transform = exp; bits_per_byte: transform = x / ln 2;
- kvcal's token-weighted KL: num_i = kl_i * n_tokens_i, den_i = n_tokens_i, transform = identity.

So one bootstrap handles them all: resample sample indices with replacement (the *same* indices for both runs,
which is what makes the bootstrap paired), recompute the statistic on each resample, read percentiles.
Everything is vectorised numpy and seeded, so a report is reproducible bit for bit.

Binary per-sample metrics (exact_match, acc) additionally get McNemar's exact test on the discordant pairs and
a minimum detectable difference from the observed discordance rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

ALPHA = 0.05
POWER = 0.8
DEFAULT_BOOTSTRAP = 2000
DEFAULT_SEED = 1234
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


@dataclass(frozen=True)
class PairedDiff:
    """Config minus baseline over the same n samples."""

    n: int
    base: float  # statistic of the baseline on the paired samples
    other: float  # statistic of the other run on the paired samples
    diff: float  # other - base
    ci_low: float  # paired bootstrap percentile interval of the difference
    ci_high: float
    se_diff: float  # bootstrap standard error of the difference
    rel_change: float | None  # (other - base) / |base|, None when base == 0
    rel_ci_low: float | None
    rel_ci_high: float | None
    confidence: float


def ratio_statistic(num: np.ndarray, den: np.ndarray, transform: Transform = identity) -> float:
    """transform(sum(num) / sum(den)) — the point estimate of a corpus metric."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    total = den.sum()
    if total == 0:
        return float("nan")
    return float(transform(np.asarray(num.sum() / total)))


def standard_error_of_mean(x: np.ndarray) -> float:
    """Sample standard error sqrt(var(x, ddof=1) / n), what lm-eval reports as `*_stderr`. 0 for n < 2."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 2:
        return 0.0
    return float(np.sqrt(x.var(ddof=1) / n))


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


def bootstrap_se(
    num: np.ndarray,
    den: np.ndarray | None = None,
    transform: Transform = identity,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
) -> float:
    """Bootstrap standard error of transform(sum(num)/sum(den)) (for perplexity-like corpus metrics)."""
    num = np.asarray(num, dtype=np.float64)
    den = np.ones_like(num) if den is None else np.asarray(den, dtype=np.float64)
    if num.size < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    s_num, s_den = _resample_sums([num, den], n_boot, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        vals = transform(s_num / s_den)
    vals = vals[np.isfinite(vals)]
    return float(vals.std(ddof=1)) if vals.size > 1 else 0.0


def paired_bootstrap(
    num_base: np.ndarray,
    num_other: np.ndarray,
    den_base: np.ndarray | None = None,
    den_other: np.ndarray | None = None,
    transform: Transform = identity,
    n_boot: int = DEFAULT_BOOTSTRAP,
    confidence: float = 0.95,
    seed: int = DEFAULT_SEED,
) -> PairedDiff:
    """Paired bootstrap interval of statistic(other) - statistic(base) over the same samples.

    Arrays are aligned: element i of every array belongs to sample i. Each resample draws n indices with
    replacement and applies them to both runs, so the sample-to-sample variation common to both cancels
    (that is what makes paired comparisons far tighter than comparing two separate error bars).
    The interval is the percentile interval; the relative-change interval (other/base - 1) comes from the
    same resamples.
    """
    nb = np.asarray(num_base, dtype=np.float64)
    no = np.asarray(num_other, dtype=np.float64)
    if nb.shape != no.shape or nb.ndim != 1:
        raise ValueError(f"paired arrays must be 1-D and aligned, got {nb.shape} and {no.shape}")
    db = np.ones_like(nb) if den_base is None else np.asarray(den_base, dtype=np.float64)
    do = np.ones_like(no) if den_other is None else np.asarray(den_other, dtype=np.float64)
    n = nb.size
    base = ratio_statistic(nb, db, transform)
    other = ratio_statistic(no, do, transform)
    diff = other - base
    rel = diff / abs(base) if base not in (0.0,) and math.isfinite(base) else None
    if n < 2:
        return PairedDiff(n, base, other, diff, diff, diff, 0.0, rel, rel, rel, confidence)
    rng = np.random.default_rng(seed)
    s_nb, s_db, s_no, s_do = _resample_sums([nb, db, no, do], n_boot, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        vb = transform(s_nb / s_db)
        vo = transform(s_no / s_do)
    d = vo - vb
    ok = np.isfinite(d)
    q = [(1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100]
    lo, hi = np.percentile(d[ok], q)
    se = float(d[ok].std(ddof=1))
    rel_lo = rel_hi = None
    if rel is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            r = d / np.abs(vb)
        r = r[np.isfinite(r)]
        if r.size:
            rel_lo, rel_hi = (float(v) for v in np.percentile(r, q))
    return PairedDiff(n, base, other, diff, float(lo), float(hi), se, rel, rel_lo, rel_hi, confidence)


def mcnemar_exact(base: np.ndarray, other: np.ndarray) -> tuple[float, int, int]:
    """McNemar's exact test for paired binary outcomes.

    b = #(base right, other wrong), c = #(base wrong, other right). Under H0 (same accuracy) each discordant
    pair is equally likely to go either way, so b ~ Binomial(b + c, 1/2); the two-sided p-value is scipy's
    exact binomial test. Concordant pairs carry no information about the difference. Returns (p, b, c);
    p = 1 when there are no discordant pairs.
    """
    bb = np.asarray(base, dtype=np.float64) > 0.5
    oo = np.asarray(other, dtype=np.float64) > 0.5
    b = int(np.sum(bb & ~oo))
    c = int(np.sum(~bb & oo))
    if b + c == 0:
        return 1.0, b, c
    p = stats.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue
    return float(min(1.0, p)), b, c


def is_binary(x: np.ndarray) -> bool:
    x = np.asarray(x, dtype=np.float64)
    return bool(np.all((x == 0.0) | (x == 1.0)))


def mdd_paired_binary(n: int, discordance_rate: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable difference in accuracy for McNemar's test with n pairs.

    Sample-size formula for McNemar's test (Connor 1987; Lachin 1992), with discordance rate
    p_d = P(pairs disagree) and true accuracy difference d:

        n = ( z_{1-alpha/2} * sqrt(p_d) + z_{power} * sqrt(p_d - d^2) )^2 / d^2

    solved here for d at the given n. A difference of d forces at least |d| of the pairs to disagree, so p_d is
    taken as max(observed discordance rate, d): with no discordant pairs observed (identical runs) the answer
    is about (z_{1-alpha/2} + z_{power})^2 / n = 7.85 / n rather than a meaningless 0. Defaults: alpha 0.05
    (two-sided), power 0.8. Returns a difference in accuracy units (0.05 = 5 points); 1.0 when even a total
    flip cannot be detected at this n.
    """
    if n <= 0:
        return float("inf")
    za = stats.norm.ppf(1 - alpha / 2)
    zb = stats.norm.ppf(power)
    pd_obs = min(max(discordance_rate, 0.0), 1.0)

    def gap(d: float) -> float:
        pd = max(pd_obs, d)
        need = (za * math.sqrt(pd) + zb * math.sqrt(max(pd - d * d, 0.0))) ** 2 / (d * d)
        return need - n  # > 0: d too small to detect with n pairs

    if gap(1.0) > 0:
        return 1.0
    return float(optimize.brentq(gap, 1e-9, 1.0, xtol=1e-9))


def mdd_continuous(se_diff: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable difference for a paired continuous statistic: (z_{1-alpha/2} + z_{power}) * SE(diff).

    SE(diff) is the paired bootstrap standard error of the difference (2.80 x SE at the defaults).
    """
    za = stats.norm.ppf(1 - alpha / 2)
    zb = stats.norm.ppf(power)
    return float((za + zb) * se_diff)


def relative_change(base: float, other: float) -> float | None:
    """(other - base) / |base|: for lower-is-better metrics (perplexity, KL) a positive value is a degradation."""
    if base == 0 or not math.isfinite(base) or not math.isfinite(other):
        return None
    return (other - base) / abs(base)
