"""`run_eval(EvalConfig) -> Path`: one model x one KV configuration x a task list, into one run directory.

Order of work (so bad input never damages an existing run): validate everything (format, limit, device, tasks,
data files, GPQA password) -> resolve the model and check what its config bounds (scale file vs checkpoint,
window and generation lengths) -> open the run directory (complete: skip; other config: error) -> load the model
once -> each task through lm-eval's simple_evaluate (or kvcal's kl), persisted as it finishes -> results.json,
metrics.json -> COMPLETE.
"""

from __future__ import annotations

import hashlib
import platform
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcal import __version__, models, parallel
from kvcal.capacity import run_capacity
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.git_probe import quiet_git_probe
from kvcal.evaluate.kl import DEFAULT_PREFILL_CHUNK, DEFAULT_SEQ_LEN, check_kl_subsample
from kvcal.evaluate.passkey import DEFAULT_DEPTHS, DEFAULT_LENGTHS
from kvcal.evaluate.runstore import RunStore
from kvcal.evaluate.tasks import KL_TASK, PASSKEY_TASKS, TaskPlan, resolve_tasks, task_manager_for
from kvcal.evaluate.timing import FORWARDS_KEY, ForwardTimer, ForwardTotals, run_timing
from kvcal.formats import DEFAULT_KV_INPUT_DTYPE, kv_pair, parse_kv_format, parse_kv_input_dtype
from kvcal.placement import Placement
from kvcal.rundir import ENV, METRICS, RESULTS, RunConfig


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
    dtype: str = "auto"  # the checkpoint's own (lm-eval's HFLM default); config.yaml records the resolved one
    device: str = "cpu"
    # accelerate's placement (kvcal.placement): where the weights live, not what is computed — not in config.yaml
    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: str | None = None
    batch_size: int = 1
    seed: int = 0
    kl_seq_len: int = DEFAULT_SEQ_LEN
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # kl windows longer than this run by chunked prefill
    kl_subsample: int = 1  # kl scores positions 0, N, 2N, ... of each window (a power of two up to 512)
    max_gen_toks: int | None = None  # cap on generated tokens (lm-eval's aime25 asks for 32768)
    trust_remote_code: bool = False  # run the checkpoint's own Python code (config.json auto_map)
    nvfp4_global: str = "one"  # nvfp4 without --scales: "one" (vLLM: global 1.0) or "per_sequence"
    # K/V rounded to this dtype before quantization: the engine's serving dtype (bf16), or float32 (as computed)
    kv_input_dtype: str = DEFAULT_KV_INPUT_DTYPE
    strict: bool = False  # a NaN/Inf K/V value reaching the cache is an error (default: warn + metrics.json)
    attention: str = "kv"  # "fp8": vLLM's FlashAttention-3 FP8 attention (Q and P cast to e4m3)
    passkey_lengths: str = DEFAULT_LENGTHS  # passkey prompt lengths in tokens, e.g. "1k,2k,4k" (k = 1024)
    passkey_depths: str = DEFAULT_DEPTHS  # where the key sits: fractions of the filler before it


def _any_nvfp4(fmt: str) -> bool:
    """A side of `fmt` (a format or a K/V pair) stores nvfp4's layout (nvfp4, nvfp4_4over6)."""
    return any(f.layout == "nvfp4" for f in kv_pair(fmt))


# ---- names --------------------------------------------------------------------------------------------------


def slug(text: str) -> str:
    """A lower-case file-name-safe form of `text` (run directory and sweep names)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "x"


def model_short(model: str) -> str:
    name = Path(str(model).rstrip("/")).name
    for suffix in (".gguf", ".GGUF"):
        name = name.removesuffix(suffix)
    return slug(name)


# `--scales first-batch`: vLLM's calculate_kv_scales (kvcal.kernels.cache.FirstBatchScales), not a file
FIRST_BATCH = "first-batch"


def is_first_batch(scales: str | None) -> bool:
    return scales == FIRST_BATCH


def scales_tag(scales: str | None) -> str:
    """'none' (uncalibrated / dynamic), 'first-batch', or 'calib-<granularity>' read from the scale file's manifest."""
    if not scales:
        return "none"
    if is_first_batch(scales):
        return FIRST_BATCH
    from kvcal.scales import load_scale_file

    return f"calib-{load_scale_file(scales).granularity}"


