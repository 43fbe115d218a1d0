"""Which metrics a task is judged on, which way is better, and how each becomes a ratio of sums.

Each task is judged on its *key metrics*, picked the way lm-eval reports them:
gsm8k: exact_match under both filters (strict-match, flexible-extract); aime: exact_match; gpqa multiple-choice:
acc (acc_norm shown too); gpqa CoT/generative: exact_match per filter; wikitext: word_perplexity (lower is
better; byte_perplexity and bits_per_byte shown too); kvcal's kl task: kl (lower is better) and top1_agree.
Any other task: its first metric, every filter. The other metrics are shown as secondary (a multiple-choice
task's `gold_logprob` among them, kvcal.report.choices).

Engine vs emulation (kvcal.report.conformance) tests the key metrics' damage, except on a multiple-choice task
whose records give `gold_logprob`: there it tests gold_logprob instead of acc / acc_norm (`conformance_specs`),
the continuous quantity acc thresholds (the real engine on GPQA Diamond: "not shown" on acc, about 1,497 questions
needed; equivalent on gold_logprob at its 198, docs/studies/engine-gpqa-smollm2.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcal.report.choices import GOLD_LOGPROB
from kvcal.report.runs import Record, Run

# Metrics where lower is better (lm-eval's own higher_is_better flags in results.json take precedence).
LOWER_IS_BETTER = {"word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity", "kl", "ppl"}
# kvcal's kl windows: per-window means, weighted by the window's tokens
_TOKEN_WEIGHTED = {"kl", "top1_agree"}


@dataclass(frozen=True)
class MetricSpec:
    metric: str
    filter: str
    higher_is_better: bool
    transform: str  # key of stats.TRANSFORMS
    # "none" | "pair" (value is [ll, count]) | "tokens" (value is a per-window mean, weight n_tokens)
    weighted: str
    key: bool  # a key metric: judged by the verdict and the gate

    @property
    def label(self) -> str:
        return self.metric if self.filter in ("none", "") else f"{self.metric},{self.filter}"


def _higher_is_better(run: Run, task: str, metric: str) -> bool:
    hib = (run.results.get("higher_is_better") or {}).get(task) or {}
    if isinstance(hib, dict) and isinstance(hib.get(metric), bool):
        return hib[metric]
    return metric not in LOWER_IS_BETTER and "perplexity" not in metric


def key_metric_names(task: str, metrics: list[str]) -> list[str]:
    """The metrics of `task` the verdict and the gate judge (see the module docstring)."""
    t = task.lower()
    if t.startswith("gsm8k") or t.startswith("aime"):
        wanted = ["exact_match"]
    elif t.startswith("gpqa"):
        wanted = ["acc"] if "acc" in metrics else ["exact_match"]
    elif t.startswith("wikitext"):
        wanted = ["word_perplexity"]
    elif t == "kl" or t.startswith("kl_"):
        wanted = ["kl", "top1_agree"]
    else:
        wanted = metrics[:1]
    got = [m for m in wanted if m in metrics]
    return got or metrics[:1]


def _shape(metric: str, value: Any, has_tokens: bool) -> tuple[str, str]:
    """(weighted, transform) of a metric from one of its values."""
    if isinstance(value, (list, tuple)):
        if "bits" in metric:
            return "pair", "bits"
        return "pair", ("exp" if ("perplexity" in metric or metric == "ppl") else "identity")
    if metric in _TOKEN_WEIGHTED and has_tokens:
        return "tokens", "identity"
    return "none", "identity"


def metric_specs(run: Run, task: str) -> list[MetricSpec]:
    """Every (metric, filter) of a task in this run, key metrics first."""
    recs = run.samples[task]
    order = run.metric_order[task]
    filters = list(dict.fromkeys(flt for _, flt in recs))
    key_names = key_metric_names(task, order)
    has_tokens = "_n_tokens" in next(iter(recs.values()))
    specs: list[MetricSpec] = []
    for m in key_names + [m for m in order if m not in key_names]:
        weighted, transform = _shape(m, next(r[m] for r in recs.values() if m in r), has_tokens)
        for flt in filters:
            if any(k[1] == flt and m in r for k, r in recs.items()):
                hib = _higher_is_better(run, task, m)
                specs.append(MetricSpec(m, flt, hib, transform, weighted, m in key_names))
    return specs


def conformance_specs(run: Run, task: str) -> list[MetricSpec]:
    """The metrics engine vs emulation tests on `task` (module docstring): the key metrics, or gold_logprob for a
    multiple-choice task whose records give it."""
    specs = metric_specs(run, task)
    gold = [sp for sp in specs if sp.metric == GOLD_LOGPROB]
    if gold and any(sp.key and sp.metric.startswith("acc") for sp in specs):
        return [dataclasses.replace(g, key=True) for g in gold]
    return [sp for sp in specs if sp.key]


def arrays(recs: list[Record], spec: MetricSpec) -> tuple[np.ndarray, np.ndarray]:
    """(num, den), each [n], so that the statistic is transform(sum num / sum den)."""
    if spec.weighted == "pair":
        # lm-eval's perplexity records: [loglikelihood, words|bytes]; weighted perplexity = exp(-sum ll / sum n)
        num = np.array([-float(r[spec.metric][0]) for r in recs])
        den = np.array([float(r[spec.metric][1]) for r in recs])
    elif spec.weighted == "tokens":
        w = np.array([r.get("_n_tokens", 1.0) for r in recs], dtype=np.float64)
        num = np.array([float(r[spec.metric]) for r in recs]) * w
        den = w
    else:
        num = np.array([float(r[spec.metric]) for r in recs])
        den = np.ones_like(num)
    return num, den
