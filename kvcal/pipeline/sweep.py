"""`kvcal sweep`: one model, a matrix of KV formats x scale variants x skip-layer choices x tasks, resumable.

    cfg = load_sweep_config("configs/sweep-gemma3-270m-cpu.yaml")
    plan = plan_sweep(cfg, "runs/")          # what is complete, what would run (touches nothing)
    execute_sweep(cfg, "runs/", plan=plan, progress=callback)

Layout of RUNS_DIR:
    scales/<recipe>__<format>__<granularity>.safetensors     calibrated once per recipe x format x granularity
    <task>/<model>__<format>__<scales_tag>__skip-<skip_tag>/  one `kvcal eval` run directory per cell
    sweep.yaml, sweep.json                                     the config as run, and the plan with each status

One run directory per (configuration, task) so that adding a task or a format later runs only the new cells;
`kvcal compare RUNS_DIR` groups the directories of one configuration back together. A cell is complete when
its run directory has COMPLETE and its config.yaml (kvcal.rundir.RunConfig, docs/run-directory.md) matches the
sweep's settings; an interrupted cell resumes (run_eval skips its finished tasks); a directory holding another
configuration is never overwritten.

Scale variants only where meaningful: uncalibrated / calibrated per tensor / per head for the calibratable
formats (fp8_e4m3, fp8_e5m2, nvfp4); every other format runs once with its dynamic scales. The BF16 baseline
runs once per task, without skipped layers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.kl import DEFAULT_PREFILL_CHUNK, DEFAULT_SEQ_LEN, check_kl_subsample
from kvcal.evaluate.passkey import DEFAULT_DEPTHS, DEFAULT_LENGTHS, parse_depths, parse_lengths
from kvcal.evaluate.run import (
    FIRST_BATCH,
    EvalConfig,
    model_short,
    recorded_kv_input_dtype,
    run_eval,
    skip_tag,
    slug,
)
from kvcal.evaluate.tasks import PASSKEY_TASKS, parse_task_list
from kvcal.formats import DEFAULT_KV_INPUT_DTYPE, get_format, kv_pair, parse_kv_format, parse_kv_input_dtype
from kvcal.io import atomic_write_json, atomic_write_text
from kvcal.models import load_model, resolve_dtype, resolve_model, sha256_file
from kvcal.rundir import COMPLETE, CONFIG, RunConfig
from kvcal.scales import load_scale_file

# uncalibrated = the engine's default (fp8 1.0, nvfp4 global 1.0); first-batch = vLLM's calculate_kv_scales (amax
# of the first batch / 200 for K, / 100 for V, fixed afterwards); tensor / head = calibrated here
SCALE_VARIANTS = ("uncalibrated", "first-batch", "tensor", "head")

ProgressCallback = Callable[[dict[str, Any]], None]
Step = Callable[
    [str, bool], None
]  # step(message, advance): one progress event; advance counts a unit as done

# ---- the sweep YAML: every key is one dataclass field, read by the parser in its metadata ---------------------

Parser = Callable[[Any, str, Path | None], Any]  # (YAML value, key, folder of the YAML) -> field value


def _key(parse: Parser, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
         yaml_key: str | None = None) -> Any:  # fmt: skip
    """A field of the sweep YAML: how its value is read, its default (absent or null -> default), its YAML name."""
    meta = {"parse": parse, "yaml": yaml_key}
    return field(default=default, default_factory=factory, metadata=meta)


def _yaml_key(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("yaml") or f.name


def _as_list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()] if key != "skip_layers" else [value]
    if isinstance(value, list):
        return value
    raise UsageError(f"sweep config: '{key}' must be a list, got {type(value).__name__}")


def _text(value: Any, key: str, base: Path | None) -> str:
    return str(value)


def _raw(value: Any, key: str, base: Path | None) -> Any:
    return value


def _int(value: Any, key: str, base: Path | None) -> int:
    if isinstance(value, bool):
        raise UsageError(f"sweep config: '{key}' must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"sweep config: '{key}' must be an integer, got {value!r}") from None


def _tokens(value: Any, key: str, base: Path | None) -> int:
    n = _int(value, key, base)
    if n < 1:
        raise UsageError(f"sweep config: '{key}' must be a positive number of tokens (e.g. 8192), got {n}")
    return n


def _subsample(value: Any, key: str, base: Path | None) -> int:
    n = _int(value, key, base)
    try:
        return check_kl_subsample(n)
    except UsageError as exc:
        raise UsageError(f"sweep config: '{key}': {exc}") from None


def _passkey_spec(parse: Callable[[str], list[Any]]) -> Parser:
    """A passkey list ('1k,2k,4k' or a YAML list [1k, 2k]) checked by `parse` now, kept as kvcal eval's text."""

    def read(value: Any, key: str, base: Path | None) -> str:
        text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        try:
            parse(text)
        except UsageError as exc:
            raise UsageError("sweep config: " + str(exc).replace(f"--{key.replace('_', '-')}", key)) from None
        return text

    return read


