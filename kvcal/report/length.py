"""Output length as a reported effect: per configuration and generative task, the paired change in generated
length (tokens) against the baseline, with its interval, and the optional gate on it (`--max-length-change`).

Why: a quantized cache can lengthen outputs (greedy loops that never reach the stop sequence; "Rethinking KV Cache
Compression", MLSys'25), which costs tokens (time, and the cache's own capacity gain) whatever the accuracy does.

What is paired, per document:
- lm-eval generative tasks (`output_type: generate_until`) of kvcal runs: the tokens the model generated
  (`gen_token_ids`, the mean over a document's repeats), the configuration's run against the baseline
  configuration's run, documents paired by doc_id (their first filter's record). Where a run kept text only
  (an engine's lm-eval output folder) both runs' texts are re-encoded with the checkpoint's tokenizer and the row
  counts text tokens (kvcal.report.text_tokens; the row's `unit`); without that tokenizer on this machine, no row.
- kvcal's divergence tasks: inside one run, the evaluated cache's greedy output (`quant_len`) against the BF16
  trajectory of the same prompt (`base_len`); the row's baseline is that BF16 cache.

The statistics are kvcal.report.stats': the difference of mean lengths (tokens) with its paired BCa bootstrap
interval and dual p-value (`bca_difference`), and the relative change (other / base - 1) with Fieller's interval
from the delta-method covariance (`paired_covariance`, `fieller_relative`), as the report's other relative changes.

The gate (`max_length_change`: a fraction, e.g. 0.25 = a quarter longer or shorter): under the regression gate a
row fails when the change is significant (p < alpha) and its relative size is beyond the threshold either way;
under the non-inferiority gate a row passes only when its relative interval lies inside (-threshold, +threshold)
(equivalence, as a non-inferiority bound on each side). A row with fewer than min_samples documents, or a baseline
length of 0, is not judged, and the gate does not pass what it could not judge (unless allow_unjudged).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvcal.errors import UsageError
from kvcal.io import read_jsonl
from kvcal.report import agreement, stats, text_tokens

GENERATE = "generate_until"
DIVERGENCE = "kvcal_divergence"
PASS, FAIL, UNJUDGED, REPORTED = "pass", "FAIL", "not judged", "reported"


@dataclass
class LengthChange:
    """One (configuration, task): mean generated tokens of the baseline and of the configuration over the paired
    documents, their difference (tokens) with its BCa interval and p-value, the relative change with its Fieller
    interval (None bounds: unbounded), and the gate's status ('reported' when no gate is set)."""

    config: str
    task: str
    baseline: str
    n: int
    base_mean: float
    mean: float
    diff: float
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    rel_change: float | None
    rel_ci_low: float | None
    rel_ci_high: float | None
    threshold: float | None = None
    status: str = REPORTED
    reason: str = ""
    unit: str = text_tokens.GENERATED  # or text_tokens.TEXT: both runs' texts re-encoded (a run kept no ids)

    @property
    def significant(self) -> bool:
        return self.p_value is not None and self.p_value < stats.ALPHA and self.diff != 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_length_change(
    base: Sequence[float],
    other: Sequence[float],
    *,
    config: str,
    task: str,
    baseline: str,
    alpha: float = stats.ALPHA,
    n_boot: int = stats.DEFAULT_BOOTSTRAP,
    seed: int = stats.DEFAULT_SEED,
    min_samples: int = stats.DEFAULT_MIN_SAMPLES,
) -> LengthChange:
    """The length change of `other` against `base`, aligned per document (tokens, [n] each)."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    n = int(b.size)
    bm, om = (float(b.mean()), float(o.mean())) if n else (0.0, 0.0)
    row = LengthChange(config, task, baseline, n, bm, om, om - bm, None, None, None, None, None, None)
    if n < max(2, min_samples):
        row.reason = f"{n} paired documents, fewer than the minimum {max(2, min_samples)} (--min-samples)"
        return row
    test = stats.bca_difference(b, o, alpha=alpha, n_boot=n_boot, seed=seed)
    row.ci_low, row.ci_high, row.p_value = test.ci_low, test.ci_high, test.p_value
    if bm > 0:
        row.rel_change = om / bm - 1
        ones = np.ones_like(b)
        vb, vo, cov = stats.paired_covariance(b, ones, o, ones)
        rel = stats.fieller_relative(bm, om, vb, vo, cov, alpha)
        if rel is not None:
            row.rel_ci_low, row.rel_ci_high = rel
    else:
        row.reason = "the baseline generated no tokens: a relative change has no meaning"
    return row


def judge_length(row: LengthChange, threshold: float | None, gate: str, alpha: float = stats.ALPHA) -> None:
    """Set the row's gate status (module docstring). gate: 'regression' | 'noninferiority'."""
    row.threshold = threshold
    if threshold is None:
        row.status = REPORTED
        return
    if row.p_value is None or row.rel_change is None:
        row.status, row.reason = UNJUDGED, row.reason or "no interval"
        return
    if gate == "noninferiority":
        lo, hi = row.rel_ci_low, row.rel_ci_high
        inside = lo is not None and hi is not None and -threshold < lo and hi < threshold
        row.status = PASS if inside else FAIL
        if not inside:
            row.reason = f"the relative change's interval is not inside ±{threshold:g}"
        return
    over = row.p_value < alpha and row.diff != 0 and abs(row.rel_change) > threshold
    row.status = FAIL if over else PASS
    if over:
        row.reason = f"significant length change of {row.rel_change:+.1%}, beyond ±{threshold:g}"


