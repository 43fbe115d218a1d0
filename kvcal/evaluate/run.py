"""`run_eval(EvalSpec) -> Path`: one model x one KV configuration x a task list, into one run directory.

Order of work (so bad input never damages an existing run): validate everything (format, limit, device, tasks,
data files, GPQA password) -> resolve the model and check what its config bounds (scale file vs checkpoint,
window and generation lengths) -> open the run directory (complete: skip; other config: error) -> load the model
once -> each task through lm-eval's simple_evaluate (or kvcal's kl), persisted as it finishes -> results.json,
metrics.json -> COMPLETE.
"""

from __future__ import annotations

import hashlib
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcal import __version__, parallel
from kvcal.capacity import run_capacity
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.bound import BoundSpec, bind, task_plan
from kvcal.evaluate.git_probe import quiet_git_probe
from kvcal.evaluate.runstore import RunStore
from kvcal.evaluate.spec import EvalConfig, EvalSpec, as_spec, run_dir_name
from kvcal.evaluate.tasks import KL_TASK, PASSKEY_TASKS, TaskPlan, task_manager_for
from kvcal.evaluate.timing import FORWARDS_KEY, ForwardTimer, ForwardTotals, run_timing
from kvcal.rundir import ENV, METRICS, RESULTS, RunConfig

__all__ = ["BoundSpec", "EvalConfig", "EvalSpec", "bind", "run_dir_name", "run_eval", "task_plan"]


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
    "kl_by_position",
    "passkey_by_cell",
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


def run_eval(config: EvalSpec | EvalConfig, progress: Callable[[str], None] | None = None) -> Path:
    """Evaluate `config` (a spec, or options that `eval_spec` parses) into its run directory and return the
    directory. A complete directory with the same config is returned untouched; an interrupted one resumes
    (finished tasks are not rerun)."""
    say = progress or (lambda _msg: None)
    bound = bind(as_spec(config))  # everything checked, against the checkpoint too, before anything is written
    spec, plan, recorded = bound.spec, bound.tasks, bound.recorded
    assert plan is not None and recorded is not None  # a spec of kvcal eval has tasks
    out = spec.run_dir
    store = RunStore(out)
    if spec.limit is not None:  # several processes (torchrun): each needs a sample
        parallel.check_enough_work(spec.limit, "samples (--limit)", parallel.from_env())
    dist = parallel.setup(spec.device)
    if not dist.is_main:  # rank 0 speaks and writes the one run directory; the others only compute
        say = _silent
    if _open_store(store, recorded, dist) == "complete":
        say(f"{out}: complete, skipped")
        return out
    if dist.is_main:
        store.write_json(ENV, environment(spec.device))
    lm = _run_tasks(store, bound, say, dist)
    if not dist.is_main:
        return out
    parts = [store.finished_task(t) or {} for t in plan.names]
    store.write_json(RESULTS, _results(parts, bound, lm))
    store.write_json(METRICS, _metrics(parts, bound))
    store.mark_complete(recorded)
    say(f"{out}: complete")
    return out


def _silent(_msg: str) -> None:
    return None


def _open_store(store: RunStore, recorded: RunConfig, dist: parallel.Dist) -> str:
    """`store.open` on rank 0 ('fresh', 'resume' or 'complete'), shared with every rank; a refusal stops all of
    them (rank 0 says why)."""
    outcome: tuple[str, str] = ("", "")
    if dist.is_main:
        try:
            outcome = ("ok", store.open(recorded))
        except KvcalError as exc:
            parallel.broadcast_object(("error", str(exc)), dist)
            raise
    outcome = parallel.broadcast_object(outcome, dist)
    if outcome[0] == "error":
        raise UsageError(f"rank {dist.rank}: rank 0 refused the run directory: {outcome[1]}")
    return outcome[1]