def _path(value: Any, key: str, base: Path | None) -> str | None:
    """Relative paths are taken relative to the YAML's folder when they exist there, else to the current one."""
    if value in (None, ""):
        return None
    cand = Path(str(value)).expanduser()
    if not cand.is_absolute() and base is not None and (base / cand).exists():
        return str((base / cand).resolve())
    return str(cand)


def _dtype(value: Any, key: str, base: Path | None) -> str:
    name = str(value)
    # a named dtype needs no checkpoint to resolve (aliases -> the name `kvcal eval` records); 'auto' does
    return name if name == "auto" else resolve_dtype(name, model_dir=".")


def _granularities(value: Any, key: str, base: Path | None) -> tuple[str, ...] | None:
    grans = tuple(str(g) for g in _as_list(value, key))
    if any(g not in ("tensor", "head") for g in grans):
        raise UsageError(f"sweep config: recipe granularity must be tensor or head, got {list(grans)}")
    return grans or None


def _recipe_name(value: Any, key: str, base: Path | None) -> str:
    return slug(str(value))


@dataclass(frozen=True)
class Recipe:
    """One calibration recipe (the arguments of kvcal.calibrate.run.calibrate)."""

    name: str = _key(_recipe_name, "default")
    observer: str = _key(_text, "minmax")
    granularity: tuple[str, ...] | None = _key(
        _granularities, None
    )  # only these granularities; None = all asked
    dataset: str | None = _key(_path, None)  # None = kvcal's built-in generated corpus
    num_samples: int = _key(_int, 128)
    seq_len: int = _key(_int, 512)
    seed: int = _key(_int, 0)
    engine: str = _key(_text, "native")
    observer_params: dict[str, Any] | None = _key(_raw, None)
    text_field: str | None = _key(_raw, None)


def _kv_input_dtype(value: Any, key: str, base: Path | None) -> str:
    return parse_kv_input_dtype(str(value))


def _tasks(value: Any, key: str, base: Path | None) -> list[str]:
    return parse_task_list([str(t) for t in _as_list(value, key)])


def _formats(value: Any, key: str, base: Path | None) -> list[str]:
    formats: list[str] = []
    for f in _as_list(value, key):
        canon = parse_kv_format(str(f))  # a format or a K/V pair k=A,v=B
        if canon not in formats:
            formats.append(canon)
    return formats


_SCALE_ALIASES = {
    "per_tensor": "tensor",
    "calibrated": "tensor",
    "per_head": "head",
    "first_batch": "first-batch",
    "calculate_kv_scales": "first-batch",
}


def _scales(value: Any, key: str, base: Path | None) -> list[str]:
    scales = [str(s).lower() for s in _as_list(value, key)]
    scales = [_SCALE_ALIASES.get(s, s) for s in scales]
    bad = [s for s in scales if s not in SCALE_VARIANTS]
    if bad or not scales:
        raise UsageError(
            f"sweep config: scales must be a list of {', '.join(SCALE_VARIANTS)}; got {bad or 'nothing'}"
        )
    return scales


