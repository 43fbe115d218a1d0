"""lm-eval output folders as runs: what `lm_eval ... --output_path P --log_samples` writes, read for comparison.

lm-eval's EvaluationTracker (lm_eval/loggers/evaluation_tracker.py, lm-eval 0.4.13: save_results_aggregated /
save_results_samples) writes, for any backend (vllm, sglang, hf, local-completions, kvcal):

    P/<model_name_sanitized>/results_<date_id>.json          (date_id: datetime.now().isoformat() with ':' -> '-')
    P/<model_name_sanitized>/samples_<task>_<date_id>.jsonl  (only with --log_samples)

The results record is read for the configuration: `config.model` (the backend), `config.model_args` (a dict in
lm-eval >= 0.4.8, the `k=v,k=v` string before; parsed with lm-eval's own simple_parse_args_string),
`config.limit`, and per task `configs[task]` (num_fewshot, generation_kwargs, repeats), `versions`, `n-shot`. The
engine's KV settings are its model_args (lm-eval's vllm / sglang backends pass them to the engine as keyword
arguments): vLLM's `kv_cache_dtype` (one of CacheDType), `calculate_kv_scales`, `kv_cache_dtype_skip_layers` (a
list of layer indices or attention types; vllm-project/vllm vllm/config/cache.py at 002f10e0, CacheConfig),
SGLang's `kv_cache_dtype`, `quantization_param_path` (sgl-project/sglang python/sglang/srt/server_args.py at
469c63e5, ServerArgs), kvcal's own `kv_format`, `kv_scales`, `skip_layers` (kvcal.evaluate.adapter.KvcalLM). The sample records are the ones kvcal's
run directories hold (kvcal.report.runs), so they pair the same way: by doc_id and lm-eval's doc_hash.

A folder with several results files: the latest `date_id`, or the one named by `PATH@DATE_ID`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcal.errors import UsageError
from kvcal.models.config import declares_kv_scheme
from kvcal.report.runs import BadRunError, Run, read_samples_file
from kvcal.rundir import RunConfig
from kvcal.scales import export_record

RESULTS_PREFIX, SAMPLES_PREFIX = "results_", "samples_"
# The results keys kvcal reads; a record without them is a layout kvcal does not know.
_REQUIRED = ("results", "configs", "config", "versions", "n-shot")
KNOWN_LAYOUT = "lm-eval 0.4.x (read from 0.4.13's EvaluationTracker)"
# Backends whose KV-cache dtype is `kv_cache_dtype` in model_args, with the engine whose names it takes
# (kvcal.formats engine_names). Others (hf, local-completions, ...) run the model's own cache: kvcal's `auto`.
_ENGINE_BACKENDS = {"vllm": "vllm", "sglang": "sglang"}
KVCAL_BACKEND = "kvcal"


@dataclass(frozen=True)
class Source:
    """One command-line argument that names an lm-eval output: the folder and the date_id asked for (None:
    the latest)."""

    path: Path
    date_id: str | None = None


def split_date_id(arg: str | Path) -> Source:
    """'P@2026-12-02T13-45-50.847617' -> Source(P, that date_id); a path that exists as given is never split."""
    raw = str(arg)
    if Path(raw).exists() or "@" not in raw:
        return Source(Path(raw))
    path, _, date_id = raw.rpartition("@")
    return Source(Path(path), date_id or None)


def _results_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{RESULTS_PREFIX}*.json"))


def results_folder(path: Path) -> Path | None:
    """The folder holding lm-eval's results_<date_id>.json: `path` itself, or the one model folder below it
    (`--output_path P` writes P/<model_name_sanitized>/); None when `path` is not one lm-eval output."""
    if not path.is_dir():
        return None
    if _results_files(path):
        return path
    below = [d for d in sorted(path.iterdir()) if d.is_dir() and _results_files(d)]
    return below[0] if len(below) == 1 else None  # several: a folder of outputs, searched like a RUNS_DIR


def date_id_of(results_file: Path) -> str:
    """lm-eval's own rule (lm_eval.utils.get_file_datetime): the name after the last '_'."""
    return results_file.stem[len(RESULTS_PREFIX) :]


