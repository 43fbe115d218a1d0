"""Output agreement with the baseline: how long a quantized cache's greedy output stays token-identical.

One observation per (document, repeat): the 1-based generated position `t` of the first token where the
evaluated output differs from the baseline's (an *event*), or the length both outputs were compared over when
they never differ (*censored*: one output ended, or both hit the generation cap — not "agreeing forever").

- Survival curve S(t) = P(no divergence by generated token t): Kaplan-Meier with its Hall-Wellner 95% band,
  median tokens to divergence and its interval (statsmodels `SurvfuncRight`: `quantile`, `quantile_ci`).
- Hazard per 1,000 generated tokens: events / token exposure (every compared token is one token at risk), with
  the exact Poisson interval (statsmodels `confint_poisson`, method "exact-c").
- Constant hazard: early vs late hazard (token exposure split at a cut), the two Poisson rates compared by
  statsmodels `test_poisson_2indep` (score test of the ratio = 1). A small p-value says the hazard is not
  constant, so a projection that assumes one is not to be trusted.
- Projection: under a constant hazard h, P(identical after L tokens) = exp(-h L); over a task's own output
  lengths L_i the expected identical fraction is mean_i exp(-h L_i). Monotone in h, so h's interval bounds it.
- Answer agreement: the fraction of samples whose extracted answers match, Wilson interval; with repeats the
  document is the unit (`cluster_mean_interval`, statsmodels' cluster-robust OLS of the flags on a constant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcal.report import text_tokens

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    value: float | None
    lo: float | None
    hi: float | None

    def to_record(self) -> dict[str, float | None]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}


def _finite(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def kaplan_meier(times: Sequence[int], events: Sequence[bool]) -> dict[str, Any]:
    """S(t) of first-divergence times (events) and censoring times, by statsmodels' SurvfuncRight: the curve at
    every event time with the Hall-Wellner 95% band (None where statsmodels cannot form it), and the median
    tokens to divergence with its 95% interval (None = not reached / unbounded)."""
    from statsmodels.duration.survfunc import SurvfuncRight

    t = np.asarray(times, dtype=float)
    e = np.asarray(events, dtype=int)
    if t.size == 0:
        raise ValueError("kaplan_meier needs at least one observation")
    if not e.any():  # no divergence at all: S(t) = 1 wherever anything was observed
        return {"times": [], "surv": [], "lo": [], "hi": [], "median": Interval(None, None, None).to_record()}
    sf = SurvfuncRight(t, e)
    try:
        lo, hi = sf.simultaneous_cb(alpha=1 - LEVEL)
        band = ([_finite(v) for v in lo], [_finite(v) for v in hi])
    except (ValueError, ZeroDivisionError, FloatingPointError):
        band = ([None] * len(sf.surv_times), [None] * len(sf.surv_times))
    med = _finite(sf.quantile(0.5))
    try:
        mlo, mhi = sf.quantile_ci(0.5, alpha=1 - LEVEL)
        mlo, mhi = _finite(mlo), _finite(mhi)
    except (ValueError, IndexError):
        mlo, mhi = None, None
    return {
        "times": [int(x) for x in sf.surv_times],
        "surv": [float(x) for x in sf.surv_prob],
        "lo": band[0],
        "hi": band[1],
        "median": Interval(med, mlo, mhi).to_record(),
    }


def hazard(times: Sequence[int], events: Sequence[bool], per: int = 1000) -> dict[str, Any]:
    """Divergences per `per` generated tokens: events / exposure (sum of the times: tokens compared), with the
    exact Poisson interval. {"value", "lo", "hi", "events", "exposure"}."""
    from statsmodels.stats.rates import confint_poisson

    n_events = int(sum(bool(x) for x in events))
    exposure = int(sum(int(x) for x in times))
    if exposure <= 0:
        return {**Interval(None, None, None).to_record(), "events": n_events, "exposure": exposure}
    lo, hi = confint_poisson(n_events, exposure, method="exact-c", alpha=1 - LEVEL)
    return {
        "value": n_events / exposure * per,
        "lo": float(lo) * per,
        "hi": float(hi) * per,
        "events": n_events,
        "exposure": exposure,
    }


def constant_hazard_test(
    times: Sequence[int], events: Sequence[bool], cut: int | None = None
) -> dict[str, Any]:
    """Early (tokens 1..cut) vs late (tokens > cut) hazard, by statsmodels' `test_poisson_2indep` (two-sided score
    test of rate ratio late/early = 1). `cut`: default half of the longest time. None fields where either side
    has no exposure."""
    from statsmodels.stats.rates import test_poisson_2indep

    t = [int(x) for x in times]
    e = [bool(x) for x in events]
    cut = cut if cut is not None else max(1, max(t, default=0) // 2)
    early_exp = sum(min(x, cut) for x in t)
    late_exp = sum(max(0, x - cut) for x in t)
    early_ev = sum(1 for x, ev in zip(t, e, strict=True) if ev and x <= cut)
    late_ev = sum(1 for x, ev in zip(t, e, strict=True) if ev and x > cut)
    out: dict[str, Any] = {
        "cut": cut,
        "early": {"events": early_ev, "exposure": early_exp},
        "late": {"events": late_ev, "exposure": late_exp},
        "ratio": None,
        "p_value": None,
        "method": "statsmodels test_poisson_2indep (score, ratio late/early = 1)",
    }
    if early_exp == 0 or late_exp == 0 or early_ev + late_ev == 0:
        return out
    with np.errstate(divide="ignore", invalid="ignore"):  # no early event: statsmodels' ratio is inf (unused)
        res = test_poisson_2indep(late_ev, late_exp, early_ev, early_exp, method="score")
    out["ratio"] = _finite(res.ratio) if early_ev else None
    out["p_value"] = float(res.pvalue)
    return out


def project(hz: dict[str, Any], lengths: Sequence[int], per: int = 1000) -> dict[str, float | None]:
    """Expected fraction of outputs still identical after each of `lengths` tokens (mean of exp(-h L_i)) under
    the constant hazard `hz` (from `hazard`), with the bounds its interval gives (exp(-h L) falls as h grows)."""
    if hz.get("value") is None or not lengths:
        return Interval(None, None, None).to_record()
    L = np.asarray(lengths, dtype=float)

    def frac(h: float) -> float:
        return float(np.mean(np.exp(-h / per * L)))

    return Interval(frac(hz["value"]), frac(hz["hi"]), frac(hz["lo"])).to_record()


def proportion(successes: int, n: int) -> dict[str, float | None]:
    """A fraction with its Wilson interval (statsmodels `proportion_confint`)."""
    from statsmodels.stats.proportion import proportion_confint

    if n == 0:
        return Interval(None, None, None).to_record()
    lo, hi = proportion_confint(successes, n, alpha=1 - LEVEL, method="wilson")
    return Interval(successes / n, float(lo), float(hi)).to_record()


def cluster_mean_interval(values: Sequence[float], clusters: Sequence[Any]) -> dict[str, float | None]:
    """Mean of `values` with a 95% interval that treats each cluster (document) as one unit: OLS of the values on
    a constant with cluster-robust standard errors (statsmodels, cov_type="cluster"; t with G-1 degrees of
    freedom). With one value per cluster it is the ordinary t interval (up to statsmodels' small-sample
    correction G/(G-1))."""
    import statsmodels.api as sm

    y = np.asarray(values, dtype=float)
    if y.size == 0:
        return Interval(None, None, None).to_record()
    groups = np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)[1]
    mean = float(y.mean())
    if np.all(y == y[0]):  # no spread: the interval is the point (statsmodels would divide by zero)
        return Interval(mean, mean, mean).to_record()
    if groups.max() < 1:  # one cluster: no interval
        return Interval(mean, None, None).to_record()
    fit = sm.OLS(y, np.ones((y.size, 1))).fit(cov_type="cluster", cov_kwds={"groups": groups}, use_t=True)
    lo, hi = fit.conf_int(alpha=1 - LEVEL)[0]
    return Interval(float(fit.params[0]), float(lo), float(hi)).to_record()


def summarize(
    times: Sequence[int],
    events: Sequence[bool],
    *,
    at_lengths: Sequence[int] = (4096, 16384, 32768),
    task_lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Everything the report says about one configuration's divergence: KM curve + median, hazard, the
    constant-hazard test, and the projections (to each of `at_lengths`, and over `task_lengths`)."""
    hz = hazard(times, events)
    out = {
        "n": len(times),
        "diverged": int(sum(bool(e) for e in events)),
        "km": kaplan_meier(times, events),
        "hazard_per_1k": hz,
        "constant_hazard": constant_hazard_test(times, events),
        "projection": {str(L): project(hz, [L]) for L in at_lengths},
    }
    if task_lengths:
        out["projection_task_lengths"] = {"n": len(task_lengths), **project(hz, task_lengths)}
    return out


