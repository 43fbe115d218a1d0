"""Judging measured differences: the gate policy, significance over the gate's family, the gate and the sentences.

- Too few paired samples (fewer than `min_samples`, `kvcal compare --min-samples`, default 10): the result is
  "insufficient data": no test, no interval, never FAIL. The gate does not pass a configuration it could not
  judge (this, or no task in common with the baseline): Comparison.gate_passed is False unless
  GateSettings.allow_unjudged (`--allow-unjudged`); the report and the JSON list it.
- Two gates (GateSettings.gate, `kvcal compare --gate`): REGRESSION fails a gated result that is a significant
  degradation beyond its threshold; NONINFERIORITY passes one only when the one-sided (1 - alpha) upper bound of
  its degradation is under the threshold, and prints the paired samples that would show it (stats.
  noninferiority_sample_size). A configuration passes non-inferiority when every gated result does (an
  intersection-union test: no multiplicity correction within it).
- Which metrics gate (`GatePolicy`, `--max-drop`): by default every task's key metric (kvcal.report.metrics)
  except those in REPORT_ONLY: kl for kvcal's kl task, exact_match for gsm8k / aime, acc for gpqa,
  word_perplexity for wikitext, the first metric of any other task. `top1_agree` is reported but gates only
  when the policy names it: argmax flips at near-ties, which even FP8 causes on a few percent of tokens
  (the table below: FP8 loses 3.9 to 5.3 points of it at a KL of 0.004-0.007 nats), so a fixed threshold on
  it fails every quantized cache. Any metric the policy names gates (a secondary one too).
- Thresholds: `--max-drop 0.02` (a bare number: the default for every gated metric), `--max-drop kl=0.05`
  (a metric in every task, `METRIC,FILTER` for one lm-eval filter), `--max-drop gsm8k/exact_match=0.03` (one
  task's metric); repeatable. The same as a YAML mapping (sweep/release configs):
  `max_drop: {default: 0.02, kl: 0.05, gsm8k/exact_match: 0.03}` -> `parse_gate_policy`. The most specific
  entry wins: TASK/METRIC,FILTER > TASK/METRIC > METRIC,FILTER > METRIC > default.
- The gate's family is every gated result tested: configurations x tasks x gated metrics x filters, less the
  insufficient ones. With Holm-Bonferroni (the default; `--no-multiple-testing-correction` turns it off) a gated
  result is significant when its Holm-adjusted p-value is below alpha, which keeps the chance of any false
  alarm in a whole report at alpha. Results outside the family (secondary metrics, top1_agree unless named)
  are judged on their own, unadjusted p-values.
- A threshold's unit is fixed by its metric (threshold_is_relative), never by the baseline's value: absolute for
  higher-is-better metrics (0.02 = 2 points of accuracy) and for kl (0.02 nats, against a BF16 baseline whose kl
  is 0 as against an FP8 one whose kl is 0.006), relative for the other lower-is-better ones (0.02 = perplexity
  up by 2%). A relative threshold against a baseline of ~0 is not judged (MetricResult.unjudged_reason).
- The minimum detectable change (80% power) is computed at the level a result has to clear: alpha / m for a
  gated result under Holm with m tests (what the first Holm step asks of a lone real regression), alpha
  otherwise.

Default thresholds: DEFAULT_MAX_DROP = 0.02 for every gated metric, with no per-metric override
(DEFAULT_METRIC_DROPS is empty): measured, 0.02 falls in the gap between FP8 and FP4 caches both as nats of KL
and as relative perplexity. `kvcal eval MODEL --tasks kl --limit 12 --kl-seq-len 128 --kv-format F [--scales
S]` (kvcal's embedded held-out text, 12 windows of 128 tokens, float32 on CPU; Gemma's FP8 scales from
`make demo`, SmolLM2's from `kvcal calibrate smollm2 --kv-format fp8_e4m3 --dataset ../shared/data/c4_calib
--num-samples 32 --seq-len 512`), each against a BF16 cache:

    model           configuration            kl (nats)   perplexity   top1_agree
    Gemma-3-270M    fp8_e4m3 uncalibrated    0.0044      +0.42 %      -3.9 points
    Gemma-3-270M    fp8_e4m3 calibrated      0.0054      +0.54 %      -4.7
    Gemma-3-270M    nvfp4                    0.071       +4.4 %       -16.7
    SmolLM2-135M    fp8_e4m3 calibrated      0.0067      +1.0 %       -5.3
    SmolLM2-135M    nvfp4                    0.078       +7.1 %       -16.5
    SmolLM2-135M    mxfp4                    0.156       +13.2 %      -22.3

- kl 0.02 nats: 3x the worst FP8 (0.0067), 3.5x below the best NVFP4 (0.071).
- perplexity 0.02 relative (wikitext's word_perplexity): FP8 moved it by at most 1.0 %, NVFP4 by 4.4 % or more
  (the kl task's token perplexity on the same windows).
- exact_match (gsm8k, aime) and acc (gpqa) 0.02 absolute = 2 points: not calibrated on these models (135M and
  270M parameters score near chance on them); at the sample sizes those tasks have, the minimum detectable
  change is usually larger than 2 points anyway, and the report prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvcal.errors import UsageError
from kvcal.report import stats

HOLM, NO_CORRECTION = "holm", "none"
INSUFFICIENT = "insufficient data"
NO_COMMON_TASK = "not judged: no task in common"
# The two gates (`kvcal compare --gate`, release YAML `gate.mode`): REGRESSION fails a configuration that is
# shown worse than its threshold; NONINFERIORITY passes only one that is shown better than worse-by-the-threshold.
REGRESSION, NONINFERIORITY = "regression", "noninferiority"
GATES = (REGRESSION, NONINFERIORITY)
# Lower-is-better metrics whose threshold is absolute whatever the baseline (a divergence from the BF16 reference,
# in nats): the baseline's own KL (0 for BF16, ~0.006 for FP8) must not turn 0.02 nats into 2%.
ABSOLUTE_LOWER_IS_BETTER = frozenset({"kl"})

DEFAULT_MAX_DROP = 0.02
# Per-metric defaults where one differs from DEFAULT_MAX_DROP (selector -> threshold); see the module docstring.
DEFAULT_METRIC_DROPS: dict[str, float] = {}
# Key metrics that are reported but gate only when the policy names them.
REPORT_ONLY = frozenset({"top1_agree"})
DEFAULT_KEY = "default"


@dataclass(frozen=True)
class GatePolicy:
    """Which results gate and at what threshold. `thresholds`: selector -> threshold, a selector being METRIC,
    METRIC,FILTER, TASK/METRIC or TASK/METRIC,FILTER; `default`: every other gated (key, not REPORT_ONLY) metric."""

    default: float = DEFAULT_MAX_DROP
    thresholds: tuple[tuple[str, float], ...] = tuple(DEFAULT_METRIC_DROPS.items())

    def threshold(self, task: str, metric: str, filter: str, key: bool) -> float | None:
        """The threshold of one result, or None when it does not gate."""
        named = dict(self.thresholds)
        flt = "" if filter in ("none", "") else f",{filter}"
        for selector in (f"{task}/{metric}{flt}", f"{task}/{metric}", f"{metric}{flt}", metric):
            if selector in named:
                return named[selector]
        return self.default if key and metric not in REPORT_ONLY else None

    def names(self) -> list[str]:
        return [sel for sel, _ in self.thresholds]

    def to_dict(self) -> dict[str, float]:
        """The YAML/JSON mapping `parse_gate_policy` reads back to this policy."""
        return {DEFAULT_KEY: self.default, **dict(self.thresholds)}

    def describe(self) -> str:
        """'0.02 for every gated metric; kl 0.05; gsm8k/exact_match 0.03'."""
        parts = [f"{self.default:g} for every gated metric"]
        parts += [f"{sel} {v:g}" for sel, v in self.thresholds]
        return "; ".join(parts)


def _threshold_value(raw: object, where: str) -> float:
    if isinstance(raw, bool):
        raise UsageError(f"{where}: expected a number >= 0, got {raw!r}")
    try:
        v = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UsageError(f"{where}: expected a number >= 0 (e.g. 0.02), got {raw!r}") from None
    if not math.isfinite(v) or v < 0:
        raise UsageError(f"{where}: the threshold must be a finite number >= 0, got {raw!r}")
    return v


def _selector(name: object, where: str) -> str:
    sel = str(name).strip() if isinstance(name, str) else ""
    task, slash, metric = sel.rpartition("/")
    if not sel or not metric.strip(", ") or (slash and not task.strip()) or sel.count("/") > 1 or " " in sel:
        raise UsageError(
            f"{where}: {name!r} is not a metric; write METRIC=VALUE, METRIC,FILTER=VALUE or TASK/METRIC=VALUE "
            "(e.g. kl=0.05, gsm8k/exact_match=0.03)"
        )
    return sel


def _from_entries(entries: list[tuple[str | None, object]], where: str) -> GatePolicy:
    """(selector or None for the default, raw value) pairs -> the policy. A default given replaces the built-in
    per-metric defaults too (a bare number is the default for every gated metric); named entries win over both."""
    defaults = [raw for sel, raw in entries if sel is None]
    if len(defaults) > 1:
        raise UsageError(f"{where}: {len(defaults)} default thresholds given ({', '.join(map(str, defaults))}); "
                         "give one bare number and name the metrics that differ (METRIC=VALUE)")  # fmt: skip
    named: dict[str, float] = {} if defaults else dict(DEFAULT_METRIC_DROPS)
    seen: set[str] = set()
    for sel, raw in entries:
        if sel is None:
            continue
        if sel in seen:
            raise UsageError(f"{where}: {sel} is given twice; give each metric one threshold")
        seen.add(sel)
        named[sel] = _threshold_value(raw, f"{where} {sel}")
    default = _threshold_value(defaults[0], where) if defaults else DEFAULT_MAX_DROP
    return GatePolicy(default=default, thresholds=tuple(named.items()))


def parse_gate_policy(
    values: list[str] | dict | float | GatePolicy | None, where: str = "--max-drop"
) -> GatePolicy:
    """The gate policy from `--max-drop` values (['0.02', 'kl=0.05', 'gsm8k/exact_match=0.03']), a YAML mapping
    ({'default': 0.02, 'kl': 0.05, 'gsm8k/exact_match': 0.03}) or one number; None -> the built-in defaults.
    UsageError (naming `where`) for anything else."""
    if values is None:
        return GatePolicy()
    if isinstance(values, GatePolicy):
        return values
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        return _from_entries([(None, values)], where)
    if isinstance(values, str):
        values = [values]
    if isinstance(values, dict):
        entries = [(None if k == DEFAULT_KEY else _selector(k, where), v) for k, v in values.items()]
        return _from_entries(entries, where)
    if isinstance(values, (list, tuple)):
        parsed: list[tuple[str | None, object]] = []
        for item in values:
            text = str(item).strip()
            sel, eq, raw = text.rpartition("=")
            parsed.append((_selector(sel, where), raw) if eq else (None, text))
        return _from_entries(parsed, where)
    raise UsageError(
        f"{where} must be a number, a list of METRIC=VALUE / TASK/METRIC=VALUE entries or a mapping "
        f"{{default: 0.02, kl: 0.05}}, got {type(values).__name__}"
    )


def threshold_is_relative(metric: str, higher_is_better: bool) -> bool:
    """The unit of a metric's threshold, fixed by the metric (never by the baseline's value): relative for
    lower-is-better metrics (perplexities: 0.02 = up by 2%), absolute for higher-is-better ones (0.02 = 2 points)
    and for kl (0.02 nats)."""
    return not higher_is_better and metric not in ABSOLUTE_LOWER_IS_BETTER


@dataclass(frozen=True)
class GateSettings:
    policy: GatePolicy = field(default_factory=GatePolicy)
    alpha: float = stats.ALPHA
    min_samples: int = stats.DEFAULT_MIN_SAMPLES
    multiple_testing: str = HOLM  # HOLM | NO_CORRECTION
    gate: str = REGRESSION  # REGRESSION | NONINFERIORITY
    allow_unjudged: bool = False  # a configuration the gate could not judge passes (--allow-unjudged)
    power: float = stats.POWER  # of the sample size a non-inferiority result would need

    @property
    def max_drop(self) -> float:
        """The default threshold (what a bare --max-drop sets)."""
        return self.policy.default


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
    gate_threshold: float | None = None  # the policy's threshold; None: not gated (reported only)
    p_adjusted: float | None = None  # Holm over the gate's family (gated results tested); None otherwise
    mdd: float | None = None  # minimum detectable difference (metric units); None: insufficient data
    mdd_rel: float | None = None  # the same relative to the baseline (lower-is-better metrics)
    significant: bool = False
    worse: bool = False  # significant degradation
    better: bool = False  # significant improvement
    gate_fail: bool = False
    status: str = ""  # FAIL | worse | better | n.s. | identical | insufficient data | not judged
    verdict: str = ""
    # The threshold's unit: "absolute" (points, nats) or "relative" (threshold_is_relative).
    threshold_unit: str = "absolute"
    unjudged_reason: str = ""  # a gated result with data that cannot be judged (a relative threshold, base ~0)
    # Non-inferiority (computed for every judged result): the degradation in the threshold's unit, its one-sided
    # upper confidence bound (level 1 - alpha; inf: unbounded) and the per-sample SD a sample size is planned on.
    degradation: float | None = None
    ni_upper: float | None = None
    ni_sd: float | None = None
    ni_passed: bool | None = None  # upper bound < threshold (None: not gated or not judged)
    ni_n_needed: int | None = None  # paired samples that would show it at `power` (None: none would / passed)

    @property
    def gated(self) -> bool:
        return self.gate_threshold is not None

    @property
    def unjudged(self) -> bool:
        """A gated result the gate could not judge: too few samples, or a threshold with no meaning here."""
        return self.gated and (self.insufficient or bool(self.unjudged_reason))


def gate_family(results: list[MetricResult]) -> list[MetricResult]:
    """The tests the gate's multiple-testing correction covers: gated results with enough data."""
    return [r for r in results if r.gated and not r.unjudged and r.p_value is not None]


