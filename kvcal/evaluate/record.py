"""What a run directory records besides its tasks: env.json (`environment`), results.json (`results_record`:
lm-eval's results merged over the tasks, the model args and seeds) and metrics.json (`metrics_record`: wall time,
prefill / decode timing, peak memory, non-finite K/V counts, the cache's capacity). docs/run-directory.md.
"""

from __future__ import annotations

import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcal import __version__
from kvcal.capacity import run_capacity, storage_bytes_per_token
from kvcal.errors import KvcalError
from kvcal.evaluate.timing import run_timing
from kvcal.rundir import RunConfig

if TYPE_CHECKING:
    from kvcal.evaluate.bound import BoundSpec


def environment(device: str) -> dict[str, Any]:
    """env.json: package versions, platform, device and kvcal's git revision."""
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
    rev, dirty = _git_revision()
    gpu = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "kvcal_version": __version__,
        "kvcal_git_revision": rev,
        "kvcal_git_dirty": dirty,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),  # the report compares speeds only of runs from one host (kvcal.report.speed)
        "processor": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": gpu,
        "versions": versions,
    }


def _git_revision() -> tuple[str | None, bool]:
    """(commit of the kvcal checkout or None when not a git checkout, whether kvcal/ has local changes)."""
    here = Path(__file__).resolve()
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=here.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "kvcal"],
            cwd=here.parents[2],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None, False
    return rev or None, bool(dirty)


_RESULT_KEYS = (
    "results",
    "groups",
    "group_subtasks",
    "configs",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
    "kl_by_position",
    "passkey_by_cell",
    "divergence_by_position",
)


def task_part(res: dict[str, Any]) -> dict[str, Any]:
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


def seeds(seed: int) -> dict[str, int]:
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


def results_record(
    parts: list[dict[str, Any]], bound: BoundSpec, runtime: dict[str, Any] | None, max_length: int | None = None
) -> dict[str, Any]:
    """results.json: lm-eval's results dict merged over the tasks, with the model args and seeds used, and as
    lm-eval records it (lm_eval.loggers.utils.add_tokenizer_info) the `max_length` the model ran with (the LM's;
    None: --max-length, else lm-eval's default from the model's config)."""
    config, recorded = bound.spec, bound.recorded
    assert recorded is not None
    merged = merge_results(parts)
    merged["config"] = {
        "model": "kvcal",
        "model_args": model_args_string(recorded),
        "batch_size": config.batch_size,
        "device": recorded.device,
        "dtype": recorded.dtype,
        "limit": config.limit,
        "num_fewshot": config.num_fewshot,
        **seeds(config.seed),
    }
    merged["kvcal"] = {  # the cache the run evaluated
        "model_ref": config.model,
        "model_dir": str(bound.model_dir),
        "kv_format": bound.cache.kv_format,
        "scales": config.scales.path,
        "skip_layers": sorted(bound.cache.skip_layers),
        "impl": bound.cache.impl,
    }
    if runtime is not None:  # the installed runtime's own description (KVRuntime.describe: per layer, first batch)
        merged["kvcal"]["runtime"] = runtime
    if max_length is None:
        from lm_eval.models.utils import resolve_max_length

        max_length = config.max_length or resolve_max_length(bound.hf_config)
    merged["max_length"] = int(max_length)
    merged["date"] = time.time()
    return merged


