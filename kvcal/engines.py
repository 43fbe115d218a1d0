"""The engine commands of one evaluated configuration: how vLLM, SGLang and TensorRT-LLM serve exactly what a kvcal
run measured, and the `lm_eval` command that evaluates the same tasks on that engine with `--log_samples` (so its
output can be compared with the kvcal run). Where an engine cannot run the configuration, the reason instead.

    cmds = engine_commands(EngineSetup.from_run_config(run_config))   # one EngineCommand per engine
    [c.to_dict() for c in cmds]                                       # what reports and release.json hold

Every flag below was checked against the engine's own source (file @ commit):
- vLLM `vllm/config/cache.py` @ 002f10e0cfa1373a19a0d2756598a34b700d20e5: `CacheDType` (auto, bfloat16, fp8,
  fp8_e4m3, fp8_e5m2, int8_per_token_head, nvfp4, nvfp4_4over6, ...) is `--kv-cache-dtype`;
  `kv_cache_dtype_skip_layers: list[str]` ("layer indices (e.g., '0', '2', '4') or attention type names") is
  `--kv-cache-dtype-skip-layers` (a list option: the values follow the flag, space separated); there is no
  `calculate_kv_scales` field any more (vLLM PR #49389 removed `--calculate-kv-scales`).
  `vllm/engine/arg_utils.py` (EngineArgs.add_cli_args): `--kv-cache-dtype-skip-layers` and
  `--attention-backend` (AttentionConfig.backend; FLASH_ATTN, TRITON_ATTN).
  Checkpoint scales: vLLM reads `k_scale` / `v_scale` of a compressed-tensors `kv_cache_scheme` checkpoint, what
  `kvcal export --to vllm` writes (kvcal/calibrate/export.py); per-head (attn_head) scales need FLASH_ATTN.
- SGLang `python/sglang/srt/server_args.py` @ 001067fffe33427bee0ed2f007fb7551a1d76b44: `--kv-cache-dtype`
  choices auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16, fp4_e2m1;
  `--quantization-param-path` ("JSON file containing the KV cache scaling factors ... Otherwise, KV cache scaling
  factors default to 1.0"); `--model-path`; no option keeps layers out of KV quantization. Its scale JSON holds one
  scale per layer for K and V (`kvcal export --to sglang`).
- TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412: `KvCacheConfig.dtype`
  (PyTorch backend; "auto" follows the checkpoint's metadata), set through `trtllm-serve MODEL --backend pytorch
  --extra_llm_api_options FILE.yaml` (`tensorrt_llm/commands/serve.py`); `tensorrt_llm/_torch/pyexecutor/
  model_loader.py` @ 004b733e0ed7c03c83dcfa7de48e8ee6e4fa58d0 accepts `_VALID_KV_CACHE_DTYPES = ("fp8", "nvfp4",
  "auto")` and refuses to override a checkpoint whose own kv_cache_quant_algo differs. Calibrated KV scales come
  from a ModelOpt checkpoint, which kvcal does not write: calibrated configurations are refused for it.
- lm-eval 0.4.13 (`lm_eval/_cli/run.py`): `--model vllm|sglang|local-completions`, `--model_args` as JSON (lists
  survive, key=value strings split on commas), `--tasks`, `--num_fewshot`, `--limit`, `--gen_kwargs`,
  `--batch_size`, `--log_samples`, `--output_path`. Its vllm model passes unknown model_args on to `vllm.LLM`
  (EngineArgs: kv_cache_dtype, kv_cache_dtype_skip_layers, attention_backend); its sglang model to `sgl.Engine`
  (ServerArgs: kv_cache_dtype, quantization_param_path).

No shell string is built from input: commands are argument lists; `shell` is shlex.join of them, for display.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvcal.formats import CPU_STORES, TQ_BOUNDARY_LAYERS, get_format, is_tq_preset
from kvcal.rundir import CONFIG, RunConfig
from kvcal.tasknames import OWN_TASKS

ENGINES = ("vllm", "vllm-cpu", "sglang", "trtllm")
# kvcal's own tasks (kvcal.tasknames): they need kvcal's BF16 reference or its generated documents; no engine runs them
KVCAL_ONLY_TASKS = OWN_TASKS
ENDPOINT = "http://localhost:8000/v1/completions"  # the OpenAI completions route vLLM / trtllm-serve open
# --kv-cache-dtype choices, transcribed: vLLM vllm/config/cache.py CacheDType @ 002f10e0; SGLang
# python/sglang/srt/server_args.py kv_cache_dtype choices @ 001067ff. A name kvcal's format table gives an engine
# must be one of them (tests/test_engines.py).
KV_CACHE_DTYPES: dict[str, frozenset[str]] = {
    "vllm": frozenset({
        "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
        "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "int4_per_token_head",
        "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
        "ultraquant_4bit", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact",  # vLLM 0.33.0 (kvcal.releases)
    }),
    "sglang": frozenset({
        "auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16", "fp4_e2m1",
    }),
    # kv_cache_config.dtype, lower case (TensorRT-LLM model_loader.py _VALID_KV_CACHE_DTYPES @ 004b733e)
    "trtllm": frozenset({"fp8", "nvfp4", "auto"}),
}  # fmt: skip


@dataclass(frozen=True)
class EngineSetup:
    """One evaluated configuration, as an engine would need it."""

    model_dir: str  # the checkpoint folder
    kv_format: str  # kvcal canonical name (or a K/V pair k=A,v=B)
    scales_path: str | None = None  # a calibrated scale file; None = the format's defaults (1.0, dynamic)
    granularity: str | None = None  # the scale file's: 'tensor' | 'head'
    first_batch: bool = False  # `--scales first-batch` (vLLM <= 0.18 calculate_kv_scales)
    skip_layers: tuple[int, ...] = ()  # layer indices kept in 16 bits
    attention: str | None = None  # 'fp8' = FlashAttention-3's FP8 attention
    nvfp4_global: str | None = None  # 'one' | 'per_sequence' (nvfp4 without a scale file)
    dtype: str = "auto"
    tasks: tuple[str, ...] = ()
    num_fewshot: int | None = None
    limit: int | None = None
    max_gen_toks: int | None = None
    gen_kwargs: tuple[tuple[str, Any], ...] = ()  # --gen-kwargs, parsed (kvcal.evaluate.spec.parse_gen_kwargs)
    repeats: int | None = None  # --repeats: generations per document
    include_path: str | None = None
    label: str = ""  # names the lm-eval output folder
    tq_boundary_layers: int | None = None  # a TurboQuant preset's --tq-boundary-layers (vLLM's is always 2)
    prefix_serde: str | None = None  # LMCache's storage tier (--prefix-serde): no engine command carries it
    engine_release: str | None = None  # 'vllm==0.33.0': the release whose store the run matched (kvcal.releases)
    max_length: int | None = None  # the run's window (lm-eval max_length): the engine's max_model_len
    data_dir: str | None = None  # --data-dir: kvcal-lm-eval reads the same offline task data
    perturb_weights: float | None = None  # --perturb-weights: a yardstick run, no engine serves it

    @classmethod
    def from_run_config(cls, rc: RunConfig, label: str = "") -> EngineSetup:
        return cls(
            model_dir=rc.model_dir or rc.model,
            kv_format=rc.kv_format,
            scales_path=rc.scales_path,
            granularity=rc.scales_granularity,
            first_batch=rc.scale_source == "first-batch",
            skip_layers=tuple(sorted(rc.skip_layer_indices)),
            attention=rc.attention,
            nvfp4_global=rc.nvfp4_global,
            dtype=rc.dtype or "auto",
            tasks=tuple(rc.tasks),
            num_fewshot=rc.num_fewshot,
            limit=rc.limit,
            max_gen_toks=rc.max_gen_toks,
            gen_kwargs=tuple((rc.gen_kwargs or {}).items()),
            repeats=rc.repeats,
            include_path=rc.include_path,
            label=label,
            tq_boundary_layers=rc.tq_boundary_layers,
            prefix_serde=rc.prefix_serde,
            engine_release=rc.engine_release,
            max_length=getattr(rc, "max_length", None) or (rc.extra or {}).get("max_length"),
            data_dir=rc.data_dir,
            perturb_weights=rc.perturb_weights,
        )

    def merged_tasks(self, other: EngineSetup) -> EngineSetup:
        """The same configuration with the tasks of both (a configuration runs one task per run directory in a
        sweep)."""
        tasks = self.tasks + tuple(t for t in other.tasks if t not in self.tasks)
        return EngineSetup(**{**self.__dict__, "tasks": tasks})


@dataclass(frozen=True)
class EngineCommand:
    """What one engine needs to run a configuration, or why it cannot."""

    engine: str
    serve: tuple[str, ...] | None = None  # the serving command line (argument list)
    export: tuple[str, ...] | None = (
        None  # the kvcal command that writes what `serve` loads, when it loads scales
    )
    lm_eval: tuple[str, ...] | None = None  # evaluates the same tasks on the engine, per-sample output kept
    files: dict[str, str] = field(default_factory=dict)  # file name -> contents the commands read
    refused: str | None = None  # why the engine cannot run this configuration (then no commands)
    notes: tuple[str, ...] = ()
    release: str | None = None  # the engine release the run emulated ('vllm==0.33.0'; kvcal.releases)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine}
        if self.release:
            out["release"] = self.release
        if self.refused:
            out["refused"] = self.refused
        for key in ("export", "serve", "lm_eval"):
            argv = getattr(self, key)
            if argv is not None:
                out[key] = shlex.join(argv)
                out[f"{key}_argv"] = list(argv)
        if self.files:
            out["files"] = dict(self.files)
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def lines(self) -> list[str]:
        """Human-readable lines (what the CLI prints and the Markdown report holds)."""
        return command_lines(self.to_dict())


def command_lines(d: dict[str, Any]) -> list[str]:
    """The lines of one engine's EngineCommand.to_dict() (release.json and sweep.json hold these dicts)."""
    engine = d["engine"]
    if d.get("refused"):
        return [f"{engine}: cannot run this configuration: {d['refused']}"]
    out = [f"{engine} {name}: {text.strip()}" for name, text in (d.get("files") or {}).items()]
    out += [
        f"{engine} {key.replace('_', '-')}: {d[key]}" for key in ("export", "serve", "lm_eval") if key in d
    ]
    if d.get("release"):
        out.append(f"{engine} release: the run emulated {d['release']}'s store (kvcal formats)")
    return out + [f"{engine} note: {n}" for n in d.get("notes", [])]


