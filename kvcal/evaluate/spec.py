"""One evaluation's spec: `EvalConfig` (the options as given) -> `eval_spec` -> `EvalSpec` (parsed, checked once).

`kvcal eval`, a sweep cell and a release candidate all build their spec with `eval_spec`, so the three cannot
disagree on a default, a name or what config.yaml records. The spec

- holds PARSED values: the canonical format (or K/V pair), the kv input dtype, passkey lengths / depths, the
  task names, the placement, and the scale source (none / first-batch / a file, loaded at most once per run);
- names its run directory (`run_dir_name`: kvcal eval's and the sweep's one namer);
- records itself (`recorded_fields`: what config.yaml holds that needs no checkpoint; kvcal.evaluate.bound.bind adds the
  checkpoint's part);
- says how it differs from a recorded run (`differences`).

Nothing here loads a model or imports lm-eval's model code. The only string parsing of eval options is here (the
cache's options through kvcal.kernels.plan.parse_cache_plan); lm-eval's `--model kvcal --model_args` strings come
through here too (kvcal.evaluate.adapter.bind_model_args). What needs the checkpoint: kvcal.evaluate.bound.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcal.errors import UsageError
from kvcal.evaluate.kl import DEFAULT_PREFILL_CHUNK, DEFAULT_SEQ_LEN, check_kl_subsample
from kvcal.evaluate.passkey import DEFAULT_DEPTHS, DEFAULT_LENGTHS, parse_depths, parse_lengths
from kvcal.evaluate.tasks import KL_TASK, PASSKEY_TASKS, TaskPlan, parse_task_list, resolve_tasks
from kvcal.formats import DEFAULT_KV_INPUT_DTYPE, TQ_BOUNDARY_LAYERS, is_tq_preset
from kvcal.kernels.plan import CachePlan, parse_cache_plan
from kvcal.models.loading import DTYPES, check_device, resolve_dtype
from kvcal.models.perturb import check_perturbation
from kvcal.placement import Placement, PlacementOptions
from kvcal.releases import emulated_release
from kvcal.rundir import RunConfig

if TYPE_CHECKING:
    from kvcal.scales import ScaleSet

# The model dtype of a lone `kvcal eval`: the checkpoint's own (lm-eval's HFLM default; config.yaml records the
# resolved name). A sweep or release calibrates AND evaluates, in calibrate's default float32, so that the scales
# are measured in the dtype the evaluations run in: kvcal.pipeline.settings.EvalSettings uses PIPELINE_DTYPE.
DEFAULT_DTYPE = "auto"
PIPELINE_DTYPE = "float32"

# `--scales first-batch`: vLLM's calculate_kv_scales (kvcal.kernels.cache.FirstBatchScales), not a file
FIRST_BATCH = "first-batch"


@dataclass
class EvalConfig(PlacementOptions):
    """The options of one evaluation as given (`kvcal eval`'s, by name and default; strings as typed).
    `eval_spec` parses and checks them. `gpqa_password` is never written anywhere."""

    model: str
    kv_format: str = "auto"
    tasks: list[str] = field(default_factory=lambda: ["wikitext"])
    output: str | None = None  # the run directory; None -> run_dir_name(spec) under the current folder
    scales: str | None = None
    force_scales: bool = False
    skip_layers: str | None = None
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    data_dir: str | None = None
    gpqa_password: str | None = field(default=None, repr=False)
    impl: str = "auto"
    dtype: str = DEFAULT_DTYPE
    device: str = "cpu"
    # accelerate's placement (PlacementOptions: device_map, max_memory, offload_folder): where the weights live,
    # not what is computed — not in config.yaml
    batch_size: int = 1
    seed: int = 0
    kl_seq_len: int = DEFAULT_SEQ_LEN
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # kl windows longer than this run by chunked prefill
    kl_subsample: int = 1  # kl scores positions 0, N, 2N, ... of each window (a power of two up to 512)
    max_gen_toks: int | None = None  # cap on generated tokens (lm-eval's aime25 asks for 32768)
    trust_remote_code: bool = False  # run the checkpoint's own Python code (config.json auto_map)
    nvfp4_global: str = "one"  # nvfp4 without --scales: "one" (vLLM: global 1.0) or "per_sequence"
    # K/V rounded to this dtype before quantization: the engine's serving dtype (bf16), or float32 (as computed);
    # None (lm-eval's model without the option): quantized as computed
    kv_input_dtype: str | None = DEFAULT_KV_INPUT_DTYPE
    strict: bool = False  # a NaN/Inf K/V value reaching the cache is an error (default: warn + metrics.json)
    attention: str = "kv"  # "fp8": vLLM's FlashAttention-3 FP8 attention (Q and P cast to e4m3)
    passkey_lengths: str = DEFAULT_LENGTHS  # passkey prompt lengths in tokens, e.g. "1k,2k,4k" (k = 1024)
    passkey_depths: str = DEFAULT_DEPTHS  # where the key sits: fractions of the filler before it
    # loglikelihood requests: "full" (lm-eval's own path, every position's logits) or "continuation" (only the
    # continuation rows reach the head, a question's choices share one prefill: kvcal.evaluate.scoring)
    scoring: str = "full"
    # log-likelihoods' log-softmax and sums: "float32" (whatever the model's dtype; what engines compute) or "model"
    # (lm-eval's HFLM default, softmax_dtype = the model's dtype: a bf16 document total rounds to tens of nats)
    logprob_dtype: str = "float32"
    # lm-eval's HFLM max_length: the rolling window of loglikelihood_rolling (wikitext) and the truncation of
    # contexts; None = lm-eval's default (the model's positions); an engine's max_model_len
    max_length: int | None = None
    # every weight moved by this many ulps of its dtype, random signs from --seed (kvcal.models.perturb): the same
    # model computed by another correct implementation, the yardstick of an engine's conformance (compare
    # --conformance-noise); None / 0: the model as loaded
    perturb_weights: float | None = None
    # generative lm-eval tasks: each document generated `repeats` times (a seed per document and repeat), scored
    # as the mean over its repeats; `gen_kwargs` as lm-eval's --gen_kwargs ("temperature=0.6,top_p=0.95")
    repeats: int | None = None
    gen_kwargs: str | None = None
    # a divergence task's prompts from this JSONL ({"prompt": ...} per line) instead of its lm-eval task
    prompts: str | None = None
    # a TurboQuant preset: vLLM's default boundary protection keeps the first and last N layers in BF16
    # (TurboQuantConfig.get_boundary_skip_layers, n = 2, no engine flag); 0 = every layer quantized (kvcal only)
    tq_boundary_layers: int = TQ_BOUNDARY_LAYERS
    # LMCache's storage tier (kvcal.serde): each sequence's first `prefix_tokens` K/V round-trip through this serde
    # ("fp8", "aesgcm", "turboquant_*") before the live cache stores them, as a prefix reloaded from disk / a remote
    # store; both or neither
    prefix_serde: str | None = None
    prefix_tokens: int | None = None


@dataclass(frozen=True)
class ScaleSource:
    """Where a run's static K/V scales come from. `kind`: 'none' (the formats' defaults / dynamic), 'first-batch'
    (vLLM's calculate_kv_scales) or 'file'. `tag` is the run directory's part (none, first-batch,
    calib-<granularity>[-<recipe>]). A file is loaded at most once per run: `eval_spec` keeps what it loaded for
    the tag in `loaded`; a sweep cell, named before its file is calibrated, loads it when it runs (`load`)."""

    kind: str = "none"
    path: str | None = None  # kind 'file': the file as given (config.yaml records it resolved)
    tag: str = "none"
    loaded: ScaleSet | None = field(default=None, compare=False, repr=False)

    @property
    def is_file(self) -> bool:
        return self.kind == "file"

    @property
    def first_batch(self) -> bool:
        return self.kind == FIRST_BATCH

    def load(self) -> ScaleSet | None:
        """The scale file's ScaleSet (read now unless `eval_spec` already did), None without a file."""
        if not self.is_file:
            return None
        if self.loaded is not None:
            return self.loaded
        from kvcal.scales import load_scale_file

        assert self.path is not None
        return load_scale_file(self.path)


@dataclass(frozen=True)
class PromptFile:
    """`--prompts FILE.jsonl`: one {"prompt": "..."} per line (vLLM's benchmark datasets' field), checked once;
    its sha256 names the prompts in config.yaml and in the divergence task's config (runs of other prompts are
    refused for pairing)."""

    path: str  # resolved
    sha256: str

    FIELD = "prompt"

    def record(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256}

    def read(self) -> list[str]:
        import json

        from kvcal.io import jsonl_lines

        lines = jsonl_lines(Path(self.path).read_text(encoding="utf-8"))
        return [str(json.loads(line)[self.FIELD]) for line in lines if line.strip()]


def _prompt_file(path: str | None, tasks: tuple[str, ...]) -> PromptFile | None:
    if path is None:
        return None
    import hashlib

    from kvcal.evaluate.tasks import DIVERGENCE_TASKS, check_jsonl_file

    div = [t for t in tasks if t in DIVERGENCE_TASKS]
    if len(div) != 1:
        raise UsageError(
            "--prompts gives one divergence task its prompts; run it with exactly one of "
            f"{', '.join(DIVERGENCE_TASKS)} in --tasks (got {len(div)})"
        )
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--prompts '{path}' is not a file; pass a JSONL with one {{\"prompt\": ...}} per line")
    check_jsonl_file(p, "--prompts", field=PromptFile.FIELD)
    if not any(line.strip() for line in p.read_text(encoding="utf-8").splitlines()):
        raise UsageError(f"--prompts '{path}' holds no prompt; write one {{\"prompt\": ...}} per line")
    return PromptFile(str(p.resolve()), hashlib.sha256(p.read_bytes()).hexdigest())


@dataclass(frozen=True)
class EvalSpec:
    """One evaluation, parsed and checked (build it with `eval_spec`). Fields keep EvalConfig's names."""

    model: str
    tasks: tuple[str, ...]  # canonical task names, the user's order (tasks.parse_task_list)
    scales: ScaleSource
    force_scales: bool
    skip_layers: (
        str | None
    )  # --skip-layers as given (config.yaml records the text; the indices need the model)
    include_path: str | None
    limit: int | None
    num_fewshot: int | None
    data_dir: str | None
    # the cache's options, parsed (kvcal.kernels.plan.parse_cache_plan): format pair, kv input dtype (None for
    # auto / bf16, whose numbers it cannot change), attention mode, nvfp4 global policy, implementation; the
    # scale file and skipped layers are bound to it with the checkpoint (kvcal.evaluate.bound.bind)
    cache: CachePlan
    dtype: str  # 'auto' (resolved against the checkpoint when recorded) or a canonical dtype name
    device: str  # checked against this machine (check_device)
    placement: Placement
    batch_size: int
    seed: int
    kl_seq_len: int
    prefill_chunk: int
    kl_subsample: int
    max_gen_toks: int | None
    trust_remote_code: bool
    strict: bool
    passkey_lengths: tuple[int, ...]
    passkey_depths: tuple[float, ...]
    output: str | None = None
    gpqa_password: str | None = field(default=None, repr=False, compare=False)
    scoring: str = "full"  # kvcal.evaluate.adapter's scoring of loglikelihood requests (SCORINGS)
    logprob_dtype: str = "float32"  # LOGPROB_DTYPES: float32, or the model's dtype (lm-eval's HFLM default)
    max_length: int | None = None  # lm-eval's max_length (None: the model's positions, lm-eval's default)
    perturb_weights: float | None = None  # ulps of the weights' dtype (kvcal.models.perturb); None: unperturbed
    plan_file: str | None = None  # `-f plan.json`: kv_format / skip_layers came from it; bind checks its binding
    repeats: int | None = None  # generations per document (None = lm-eval's task config: one)
    gen_kwargs: tuple[tuple[str, Any], ...] = ()  # --gen-kwargs parsed (parse_gen_kwargs), in the user's order
    prompts: PromptFile | None = None  # --prompts: the divergence task's own prompts (checked, hashed)
    plan: dict[str, Any] | None = None  # config.yaml's `plan` of that file (kvcal.planfile.PlanFile.run_record)
    tq_boundary_layers: int = TQ_BOUNDARY_LAYERS  # EvalConfig's; used only with a TurboQuant preset

    # ---- derived -----------------------------------------------------------------------------------------------

    @property
    def kv_format(self) -> str:
        """Canonical: a format name or 'k=<canonical>,v=<canonical>' (formats.parse_kv_format)."""
        return self.cache.kv_format

    @property
    def impl(self) -> str:
        return self.cache.impl

    @property
    def nvfp4_global(self) -> str:
        return self.cache.nvfp4_global

    @property
    def attention(self) -> str:
        return self.cache.attention

    @property
    def kv_input_dtype(self) -> str | None:
        """Canonical (formats.parse_kv_input_dtype); None = as computed (lm-eval's model without the option)
        or a format whose numbers it cannot change (auto, bf16)."""
        return self.cache.kv_input_dtype

    @property
    def quantized(self) -> bool:
        return self.cache.quantized

    @property
    def prefix_serde(self) -> str | None:
        return self.cache.prefix_serde

    @property
    def prefix_tokens(self) -> int | None:
        """N of --prefix-tokens; None without a prefix serde."""
        return self.cache.prefix_tokens if self.cache.prefix_serde is not None else None

    @property
    def has_kl(self) -> bool:
        return KL_TASK in self.tasks

    @property
    def has_passkey(self) -> bool:
        return any(t in PASSKEY_TASKS for t in self.tasks)

    @property
    def any_nvfp4(self) -> bool:
        """A side of the format stores nvfp4's layout (nvfp4, nvfp4_4over6)."""
        return any(f.codec.global_scale for f in (self.cache.k_fmt, self.cache.v_fmt))

    @property
    def recorded_kv_input_dtype(self) -> str | None:
        """config.yaml's kv_input_dtype: recorded for every quantized format (a run directory without it was
        quantized as computed, float32 on CPU, before kvcal had the option); None for auto / bf16, whose numbers
        it cannot change (bf16 rounding is idempotent), so their runs keep their identity hash."""
        return self.kv_input_dtype

    @property
    def run_dir(self) -> Path:
        return Path(self.output) if self.output else Path(run_dir_name(self))

    def task_plan(self) -> TaskPlan:
        """The tasks as lm-eval specs, their data files checked (nothing here imports lm-eval's model code)."""
        return resolve_tasks(
            list(self.tasks),
            include_path=self.include_path,
            data_dir=self.data_dir,
            gpqa_password=self.gpqa_password,
            own_prompts=self.prompts is not None,
        )

    def with_output(self, output: str | Path) -> EvalSpec:
        return dataclasses.replace(self, output=str(output))

    # ---- config.yaml -------------------------------------------------------------------------------------------

    def recorded_fields(self) -> dict[str, Any]:
        """The RunConfig fields this spec decides without a checkpoint (kvcal.evaluate.bound.bind adds
        model_dir, the resolved dtype of 'auto', the skip indices and the scale file's check)."""
        kl, passkey = self.has_kl, self.has_passkey
        return {
            "model": self.model,
            "kv_format": self.kv_format,
            "tasks": list(self.tasks),
            "scales_path": str(Path(self.scales.path).resolve()) if self.scales.path else None,
            "scale_source": FIRST_BATCH if self.scales.first_batch else None,
            "kv_input_dtype": self.recorded_kv_input_dtype,
            "force_scales": bool(self.force_scales),
            "skip_layers": self.skip_layers or "",
            "limit": self.limit,
            "num_fewshot": self.num_fewshot,
            "data_dir": str(Path(self.data_dir).resolve()) if self.data_dir else None,
            "impl": self.impl,
            "device": self.device,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "kl_seq_len": self.kl_seq_len if kl else None,
            "passkey_lengths": list(self.passkey_lengths) if passkey else None,
            "passkey_depths": list(self.passkey_depths) if passkey else None,
            # only where it changes what is measured (kl windows longer than a chunk; continuation scoring, which
            # prefills long log-likelihood requests chunk by chunk): other runs keep their hash
            "prefill_chunk": self.prefill_chunk
            if (kl and self.kl_seq_len > self.prefill_chunk) or self.scoring == "continuation"
            else None,
            "kl_subsample": self.kl_subsample if kl and self.kl_subsample > 1 else None,
            "max_gen_toks": self.max_gen_toks,
            "nvfp4_global": self.nvfp4_global if self.any_nvfp4 and self.scales.kind == "none" else None,
            "attention": None if self.attention == "kv" else self.attention,
            "scoring": None if self.scoring == "full" else self.scoring,  # recorded only off the default
            # bind records it only for a model dtype other than float32 (where both give the same numbers)
            "logprob_dtype": self.logprob_dtype,
            "max_length": self.max_length,  # recorded when given (results.json holds the window used)
            "perturb_weights": self.perturb_weights,  # None (not written) for the model as loaded
            "repeats": self.repeats,
            "gen_kwargs": dict(self.gen_kwargs) or None,
            "prompts": self.prompts.record() if self.prompts else None,
            "plan": self.plan,
            "tq_boundary_layers": self.tq_boundary_layers if is_tq_preset(self.kv_format) else None,
            "prefix_serde": self.prefix_serde,  # None (not written) without a storage tier
            "prefix_tokens": self.prefix_tokens,
            "engine_release": emulated_release(self.kv_format) if self.plan is None else None,
        }

    @property
    def generation_kwargs(self) -> dict[str, Any] | None:
        """What simple_evaluate's gen_kwargs gets: --max-gen-toks and --gen-kwargs (None: the tasks' own)."""
        out: dict[str, Any] = {"max_gen_toks": self.max_gen_toks} if self.max_gen_toks else {}
        out.update(self.gen_kwargs)
        if "temperature" in out and "do_sample" not in out:
            # a temperature above 0 samples, as in vLLM (lm-eval's task YAMLs often say do_sample: false, which
            # would otherwise win over the temperature given here)
            out["do_sample"] = float(out["temperature"]) > 0
        return out or None

    def differences(self, have: RunConfig, scales_sha256: str | None = None) -> list[str]:
        """What differs between a recorded run (config.yaml) and this spec, as 'field: there, here' lines ([] =
        the same run as far as the spec decides; the run store's identity hash decides the rest). A dtype of
        'auto' matches any recorded dtype (recorded resolved); a recorded run without kv_input_dtype was
        quantized as computed (RunConfig.kv_input_dtype_or_legacy). `scales_sha256`: the scale file's hash now
        (None: not compared)."""
        want = self.recorded_fields()
        if self.dtype != "auto":
            want["dtype"] = self.dtype
        keys = [
            *_COMPARED,
            *(_KL_COMPARED if self.has_kl else ()),
            *(_PASSKEY_COMPARED if self.has_passkey else ()),
        ]
        diffs = [
            f"{k}: {getattr(have, k)!r} there, {want[k]!r} here"
            for k in keys
            if k in want and getattr(have, k) != want[k]
        ]
        if have.scale_source != want["scale_source"]:
            there, here = have.scale_source or "none", want["scale_source"] or "none"
            diffs.append(f"scale source: {there!r} there, {here!r} here")
        if have.tasks and have.tasks != want["tasks"]:
            diffs.append(f"tasks: {have.tasks!r} there, {want['tasks']!r} here")
        kvin = want["kv_input_dtype"]
        if kvin is not None and have.kv_input_dtype_or_legacy != kvin:
            diffs.append(f"kv_input_dtype: {have.kv_input_dtype_or_legacy!r} there, {kvin!r} here")
        if (have.skip_layers or "none") != (self.skip_layers or "none"):
            diffs.append(
                f"skip_layers: {have.skip_layers or 'none'!r} there, {self.skip_layers or 'none'!r} here"
            )
        plan = (self.plan or {}).get("label")
        if have.plan_label != plan:
            diffs.append(f"plan: {have.plan_label or 'none'!r} there, {plan or 'none'!r} here")
        if have.calibrated != self.scales.is_file:
            diffs.append(
                "scales: " + ("calibrated there, not here" if have.calibrated else "not calibrated there")
            )
        elif scales_sha256 is not None:
            sha = have.scales.get("sha256") if isinstance(have.scales, dict) else None
            if sha and sha != scales_sha256:
                diffs.append(f"scales: the run used another version of {Path(str(self.scales.path)).name}")
        return diffs


# What `differences` compares field by field (with tasks, kv input dtype, skip layers and the scale file): the
# settings that make one run directory another configuration. Fields config.yaml gained later (nvfp4_global,
# max_gen_toks, attention, ...) are left to the run store's identity hash, so run directories written before them
# are still found; the kl / passkey fields only for those tasks.
_COMPARED = (
    "kv_format",
    "limit",
    "num_fewshot",
    "dtype",
    "device",
    "impl",
    "batch_size",
    "seed",
    "scale_source",
    "prefix_serde",
    "prefix_tokens",
    "perturb_weights",
)
_KL_COMPARED = ("kl_seq_len", "prefill_chunk", "kl_subsample")
_PASSKEY_COMPARED = ("passkey_lengths", "passkey_depths")


# ---- names ------------------------------------------------------------------------------------------------------


def slug(text: str) -> str:
    """A lower-case file-name-safe form of `text` (run directory and sweep names)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "x"


def model_short(model: str) -> str:
    name = Path(str(model).rstrip("/")).name
    for suffix in (".gguf", ".GGUF"):
        name = name.removesuffix(suffix)
    return slug(name)


def skip_tag(skip_layers: str | None) -> str:
    if not skip_layers or str(skip_layers).strip().lower() in ("", "none"):
        return "none"
    return slug(str(skip_layers).replace(",", "-"))


def base_dir_name(spec: EvalSpec) -> str:
    """`{model_short}__{kv_format}__{scales tag}__skip-{skip_tag}` (a K/V pair k=A,v=B as k-a-v-b); a plan file's
    run `{model_short}__plan-3.0x-{kv_format}__{scales tag}` (its label: the plan decides the 16-bit layers)."""
    tag = spec.scales.tag
    if spec.any_nvfp4 and spec.scales.kind == "none" and spec.nvfp4_global != "one":
        tag = f"global-{slug(spec.nvfp4_global)}"
    fmt_tag = slug(spec.kv_format) if "=" in spec.kv_format else spec.kv_format
    if is_tq_preset(spec.kv_format) and spec.tq_boundary_layers != TQ_BOUNDARY_LAYERS:
        fmt_tag += f"-boundary{spec.tq_boundary_layers}"
    if spec.plan is not None:
        return f"{model_short(spec.model)}__{slug(str(spec.plan['label']))}-{fmt_tag}__{tag}"
    return f"{model_short(spec.model)}__{fmt_tag}__{tag}__skip-{skip_tag(spec.skip_layers)}"


def run_dir_name(spec: EvalSpec | EvalConfig) -> str:
    """The run directory's name, e.g. `gemma3-270m__fp8_e4m3__calib-tensor__skip-sliding_window`, plus
    `__kvin-<dtype>` (a quantized run off the default kv input dtype) and `__attn-<mode>` (--attention)."""
    spec = as_spec(spec)
    name = base_dir_name(spec)
    if spec.recorded_kv_input_dtype not in (None, DEFAULT_KV_INPUT_DTYPE):
        name += f"__kvin-{spec.kv_input_dtype}"
    if spec.attention != "kv":
        name += f"__attn-{slug(spec.attention)}"
    if spec.prefix_serde is not None:
        name += f"__serde-{slug(spec.prefix_serde)}-{spec.prefix_tokens}"
    if spec.perturb_weights is not None:
        name += f"__perturb-{spec.perturb_weights:g}ulp-seed{spec.seed}"
    return name


# ---- the one builder --------------------------------------------------------------------------------------------


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
    if config.repeats is not None and config.repeats < 1:
        raise UsageError(f"--repeats must be at least 1 generation per document, got {config.repeats}")


# --gen-kwargs keys kvcal checks the values of; other keys go to transformers' generate as lm-eval passes them
_GEN_FLOATS = {"temperature": (0.0, None), "top_p": (0.0, 1.0)}


def parse_gen_kwargs(text: str | None) -> tuple[tuple[str, Any], ...]:
    """lm-eval's --gen_kwargs syntax, 'temperature=0.6,top_p=0.95,do_sample=true', parsed once: true/false ->
    bool, numbers -> int / float (lm-eval's handle_arg_string), anything else a string. UsageError on a pair
    without '=' or a value out of range."""
    if not text:
        return ()
    from lm_eval.utils import handle_arg_string  # lm-eval's own value parser of --gen_kwargs / --model_args

    out: dict[str, Any] = {}
    for item in (p.strip() for p in text.split(",")):
        key, sep, raw = item.partition("=")
        if not item or not sep or not key.strip() or not raw.strip():
            raise UsageError(f"--gen-kwargs item '{item}' is not key=value; e.g. --gen-kwargs temperature=0.6,top_p=0.95")
        key, raw = key.strip(), raw.strip()
        if key == "until":
            raise UsageError("--gen-kwargs until=... is the task's stop sequences; set them in the task's YAML")
        out[key] = handle_arg_string(raw)
    for key, (lo, hi) in _GEN_FLOATS.items():
        if key in out:
            v = out[key]
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo
                    or (hi is not None and v > hi)):  # fmt: skip
                bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
                raise UsageError(f"--gen-kwargs {key}={v} must be a number {bound}")
    return tuple(out.items())



def _scale_source(config: EvalConfig, scales_tag: str | None) -> ScaleSource:
    scales = config.scales
    if not scales:
        return ScaleSource()
    if scales == FIRST_BATCH:
        return ScaleSource(FIRST_BATCH, tag=FIRST_BATCH)
    if scales_tag is not None:  # a sweep cell: named by its calibration, the file may not exist yet
        return ScaleSource("file", str(scales), scales_tag)
    if not Path(scales).is_file():
        raise UsageError(f"scale file '{scales}' does not exist; pass the file `kvcal calibrate` wrote")
    from kvcal.scales import load_scale_file

    loaded = load_scale_file(scales)  # the run's one load (bind checks this one)
    return ScaleSource("file", str(scales), f"calib-{loaded.granularity}", loaded)


def _from_plan_file(config: EvalConfig) -> tuple[EvalConfig, str | None, dict[str, Any] | None]:
    """`-f plan.json` (a `kvcal plan` file): its one format and 16-bit layers as --kv-format / --skip-layers
    (kvcal.planfile.one_format_plus_16_bit refuses a plan the quantized cache cannot run), the file, and what
    config.yaml records of it."""
    from kvcal.planfile import is_plan_path, load_plan, one_format_plus_16_bit

    if not is_plan_path(config.kv_format):
        return config, None, None
    if config.skip_layers:
        raise UsageError("--skip-layers comes from the plan file given as --kv-format; drop --skip-layers")
    plan = load_plan(config.kv_format)
    fmt, skip = one_format_plus_16_bit(plan)
    return dataclasses.replace(config, kv_format=fmt, skip_layers=skip), str(config.kv_format), plan.run_record()


# full: lm-eval's own path; continuation: continuation rows only, shared context prefill, chunked; continuation-whole:
# continuation rows only, every request's whole window in one forward as lm-eval runs it (kvcal.evaluate.scoring)
SCORINGS = ("full", "continuation", "continuation-whole")


# float32: log-softmax and sums of log-likelihoods in float32 whatever the model's dtype (kvcal's default; engines
# compute log-probs in float32); model: in the model's dtype, lm-eval's HFLM default (softmax_dtype None)
LOGPROB_DTYPES = ("float32", "model")


def check_logprob_dtype(name: str, flag: str = "--logprob-dtype") -> str:
    """`name` if it is one of LOGPROB_DTYPES, else UsageError naming `flag`."""
    if name not in LOGPROB_DTYPES:
        raise UsageError(
            f"{flag} must be float32 (the default) or model (lm-eval's HFLM: the model's dtype), got '{name}'"
        )
    return name


def check_max_length(value: int | None, flag: str = "--max-length") -> int | None:
    """A max length of at least 2 tokens (one of context, one scored), or None; UsageError naming `flag`."""
    if value is not None and (isinstance(value, bool) or int(value) < 2):
        raise UsageError(f"{flag} must be at least 2 tokens, got {value}")
    return None if value is None else int(value)


def check_scoring(name: str, flag: str = "--scoring") -> str:
    """`name` if it is one of SCORINGS, else UsageError naming `flag` (the CLI's option or lm-eval's model_args)."""
    if name not in SCORINGS:
        raise UsageError(f"{flag} must be one of {', '.join(SCORINGS)}, got '{name}'")
    return name


def eval_spec(config: EvalConfig, *, scales_tag: str | None = None, own_tasks: bool = True) -> EvalSpec:
    """Parse and check everything that needs no model (UsageError naming the option otherwise). `scales_tag`:
    the run-directory tag of a scale file named before it exists (a sweep cell); the file is then loaded when
    the run starts. `own_tasks` False: lm-eval's model (`--model kvcal --model_args ...`, kvcal.evaluate.adapter),
    whose tasks lm-eval runs: the spec has none."""
    _check_numbers(config)
    config, plan_file, plan = _from_plan_file(config)
    scales = _scale_source(config, scales_tag)
    check_kl_subsample(config.kl_subsample)
    if config.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got '{config.dtype}'")
    device = check_device(config.device)
    dtype = config.dtype if config.dtype == "auto" else resolve_dtype(config.dtype, model_dir=".")
    placement = config.placement()
    placement.check()
    # the cache's options: kvcal.kernels.plan.parse_cache_plan is the one parser of them
    cache = parse_cache_plan(
        config.kv_format,
        kv_input_dtype=config.kv_input_dtype,
        attention=config.attention,
        nvfp4_global=config.nvfp4_global,
        impl=config.impl,
        prefix_serde=config.prefix_serde,
        prefix_tokens=config.prefix_tokens,
    )
    if cache.kv_format in ("auto", "bf16") and cache.prefix_serde is None:
        # bf16 rounding is idempotent: nothing rounds, config.yaml records none. With a prefix serde the K/V it
        # round-trips are the engine's (bf16) ones, so the input dtype stays: fp8(float32 K) is not fp8(bf16 K)
        cache = dataclasses.replace(cache, kv_input_dtype=None)
    nvfp4 = any(f.codec.global_scale for f in (cache.k_fmt, cache.v_fmt))
    if cache.nvfp4_global != "one" and (not nvfp4 or config.scales):
        raise UsageError(
            "--nvfp4-global applies to --kv-format nvfp4 / nvfp4_4over6 without --scales (a scale file or "
            "first-batch fixes the global scale)"
        )
    if not cache.quantized and (config.scales or config.skip_layers):
        raise UsageError(
            "--scales / --skip-layers need a quantized --kv-format (auto leaves the cache untouched)"
        )
    if scales.first_batch and not (cache.k_fmt.calibratable and cache.v_fmt.calibratable):
        raise UsageError(
            f"--scales first-batch (vLLM's calculate_kv_scales) sets a static scale, but {cache.kv_format} has "
            "none (its scales are computed at write time); use fp8_e4m3, fp8_e5m2, nvfp4 or nvfp4_4over6"
        )
    if config.tq_boundary_layers < 0:
        raise UsageError(f"--tq-boundary-layers must be 0 or more, got {config.tq_boundary_layers}")
    tasks = tuple(parse_task_list(config.tasks)) if own_tasks else ()
    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = ()
    if any(t in PASSKEY_TASKS for t in tasks):
        lengths = tuple(parse_lengths(config.passkey_lengths))
        depths = tuple(parse_depths(config.passkey_depths))
    return EvalSpec(
        model=config.model,
        tasks=tasks,
        scales=scales,
        force_scales=bool(config.force_scales),
        skip_layers=config.skip_layers,
        include_path=config.include_path,
        limit=config.limit,
        num_fewshot=config.num_fewshot,
        data_dir=config.data_dir,
        cache=cache,
        dtype=dtype,
        device=device,
        placement=placement,
        batch_size=config.batch_size,
        seed=config.seed,
        kl_seq_len=config.kl_seq_len,
        prefill_chunk=config.prefill_chunk,
        kl_subsample=config.kl_subsample,
        max_gen_toks=config.max_gen_toks,
        trust_remote_code=bool(config.trust_remote_code),
        strict=bool(config.strict),
        passkey_lengths=lengths,
        passkey_depths=depths,
        plan_file=plan_file,
        plan=plan,
        scoring=check_scoring(config.scoring),
        logprob_dtype=check_logprob_dtype(config.logprob_dtype),
        max_length=check_max_length(config.max_length),
        perturb_weights=check_perturbation(config.perturb_weights),
        repeats=config.repeats,
        gen_kwargs=parse_gen_kwargs(config.gen_kwargs),
        prompts=_prompt_file(config.prompts, tasks),
        output=config.output,
        gpqa_password=config.gpqa_password,
        tq_boundary_layers=config.tq_boundary_layers,
    )


def as_spec(config: EvalSpec | EvalConfig) -> EvalSpec:
    return config if isinstance(config, EvalSpec) else eval_spec(config)
