"""Compare evaluation run directories against a baseline: the Comparison a report and the gate are made from.

Input: run directories in the layout `kvcal eval` writes (kvcal.rundir). Samples are paired by (task, doc_id,
filter) — the same question under the same lm-eval filter — so every difference is a paired difference over the
samples both runs scored. Which metrics are judged: kvcal.report.metrics. The statistics: kvcal.report.stats.
Significance, the gate and the sentences: kvcal.report.verdicts.

Steps: load the run directories -> check they are of one model -> group them into configurations -> pick the
baseline -> capacity -> measure every (configuration, task, metric, filter) -> judge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcal.errors import KvcalError, UsageError
from kvcal.kvconfig import KVConfig
from kvcal.kvconfig import describe_scales as describe_scales  # re-exported: reports and tests read it here
from kvcal.kvconfig import describe_skip as describe_skip
from kvcal.report import agreement, length, longcontext, stats
from kvcal.report.lmeval_runs import (
    Source,
    exported_from,
    load_lm_eval_run,
    results_folder,
    same_documents,
    split_date_id,
    task_limit,
    task_settings,
)
from kvcal.report.longcontext import PasskeyGrid, PositionCurve
from kvcal.report.metrics import MetricSpec, arrays, metric_specs
from kvcal.report.runs import BadRunError, Record, Run, discover_run_dirs, is_lm_eval_dir, load_run
from kvcal.report.speed import EmulationSpeed, emulation_speed
from kvcal.report.verdicts import (
    GATES,
    HOLM,
    INSUFFICIENT,
    NO_CORRECTION,
    NONINFERIORITY,
    REGRESSION,
    GatePolicy,
    GateSettings,
    MetricResult,
    bootstrap_resolution_warning,
    config_gate,
    config_verdict,
    judge,
    parse_gate_policy,
    threshold_is_relative,
)
from kvcal.rundir import CONFIG

# --max-drop as compare_runs takes it: see verdicts.parse_gate_policy.
MaxDrop = float | list[str] | dict[str, Any] | GatePolicy | None
# Below this the baseline counts as zero: no relative change, the gate compares absolute differences.
NEAR_ZERO_BASELINE = 1e-4
Warn = Callable[[str], None]


@dataclass
class Configuration:
    """One configuration (a run directory, or several with the same name covering different tasks)."""

    label: str
    runs: list[Run]
    kv_format: str
    scales: str
    skip: str
    capacity: float | None = None  # tokens that fit vs BF16 (x)
    plan: str | None = None  # the label of the plan file its runs evaluated (`plan@3.0x`), None for a format

    @classmethod
    def of_runs(cls, label: str, runs: list[Run]) -> Configuration:
        """The configuration its first run's config.yaml records (KVConfig.of_run)."""
        key = KVConfig.of_run(runs[0].config)
        return cls(label, runs, key.kv_format, key.scales, key.skip, plan=key.plan)

    @property
    def key(self) -> KVConfig:
        return KVConfig(self.kv_format, self.scales, self.skip, self.plan)

    @property
    def format_shown(self) -> str:
        return self.key.format_shown

    def run_for(self, task: str) -> Run | None:
        return next((r for r in self.runs if task in r.samples), None)

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(t for r in self.runs for t in r.samples))


@dataclass(frozen=True)
class Resampling:
    n_boot: int = stats.DEFAULT_BOOTSTRAP
    seed: int = stats.DEFAULT_SEED