def engine_commands(setup: EngineSetup) -> list[EngineCommand]:
    """One EngineCommand per engine of ENGINES."""
    return [_vllm(setup), _vllm_cpu(setup), _sglang(setup), _trtllm(setup)]


def commands_dict(setup: EngineSetup) -> dict[str, dict[str, Any]]:
    """{engine: EngineCommand.to_dict()} (what reports, sweep.json and release.json hold)."""
    return {c.engine: c.to_dict() for c in engine_commands(setup)}


def setup_from_run_dir(path: str | os.PathLike[str], label: str = "") -> EngineSetup | None:
    """The EngineSetup of a run directory's config.yaml; None when it has none or it does not parse (the
    callers report such runs themselves)."""
    try:
        raw = yaml.safe_load((Path(path) / CONFIG).read_text(encoding="utf-8"))
        rc = RunConfig.from_dict(raw) if isinstance(raw, dict) else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError, ValueError, TypeError):
        return None
    return None if rc is None else EngineSetup.from_run_config(rc, label or Path(path).name)


def group_setups(named: list[tuple[str, EngineSetup]]) -> list[tuple[str, EngineSetup]]:
    """One setup per label, the tasks of all its runs merged (first-seen order)."""
    out: dict[str, EngineSetup] = {}
    for label, setup in named:
        out[label] = out[label].merged_tasks(setup) if label in out else setup
    return list(out.items())


