"""The release YAML of `kvcal release MODEL --config release.yaml -o OUT` (kvcal.pipeline.release).

MODEL comes from the command line (so one file serves every checkpoint of a model family); the YAML says what to
ship and how to decide. Sections (every key optional unless marked; unknown keys are an error naming the key):

    scales: scales/current.safetensors   # the scale file in service now; absent: the first release calibrates
    ship:                               # REQUIRED: the configuration this release ships
      kv_format: fp8_e4m3               #   REQUIRED; calibratable: fp8_e4m3 (fp8), fp8_e5m2, nvfp4
      granularity: tensor               #   tensor | head
      skip_layers: none                 #   kept at 16 bits: none, sliding_window, full_attention, "0,29"
    calibration:                        # the recipe of every (re)calibration: `kvcal calibrate`'s options
      dataset: data/c4_calib            #   file / folder; absent: kvcal's generated corpus
      text_field: null
      num_samples: 128
      seq_len: 512
      observer: minmax                  #   + observer_params, seed, engine (native | llmcompressor)
    drift:                              # optional: check the scales against a sample of production traffic
      dataset: traffic.jsonl            #   REQUIRED in this section (local file or folder)
      text_field: null
      num_samples: 64
      seq_len: 512
      seed: 0
      max_clip: null                    #   null: `kvcal drift`'s default
      max_sqnr_loss_db: null            #   null: `kvcal drift`'s default
      on_drift: recalibrate             #   recalibrate (on the traffic sample) | fail (exit 1, nothing shipped)
    evaluate:                           # against BF16, through the run store (interrupted runs resume)
      tasks: [kl]                       #   kl and/or any lm-eval task
      candidates: []                    #   further configurations gated with the shipped one:
                                        #   {kv_format, scales: calibrated | uncalibrated, skip_layers}, or
                                        #   {plan: {capacity: 3.0x, format: nvfp4, ...}, scales}: the best plan
                                        #   of `format` (default ship.kv_format) and 16-bit layers at that budget,
                                        #   solved by `kvcal plan` into OUT/plans/ (or plan: a plan file)
      limit: null                       #   samples per task (a mapping task: n gives each its own)
      kl_seq_len: null                  #   + prefill_chunk, kl_subsample, passkey_lengths, passkey_depths, num_fewshot,
      dtype: float32                    #     data_dir, include_path, max_gen_toks, dtype, device, impl,
                                        #     batch_size, seed, repeats, gen_kwargs (as in a sweep YAML)
    gate:
      mode: noninferiority              #   noninferiority: ship only what is shown within max_drop (one-sided
                                        #   upper bound); regression: ship unless shown worse (kvcal compare's)
      allow_unjudged: false             #   true: a configuration with too few samples does not block the release
      max_drop: null                    #   null: kvcal's defaults per metric; a number (every gated metric), or
                                        #   {default: 0.02, kl: 0.05, gsm8k/exact_match: 0.03}
      alpha: 0.05
      min_samples: 10
      bootstrap: 2000
      seed: 1234
      context: null                     #   tokens of context the capacity column assumes (sliding-window
                                        #   layers hold min(context, window)); null: the longest evaluated
    export:
      engines: [vllm, sglang]           #   vllm: checkpoint folder; sglang: --quantization-param-path JSON
      tp_size: 1                        #   sglang: tensor-parallel ranks in the JSON
      reduce_heads: false               #   sglang: allow per-head scales (max over heads)

What each engine can load is checked here, before any work: vLLM's checkpoint export and SGLang's JSON hold FP8
E4M3 scales only; SGLang's JSON holds one scale per layer (per tensor; per-head needs reduce_heads) and SGLang has
no option to keep layers at 16 bits, so skip_layers ship through vLLM alone.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import UsageError
from kvcal.formats import get_format
from kvcal.pipeline import sweep
from kvcal.pipeline.settings import (
    EvalSettings,
    Recipe,
    eval_settings,
    read_fields,
    read_int,
    read_path,
    read_raw,
    read_tasks,
    read_tokens,
    yaml_field,
)

ENGINES = ("vllm", "sglang")
ON_DRIFT = ("recalibrate", "fail")
CANDIDATE_SCALES = ("calibrated", "uncalibrated")
_PREFIX = "release config"


@contextmanager
def _release_errors(section: str | None = None) -> Iterator[None]:
    """The sweep parsers name the sweep config in their messages; here the same check is the release config's."""
    try:
        yield
    except UsageError as exc:
        where = f"{_PREFIX} ({section})" if section else _PREFIX
        msg = str(exc)
        msg = msg.replace("sweep config", where, 1) if "sweep config" in msg else f"{where}: {msg}"
        raise UsageError(msg) from None


