"""Compare evaluation run directories against a baseline: paired statistics, verdicts and the regression gate.

Input: run directories in the layout `kvcal eval` writes (config.yaml, results.json, samples_<task>.jsonl,
metrics.json, COMPLETE). Samples are paired by (task, doc_id, filter) — the same question under the same
lm-eval filter — so every difference is a paired difference over the samples both runs scored.

Each task is judged on its *key metrics*, picked the way lm-eval reports them:
gsm8k: exact_match under both filters (strict-match, flexible-extract); aime: exact_match; gpqa multiple-choice:
acc (acc_norm shown too); gpqa CoT/generative: exact_match per filter; wikitext: word_perplexity (lower is
better; byte_perplexity and bits_per_byte shown too); kvcal's kl task: kl (lower is better) and top1_agree.
Any other task: its first metric, every filter.

Significance: McNemar's exact test (p < alpha) for binary per-sample metrics, the paired bootstrap interval
excluding 0 for everything else. The gate fails a (configuration, task, metric) when the change is a significant
degradation AND larger than the threshold: absolute for higher-is-better metrics (0.02 = 2 points of accuracy),
relative for lower-is-better ones (0.02 = perplexity or KL up by 2%). Where the baseline is ~0 (kvcal's kl of
a BF16 run, which is measured against a BF16 cache) there is no relative change and the threshold is absolute
(0.02 nats of KL).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.report import stats

# Metrics where lower is better (lm-eval's own higher_is_better flags in results.json take precedence).
LOWER_IS_BETTER = {"word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity", "kl", "nll", "ppl"}
# Keys of a per-sample record that are never metrics.
_NON_METRIC_KEYS = {
    "doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash",
    "prompt_hash", "target_hash", "n_tokens", "task", "window", "start", "end",
}  # fmt: skip
_TOKEN_WEIGHTED = {"kl", "top1_agree"}
# Below this the baseline counts as zero: no relative change, the gate compares absolute differences.
NEAR_ZERO_BASELINE = 1e-4
# Below this many paired samples the report warns that the statistics are rough.
SMALL_N = 20


# --------------------------------------------------------------------------------------------------------------
# Loading run directories


@dataclass
class Run:
    """One run directory, loaded: per-task per-sample metric values keyed by (doc_id, filter)."""

    path: Path
    name: str
    config: dict[str, Any]
    results: dict[str, Any]
    metrics: dict[str, Any]
    # task -> (doc_id, filter) -> {metric: value, "_n_tokens": float, "_doc_hash": str}
    samples: dict[str, dict[tuple[str, str], dict[str, Any]]] = field(default_factory=dict)
    # task -> metric names in the order the records list them
    metric_order: dict[str, list[str]] = field(default_factory=dict)

    @property
    def kv_format(self) -> str:
        return str(self.config.get("kv_format", "?"))

    @property
    def model(self) -> str:
        cfg = self.config
        ref = cfg.get("model") or cfg.get("model_ref") or cfg.get("model_dir") or "?"
        if isinstance(ref, dict):
            ref = ref.get("ref") or ref.get("name") or json.dumps(ref, sort_keys=True)
        return str(ref)

    @property
    def model_dir(self) -> str | None:
        d = self.config.get("model_dir")
        return str(d) if d else None

    @property
    def limit(self) -> Any:
        return self.config.get("limit")


class BadRunError(KvcalError):
    """A run directory that is incomplete or cannot be read."""


def _is_run_dir(p: Path) -> bool:
    return p.is_dir() and (
        (p / "config.yaml").exists() or (p / "results.json").exists() or (p / "COMPLETE").exists()
    )


def discover_run_dirs(paths: Iterable[str | Path], max_depth: int = 3) -> list[Path]:
    """Each argument is a run directory or a folder holding run directories (a sweep's RUNS_DIR), searched
    `max_depth` levels deep. Order is stable (arguments in order, then sorted)."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise UsageError(
                f"run directory {p} does not exist; pass directories written by `kvcal eval` or `kvcal sweep`"
            )
        if _is_run_dir(p):
            found.append(p)
            continue
        level = [p]
        hits: list[Path] = []
        for _ in range(max_depth):
            nxt: list[Path] = []
            for d in level:
                for child in sorted(c for c in d.iterdir() if c.is_dir() and not c.name.startswith(".")):
                    if child.name == "scales":
                        continue
                    (hits if _is_run_dir(child) else nxt).append(child)
            level = nxt
        if not hits:
            raise UsageError(
                f"{p} is not a run directory and holds none (no config.yaml / results.json found)"
            )
        found.extend(hits)
    seen: set[Path] = set()
    out = []
    for p in found:
        rp = p.resolve()
        if rp not in seen:
            seen.add(rp)
            out.append(p)
    return out