def skip_tag(skip_layers: str | None) -> str:
    if not skip_layers or str(skip_layers).strip().lower() in ("", "none"):
        return "none"
    return slug(str(skip_layers).replace(",", "-"))


def run_dir_name(config: EvalConfig) -> str:
    """`{model_short}__{kv_format}__{scales_tag}__skip-{skip_tag}`, e.g.
    `gemma3-270m__fp8_e4m3__calib-tensor__skip-sliding_window`."""
    fmt = parse_kv_format(config.kv_format)
    tag = scales_tag(config.scales)
    if _any_nvfp4(fmt) and not config.scales and config.nvfp4_global != "one":
        tag = f"global-{slug(config.nvfp4_global)}"
    fmt_tag = slug(fmt) if "=" in fmt else fmt  # a K/V pair k=A,v=B -> k-a-v-b
    name = f"{model_short(config.model)}__{fmt_tag}__{tag}__skip-{skip_tag(config.skip_layers)}"
    if recorded_kv_input_dtype(config, fmt) not in (None, DEFAULT_KV_INPUT_DTYPE):
        name += f"__kvin-{parse_kv_input_dtype(config.kv_input_dtype)}"
    if config.attention != "kv":
        name += f"__attn-{slug(config.attention)}"
    return name


def recorded_kv_input_dtype(config: EvalConfig, fmt: str) -> str | None:
    """config.yaml's kv_input_dtype: recorded for every quantized format (a run directory without it was quantized
    as computed, float32 on CPU, before kvcal had the option); None for auto / bf16, whose numbers it cannot change
    (bf16 rounding is idempotent), so their runs keep their identity hash."""
    if fmt in ("auto", "bf16"):
        return None
    return parse_kv_input_dtype(config.kv_input_dtype)


# ---- validation + the recorded config -----------------------------------------------------------------------


def _check_numbers(config: EvalConfig) -> None:
    if config.limit is not None and config.limit <= 0:
        raise UsageError(f"--limit must be a positive number of samples, got {config.limit}")
    if config.num_fewshot is not None and config.num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be 0 or more, got {config.num_fewshot}")
    if config.max_gen_toks is not None and config.max_gen_toks < 1:
        raise UsageError(f"--max-gen-toks must be at least 1, got {config.max_gen_toks}")
    if config.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {config.batch_size}")
    if config.kl_seq_len < 2:
        raise UsageError(f"--kl-seq-len must be at least 2 tokens, got {config.kl_seq_len}")
    if config.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be at least 1 token, got {config.prefill_chunk}")
    check_kl_subsample(config.kl_subsample)


def validate(config: EvalConfig) -> tuple[TaskPlan, str, str]:
    """Check everything that needs no model (nothing here imports lm-eval's model code). Returns (task plan,
    canonical format, checked device)."""
    from kvcal.kernels.cache import check_nvfp4_global
    from kvcal.kernels.runtime import IMPLS

    _check_numbers(config)
    if config.dtype not in models.DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(models.DTYPES)}, got '{config.dtype}'")
    if config.impl not in IMPLS:
        raise UsageError(f"--impl must be one of {', '.join(IMPLS)}, got '{config.impl}'")
    device = models.check_device(config.device)
    Placement.parse(config.device_map, config.max_memory, config.offload_folder).check()
    fmt = parse_kv_format(config.kv_format)
    check_nvfp4_global(config.nvfp4_global)
    parse_kv_input_dtype(config.kv_input_dtype)
    if config.nvfp4_global != "one" and (not _any_nvfp4(fmt) or config.scales):
        raise UsageError(
            "--nvfp4-global applies to --kv-format nvfp4 / nvfp4_4over6 without --scales (a scale file or "
            "first-batch fixes the global scale)"
        )
    if is_first_batch(config.scales) and not all(f.calibratable for f in kv_pair(fmt)):
        raise UsageError(
            f"--scales first-batch (vLLM's calculate_kv_scales) sets a static scale, but {fmt} has none "
            "(its scales are computed at write time); use fp8_e4m3, fp8_e5m2, nvfp4 or nvfp4_4over6"
        )
    if fmt == "auto" and (config.scales or config.skip_layers):
        raise UsageError(
            "--scales / --skip-layers need a quantized --kv-format (auto leaves the cache untouched)"
        )
    from kvcal.kernels.attention import check_attention_mode

    check_attention_mode(config.attention, *(f.name for f in kv_pair(fmt)))
    if config.scales and not is_first_batch(config.scales) and not Path(config.scales).is_file():
        raise UsageError(
            f"scale file '{config.scales}' does not exist; pass the file `kvcal calibrate` wrote"
        )
    plan = resolve_tasks(
        config.tasks,
        include_path=config.include_path,
        data_dir=config.data_dir,
        gpqa_password=config.gpqa_password,
    )
    if plan.has_passkey:
        from kvcal.evaluate.passkey import parse_depths, parse_lengths

        parse_lengths(config.passkey_lengths)
        parse_depths(config.passkey_depths)
    return plan, fmt, device