def _float(value: Any, key: str, base: Path | None) -> float:
    if isinstance(value, bool):
        raise UsageError(f"'{key}' must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(f"'{key}' must be a number, got {value!r}") from None


def _length_change(value: Any, key: str, base: Path | None) -> float | None:
    """gate.max_length_change: kvcal compare's --max-length-change check, named by its YAML key."""
    from kvcal.report.length import check_max_length_change

    name = f"gate.{key}"
    return check_max_length_change(_float(value, name, base), f"'{name}'")


def _bool(value: Any, key: str, base: Path | None) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"'{key}' must be true or false, got {value!r}")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str, Path | None], str]:
    def parse(value: Any, key: str, base: Path | None) -> str:
        v = str(value).strip().lower()
        if v not in choices:
            raise UsageError(f"'{key}' must be one of {', '.join(choices)}, got {value!r}")
        return v

    return parse


def _skip(value: Any, key: str, base: Path | None) -> str:
    if value in (None, "", False):
        return "none"
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    return str(value).strip() or "none"


def _shipped_format(value: Any, key: str, base: Path | None) -> str:
    fmt = get_format(str(value))
    if not fmt.calibratable:
        calibratable = ", ".join(f for f, spec in _formats().items() if spec.calibratable)
        raise UsageError(
            f"'ship.kv_format' {fmt.name} takes no calibrated scales; ship one of {calibratable} "
            "(list dynamic formats under evaluate.candidates)"
        )
    return fmt.name


def _formats() -> dict[str, Any]:
    from kvcal.formats import FORMATS

    return FORMATS


def _any_format(value: Any, key: str, base: Path | None) -> str:
    return get_format(str(value)).name


def _engines(value: Any, key: str, base: Path | None) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise UsageError(f"'{key}' must be a list of engines ({', '.join(ENGINES)})")
    out: list[str] = []
    for e in items:
        name = str(e).strip().lower()
        if name not in ENGINES:
            raise UsageError(
                f"unknown engine '{e}' in export.engines; kvcal exports for {', '.join(ENGINES)}"
            )
        if name not in out:
            out.append(name)
    return out


def _gate_mode(value: Any, key: str, base: Path | None) -> str:
    from kvcal.report.verdicts import GATES

    return _choice(GATES)(value, key, base)


def _max_drop(value: Any, key: str, base: Path | None) -> Any:
    from kvcal.report.verdicts import parse_gate_policy

    return parse_gate_policy(value, where="gate.max_drop")


# ---- sections --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ship:
    kv_format: str = yaml_field(_shipped_format)
    granularity: str = yaml_field(_choice(("tensor", "head")), "tensor")
    skip_layers: str = yaml_field(_skip, "none")


@dataclass(frozen=True)
class Candidate:
    kv_format: str = yaml_field(_any_format)
    scales: str | None = yaml_field(_choice(CANDIDATE_SCALES), None)  # None: calibrated for the shipped format
    skip_layers: str = yaml_field(_skip, "none")


@dataclass(frozen=True)
class Drift:
    dataset: str = yaml_field(read_path)
    text_field: str | None = yaml_field(read_raw, None)
    num_samples: int = yaml_field(read_int, 64)
    seq_len: int = yaml_field(read_int, 512)
    seed: int = yaml_field(read_int, 0)
    max_clip: float | None = yaml_field(_float, None)  # None: kvcal drift's default
    max_sqnr_loss_db: float | None = yaml_field(_float, None)
    on_drift: str = yaml_field(_choice(ON_DRIFT), "recalibrate")


def _budget(value: Any, key: str, base: Path | None) -> str:
    return str(value).strip()