def _skips(value: Any, key: str, base: Path | None) -> list[str]:
    skips: list[str] = []
    for s in _as_list(value, key):
        s = "none" if s in (None, "", False) or str(s).strip().lower() == "none" else str(s).strip()
        if s not in skips:
            skips.append(s)
    return skips


def _limit(value: Any, key: str, base: Path | None) -> int | dict[str, int]:
    if isinstance(value, dict):
        value = {("default" if k == "default" else parse_task_list([str(k)])[0]): v for k, v in value.items()}
        values = list(value.values())
    else:
        values = [value]
    if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0) for v in values):
        raise UsageError(
            f"sweep config: limit must be a positive integer or a mapping task: integer, got {value!r}"
        )
    return value


def _recipes(value: Any, key: str, base: Path | None) -> list[Recipe]:
    raw = [value] if isinstance(value, dict) else value
    if not isinstance(raw, list):
        raise UsageError("sweep config: 'calibration' must be a recipe mapping or a list of them")
    recipes: list[Recipe] = []
    for i, r in enumerate(raw or [{}]):
        if not isinstance(r, dict):
            raise UsageError(f"sweep config: calibration recipe {i + 1} must be a mapping")
        r = dict(r)
        if not r.get("name"):
            r["name"] = "default" if len(raw) <= 1 else f"recipe{i + 1}"
        recipes.append(Recipe(**_read_fields(Recipe, r, base, "calibration key")))
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise UsageError(f"sweep config: calibration recipe names must be unique, got {names}")
    return recipes


@dataclass(kw_only=True)
class EvalSettings:
    """How each evaluation runs: the keys a sweep config and a release config's `evaluate` section share."""

    limit: int | dict[str, int] | None = _key(
        _limit, None
    )  # samples per task; a mapping gives each task its own
    num_fewshot: int | None = _key(_int, None)
    data_dir: str | None = _key(_path, None)
    include_path: str | None = _key(_path, None)
    dtype: str = _key(_dtype, "float32")
    device: str = _key(_text, "cpu")
    impl: str = _key(_text, "auto")
    batch_size: int = _key(_int, 1)
    seed: int = _key(_int, 0)
    kl_seq_len: int | None = _key(_int, None)
    prefill_chunk: int | None = _key(_tokens, None)  # kl windows longer than this: chunked prefill
    # kl scores positions 0, N, 2N, ... (kvcal eval --kl-subsample)
    kl_subsample: int | None = _key(_subsample, None)
    max_gen_toks: int | None = _key(_int, None)  # cap on generated tokens (lm-eval's aime25 asks for 32768)
    passkey_lengths: str | None = _key(_passkey_spec(parse_lengths), None)  # e.g. [1k, 2k, 4k]
    passkey_depths: str | None = _key(_passkey_spec(parse_depths), None)  # e.g. [0, 0.5, 1]
    # K/V rounded to this dtype before quantization (kvcal eval --kv-input-dtype): the engine's serving dtype
    kv_input_dtype: str = _key(_kv_input_dtype, DEFAULT_KV_INPUT_DTYPE)