def _task_from_samples_name(stem: str, known: Iterable[str]) -> str:
    task = stem[len("samples_") :]
    if task in known:
        return task
    # lm-eval's own file names carry a timestamp suffix: samples_<task>_<YYYY-MM-DDTHH-MM-SS...>
    m = re.match(r"^(.*)_\d{4}-\d{2}-\d{2}T[\d\-\.:]+$", task)
    return m.group(1) if m else task


def _metric_value_ok(v: Any) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return True
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)


def load_run(path: str | Path) -> Run:
    """Load one run directory; BadRunError naming the directory and what is wrong."""
    p = Path(path)
    if not (p / "COMPLETE").exists():
        raise BadRunError(f"run {p} is incomplete (no COMPLETE file: interrupted or still running); rerun it")
    try:
        config = yaml.safe_load((p / "config.yaml").read_text()) or {}
        if not isinstance(config, dict):
            raise ValueError("config.yaml is not a mapping")
    except FileNotFoundError:
        raise BadRunError(f"run {p} is corrupt: config.yaml is missing") from None
    except (yaml.YAMLError, ValueError, UnicodeDecodeError) as exc:
        raise BadRunError(
            f"run {p} is corrupt: config.yaml does not parse ({exc.__class__.__name__})"
        ) from None
    try:
        results = json.loads((p / "results.json").read_text())
        if not isinstance(results, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        raise BadRunError(f"run {p} is corrupt: results.json is missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRunError(f"run {p} is corrupt: results.json does not parse ({exc})") from None
    metrics: dict[str, Any] = {}
    if (p / "metrics.json").exists():
        try:
            metrics = json.loads((p / "metrics.json").read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRunError(f"run {p} is corrupt: metrics.json does not parse ({exc})") from None
    run = Run(
        path=p,
        name=p.name,
        config=config,
        results=results,
        metrics=metrics if isinstance(metrics, dict) else {},
    )
    known = set((results.get("results") or {}).keys()) | set(config.get("tasks") or [])
    files = sorted(p.glob("samples_*.jsonl"))
    if not files:
        raise BadRunError(
            f"run {p} is corrupt: no samples_<task>.jsonl files (was it run with sample logging?)"
        )
    for f in files:
        task = _task_from_samples_name(f.stem, known)
        recs: dict[tuple[str, str], dict[str, Any]] = {}
        order: list[str] = []
        try:
            with f.open() as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                    except ValueError:
                        raise BadRunError(f"run {p} is corrupt: {f.name} line {lineno} is not JSON") from None
                    if not isinstance(r, dict) or "doc_id" not in r:
                        raise BadRunError(f"run {p} is corrupt: {f.name} line {lineno} has no doc_id")
                    names = r.get("metrics")
                    vals: dict[str, Any] = {}
                    if not isinstance(names, list):
                        names = [k for k, v in r.items() if k not in _NON_METRIC_KEYS and _metric_value_ok(v)]
                        if "nll" in names and isinstance(r.get("n_tokens"), (int, float)):
                            # kvcal's kl windows: nll is the window's summed NLL; as lm-eval's [ll, count] pair
                            # it gives the token perplexity exp(sum nll / sum n_tokens), kl's "ppl"
                            names = [m for m in names if m != "nll"]
                            vals["ppl"] = [-float(r["nll"]), float(r["n_tokens"])]
                            if "ppl" not in order:
                                order.append("ppl")
                    for m in names:
                        if m in r and _metric_value_ok(r[m]):
                            vals[m] = r[m]
                            if m not in order:
                                order.append(m)
                    if "n_tokens" in r:
                        vals["_n_tokens"] = float(r["n_tokens"])
                    if isinstance(r.get("doc_hash"), str):
                        vals["_doc_hash"] = r["doc_hash"]
                    recs[(str(r["doc_id"]), str(r.get("filter", "none")))] = vals
        except UnicodeDecodeError:
            raise BadRunError(f"run {p} is corrupt: {f.name} is not UTF-8 text") from None
        if not recs:
            raise BadRunError(f"run {p} is corrupt: {f.name} holds no samples")
        run.samples[task] = recs
        run.metric_order[task] = order
    return run


# --------------------------------------------------------------------------------------------------------------
# Metric choice


@dataclass(frozen=True)
class MetricSpec:
    metric: str
    filter: str
    higher_is_better: bool
    transform: str  # key of stats.TRANSFORMS
    weighted: (
        str  # "none" | "pair" (value is [ll, count]) | "tokens" (value is a per-window mean, weight n_tokens)
    )
    key: bool  # a key metric: judged by the verdict and the gate

    @property
    def label(self) -> str:
        return self.metric if self.filter in ("none", "") else f"{self.metric},{self.filter}"


def _higher_is_better(run: Run, task: str, metric: str) -> bool:
    hib = (run.results.get("higher_is_better") or {}).get(task) or {}
    if isinstance(hib, dict) and metric in hib and isinstance(hib[metric], bool):
        return hib[metric]
    return metric not in LOWER_IS_BETTER and "perplexity" not in metric


def _key_metric_names(task: str, metrics: list[str]) -> list[str]:
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


def metric_specs(run: Run, task: str) -> list[MetricSpec]:
    """Every (metric, filter) of a task in this run, key metrics first."""
    recs = run.samples[task]
    order = run.metric_order[task]
    filters: list[str] = []
    for _, flt in recs:
        if flt not in filters:
            filters.append(flt)
    key_names = _key_metric_names(task, order)
    specs: list[MetricSpec] = []
    first = next(iter(recs.values()))
    for m in key_names + [m for m in order if m not in key_names]:
        sample_val = next((r[m] for r in recs.values() if m in r), first.get(m))
        if isinstance(sample_val, (list, tuple)):
            weighted = "pair"
            transform = (
                "bits" if "bits" in m else ("exp" if ("perplexity" in m or m == "ppl") else "identity")
            )
        elif m in _TOKEN_WEIGHTED and "_n_tokens" in first:
            weighted = "tokens"
            transform = "identity"
        else:
            weighted, transform = "none", "identity"
        for flt in filters:
            if not any(k[1] == flt and m in r for k, r in recs.items()):
                continue
            specs.append(
                MetricSpec(m, flt, _higher_is_better(run, task, m), transform, weighted, m in key_names)
            )
    return specs


def _arrays(recs: list[dict[str, Any]], spec: MetricSpec) -> tuple[np.ndarray, np.ndarray]:
    """(num, den) per sample so that the statistic is transform(sum num / sum den)."""
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


# --------------------------------------------------------------------------------------------------------------
# The comparison


@dataclass
class Configuration:
    """One configuration (a run directory, or several with the same name covering different tasks)."""

    label: str
    runs: list[Run]
    kv_format: str
    scales: str
    skip: str
    capacity: float | None = None  # tokens that fit vs BF16 (x)
    tokens_per_s: float | None = None
    throughput_ratio: float | None = None  # tokens/s vs the baseline's

    def run_for(self, task: str) -> Run | None:
        return next((r for r in self.runs if task in r.samples), None)

    @property
    def tasks(self) -> list[str]:
        out: list[str] = []
        for r in self.runs:
            out.extend(t for t in r.samples if t not in out)
        return out


@dataclass
class MetricResult:
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
    ci_low: float
    ci_high: float
    rel_change: float | None
    rel_ci_low: float | None
    rel_ci_high: float | None
    p_value: float | None  # McNemar exact (binary metrics)
    discordant: tuple[int, int] | None  # (base right & other wrong, base wrong & other right)
    mdd: float  # minimum detectable difference (metric units)
    mdd_rel: float | None  # the same relative to the baseline (lower-is-better metrics)
    identical: bool
    significant: bool
    worse: bool  # significant degradation
    better: bool  # significant improvement
    gate_fail: bool
    verdict: str


@dataclass
class Comparison:
    model: str
    baseline: str
    configs: list[Configuration]
    results: list[MetricResult]
    tasks: list[str]
    warnings: list[str]
    skipped_runs: list[str]
    max_drop: float
    alpha: float
    n_boot: int
    seed: int

    def by_config(self, label: str) -> list[MetricResult]:
        return [r for r in self.results if r.config == label]

    def config(self, label: str) -> Configuration:
        return next(c for c in self.configs if c.label == label)

    @property
    def failures(self) -> list[MetricResult]:
        return [r for r in self.results if r.gate_fail]

    def config_verdict(self, label: str) -> str:
        return config_verdict([r for r in self.by_config(label) if r.key], self.max_drop)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "baseline": self.baseline,
            "max_drop": self.max_drop,
            "alpha": self.alpha,
            "bootstrap": {"resamples": self.n_boot, "seed": self.seed, "interval": "percentile, paired"},
            "tasks": self.tasks,
            "gate": {
                "passed": not self.failures,
                "failures": [
                    {
                        "config": r.config,
                        "task": r.task,
                        "metric": r.label,
                        "diff": r.diff,
                        "rel_change": r.rel_change,
                        "verdict": r.verdict,
                    }
                    for r in self.failures
                ],
            },  # fmt: skip
            "configurations": [
                {
                    "label": c.label,
                    "kv_format": c.kv_format,
                    "scales": c.scales,
                    "skip_layers": c.skip,
                    "runs": [str(r.path) for r in c.runs],
                    "capacity_vs_bf16": c.capacity,
                    "tokens_per_s": c.tokens_per_s,
                    "throughput_vs_baseline": c.throughput_ratio,
                    "is_baseline": c.label == self.baseline,
                    "verdict": self.config_verdict(c.label) if c.label != self.baseline else "baseline",
                    "gate_passed": not any(r.gate_fail for r in self.by_config(c.label)),
                }
                for c in self.configs
            ],
            "results": [asdict(r) for r in self.results],
            "warnings": self.warnings,
            "skipped_runs": self.skipped_runs,
        }


def _cfg_get(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        cur: Any = cfg
        for part in k.split("."):
            if not isinstance(cur, dict) or part not in cur:
                cur = None
                break
            cur = cur[part]
        if cur not in (None, "", []):
            return cur
    return None


def describe_scales(cfg: dict[str, Any]) -> str:
    """'uncalibrated' | 'calib-tensor' | 'calib-head' | 'dynamic' | 'none' from a run's config.yaml."""
    fmt = str(cfg.get("kv_format", ""))
    path = _cfg_get(cfg, "scales.path", "scales_path", "scales")
    if path and not isinstance(path, dict):
        gran = _cfg_get(cfg, "scales.granularity", "scales_granularity", "granularity") or "tensor"
        return f"calib-{gran}"
    if fmt in ("fp8_e4m3", "fp8", "fp8_e5m2"):
        return "uncalibrated"
    if fmt == "nvfp4":
        return "dynamic"
    if fmt in ("auto", "bf16", "bfloat16"):
        return "none"
    return "dynamic"


def describe_skip(cfg: dict[str, Any]) -> str:
    s = _cfg_get(cfg, "skip_layers.spec", "skip_layers_spec", "skip_layers")
    if isinstance(s, dict):
        s = None
    if isinstance(s, list):
        s = ",".join(str(x) for x in s)
    return str(s) if s else "none"


def _capacity_of(run: Run) -> float | None:
    """KV tokens that fit vs a BF16 cache: from kvcal.capacity on the run's model config (skipped layers at
    16 bits) when the model folder is readable here, else what the run recorded in metrics.json."""
    from_model = _capacity_from_model(run)
    if from_model is not None:
        return from_model
    m = run.metrics
    for k in ("capacity_multiplier_vs_bf16", "capacity_vs_bf16", "multiplier_vs_bf16", "capacity_multiplier"):
        v = m.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _capacity_from_model(run: Run) -> float | None:
    model_dir = run.config.get("model_dir")
    if not model_dir or not (Path(str(model_dir)) / "config.json").is_file():
        return None
    try:
        from kvcal.capacity import kv_bytes_per_token
        from kvcal.models import kv_spec, load_config

        kv = kv_spec(load_config(str(model_dir)))
        skip = frozenset(int(i) for i in (run.config.get("skip_layer_indices") or []))
        return kv_bytes_per_token(kv, "bf16") / kv_bytes_per_token(kv, run.kv_format, skip)
    except (KvcalError, ValueError, OSError, ImportError):
        return None


def _tokens_per_s(run: Run) -> float | None:
    v = run.metrics.get("tokens_per_s")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _matches_baseline(run: Run, name: str) -> bool:
    n = name.lower()
    aliases = {"bf16": {"bf16", "bfloat16"}, "bfloat16": {"bf16", "bfloat16"}}.get(n, {n})
    return run.kv_format.lower() in aliases


def _metric_verdict(r: MetricResult, max_drop: float) -> str:
    where = f"{r.task} {r.label}"
    same = "identical per-sample results; " if r.identical else ""
    if r.higher_is_better:
        if r.worse:
            return f"significant drop of {abs(r.diff):.3f} on {where}"
        if r.better:
            return f"significant gain of {abs(r.diff):.3f} on {where}"
        if r.mdd <= 0:
            return f"no significant change on {where} (identical per-sample results)"
        return f"no significant change on {where} ({same}could miss drops below {r.mdd:.3f})"
    rel = f"{abs(r.rel_change):.1%}" if r.rel_change is not None else f"{abs(r.diff):.4g}"
    if r.worse:
        return f"significant increase of {rel} in {r.label} on {r.task}"
    if r.better:
        return f"significant decrease of {rel} in {r.label} on {r.task}"
    if r.mdd <= 0:
        return f"no significant change on {where} (identical per-sample results)"
    miss = f"{r.mdd_rel:.1%}" if r.mdd_rel is not None else f"{r.mdd:.4g}"
    return f"no significant change on {where} ({same}could miss increases below {miss})"


def config_verdict(key_results: list[MetricResult], max_drop: float) -> str:
    """One sentence per configuration, the worst news first; 'no significant change' always carries the
    minimum detectable change, so it is not read as 'no change'."""
    if not key_results:
        return "no tasks in common with the baseline"
    worse = [r for r in key_results if r.worse]
    better = [r for r in key_results if r.better]
    parts: list[str] = []
    for r in worse:
        over = " (over the gate threshold)" if r.gate_fail else " (within the gate threshold)"
        parts.append(r.verdict + over)
    if not worse:
        mdds = []
        for r in key_results:
            if r.better or r.mdd <= 0:
                continue
            if r.higher_is_better or r.mdd_rel is None:
                mdds.append(f"{r.mdd:.3g} on {r.task} {r.label}")
            else:
                mdds.append(f"{r.mdd_rel:.1%} on {r.task} {r.label}")
        same = "identical per-sample results; " if all(r.identical for r in key_results) else ""
        detail = (
            f" ({same}could miss changes below {'; '.join(mdds)})"
            if mdds
            else (" (identical per-sample results)" if same else "")
        )
        parts.append("no significant change on any task" + detail)
    parts.extend(r.verdict for r in better)
    return "; ".join(parts)


def compare_runs(
    run_dirs: Iterable[str | Path],
    baseline: str = "bf16",
    max_drop: float = 0.02,
    on_bad_run: str = "fail",
    alpha: float = stats.ALPHA,
    n_boot: int = stats.DEFAULT_BOOTSTRAP,
    seed: int = stats.DEFAULT_SEED,
    warn: Callable[[str], None] | None = None,
) -> Comparison:
    """Load run directories (or folders of them), pick the baseline, and compare every configuration with it.

    `baseline` matches a run directory name first, then a kv_format ('bf16' also matches 'bfloat16').
    `on_bad_run`: 'fail' raises on an incomplete or corrupt run directory; 'skip' leaves it out with a warning.
    `warn` is called with each warning as it arises (they are also collected in Comparison.warnings).
    """
    if on_bad_run not in ("fail", "skip"):
        raise UsageError(f"--on-bad-run must be 'skip' or 'fail', got {on_bad_run!r}")
    if max_drop < 0:
        raise UsageError(f"--max-drop must be >= 0, got {max_drop}")
    warnings: list[str] = []

    def _warn(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    dirs = discover_run_dirs(run_dirs)
    runs: list[Run] = []
    skipped: list[str] = []
    for d in dirs:
        try:
            runs.append(load_run(d))
        except BadRunError as exc:
            if on_bad_run == "fail":
                raise BadRunError(f"{exc} (or pass --on-bad-run skip to leave it out)") from None
            skipped.append(str(d))
            _warn(f"skipped: {exc}")
    if not runs:
        raise KvcalError("no usable run directories to compare")

    # One model: the same reference, or the same local folder (a .gguf and its cached conversion, say).
    first = runs[0]
    strangers = [
        r for r in runs if r.model != first.model and (not r.model_dir or r.model_dir != first.model_dir)
    ]
    if strangers:
        models = sorted({r.model for r in runs})
        detail = "; ".join(f"{m}: {', '.join(r.name for r in runs if r.model == m)}" for m in models)
        raise UsageError(f"runs of different models cannot be compared ({detail}); compare runs of one model")
    models = [first.model]

    # Group run dirs into configurations: same directory name and disjoint tasks -> one configuration
    # (a sweep writes one directory per task); a name clash on the same task -> separate, labelled by parent.
    groups: dict[str, list[Run]] = {}
    for r in runs:
        label = r.name
        if label in groups and any(set(o.samples) & set(r.samples) for o in groups[label]):
            label = f"{r.path.parent.name}/{r.name}"
            i = 2
            while label in groups and any(set(o.samples) & set(r.samples) for o in groups[label]):
                label = f"{r.path.parent.name}/{r.name}#{i}"
                i += 1
        groups.setdefault(label, []).append(r)
    configs = [
        Configuration(
            label=lab,
            runs=rs,
            kv_format=rs[0].kv_format,
            scales=describe_scales(rs[0].config),
            skip=describe_skip(rs[0].config),
        )
        for lab, rs in groups.items()
    ]

    # Baseline: a directory name (or label) first, then the kv_format.
    base_cfgs = [c for c in configs if c.label == baseline or any(r.name == baseline for r in c.runs)]
    if not base_cfgs:
        base_cfgs = [c for c in configs if all(_matches_baseline(r, baseline) for r in c.runs)]
        if len(base_cfgs) > 1:
            plain = [c for c in base_cfgs if c.skip == "none"]
            base_cfgs = plain if len(plain) == 1 else base_cfgs
    if not base_cfgs:
        have = ", ".join(sorted({c.kv_format for c in configs}))
        raise UsageError(
            f"no baseline run matches {baseline!r} (kv formats present: {have}); run `kvcal eval --kv-format bf16` "
            "or pass --baseline with a run directory name or kv format"
        )
    if len(base_cfgs) > 1:
        raise UsageError(
            f"--baseline {baseline!r} matches several runs ({', '.join(c.label for c in base_cfgs)}); "
            "pass the run directory name instead"
        )
    base_cfg = base_cfgs[0]
    configs = [base_cfg] + [c for c in configs if c is not base_cfg]

    for c in configs:
        c.capacity = next((v for v in (_capacity_of(r) for r in c.runs) if v is not None), None)
        c.tokens_per_s = next((v for v in (_tokens_per_s(r) for r in c.runs) if v is not None), None)
    if base_cfg.tokens_per_s:
        for c in configs:
            if c.tokens_per_s is not None:
                c.throughput_ratio = c.tokens_per_s / base_cfg.tokens_per_s

    tasks = list(base_cfg.tasks)
    for c in configs[1:]:
        for t in c.tasks:
            if t not in tasks:
                tasks.append(t)
                _warn(f"task {t} of {c.label} has no baseline run; it is not compared")
    results: list[MetricResult] = []
    any_common = False
    for c in configs[1:]:
        for task in base_cfg.tasks:
            brun = base_cfg.run_for(task)
            orun = c.run_for(task)
            assert brun is not None
            if orun is None:
                _warn(f"{c.label} has no {task} run; {task} is not compared for it")
                continue
            res = _compare_task(task, brun, orun, c.label, max_drop, alpha, n_boot, seed, _warn)
            if res:
                any_common = True
            results.extend(res)
    for task in base_cfg.tasks:
        ns = [r.n for r in results if r.task == task and r.key]
        if ns and min(ns) < SMALL_N:
            _warn(
                f"{task}: only {min(ns)} paired samples; bootstrap intervals are too narrow and p-values rough "
                f"below ~{SMALL_N} (raise --limit)"
            )
    if len(configs) < 2:
        raise UsageError(
            f"only the baseline ({base_cfg.label}) was given; pass at least one more run directory"
        )
    if not any_common:
        raise KvcalError(
            f"no samples in common between the baseline {base_cfg.label} and the other runs "
            "(different tasks or disjoint doc ids); evaluate the same tasks with the same data"
        )
    return Comparison(
        model=models[0],
        baseline=base_cfg.label,
        configs=configs,
        results=results,
        tasks=[t for t in tasks if t in base_cfg.tasks],
        warnings=warnings,
        skipped_runs=skipped,
        max_drop=max_drop,
        alpha=alpha,
        n_boot=n_boot,
        seed=seed,
    )


def _compare_task(
    task: str,
    brun: Run,
    orun: Run,
    label: str,
    max_drop: float,
    alpha: float,
    n_boot: int,
    seed: int,
    warn: Callable[[str], None],
) -> list[MetricResult]:
    bsamp, osamp = brun.samples[task], orun.samples[task]
    common = [k for k in bsamp if k in osamp]
    # The same doc_id must be the same document: lm-eval's doc_hash says so when both runs logged it.
    mismatched = [
        k for k in common
        if "_doc_hash" in bsamp[k] and "_doc_hash" in osamp[k] and bsamp[k]["_doc_hash"] != osamp[k]["_doc_hash"]
    ]  # fmt: skip
    if mismatched:
        warn(
            f"{task}: {len(mismatched)} doc ids of {label} hold different documents than the baseline's "
            "(different data files?); they are left out"
        )
        bad = set(mismatched)
        common = [k for k in common if k not in bad]
    docs_b = {k[0] for k in bsamp}
    docs_o = {k[0] for k in osamp}
    docs_c = {k[0] for k in common}
    if not docs_c:
        warn(f"{task}: {label} and the baseline share no samples; {task} is not compared for it")
        return []
    if len(docs_c) < max(len(docs_b), len(docs_o)):
        warn(
            f"{task}: {label} has {len(docs_o)} samples, the baseline {len(docs_b)} "
            f"(limit {orun.limit} vs {brun.limit}); paired statistics use the {len(docs_c)} in common"
        )
    out: list[MetricResult] = []
    specs = metric_specs(brun, task)
    ospecs = {(s.metric, s.filter) for s in metric_specs(orun, task)}
    for spec in specs:
        if (spec.metric, spec.filter) not in ospecs:
            continue
        keys = [
            k for k in common if k[1] == spec.filter and spec.metric in bsamp[k] and spec.metric in osamp[k]
        ]
        if not keys:
            continue
        brecs = [bsamp[k] for k in keys]
        orecs = [osamp[k] for k in keys]
        nb, db = _arrays(brecs, spec)
        no, do = _arrays(orecs, spec)
        tf = stats.TRANSFORMS[spec.transform]
        pdiff = stats.paired_bootstrap(nb, no, db, do, tf, n_boot=n_boot, seed=seed)
        if abs(pdiff.base) < NEAR_ZERO_BASELINE:
            # e.g. kvcal's kl of the BF16 run, measured against a BF16 cache: ~0, so a relative change means
            # nothing; the difference (and the gate) stay absolute (nats for kl)
            pdiff = dataclasses.replace(pdiff, rel_change=None, rel_ci_low=None, rel_ci_high=None)
        n = len(keys)
        binary = spec.weighted == "none" and stats.is_binary(nb) and stats.is_binary(no)
        identical = bool(np.array_equal(nb, no) and np.array_equal(db, do))
        if spec.weighted == "none":
            base_se, score_se = stats.standard_error_of_mean(nb), stats.standard_error_of_mean(no)
        else:
            base_se = stats.bootstrap_se(nb, db, tf, n_boot=n_boot, seed=seed)
            score_se = stats.bootstrap_se(no, do, tf, n_boot=n_boot, seed=seed)
        p_value: float | None = None
        disc: tuple[int, int] | None = None
        if binary:
            p_value, b, cc = stats.mcnemar_exact(nb, no)
            disc = (b, cc)
            mdd = stats.mdd_paired_binary(n, (b + cc) / n, alpha=alpha)
            significant = p_value < alpha
        else:
            mdd = stats.mdd_continuous(pdiff.se_diff, alpha=alpha)
            significant = (pdiff.ci_low > 0 or pdiff.ci_high < 0) and not identical
        mdd_rel = (
            mdd / abs(pdiff.base) if (not spec.higher_is_better and pdiff.rel_change is not None) else None
        )
        degrade = -pdiff.diff if spec.higher_is_better else pdiff.diff
        worse = significant and degrade > 0
        better = significant and degrade < 0
        if spec.higher_is_better:
            magnitude = degrade
        else:
            magnitude = pdiff.rel_change if pdiff.rel_change is not None else pdiff.diff
        gate_fail = bool(worse and spec.key and magnitude > max_drop)
        r = MetricResult(
            task=task,
            config=label,
            metric=spec.metric,
            filter=spec.filter,
            label=spec.label,
            key=spec.key,
            higher_is_better=spec.higher_is_better,
            binary=binary,
            n=n,
            n_base_total=sum(1 for k in bsamp if k[1] == spec.filter and spec.metric in bsamp[k]),
            n_other_total=sum(1 for k in osamp if k[1] == spec.filter and spec.metric in osamp[k]),
            base=pdiff.base,
            base_se=base_se,
            score=pdiff.other,
            score_se=score_se,
            diff=pdiff.diff,
            ci_low=pdiff.ci_low,
            ci_high=pdiff.ci_high,
            rel_change=pdiff.rel_change,
            rel_ci_low=pdiff.rel_ci_low,
            rel_ci_high=pdiff.rel_ci_high,
            p_value=p_value,
            discordant=disc,
            mdd=mdd,
            mdd_rel=mdd_rel,
            identical=identical,
            significant=bool(significant),
            worse=bool(worse),
            better=bool(better),
            gate_fail=gate_fail,
            verdict="",
        )
        r.verdict = _metric_verdict(r, max_drop)
        out.append(r)
    return out