@dataclass(frozen=True)
class PlanRecipe:
    """`evaluate.candidates[i].plan` as a mapping: what `kvcal plan` solves (candidates: bf16 and `format`)."""

    capacity: str | None = yaml_field(_budget, None)  # e.g. 3.0x
    effective_bits: float | None = yaml_field(_float, None)
    format: str | None = yaml_field(_any_format, None)  # None: ship.kv_format
    context: int | None = yaml_field(read_tokens, None)
    dataset: str | None = yaml_field(read_path, None)  # calibration text of the damage; None: kvcal's corpus
    text_field: str | None = yaml_field(read_raw, None)
    num_samples: int = yaml_field(read_int, 16)
    seq_len: int = yaml_field(read_int, 512)
    seed: int = yaml_field(read_int, 0)
    heldout_windows: int = yaml_field(read_int, 16)
    heldout_seq_len: int = yaml_field(read_int, 512)
    batch_size: int = yaml_field(read_int, 1)


@dataclass(frozen=True)
class PlanCandidate:
    """A plan as a candidate: `recipe` solved by the release, or `file` (a `kvcal plan -o` file) used as is."""

    recipe: PlanRecipe | None
    file: str | None
    scales: str | None = None  # None: calibrated when its format is the shipped one

    @property
    def kv_format(self) -> str:
        """Its one quantized format (the other layers are 16-bit)."""
        if self.file is not None:
            from kvcal.planfile import load_plan, one_format_plus_16_bit

            return one_format_plus_16_bit(load_plan(self.file))[0]
        assert self.recipe is not None and self.recipe.format is not None  # parse_release_config resolves it
        return self.recipe.format

    @property
    def skip_layers(self) -> str:
        return "none"  # the plan decides its 16-bit layers


def _plan_candidate(raw: dict[str, Any], base: Path | None, name: str) -> PlanCandidate:
    """{plan: mapping | plan file, scales}: checked now (budget, one quantized format, the file's shape)."""
    unknown = sorted(set(raw) - {"plan", "scales"})
    if unknown:
        raise UsageError(f"unknown key '{name}.{unknown[0]}'; a plan candidate takes plan, scales")
    scales = None if raw.get("scales") is None else _choice(CANDIDATE_SCALES)(raw["scales"], "scales", base)
    value = raw["plan"]
    if isinstance(value, str):
        from kvcal.planfile import load_plan, one_format_plus_16_bit

        path = read_path(value, f"{name}.plan", base)
        assert path is not None
        with _release_errors(f"{name}.plan"):
            one_format_plus_16_bit(load_plan(path))
        return PlanCandidate(None, path, scales)
    if not isinstance(value, dict):
        raise UsageError(f"'{name}.plan' must be a mapping such as {{capacity: 3.0x}} or a plan file")
    recipe = _section(PlanRecipe, value, base, f"{name}.plan")
    from kvcal.pipeline.plan_cost import parse_budget

    try:
        parse_budget(recipe.capacity, recipe.effective_bits, recipe.context)
    except UsageError as exc:
        raise UsageError(f"{name}.plan: {str(exc).replace('--', '')}") from None
    if recipe.format in ("auto", "bf16"):
        raise UsageError(f"{name}.plan.format must be a quantized format (the other candidate is bf16)")
    return PlanCandidate(recipe, None, scales)


def _candidates(value: Any, key: str, base: Path | None) -> list[Candidate | PlanCandidate]:
    if not isinstance(value, list):
        raise UsageError(
            "'evaluate.candidates' must be a list of {kv_format, scales, skip_layers} or {plan, scales} mappings"
        )
    out: list[Candidate | PlanCandidate] = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise UsageError(f"evaluate.candidates item {i + 1} must be a mapping with kv_format or plan")
        name = f"evaluate.candidates[{i + 1}]"
        out.append(_plan_candidate(raw, base, name) if "plan" in raw else _section(Candidate, raw, base, name))
    return out


@dataclass
class Evaluate(EvalSettings):
    tasks: list[str] = yaml_field(read_tasks, factory=lambda: ["kl"])
    candidates: list[Candidate | PlanCandidate] = yaml_field(_candidates, factory=list)


@dataclass
class Gate:
    # A release must show each configuration is no worse than the threshold (kvcal compare --gate), and a
    # configuration the gate cannot judge does not ship unless allow_unjudged.
    mode: str = yaml_field(_gate_mode, "noninferiority")
    allow_unjudged: bool = yaml_field(_bool, False)
    max_drop: Any = yaml_field(_max_drop, factory=lambda: _max_drop(None, "max_drop", None))  # a GatePolicy
    alpha: float = yaml_field(_float, 0.05)
    min_samples: int = yaml_field(read_int, 10)
    bootstrap: int = yaml_field(read_int, 2000)
    seed: int = yaml_field(read_int, 1234)
    context: int | None = yaml_field(read_tokens, None)  # capacity's context; None: the longest the runs evaluated
    # the paired change in generated length of every generative task (kvcal compare --max-length-change); None:
    # reported, not gated
    max_length_change: float | None = yaml_field(_length_change, None)