def pick_results(folder: Path, date_id: str | None) -> Path:
    """The results file of `folder` that a comparison reads: the one of `date_id`, else the newest."""
    files = _results_files(folder)
    if date_id is None:
        return max(files, key=date_id_of)  # ISO date_ids sort in time order
    chosen = [f for f in files if date_id_of(f) == date_id]
    if not chosen:
        have = ", ".join(date_id_of(f) for f in files)
        raise UsageError(f"{folder} has no lm-eval results of {date_id} (it has {have}); pass PATH@ one of them")
    return chosen[0]


def parse_model_args(value: Any) -> dict[str, Any]:
    """lm-eval's model_args as recorded: a dict (lm-eval >= 0.4.8) or the `k=v,k=v` string of `--model_args`,
    parsed by lm-eval's own parser (lm_eval.utils.simple_parse_args_string: 'True' -> True, '0.8' -> 0.8)."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        from lm_eval.utils import simple_parse_args_string

        return simple_parse_args_string(value)
    raise UsageError(f"model_args must be a string or a mapping, got {type(value).__name__}")


def _truthy(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.strip().lower() in ("true", "1", "yes"))


def engine_kv_format(backend: str, name: Any) -> str:
    """kvcal's format for an engine's kv_cache_dtype ('fp8' on vLLM -> fp8_e4m3); UsageError naming it when
    kvcal does not emulate it."""
    from kvcal.formats import FORMATS, get_format, is_tq_preset

    text = "auto" if name in (None, "") else str(name).strip()
    engine = _ENGINE_BACKENDS.get(backend)
    if engine == "vllm" and is_tq_preset(text):
        return text.lower()  # vLLM's TurboQuant presets are kvcal's names too (K/V pairs)
    if engine:
        for f in FORMATS.values():
            if f.engine_names.get(engine) == text:
                return f.name
    try:
        return get_format(text).name
    except UsageError as exc:
        raise UsageError(f"{backend} kv_cache_dtype={text}: {exc}") from None


def _kvcal_kv_format(name: Any) -> str:
    """`--model kvcal`'s kv_format as kvcal eval records it: one format, a K/V pair or a TurboQuant preset (the
    canonical name, formats.pair_name); UsageError naming it when kvcal does not know it."""
    from kvcal.formats import kv_pair, pair_name, parse_kv_format

    text = "auto" if name in (None, "") else str(name).strip()
    try:
        return pair_name(*kv_pair(parse_kv_format(text)))
    except UsageError as exc:
        raise UsageError(f"kvcal kv_format={text}: {exc}") from None


@dataclass(frozen=True)
class EngineConfig:
    """What an lm-eval run's record says about its KV cache."""

    backend: str
    model: str
    kv_format: str
    scales: str | None  # a scale file / JSON path, or None
    scale_source: str | None  # "first-batch" (vLLM calculate_kv_scales, kvcal kv_scales=first-batch) or None
    skip_layers: str
    dtype: str


def exported_from(model_dir: str) -> set[str]:
    """The source model's reference and folder of a checkpoint `kvcal export --to vllm` wrote (its export record's
    binding), or an empty set for any other folder."""
    binding = (export_record(model_dir) or {}).get("binding")
    if not isinstance(binding, dict):
        return set()
    return {str(binding[k]) for k in ("model", "model_dir") if binding.get(k)}