def eval_settings(settings: EvalSettings) -> dict[str, Any]:
    """The EvalSettings fields of `settings` as keyword arguments (to carry them into another config)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(EvalSettings)}


@dataclass
class SweepConfig(EvalSettings):
    model: str = _key(_text)
    tasks: list[str] = _key(_tasks)
    formats: list[str] = _key(_formats)
    scales: list[str] = _key(_scales, factory=lambda: ["uncalibrated", "tensor"])
    skip_layers: list[str] = _key(_skips, factory=lambda: ["none"])
    baseline: str = _key(_text, "bf16")
    # tokens of context `kvcal compare RUNS_DIR` assumes for capacity (recorded in sweep.yaml; see recorded_context)
    context: int | None = _key(_tokens, None)
    recipes: list[Recipe] = _key(_recipes, factory=lambda: [Recipe()], yaml_key="calibration")

    def limit_for(self, task: str) -> int | None:
        if isinstance(self.limit, dict):
            return self.limit.get(task, self.limit.get("default"))
        return self.limit


def _read_fields(cls: type, raw: dict[str, Any], base: Path | None, what: str) -> dict[str, Any]:
    """Keyword arguments of dataclass `cls` from a YAML mapping, each value through its field's parser; absent and
    null keys keep their defaults. UsageError for unknown keys."""
    known = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UsageError(
            f"sweep config: unknown {what}(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    return {
        f.name: f.metadata["parse"](raw[key], key, base)
        for key, f in known.items()
        if raw.get(key) is not None
    }


def parse_sweep_config(raw: dict[str, Any], base_dir: Path | None = None) -> SweepConfig:
    """Validate a sweep config dict (the YAML). Relative paths are taken relative to `base_dir` when they exist
    there, else to the current folder."""
    if not isinstance(raw, dict):
        raise UsageError("sweep config must be a YAML mapping (see configs/ for examples)")
    required = [_yaml_key(f) for f in dataclasses.fields(SweepConfig) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]  # fmt: skip
    kwargs = _read_fields(SweepConfig, raw, base_dir, "key")
    for key in required:
        if not raw.get(key):
            raise UsageError(f"sweep config: '{key}' is required (see configs/ for examples)")
    return SweepConfig(**kwargs)


def load_sweep_config(path: str | os.PathLike[str]) -> SweepConfig:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"sweep config {p} does not exist; see configs/ for examples")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UsageError(f"sweep config {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise UsageError(f"sweep config {p} is not UTF-8 text; save it as UTF-8") from None
    return parse_sweep_config(raw, base_dir=p.parent)


def recorded_context(runs_dir: str | os.PathLike[str]) -> int | None:
    """The `context` a sweep recorded in RUNS_DIR/sweep.yaml (what `kvcal compare RUNS_DIR` assumes by default),
    or None: no sweep.yaml, no context key, or not a positive integer."""
    try:
        raw = yaml.safe_load((Path(runs_dir) / "sweep.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    value = raw.get("context") if isinstance(raw, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def config_dict(cfg: SweepConfig) -> dict[str, Any]:
    """The YAML mapping of `cfg` (what sweep.yaml records; parse_sweep_config reads it back to the same config)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SweepConfig):
        value = getattr(cfg, f.name)
        if f.name == "recipes":
            value = [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(r).items() if v is not None}
                for r in value
            ]  # fmt: skip
        out[_yaml_key(f)] = value
    return out


# ---- the plan -------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    recipe: Recipe
    kv_format: str
    granularity: str
    path: Path
    status: str  # 'done' | 'todo'

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Cell:
    name: str  # run directory name (the configuration)
    task: str
    kv_format: str
    scales_label: str  # 'none' (baseline), 'uncalibrated', 'dynamic', 'calib-tensor', 'calib-head[-recipe]'
    skip: str  # 'none' or the --skip-layers spec
    path: Path
    calibration: Calibration | None
    is_baseline: bool
    status: str = "todo"  # 'complete' | 'partial' (resumes) | 'todo' | 'stale' (another config lives there)
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "kv_format": self.kv_format,
            "scales": self.scales_label,
            "scale_file": str(self.calibration.path) if self.calibration else None,
            "skip_layers": self.skip,
            "run_dir": str(self.path),
            "baseline": self.is_baseline,
            "status": self.status,
            "detail": self.detail,
        }


