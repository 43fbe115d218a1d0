"""Repeated sampling for generative lm-eval tasks (`kvcal eval --repeats N --gen-kwargs temperature=0.6,...`).

How engine teams score reasoning tasks (AIME25 over 10 samples, GPQA over 5): each document is generated N times
with sampling and its score is the mean over its N generations ("avg@N"); the task's score is the mean over
documents. kvcal does the same in three steps:

1. The task config's `repeats` is set to N (lm-eval then hands the model N copies of each request).
2. Each sampled request is generated from its own seed, `sample_seed(base, task, doc_id, repeat)` (the LM's
   generate_until, kvcal.evaluate.adapter): repeat r of a document draws the same random numbers in every
   configuration, whatever the batch or the process split, so a BF16 and an FP8 run pair repeat for repeat, and
   the only thing that differs between them is the cache.
3. lm-eval's filters keep one response per document (`take_first`); kvcal scores every repeat with the task's
   own filters and `process_results` (`score_repeats`), stores the N scores per sample (`repeat_metrics`) and
   sets the sample's metric to their mean. The document is then the unit of every paired statistic and of the
   gate (kvcal.report.stats on per-document means): repeats of one document are correlated, and treating the
   (document, repeat) pairs as independent samples would give intervals that are too narrow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvcal.errors import UsageError

SCORING = "mean over repeats per document"


def samples(gen_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request with these generation kwargs samples (as lm-eval's HFLM decides: do_sample, or a
    temperature above 0 with do_sample unset)."""
    kw = dict(gen_kwargs or {})
    if kw.get("do_sample") is not None:
        return bool(kw["do_sample"])
    return float(kw.get("temperature") or 0.0) > 0.0


def sample_seed(base: int, task: str | None, doc_id: int | None, repeat: int) -> int:
    """The torch seed of repeat `repeat` of document `doc_id` of `task`: a hash, so neighbouring documents and
    repeats draw unrelated streams; the same in every configuration and every run with the same base."""
    blob = json.dumps([int(base), str(task), doc_id, int(repeat)]).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") % (2**63)


def with_repeats(spec: str | dict[str, Any], repeats: int, name: str, task_manager: Any) -> dict[str, Any]:
    """A copy of lm-eval task spec `spec` (an inline config, or a task name of --include-path / lm-eval's
    index) with `repeats` set. Groups, tags and non-generative tasks are refused: --repeats means N generations."""
    if isinstance(spec, str):
        entry = task_manager.task_index.get(spec)
        if entry is None or getattr(entry, "yaml_path", None) is None or entry.kind.name.lower() != "task":
            raise UsageError(
                f"--repeats applies to one generative task; '{name}' is a group or tag of lm-eval's, name its "
                "tasks instead"
            )
        from kvcal.evaluate.tasks import load_task_yaml

        spec = load_task_yaml(entry.yaml_path)
    cfg = dict(spec)
    if cfg.get("output_type") != "generate_until":
        raise UsageError(
            f"--repeats applies to generative tasks (output_type generate_until); '{name}' is "
            f"{cfg.get('output_type') or 'not generative'}: drop --repeats for it"
        )
    cfg["repeats"] = int(repeats)
    return cfg


def score_repeats(task: Any, instances: list[Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every repeat of every sample scored by the task's own filters and process_results. `task`, `instances`:
    the lm-eval Task and its requests in document order (kvcal.evaluate.divergence.lm_eval_requests, built as
    simple_evaluate built them); `records`: lm-eval's sample records (one per document and filter, `resps`
    [[N generations]]). Returns the records with `repeat_metrics` {metric: [N scores]} and each metric the mean
    of its N scores."""
    by_doc = {inst.doc_id: inst for inst in instances}
    names = [f.name for f in task._filters]
    gens = {rec["doc_id"]: _generations(rec) for rec in records}  # a document's records share its generations
    n = max(len(g) for g in gens.values())
    scores: dict[tuple[int, str], dict[str, list[float]]] = {}
    for r in range(n):
        for doc_id, g in gens.items():
            by_doc[doc_id].resps, by_doc[doc_id].filtered_resps = [g[r]], {}
        task.apply_filters()
        for doc_id in gens:
            inst = by_doc[doc_id]
            for f in names:
                got = task.process_results(inst.doc, [inst.filtered_resps[f]])
                per = scores.setdefault((doc_id, f), {})
                for metric, value in got.items():
                    per.setdefault(metric, []).append(float(value))
    out = []
    for rec in records:
        per = scores[(rec["doc_id"], rec.get("filter", names[0]))]
        rec = {**rec, "repeat_metrics": per}
        rec.update({metric: sum(v) / len(v) for metric, v in per.items()})
        out.append(rec)
    return out


def _generations(rec: dict[str, Any]) -> list[str]:
    resps = rec.get("resps") or [[]]
    first = resps[0]
    return list(first) if isinstance(first, list) else list(resps)


def check_mean_metrics(task: Any, name: str) -> None:
    """Averaging over repeats is the mean of per-document scores: a metric aggregated otherwise (a corpus-level
    BLEU, perplexity) cannot be; refuse it naming the metric."""
    from lm_eval.api.metrics import mean

    others = [m for m, agg in task.aggregation().items() if agg is not mean]
    if others:
        raise UsageError(
            f"--repeats averages per-document scores, but task '{name}' aggregates {', '.join(others)} "
            "otherwise than by a mean; drop --repeats for it"
        )


def aggregate(part: dict[str, Any], task: str, records: list[dict[str, Any]], repeats: int, seed: int) -> None:
    """results.json's metrics of `task` recomputed from the per-document means (in place): the mean over
    documents and its standard error (scipy.stats.sem: documents are the unit); the scoring recorded in the
    task's config."""
    from scipy.stats import sem

    res = part.get("results", {}).get(task)
    if res is None:
        return
    by_filter: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_filter.setdefault(rec.get("filter", "none"), []).append(rec)
    for f, recs in by_filter.items():
        for metric in recs[0]["repeat_metrics"]:
            vals = [x[metric] for x in recs]
            res[f"{metric},{f}"] = sum(vals) / len(vals)
            res[f"{metric}_stderr,{f}"] = float(sem(vals)) if len(vals) > 1 else "N/A"
    cfg = part.get("configs", {}).get(task)
    if isinstance(cfg, dict):
        cfg["kvcal_repeats"] = {"repeats": repeats, "scoring": SCORING, "sample_seed": seed}
