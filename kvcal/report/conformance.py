"""Engine vs emulation: does an engine's run compute what its configuration claims?

An engine run (an lm-eval output of `--model vllm | sglang`, or any run named with `--conformance ENGINE=EMU`) is
paired with kvcal's emulation of the same configuration (kv format, scales, skip layers) over the samples both
scored. kvcal's emulation is exact for each format (kvcal.formats), so a faithful engine differs from it only by
its kernels' rounding: per-sample answers agree almost everywhere and no key metric differs significantly. An
engine that loads scales and never delivers them to the kernel (scale 1.0), drops block scales, or duplicates
tokens computes a different cache: the paired difference shows it.

Per pair and key metric (kvcal.report.metrics): the agreement (share of paired samples whose per-sample score is
the same: answer agreement for exact-match tasks, the same window value for kl) and the paired difference,
engine minus emulation, with the tests of kvcal.report.stats, Holm-Bonferroni over the pair's key metrics, two
sided (an engine better than its emulation does not compute it either). The verdict: *does not match* when a key
metric differs significantly; else *matches at this sample size*, with the minimum detectable difference (80%
power) so that a small real difference is not read as none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcal.errors import UsageError
from kvcal.report.compare import Comparison, Configuration, Warn, paired_results
from kvcal.report.metrics import arrays, metric_specs
from kvcal.report.verdicts import HOLM, GatePolicy, GateSettings, MetricResult, judge

# lm-eval backends that are serving engines (kvcal.report.lmeval_runs records the backend)
ENGINE_BACKENDS = frozenset({"vllm", "sglang", "local-completions", "local-chat-completions", "openai-completions"})


@dataclass
class ConformanceResult:
    engine: str
    emulation: str
    claimed: str  # 'fp8_e4m3, scales calib-tensor, skip none'
    results: list[MetricResult] = field(default_factory=list)  # key metrics, engine vs emulation
    agreement: dict[str, float] = field(default_factory=dict)  # 'task/metric' -> share of samples that agree
    conforms: bool | None = None  # None: nothing could be judged
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine, "emulation": self.emulation, "claimed": self.claimed,
            "conforms": self.conforms, "verdict": self.verdict, "agreement": self.agreement,
            "results": [{"task": r.task, "metric": r.label, "n": r.n, "engine": r.score, "emulation": r.base,
                         "diff": r.diff, "ci_low": r.ci_low, "ci_high": r.ci_high, "p_value": r.p_value,
                         "p_adjusted": r.p_adjusted, "mdd": r.mdd, "status": r.status} for r in self.results],
        }  # fmt: skip


def _backend(c: Configuration) -> str:
    return str((c.runs[0].config.extra.get("lm_eval") or {}).get("backend") or "")


def _claim(c: Configuration) -> tuple[str, str, str]:
    return c.kv_format, c.scales, c.skip


def _describe(c: Configuration) -> str:
    return f"{c.kv_format}, scales {c.scales}, skip {c.skip}"


def find_pairs(cmp: Comparison, named: Iterable[str] | None) -> list[tuple[Configuration, Configuration]]:
    """(engine, emulation) pairs: those named `ENGINE=EMULATION` (labels), else every engine run with the one
    kvcal run of the same claimed configuration (kv format, scales, skip layers)."""
    by_label = {c.label: c for c in cmp.configs}
    pairs: list[tuple[Configuration, Configuration]] = []
    for item in named or []:
        eng, eq, emu = str(item).partition("=")
        if not eq or eng not in by_label or emu not in by_label or eng == emu:
            raise UsageError(
                f"--conformance {item!r}: write ENGINE=EMULATION with two of the labels here "
                f"({', '.join(by_label)})"
            )
        pairs.append((by_label[eng], by_label[emu]))
    if named:
        return pairs
    for eng in cmp.configs:
        if _backend(eng) not in ENGINE_BACKENDS:
            continue
        emus = [c for c in cmp.configs if c is not eng and _backend(c) not in ENGINE_BACKENDS
                and _claim(c) == _claim(eng)]  # fmt: skip
        if len(emus) == 1:
            pairs.append((eng, emus[0]))
    return pairs


def _agreement(r: MetricResult, eng: Configuration, emu: Configuration) -> float | None:
    """Share of the paired samples whose per-sample value is the same in both runs."""
    erun, brun = eng.run_for(r.task), emu.run_for(r.task)
    if erun is None or brun is None:
        return None
    spec = next((sp for sp in metric_specs(brun, r.task) if sp.label == r.label), None)
    if spec is None:
        return None
    es, bs = erun.samples[r.task], brun.samples[r.task]
    keys = [k for k in bs if k in es and k[1] == spec.filter and spec.metric in bs[k] and spec.metric in es[k]]
    if not keys:
        return None
    nb, db = arrays([bs[k] for k in keys], spec)
    ne, de = arrays([es[k] for k in keys], spec)
    return float(np.mean((nb == ne) & (db == de)))


def check_pair(
    eng: Configuration, emu: Configuration, cmp: Comparison, warn: Warn
) -> ConformanceResult:
    """The engine run against kvcal's emulation of its configuration (see the module docstring)."""
    s = cmp.settings
    # every key metric in the family (top1_agree too), threshold 0: significance is what is asked
    settings = GateSettings(GatePolicy(default=0.0, thresholds=(("top1_agree", 0.0),)), s.alpha, s.min_samples, HOLM)
    out = ConformanceResult(eng.label, emu.label, _describe(emu))
    if _claim(eng) != _claim(emu):
        warn(f"conformance: {eng.label} claims {_describe(eng)}, {emu.label} emulates {_describe(emu)}")
    results = [r for r in paired_results(emu, eng, settings, cmp.resampling, warn) if r.key]
    judge(results, settings)
    out.results = results
    for r in results:
        a = _agreement(r, eng, emu)
        if a is not None:
            out.agreement[f"{r.task}/{r.label}"] = a
    judged = [r for r in results if not r.insufficient]
    differ = [r for r in judged if r.significant]
    if not judged:
        out.verdict = f"not judged: fewer than {s.min_samples} paired samples of {eng.label} and {emu.label}"
        return out
    out.conforms = not differ
    if differ:
        parts = [f"{r.task} {r.label} {r.score:.4g} vs {r.base:.4g} (difference {r.diff:+.4g}, "
                 f"[{r.ci_low:.4g}, {r.ci_high:.4g}], p = {r.p_adjusted if r.p_adjusted is not None else r.p_value:.2g})"
                 for r in differ]  # fmt: skip
        out.verdict = (
            f"does not match: {eng.label} does not compute what {_describe(emu)} computes in kvcal's emulation "
            f"({emu.label}): {'; '.join(parts)}"
        )
    else:
        mdds = "; ".join(f"{r.task} {r.label} {r.mdd:.3g} (n = {r.n})" for r in judged if r.mdd)
        out.verdict = (
            f"matches at this sample size: no significant difference between {eng.label} and kvcal's emulation "
            f"of {_describe(emu)} ({emu.label})" + (f"; could miss differences below {mdds}" if mdds else "")
        )
    return out


def add_conformance(cmp: Comparison, named: Iterable[str] | None = None, warn: Warn | None = None) -> None:
    """Fill cmp.conformance: the named pairs, or every engine run that has an emulation here."""
    def _warn(msg: str) -> None:
        cmp.warnings.append(msg)
        if warn is not None:
            warn(msg)

    cmp.conformance = [check_pair(e, m, cmp, _warn) for e, m in find_pairs(cmp, named)]
