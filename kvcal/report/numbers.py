"""How the Markdown and HTML reports write numbers, intervals and statuses (one place, so both read the same)."""

from __future__ import annotations

import math

from kvcal.report.verdicts import HOLM, INSUFFICIENT, MetricResult

# What each kind of interval is, in the reports' words.
INTERVAL_NAMES = {
    "newcombe": "Newcombe (paired), consistent with McNemar",
    "bca": "paired BCa bootstrap",
    "none": "none (insufficient data)",
}


def f(x: float | None, digits: int = 3) -> str:
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


def sig(x: float | None, digits: int = 4) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}g}"


def pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:+.2%}"


def p(x: float | None) -> str:
    if x is None:
        return "—"
    return "<0.001" if x < 0.001 else f"{x:.3f}"


def mult(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def duration(seconds: float | None) -> str:
    """A time, 4 significant digits: milliseconds below a second ('12.34 ms'), else seconds ('22.28 s')."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    return f"{seconds * 1e3:.4g} ms" if abs(seconds) < 1 else f"{seconds:.4g} s"


def _accuracy_like(r: MetricResult) -> bool:
    return r.higher_is_better and abs(r.base) <= 1


def score(r: MetricResult, base: bool = False) -> str:
    v, se = (r.base, r.base_se) if base else (r.score, r.score_se)
    if r.higher_is_better and abs(v) <= 1:
        return f"{v:.3f} ± {se:.3f}"
    return f"{sig(v)} ± {sig(se, 2)}"


def diff(r: MetricResult) -> str:
    """The difference and its interval, e.g. '-0.180 [-0.235, -0.125]'."""
    point = f"{r.diff:+.3f}" if _accuracy_like(r) else f"{r.diff:+.4g}"
    if r.ci_low is None or r.ci_high is None:
        return f"{point} [{INSUFFICIENT}]"
    if _accuracy_like(r):
        return f"{point} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
    return f"{point} [{r.ci_low:+.4g}, {r.ci_high:+.4g}]"


def rel(r: MetricResult) -> str:
    """The relative change and its Fieller interval ('unbounded' where the baseline is not clearly nonzero)."""
    if r.rel_change is None:
        return "n/a"
    if r.rel_ci_unbounded:
        return f"{pct(r.rel_change)} [unbounded]"
    if r.rel_ci_low is None or r.rel_ci_high is None:
        return pct(r.rel_change)
    return f"{pct(r.rel_change)} [{pct(r.rel_ci_low)}, {pct(r.rel_ci_high)}]"


def mdd(r: MetricResult) -> str:
    if r.mdd is None:
        return "n/a"
    if not r.higher_is_better and r.mdd_rel is not None:
        return f"{r.mdd_rel:.2%}"
    return f(r.mdd) if _accuracy_like(r) else sig(r.mdd)


def p_column(r: MetricResult) -> str:
    """'p' or 'p (adjusted p)' of a result."""
    if r.p_value is None:
        return "—"
    if r.p_adjusted is None:
        return p(r.p_value)
    return f"{p(r.p_value)} ({p(r.p_adjusted)})"


def gate_line(
    failures: int,
    insufficient: int,
    no_common: int = 0,
    allow_unjudged: bool = False,
    mode: str = "regression",
    mismatched: int = 0,
    conformance_unjudged: int = 0,
) -> str:
    """The gate's one line: what failed (results over the threshold, engine runs whose damage is not equivalent
    to their emulation's), or what was not judged (which fails unless --allow-unjudged)."""
    if failures or mismatched:
        what = "regression(s)" if mode == "regression" else "result(s) not shown non-inferior"
        parts = ([f"{failures} {what}"] if failures else []) + (
            [f"{mismatched} engine run(s) not equivalent to their emulation"] if mismatched else []
        )
        return f"FAILED ({'; '.join(parts)})"
    unjudged = []
    if conformance_unjudged:
        unjudged.append(f"{conformance_unjudged} engine run(s) not shown equivalent to their emulation")
    if insufficient:
        unjudged.append(f"{insufficient} key result(s) had {INSUFFICIENT} and were not judged")
    if no_common:
        unjudged.append(f"{no_common} configuration(s) had no task in common with the baseline")
    if unjudged and not allow_unjudged:
        return f"FAILED: {'; '.join(unjudged)} (--allow-unjudged lets them pass)"
    if unjudged:
        return f"PASSED (--allow-unjudged), but {'; '.join(unjudged)}"
    return "PASSED"


def correction_words(multiple_testing: str, alpha: float) -> str:
    if multiple_testing == HOLM:
        return f"Holm-Bonferroni over the gated metrics tested (family-wise error rate {alpha:g})"
    return "none (each gated metric tested on its own at alpha; --no-multiple-testing-correction)"


def threshold(r: MetricResult) -> str:
    """The gate threshold of a result in its unit (verdicts.threshold_is_relative): '0.02 absolute', '0.02 nats
    absolute', '0.02 relative (2.0%)'."""
    t = r.gate_threshold
    if t is None:
        return "not gated"
    if r.threshold_unit == "relative":
        return f"{t:.3g} relative ({t:.1%})"
    return f"{t:g}{' nats' if r.metric == 'kl' else ''} absolute"


def role(r: MetricResult) -> str:
    """'key metric, gated at 0.02 absolute' | 'key metric, reported (not gated)' | 'secondary' | ..."""
    kind = "key metric" if r.key else "secondary"
    if r.gated:
        return f"{kind}, gated at {threshold(r)}"
    return f"{kind}, reported (not gated)" if r.key else kind


def tokens(n: int) -> str:
    """A token count as people write contexts: 8192 -> '8k', 32768 -> '32k', 4000 -> '4000'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def capacity_heading(context: int | None) -> str:
    """The capacity column's heading: 'tokens vs BF16' or 'tokens vs BF16 @ 8k context'."""
    return "tokens vs BF16" if context is None else f"tokens vs BF16 @ {tokens(context)} context"


def depth(d: float) -> str:
    """A passkey depth as a percentage: 0.5 -> '50%'."""
    return f"{100 * d:.0f}%"