def check_lengths(config: EvalConfig, plan: TaskPlan, kv: models.KVSpec) -> None:
    """Lengths the model's config bounds: a kl window and the generated tokens must fit its positions."""
    limit = kv.max_position_embeddings
    if not limit:
        return
    if plan.has_kl and config.kl_seq_len > limit:
        raise UsageError(
            f"--kl-seq-len {config.kl_seq_len} is longer than the model's {limit} positions "
            f"(max_position_embeddings); use --kl-seq-len {limit} or less"
        )
    if config.max_gen_toks is not None and config.max_gen_toks >= limit:
        raise UsageError(
            f"--max-gen-toks {config.max_gen_toks} leaves no room for a prompt in the model's {limit} positions "
            f"(max_position_embeddings); use fewer than {limit}"
        )
    if plan.has_passkey:
        from kvcal.evaluate.passkey import GEN_TOKS, check_positions, parse_lengths

        check_positions(parse_lengths(config.passkey_lengths), limit, config.max_gen_toks or GEN_TOKS)


def _scales_record(
    config: EvalConfig, fmt: str, model_ref: str, model_dir: Path, kv: models.KVSpec
) -> dict[str, Any] | None:
    """config.yaml's `scales`; the scale file is checked against the checkpoint here (before any write)."""
    if not config.scales or is_first_batch(config.scales):
        return None
    from kvcal.scales import binding_differences, load_scales_for_model

    ss = load_scales_for_model(
        config.scales, model_ref, model_dir, kv, kv_format=fmt, force=config.force_scales
    )
    if config.attention == "fp8":
        from kvcal.kernels.runtime import query_scales

        query_scales(config.attention, ss, kv.num_layers)  # refuses a scale file without q_scale
    observer = ss.manifest.get("observer")
    scales: dict[str, Any] = {
        "sha256": models.sha256_file(config.scales),
        "granularity": ss.granularity,
        "observer": observer.get("name") if isinstance(observer, dict) else observer,
        "binding_differences": binding_differences(ss, model_ref, model_dir, kv),
        "kv_input_dtype": ss.kv_input_dtype,  # what the scales were measured on (the eval's: kv_input_dtype)
    }
    if scales["binding_differences"] and config.force_scales:
        scales["WARNING"] = (
            "scales were measured on another checkpoint; used anyway because of --force-scales"
        )
    return scales


def _recorded_chunk(config: EvalConfig, plan: TaskPlan) -> int | None:
    """config.yaml's prefill_chunk: only where it changes what is measured (kl windows longer than a chunk), so
    every other run keeps its identity hash."""
    return config.prefill_chunk if plan.has_kl and config.kl_seq_len > config.prefill_chunk else None