# ---- the report's rows: one per (configuration, divergence task) ----------------------------------------------

DIVERGENCE_OUTPUT_TYPE = (
    "kvcal_divergence"  # configs.<task>.output_type of kvcal.evaluate.divergence's results
)
AT_LENGTHS = (4096, 16384, 32768)


def divergence_tasks(run: Any) -> list[str]:
    """The divergence tasks a loaded run (kvcal.report.runs.Run) holds."""
    cfgs = run.results.get("configs") or {}
    return [t for t in run.samples if (cfgs.get(t) or {}).get("output_type") == DIVERGENCE_OUTPUT_TYPE]


def _raw_samples(run: Any, task: str) -> list[dict[str, Any]]:
    from kvcal.io import read_jsonl

    return read_jsonl(run.samples_path(task))


def divergence_rows(
    configs: list[tuple[str, list[Any]]], at_lengths: Sequence[int] = AT_LENGTHS
) -> list[dict]:
    """Per (configuration label, divergence task): answer agreement and output identity with their intervals,
    vLLM's logprobs-close pass rate, the survival summary (`summarize`, projected to `at_lengths` and over the
    BF16 trajectories' own lengths), and decode vs prefill KL."""
    rows: list[dict[str, Any]] = []
    settings: dict[str, dict[str, Any]] = {}  # task -> the first configuration's generation settings
    for label, runs in configs:
        for run in runs:
            for task in divergence_tasks(run):
                _check_same_generation(settings, task, label, run)
                s = _raw_samples(run, task)
                n = len(s)
                summary = summarize(
                    [int(x["first_divergence"]) for x in s],
                    [bool(x["diverged"]) for x in s],
                    at_lengths=at_lengths,
                    task_lengths=[int(x["base_len"]) for x in s],
                )
                rows.append(
                    {
                        "config": label,
                        "task": task,
                        "gen_len": (run.results.get("configs") or {}).get(task, {}).get("gen_len"),
                        "answer_agree": proportion(sum(int(x["answer_agree"]) for x in s), n),
                        "identical": proportion(sum(int(x["identical"]) for x in s), n),
                        "logprobs_close": proportion(sum(int(x["logprobs_close"]) for x in s), n),
                        "decode_kl": float(np.mean([x["decode_kl"] for x in s])),
                        "prefill_kl": float(np.mean([x["prefill_kl"] for x in s])),
                        **summary,
                    }
                )
    return rows


