"""`run_eval(EvalConfig) -> Path`: one model x one KV configuration x a task list, into one run directory.

Order of work (so bad input never damages an existing run): validate everything (format, limit, tasks, data
files, GPQA password, scale file vs checkpoint) -> open the run directory (complete: skip; other config: error)
-> load the model once -> each task through lm-eval's simple_evaluate (or kvcal's kl), persisted as it finishes
-> results.json, metrics.json -> COMPLETE.
"""

from __future__ import annotations

import hashlib
import platform
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcal import __version__
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate import runstore
from kvcal.evaluate.kl import DEFAULT_SEQ_LEN
from kvcal.evaluate.runstore import RunStore
from kvcal.evaluate.tasks import KL_TASK, TaskPlan, resolve_tasks, task_manager_for

DTYPES = ("float32", "bfloat16", "float16")
IMPLS = ("auto", "torch", "triton")


@dataclass
class EvalConfig:
    """Everything one evaluation needs. `gpqa_password` is never written anywhere."""

    model: str
    kv_format: str = "auto"
    tasks: list[str] = field(default_factory=lambda: ["wikitext"])
    output: str | None = None  # the run directory; None -> run_dir_name(config) under the current folder
    scales: str | None = None
    force_scales: bool = False
    skip_layers: str | None = None
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    data_dir: str | None = None
    gpqa_password: str | None = field(default=None, repr=False)
    impl: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 1
    seed: int = 0
    kl_seq_len: int = DEFAULT_SEQ_LEN
    max_gen_toks: int | None = None  # cap on generated tokens (lm-eval's aime25 asks for 32768)


def parse_kv_format(name: str | None) -> str:
    """Canonical format name ('auto' for empty / auto); UsageError listing the valid names otherwise."""
    if name is None or str(name).strip().lower() in ("", "auto"):
        return "auto"
    from kvcal.formats import get_format

    return get_format(str(name)).name


# ---- names --------------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "x"


def model_short(model: str) -> str:
    name = Path(str(model).rstrip("/")).name
    for suffix in (".gguf", ".GGUF"):
        name = name.removesuffix(suffix)
    return _slug(name)


def scales_tag(scales: str | None) -> str:
    """'none' (uncalibrated / dynamic) or 'calib-<granularity>' read from the scale file's manifest."""
    if not scales:
        return "none"
    try:
        from kvcal.scales import load_scale_file

        return f"calib-{load_scale_file(scales).granularity}"
    except ImportError:
        return "calib"


def skip_tag(skip_layers: str | None) -> str:
    if not skip_layers or str(skip_layers).strip().lower() in ("", "none"):
        return "none"
    return _slug(str(skip_layers).replace(",", "-"))


def run_dir_name(config: EvalConfig) -> str:
    """`{model_short}__{kv_format}__{scales_tag}__skip-{skip_tag}`, e.g.
    `gemma3-270m__fp8_e4m3__calib-tensor__skip-sliding_window`."""
    fmt = parse_kv_format(config.kv_format)
    return f"{model_short(config.model)}__{fmt}__{scales_tag(config.scales)}__skip-{skip_tag(config.skip_layers)}"


# ---- validation + the recorded config -----------------------------------------------------------------------


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def validate(config: EvalConfig) -> tuple[TaskPlan, str]:
    """Check the cheap things first (nothing here imports lm-eval's model code). Returns (task plan, format)."""
    if config.limit is not None and config.limit <= 0:
        raise UsageError(f"--limit must be a positive number of samples, got {config.limit}")
    if config.num_fewshot is not None and config.num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be 0 or more, got {config.num_fewshot}")
    if config.max_gen_toks is not None and config.max_gen_toks < 1:
        raise UsageError(f"--max-gen-toks must be at least 1, got {config.max_gen_toks}")
    if config.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {config.batch_size}")
    if config.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got '{config.dtype}'")
    if config.impl not in IMPLS:
        raise UsageError(f"--impl must be one of {', '.join(IMPLS)}, got '{config.impl}'")
    if config.device not in ("cpu", "cuda") and not str(config.device).startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got '{config.device}'")
    fmt = parse_kv_format(config.kv_format)
    if fmt == "auto" and (config.scales or config.skip_layers):
        raise UsageError(
            "--scales / --skip-layers need a quantized --kv-format (auto leaves the cache untouched)"
        )
    if config.scales and not Path(config.scales).is_file():
        raise UsageError(
            f"scale file '{config.scales}' does not exist; pass the file `kvcal calibrate` wrote"
        )
    plan = resolve_tasks(
        config.tasks,
        include_path=config.include_path,
        data_dir=config.data_dir,
        gpqa_password=config.gpqa_password,
    )
    return plan, fmt