def _run_tasks(
    store: RunStore,
    bound: BoundSpec,
    say: Callable[[str], None],
    dist: parallel.Dist | None = None,
) -> Any:
    """Run every unfinished task (one model load), saving each as it finishes (rank 0: the others run their
    share of each task). Returns the LM, or None when every task was already done."""
    plan, recorded, config = bound.tasks, bound.recorded, bound.spec
    assert plan is not None and recorded is not None
    dist = dist or parallel.Dist()
    # decided once, on rank 0, before it writes anything: every rank runs the same tasks
    pending = parallel.broadcast_object([t for t in plan.names if store.finished_task(t) is None], dist)
    for task in plan.names:
        if task not in pending:
            say(f"{task}: already done, skipped")
    if not pending:
        return None
    say(f"loading {recorded.model} ({recorded.dtype}, {recorded.device}, kv {recorded.kv_format})")
    lm = _make_lm(bound)
    # prefill / decode forwards and TTFT (kvcal.evaluate.timing); the LM marks its generate calls
    lm.forward_timer = timer = ForwardTimer(lm.model)
    try:
        for task in pending:
            say(f"{task}: running")
            timer.take()  # start the task's totals afresh
            t0 = time.perf_counter()
            if task == KL_TASK:
                part, samples = _run_kl_task(lm, bound, dist)
            else:
                with quiet_git_probe():  # lm-eval's `git describe` prints "fatal: ..." outside a checkout
                    part, samples = _run_lm_eval_task(lm, plan, task, config)
            mine = (timer.take().to_record(), _nonfinite_kv(lm, task, False, _silent))
            shared = parallel.gather_objects(mine, dist)  # every rank's (forward totals, non-finite counts)
            if part is None or shared is None:
                continue  # not rank 0: it holds the task's results
            forwards = ForwardTotals.merge([ForwardTotals.from_record(f) for f, _ in shared])
            part[FORWARDS_KEY] = forwards.to_record()
            part["kvcal_task_metrics"] = {"wall_s": time.perf_counter() - t0, "tokens": forwards.tokens}
            part["kvcal_task_metrics"].update(forwards.summary())
            part["kvcal_task_metrics"]["nonfinite_kv"] = _check_nonfinite(
                _sum_nonfinite([{"nonfinite_kv": c} for _, c in shared]), task, config.strict, say
            )
            store.save_task(task, part, samples)
    finally:
        timer.close()
        lm.forward_timer = None
    return lm


def _results(parts: list[dict[str, Any]], bound: BoundSpec, lm: Any) -> dict[str, Any]:
    """results.json: lm-eval's results dict merged over the tasks, with the model args and seeds used."""
    config, recorded = bound.spec, bound.recorded
    assert recorded is not None
    merged = merge_results(parts)
    merged["config"] = {
        "model": "kvcal",
        "model_args": _model_args_string(recorded),
        "batch_size": config.batch_size,
        "device": recorded.device,
        "dtype": recorded.dtype,
        "limit": config.limit,
        "num_fewshot": config.num_fewshot,
        **_seeds(config.seed),
    }
    if lm is not None:
        merged["kvcal"] = lm.kvcal_describe()
    merged["date"] = time.time()
    return merged


def _metrics(parts: list[dict[str, Any]], bound: BoundSpec) -> dict[str, Any]:
    """metrics.json: emulation wall time and tokens, prefill / decode timing (TTFT, TPOT), peak memory, and the
    cache's capacity as `kvcal capacity` counts it (docs/run-directory.md)."""
    plan, recorded = bound.tasks, bound.recorded
    assert plan is not None and recorded is not None
    wall = sum(p.get("kvcal_task_metrics", {}).get("wall_s", 0.0) for p in parts)
    tokens = sum(p.get("kvcal_task_metrics", {}).get("tokens", 0) for p in parts)
    metrics: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        **run_timing(parts),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": _peak_gpu(recorded.device),
        "per_task": {t: p.get("kvcal_task_metrics") for t, p in zip(plan.names, parts, strict=True)},
    }
    metrics["nonfinite_kv"] = _sum_nonfinite([p.get("kvcal_task_metrics", {}) for p in parts])
    metrics.update(run_capacity(bound.kv, recorded.kv_format, bound.skip_layers))
    return metrics


def _peak_gpu(device: str) -> int | None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return None


def _model_args_string(recorded: RunConfig) -> str:
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
    args.append(f"impl={recorded.impl}")
    return ",".join(args)


def _make_lm(bound: BoundSpec) -> Any:
    """The lm-eval model of the bound spec: its cache plan (the checked scale set, the skip indices), its
    placement; nothing is parsed or read again."""
    from kvcal.evaluate.adapter import KvcalLM

    spec = bound.spec
    return KvcalLM.from_bound(
        bound,
        dtype=bound.dtype,
        device=spec.device,
        batch_size=spec.batch_size,
        trust_remote_code=spec.trust_remote_code,
    )