@dataclass
class SweepPlan:
    runs_dir: Path
    cells: list[Cell]
    calibrations: list[Calibration]

    @property
    def todo(self) -> list[Cell]:
        return [c for c in self.cells if c.status in ("todo", "partial")]

    @property
    def stale(self) -> list[Cell]:
        return [c for c in self.cells if c.status == "stale"]

    @property
    def n_done(self) -> int:
        return sum(c.status == "complete" for c in self.cells)

    @property
    def calibrations_todo(self) -> list[Calibration]:
        needed = {id(c.calibration) for c in self.todo if c.calibration is not None}
        return [c for c in self.calibrations if c.status == "todo" and id(c) in needed]

    @property
    def total_steps(self) -> int:
        """Progress units over the whole matrix: every cell plus every scale file (done ones count as done)."""
        return len(self.cells) + len(self.calibrations)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs_dir": str(self.runs_dir),
            "cells": [c.to_dict() for c in self.cells],
            "calibrations": [
                {
                    "file": str(c.path),
                    "kv_format": c.kv_format,
                    "granularity": c.granularity,
                    "recipe": c.recipe.name,
                    "status": c.status,
                }
                for c in self.calibrations
            ],  # fmt: skip
            "summary": {
                "cells": len(self.cells),
                "complete": self.n_done,
                "to_run": len(self.todo),
                "stale": len(self.stale),
                "scale_files": len(self.calibrations),
                "to_calibrate": len(self.calibrations_todo),
            },
        }