@dataclass
class Comparison:
    model: str
    baseline: str
    configs: list[Configuration]
    results: list[MetricResult]
    tasks: list[str]
    warnings: list[str]
    skipped_runs: list[str]
    settings: GateSettings
    resampling: Resampling = field(default_factory=Resampling)
    # The context (tokens) the capacity column assumes: sliding-window layers hold min(context, window) tokens.
    # None: none given and none evaluated -> sliding layers counted in full (exact up to their window).
    context: int | None = None
    context_source: str = ""  # '--context' | 'the longest the runs evaluated: kl windows of 4096 tokens'
    sliding_layers: bool | None = None  # the model has sliding layers (None: its config is not readable)
    positions: list[PositionCurve] = field(default_factory=list)  # KL by position, one per configuration
    passkey: list[PasskeyGrid] = field(default_factory=list)  # passkey accuracy by (length, depth)
    # kvcal's emulation speed of runs timed side by side (kvcal.report.speed); None: nothing comparable
    speed: EmulationSpeed | None = None
    # output agreement of divergence tasks (kvcal.report.agreement.divergence_rows), one row per (config, task)
    agreement_rows: list[dict[str, Any]] = field(default_factory=list)
    # lm-eval generative tasks: answer / text agreement with the baseline run (agreement.text_agreement_rows)
    text_agreement_rows: list[dict[str, Any]] = field(default_factory=list)
    # engine runs vs kvcal's emulation of the configuration they claim (kvcal.report.conformance fills it)
    conformance: list[Any] = field(default_factory=list)
    # paired change in generated length per (configuration, generative task) and its gate (kvcal.report.length)
    length_rows: list[length.LengthChange] = field(default_factory=list)
    max_length_change: float | None = None

    @property
    def by_position(self) -> list[PositionCurve]:
        """The KL-by-position curves a report shows: none when every configuration has a single bucket (a
        one-point curve has no position to compare)."""
        return self.positions if longcontext.shows_position(self.positions) else []

    @property
    def max_drop(self) -> float:
        """The default threshold; `policy` has the per-metric ones."""
        return self.settings.max_drop

    @property
    def policy(self) -> GatePolicy:
        return self.settings.policy

    @property
    def alpha(self) -> float:
        return self.settings.alpha

    @property
    def min_samples(self) -> int:
        return self.settings.min_samples

    @property
    def multiple_testing(self) -> str:
        return self.settings.multiple_testing

    @property
    def n_boot(self) -> int:
        return self.resampling.n_boot

    @property
    def seed(self) -> int:
        return self.resampling.seed

    def by_config(self, label: str) -> list[MetricResult]:
        return [r for r in self.results if r.config == label]

    def config(self, label: str) -> Configuration:
        return next(c for c in self.configs if c.label == label)

    @property
    def failures(self) -> list[MetricResult]:
        return [r for r in self.results if r.gate_fail]

    @property
    def insufficient(self) -> list[MetricResult]:
        """Gated results the gate could not judge (fewer paired samples than min_samples, or a threshold with no
        meaning against this baseline: MetricResult.unjudged)."""
        return [r for r in self.results if r.unjudged]

    @property
    def no_common_task(self) -> list[str]:
        """Configurations with no task (no paired sample) in common with the baseline: nothing was judged."""
        return [c.label for c in self.configs[1:] if not self.by_config(c.label)]

    @property
    def unjudged_configs(self) -> list[str]:
        """Configurations the gate could not judge in full: an unjudged gated result (a length change under
        --max-length-change included), or no task in common."""
        lacking = {r.config for r in self.insufficient} | {
            r.config for r in self.length_rows if r.status == length.UNJUDGED
        }
        return [c.label for c in self.configs[1:] if c.label in lacking or c.label in self.no_common_task]

    @property
    def length_failures(self) -> list[length.LengthChange]:
        """Length changes beyond --max-length-change (kvcal.report.length.judge_length); the baseline
        configuration's own divergence rows (against its BF16 trajectory) included."""
        return [r for r in self.length_rows if r.status == length.FAIL]

    @property
    def gate_passed(self) -> bool:
        """No configuration failed, every one was judged (or GateSettings.allow_unjudged lets it pass), and no
        engine run differs from kvcal's emulation of its configuration (conformance)."""
        judged = self.settings.allow_unjudged or not (self.unjudged_configs or self.conformance_unjudged)
        conforms = not any(c.conforms is False for c in self.conformance)
        return not self.failures and not self.length_failures and judged and conforms

    @property
    def conformance_unjudged(self) -> list[str]:
        """Engine runs whose conformance was not shown either way (no BF16 run, too few samples, not shown at
        this sample size): the gate fails on them unless allow_unjudged."""
        return [c.engine for c in self.conformance if c.conforms is None]

    def config_verdict(self, label: str) -> str:
        return config_verdict([r for r in self.by_config(label) if r.key or r.gated])

    def config_gate(self, label: str) -> str:
        """'baseline' | 'FAIL' | 'insufficient data' | 'pass'."""
        if label == self.baseline:
            return "baseline"
        if any(r.config == label for r in self.length_failures):
            return "FAIL"
        gate = config_gate(self.by_config(label))
        unjudged = any(r.config == label and r.status == length.UNJUDGED for r in self.length_rows)
        return INSUFFICIENT if gate == "pass" and unjudged else gate

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "baseline": self.baseline,
            "max_drop": self.max_drop,
            "gate_policy": self.policy.to_dict(),
            "alpha": self.alpha,
            "min_samples": self.min_samples,
            "multiple_testing": self.multiple_testing,
            "bootstrap": {"resamples": self.n_boot, "seed": self.seed, "interval": "BCa, paired"},
            "intervals": {
                "binary": "Newcombe square-and-add (paired), widened to 0 where McNemar's exact test does not reject",
                "other": "paired BCa bootstrap; p-value: its dual",
                "relative_change": "Fieller (delta-method covariance); null bounds with rel_ci_unbounded",
            },
            "tasks": self.tasks,
            "gate": self._gate_dict(),
            "configurations": [self._config_dict(c) for c in self.configs],
            "results": [asdict(r) for r in self.results],
            "warnings": self.warnings,
            "skipped_runs": self.skipped_runs,
            **self._long_context_dict(),
        }

    def _long_context_dict(self) -> dict[str, Any]:
        """Keys present only where there is something to say (runs without them keep their JSON)."""
        out: dict[str, Any] = {}
        if self.context is not None:
            out["capacity_context"] = {"tokens": self.context, "source": self.context_source}
        if self.positions:
            out["kl_by_position"] = [c.to_dict() for c in self.positions]
        if self.passkey:
            out["passkey_by_cell"] = [g.to_dict() for g in self.passkey]
        if self.speed is not None:
            out["emulation_speed"] = self.speed.to_dict()
        if self.agreement_rows:
            out["output_agreement"] = self.agreement_rows
        if self.text_agreement_rows:
            out["text_agreement"] = self.text_agreement_rows
        if self.conformance:
            out["conformance"] = [c.to_dict() for c in self.conformance]
        if self.length_rows:
            out["length_change"] = {
                "max_length_change": self.max_length_change,
                "rows": [r.to_dict() for r in self.length_rows],
            }
        return out

    def _gate_dict(self) -> dict[str, Any]:
        def brief(r: MetricResult) -> dict[str, Any]:
            return {"config": r.config, "task": r.task, "metric": r.label, "diff": r.diff,
                    "rel_change": r.rel_change, "threshold": r.gate_threshold,
                    "threshold_unit": r.threshold_unit, "p_adjusted": r.p_adjusted,
                    "upper_bound": r.ni_upper, "n_needed": r.ni_n_needed, "verdict": r.verdict}  # fmt: skip

        return {
            "passed": self.gate_passed,
            "mode": self.settings.gate,
            "allow_unjudged": self.settings.allow_unjudged,
            "unjudged_configurations": self.unjudged_configs,
            "no_common_task": self.no_common_task,
            "policy": self.policy.to_dict(),
            "gated": sorted({f"{r.task}/{r.label}" for r in self.results if r.gated}),
            "failures": [brief(r) for r in self.failures],
            "length_failures": [r.to_dict() for r in self.length_failures],
            "insufficient_data": [
                {"config": r.config, "task": r.task, "metric": r.label, "n": r.n, "verdict": r.verdict}
                for r in self.insufficient
            ],
        }

    def _config_dict(self, c: Configuration) -> dict[str, Any]:
        is_base = c.label == self.baseline
        return {
            "label": c.label,
            "kv_format": c.kv_format,
            "plan": c.runs[0].config.plan,
            "scales": c.scales,
            "skip_layers": c.skip,
            "runs": [str(r.path) for r in c.runs],
            "capacity_vs_bf16": c.capacity,
            "is_baseline": is_base,
            "verdict": "baseline" if is_base else self.config_verdict(c.label),
            "gate": self.config_gate(c.label),
            "gate_passed": not any(r.gate_fail for r in self.by_config(c.label))
            and not any(r.config == c.label for r in self.length_failures),
        }