def record_config(
    config: EvalConfig, plan: TaskPlan, fmt: str, model_ref: str, model_dir: Path
) -> dict[str, Any]:
    """The config.yaml dict. Scale files are checked against the checkpoint here (before any write)."""
    from kvcal.models import kv_spec, load_config, parse_skip_layers

    kv = kv_spec(load_config(model_dir))
    skip = sorted(parse_skip_layers(config.skip_layers, kv))
    scales: dict[str, Any] | None = None
    if config.scales:
        from kvcal.scales import binding_differences, load_scales_for_model

        ss = load_scales_for_model(
            config.scales, model_ref, model_dir, kv, kv_format=fmt, force=config.force_scales
        )
        manifest = getattr(ss, "manifest", {}) or {}
        observer = manifest.get("observer")
        scales = {
            "sha256": _sha256(config.scales),
            "granularity": ss.granularity,
            "observer": observer.get("name") if isinstance(observer, dict) else observer,
            "binding_differences": binding_differences(ss, model_ref, model_dir, kv),
        }
        if scales["binding_differences"] and config.force_scales:
            scales["WARNING"] = (
                "scales were measured on another checkpoint; used anyway because of --force-scales"
            )
    return {
        "model": model_ref,
        "model_dir": str(model_dir),
        "kv_format": fmt,
        "scales_path": str(Path(config.scales).resolve()) if config.scales else None,
        "scales": scales,
        "force_scales": bool(config.force_scales),
        "skip_layers": config.skip_layers or "",
        "skip_layer_indices": skip,
        "tasks": plan.names,
        "include_path": plan.include_path,
        "limit": config.limit,
        "num_fewshot": config.num_fewshot,
        "data_dir": str(Path(config.data_dir).resolve()) if config.data_dir else None,
        "impl": config.impl,
        "dtype": config.dtype,
        "device": config.device,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "kl_seq_len": config.kl_seq_len if plan.has_kl else None,
        "max_gen_toks": config.max_gen_toks,
        "kvcal_version": __version__,
    }


def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in (
        "torch",
        "transformers",
        "lm-eval",
        "datasets",
        "triton",
        "safetensors",
        "compressed-tensors",
    ):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    try:
        rev = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            or None
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "kvcal"],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev, dirty = None, ""
    gpu = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {
        "kvcal_version": __version__,
        "kvcal_git_revision": rev,
        "kvcal_git_dirty": bool(dirty),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": gpu,
        "versions": versions,
    }


# ---- sample hygiene -----------------------------------------------------------------------------------------


def private_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A GPQA sample with nothing of the question left in plain text: the doc, the prompts and the raw
    generations go; a hash of the doc stays (enough to pair samples across runs)."""
    out = {k: v for k, v in sample.items() if k not in ("doc", "arguments", "resps")}
    out["doc_hash"] = (
        sample.get("doc_hash")
        or hashlib.sha256(repr(sorted((sample.get("doc") or {}).items())).encode()).hexdigest()
    )
    filtered = out.get("filtered_resps")
    if isinstance(filtered, list) and any(isinstance(f, str) and len(f) > 16 for f in filtered):
        out["filtered_resps"] = [
            f
            if not isinstance(f, str) or len(f) <= 16
            else "sha256:" + hashlib.sha256(f.encode()).hexdigest()
            for f in filtered
        ]
    return out


_RESULT_KEYS = (
    "results",
    "groups",
    "group_subtasks",
    "configs",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
)


def _task_part(res: dict[str, Any]) -> dict[str, Any]:
    return {k: res[k] for k in _RESULT_KEYS if k in res}


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {k: {} for k in _RESULT_KEYS}
    for part in parts:
        for k in _RESULT_KEYS:
            if isinstance(part.get(k), dict):
                merged[k].update(part[k])
    return {
        k: v for k, v in merged.items() if v or k in ("results", "configs", "versions", "n-shot", "n-samples")
    }


# ---- capacity -----------------------------------------------------------------------------------------------


def cache_capacity(model_dir: Path, fmt: str, skip: list[int], dtype: str) -> dict[str, Any]:
    """Cache bytes per token (no sliding-window discount: the longest-context view) and tokens-that-fit
    multiplier vs a BF16 cache, per DESIGN.md's formula."""
    from kvcal.models import kv_spec, load_config

    kv = kv_spec(load_config(model_dir))
    model_bits = 32 if dtype == "float32" else 16

    def bits(layer_fmt: str, head_dim: int) -> float:
        if layer_fmt == "auto":
            return float(model_bits)
        from kvcal.formats import bits_per_element

        return float(bits_per_element(layer_fmt, head_dim))

    total = 0.0
    bf16 = 0.0
    for layer in kv.layers:
        elems = 2 * layer.kv_heads * layer.head_dim
        layer_fmt = "bf16" if layer.index in skip else fmt
        total += elems * bits(layer_fmt, layer.head_dim) / 8
        bf16 += elems * 16 / 8
    return {
        "bytes_per_token": total,
        "bf16_bytes_per_token": bf16,
        "capacity_multiplier_vs_bf16": bf16 / total,
    }