def plan_sweep(cfg: SweepConfig, runs_dir: str | os.PathLike[str]) -> SweepPlan:
    """The whole matrix with the status of every cell and scale file, from what is on disk (touches nothing)."""
    root = Path(runs_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(f"-o {root} is a file; pass a directory for the sweep's runs")
    model = model_short(cfg.model)
    calibrations: dict[tuple[str, str, str], Calibration] = {}
    cells: list[Cell] = []
    for fmt, label, gran, recipe, skip, baseline in _configurations(cfg):
        cal = None
        if gran is not None and recipe is not None:
            key = (recipe.name, fmt, gran)
            if key not in calibrations:
                calibrations[key] = _calibration(root, recipe, fmt, gran)
            cal = calibrations[key]
        cells.extend(
            task_cells(cfg, root, cell_name(model, fmt, label, skip), fmt, label, skip, cal, baseline)
        )
    return SweepPlan(root, cells, list(calibrations.values()))


def task_cells(
    cfg: SweepConfig,
    root: Path,
    name: str,
    fmt: str,
    label: str,
    skip: str,
    cal: Calibration | None,
    baseline: bool,
) -> list[Cell]:
    """One configuration's cell per task (run directory root/<task>/<name>), each with its status on disk."""
    cells = []
    for task in cfg.tasks:
        cell = Cell(name, task, fmt, label, skip, root / task / name, cal, baseline)
        cell.status, cell.detail = _cell_state(cell, cfg)
        cells.append(cell)
    return cells


def _configurations(cfg: SweepConfig) -> Iterator[tuple[str, str, str | None, Recipe | None, str, bool]]:
    """(format, scales label, granularity, recipe, skip, is_baseline) of every configuration: the baseline first,
    without skipped layers; BF16 / auto never skip layers."""
    base_fmt = get_format(cfg.baseline).name
    yield base_fmt, "none", None, None, "none", True
    for fmt in cfg.formats:
        if fmt == base_fmt:
            continue
        skips = ["none"] if fmt in ("auto", "bf16") else cfg.skip_layers
        for label, gran, recipe in _scale_variants(fmt, cfg):
            for skip in skips:
                yield fmt, label, gran, recipe, skip, False


def _scale_variants(fmt_name: str, cfg: SweepConfig) -> list[tuple[str, str | None, Recipe | None]]:
    """[(label, granularity, recipe)] for one format: only calibratable formats get scale variants."""
    sides = kv_pair(fmt_name)  # (K, V) formats, the same unless a K/V pair
    if sides[0].name in ("auto", "bf16") and sides[1].name in ("auto", "bf16"):
        return [("none", None, None)]
    if not all(f.calibratable for f in sides):
        return [("dynamic", None, None)]
    out: list[tuple[str, str | None, Recipe | None]] = []
    if "uncalibrated" in cfg.scales:
        out.append(("uncalibrated", None, None))
    if FIRST_BATCH in cfg.scales:
        out.append((FIRST_BATCH, None, None))
    for gran in ("tensor", "head"):
        if gran not in cfg.scales:
            continue
        for recipe in cfg.recipes:
            if recipe.granularity and gran not in recipe.granularity:
                continue
            label = f"calib-{gran}" if len(cfg.recipes) == 1 else f"calib-{gran}-{recipe.name}"
            out.append((label, gran, recipe))
    return out


def cell_name(model: str, fmt: str, label: str, skip: str) -> str:
    """kvcal eval's run directory name (evaluate.run.run_dir_name): uncalibrated and dynamic are both 'none'."""
    tag = label if label.startswith("calib-") or label == FIRST_BATCH else "none"
    fmt_tag = slug(fmt) if "=" in fmt else fmt  # as run_dir_name names a K/V pair
    return f"{model}__{fmt_tag}__{tag}__skip-{skip_tag(skip)}"


def _calibration(root: Path, recipe: Recipe, fmt: str, gran: str) -> Calibration:
    path = root / "scales" / f"{recipe.name}__{fmt}__{gran}.safetensors"
    return Calibration(recipe, fmt, gran, path, "done" if _scale_file_ok(path) else "todo")


def _scale_file_ok(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        load_scale_file(path)
        return True
    except KvcalError:
        return False


def _cell_state(cell: Cell, cfg: SweepConfig) -> tuple[str, str]:
    """('complete'|'partial'|'todo'|'stale', detail) from what is on disk; never modifies anything."""
    d = cell.path
    if not d.exists():
        return "todo", ""
    conf = d / CONFIG
    if not conf.is_file():
        if any(p for p in d.iterdir() if not p.name.startswith(".")):
            return "stale", f"{d} exists but holds no run (no {CONFIG}); move it aside"
        return "todo", ""
    have = _read_run_config(conf)
    if have is None:
        return "stale", f"{conf} does not parse; move {d} aside"
    diffs = _run_differences(have, cell, cfg)
    if diffs:
        return (
            "stale",
            f"{d} holds another configuration ({'; '.join(diffs[:3])}); use a new RUNS_DIR or move it aside",
        )
    if (d / COMPLETE).is_file():
        return "complete", ""
    return "partial", "interrupted; resumes"


def _read_run_config(conf: Path) -> RunConfig | None:
    try:
        raw = yaml.safe_load(conf.read_text(encoding="utf-8"))
        return RunConfig.from_dict(raw) if isinstance(raw, dict) else None
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, TypeError):
        return None


def _long_context_recorded(cfg: SweepConfig, task: str) -> dict[str, Any]:
    """What `kvcal eval` records of kl's window / chunk and passkey's lengths / depths for this task (a run made
    with other ones measured something else)."""
    if task == "kl":
        seq_len = cfg.kl_seq_len or DEFAULT_SEQ_LEN
        chunk = cfg.prefill_chunk or DEFAULT_PREFILL_CHUNK
        sub = cfg.kl_subsample or 1
        return {
            "kl_seq_len": seq_len,
            "prefill_chunk": chunk if seq_len > chunk else None,
            "kl_subsample": sub if sub > 1 else None,
        }
    if task in PASSKEY_TASKS:
        return {
            "passkey_lengths": parse_lengths(cfg.passkey_lengths or DEFAULT_LENGTHS),
            "passkey_depths": parse_depths(cfg.passkey_depths or DEFAULT_DEPTHS),
        }
    return {}


def _run_differences(have: RunConfig, cell: Cell, cfg: SweepConfig) -> list[str]:
    """What differs between a run directory's recorded configuration and what the sweep would run there."""
    want: dict[str, Any] = {
        "kv_format": cell.kv_format,
        "limit": cfg.limit_for(cell.task),
        "num_fewshot": cfg.num_fewshot,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "impl": cfg.impl,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
    }
    if cfg.dtype == "auto":  # recorded as what the checkpoint resolved to: any dtype is that one
        del want["dtype"]
    want.update(_long_context_recorded(cfg, cell.task))
    diffs = [f"{k}: {getattr(have, k)!r} there, {v!r} here" for k, v in want.items() if getattr(have, k) != v]
    if have.tasks and have.tasks != [cell.task]:
        diffs.append(f"tasks: {have.tasks!r} there, {[cell.task]!r} here")
    want_src = FIRST_BATCH if cell.scales_label == FIRST_BATCH else None
    if have.scale_source != want_src:
        diffs.append(f"scale source: {have.scale_source or 'none'!r} there, {want_src or 'none'!r} here")
    kvin = recorded_kv_input_dtype(
        EvalConfig(model=cfg.model, kv_input_dtype=cfg.kv_input_dtype), cell.kv_format
    )
    if kvin is not None and have.kv_input_dtype_or_legacy != kvin:
        diffs.append(f"kv_input_dtype: {have.kv_input_dtype_or_legacy!r} there, {kvin!r} here")
    if (have.skip_layers or "none") != cell.skip:
        diffs.append(f"skip_layers: {have.skip_layers or 'none'!r} there, {cell.skip!r} here")
    cal = cell.calibration
    if have.calibrated != (cal is not None):
        diffs.append(
            "scales: " + ("calibrated there, not here" if have.calibrated else "not calibrated there")
        )
    elif cal is not None and cal.path.is_file():
        sha = have.scales.get("sha256") if isinstance(have.scales, dict) else None
        if sha and sha != sha256_file(cal.path):
            diffs.append(f"scales: {cell.path.name} used another version of {cal.path.name}")
    return diffs


# ---- execution ----------------------------------------------------------------------------------------------


def execute_sweep(
    cfg: SweepConfig,
    runs_dir: str | os.PathLike[str],
    plan: SweepPlan | None = None,
    progress: ProgressCallback | None = None,
    warn: Callable[[str], None] | None = None,
    gpqa_password: str | None = None,
) -> dict[str, Any]:
    """Calibrate what is missing, run the baseline and every incomplete cell, and report what happened.

    `progress(event)` receives {"done", "total", "message"} over the whole matrix (complete cells and existing
    scale files count as done from the start). A failing cell is recorded and the sweep goes on; stale cells
    (another configuration in their directory) are never touched.
    """
    root = Path(runs_dir)
    plan = plan or plan_sweep(cfg, root)
    step = _stepper(plan, progress)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "sweep.yaml", yaml.safe_dump(config_dict(cfg), sort_keys=False))
    step(f"{plan.n_done} of {len(plan.cells)} cells complete", False)

    failed = [{"cell": f"{cell.task}/{cell.name}", "error": cell.detail} for cell in plan.stale]
    skipped = plan.n_done
    needed = plan.calibrations_todo
    for c in plan.calibrations:  # scale files whose cells are all complete or stale: nothing to do
        if c.status == "todo" and c not in needed:
            step(f"{c.name}: not needed", True)
    cal_errors = calibrate_all(cfg, needed, step, warn or (lambda _m: None))
    ran, cell_failures = run_cells(cfg, plan, cal_errors, step, gpqa_password)
    summary = {
        "runs_dir": str(root),
        "ran": ran,
        "skipped_complete": skipped,
        "failed": failed + cell_failures,
        "calibrated": sum(1 for c in needed if c.status == "done"),
        "context": cfg.context,
        "plan": plan.to_dict(),
    }
    atomic_write_json(root / "sweep.json", summary)
    return summary


