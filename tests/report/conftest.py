"""Fixtures of the report tests: run directories WRITTEN in the run-directory contract (kvcal.rundir: config.yaml
from RunConfig, results.json, samples_<task>.jsonl in lm-eval's --log_samples record shape or kvcal's kl windows,
metrics.json, COMPLETE), so the comparison logic is tested on known answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from kvcal.rundir import COMPLETE, CONFIG, METRICS, RESULTS, RunConfig, samples_file

MODEL = "/models/gemma3-270m"


def _write_run(
    root: Path,
    name: str,
    kv_format: str,
    tasks: dict[str, list[dict]],
    *,
    model: str = MODEL,
    complete: bool = True,
    tokens_per_s: float = 100.0,
    capacity: float = 1.0,
    limit: int | None = None,
    granularity: str | None = None,
    skip: str = "",
    dtype: str = "float32",
    max_length: int | None = 2048,
    task_configs: dict[str, dict[str, Any]] | None = None,
    perturb_weights: float | None = None,
) -> Path:
    """One run directory as `kvcal eval` writes it; `granularity` makes it a calibrated run. `max_length`: the
    window results.json records (None: none recorded); `task_configs`: lm-eval's configs[task] entries."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    scales = {"sha256": "0" * 64, "granularity": granularity, "observer": "minmax", "binding_differences": []}
    cfg = RunConfig(
        model=model, model_dir=model, kv_format=kv_format, tasks=list(tasks), limit=limit, skip_layers=skip,
        scales_path=f"/scales/{name}.safetensors" if granularity else None, scales=scales if granularity else None,
        dtype=dtype, perturb_weights=perturb_weights,
    )  # fmt: skip
    (d / CONFIG).write_text(yaml.safe_dump(cfg.to_dict()))
    results: dict[str, Any] = {"results": {}, "configs": dict(task_configs or {}), "n-shot": {}, "versions": {},
                               "n-samples": {}}  # fmt: skip
    if max_length is not None:
        results["max_length"] = max_length
    for task, recs in tasks.items():
        (d / samples_file(task)).write_text("".join(json.dumps(r) + "\n" for r in recs))
        results["results"][task] = {"alias": task}
    (d / RESULTS).write_text(json.dumps(results))
    metrics = {"tokens_per_s": tokens_per_s, "capacity_multiplier_vs_bf16": capacity}
    (d / METRICS).write_text(json.dumps(metrics))
    if complete:
        (d / COMPLETE).write_text(json.dumps({"finished": "now"}))
    return d


def _gsm8k_records(correct: np.ndarray) -> list[dict]:
    """lm-eval gsm8k records: one per (doc, filter)."""
    return [
        {"doc_id": i, "filter": flt, "metrics": ["exact_match"], "exact_match": float(c), "doc_hash": f"h{i}",
         "target": "1", "filtered_resps": ["1"]}
        for i, c in enumerate(correct)
        for flt in ("strict-match", "flexible-extract")
    ]  # fmt: skip


def _wikitext_records(ll: np.ndarray, words: np.ndarray) -> list[dict]:
    return [
        {"doc_id": i, "filter": "none", "metrics": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
         "word_perplexity": [float(a), int(w)], "byte_perplexity": [float(a), int(w) * 5],
         "bits_per_byte": [float(a), int(w) * 5]}
        for i, (a, w) in enumerate(zip(ll, words, strict=True))
    ]  # fmt: skip


def _kl_records(kl: np.ndarray, agree: np.ndarray) -> list[dict]:
    """kvcal's kl windows: {doc_id, kl, top1_agree, nll, n_tokens}."""
    return [
        {"doc_id": i, "kl": float(k), "top1_agree": float(a), "nll": 3.0, "n_tokens": 64}
        for i, (k, a) in enumerate(zip(kl, agree, strict=True))
    ]


@pytest.fixture(scope="session")
def write_run() -> Callable[..., Path]:
    return _write_run


@pytest.fixture(scope="session")
def gsm8k_records() -> Callable[[np.ndarray], list[dict]]:
    return _gsm8k_records


@pytest.fixture(scope="session")
def wikitext_records() -> Callable[[np.ndarray, np.ndarray], list[dict]]:
    return _wikitext_records


@pytest.fixture(scope="session")
def kl_records() -> Callable[[np.ndarray, np.ndarray], list[dict]]:
    return _kl_records