def metrics_record(parts: list[dict[str, Any]], bound: BoundSpec) -> dict[str, Any]:
    """metrics.json: emulation wall time and tokens, prefill / decode timing (TTFT, TPOT), peak memory, and the
    cache's capacity as `kvcal capacity` counts it (docs/run-directory.md)."""
    plan, recorded = bound.tasks, bound.recorded
    assert plan is not None and recorded is not None
    wall = sum(p.get("kvcal_task_metrics", {}).get("wall_s", 0.0) for p in parts)
    tokens = sum(p.get("kvcal_task_metrics", {}).get("tokens", 0) for p in parts)
    peak_gpu = _peak_gpu(recorded.device)
    nonfinite = sum_nonfinite([p.get("kvcal_task_metrics", {}) for p in parts])
    metrics: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        **run_timing(parts),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": peak_gpu,
        "per_task": {t: p.get("kvcal_task_metrics") for t, p in zip(plan.names, parts, strict=True)},
        "nonfinite_kv": nonfinite,
    }
    metrics.update(run_capacity(bound.kv, recorded.kv_format, bound.skip_layers))
    if recorded.prefix_serde is not None:  # LMCache's storage tier: its own bytes, apart from the live cache's
        metrics["storage_bytes_per_token"] = storage_bytes_per_token(bound.kv, recorded.prefix_serde)["bytes_per_token"]
    return metrics


def _peak_gpu(device: str) -> int | None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return None


def model_args_string(recorded: RunConfig) -> str:
    args = [
        f"pretrained={recorded.model_dir}",
        f"kv_format={recorded.kv_format}",
        f"dtype={recorded.dtype}",
    ]
    if recorded.scales_path:
        args.append(f"kv_scales={recorded.scales_path}")
    if recorded.attention:
        args.append(f"attention={recorded.attention}")
    if recorded.scale_source:
        args.append(f"kv_scales={recorded.scale_source}")
    if recorded.kv_input_dtype:
        args.append(f"kv_input_dtype={recorded.kv_input_dtype}")
    if recorded.skip_layers:
        args.append(f"skip_layers={recorded.skip_layers}")
    if recorded.logprob_dtype:
        args.append(f"logprob_dtype={recorded.logprob_dtype}")
    if recorded.max_length:
        args.append(f"max_length={recorded.max_length}")
    if recorded.perturb_weights:
        args.append(f"perturb_weights={recorded.perturb_weights:g},perturb_seed={recorded.seed}")
    args.append(f"impl={recorded.impl}")
    return ",".join(args)


def sum_nonfinite(task_metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """metrics.json's nonfinite_kv: the tasks' per-layer counts summed, and their total."""
    counted = [m["nonfinite_kv"] for m in task_metrics if m.get("nonfinite_kv") is not None]
    if not counted:
        return None
    per: dict[int, list[int]] = {}
    for c in counted:
        for e in c["per_layer"]:
            kv = per.setdefault(e["layer"], [0, 0])
            kv[0], kv[1] = kv[0] + e["k"], kv[1] + e["v"]
    per_layer = [{"layer": i, "k": k, "v": v} for i, (k, v) in sorted(per.items())]
    return {"per_layer": per_layer, "total": sum(c["total"] for c in counted)}


def nonfinite_kv(lm: Any, task: str, strict: bool, say: Callable[[str], None]) -> dict[str, Any] | None:
    """NaN/Inf K/V values the cache was asked to store during `task` (None: kv format auto, nothing counted);
    a warning, or a KvcalError with --strict."""
    runtime = getattr(lm, "runtime", None)
    if runtime is None:
        return None
    return check_nonfinite(runtime.take_nonfinite_kv(), task, strict, say)


def check_nonfinite(
    counts: dict[str, Any] | None, task: str, strict: bool, say: Callable[[str], None]
) -> dict[str, Any] | None:
    """`counts` (every rank's, summed) as metrics record them; a warning, or a KvcalError with --strict."""
    if counts is None:
        return None
    if counts["total"]:
        layers = ", ".join(str(e["layer"]) for e in counts["per_layer"])
        msg = f"{task}: {counts['total']} non-finite K/V values (NaN/Inf) reached the KV cache (layers {layers})"
        if strict:
            raise KvcalError(f"{msg}; the model overflows its dtype (try --dtype float32), or drop --strict")
        say(f"WARNING: {msg}; counted in metrics.json (nonfinite_kv)")
    return counts