def _stepper(plan: SweepPlan, progress: ProgressCallback | None) -> Step:
    """step(message, advance): count progress units over the whole matrix and report each event."""
    state = {"done": plan.n_done + sum(c.status == "done" for c in plan.calibrations)}

    def step(message: str, advance: bool) -> None:
        if advance:
            state["done"] += 1
        if progress:
            progress({"done": state["done"], "total": plan.total_steps, "message": message})

    return step


def calibrate_all(
    cfg: SweepConfig, todo: list[Calibration], step: Step, warn: Callable[[str], None]
) -> dict[str, str]:
    """Write every missing scale file; one model load for all of them. Returns {scale file: error}."""
    if not todo:
        return {}
    from kvcal.calibrate.run import calibrate  # imports transformers: planning (--dry-run) stays without it

    model_dir = resolve_model(cfg.model)
    step(f"loading {cfg.model} for calibration", False)
    lm = load_model(str(model_dir), dtype=cfg.dtype, device=cfg.device)
    errors: dict[str, str] = {}
    for cal in todo:
        r = cal.recipe
        step(f"calibrating {cal.name}", False)
        try:
            res = calibrate(
                lm, cal.kv_format, granularity=cal.granularity, observer=r.observer, dataset=r.dataset,
                num_samples=r.num_samples, seq_len=r.seq_len, seed=r.seed, engine=r.engine, output=cal.path,
                observer_params=r.observer_params, text_field=r.text_field, dtype=cfg.dtype, device=cfg.device,
                kv_input_dtype=cfg.kv_input_dtype,
            )  # fmt: skip
            for w in res.warnings:
                warn(f"{cal.name}: {w}")
            cal.status = "done"
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                raise
            errors[str(cal.path)] = str(exc)
        step(f"calibrated {cal.name}", True)
    return errors


