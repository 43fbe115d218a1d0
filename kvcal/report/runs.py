"""Reading run directories back: what `kvcal eval` wrote (kvcal.rundir's layout), loaded for comparison.

Per-sample records come in two shapes, both written by `kvcal eval`:
- lm-eval's --log_samples records (every lm-eval task): `metrics` lists the metric names, each a key of the
  record; a value is a number, or [loglikelihood, words|bytes] for the weighted perplexities;
- kvcal's `kl` windows: {doc_id, kl, top1_agree, nll, n_tokens}; `nll` is the window's summed NLL and becomes
  `ppl` as an lm-eval-style [ll, count] pair (token perplexity exp(sum nll / sum n_tokens)).
A multiple-choice record (scored with `acc`) also gets `gold_logprob`, the gold choice's log-probability among
the choices (kvcal.report.choices): the continuous score `acc` thresholds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.io import jsonl_lines
from kvcal.report import choices
from kvcal.rundir import COMPLETE, CONFIG, ENV, METRICS, RESULTS, RunConfig, samples_file

# Where a sweep keeps its scale files, next to the run directories: never a run directory itself.
_SWEEP_SCALES_DIR = "scales"
KL_METRICS = ("kl", "top1_agree")

# One record's metric values: {metric: number | [ll, count]} plus "_n_tokens" (float) and "_doc_hash" (str)
Record = dict[str, Any]


@dataclass
class Run:
    """One run directory, loaded: per-task per-sample metric values keyed by (doc_id, filter)."""

    path: Path
    name: str
    config: RunConfig
    results: dict[str, Any]
    metrics: dict[str, Any]
    # task -> (doc_id, filter) -> record
    samples: dict[str, dict[tuple[str, str], Record]] = field(default_factory=dict)
    # task -> metric names in the order the records list them
    metric_order: dict[str, list[str]] = field(default_factory=dict)
    # env.json (device, gpu, host, versions): only the speed section reads it; {} when missing or unreadable
    env: dict[str, Any] = field(default_factory=dict)
    # task -> the samples file its records came from (a run directory's samples_<task>.jsonl, or lm-eval's
    # samples_<task>_<date>.jsonl): what reads the raw records (output agreement) reads them from here
    sample_files: dict[str, Path] = field(default_factory=dict)

    def samples_path(self, task: str) -> Path:
        return self.sample_files.get(task) or self.path / samples_file(task)

    @property
    def kv_format(self) -> str:
        return self.config.kv_format

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def model_dir(self) -> str | None:
        return self.config.model_dir or None

    @property
    def limit(self) -> int | None:
        return self.config.limit


class BadRunError(KvcalError):
    """A run directory that is incomplete or cannot be read."""


def is_lm_eval_dir(p: Path) -> bool:
    """A folder lm-eval wrote results_<date_id>.json into (kvcal.report.lmeval_runs reads it)."""
    return p.is_dir() and not (p / CONFIG).exists() and any(p.glob("results_*.json"))


def _is_run_dir(p: Path) -> bool:
    if not p.is_dir():
        return False
    return (p / CONFIG).exists() or (p / RESULTS).exists() or (p / COMPLETE).exists() or is_lm_eval_dir(p)


def _run_dirs_below(root: Path, max_depth: int) -> list[Path]:
    """Run directories under `root`, breadth first, `max_depth` levels deep, sorted within a level."""
    level, hits = [root], []
    for _ in range(max_depth):
        nxt: list[Path] = []
        for d in level:
            for child in sorted(c for c in d.iterdir() if c.is_dir() and not c.name.startswith(".")):
                if child.name == _SWEEP_SCALES_DIR:
                    continue
                (hits if _is_run_dir(child) else nxt).append(child)
        level = nxt
    return hits


def discover_run_dirs(paths: Iterable[str | Path], max_depth: int = 3) -> list[Path]:
    """Each argument is a run directory or a folder holding run directories (a sweep's RUNS_DIR), searched
    `max_depth` levels deep. Order is stable (arguments in order, then sorted); repeats are dropped."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise UsageError(
                f"run directory {p} does not exist; pass directories written by `kvcal eval` or `kvcal sweep`"
            )
        hits = [p] if _is_run_dir(p) else _run_dirs_below(p, max_depth)
        if not hits:
            raise UsageError(f"{p} is not a run directory and holds none (no {CONFIG} / {RESULTS} found)")
        found.extend(hits)
    seen: set[Path] = set()
    out = []
    for p in found:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