def markdown_section(named: list[tuple[str, EngineSetup]]) -> str:
    """## Engine commands: per configuration, each engine's commands or the reason it cannot run it."""
    return markdown_from_dicts({label: commands_dict(setup) for label, setup in group_setups(named)})


def markdown_from_dicts(by_config: dict[str, dict[str, dict[str, Any]]]) -> str:
    """markdown_section from {configuration: commands_dict(...)} (what release.json and sweep.json hold)."""
    lines = [
        "## Engine commands",
        "",
        "How each engine serves each configuration, and the `lm_eval` command that evaluates the same tasks on it "
        "with `--log_samples` (its output folder can be compared with these runs). Flags checked against each "
        "engine's source (kvcal/engines.py names file and commit).",
        "",
    ]
    for label, engines in by_config.items():
        lines += [f"### {label}", "", "```"]
        for d in engines.values():
            lines += command_lines(d)
        lines += ["```", ""]
    return "\n".join(lines)


# ---- refusals shared by every engine ---------------------------------------------------------------------------


def _common_refusal(s: EngineSetup, engine: str) -> str | None:
    if s.kv_format in CPU_STORES:
        return (
            f"{s.kv_format} is vLLM's CPU build's FP8 store (mantissa truncated); {_ENGINE_NAMES[engine]} rounds to "
            f"nearest: evaluate {CPU_STORES[s.kv_format]} for it"
        )
    if "=" in s.kv_format:
        return (
            f"{s.kv_format} stores K and V in two formats; released engines take one KV cache dtype for both "
            "(vLLM PR #53770's fp8_k_nvfp4_v is unreleased)"
        )
    if s.nvfp4_global == "per_sequence":
        return "a per-sequence NVFP4 global scale (--nvfp4-global per_sequence) is no engine's behaviour"
    if s.prefix_serde is not None:
        return (
            f"the prefix serde '{s.prefix_serde}' is LMCache's storage tier (an LMCache connector with an L2 serde "
            "and a prefix reloaded from it), which kvcal writes no engine configuration for"
        )
    if s.perturb_weights is not None:
        return (
            f"the run's weights were perturbed by {s.perturb_weights:g} ulps (--perturb-weights): a conformance "
            "yardstick, not a model an engine serves; print the commands of the unperturbed run"
        )
    if is_tq_preset(s.kv_format):
        return _tq_refusal(s, engine)
    fmt = get_format(s.kv_format)
    name = fmt.engine_names.get(engine)
    if name is None and not (engine == "trtllm" and fmt.name in ("auto", "bf16")):
        return f"{_ENGINE_NAMES[engine]} has no KV cache dtype for {s.kv_format}"
    if (engine, _engine_dtype(fmt.name, engine)) in OTHER_BACKEND:
        return OTHER_BACKEND[engine, _engine_dtype(fmt.name, engine)]
    if _engine_dtype(fmt.name, engine) not in KV_CACHE_DTYPES[engine]:
        return f"'{name}' is not a KV cache dtype of {_ENGINE_NAMES[engine]} (see kvcal/engines.py)"
    return None


