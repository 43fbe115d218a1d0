"""Judging measured differences: significance over the gate's family, the regression gate, and the sentences.

- Too few paired samples (fewer than `min_samples`, `kvcal compare --min-samples`, default 10): the result is
  "insufficient data": no test, no interval, never FAIL and never a pass on its merits. The gate does not fail
  on it; the report and the JSON list it.
- The gate's family is every key metric tested: configurations x tasks x key metrics x filters, less the
  insufficient ones. With Holm-Bonferroni (the default; `--no-multiple-testing-correction` turns it off) a key
  result is significant when its Holm-adjusted p-value is below alpha, which keeps the chance of any false
  alarm in a whole report at alpha. Secondary metrics are judged on their own, unadjusted p-values.
- A key result fails the gate when it is a significant degradation larger than `max_drop`: absolute for
  higher-is-better metrics (0.02 = 2 points of accuracy), relative for lower-is-better ones (0.02 = perplexity or
  KL up by 2%). Where the baseline is ~0 (kvcal's kl of a BF16 run, measured against a BF16 cache) there is no
  relative change and the threshold is absolute (0.02 nats of KL).
- The minimum detectable change (80% power) is computed at the level a result has to clear: alpha / m for a key
  result under Holm with m tests (what the first Holm step asks of a lone real regression), alpha otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcal.report import stats

HOLM, NO_CORRECTION = "holm", "none"
INSUFFICIENT = "insufficient data"


@dataclass(frozen=True)
class GateSettings:
    max_drop: float = 0.02
    alpha: float = stats.ALPHA
    min_samples: int = stats.DEFAULT_MIN_SAMPLES
    multiple_testing: str = HOLM  # HOLM | NO_CORRECTION


@dataclass
class MetricResult:
    """One (configuration, task, metric, filter) compared with the baseline over the paired samples."""

    task: str
    config: str
    metric: str
    filter: str
    label: str
    key: bool
    higher_is_better: bool
    binary: bool
    n: int  # paired samples
    n_base_total: int
    n_other_total: int
    base: float
    base_se: float
    score: float
    score_se: float
    diff: float
    ci_low: float | None  # None: insufficient data
    ci_high: float | None
    interval: str  # "newcombe" (binary) | "bca" (others) | "none" (insufficient data)
    rel_change: float | None  # None where the baseline is ~0
    rel_ci_low: float | None  # None: unbounded (see rel_ci_unbounded) or no relative change
    rel_ci_high: float | None
    rel_ci_unbounded: bool  # Fieller: the baseline is not significantly different from 0
    p_value: float | None  # McNemar exact (binary) or the BCa interval's dual p; None: insufficient data
    discordant: tuple[int, int] | None  # (base right & other wrong, base wrong & other right)
    se_diff: float
    identical: bool
    insufficient: bool
    p_adjusted: float | None = None  # Holm over the gate's family (key metrics tested); None otherwise
    mdd: float | None = None  # minimum detectable difference (metric units); None: insufficient data
    mdd_rel: float | None = None  # the same relative to the baseline (lower-is-better metrics)
    significant: bool = False
    worse: bool = False  # significant degradation
    better: bool = False  # significant improvement
    gate_fail: bool = False
    status: str = ""  # FAIL | worse | better | n.s. | identical | insufficient data
    verdict: str = ""


def gate_family(results: list[MetricResult]) -> list[MetricResult]:
    """The tests the gate's multiple-testing correction covers: key metrics with enough data."""
    return [r for r in results if r.key and not r.insufficient and r.p_value is not None]


def judge(results: list[MetricResult], s: GateSettings) -> None:
    """Fill in p_adjusted, significance, the detectable change, the gate and the verdict of every result."""
    family = gate_family(results)
    holm = s.multiple_testing == HOLM and bool(family)
    if holm:
        raw = [r.p_value for r in family if r.p_value is not None]  # every one: see gate_family
        for r, p in zip(family, stats.holm(raw, s.alpha), strict=True):
            r.p_adjusted = p
    key_alpha = s.alpha / len(family) if holm else s.alpha
    for r in results:
        _judge_one(r, s, key_alpha if r.key else s.alpha)