def _exported_scales(model_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """(scale shard path, its record) of a checkpoint `kvcal export --to vllm` wrote: the calibrated scales vLLM
    reads from it, or None for any other folder."""
    record = export_record(model_dir)
    if record is None or not record.get("scale_shard"):
        return None
    keep = ("kv_format", "granularity", "scale_shard_sha256")
    return str(model_dir / str(record["scale_shard"])), {k: record[k] for k in keep if k in record}


def engine_config(config: dict[str, Any]) -> EngineConfig:
    """The KV configuration of an lm-eval results record's `config` (see the module docstring)."""
    backend = str(config.get("model") or "")
    args = parse_model_args(config.get("model_args"))
    model = str(args.get("model_ref") or args.get("pretrained") or args.get("model") or "")
    if not model:
        raise UsageError(f"lm-eval's config.model_args names no model (no pretrained= or model=): {args}")
    dtype = str(args.get("dtype") or "auto")
    if backend == KVCAL_BACKEND:
        scales = args.get("kv_scales")
        first = scales == "first-batch"
        return EngineConfig(
            backend, model, _kvcal_kv_format(args.get("kv_format")), None if first or not scales else str(scales),
            "first-batch" if first else None, str(args.get("skip_layers") or ""), dtype,
        )  # fmt: skip
    if backend in _ENGINE_BACKENDS:
        qpath = args.get("quantization_param_path")
        skip = args.get("kv_cache_dtype_skip_layers")
        skip = ",".join(map(str, skip)) if isinstance(skip, (list, tuple)) else skip
        kv_dtype = args.get("kv_cache_dtype")
        if _ENGINE_BACKENDS.get(backend) == "vllm" and kv_dtype in (None, "", "auto") and declares_kv_scheme(model):
            kv_dtype = "fp8"  # what vLLM serves for `auto` on this checkpoint (models.config.declares_kv_scheme)
        return EngineConfig(
            backend, model, engine_kv_format(backend, kv_dtype), str(qpath) if qpath else None,
            "first-batch" if _truthy(args.get("calculate_kv_scales")) else None, "" if skip is None else str(skip),
            dtype,
        )  # fmt: skip
    return EngineConfig(backend, model, "auto", None, None, "", dtype)


def _check_layout(results: dict[str, Any], where: Path) -> None:
    missing = [k for k in _REQUIRED if k not in results]
    if missing or not isinstance(results.get("config"), dict):
        version = results.get("lm_eval_version") or "unknown (no lm_eval_version in it)"
        raise UsageError(
            f"{where} is from lm-eval {version}, whose results layout kvcal does not know (no "
            f"{', '.join(missing) or 'config mapping'}); kvcal reads {KNOWN_LAYOUT}: rerun with that lm-eval"
        )


def task_settings(run: Run, task: str) -> dict[str, Any]:
    """The settings of one task that decide its prompts and scoring, from the run's lm-eval record (kvcal's run
    directories hold the same record in results.json): version, num_fewshot, generation_kwargs, repeats, and for
    kvcal's own runs of log-likelihood tasks `--scoring`. Keys the record lacks are left out (nothing to compare)."""
    res = run.results
    cfg = (res.get("configs") or {}).get(task) or {}
    out: dict[str, Any] = {}
    if task in (res.get("versions") or {}):
        out["version"] = res["versions"][task]
    shots = (res.get("n-shot") or {}).get(task, cfg.get("num_fewshot"))
    if shots is not None:
        out["num_fewshot"] = shots
    for key in ("generation_kwargs", "repeats", "seq_len"):  # seq_len: kvcal's kl windows (--kl-seq-len)
        if key in cfg:
            out[key] = cfg[key]
    if cfg.get("output_type") in LOGLIKELIHOOD_TYPES and "lm_eval" not in run.config.extra:
        # kvcal's own runs: through a quantized cache, continuation scoring's split (context once, then the
        # choices) moves per-sample log-likelihoods (docs/commands.md, eval): runs scored apart do not pair.
        # continuation-whole runs lm-eval's own forwards (only the head meets fewer rows): it pairs with full.
        scoring = run.config.scoring or "full"
        out["scoring"] = "full" if scoring == "continuation-whole" else scoring
    return out


# lm-eval's output types scored by log-likelihood requests (what `--scoring` changes)
LOGLIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


@dataclass(frozen=True)
class TaskLimit:
    """How many of a task's documents a run evaluated: `--limit` as recorded (lm-eval's `config.limit`: a count,
    or a fraction below 1; None: no limit) and lm-eval's `n-samples` (effective / original), None where not
    recorded."""

    limit: int | float | None
    effective: int | None
    original: int | None

    @property
    def whole(self) -> bool:
        """Every document of the task was evaluated (no limit, or one at least the task's size)."""
        return self.effective is not None and self.effective == self.original

    def describe(self) -> str:
        docs = "" if self.effective is None else f"{self.effective} documents"
        if self.limit is None:
            return "none" + (f" ({docs})" if docs else "")
        return f"{self.limit:g}" + (f" ({docs})" if docs else "")


def _count(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def task_limit(run: Run, task: str) -> TaskLimit:
    """A run's `--limit` for one task: the results record's `config.limit` (lm-eval's own, or kvcal's copy of its
    config.yaml), else config.yaml's; with `n-samples` of the task."""
    cfg = run.results.get("config")
    raw = cfg["limit"] if isinstance(cfg, dict) and "limit" in cfg else run.config.limit
    limit = raw if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
    n = (run.results.get("n-samples") or {}).get(task) or {}
    n = n if isinstance(n, dict) else {}
    return TaskLimit(limit, _count(n.get("effective")), _count(n.get("original")))


def same_documents(a: TaskLimit, b: TaskLimit) -> bool:
    """Two runs of a task evaluated the same documents: the same --limit, or both every document of it."""
    return a.limit == b.limit or (a.whole and b.whole and a.original == b.original)


def load_lm_eval_run(source: Source, label: str | None = None) -> Run:
    """One lm-eval output (a results record and its samples files) as a Run; BadRunError / UsageError naming
    the folder and what is wrong."""
    folder = results_folder(source.path)
    if folder is None:
        raise UsageError(f"{source.path} holds no lm-eval results_<date>.json")
    results_file = pick_results(folder, source.date_id)
    date_id = date_id_of(results_file)
    try:
        results = json.loads(results_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRunError(f"{results_file} does not parse ({exc})") from None
    if not isinstance(results, dict):
        raise BadRunError(f"{results_file} is not a JSON object")
    _check_layout(results, results_file)
    ec = engine_config(results["config"])
    tasks = list(results["configs"])
    if not tasks:
        raise BadRunError(f"{results_file} lists no tasks")
    name = label or _default_label(source.path, folder, results)
    limit = results["config"].get("limit")  # lm-eval: below 1 a fraction of each task (kept raw: task_limit)
    model_dir = ec.model if Path(ec.model).is_dir() else ""
    scales_path, scales = ec.scales, None
    if model_dir and _ENGINE_BACKENDS.get(ec.backend) == "vllm" and ec.kv_format not in ("auto", "bf16"):
        scales_path, scales = _exported_scales(Path(model_dir)) or (scales_path, None)
    config = RunConfig(
        model=ec.model, model_dir=model_dir, kv_format=ec.kv_format, tasks=tasks, scales_path=scales_path,
        scales=scales,
        skip_layers=ec.skip_layers, limit=int(limit) if isinstance(limit, (int, float)) and limit >= 1 else None,
        dtype=ec.dtype, scale_source=ec.scale_source, device=str(results["config"].get("device") or ""),
        kvcal_version="", extra={"lm_eval": {"backend": ec.backend, "date_id": date_id,
                                             "results": str(results_file)}},
    )  # fmt: skip
    config = _with_kvcal_record(config, results["config"])
    run = Run(path=folder, name=name, config=config, results=results, metrics={}, env={})
    for task in tasks:
        f = folder / f"{SAMPLES_PREFIX}{task}_{date_id}.jsonl"
        if not f.is_file():
            raise UsageError(
                f"{folder} has lm-eval results of {date_id} but no {f.name}: lm-eval wrote no per-sample "
                "records; rerun lm_eval with --log_samples"
            )
        run.samples[task], run.metric_order[task] = read_samples_file(f, f"lm-eval output {folder}")
        run.sample_files[task] = f
    return run


# what `--model kvcal` records of its resolved cache configuration (kvcal.evaluate.adapter.resolved_config, in
# the results' config under `kvcal`) that a RunConfig holds: read over what model_args said
_KVCAL_RECORDED = ("kv_format", "scales_path", "scales", "scale_source", "kv_input_dtype", "nvfp4_global", "attention", "impl",
                   "skip_layers", "skip_layer_indices", "force_scales", "tq_boundary_layers", "prefix_serde",
                   "prefix_tokens", "plan", "model_dir", "dtype")  # fmt: skip


def _with_kvcal_record(config: RunConfig, record: dict[str, Any]) -> RunConfig:
    """`config` with kvcal's resolved configuration where an lm-eval run of `--model kvcal` recorded it (kvcal
    issue 43 on): the defaults it resolved (kv input dtype, nvfp4's global scale, ...) are then part of the
    run's configuration as they are of a kvcal eval run's, so runs of different configurations do not pair."""
    kv = record.get("kvcal")
    if not isinstance(kv, dict):
        return config
    import dataclasses

    values = {k: kv[k] for k in _KVCAL_RECORDED if k in kv and kv[k] is not None}
    if kv.get("scoring") not in (None, "full"):
        values["scoring"] = kv["scoring"]
    return dataclasses.replace(config, **values)


def _default_label(given: Path, folder: Path, results: dict[str, Any]) -> str:
    """The --output_path folder's name (P of P/<model>/), else the folder's own."""
    if folder != given and folder.parent == given:
        return given.name
    if folder.name == results.get("model_name_sanitized") and folder.parent.name:
        return folder.parent.name
    return folder.name