def judge(results: list[MetricResult], s: GateSettings) -> None:
    """Fill in the threshold, p_adjusted, significance, the detectable change, the gate and the verdict of
    every result."""
    for r in results:
        r.gate_threshold = s.policy.threshold(r.task, r.metric, r.filter, r.key)
    family = gate_family(results)
    holm = s.multiple_testing == HOLM and bool(family)
    if holm:
        raw = [r.p_value for r in family if r.p_value is not None]  # every one: see gate_family
        for r, p in zip(family, stats.holm(raw, s.alpha), strict=True):
            r.p_adjusted = p
    family_alpha = s.alpha / len(family) if holm else s.alpha
    for r in results:
        _judge_one(r, s, family_alpha if r.gated else s.alpha)


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
    relative = threshold_is_relative(r.metric, r.higher_is_better)
    r.threshold_unit = "relative" if relative else "absolute"
    if r.gated and not (math.isfinite(r.score) and math.isfinite(r.base)):
        # a run that scored samples NaN / inf (an engine's NaN log-likelihood): nothing to gate on
        which, value = ("the configuration", r.score) if not math.isfinite(r.score) else ("the baseline", r.base)
        r.unjudged_reason = (
            f"{which}'s {r.label} on {r.task} is {value:.3g}: its run scored samples non-finite (NaN or "
            "infinite); not judged"
        )
    elif relative and r.rel_change is None and r.gated:
        # A relative threshold against a baseline of ~0 has no meaning; say so instead of switching units.
        r.unjudged_reason = (
            f"the baseline's {r.label} on {r.task} is ~0 ({r.base:.3g}): a relative threshold has no meaning "
            "against it; not judged"
        )
    if r.gated and not r.unjudged_reason and r.degradation is not None:
        if r.ni_upper is not None:  # measured where the gate is non-inferiority
            _noninferiority(r, s)
        if s.gate == NONINFERIORITY:
            r.gate_fail = not r.ni_passed
        else:
            r.gate_fail = bool(r.worse and r.gate_threshold is not None and r.degradation > r.gate_threshold)
    if r.binary and r.discordant is not None:
        r.mdd = stats.mdd_paired_binary(r.n, sum(r.discordant) / r.n, alpha=mdd_alpha)
    else:
        r.mdd = stats.mdd_continuous(r.se_diff, alpha=mdd_alpha)
    if not r.higher_is_better and r.rel_change is not None and r.base != 0:
        r.mdd_rel = r.mdd / abs(r.base)
    r.status = _status(r)
    r.verdict = r.unjudged_reason or metric_verdict(r)
    if s.gate == NONINFERIORITY and r.gated and not r.unjudged_reason:
        r.verdict = noninferiority_verdict(r, s)