# What must match for two configurations' divergence outputs to be compared (kvcal.evaluate.divergence's config).
GENERATION_KEYS = ("gen_len", "greedy", "num_fewshot", "prompts", "eos_token_ids", "baseline")


def _check_same_generation(seen: dict[str, dict[str, Any]], task: str, label: str, run: Any) -> None:
    cfg = (run.results.get("configs") or {}).get(task) or {}
    mine = {k: cfg.get(k) for k in GENERATION_KEYS} | {"limit": len(run.samples[task])}
    first = seen.setdefault(task, {"label": label, **mine})
    diff = [k for k in mine if mine[k] != first[k]]
    if diff:
        from kvcal.errors import UsageError

        k = diff[0]
        raise UsageError(
            f"{task}: `{label}` generated with {k}={mine[k]!r} but `{first['label']}` with {first[k]!r}; "
            "compare runs of the same generation settings (rerun one with the other's --max-gen-toks, "
            "--num-fewshot and --limit)"
        )


# ---- lm-eval's own generative tasks: agreement of the text outputs with the baseline run's ---------------------


def first_filter_records(run: Any, task: str) -> dict[str, dict[str, Any]]:
    """doc_id -> the record of the first filter (lm-eval writes one record per (doc, filter))."""
    recs = _raw_samples(run, task)
    first = next((r.get("filter") for r in recs), None)
    return {str(r["doc_id"]): r for r in recs if r.get("filter") == first}


def _text(rec: dict[str, Any]) -> str | None:
    t = text_tokens.texts(rec)
    return t[0] if t else None  # None: GPQA's private records keep no output text


def first_difference(a: Sequence[int], b: Sequence[int]) -> tuple[int, bool]:
    """(time, event) of two outputs: the 1-based position of the first differing token, or the shorter length
    when one is a prefix of the other (censored)."""
    n = min(len(a), len(b))
    where = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return (int(where[0]) + 1, True) if where.size else (n, False)


def divergence_times(
    runs: tuple[Any, Any],
    recs: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]],
    docs: list[str],
    task: str,
    unit: str | None = None,
) -> tuple[dict[str, tuple[int, bool, int]], str] | None:
    """doc -> (time, event, the first run's output length) of two runs' outputs (the first repeat of each
    document, so documents stay independent observations), in generated token ids or, where a run kept text
    only, text tokens (kvcal.report.text_tokens; `unit=TEXT` forces them), and that unit; None without ids or a
    tokenizer. An output that stopped before the other's is a divergence (`stopped_difference`, under `task`'s
    cap)."""
    got = text_tokens.paired_outputs(runs, recs, docs, unit)
    if got is None:
        return None
    outputs, unit = got
    cap = min(max_gen_toks(r, task) for r in runs)
    out = {}
    for d, (a, b) in outputs.items():
        if a and b:
            te = stopped_difference(a[0], b[0], cap)
            if te is not None:
                out[d] = (te[0], te[1], len(a[0]))
    return out, unit