# --------------------------------------------------------------------------------------------------------------
# Describing a configuration


def _kv_spec_of(run: Run) -> Any | None:
    """The KV geometry (kvcal.models.geometry.KVSpec) of the run's model when its folder is readable here, else None."""
    model_dir = run.model_dir
    if model_dir and (Path(model_dir) / "config.json").is_file():
        from kvcal.models.config import load_config
        from kvcal.models.geometry import kv_spec

        try:
            return kv_spec(load_config(model_dir))
        except (KvcalError, ValueError, OSError):
            return None
    return None


def _capacity_of(run: Run, context: int | None = None) -> float | None:
    """KV tokens that fit vs a BF16 cache: kvcal.capacity on the run's model config (skipped layers at 16 bits;
    sliding-window layers at min(context, window) of `context` tokens) when the model folder is readable here,
    else what the run recorded in metrics.json (sliding layers counted in full)."""
    kv = _kv_spec_of(run)
    if kv is not None:
        from kvcal.capacity import capacity_table

        try:
            skip = frozenset(run.config.skip_layer_indices)  # a TurboQuant run's boundary layers included
            table = capacity_table(kv, [run.kv_format], skip, context, tq_boundary=0)
            return float(table["formats"][0]["multiplier_vs_bf16"])
        except (KvcalError, ValueError):
            pass
    v = run.metrics.get("capacity_multiplier_vs_bf16")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# --------------------------------------------------------------------------------------------------------------
# The steps of compare_runs


def parse_labels(values: Iterable[str] | dict[str, str] | None) -> dict[str, str]:
    """`--label NAME=PATH` values -> {PATH as given (PATH@DATE_ID kept): NAME}; UsageError for a malformed one,
    a path given twice or a name given to two paths."""
    if values is None:
        return {}
    pairs = list(values.items()) if isinstance(values, dict) else []
    if not isinstance(values, dict):
        for v in values:
            name, eq, path = str(v).partition("=")
            if not eq or not name.strip() or not path.strip():
                raise UsageError(f"--label {v!r}: write NAME=PATH (e.g. --label vllm-fp8=out/vllm-fp8)")
            pairs.append((path.strip(), name.strip()))
    out: dict[str, str] = {}
    for path, name in pairs:
        if path in out:
            raise UsageError(f"--label: {path} is labelled twice ({out[path]}, {name}); give it one label")
        if name in out.values():
            other = next(k for k, v in out.items() if v == name)
            raise UsageError(f"--label: two runs have the label {name} ({other}, {path}); give each its own")
        out[path] = name
    return out