def _noninferiority(r: MetricResult, s: GateSettings) -> None:
    """Whether the one-sided upper bound of the degradation is under the threshold, and the paired samples that
    would show it (a one-sided paired t test's sample size at s.power, statsmodels.stats.power.TTestPower, for a
    true degradation equal to the estimate and the per-sample SD measured here)."""
    assert r.gate_threshold is not None and r.degradation is not None and r.ni_upper is not None
    r.ni_passed = bool(r.ni_upper < r.gate_threshold)
    if r.ni_passed:
        return
    margin = r.gate_threshold - r.degradation
    if margin <= 0:
        r.ni_n_needed = None  # the estimate itself is at or over the threshold: no sample size shows it
        return
    sd = r.ni_sd
    if not sd and math.isfinite(r.ni_upper):
        # no spread between the runs (identical per-sample results): plan on the SD the bound itself implies,
        # bound = estimate + z_{1-alpha} sd / sqrt(n)
        sd = (r.ni_upper - r.degradation) * math.sqrt(r.n) / float(stats.sps.norm.ppf(1 - s.alpha))
    r.ni_n_needed = stats.noninferiority_sample_size(margin, sd, s.alpha, s.power) if sd and sd > 0 else None


def _in_unit(r: MetricResult, x: float) -> str:
    x += 0.0  # -0.0 -> 0.0
    if r.threshold_unit == "relative":
        return f"{x:.1%}"
    return f"{x:.4g}{' nats' if r.metric == 'kl' else ''}"