# ---- the run ------------------------------------------------------------------------------------------------


def _seeds(seed: int) -> dict[str, int]:
    # seed 0 = lm-eval's own defaults (so `kvcal eval` matches a plain `lm_eval` run); otherwise all four = seed.
    if seed == 0:
        return {
            "random_seed": 0,
            "numpy_random_seed": 1234,
            "torch_random_seed": 1234,
            "fewshot_random_seed": 1234,
        }
    return {
        "random_seed": seed,
        "numpy_random_seed": seed,
        "torch_random_seed": seed,
        "fewshot_random_seed": seed,
    }


class _TokenCounter:
    """Counts the tokens every forward of the model processes (prefill and decode steps)."""

    def __init__(self, model: Any) -> None:
        self.tokens = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
            self.tokens += int(ids.shape[0] * ids.shape[1]) if ids is not None else 0
        else:
            self.tokens += int(ids.numel())

    def close(self) -> None:
        self._handle.remove()


def run_eval(config: EvalConfig, progress: Callable[[str], None] | None = None) -> Path:
    """Evaluate `config` into its run directory and return the directory. A complete directory with the same
    config is returned untouched; an interrupted one resumes (finished tasks are not rerun)."""
    say = progress or (lambda _msg: None)
    plan, fmt = validate(config)
    from kvcal.evaluate.adapter import resolve_pretrained

    model_ref, model_dir = resolve_pretrained(config.model)
    recorded = record_config(config, plan, fmt, model_ref, model_dir)
    out = Path(config.output) if config.output else Path(run_dir_name(config))
    store = RunStore(out)
    state = store.open(recorded)
    if state == "complete":
        say(f"{out}: complete, skipped")
        return out
    store.write_json(runstore.ENV, environment(config.device))

    pending = [t for t in plan.names if store.finished_task(t) is None]
    lm = None
    counter = None
    if pending:
        say(f"loading {model_ref} ({config.dtype}, {config.device}, kv {fmt})")
        lm = _make_lm(config, fmt, model_ref, model_dir)
        counter = _TokenCounter(lm.model)
    try:
        for task in plan.names:
            if store.finished_task(task) is not None:
                say(f"{task}: already done, skipped")
                continue
            assert lm is not None and counter is not None
            say(f"{task}: running")
            t0, tok0 = time.perf_counter(), counter.tokens
            if task == KL_TASK:
                part, samples = _run_kl_task(lm, config, model_dir)
            else:
                part, samples = _run_lm_eval_task(lm, plan, task, config)
            wall = time.perf_counter() - t0
            part["kvcal_task_metrics"] = {"wall_s": wall, "tokens": counter.tokens - tok0}
            store.save_task(task, part, samples)
    finally:
        if counter is not None:
            counter.close()

    parts = [store.finished_task(t) or {} for t in plan.names]
    merged = merge_results(parts)
    merged["config"] = {
        "model": "kvcal",
        "model_args": _model_args_string(recorded),
        "batch_size": config.batch_size,
        "device": config.device,
        "limit": config.limit,
        "num_fewshot": config.num_fewshot,
        **_seeds(config.seed),
    }
    if lm is not None:
        merged["kvcal"] = lm.kvcal_describe()
    merged["date"] = time.time()
    store.write_json(runstore.RESULTS, merged)

    wall = sum(p.get("kvcal_task_metrics", {}).get("wall_s", 0.0) for p in parts)
    tokens = sum(p.get("kvcal_task_metrics", {}).get("tokens", 0) for p in parts)
    metrics: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": _peak_gpu(config.device),
        "per_task": {t: p.get("kvcal_task_metrics") for t, p in zip(plan.names, parts, strict=True)},
    }
    metrics.update(cache_capacity(model_dir, fmt, recorded["skip_layer_indices"], config.dtype))
    store.write_json(runstore.METRICS, metrics)
    store.mark_complete(recorded)
    say(f"{out}: complete")
    return out