def _tq_refusal(s: EngineSetup, engine: str) -> str | None:
    """TurboQuant presets are vLLM's own names; vLLM always adds its boundary layers (no flag turns them off)."""
    if engine != "vllm":
        return f"{_ENGINE_NAMES[engine]} has no TurboQuant KV cache ({s.kv_format} is vLLM's preset)"
    if s.tq_boundary_layers not in (None, TQ_BOUNDARY_LAYERS):
        return (
            f"vLLM always keeps the first and last {TQ_BOUNDARY_LAYERS} layers of a dense model out of TurboQuant "
            f"(TurboQuantConfig.get_boundary_skip_layers, no flag); this run used --tq-boundary-layers "
            f"{s.tq_boundary_layers}"
        )
    return None


def _engine_dtype(fmt_name: str, engine: str) -> str:
    """The engine's KV cache dtype for a kvcal format (TensorRT-LLM: lower case; bf16/auto -> auto)."""
    if is_tq_preset(fmt_name):
        return fmt_name
    name = get_format(fmt_name).engine_names.get(engine)
    if engine == "trtllm":
        return "auto" if fmt_name in ("auto", "bf16") else str(name).lower()
    return str(name)


_ENGINE_NAMES = {"vllm": "vLLM", "vllm-cpu": "vLLM's CPU build", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}

# Engine names of formats' table that the serve commands here cannot run, and why (tests/test_engines.py checks
# every other name is one of KV_CACHE_DTYPES)
OTHER_BACKEND: dict[tuple[str, str], str] = {
    ("trtllm", "int8"): (
        "TensorRT-LLM's INT8 KV cache (QuantMode INT8_KV_CACHE, a checkpoint quantized with kv_cache_quant_algo "
        "INT8) belongs to its TensorRT engine backend; the PyTorch backend that `trtllm-serve --backend pytorch` "
        "runs takes kv_cache_config.dtype fp8, nvfp4 or auto"
    ),
}


def _calibrated_fp8(s: EngineSetup, engine: str) -> str | None:
    """A calibrated scale file only reaches an engine through `kvcal export`, which writes FP8 E4M3 scales only."""
    if s.scales_path is not None and s.kv_format != "fp8_e4m3":
        return (
            f"calibrated {s.kv_format} scales have no checkpoint layout {_ENGINE_NAMES[engine]} loads "
            "(kvcal export writes FP8 E4M3 scales only); run it without --scales for the engine's defaults"
        )
    return None


# ---- lm-eval ---------------------------------------------------------------------------------------------------


def _engine_tasks(s: EngineSetup) -> tuple[list[str], list[str]]:
    """(lm-eval tasks, notes): kvcal's own tasks dropped with a note."""
    tasks = [t for t in s.tasks if t not in KVCAL_ONLY_TASKS]
    own = [t for t in s.tasks if t in KVCAL_ONLY_TASKS]
    notes = (
        [
            f"{', '.join(own)}: kvcal's own task(s) (BF16 reference logits / generated documents); no lm-eval command"
        ]
        if own
        else []
    )
    if s.repeats is not None and s.repeats > 1:
        # lm-eval's CLI has no repeats option (lm_eval/_cli/run.py @ 0.4.13): it is the task config's `repeats`
        notes.append(
            f"--repeats {s.repeats}: lm-eval's CLI has no repeats option; set `repeats: {s.repeats}` in the task's "
            "YAML (--include_path), and kvcal compare scores each document by the mean over its repeats only in "
            "kvcal's own runs (lm-eval's filters keep the first)"
        )
    return tasks, notes


def gen_kwargs_text(items: Iterable[tuple[str, Any]]) -> str:
    """lm-eval's --gen_kwargs string of (key, value) pairs: 'max_gen_toks=48,temperature=0.6,do_sample=true'."""
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items)


def _lm_eval(model: str, model_args: dict[str, Any], s: EngineSetup, engine: str) -> tuple[str, ...]:
    tasks, _ = _engine_tasks(s)
    argv = ["lm_eval", "--model", model, "--model_args", json.dumps(model_args, separators=(",", ":"))]
    argv += ["--tasks", ",".join(tasks)]
    if s.num_fewshot is not None:
        argv += ["--num_fewshot", str(s.num_fewshot)]
    if s.limit is not None:
        argv += ["--limit", str(s.limit)]
    gen = ([("max_gen_toks", s.max_gen_toks)] if s.max_gen_toks is not None else []) + list(s.gen_kwargs)
    if gen:
        argv += ["--gen_kwargs", gen_kwargs_text(gen)]
    if s.include_path:
        argv += ["--include_path", s.include_path]
    out = Path("lm-eval") / f"{engine}-{s.label or s.kv_format}"
    argv += ["--batch_size", "auto", "--log_samples", "--output_path", str(out)]
    return tuple(argv)