def _run_lm_eval_task(
    lm: Any, plan: TaskPlan, task: str, config: EvalSpec
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    from lm_eval import simple_evaluate

    res = simple_evaluate(
        model=lm,
        tasks=[plan.lm_eval_specs[task]],
        num_fewshot=config.num_fewshot,
        limit=None if task in PASSKEY_TASKS else config.limit,  # passkey: --limit = samples per cell
        log_samples=True,
        task_manager=task_manager_for(plan),
        gen_kwargs={"max_gen_toks": config.max_gen_toks} if config.max_gen_toks else None,
        **_seeds(config.seed),
    )
    if res is None:
        if lm.rank != 0:  # lm-eval gathered this rank's share on rank 0
            return None, []
        raise KvcalError(f"lm-eval returned no results for task '{task}'")
    samples_by_task = res.get("samples", {}) or {}
    samples: list[dict[str, Any]] = []
    for name, recs in samples_by_task.items():
        if lm.world_size > 1:
            recs = undo_rank_split(recs, (res.get("configs", {}).get(name) or {}).get("repeats", 1))
        for rec in recs:
            rec = dict(rec)
            if len(samples_by_task) > 1:
                rec["task"] = name
            samples.append(private_sample(rec) if task in plan.private else rec)
    part = _task_part(res)
    if task in plan.private:
        part = _scrub_configs(part)
    if task in PASSKEY_TASKS:
        from kvcal.evaluate.passkey import cells

        part["passkey_by_cell"] = {task: cells(task, samples)}
    return part, samples


def undo_rank_split(recs: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """One process's sample records from several processes' (lm-eval's evaluator concatenates the ranks' records
    rank by rank, and pads a rank that has fewer requests with copies of its last request, whose responses then
    land in that request's `resps` too): per filter, in document order, `resps` cut back to `repeats`."""
    filters = list(dict.fromkeys(r.get("filter") for r in recs))  # first-seen order = lm-eval's filter order
    ordered = sorted(recs, key=lambda r: (filters.index(r.get("filter")), r.get("doc_id", 0)))
    out = []
    for rec in ordered:
        if isinstance(rec.get("resps"), list):
            rec = {**rec, "resps": [r[:repeats] if isinstance(r, list) else r for r in rec["resps"]]}
        out.append(rec)
    return out


def _scrub_configs(part: dict[str, Any]) -> dict[str, Any]:
    """GPQA configs carry only templates, but keep the local zip path and loader out of results.json."""
    for cfg in part.get("configs", {}).values():
        if isinstance(cfg, dict):
            cfg.pop("dataset_kwargs", None)
            if "custom_dataset" in cfg:
                cfg["custom_dataset"] = "kvcal.evaluate.tasks.gpqa_in_memory"
    return part


def _run_kl_task(
    lm: Any, bound: BoundSpec, dist: parallel.Dist | None = None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    from kvcal.evaluate.kl import lm_sides, run_kl

    spec, recorded = bound.spec, bound.recorded
    assert recorded is not None
    quant_session, baseline = lm_sides(lm, spec.impl)
    base = {"kv_format": "bf16", "impl": spec.impl, "dtype": bound.dtype, "device": spec.device}
    return run_kl(
        lm.model,
        lm.tokenizer,
        quant_session=quant_session,
        baseline=baseline,
        baseline_desc={**base, "attention": "kvcal"},
        evaluated_desc=_kl_evaluated_side(recorded),
        model_dir=bound.model_dir,
        data_dir=spec.data_dir,
        limit=spec.limit,
        seq_len=spec.kl_seq_len,
        prefill_chunk=spec.prefill_chunk,
        subsample=spec.kl_subsample,
        dist=dist,
    )


def _kl_evaluated_side(recorded: RunConfig) -> dict[str, Any]:
    """What the kl task compares against its BF16 baseline (kvcal's attention over a BF16 cache)."""
    if recorded.kv_format == "auto":
        return {
            "kv_format": "auto",
            "attention": "transformers (the model's own)",
            "cache_dtype": recorded.dtype,
            "note": "the model's own attention over its own-dtype cache vs kvcal's attention over a BF16 cache: "
            "the KL holds the attention implementations' difference as well as the cache's",
        }
    return {
        "kv_format": recorded.kv_format,
        "attention": "kvcal",
        "impl": recorded.impl,
        "skip_layers": recorded.skip_layer_indices,
        "note": "same attention as the baseline: the KL is the cache format's alone",
    }


def _nonfinite_kv(lm: Any, task: str, strict: bool, say: Callable[[str], None]) -> dict[str, Any] | None:
    """NaN/Inf K/V values the cache was asked to store during `task` (None: kv format auto, nothing counted);
    a warning, or a KvcalError with --strict."""
    runtime = getattr(lm, "runtime", None)
    if runtime is None:
        return None
    return _check_nonfinite(runtime.take_nonfinite_kv(), task, strict, say)


def _check_nonfinite(
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


def _sum_nonfinite(task_metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
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