@dataclass
class Export:
    engines: list[str] = yaml_field(_engines, factory=list)
    tp_size: int = yaml_field(read_int, 1)
    reduce_heads: bool = yaml_field(_bool, False)


def _recipe(value: Any, key: str, base: Path | None) -> Recipe:
    if not isinstance(value, dict):
        raise UsageError(
            "'calibration' must be a mapping of `kvcal calibrate` options (dataset, num_samples, ...)"
        )
    if "name" in value or "granularity" in value:
        bad = "name" if "name" in value else "granularity"
        raise UsageError(f"unknown calibration key '{bad}' (the granularity is ship.granularity)")
    return Recipe(**read_fields(Recipe, value, base, "calibration key"))


def _sub(cls: type) -> Callable[[Any, str, Path | None], Any]:
    def parse(value: Any, key: str, base: Path | None) -> Any:
        if not isinstance(value, dict):
            raise UsageError(f"'{key}' must be a mapping (see configs/release-smollm2.yaml)")
        return _section(cls, value, base, key)

    return parse


def _section(cls: type, raw: dict[str, Any], base: Path | None, name: str) -> Any:
    """Dataclass `cls` from one YAML mapping; UsageError naming `name.key` for unknown or missing keys."""
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        valid = ", ".join(f.name for f in dataclasses.fields(cls))
        raise UsageError(f"unknown key '{name}.{unknown[0]}'; {name} takes {valid}")
    for f in dataclasses.fields(cls):
        if (
            f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and raw.get(f.name) is None
        ):
            raise UsageError(f"'{name}.{f.name}' is required (see configs/release-smollm2.yaml)")
    return cls(**read_fields(cls, raw, base, f"{name} key"))


@dataclass
class ReleaseConfig:
    ship: Ship = yaml_field(_sub(Ship))
    scales: str | None = yaml_field(read_path, None)
    calibration: Recipe = yaml_field(_recipe, factory=Recipe)
    drift: Drift | None = yaml_field(_sub(Drift), None)
    evaluate: Evaluate = yaml_field(_sub(Evaluate), factory=Evaluate)
    gate: Gate = yaml_field(_sub(Gate), factory=Gate)
    export: Export = yaml_field(_sub(Export), factory=Export)
    source: str | None = None  # the YAML's path (not a key)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as run (what release.json records)."""
        out = dataclasses.asdict(self)
        out["gate"]["max_drop"] = _policy_dict(self.gate.max_drop)
        return out


def _policy_dict(policy: Any) -> Any:
    if hasattr(policy, "to_dict"):
        return policy.to_dict()
    if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
        return dataclasses.asdict(policy)
    return policy


# ---- checks across sections ------------------------------------------------------------------------------------


def _check_engines(cfg: ReleaseConfig) -> None:
    """Refuse now an export the engine could not load (nothing has run yet)."""
    ship, export = cfg.ship, cfg.export
    for engine in export.engines:
        if ship.kv_format != "fp8_e4m3":
            accepts = (
                "FP8 E4M3 scales in a compressed-tensors checkpoint (kv_cache_scheme: float, 8 bits)"
                if engine == "vllm"
                else "per-layer FP8 E4M3 scales (dtype float8_e4m3fn)"
            )
            raise UsageError(
                f"export.engines: {engine} cannot load {ship.kv_format} scales; its export takes {accepts}; "
                f"ship kv_format fp8_e4m3 or drop {engine} from export.engines"
            )
    if "sglang" in export.engines:
        if ship.granularity == "head" and not export.reduce_heads:
            raise UsageError(
                "export.engines: sglang's --quantization-param-path takes one FP8 scale per layer (per tensor); "
                "ship granularity tensor, or set export.reduce_heads: true (max over heads)"
            )
        if ship.skip_layers != "none":
            raise UsageError(
                f"export.engines: sglang has no option to keep layers at 16 bits (ship.skip_layers "
                f"{ship.skip_layers!r}); ship skip_layers through vllm only, or drop the skip layers"
            )
    if export.tp_size < 1:
        raise UsageError(f"export.tp_size must be at least 1, got {export.tp_size}")