def record_config(config: EvalConfig, plan: TaskPlan, fmt: str, device: str, model_dir: Path) -> RunConfig:
    """What config.yaml records (the run's identity): the resolved dtype and skip layers, the scale file's
    check against the checkpoint. UsageError for lengths the model cannot hold."""
    kv = models.kv_spec(models.load_config(model_dir, trust_remote_code=config.trust_remote_code))
    check_lengths(config, plan, kv)
    return RunConfig(
        model=config.model,
        model_dir=str(model_dir),
        kv_format=fmt,
        tasks=plan.names,
        scales_path=str(Path(config.scales).resolve())
        if config.scales and not is_first_batch(config.scales)
        else None,
        scale_source=FIRST_BATCH if is_first_batch(config.scales) else None,
        kv_input_dtype=recorded_kv_input_dtype(config, fmt),
        scales=_scales_record(config, fmt, config.model, model_dir, kv),
        force_scales=bool(config.force_scales),
        skip_layers=config.skip_layers or "",
        skip_layer_indices=sorted(models.parse_skip_layers(config.skip_layers, kv)),
        include_path=plan.include_path,
        limit=config.limit,
        num_fewshot=config.num_fewshot,
        data_dir=str(Path(config.data_dir).resolve()) if config.data_dir else None,
        impl=config.impl,
        dtype=models.resolve_dtype(config.dtype, model_dir),
        device=device,
        batch_size=config.batch_size,
        seed=config.seed,
        kl_seq_len=config.kl_seq_len if plan.has_kl else None,
        passkey_lengths=_passkey_recorded(config, plan)[0],
        passkey_depths=_passkey_recorded(config, plan)[1],
        prefill_chunk=_recorded_chunk(config, plan),
        kl_subsample=config.kl_subsample if plan.has_kl and config.kl_subsample > 1 else None,
        max_gen_toks=config.max_gen_toks,
        nvfp4_global=config.nvfp4_global if _any_nvfp4(fmt) and not config.scales else None,
        attention=None if config.attention == "kv" else config.attention,
        kvcal_version=__version__,
    )


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


def run_eval(config: EvalConfig, progress: Callable[[str], None] | None = None) -> Path:
    """Evaluate `config` into its run directory and return the directory. A complete directory with the same
    config is returned untouched; an interrupted one resumes (finished tasks are not rerun)."""
    say = progress or (lambda _msg: None)
    plan, fmt, device = validate(config)
    model_dir = models.resolve_model(config.model, trust_remote_code=config.trust_remote_code)
    recorded = record_config(config, plan, fmt, device, model_dir)
    _add_passkey_specs(plan, config, model_dir)  # before the run directory opens: a length it cannot fill
    out = Path(config.output) if config.output else Path(run_dir_name(config))
    store = RunStore(out)
    if config.limit is not None:  # several processes (torchrun): each needs a sample
        parallel.check_enough_work(config.limit, "samples (--limit)", parallel.from_env())
    dist = parallel.setup(device)
    if not dist.is_main:  # rank 0 speaks and writes the one run directory; the others only compute
        say = _silent
    if _open_store(store, recorded, dist) == "complete":
        say(f"{out}: complete, skipped")
        return out
    if dist.is_main:
        store.write_json(ENV, environment(device))
    lm = _run_tasks(store, plan, config, recorded, say, dist)
    if not dist.is_main:
        return out
    parts = [store.finished_task(t) or {} for t in plan.names]
    store.write_json(RESULTS, _results(parts, config, recorded, lm))
    store.write_json(METRICS, _metrics(parts, plan, recorded))
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
    plan: TaskPlan,
    config: EvalConfig,
    recorded: RunConfig,
    say: Callable[[str], None],
    dist: parallel.Dist | None = None,
) -> Any:
    """Run every unfinished task (one model load), saving each as it finishes (rank 0: the others run their
    share of each task). Returns the LM, or None when every task was already done."""
    dist = dist or parallel.Dist()
    # decided once, on rank 0, before it writes anything: every rank runs the same tasks
    pending = parallel.broadcast_object([t for t in plan.names if store.finished_task(t) is None], dist)
    for task in plan.names:
        if task not in pending:
            say(f"{task}: already done, skipped")
    if not pending:
        return None
    say(f"loading {recorded.model} ({recorded.dtype}, {recorded.device}, kv {recorded.kv_format})")
    lm = _make_lm(config, recorded)
    # prefill / decode forwards and TTFT (kvcal.evaluate.timing); the LM marks its generate calls
    lm.forward_timer = timer = ForwardTimer(lm.model)
    try:
        for task in pending:
            say(f"{task}: running")
            timer.take()  # start the task's totals afresh
            t0 = time.perf_counter()
            if task == KL_TASK:
                part, samples = _run_kl_task(lm, config, recorded, dist)
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