def run_cells(
    cfg: SweepConfig, plan: SweepPlan, cal_errors: dict[str, str], step: Step, gpqa_password: str | None
) -> tuple[int, list[dict[str, str]]]:
    """Run every cell still to run (the baseline first). Returns (cells run, [{cell, error}] of the failures)."""
    ran = 0
    failed: list[dict[str, str]] = []
    for cell in sorted(plan.todo, key=lambda c: (not c.is_baseline, c.name, c.task)):
        label = f"{cell.task}/{cell.name}"
        if cell.calibration is not None and str(cell.calibration.path) in cal_errors:
            failed.append(
                {"cell": label, "error": f"calibration failed: {cal_errors[str(cell.calibration.path)]}"}
            )
            step(f"{label}: skipped (calibration failed)", True)
            continue
        step(f"{label}: running", False)
        try:
            run_eval(
                _eval_config(cfg, cell, gpqa_password), progress=lambda m, _l=label: step(f"{_l}: {m}", False)
            )
            cell.status = "complete"
            ran += 1
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                raise
            failed.append({"cell": label, "error": str(exc)})
            cell.status, cell.detail = "failed", str(exc)
        step(f"{label}: {cell.status}", True)
    return ran, failed


def _eval_config(cfg: SweepConfig, cell: Cell, gpqa_password: str | None) -> EvalConfig:
    """The `kvcal eval` of one cell."""
    ec = EvalConfig(
        model=cfg.model,
        kv_format=cell.kv_format,
        tasks=[cell.task],
        output=str(cell.path),
        scales=str(cell.calibration.path)
        if cell.calibration
        else (FIRST_BATCH if cell.scales_label == FIRST_BATCH else None),
        skip_layers=None if cell.skip == "none" else cell.skip,
        include_path=cfg.include_path,
        limit=cfg.limit_for(cell.task),
        num_fewshot=cfg.num_fewshot,
        data_dir=cfg.data_dir,
        gpqa_password=gpqa_password,
        impl=cfg.impl,
        dtype=cfg.dtype,
        device=cfg.device,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        max_gen_toks=cfg.max_gen_toks,
        kv_input_dtype=cfg.kv_input_dtype,
    )
    for name in ("kl_seq_len", "prefill_chunk", "kl_subsample", "passkey_lengths", "passkey_depths"):
        if getattr(cfg, name) is not None:  # unset: kvcal eval's own default
            setattr(ec, name, getattr(cfg, name))
    return ec