def _label_for(labels: dict[str, str], given: str, folder: Path) -> str | None:
    """The --label of a run: by the argument as given, else by its folder (resolved)."""
    if given in labels:
        return labels[given]
    want = folder.resolve()
    for key, name in labels.items():
        src = split_date_id(key)
        if src.date_id is None and Path(key).exists() and Path(key).resolve() in (want, want.parent):
            return name
    return None


def _load_one(d: Path, labels: dict[str, str], given: str) -> Run:
    label = _label_for(labels, given, d)
    if is_lm_eval_dir(d):
        return load_lm_eval_run(Source(d), label)
    run = load_run(d)
    if label:
        run.name = label
    return run


def _load_runs(
    run_dirs: Iterable[str | Path], on_bad_run: str, warn: Warn, labels: dict[str, str] | None = None
) -> tuple[list[Run], list[str]]:
    """Run directories, lm-eval output folders (PATH or PATH@DATE_ID) and folders holding either, loaded."""
    labels = labels or {}
    runs: list[Run] = []
    skipped: list[str] = []
    for raw in run_dirs:
        src = split_date_id(raw)
        folder = results_folder(src.path) if src.path.is_dir() and not (src.path / CONFIG).exists() else None
        if src.date_id is not None or folder is not None:
            runs.append(load_lm_eval_run(src, _label_for(labels, str(raw), folder or src.path)))
            continue
        for d in discover_run_dirs([src.path]):
            try:
                runs.append(_load_one(d, labels, str(raw)))
            except BadRunError as exc:
                if on_bad_run == "fail":
                    raise BadRunError(f"{exc} (or pass --on-bad-run skip to leave it out)") from None
                skipped.append(str(d))
                warn(f"skipped: {exc}")
    if not runs:
        raise KvcalError("no usable run directories to compare")
    _check_labels(runs, labels)
    return runs, skipped


def _check_labels(runs: list[Run], labels: dict[str, str]) -> None:
    """A label given with --label names one configuration: two runs of it on one task is an error."""
    for name in set(labels.values()):
        mine = [r for r in runs if r.name == name]
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if set(a.samples) & set(b.samples):
                    raise UsageError(
                        f"two runs of the label {name} cover {', '.join(sorted(set(a.samples) & set(b.samples)))}"
                        f" ({a.path}, {b.path}); give each its own --label"
                    )


def _one_model(runs: list[Run]) -> str:
    """The model all runs measured: the same reference, or the same local folder (a .gguf and its cached
    conversion, say)."""
    first = runs[0]

    def names(r: Run) -> set[str]:
        # a checkpoint `kvcal export --to vllm` wrote is its source model with scales added: an engine run on it
        # measured that model (its export record's binding names the source's reference and folder)
        out = {r.model, *([r.model_dir] if r.model_dir else [])}
        return out | exported_from(r.model_dir) if r.model_dir else out

    ref = names(first)
    strangers = [r for r in runs if not names(r) & ref]
    if strangers:
        models = sorted({r.model for r in runs})
        detail = "; ".join(f"{m}: {', '.join(r.name for r in runs if r.model == m)}" for m in models)
        raise UsageError(f"runs of different models cannot be compared ({detail}); compare runs of one model")
    return first.model


def _configurations(runs: list[Run]) -> list[Configuration]:
    """Same directory name and disjoint tasks -> one configuration (a sweep writes one directory per task); a name
    clash on the same task -> separate configurations, labelled by the parent folder."""
    groups: dict[str, list[Run]] = {}

    def clash(label: str, r: Run) -> bool:
        return label in groups and any(set(o.samples) & set(r.samples) for o in groups[label])

    for r in runs:
        label, i = r.name, 2
        if clash(label, r):
            label = f"{r.path.parent.name}/{r.name}"
            while clash(label, r):
                label, i = f"{r.path.parent.name}/{r.name}#{i}", i + 1
        groups.setdefault(label, []).append(r)
    return [
        Configuration.of_runs(lab, rs)
        for lab, rs in groups.items()
    ]


def _matches_baseline(run: Run, name: str) -> bool:
    n = name.lower()
    aliases = {"bf16": {"bf16", "bfloat16"}, "bfloat16": {"bf16", "bfloat16"}}.get(n, {n})
    return run.kv_format.lower() in aliases


def _baseline_first(configs: list[Configuration], baseline: str) -> list[Configuration]:
    """The configurations with the baseline first: a directory name (or label) first, then the kv_format."""
    found = [c for c in configs if c.label == baseline or any(r.name == baseline for r in c.runs)]
    if not found:
        found = [c for c in configs if all(_matches_baseline(r, baseline) for r in c.runs)]
        if not found and baseline.lower() in ("bf16", "bfloat16"):
            # an engine's kv_cache_dtype=auto (or lm-eval's hf backend): the model's own 16-bit cache
            found = [c for c in configs if all(r.kv_format == "auto" for r in c.runs)]
        plain = [c for c in found if c.skip == "none"]
        found = plain if len(found) > 1 and len(plain) == 1 else found
    if not found:
        have = ", ".join(sorted({c.kv_format for c in configs}))
        raise UsageError(
            f"no baseline run matches {baseline!r} (kv formats present: {have}); run `kvcal eval --kv-format bf16` "
            "or pass --baseline with a run directory name or kv format"
        )
    if len(found) > 1:
        raise UsageError(
            f"--baseline {baseline!r} matches several runs ({', '.join(c.label for c in found)}); "
            "pass the run directory name instead"
        )
    if len(configs) < 2:
        raise UsageError(
            f"only the baseline ({found[0].label}) was given; pass at least one more run directory"
        )
    return found + [c for c in configs if c is not found[0]]