def _dtype_arg(s: EngineSetup) -> dict[str, str]:
    return {} if s.dtype in ("auto", "", None) else {"dtype": s.dtype}


def _float32_note(s: EngineSetup) -> list[str]:
    """A run computed in float32 (the float32 checkpoint's own dtype) is what the printed commands reproduce; a
    served model runs in 16 bits (vLLM's `--dtype auto` serves a float32 checkpoint in bfloat16 / float16)."""
    if s.dtype != "float32":
        return []
    return [
        "this run computed in float32, so the commands serve float32 to compute the same; to measure what you serve "
        "in 16 bits, evaluate with `kvcal eval --dtype bfloat16` and use that run's commands"
    ]


def _dtype_flag(s: EngineSetup) -> list[str]:
    """`--dtype D` (vLLM ModelConfig.dtype, SGLang ServerArgs.dtype: both take bfloat16 / float16 / float32): the
    run's resolved model dtype, so the engine computes in the dtype kvcal did."""
    return [] if s.dtype in ("auto", "", None) else ["--dtype", s.dtype]


# ---- vLLM ------------------------------------------------------------------------------------------------------


def _export_dir(s: EngineSetup, engine: str) -> str:
    assert s.scales_path is not None
    p = Path(s.scales_path)
    return (
        str(p.with_name(f"{p.stem}-{engine}"))
        if engine == "vllm"
        else str(p.with_name(f"{p.stem}-sglang.json"))
    )


def _unquantized_on_a_scheme(s: EngineSetup, dtype: str, notes: list[str]) -> str:
    """vLLM serves `--kv-cache-dtype auto` as FP8 on a checkpoint that declares a kv_cache_scheme (models.config.
    declares_kv_scheme): an unquantized run (`auto`, `bf16`) of such a checkpoint names its cache dtype, the
    explicit choice vLLM honours over the checkpoint's. Measured on vllm-cpu 0.32.0: `bfloat16` runs there (a
    16-bit cache of 65,536 tokens in 1.41 GiB) though CPU_ATTN's supported_kv_cache_dtypes does not list it."""
    if dtype != "auto" or s.scales_path is not None or not _declares_kv_scheme(s.model_dir):
        return dtype
    explicit = "float16" if s.dtype in ("float16", "half") else "bfloat16"  # vLLM's CacheDType has no float32
    notes.append(
        f"--kv-cache-dtype {explicit}: {s.model_dir} declares a KV-cache scheme, and vLLM serves `auto` on it as FP8 "
        "with its scales (vllm/model_executor/layers/attention/attention.py @ v0.32.0)"
    )
    return explicit


def _declares_kv_scheme(model_dir: str) -> bool:
    """The checkpoint declares a kv_cache_scheme (vLLM then serves `auto` as FP8 and refuses fp8_e5m2)."""
    from kvcal.models.config import declares_kv_scheme

    return declares_kv_scheme(model_dir)


def _e5m2_on_a_scheme(s: EngineSetup, dtype: str) -> str | None:
    """vLLM raises at load time for fp8_e5m2 on a checkpoint that declares a kv_cache_scheme (measured on
    vllm-cpu 0.32.0: a `kvcal export --to vllm` checkpoint): the refusal, or None."""
    if dtype != "fp8_e5m2" or not _declares_kv_scheme(s.model_dir):
        return None
    return (
        f"vLLM refuses fp8_e5m2 on {s.model_dir}, a checkpoint declaring a KV-cache scheme ('fp8_e5m2 kv-cache is "
        "not supported with fp8 checkpoints', vllm/model_executor/layers/attention/attention.py @ v0.32.0): "
        "evaluate the source model"
    )