LM_EVAL_MAX_GEN_TOKS = 256  # lm-eval's default cap (LM.max_gen_toks) when neither the task nor the run sets one


def max_gen_toks(run: Any, task: str) -> int:
    """The cap a run generated `task` under: the task's generation_kwargs, else the run's --max-gen-toks, else
    lm-eval's default."""
    gk = (((run.results.get("configs") or {}).get(task) or {}).get("generation_kwargs")) or {}
    cap = gk.get("max_gen_toks") or getattr(run.config, "max_gen_toks", None) or LM_EVAL_MAX_GEN_TOKS
    return int(cap)


def stopped_difference(a: Sequence[int], b: Sequence[int], cap: int | None) -> tuple[int, bool] | None:
    """`first_difference` of two generate_until outputs, whose stop sequence lm-eval cut from the text: where one
    is a proper prefix of the other and ended before the cap, it stopped where the other went on, a divergence at
    the token after it (an empty output against a non-empty one: at token 1); outputs the cap ended are censored.
    None when both are empty (nothing was compared)."""
    if not a and not b:
        return None
    t, event = first_difference(a, b)
    if not event and len(a) != len(b) and (cap is None or min(len(a), len(b)) < cap):
        return t + 1, True
    return max(t, 1), event


def token_divergence(
    runs: tuple[Any, Any],
    recs: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]],
    docs: list[str],
    task: str,
    at_lengths: Sequence[int],
) -> dict[str, Any] | None:
    """Survival of token identity between two runs' outputs (`divergence_times`; the summary's `unit` says which
    tokens); None when fewer than two documents have outputs in one unit."""
    got = divergence_times(runs, recs, docs, task)
    if got is None or len(got[0]) < 2:
        return None
    tes, unit = got
    times, events, lengths = zip(*tes.values(), strict=True)
    return {**summarize(list(times), list(events), at_lengths=at_lengths, task_lengths=list(lengths)), "unit": unit}


def text_agreement_rows(
    configs: list[tuple[str, list[Any]]], at_lengths: Sequence[int] = AT_LENGTHS
) -> list[dict[str, Any]]:
    """Per (configuration, lm-eval generative task) other than the first (the baseline): the fraction of documents
    whose extracted answer (lm-eval's first filter's filtered response) and whose output text equal the baseline
    run's, with Wilson intervals; and where both runs recorded the generated token ids (kvcal runs), the survival
    of token identity (`tokens`: as `summarize`, over the first repeat of each document). Documents are paired by
    doc_id."""
    if not configs:
        return []
    base_label, base_runs = configs[0]
    rows: list[dict[str, Any]] = []
    for task in (t for r in base_runs for t in r.samples):
        base_run = next(r for r in base_runs if task in r.samples)
        cfg = (base_run.results.get("configs") or {}).get(task) or {}
        if cfg.get("output_type") != "generate_until":
            continue
        base = first_filter_records(base_run, task)
        for label, runs in configs[1:]:
            run = next((r for r in runs if task in r.samples), None)
            if run is None:
                continue
            _check_same_text_generation(task, (base_label, base_run), (label, run))
            mine = first_filter_records(run, task)
            docs = [d for d in base if d in mine]
            answers = sum(base[d].get("filtered_resps") == mine[d].get("filtered_resps") for d in docs)
            texts = [(_text(base[d]), _text(mine[d])) for d in docs]
            comparable = [(a, b) for a, b in texts if a is not None and b is not None]
            row = {
                "config": label,
                "task": task,
                "baseline": base_label,
                "n": len(docs),
                "answer_agree": proportion(int(answers), len(docs)),
                "identical": proportion(sum(a == b for a, b in comparable), len(comparable)),
            }
            tokens = token_divergence((base_run, run), (base, mine), docs, task, at_lengths)
            if tokens is not None:
                row["tokens"] = tokens
            rows.append(row)
    return rows


# config.yaml keys that change what a generative task generates (kvcal.rundir.RunConfig)
TEXT_GENERATION_KEYS = ("max_gen_toks", "num_fewshot", "seed", "repeats", "gen_kwargs")


def _check_same_text_generation(task: str, base: tuple[str, Any], other: tuple[str, Any]) -> None:
    """Outputs generated with another cap, few-shot count or seed are not the same outputs to compare."""
    from kvcal.errors import UsageError

    for k in TEXT_GENERATION_KEYS:
        a, b = getattr(base[1].config, k, None), getattr(other[1].config, k, None)
        if a != b:
            raise UsageError(
                f"{task}: `{other[0]}` generated with {k}={b!r} but the baseline `{base[0]}` with {a!r}; "
                f"compare runs of the same generation settings (rerun one with the other's --{k.replace('_', '-')})"
            )