def _add_capacity(configs: list[Configuration], context: int | None = None) -> None:
    for c in configs:
        c.capacity = next((v for v in (_capacity_of(r, context) for r in c.runs) if v is not None), None)


def _capacity_context(
    configs: list[Configuration], context: int | None, source: str, warn: Warn
) -> tuple[int | None, str, bool | None]:
    """(context, where it comes from, whether the model has sliding-window layers) of the capacity column:
    --context, else the longest context the runs evaluated (kl windows, passkey prompts), else None."""
    from kvcal.models.geometry import SLIDING

    runs = [r for c in configs for r in c.runs]
    if context is None:
        found = longcontext.longest_context(runs)
        context, source = (found[0], f"the longest the runs evaluated: {found[1]}") if found else (None, "")
    kv = next((k for k in map(_kv_spec_of, runs) if k is not None), None)
    sliding = None if kv is None else any(layer.type == SLIDING and layer.window for layer in kv.layers)
    if kv is None and context is not None:
        warn(
            f"the model's config is not readable here ({runs[0].model_dir or runs[0].model}): tokens vs BF16 is "
            f"each run's recorded figure (sliding-window layers counted in full), not at {context} tokens of "
            "context; compare where the model folder exists to apply the context"
        )
    return context, source, sliding


def _paired_keys(task: str, brun: Run, orun: Run, label: str, warn: Warn) -> list[tuple[str, str]]:
    """The (doc_id, filter) keys both runs scored, less those whose documents differ (lm-eval's doc_hash)."""
    bsamp, osamp = brun.samples[task], orun.samples[task]
    common = [k for k in bsamp if k in osamp]
    mismatched = {
        k for k in common
        if "_doc_hash" in bsamp[k] and "_doc_hash" in osamp[k] and bsamp[k]["_doc_hash"] != osamp[k]["_doc_hash"]
    }  # fmt: skip
    if mismatched:
        warn(
            f"{task}: {len(mismatched)} doc ids of {label} hold different documents than the baseline's "
            "(different data files?); they are left out"
        )
        common = [k for k in common if k not in mismatched]
    docs_b, docs_o, docs_c = ({k[0] for k in keys} for keys in (bsamp, osamp, common))
    if not docs_c:
        warn(f"{task}: {label} and the baseline share no samples; {task} is not compared for it")
    elif len(docs_c) < max(len(docs_b), len(docs_o)):
        warn(
            f"{task}: {label} has {len(docs_o)} samples, the baseline {len(docs_b)} (the same --limit: different "
            f"data or an engine that dropped samples?); paired statistics use the {len(docs_c)} in common"
        )
    return common


def _same_task_settings(task: str, brun: Run, orun: Run, label: str, base_label: str) -> None:
    """Runs whose task settings differ (n-shot, generation kwargs, task version, repeats, kl's window length)
    score different prompts or answers, and runs of a different --limit different documents (a kl window or a
    passkey cell's sample of one is not the other's): refuse to pair them, naming the difference."""
    b, o = task_settings(brun, task), task_settings(orun, task)
    diffs = [f"{k} {o[k]!r} vs {b[k]!r}" for k in b if k in o and b[k] != o[k]]
    if diffs:
        raise UsageError(
            f"{task}: {label} and the baseline {base_label} ran different task settings ({'; '.join(diffs)}, "
            f"{label} first): their samples cannot be paired; evaluate both with the same settings"
        )
    bl, ol = task_limit(brun, task), task_limit(orun, task)
    if not same_documents(bl, ol):
        raise UsageError(
            f"{task}: {label} and the baseline {base_label} ran different --limit ({ol.describe()} vs "
            f"{bl.describe()}, {label} first): they evaluated different documents and cannot be paired; "
            "evaluate both with the same --limit"
        )


def paired_results(
    base_cfg: Configuration, c: Configuration, s: GateSettings, rs: Resampling, warn: Warn
) -> list[MetricResult]:
    """Every (task, metric, filter) of `c` measured against `base_cfg` over the samples both scored (not yet
    judged: verdicts.judge)."""
    results: list[MetricResult] = []
    for task in base_cfg.tasks:
        brun, orun = base_cfg.run_for(task), c.run_for(task)
        assert brun is not None
        if orun is None:
            warn(f"{c.label} has no {task} run; {task} is not compared for it")
            continue
        _same_task_settings(task, brun, orun, c.label, base_cfg.label)
        keys = _paired_keys(task, brun, orun, c.label, warn)
        if keys:
            results.extend(_compare_task(task, brun, orun, c.label, keys, s, rs))
    return results