def _vllm(s: EngineSetup) -> EngineCommand:
    refusal = _common_refusal(s, "vllm") or _calibrated_fp8(s, "vllm")
    if refusal:
        return EngineCommand("vllm", refused=refusal)
    dtype = _engine_dtype(s.kv_format, "vllm")
    e5m2_refusal = _e5m2_on_a_scheme(s, dtype)
    if e5m2_refusal:
        return EngineCommand("vllm", refused=e5m2_refusal)
    notes: list[str] = []
    dtype = _unquantized_on_a_scheme(s, dtype, notes)
    if s.first_batch:
        return EngineCommand(
            "vllm",
            refused="vLLM removed --calculate-kv-scales (PR #49389; vllm/config/cache.py has no "
            "calculate_kv_scales); vLLM <= 0.18 ran it with `--calculate-kv-scales`",
        )
    model, export = s.model_dir, None
    if s.scales_path is not None:
        model = _export_dir(s, "vllm")
        export = ("kvcal", "export", s.scales_path, s.model_dir, "--to", "vllm", "-o", model)
    flags = [*_dtype_flag(s), "--kv-cache-dtype", dtype]
    if s.skip_layers and dtype not in ("auto", "bfloat16"):
        flags += ["--kv-cache-dtype-skip-layers", *(str(i) for i in s.skip_layers)]
    backend = None
    quantized = dtype not in ("auto", "bfloat16")
    if s.attention == "fp8":
        backend = "FLASH_ATTN"
        notes.append("FP8 attention (Q and P in e4m3) is FlashAttention-3's: a Hopper GPU")
    elif s.granularity == "head":
        backend = "FLASH_ATTN"
        notes.append(
            "per-head scales need the FLASH_ATTN backend; on Hopper FlashAttention-3 also quantizes Q to FP8, "
            "which this run did not emulate (kvcal eval --attention fp8 does)"
        )
    elif quantized and dtype.startswith("fp8"):
        backend = "TRITON_ATTN"  # attention in the model dtype, as this run computed it (no FP8 Q)
    if is_tq_preset(dtype):
        notes.append(
            "vLLM's TurboQuant backend attends a prompt's first chunk on its unquantized K/V (flash_attn) and reads "
            "the TurboQuant cache from decode on; kvcal reads the cache at every position (what its decode computes)"
        )
    if backend:
        flags += ["--attention-backend", backend]
    if s.max_length is not None:
        flags += ["--max-model-len", str(s.max_length)]
    serve = ("vllm", "serve", model, *flags)
    model_args: dict[str, Any] = {"pretrained": model, "kv_cache_dtype": dtype, **_dtype_arg(s)}
    if "--kv-cache-dtype-skip-layers" in flags:
        model_args["kv_cache_dtype_skip_layers"] = [str(i) for i in s.skip_layers]
    if s.max_length is not None:
        model_args["max_model_len"] = s.max_length
    if backend:
        model_args["attention_backend"] = backend
    tasks, task_notes = _engine_tasks(s)
    lm = _lm_eval("vllm", model_args, s, "vllm") if tasks else None
    notes += _float32_note(s)
    return EngineCommand(
        "vllm", serve=serve, export=export, lm_eval=lm, notes=tuple(notes + task_notes), release=s.engine_release
    )


# kvcal's emulation of vLLM's CPU build's FP8 store (kvcal.formats fp8_e4m3_cpu): vllm-cpu's `fp8`, no GPU's;
# kvcal.formats.CPU_STORES has it and fp8_e5m2_cpu with their round-to-nearest formats
CPU_FP8 = "fp8_e4m3_cpu"

# ---- vLLM's CPU build -------------------------------------------------------------------------------------------

# The CPU attention backend's KV cache dtypes: CPUAttentionBackend.supported_kv_cache_dtypes in
# vllm/v1/attention/backends/cpu_attn.py of vllm-cpu 0.32.0 (the package kvcal's `make engine` installs).
VLLM_CPU_RELEASE = "0.32.0"
VLLM_CPU_KV_DTYPES = frozenset({"auto", "fp8", "fp8_e4m3", "fp8_e5m2"})


CPU_KV_SEQUENCES = 8  # the CPU build's cache is sized for this many sequences at the run's window
CPU_KV_FALLBACK_BYTES = 4 * 2**30  # 4 GiB, vLLM's former VLLM_CPU_KVCACHE_SPACE default: when no config reads