def _judge_one(r: MetricResult, s: GateSettings, mdd_alpha: float) -> None:
    if r.insufficient:
        r.status = INSUFFICIENT
        r.verdict = (
            f"{INSUFFICIENT} on {r.task} {r.label}: {r.n} paired samples, fewer than the minimum {s.min_samples} "
            "(--min-samples); not judged"
        )
        return
    p = r.p_adjusted if r.p_adjusted is not None else r.p_value
    r.significant = bool(p is not None and p < s.alpha and not r.identical)
    degrade = -r.diff if r.higher_is_better else r.diff
    r.worse, r.better = r.significant and degrade > 0, r.significant and degrade < 0
    if r.higher_is_better or r.rel_change is None:
        magnitude = degrade
    else:
        magnitude = r.rel_change
    r.gate_fail = bool(r.worse and r.key and magnitude > s.max_drop)
    if r.binary and r.discordant is not None:
        r.mdd = stats.mdd_paired_binary(r.n, sum(r.discordant) / r.n, alpha=mdd_alpha)
    else:
        r.mdd = stats.mdd_continuous(r.se_diff, alpha=mdd_alpha)
    if not r.higher_is_better and r.rel_change is not None and r.base != 0:
        r.mdd_rel = r.mdd / abs(r.base)
    r.status = _status(r)
    r.verdict = metric_verdict(r)


def _status(r: MetricResult) -> str:
    if r.gate_fail:
        return "FAIL"
    if r.identical:
        return "identical"
    return "worse" if r.worse else ("better" if r.better else "n.s.")


def metric_verdict(r: MetricResult) -> str:
    """One sentence on one judged result; 'no significant change' carries what could have been missed."""
    where = f"{r.task} {r.label}"
    if r.higher_is_better:
        if r.worse or r.better:
            return f"significant {'drop' if r.worse else 'gain'} of {abs(r.diff):.3f} on {where}"
        change = "drops"
    else:
        rel = f"{abs(r.rel_change):.1%}" if r.rel_change is not None else f"{abs(r.diff):.4g}"
        if r.worse or r.better:
            return f"significant {'increase' if r.worse else 'decrease'} of {rel} in {r.label} on {r.task}"
        change = "increases"
    if not r.mdd:
        return f"no significant change on {where} (identical per-sample results)"
    same = "identical per-sample results; " if r.identical else ""
    if r.mdd_rel is not None:
        miss = f"{r.mdd_rel:.1%}"
    else:
        miss = f"{r.mdd:.3f}" if r.higher_is_better else f"{r.mdd:.4g}"
    return f"no significant change on {where} ({same}could miss {change} below {miss})"


def _missable(r: MetricResult) -> str | None:
    if r.better or not r.mdd or r.insufficient:
        return None
    if r.higher_is_better or r.mdd_rel is None:
        return f"{r.mdd:.3g} on {r.task} {r.label}"
    return f"{r.mdd_rel:.1%} on {r.task} {r.label}"


def _no_change_sentence(judged: list[MetricResult]) -> str:
    mdds = [m for m in (_missable(r) for r in judged) if m]
    same = "identical per-sample results; " if all(r.identical for r in judged) else ""
    if mdds:
        return f"no significant change on any task ({same}could miss changes below {'; '.join(mdds)})"
    return "no significant change on any task" + (" (identical per-sample results)" if same else "")


def config_verdict(key_results: list[MetricResult]) -> str:
    """One sentence per configuration, the worst news first; 'no significant change' always carries the
    minimum detectable change, so it is not read as 'no change'; results without enough data are named."""
    if not key_results:
        return "no tasks in common with the baseline"
    judged = [r for r in key_results if not r.insufficient]
    lacking = [r for r in key_results if r.insufficient]
    parts: list[str] = []
    worse = [r for r in judged if r.worse]
    for r in worse:
        over = " (over the gate threshold)" if r.gate_fail else " (within the gate threshold)"
        parts.append(r.verdict + over)
    if judged and not worse:
        parts.append(_no_change_sentence(judged))
    parts.extend(r.verdict for r in judged if r.better)
    if lacking:
        where = ", ".join(f"{r.task} {r.label} (n = {r.n})" for r in lacking)
        parts.append(f"{INSUFFICIENT} on {where}: not judged")
    return "; ".join(parts)


def config_gate(key_results: list[MetricResult]) -> str:
    """'FAIL' | 'insufficient data' (nothing failed, but some key result lacks data) | 'pass'."""
    if any(r.gate_fail for r in key_results):
        return "FAIL"
    return INSUFFICIENT if any(r.insufficient for r in key_results) else "pass"


def bootstrap_resolution_warning(results: list[MetricResult], s: GateSettings, n_boot: int) -> str | None:
    """A bootstrap p-value cannot go much below 1 / resamples; Holm's first step asks for alpha / m."""
    family = [r for r in gate_family(results) if r.interval == "bca"]
    m = len(gate_family(results))
    if not family or s.multiple_testing != HOLM or 1.0 / n_boot < s.alpha / m:
        return None
    need = math.ceil(2 * m / s.alpha)
    return (
        f"{n_boot} bootstrap resamples cannot give p-values below ~{1 / n_boot:.2g}, and Holm over {m} tests asks "
        f"for p < {s.alpha / m:.2g}: a real change in a non-binary metric may not reach significance; "
        f"raise --bootstrap to {need} or more"
    )