def _results(parts: list[dict[str, Any]], config: EvalConfig, recorded: RunConfig, lm: Any) -> dict[str, Any]:
    """results.json: lm-eval's results dict merged over the tasks, with the model args and seeds used."""
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


def _metrics(parts: list[dict[str, Any]], plan: TaskPlan, recorded: RunConfig) -> dict[str, Any]:
    """metrics.json: emulation wall time and tokens, prefill / decode timing (TTFT, TPOT), peak memory, and the
    cache's capacity as `kvcal capacity` counts it (docs/run-directory.md)."""
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
    kv = models.kv_spec(models.load_config(recorded.model_dir))
    metrics.update(run_capacity(kv, recorded.kv_format, frozenset(recorded.skip_layer_indices)))
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


def _make_lm(config: EvalConfig, recorded: RunConfig) -> Any:
    from kvcal.evaluate.adapter import KvcalLM

    return KvcalLM(
        pretrained=recorded.model_dir,
        model_ref=recorded.model,
        kv_format=recorded.kv_format,
        kv_scales=config.scales,
        skip_layers=config.skip_layers,
        impl=recorded.impl,
        force_scales=recorded.force_scales,
        dtype=recorded.dtype,
        device=recorded.device,
        batch_size=recorded.batch_size,
        trust_remote_code=config.trust_remote_code,
        nvfp4_global=config.nvfp4_global,
        kv_input_dtype=recorded.kv_input_dtype,
        attention=config.attention,
        device_map=config.device_map,
        max_memory=config.max_memory,
        offload_folder=config.offload_folder,
    )


def _run_lm_eval_task(
    lm: Any, plan: TaskPlan, task: str, config: EvalConfig
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


def _passkey_recorded(config: EvalConfig, plan: TaskPlan) -> tuple[list[int] | None, list[float] | None]:
    """config.yaml's passkey_lengths / passkey_depths: only when a passkey task runs."""
    if not plan.has_passkey:
        return None, None
    from kvcal.evaluate.passkey import parse_depths, parse_lengths

    return parse_lengths(config.passkey_lengths), parse_depths(config.passkey_depths)


def _add_passkey_specs(plan: TaskPlan, config: EvalConfig, model_dir: Path) -> None:
    """The passkey tasks' lm-eval configs, their documents generated with the model's own tokenizer (the one
    lm-eval's HFLM loads from the same folder)."""
    if not plan.has_passkey:
        return
    from transformers import AutoTokenizer

    from kvcal.evaluate.passkey import DEFAULT_PER_CELL, task_specs

    lengths, depths = _passkey_recorded(config, plan)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=config.trust_remote_code)
    plan.lm_eval_specs.update(
        task_specs(
            plan.names,
            tokenizer,
            data_dir=config.data_dir,
            lengths=lengths or [],
            depths=depths or [],
            per_cell=config.limit or DEFAULT_PER_CELL,
            seed=config.seed,
        )
    )


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
    lm: Any, config: EvalConfig, recorded: RunConfig, dist: parallel.Dist | None = None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    from kvcal.evaluate.kl import lm_sides, run_kl

    quant_session, baseline = lm_sides(lm, recorded.impl)
    base = {"kv_format": "bf16", "impl": recorded.impl, "dtype": recorded.dtype, "device": recorded.device}
    return run_kl(
        lm.model,
        lm.tokenizer,
        quant_session=quant_session,
        baseline=baseline,
        baseline_desc={**base, "attention": "kvcal"},
        evaluated_desc=_kl_evaluated_side(recorded),
        model_dir=recorded.model_dir,
        data_dir=config.data_dir,
        limit=config.limit,
        seq_len=config.kl_seq_len,
        prefill_chunk=config.prefill_chunk,
        subsample=config.kl_subsample,
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