def cpu_kv_cache_bytes(s: EngineSetup) -> tuple[int, str]:
    """(--kv-cache-memory-bytes for vLLM's CPU build, a note saying how it was sized). Without it the CPU worker
    reserves --gpu-memory-utilization (0.92) of the machine's memory and refuses to start when less is free
    (vllm/v1/worker/cpu_worker.py @ v0.32.0: "Available memory on node 0 ... is less than desired CPU memory
    utilization"): a printed command that fails on any machine running something else. Sized from the checkpoint's
    config: CPU_KV_SEQUENCES sequences of the window (the run's max_length, else the model's positions), every
    layer's K and V at 16 bits (the FP8 cache needs half), rounded up to a MiB."""
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec

    try:
        kv = kv_spec(load_config(s.model_dir))
    except Exception:  # noqa: BLE001 - any unreadable checkpoint: the fallback, said in the note
        return CPU_KV_FALLBACK_BYTES, (
            f"--kv-cache-memory-bytes {CPU_KV_FALLBACK_BYTES}: {s.model_dir}'s config did not read, so the CPU "
            "build's cache is set to 4 GiB (without it the engine reserves 92% of the machine's memory)"
        )
    window = s.max_length or kv.max_position_embeddings or 8192
    per_token = sum(2 * layer.kv_heads * layer.head_dim * 2 for layer in kv.layers)  # K and V, 2 bytes each
    size = -(-CPU_KV_SEQUENCES * window * per_token // 2**20) * 2**20
    return size, (
        f"--kv-cache-memory-bytes {size}: room for {CPU_KV_SEQUENCES} sequences of {window} tokens in a 16-bit cache "
        "(without it the CPU build reserves 92% of the machine's memory and refuses to start when less is free)"
    )


def _vllm_cpu(s: EngineSetup) -> EngineCommand:
    """vLLM's CPU build (`vllm-cpu`): one attention backend (CPU_ATTN, no --attention-backend to choose), FP8 only
    on AVX-512 / AMX, and lm-eval started through `kvcal-lm-eval` (lm-eval's own `--model vllm` looks up the
    distribution `vllm`, which the CPU build does not register)."""
    cpu_store = s.kv_format in CPU_STORES
    base = replace(s, kv_format=CPU_STORES[s.kv_format]) if cpu_store else s  # the CPU build's store of it
    refusal = _common_refusal(base, "vllm") or _calibrated_fp8(base, "vllm")
    if refusal:
        return EngineCommand("vllm-cpu", refused=refusal)
    s = base
    if s.first_batch:
        return EngineCommand("vllm-cpu", refused="vLLM removed --calculate-kv-scales (PR #49389)")
    if s.attention == "fp8":
        return EngineCommand("vllm-cpu", refused="FP8 attention (Q and P in e4m3) is FlashAttention-3's, a Hopper GPU")
    dtype = _engine_dtype(s.kv_format, "vllm")
    if dtype == "bfloat16":
        dtype = "auto"  # the cache in the model's dtype: what CPU_ATTN lists (it has no 'bfloat16' entry)
    scheme_notes: list[str] = []
    dtype = _unquantized_on_a_scheme(s, dtype, scheme_notes)
    if dtype not in VLLM_CPU_KV_DTYPES and dtype != "bfloat16":
        return EngineCommand(
            "vllm-cpu",
            refused=f"vLLM's CPU attention backend (vllm-cpu {VLLM_CPU_RELEASE}, CPU_ATTN) stores "
            f"{', '.join(sorted(VLLM_CPU_KV_DTYPES))} only; {dtype} needs a GPU backend",
        )
    notes = [
        f"vllm-cpu=={VLLM_CPU_RELEASE} (`make engine` installs it in .venv-vllm/); CPU_ATTN, its only attention backend",
        *scheme_notes,
    ]
    if dtype not in ("auto", "bfloat16"):
        notes.append("an FP8 KV cache on the CPU build needs x86 with AVX-512 or AMX and a head size divisible by 32")
    own = {rne: cpu for cpu, rne in CPU_STORES.items()}.get(s.kv_format)
    if dtype != "auto" and not cpu_store and own is not None:
        notes.append(
            f"vLLM's CPU build truncates FP8 mantissas (csrc/cpu/cpu_attn_fp8.hpp); this run rounds to nearest "
            f"as vLLM's GPU store does: `kvcal eval -f {own}` emulates what this command stores"
        )
    e5m2_refusal = _e5m2_on_a_scheme(s, dtype)
    if e5m2_refusal:
        return EngineCommand("vllm-cpu", refused=e5m2_refusal)
    if dtype in ("fp8", "fp8_e4m3") and s.scales_path is None and not _declares_kv_scheme(s.model_dir):
        notes.append(
            f"WARNING: without calibrated scales vllm-cpu {VLLM_CPU_RELEASE}'s FP8 attention (AMX) loses small E4M3 V "
            "codes (subnormal codes read as 0; SmolLM2 wikitext at scale 1.0: the engine +8.3% word perplexity "
            "where the store it writes costs +3.1%, docs/engines.md): calibrate (`kvcal calibrate`, `kvcal export "
            "--to vllm`), or expect more damage than this run shows"
        )
    model, export = s.model_dir, None
    if s.scales_path is not None:
        model = _export_dir(s, "vllm")
        export = ("kvcal", "export", s.scales_path, s.model_dir, "--to", "vllm", "-o", model)
    if s.granularity == "head":
        notes.append(
            "WARNING: vLLM's compressed-tensors loader hands the CPU backend one scale per layer, the maximum of the "
            "per-head scales (compressed_tensors.py _to_scalar @ v0.32.0): the engine serves per-tensor scales, not "
            "this run's per-head ones"
        )
    # eager: vLLM's default torch.compile of the model takes minutes on a small CPU before the first token and
    # changes no KV arithmetic (the cache write and attention are CPU_ATTN's own kernels either way)
    flags = [*_dtype_flag(s), "--kv-cache-dtype", dtype, "--enforce-eager"]
    model_args: dict[str, Any] = {"pretrained": model, "kv_cache_dtype": dtype, **_dtype_arg(s), "enforce_eager": True}
    if s.skip_layers and dtype != "auto":
        flags += ["--kv-cache-dtype-skip-layers", *(str(i) for i in s.skip_layers)]
        model_args["kv_cache_dtype_skip_layers"] = [str(i) for i in s.skip_layers]
    if s.max_length is not None:
        flags += ["--max-model-len", str(s.max_length)]
        model_args["max_model_len"] = s.max_length
    kv_bytes, kv_note = cpu_kv_cache_bytes(s)
    flags += ["--kv-cache-memory-bytes", str(kv_bytes)]
    model_args["kv_cache_memory_bytes"] = kv_bytes
    notes.append(kv_note)
    serve = ("vllm", "serve", model, *flags, "--host", "127.0.0.1")
    tasks, task_notes = _engine_tasks(s)
    lm = None
    if tasks:
        argv = list(_lm_eval("vllm", model_args, s, "vllm-cpu"))
        argv[0] = "kvcal-lm-eval"
        if s.data_dir:
            argv += ["--data-dir", s.data_dir]
        lm = tuple(argv)
    notes += _float32_note(s)
    return EngineCommand("vllm-cpu", serve=serve, export=export, lm_eval=lm, notes=tuple(notes + task_notes))


# ---- SGLang ----------------------------------------------------------------------------------------------------


def _sglang(s: EngineSetup) -> EngineCommand:
    refusal = _common_refusal(s, "sglang") or _calibrated_fp8(s, "sglang")
    if refusal:
        return EngineCommand("sglang", refused=refusal)
    dtype = _engine_dtype(s.kv_format, "sglang")
    if s.skip_layers and dtype not in ("auto", "bf16"):
        return EngineCommand(
            "sglang",
            refused=f"SGLang has no option to keep layers out of KV quantization (skip layers "
            f"{','.join(map(str, s.skip_layers))}); server_args.py has --kv-cache-dtype for every layer",
        )
    if s.first_batch:
        return EngineCommand("sglang", refused="SGLang computes no scales from the first batch")
    if s.attention == "fp8":
        return EngineCommand("sglang", refused="FP8 attention (--attention fp8) is vLLM FlashAttention-3's")
    if s.granularity == "head":
        return EngineCommand(
            "sglang",
            refused="SGLang's --quantization-param-path holds one scale per layer for K and V; this run used "
            "per-head scales (calibrate --granularity tensor, or kvcal export --to sglang --reduce-heads for a "
            "different configuration that needs its own kvcal run)",
        )
    flags = [*_dtype_flag(s), "--kv-cache-dtype", dtype]
    export, notes = None, []
    model_args: dict[str, Any] = {"pretrained": s.model_dir, "kv_cache_dtype": dtype, **_dtype_arg(s)}
    if s.scales_path is not None:
        path = _export_dir(s, "sglang")
        export = ("kvcal", "export", s.scales_path, s.model_dir, "--to", "sglang", "-o", path)
        flags += ["--quantization-param-path", path]
        model_args["quantization_param_path"] = path
        notes.append("SGLang applies one scale per layer to K and V: the export writes max(k_scale, v_scale)")
    serve = ("python", "-m", "sglang.launch_server", "--model-path", s.model_dir, *flags)
    tasks, task_notes = _engine_tasks(s)
    lm = _lm_eval("sglang", model_args, s, "sglang") if tasks else None
    return EngineCommand("sglang", serve=serve, export=export, lm_eval=lm, notes=tuple(notes + task_notes))


# ---- TensorRT-LLM ----------------------------------------------------------------------------------------------


def _trtllm(s: EngineSetup) -> EngineCommand:
    refusal = _common_refusal(s, "trtllm")
    if refusal:
        return EngineCommand("trtllm", refused=refusal)
    if s.first_batch:
        return EngineCommand("trtllm", refused="TensorRT-LLM computes no KV scales from the first batch")
    if s.scales_path is not None:
        return EngineCommand(
            "trtllm",
            refused="TensorRT-LLM takes calibrated KV scales from a ModelOpt checkpoint, which kvcal does not "
            "write; run it without --scales to compare with TensorRT-LLM's defaults",
        )
    if s.skip_layers:
        return EngineCommand("trtllm", refused="KvCacheConfig has no per-layer KV dtype (skip layers)")
    if s.attention == "fp8":
        return EngineCommand("trtllm", refused="FP8 attention (--attention fp8) is vLLM FlashAttention-3's")
    dtype = _engine_dtype(s.kv_format, "trtllm")
    name = "kv_cache.yaml"
    files = {name: f"kv_cache_config:\n  dtype: {dtype}\n"}
    serve = ("trtllm-serve", s.model_dir, "--backend", "pytorch", "--extra_llm_api_options", name)
    tasks, task_notes = _engine_tasks(s)
    lm = None
    if tasks:
        args = {"model": s.model_dir, "base_url": ENDPOINT, "tokenized_requests": False}
        lm = _lm_eval("local-completions", args, s, "trtllm")
    notes = (
        "lm-eval has no TensorRT-LLM model: lm_eval reads the running trtllm-serve endpoint",
        *task_notes,
    )
    return EngineCommand("trtllm", serve=serve, lm_eval=lm, files=files, notes=notes)