# ---- reading the runs ---------------------------------------------------------------------------------------


def _raw(run: Any, task: str) -> list[dict[str, Any]]:
    """The task's sample records as written (run.samples keeps metric values only)."""
    return read_jsonl(run.samples_path(task))


def check_max_length_change(value: float | None, name: str = "--max-length-change") -> float | None:
    """`--max-length-change` (or the setting NAME, e.g. a release YAML's gate.max_length_change): None (report
    only) or a fraction > 0."""
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(
            f"{name} must be a fraction of the baseline's length > 0 (e.g. 0.25 for a quarter), got {value:g}"
        )
    return float(value)


def generated_lengths(
    runs: tuple[Any, Any],
    recs: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]],
    docs: list[str],
    unit: str | None = None,
) -> tuple[tuple[list[float], list[float]], str] | None:
    """Per document the mean generated length over its repeats in each run, paired, and the unit: generated
    token ids, or text tokens where a run kept text only (kvcal.report.text_tokens); None without either."""
    got = text_tokens.paired_outputs(runs, recs, docs, unit)
    if got is None or not got[0]:
        return None
    outputs, unit = got
    pairs = [(float(np.mean([len(x) for x in a])), float(np.mean([len(x) for x in b]))) for a, b in outputs.values()]
    return ([a for a, _ in pairs], [b for _, b in pairs]), unit


def output_type(run: Any, task: str) -> str | None:
    """lm-eval's output_type of `task` in a run's results (configs), None when not recorded."""
    return ((run.results.get("configs") or {}).get(task) or {}).get("output_type")


def length_rows(
    configs: list[tuple[str, list[Any]]],
    *,
    alpha: float = stats.ALPHA,
    n_boot: int = stats.DEFAULT_BOOTSTRAP,
    seed: int = stats.DEFAULT_SEED,
    min_samples: int = stats.DEFAULT_MIN_SAMPLES,
    threshold: float | None = None,
    gate: str = "regression",
) -> list[LengthChange]:
    """Per (configuration, generative task) the paired length change (module docstring), judged against
    `threshold`. `configs`: (label, runs) with the baseline configuration first."""
    if not configs:
        return []
    base_label, base_runs = configs[0]
    kw = {"alpha": alpha, "n_boot": n_boot, "seed": seed, "min_samples": min_samples}
    rows: list[LengthChange] = []
    tasks = list(dict.fromkeys(t for _, runs in configs for r in runs for t in r.samples))
    for task in tasks:
        for label, runs in configs:
            run = next((r for r in runs if task in r.samples), None)
            if run is None:
                continue
            kind = output_type(run, task)
            if kind == DIVERGENCE:  # the run's own BF16 trajectory is the baseline
                recs = _raw(run, task)
                pairs = [(float(r["base_len"]), float(r["quant_len"])) for r in recs if "quant_len" in r]
                bf16 = "BF16 trajectory"
                rows.append(paired_length_change(
                    [a for a, _ in pairs], [b for _, b in pairs], config=label, task=task, baseline=bf16, **kw
                ))  # fmt: skip
                continue
            if kind != GENERATE or label == base_label:
                continue
            base_run = next((r for r in base_runs if task in r.samples), None)
            if base_run is None or output_type(base_run, task) != GENERATE:
                continue
            base, mine = agreement.first_filter_records(base_run, task), agreement.first_filter_records(run, task)
            got = generated_lengths((base_run, run), (base, mine), [d for d in base if d in mine])
            if got is None:  # text only, and no tokenizer on this machine
                continue
            (a, b), unit = got
            row = paired_length_change(a, b, config=label, task=task, baseline=base_label, **kw)
            rows.append(dataclasses.replace(row, unit=unit))
    for row in rows:
        judge_length(row, threshold, gate, alpha)
    return rows