def noninferiority_verdict(r: MetricResult, s: GateSettings) -> str:
    """One sentence on one gated result's non-inferiority: shown, or not and what it would take."""
    where = f"{r.task} {r.label}"
    level = f"{1 - s.alpha:.0%}"
    if r.ni_passed is None or r.gate_threshold is None or r.degradation is None or r.ni_upper is None:
        return r.verdict
    thr = f"{_in_unit(r, r.gate_threshold)} ({r.threshold_unit})"
    bound = "unbounded" if not math.isfinite(r.ni_upper) else _in_unit(r, r.ni_upper)
    if r.ni_passed:
        return f"non-inferior on {where}: degradation at most {bound} ({level} one-sided upper bound) < {thr}"
    head = f"not shown non-inferior on {where}: the {level} upper bound of the degradation is {bound}, not under {thr}"
    if r.ni_n_needed is None:
        return f"{head}; the estimate itself ({_in_unit(r, r.degradation)}) is not under it: no sample size would"
    return (
        f"{head}; about {r.ni_n_needed} paired samples (now {r.n}) would show it with {s.power:.0%} power if the "
        f"true degradation is the estimate, {_in_unit(r, r.degradation)}"
    )


def _status(r: MetricResult) -> str:
    if r.unjudged_reason:
        return "not judged"
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
    """One sentence per configuration over its key and gated results, the worst news first; 'no significant
    change' always carries the minimum detectable change, so it is not read as 'no change'; results without
    enough data are named."""
    if not key_results:
        return "not judged: no task in common with the baseline"
    judged = [r for r in key_results if not r.insufficient and not r.unjudged_reason]
    lacking = [r for r in key_results if r.insufficient]
    odd = [r for r in key_results if r.unjudged_reason and not r.insufficient]
    parts: list[str] = []
    worse = [r for r in judged if r.worse]
    for r in worse:
        if not r.gated:
            over = " (reported, not gated)"
        else:
            over = " (over the gate threshold)" if r.gate_fail else " (within the gate threshold)"
        parts.append(r.verdict + over)
    if judged and not worse:
        parts.append(_no_change_sentence(judged))
    parts.extend(r.verdict for r in judged if r.better)
    if lacking:
        where = ", ".join(f"{r.task} {r.label} (n = {r.n})" for r in lacking)
        parts.append(f"{INSUFFICIENT} on {where}: not judged")
    parts.extend(r.unjudged_reason for r in odd)
    return "; ".join(parts)


def config_gate(results: list[MetricResult]) -> str:
    """'FAIL' | 'insufficient data' (nothing failed, but some gated result lacks data or could not be judged) |
    'not judged: no task in common' (no result at all) | 'pass'."""
    if not results:
        return NO_COMMON_TASK
    gated = [r for r in results if r.gated]
    if any(r.gate_fail for r in gated):
        return "FAIL"
    return INSUFFICIENT if any(r.unjudged for r in gated) else "pass"


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