def _peak_gpu(device: str) -> int | None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return None


def _model_args_string(recorded: dict[str, Any]) -> str:
    args = [
        f"pretrained={recorded['model_dir']}",
        f"kv_format={recorded['kv_format']}",
        f"dtype={recorded['dtype']}",
    ]
    if recorded.get("scales_path"):
        args.append(f"kv_scales={recorded['scales_path']}")
    if recorded.get("skip_layers"):
        args.append(f"skip_layers={recorded['skip_layers']}")
    args.append(f"impl={recorded['impl']}")
    return ",".join(args)


def _make_lm(config: EvalConfig, fmt: str, model_ref: str, model_dir: Path) -> Any:
    from kvcal.evaluate.adapter import KvcalLM

    return KvcalLM(
        pretrained=str(model_dir),
        model_ref=model_ref,
        kv_format=fmt,
        kv_scales=config.scales,
        skip_layers=config.skip_layers,
        impl=config.impl,
        force_scales=config.force_scales,
        dtype=config.dtype,
        device=config.device,
        batch_size=config.batch_size,
    )


def _run_lm_eval_task(
    lm: Any, plan: TaskPlan, task: str, config: EvalConfig
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from lm_eval import simple_evaluate

    res = simple_evaluate(
        model=lm,
        tasks=[plan.lm_eval_specs[task]],
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        log_samples=True,
        task_manager=task_manager_for(plan),
        gen_kwargs={"max_gen_toks": config.max_gen_toks} if config.max_gen_toks else None,
        **_seeds(config.seed),
    )
    if res is None:
        raise KvcalError(f"lm-eval returned no results for task '{task}'")
    samples_by_task = res.get("samples", {}) or {}
    samples: list[dict[str, Any]] = []
    for name, recs in samples_by_task.items():
        for rec in recs:
            rec = dict(rec)
            if len(samples_by_task) > 1:
                rec["task"] = name
            samples.append(private_sample(rec) if task in plan.private else rec)
    part = _task_part(res)
    if task in plan.private:
        part = _scrub_configs(part)
    return part, samples


def _scrub_configs(part: dict[str, Any]) -> dict[str, Any]:
    """GPQA configs carry only templates, but keep the local zip path and loader out of results.json."""
    for cfg in part.get("configs", {}).values():
        if isinstance(cfg, dict):
            cfg.pop("dataset_kwargs", None)
            if "custom_dataset" in cfg:
                cfg["custom_dataset"] = "kvcal.evaluate.tasks.gpqa_in_memory"
    return part


def _run_kl_task(lm: Any, config: EvalConfig, model_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from kvcal.evaluate.kl import run_kl

    model = lm.model

    @contextmanager
    def baseline() -> Iterator[Callable[[Any], Any]]:
        from kvcal.kernels.runtime import KVRuntime

        rt = KVRuntime(model, "bf16", impl=config.impl)  # replaces the evaluated configuration for a moment
        try:
            yield lambda ids: model(ids, past_key_values=rt.new_cache(), use_cache=True).logits
        finally:
            lm.activate_runtime()

    desc = {"kv_format": "bf16", "impl": config.impl, "dtype": config.dtype, "device": config.device}
    return run_kl(
        model,
        lm.tokenizer,
        quant_forward=lm._model_call,
        baseline=baseline,
        baseline_desc=desc,
        model_dir=model_dir,
        data_dir=config.data_dir,
        limit=config.limit,
        seq_len=config.kl_seq_len,
    )


def config_dict(config: EvalConfig) -> dict[str, Any]:
    d = asdict(config)
    d.pop("gpqa_password", None)
    return d