def _resolve_plan_formats(cfg: ReleaseConfig) -> None:
    """A plan recipe without `format` plans the shipped format."""
    for i, c in enumerate(cfg.evaluate.candidates):
        if isinstance(c, PlanCandidate) and c.recipe is not None and c.recipe.format is None:
            recipe = dataclasses.replace(c.recipe, format=cfg.ship.kv_format)
            cfg.evaluate.candidates[i] = dataclasses.replace(c, recipe=recipe)


def _check_candidates(cfg: ReleaseConfig) -> None:
    _resolve_plan_formats(cfg)
    for i, c in enumerate(cfg.evaluate.candidates):
        if c.scales == "calibrated" and c.kv_format != cfg.ship.kv_format:
            raise UsageError(
                f"evaluate.candidates[{i + 1}]: only ship.kv_format ({cfg.ship.kv_format}) has release scales; "
                f"give {c.kv_format} scales: uncalibrated, or ship {c.kv_format}"
            )
        if c.kv_format in ("auto", "bf16") and c.skip_layers != "none":
            raise UsageError(f"evaluate.candidates[{i + 1}]: {c.kv_format} has no layers to skip")


def _check_numbers(cfg: ReleaseConfig) -> None:
    g = cfg.gate
    if not 0 < g.alpha < 1:
        raise UsageError(f"gate.alpha must lie between 0 and 1, got {g.alpha}")
    if g.min_samples < 1:
        raise UsageError(f"gate.min_samples must be at least 1, got {g.min_samples}")
    if g.bootstrap < 100:
        raise UsageError(f"gate.bootstrap must be at least 100, got {g.bootstrap}")
    d = cfg.drift
    if d is not None and (d.num_samples < 1 or d.seq_len < 2):
        raise UsageError("drift.num_samples must be at least 1 and drift.seq_len at least 2")


def parse_release_config(raw: Any, base_dir: Path | None = None, source: str | None = None) -> ReleaseConfig:
    """Validate a release YAML mapping. Relative paths are taken relative to `base_dir` when they exist there."""
    if not isinstance(raw, dict):
        raise UsageError(
            f"{_PREFIX} must be a YAML mapping with at least ship.kv_format (see configs/release-*.yaml)"
        )
    with _release_errors():
        known = {f.name for f in dataclasses.fields(ReleaseConfig)} - {"source"}
        unknown = sorted(set(raw) - known)
        if unknown:
            hint = " (MODEL is the command's argument)" if unknown[0] == "model" else ""
            raise UsageError(f"unknown key '{unknown[0]}'{hint}; valid: {', '.join(sorted(known))}")
        if raw.get("ship") is None:
            raise UsageError(
                "'ship' is required: ship: {kv_format: fp8_e4m3} (see configs/release-smollm2.yaml)"
            )
        kwargs = read_fields(ReleaseConfig, {k: v for k, v in raw.items() if k in known}, base_dir, "key")
        cfg = ReleaseConfig(**kwargs, source=source)
        _check_engines(cfg)
        _check_candidates(cfg)
        _check_numbers(cfg)
    return cfg


def load_release_config(path: str | os.PathLike[str]) -> ReleaseConfig:
    p = Path(path)
    if not p.is_file():
        raise UsageError(
            f"release config '{p}' does not exist; see configs/release-smollm2.yaml for an example"
        )
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UsageError(f"release config '{p}' is not valid YAML: {str(exc).splitlines()[0]}") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise UsageError(
            f"cannot read release config '{p}' ({exc}); pass a readable UTF-8 YAML file"
        ) from None
    return parse_release_config(raw, base_dir=p.parent, source=str(p))


def sweep_config(model: str, cfg: ReleaseConfig) -> sweep.SweepConfig:
    """The sweep settings of the release's evaluations and calibration (kvcal.pipeline.sweep runs both)."""
    e = cfg.evaluate
    return sweep.SweepConfig(
        model=model, tasks=list(e.tasks), formats=[cfg.ship.kv_format], baseline="bf16", recipes=[cfg.calibration],
        **eval_settings(e),
    )  # fmt: skip


__all__ = [
    "Candidate",
    "Drift",
    "PlanCandidate",
    "PlanRecipe",
    "ENGINES",
    "Evaluate",
    "Export",
    "Gate",
    "ReleaseConfig",
    "Ship",
    "load_release_config",
    "parse_release_config",
    "sweep_config",
]