def _read_config(p: Path) -> RunConfig:
    try:
        raw = yaml.safe_load((p / CONFIG).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{CONFIG} is not a mapping")
        return RunConfig.from_dict(raw)
    except FileNotFoundError:
        raise BadRunError(f"run {p} is corrupt: {CONFIG} is missing") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise BadRunError(f"run {p} is corrupt: {CONFIG} does not parse ({exc.__class__.__name__})") from None
    except (ValueError, TypeError) as exc:
        raise BadRunError(f"run {p} is corrupt: {exc}") from None


def _read_json(p: Path, name: str, required: bool) -> dict[str, Any]:
    try:
        obj = json.loads((p / name).read_text())
    except FileNotFoundError:
        if required:
            raise BadRunError(f"run {p} is corrupt: {name} is missing") from None
        return {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRunError(f"run {p} is corrupt: {name} does not parse ({exc})") from None
    if not isinstance(obj, dict):
        raise BadRunError(f"run {p} is corrupt: {name} is not a JSON object")
    return obj


def _read_env(p: Path) -> dict[str, Any]:
    """env.json, or {} when it is missing or unreadable: it describes where the run ran (the report's speed
    section compares only runs from one machine) and never makes a run unusable."""
    try:
        return _read_json(p, ENV, required=False)
    except BadRunError:
        return {}


def _is_value(v: Any) -> bool:
    if isinstance(v, (bool, int, float)):
        return True
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)


def _record_values(r: dict[str, Any], where: str) -> Record:
    """One JSONL record's metric values (see the module docstring for the two shapes)."""
    vals: Record = {}
    if isinstance(r.get("metrics"), list):
        vals.update({m: r[m] for m in r["metrics"] if m in r and _is_value(r[m])})
        gold = choices.gold_logprob(r)  # multiple-choice: the continuous score acc thresholds
        if gold is not None:
            vals[choices.GOLD_LOGPROB] = gold
    elif "kl" in r:
        vals.update({m: r[m] for m in KL_METRICS if m in r and _is_value(r[m])})
        if isinstance(r.get("nll"), (int, float)) and isinstance(r.get("n_tokens"), (int, float)):
            vals["ppl"] = [-float(r["nll"]), float(r["n_tokens"])]
    else:
        raise BadRunError(f"{where} is neither an lm-eval record (no `metrics` list) nor a kvcal kl window")
    if isinstance(r.get("n_tokens"), (int, float)):
        vals["_n_tokens"] = float(r["n_tokens"])
    if isinstance(r.get("doc_hash"), str):
        vals["_doc_hash"] = r["doc_hash"]
    return vals


def _read_samples(p: Path, task: str) -> tuple[dict[tuple[str, str], Record], list[str]]:
    """(records keyed by (doc_id, filter), metric names in first-seen order) of one task's samples file."""
    f = p / samples_file(task)
    if not f.is_file():
        raise BadRunError(f"run {p} is corrupt: {f.name} is missing (task {task} in {CONFIG})")
    return read_samples_file(f, f"run {p}")


def read_samples_file(f: Path, owner: str) -> tuple[dict[tuple[str, str], Record], list[str]]:
    """One samples JSONL (lm-eval's --log_samples records or kvcal's kl windows): (records keyed by (doc_id,
    filter), metric names in first-seen order). `owner` names the run in errors ('run DIR')."""
    recs: dict[tuple[str, str], Record] = {}
    order: list[str] = []
    try:
        lines = jsonl_lines(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadRunError(f"{owner} is corrupt: {f.name} is missing") from None
    except UnicodeDecodeError:
        raise BadRunError(f"{owner} is corrupt: {f.name} is not UTF-8 text") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{owner} is corrupt: {f.name} line {lineno}"
        try:
            r = json.loads(line)
        except ValueError:
            raise BadRunError(f"{where} is not JSON") from None
        if not isinstance(r, dict) or "doc_id" not in r:
            raise BadRunError(f"{where} has no doc_id")
        vals = _record_values(r, where)
        order.extend(m for m in vals if not m.startswith("_") and m not in order)
        recs[(str(r["doc_id"]), str(r.get("filter", "none")))] = vals
    if not recs:
        raise BadRunError(f"{owner} is corrupt: {f.name} holds no samples")
    return recs, order


def load_run(path: str | Path) -> Run:
    """Load one run directory; BadRunError naming the directory and what is wrong."""
    p = Path(path)
    if not (p / COMPLETE).exists():
        raise BadRunError(
            f"run {p} is incomplete (no {COMPLETE} file: interrupted or still running); rerun it"
        )
    config = _read_config(p)
    run = Run(
        path=p,
        name=p.name,
        config=config,
        results=_read_json(p, RESULTS, required=True),
        metrics=_read_json(p, METRICS, required=False),
        env=_read_env(p),
    )
    if not config.tasks:
        raise BadRunError(f"run {p} is corrupt: {CONFIG} lists no tasks")
    for task in config.tasks:
        run.samples[task], run.metric_order[task] = _read_samples(p, task)
    return run