def _compare_configs(
    configs: list[Configuration], s: GateSettings, rs: Resampling, warn: Warn
) -> list[MetricResult]:
    base_cfg = configs[0]
    for c in configs[1:]:
        for t in c.tasks:
            if t not in base_cfg.tasks:
                warn(f"task {t} of {c.label} has no baseline run; it is not compared")
    results: list[MetricResult] = []
    for c in configs[1:]:
        results.extend(paired_results(base_cfg, c, s, rs, warn))
    if not results:
        raise KvcalError(
            f"no samples in common between the baseline {base_cfg.label} and the other runs "
            "(different tasks or disjoint doc ids); evaluate the same tasks with the same data"
        )
    return results


def _compare_task(
    task: str,
    brun: Run,
    orun: Run,
    label: str,
    common: list[tuple[str, str]],
    s: GateSettings,
    rs: Resampling,
) -> list[MetricResult]:
    bsamp, osamp = brun.samples[task], orun.samples[task]
    ospecs = {(sp.metric, sp.filter) for sp in metric_specs(orun, task)}
    out: list[MetricResult] = []
    for spec in metric_specs(brun, task):
        if (spec.metric, spec.filter) not in ospecs:
            continue
        keys = [
            k for k in common if k[1] == spec.filter and spec.metric in bsamp[k] and spec.metric in osamp[k]
        ]
        if not keys:
            continue
        r = measure(task, label, spec, [bsamp[k] for k in keys], [osamp[k] for k in keys], s, rs)
        r.n_base_total = sum(1 for k in bsamp if k[1] == spec.filter and spec.metric in bsamp[k])
        r.n_other_total = sum(1 for k in osamp if k[1] == spec.filter and spec.metric in osamp[k])
        out.append(r)
    return out


# --------------------------------------------------------------------------------------------------------------
# Measuring one metric


def _relative(
    base: float, diff: float, arrs: tuple[np.ndarray, ...], spec: MetricSpec, alpha: float, judged: bool
) -> tuple[float | None, tuple[float, float] | None, bool]:
    """(relative change, its Fieller interval or None, unbounded?). No relative change where the baseline is ~0:
    e.g. kvcal's kl of the BF16 run, measured against a BF16 cache; the difference stays absolute (nats)."""
    if not np.isfinite(base) or abs(base) < NEAR_ZERO_BASELINE:
        return None, None, False
    rel = stats.relative_change(base, base + diff)
    if not judged or rel is None:
        return rel, None, False
    nb, db, no, do = arrs
    vb, vo, cov = stats.paired_covariance(nb, db, no, do, spec.transform)
    interval = stats.fieller_relative(base, base + diff, vb, vo, cov, alpha)
    return rel, interval, interval is None


def measure(
    task: str,
    config: str,
    spec: MetricSpec,
    brecs: list[Record],
    orecs: list[Record],
    s: GateSettings,
    rs: Resampling,
) -> MetricResult:
    """The paired statistics of one metric of `config` vs the baseline over aligned records (element i of both
    lists is the same sample); n_*_total count the paired samples until the caller sets them. Not yet judged:
    see verdicts.judge."""
    nb, db = arrays(brecs, spec)
    no, do = arrays(orecs, spec)
    tf = stats.TRANSFORMS[spec.transform]
    base, score = stats.ratio_statistic(nb, db, tf), stats.ratio_statistic(no, do, tf)
    n = len(brecs)
    binary = spec.weighted == "none" and stats.is_binary(nb) and stats.is_binary(no)
    judged = n >= s.min_samples
    test: stats.DiffTest | None = None
    disc: tuple[int, int] | None = None
    if judged and binary:
        test, b, c = stats.binary_difference(nb, no, s.alpha)
        disc = (b, c)
    elif judged:
        test = stats.bca_difference(nb, no, db, do, spec.transform, s.alpha, rs.n_boot, rs.seed)
    rel, rel_ci, unbounded = _relative(base, score - base, (nb, db, no, do), spec, s.alpha, judged)
    ni = _noninferiority_bound(base, score - base, rel, (nb, db, no, do), spec, binary, s, rs) if judged else None
    return MetricResult(
        task=task, config=config, metric=spec.metric, filter=spec.filter, label=spec.label, key=spec.key,
        higher_is_better=spec.higher_is_better, binary=binary, n=n, n_base_total=n, n_other_total=n,
        base=base, base_se=stats.standard_error(nb, db, spec.transform),
        score=score, score_se=stats.standard_error(no, do, spec.transform), diff=score - base,
        ci_low=test.ci_low if test else None, ci_high=test.ci_high if test else None,
        interval="none" if test is None else ("newcombe" if binary else "bca"),
        rel_change=rel, rel_ci_low=rel_ci[0] if rel_ci else None, rel_ci_high=rel_ci[1] if rel_ci else None,
        rel_ci_unbounded=unbounded, p_value=test.p_value if test else None, discordant=disc,
        se_diff=test.se_diff if test else 0.0,
        identical=bool(np.array_equal(nb, no) and np.array_equal(db, do)), insufficient=not judged,
        degradation=_degradation(spec, score - base, rel),
        ni_upper=ni[0] if ni else None, ni_sd=ni[1] if ni else None,
    )  # fmt: skip


