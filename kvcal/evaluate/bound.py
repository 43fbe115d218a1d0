"""`bind(EvalSpec) -> BoundSpec`: an evaluation's spec bound to its checkpoint, once.

What needs the checkpoint happens here and nowhere else: resolve the model folder, read its config (the KV
geometry), check the lengths it bounds (kl window, generated tokens, passkey prompts), check the scale file
(loaded once, by `eval_spec`) against it, turn `--skip-layers` into layer indices, resolve dtype 'auto', bind
the scale file and skipped layers into the cache plan, and record config.yaml's RunConfig. A run passes the
BoundSpec whole: the adapter builds its runtime from `bound.cache`, the kl and passkey tasks read their values
from it. Nothing here loads weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcal import __version__
from kvcal.errors import UsageError
from kvcal.evaluate.spec import EvalSpec
from kvcal.evaluate.tasks import TaskPlan, resolve_tasks
from kvcal.kernels.plan import CachePlan
from kvcal.models.config import load_config
from kvcal.models.geometry import KVSpec, kv_spec, parse_skip_layers
from kvcal.models.loading import resolve_dtype
from kvcal.models.resolve import resolve_model
from kvcal.rundir import RunConfig

if TYPE_CHECKING:
    from kvcal.scales import ScaleSet


@dataclass(frozen=True)
class BoundSpec:
    """An EvalSpec bound to its checkpoint (build it with `bind`). `tasks` / `recorded`: kvcal eval's task plan
    (passkey documents built with the model's tokenizer) and config.yaml's RunConfig; None for lm-eval's model
    (`--model kvcal`), whose tasks lm-eval runs."""

    spec: EvalSpec
    model_dir: Path
    kv: KVSpec
    dtype: str  # resolved: 'auto' -> the checkpoint's own dtype name (lm-eval's model: as given)
    skip_layers: frozenset[int]  # --skip-layers as layer indices (parse_skip_layers)
    scales: ScaleSet | None  # the scale file, checked against this checkpoint (format, geometry, binding)
    cache: CachePlan  # the spec's cache plan with the scale file and skipped layers bound
    tasks: TaskPlan | None = None
    recorded: RunConfig | None = None


def bind(spec: EvalSpec, *, model_dir: Path | None = None, hf_config: Any = None) -> BoundSpec:
    """Bind `spec` to its checkpoint (UsageError / KvcalError before anything is written). `model_dir` /
    `hf_config`: an already resolved folder / loaded config (lm-eval's model given a built model). One straight
    pass, each module visited once: the spec's own record, the task plan's data files (before the model is
    resolved), the checkpoint (folder, config, skip indices, dtype), the lengths it bounds, the scale file."""
    fields = spec.recorded_fields()
    loaded = spec.scales.load()  # eval_spec's load; a sweep cell's file is read now
    plan = task_plan(spec) if spec.tasks else None
    if model_dir is None:
        model_dir = resolve_model(spec.model, trust_remote_code=spec.trust_remote_code)
    if hf_config is None:
        hf_config = load_config(model_dir, trust_remote_code=spec.trust_remote_code)
    kv = kv_spec(hf_config)
    skip = parse_skip_layers(spec.skip_layers, kv)
    # 'auto' resolved from the folder (kvcal eval's run records it); lm-eval's model leaves the dtype to HFLM
    dtype = resolve_dtype(spec.dtype, model_dir) if plan is not None else spec.dtype
    check_lengths(spec, kv)
    ss, record = None, None
    if loaded is not None:
        from kvcal.scales import bind_scale_file

        ss, record = bind_scale_file(
            loaded,
            str(spec.scales.path),
            spec.model,
            model_dir,
            kv,
            kv_format=spec.kv_format,
            force=spec.force_scales,
            attention=spec.attention,
        )
        # what the run passes down holds the checked scale file: nothing reloads it
        spec = dataclasses.replace(spec, scales=dataclasses.replace(spec.scales, loaded=ss))
    cache = dataclasses.replace(spec.cache, scales=ss, first_batch=spec.scales.first_batch, skip_layers=skip)
    recorded = None
    if plan is not None:
        recorded = RunConfig(
            **fields,
            model_dir=str(model_dir),
            scales=record,
            skip_layer_indices=sorted(skip),
            include_path=plan.include_path,
            dtype=dtype,
            kvcal_version=__version__,
        )
        _add_passkey_specs(plan, spec, model_dir)  # before the run directory opens: a length it cannot fill
    return BoundSpec(spec, model_dir, kv, dtype, skip, ss, cache, plan, recorded)


def task_plan(spec: EvalSpec) -> TaskPlan:
    """The spec's tasks as lm-eval specs, their data files checked (nothing here imports lm-eval's model code)."""
    return resolve_tasks(
        list(spec.tasks),
        include_path=spec.include_path,
        data_dir=spec.data_dir,
        gpqa_password=spec.gpqa_password,
    )


def check_lengths(spec: EvalSpec, kv: KVSpec) -> None:
    """Lengths the model's config bounds: a kl window and the generated tokens must fit its positions."""
    limit = kv.max_position_embeddings
    if not limit:
        return
    if spec.has_kl and spec.kl_seq_len > limit:
        raise UsageError(
            f"--kl-seq-len {spec.kl_seq_len} is longer than the model's {limit} positions "
            f"(max_position_embeddings); use --kl-seq-len {limit} or less"
        )
    if spec.max_gen_toks is not None and spec.max_gen_toks >= limit:
        raise UsageError(
            f"--max-gen-toks {spec.max_gen_toks} leaves no room for a prompt in the model's {limit} positions "
            f"(max_position_embeddings); use fewer than {limit}"
        )
    if spec.has_passkey:
        from kvcal.evaluate.passkey import GEN_TOKS, check_positions

        check_positions(list(spec.passkey_lengths), limit, spec.max_gen_toks or GEN_TOKS)


def _add_passkey_specs(plan: TaskPlan, spec: EvalSpec, model_dir: Path) -> None:
    """The passkey tasks' lm-eval configs, their documents generated with the model's own tokenizer (the one
    lm-eval's HFLM loads from the same folder)."""
    if not plan.has_passkey:
        return
    from transformers import AutoTokenizer

    from kvcal.evaluate.passkey import DEFAULT_PER_CELL, task_specs

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=spec.trust_remote_code)
    plan.lm_eval_specs.update(
        task_specs(
            plan.names,
            tokenizer,
            data_dir=spec.data_dir,
            lengths=list(spec.passkey_lengths),
            depths=list(spec.passkey_depths),
            per_cell=spec.limit or DEFAULT_PER_CELL,
            seed=spec.seed,
        )
    )
