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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcal import __version__
from kvcal.errors import UsageError
from kvcal.evaluate.spec import EvalSpec
from kvcal.evaluate.tasks import TaskPlan
from kvcal.formats.geometry import boundary_layers, check_rotation_head_dims, check_sliding
from kvcal.kernels.plan import CachePlan
from kvcal.models.config import folder_config
from kvcal.models.geometry import KVSpec, kv_spec, parse_skip_layers
from kvcal.models.loading import resolve_dtype
from kvcal.models.resolve import resolve_model
from kvcal.rundir import RunConfig
from kvcal.serde import check_serde_geometry

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
    hf_config: Any = field(default=None, compare=False, repr=False)  # the checkpoint's transformers config
    tasks: TaskPlan | None = None
    recorded: RunConfig | None = None


def _check_repeats(plan: TaskPlan, repeats: int) -> None:
    """--repeats N of every lm-eval task of the plan as the run will apply it (kvcal.evaluate.repeats.with_repeats:
    generative tasks only), checked now rather than when the task runs, after the model has loaded."""
    from kvcal.evaluate.repeats import with_repeats
    from kvcal.evaluate.tasks import task_manager_for

    manager = task_manager_for(plan)
    for name, task in plan.lm_eval_specs.items():
        with_repeats(task, repeats, name, manager)


def bind(spec: EvalSpec, *, model_dir: Path | None = None, hf_config: Any = None) -> BoundSpec:
    """Bind `spec` to its checkpoint (UsageError / KvcalError before anything is written). `model_dir` /
    `hf_config`: an already resolved folder / loaded config (lm-eval's model given a built model). One straight
    pass, each module visited once: the spec's own record and the task plan's data files (before the model is
    resolved), the checkpoint (folder, config, KV geometry, skip indices, dtype) and the lengths it bounds, the
    scale file (loaded once, checked against the checkpoint), the passkey documents."""
    fields = spec.recorded_fields()
    plan = spec.task_plan() if spec.tasks else None
    if plan is not None and spec.repeats is not None and spec.repeats > 1:
        _check_repeats(plan, spec.repeats)  # before the run directory records them: a refused run leaves none
    if model_dir is None:
        model_dir = resolve_model(spec.model, trust_remote_code=spec.trust_remote_code)
    if hf_config is None:
        hf_config = folder_config(model_dir, spec.trust_remote_code, spec.model)
    kv = kv_spec(hf_config)
    skip = parse_skip_layers(spec.skip_layers, kv)
    # vLLM adds a TurboQuant preset's boundary layers to kv_cache_dtype_skip_layers
    skip |= boundary_layers(spec.kv_format, kv.num_layers, spec.tq_boundary_layers)
    # before any weight is loaded: the refusals the runtime would raise (the format's families' geometry rules)
    check_sliding(spec.kv_format, [x.index for x in kv.layers if x.window and x.index not in skip])
    check_rotation_head_dims(spec.kv_format, [x.head_dim for x in kv.layers if x.index not in skip])
    # LMCache's TurboQuant serdes need a power-of-two head_dim on the layers they quantize: refused before weights load
    check_serde_geometry(spec.prefix_serde, {x.index: x.head_dim for x in kv.layers})
    # 'auto' resolved from the folder (kvcal eval's run records it); lm-eval's model leaves the dtype to HFLM
    dtype = resolve_dtype(spec.dtype, model_dir, hf_config) if plan is not None else spec.dtype
    if spec.plan_file is not None:  # a plan is refused on another checkpoint, like a scale file
        from kvcal.planfile import load_plan_for_model

        load_plan_for_model(spec.plan_file, spec.model, model_dir, kv)
    limit = kv.max_position_embeddings  # the lengths the config bounds: kl windows, generated tokens, prompts
    if limit and spec.max_length is not None and spec.max_length > limit:
        raise UsageError(
            f"--max-length {spec.max_length} is longer than the model's {limit} positions "
            f"(max_position_embeddings); use --max-length {limit} or less"
        )
    if dtype == "float32":  # log-softmax in the model's dtype is float32 too: the same numbers, the same hash
        fields["logprob_dtype"] = None
    if limit and spec.has_kl and spec.kl_seq_len > limit:
        raise UsageError(
            f"--kl-seq-len {spec.kl_seq_len} is longer than the model's {limit} positions "
            f"(max_position_embeddings); use --kl-seq-len {limit} or less"
        )
    if limit and spec.max_gen_toks is not None and spec.max_gen_toks >= limit:
        raise UsageError(
            f"--max-gen-toks {spec.max_gen_toks} leaves no room for a prompt in the model's {limit} positions "
            f"(max_position_embeddings); use fewer than {limit}"
        )
    ss, record = None, None
    if spec.scales.is_file:
        from kvcal.scales import bind_scale_file

        ss, record = bind_scale_file(
            spec.scales.loaded,  # eval_spec's load; a sweep cell's file is read now
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
    if spec.has_passkey:  # a length the model or the filler cannot take fails before the run directory opens
        from kvcal.evaluate.passkey import bind_passkey

        bind_passkey(
            plan,
            model_dir,
            max_positions=limit,
            gen_toks=spec.max_gen_toks,
            data_dir=spec.data_dir,
            lengths=list(spec.passkey_lengths),
            depths=list(spec.passkey_depths),
            limit=spec.limit,
            seed=spec.seed,
            trust_remote_code=spec.trust_remote_code,
        )
    return BoundSpec(spec, model_dir, kv, dtype, skip, ss, cache, hf_config, plan, recorded)