def _degradation(spec: MetricSpec, diff: float, rel: float | None) -> float | None:
    """How much worse the configuration is, in its threshold's unit (verdicts.threshold_is_relative); None where
    that unit is relative and the baseline is ~0."""
    if threshold_is_relative(spec.metric, spec.higher_is_better):
        return rel
    return -diff if spec.higher_is_better else diff


def _noninferiority_bound(
    base: float,
    diff: float,
    rel: float | None,
    arrs: tuple[np.ndarray, ...],
    spec: MetricSpec,
    binary: bool,
    s: GateSettings,
    rs: Resampling,
) -> tuple[float, float] | None:
    """(one-sided upper confidence bound of the degradation at level 1 - alpha, per-sample SD of the degradation)
    in the threshold's unit, measured only for the non-inferiority gate; None where the unit is relative and the
    baseline is ~0. The one-sided bound is the matching end of the two-sided 1 - 2 alpha interval of the
    statistic the regression gate tests: Newcombe's (binary), the paired BCa bootstrap's (others, same seed),
    Fieller's for a relative change (inf when it is unbounded)."""
    if s.gate != NONINFERIORITY:
        return None
    nb, db, no, do = arrs
    n = nb.size
    two = 2 * s.alpha
    if threshold_is_relative(spec.metric, spec.higher_is_better):
        if rel is None:
            return None
        vb, vo, cov = stats.paired_covariance(nb, db, no, do, spec.transform)
        t = (base + diff) / base
        sd = math.sqrt(max(vo - 2 * t * cov + t * t * vb, 0.0) * n) / abs(base)  # delta method of other / base
        interval = stats.fieller_relative(base, base + diff, vb, vo, cov, two)
        return (math.inf if interval is None else interval[1]), sd
    if binary:
        a, b, c, d = stats.discordant_pairs(nb, no)
        lo, hi = stats.newcombe_paired(a, b, c, d, two)  # Wilson-based: not 0-wide with no discordant pairs
        sd = stats.paired_binary_test(a, b, c, d, s.alpha).se_diff * math.sqrt(n)
    else:
        test = stats.bca_difference(nb, no, db, do, spec.transform, two, rs.n_boot, rs.seed)
        lo, hi, sd = test.ci_low, test.ci_high, test.se_diff * math.sqrt(n)
    return (-lo if spec.higher_is_better else hi), sd


# --------------------------------------------------------------------------------------------------------------


def _settings(
    max_drop: MaxDrop,
    on_bad_run: str,
    alpha: float,
    min_samples: int,
    multiple_testing: str,
    gate: str = REGRESSION,
    allow_unjudged: bool = False,
) -> GateSettings:
    if on_bad_run not in ("fail", "skip"):
        raise UsageError(f"--on-bad-run must be 'skip' or 'fail', got {on_bad_run!r}")
    policy = parse_gate_policy(max_drop)
    if not 0 < alpha < 1:
        raise UsageError(f"--alpha must be between 0 and 1 (e.g. 0.05), got {alpha}")
    if min_samples < 2:
        raise UsageError(f"--min-samples must be at least 2, got {min_samples}")
    if multiple_testing not in (HOLM, NO_CORRECTION):
        raise UsageError(f"multiple_testing must be {HOLM!r} or {NO_CORRECTION!r}, got {multiple_testing!r}")
    if gate not in GATES:
        raise UsageError(f"--gate must be one of {', '.join(GATES)}, got {gate!r}")
    return GateSettings(policy, alpha, min_samples, multiple_testing, gate, allow_unjudged)


def _unmatched_policy_warnings(results: list[MetricResult], policy: GatePolicy, warn: Warn) -> None:
    """A threshold that names no compared result is almost always a typo (kl vs KL, exact-match)."""
    have: set[str] = set()
    for r in results:
        flt = "" if r.filter in ("none", "") else f",{r.filter}"
        have |= {f"{r.task}/{r.metric}{flt}", f"{r.task}/{r.metric}", f"{r.metric}{flt}", r.metric}
    for sel in policy.names():
        if sel not in have:
            warn(f"--max-drop names {sel}, which no compared result has; it gates nothing (metrics here: "
                 f"{', '.join(sorted({f'{r.task}/{r.label}' for r in results}))})")  # fmt: skip


def _insufficient_warnings(results: list[MetricResult], min_samples: int, warn: Warn) -> None:
    lacking: dict[str, int] = {}
    for r in results:
        if r.gated and r.insufficient:
            lacking[r.task] = min(r.n, lacking.get(r.task, r.n))
    for task, n in lacking.items():
        warn(
            f"{task}: only {n} paired samples, fewer than --min-samples {min_samples}: insufficient data, "
            "not judged by the gate (raise --limit)"
        )


def compare_runs(
    run_dirs: Iterable[str | Path],
    baseline: str = "bf16",
    max_drop: MaxDrop = None,
    on_bad_run: str = "fail",
    alpha: float = stats.ALPHA,
    n_boot: int = stats.DEFAULT_BOOTSTRAP,
    seed: int = stats.DEFAULT_SEED,
    warn: Warn | None = None,
    min_samples: int = stats.DEFAULT_MIN_SAMPLES,
    multiple_testing: str = HOLM,
    context: int | None = None,
    context_source: str = "--context",
    gate: str = REGRESSION,
    allow_unjudged: bool = False,
    labels: Iterable[str] | dict[str, str] | None = None,
    at_lengths: Sequence[int] = agreement.AT_LENGTHS,
    max_length_change: float | None = None,
    before_pairing: Callable[[list[Configuration]], None] | None = None,
) -> Comparison:
    """Load run directories (or folders of them), pick the baseline, and compare every configuration with it.

    `baseline` matches a run directory name first, then a kv_format ('bf16' also matches 'bfloat16').
    `max_drop`: the gate policy — a number (the default for every gated metric), `--max-drop` strings
    (['0.02', 'kl=0.05', 'gsm8k/exact_match=0.03']), a mapping ({'default': 0.02, 'kl': 0.05}), a GatePolicy,
    or None for the built-in defaults (kvcal.report.verdicts).
    `on_bad_run`: 'fail' raises on an incomplete or corrupt run directory; 'skip' leaves it out with a warning.
    `multiple_testing`: 'holm' (Holm-Bonferroni over the gate's family) or 'none'.
    `warn` is called with each warning as it arises (they are also collected in Comparison.warnings).
    `context`: tokens of context the capacity column assumes (sliding-window layers hold min(context, window));
    None: the longest context the runs evaluated (kl_seq_len, passkey lengths), or none when no run says.
    `context_source` says where a given `context` comes from, in the report's words.
    `at_lengths`: generated lengths (tokens) the divergence tasks' identical fraction is projected to.
    `max_length_change`: the gate on the paired change in generated length (a fraction, kvcal.report.length);
    None reports the change without gating it.
    `gate`: 'regression' (fail a configuration shown worse than its threshold) or 'noninferiority' (pass only one
    whose one-sided upper bound of the degradation is under its threshold); `allow_unjudged`: a configuration the
    gate could not judge (too few samples, no task in common) passes Comparison.gate_passed.
    `run_dirs` may also name lm-eval output folders (`lm_eval --output_path P --log_samples`: P, or P@DATE_ID for
    one of several results files; kvcal.report.lmeval_runs); `labels`: `--label NAME=PATH` values (or
    {PATH: NAME}) naming a configuration. `before_pairing`: called with the configurations before any samples are
    paired (kvcal.report.conformance's like-with-like check).
    """
    settings = _settings(max_drop, on_bad_run, alpha, min_samples, multiple_testing, gate, allow_unjudged)
    max_length_change = length.check_max_length_change(max_length_change)
    if context is not None and context < 1:
        raise UsageError(f"--context must be a positive number of tokens (e.g. 8192), got {context}")
    resampling = Resampling(n_boot, seed)
    warnings: list[str] = []

    def _warn(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    runs, skipped = _load_runs(run_dirs, on_bad_run, _warn, parse_labels(labels))
    model = _one_model(runs)
    configs = _baseline_first(_configurations(runs), baseline)
    if before_pairing is not None:
        before_pairing(configs)
    ctx, ctx_source, sliding = _capacity_context(configs, context, context_source, _warn)
    _add_capacity(configs, ctx)
    results = _compare_configs(configs, settings, resampling, _warn)
    judge(results, settings)
    _unmatched_policy_warnings(results, settings.policy, _warn)
    _insufficient_warnings(results, min_samples, _warn)
    note = bootstrap_resolution_warning(results, settings, n_boot)
    if note:
        _warn(note)
    base_tasks = configs[0].tasks
    return Comparison(
        model=model, baseline=configs[0].label, configs=configs, results=results,
        tasks=list(base_tasks), warnings=warnings, skipped_runs=skipped,
        settings=settings, resampling=resampling, context=ctx, context_source=ctx_source, sliding_layers=sliding,
        positions=longcontext.position_curves(
            [(c.label, c.runs) for c in configs], alpha, multiple_testing == HOLM, _warn
        ),
        passkey=[g for c in configs for g in longcontext.passkey_grids(c.label, c.runs, _warn)],
        speed=emulation_speed([(c.label, c.runs) for c in configs], base_tasks),
        agreement_rows=agreement.divergence_rows([(c.label, c.runs) for c in configs], at_lengths),
        text_agreement_rows=agreement.text_agreement_rows([(c.label, c.runs) for c in configs], at_lengths),
        length_rows=length.length_rows(
            [(c.label, c.runs) for c in configs], alpha=alpha, n_boot=n_boot, seed=seed,
            min_samples=min_samples, threshold=max_length_change, gate=gate,
        ),
        max_length_change=max_length_change,
    )  # fmt: skip
