"""`kvcal sweep`: one model, a matrix of KV formats x scale variants x skip-layer choices x tasks, resumable.

    cfg = load_sweep_config("configs/sweep-gemma3-270m-cpu.yaml")
    plan = plan_sweep(cfg, "runs/")          # what is complete, what would run (touches nothing)
    execute_sweep(cfg, "runs/", plan=plan, progress=callback)

Layout of RUNS_DIR:
    scales/<recipe>__<format>__<granularity>.safetensors     calibrated once per recipe x format x granularity
    <task>/<model>__<format>__<scales_tag>__skip-<skip_tag>/  one `kvcal eval` run directory per cell
    sweep.yaml, sweep.json                                     the config as run, and the plan with each status
    sweep.shard-<I>-of-<N>.json                                what `--shard I/N` ran (one file per shard)
    report.md                                                  `kvcal sweep --report-only`: the comparison
    .locks/                                                    one lock file per cell and scale file

One run directory per (configuration, task) so that adding a task or a format later runs only the new cells;
`kvcal compare RUNS_DIR` groups the directories of one configuration back together. A cell is complete when
its run directory has COMPLETE and its config.yaml (kvcal.rundir.RunConfig, docs/run-directory.md) matches the
sweep's settings; an interrupted cell resumes (run_eval skips its finished tasks); a directory holding another
configuration is never overwritten.

Scale-out (`--shard I/N`, `execute_sweep(..., shard=(I, N))`): cell k of the matrix (in plan order) belongs to
shard k mod N + 1, so N processes (a Slurm array, a Kubernetes indexed Job) run disjoint slices. Any number of
processes may share one RUNS_DIR: a process runs a cell only while it holds the cell's lock (flock on
.locks/<task>/<cell>.lock, released by the kernel when the holder dies) and only after re-reading the cell's state
under that lock, so no cell runs twice and a killed process's cell is taken over by the next process that reaches
it (it resumes: run_eval skips the cell's finished tasks). A scale file needed by several slices is calibrated once:
its lock is waited for, then the file is re-checked. `kvcal sweep --report-only` writes report.md once every cell
is complete.

Scale variants only where meaningful: uncalibrated / calibrated per tensor / per head for the calibratable
formats (fp8_e4m3, fp8_e5m2, nvfp4); every other format runs once with its dynamic scales. The BF16 baseline
runs once per task, without skipped layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.run import run_eval
from kvcal.evaluate.spec import (
    FIRST_BATCH,
    EvalConfig,
    EvalSpec,
    base_dir_name,
    eval_spec,
    run_dir_name,
)
from kvcal.filecache import sha256_file
from kvcal.formats import get_format, kv_pair, parse_kv_format
from kvcal.io import atomic_write_json, atomic_write_text, file_lock
from kvcal.kvconfig import KVConfig
from kvcal.models.loading import load_model
from kvcal.models.resolve import resolve_model
from kvcal.pipeline.settings import (
    EvalSettings,
    Recipe,
    as_list,
    eval_options,
    read_fields,
    read_path,
    read_recipes,
    read_tasks,
    read_text,
    read_tokens,
    yaml_field,
    yaml_key,
    yaml_words,
)
from kvcal.rundir import COMPLETE, CONFIG, RunConfig
from kvcal.scales import load_scale_file

# uncalibrated = the engine's default (fp8 1.0, nvfp4 global 1.0); first-batch = vLLM's calculate_kv_scales (amax
# of the first batch / 200 for K, / 100 for V, fixed afterwards); tensor / head = calibrated here
SCALE_VARIANTS = ("uncalibrated", "first-batch", "tensor", "head")

ProgressCallback = Callable[[dict[str, Any]], None]
Step = Callable[
    [str, bool], None
]  # step(message, advance): one progress event; advance counts a unit as done


def _formats(value: Any, key: str, base: Path | None) -> list[str]:
    formats: list[str] = []
    for f in as_list(value, key):
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
    scales = [str(s).lower() for s in as_list(value, key)]
    scales = [_SCALE_ALIASES.get(s, s) for s in scales]
    bad = [s for s in scales if s not in SCALE_VARIANTS]
    if bad or not scales:
        raise UsageError(
            f"sweep config: scales must be a list of {', '.join(SCALE_VARIANTS)}; got {bad or 'nothing'}"
        )
    return scales


def _plans(value: Any, key: str, base: Path | None) -> list[str]:
    """Plan files (`kvcal plan -o`): each read now, one quantized format plus 16-bit layers (what kvcal eval
    runs), no two with the same label and format (they would share a run directory)."""
    from kvcal.planfile import load_plan, one_format_plus_16_bit

    out: list[str] = []
    names: dict[tuple[str, str], str] = {}
    for item in as_list(value, key):
        path = read_path(item, key, base)
        if path is None or path in out:
            continue
        try:
            plan = load_plan(path)
            fmt, _skip = one_format_plus_16_bit(plan)
        except UsageError as exc:
            raise UsageError(f"sweep config: plans: {exc}") from None
        if (plan.label, fmt) in names:
            raise UsageError(
                f"sweep config: plans '{names[plan.label, fmt]}' and '{path}' are both {plan.label} in {fmt}; "
                "keep one (or re-plan one at another budget)"
            )
        names[plan.label, fmt] = path
        out.append(path)
    return out


def _skips(value: Any, key: str, base: Path | None) -> list[str]:
    skips: list[str] = []
    for s in as_list(value, key):
        s = "none" if s in (None, "", False) or str(s).strip().lower() == "none" else str(s).strip()
        if s not in skips:
            skips.append(s)
    return skips


@dataclass
class SweepConfig(EvalSettings):
    model: str = yaml_field(read_text)
    tasks: list[str] = yaml_field(read_tasks)
    formats: list[str] = yaml_field(_formats, factory=list)
    # plan files (`kvcal plan -o`): each a configuration beside the formats, in every scale variant of its format
    plans: list[str] = yaml_field(_plans, factory=list)
    scales: list[str] = yaml_field(_scales, factory=lambda: ["uncalibrated", "tensor"])
    skip_layers: list[str] = yaml_field(_skips, factory=lambda: ["none"])
    baseline: str = yaml_field(read_text, "bf16")
    # tokens of context `kvcal compare RUNS_DIR` assumes for capacity (recorded in sweep.yaml; see recorded_context)
    context: int | None = yaml_field(read_tokens, None)
    recipes: list[Recipe] = yaml_field(read_recipes, factory=lambda: [Recipe()], yaml_key="calibration")

    def limit_for(self, task: str) -> int | None:
        if isinstance(self.limit, dict):
            return self.limit.get(task, self.limit.get("default"))
        return self.limit


def parse_sweep_config(raw: dict[str, Any], base_dir: Path | None = None) -> SweepConfig:
    """Validate a sweep config dict (the YAML). Relative paths are taken relative to `base_dir` when they exist
    there, else to the current folder."""
    if not isinstance(raw, dict):
        raise UsageError("sweep config must be a YAML mapping (see configs/ for examples)")
    required = [yaml_key(f) for f in dataclasses.fields(SweepConfig) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]  # fmt: skip
    kwargs = read_fields(SweepConfig, raw, base_dir, "key")
    for key in required:
        if not raw.get(key):
            raise UsageError(f"sweep config: '{key}' is required (see configs/ for examples)")
    if not raw.get("formats") and not raw.get("plans"):
        raise UsageError("sweep config: 'formats' is required, or 'plans' (plan files); see configs/ for examples")
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
        out[yaml_key(f)] = value
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
    """One (configuration, task) of the matrix: its `kvcal eval` spec (which names its run directory) and its
    status on disk."""

    name: str  # run directory name (the configuration)
    task: str
    kv_format: str
    scales_label: str  # 'none' (baseline), 'uncalibrated', 'dynamic', 'calib-tensor', 'calib-head[-recipe]'
    skip: str  # 'none' or the --skip-layers spec
    path: Path
    calibration: Calibration | None
    is_baseline: bool
    spec: EvalSpec
    status: str = "todo"  # 'complete' | 'partial' (resumes) | 'todo' | 'stale' (another config lives there)
    detail: str = ""
    plan: str | None = None  # the plan file this cell evaluates (its format and 16-bit layers: kv_format, skip)

    @property
    def key(self) -> KVConfig:
        """The configuration this cell evaluates (kvcal.kvconfig)."""
        return KVConfig(self.kv_format, self.scales_label, self.skip, self.plan)

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
            "plan": self.plan,
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


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N) -> (I, N); UsageError naming the problem otherwise."""
    head, sep, tail = str(text).strip().partition("/")
    try:
        i, n = int(head), int(tail)
    except ValueError:
        i = n = 0
    if not sep or n < 1:
        raise UsageError(f"--shard {text}: give I/N with N >= 1 slices, e.g. --shard 1/4 (slice 1 of 4)")
    if not 1 <= i <= n:
        raise UsageError(
            f"--shard {text}: slice {i} does not exist in {n} slices; I runs from 1 to N (e.g. --shard 1/{n} ... "
            f"--shard {n}/{n})"
        )
    return i, n


def shard_plan(plan: SweepPlan, shard: tuple[int, int]) -> SweepPlan:
    """Slice I of N: cell k of the plan (its order is the config's, the same in every process) when k mod N is
    I - 1, with the scale files those cells need."""
    i, n = shard
    cells = [c for k, c in enumerate(plan.cells) if k % n == i - 1]
    needed = {id(c.calibration) for c in cells if c.calibration is not None}
    return SweepPlan(plan.runs_dir, cells, [c for c in plan.calibrations if id(c) in needed])


def lock_path(root: Path, what: Cell | Calibration) -> Path:
    """The lock file of one cell (.locks/<task>/<cell>.lock) or scale file (.locks/scales/<file>.lock)."""
    if isinstance(what, Cell):
        return root / ".locks" / what.task / f"{what.name}.lock"
    return root / ".locks" / "scales" / f"{what.path.name}.lock"


def summary_name(shard: tuple[int, int] | None) -> str:
    return "sweep.json" if shard is None else f"sweep.shard-{shard[0]}-of-{shard[1]}.json"


def plan_sweep(cfg: SweepConfig, runs_dir: str | os.PathLike[str]) -> SweepPlan:
    """The whole matrix with the status of every cell and scale file, from what is on disk (touches nothing)."""
    root = Path(runs_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(f"-o {root} is a file; pass a directory for the sweep's runs")
    check_plans(cfg)
    calibrations: dict[tuple[str, str, str], Calibration] = {}
    cells: list[Cell] = []
    for conf, gran, recipe, baseline in _configurations(cfg):
        cal = None
        if gran is not None and recipe is not None:
            key = (recipe.name, conf.kv_format, gran)
            if key not in calibrations:
                calibrations[key] = _calibration(root, recipe, conf.kv_format, gran)
            cal = calibrations[key]
        try:
            cells.extend(task_cells(cfg, root, conf.kv_format, conf.scales, conf.skip, cal, baseline, conf.plan))
        except UsageError as exc:  # kvcal eval's refusal of a setting, in the sweep YAML's words
            raise UsageError(f"sweep config: {yaml_words(str(exc), None)}") from None
    return SweepPlan(root, cells, list(calibrations.values()))


def check_plans(cfg: SweepConfig) -> None:
    """Every plan file was solved on the sweep's checkpoint (KvcalError naming what changed), before any work."""
    if not cfg.plans:
        return
    from kvcal.planfile import load_plan_for_model
    from kvcal.scales import resolve_model_and_spec

    model_dir, kv = resolve_model_and_spec(cfg.model)
    for path in cfg.plans:
        load_plan_for_model(path, cfg.model, model_dir, kv)


def cell_spec(
    cfg: EvalSettings, model: str, task: str, fmt: str, label: str, skip: str, cal: Calibration | None,
    plan: str | None = None,
) -> EvalSpec:  # fmt: skip
    """The `kvcal eval` spec of one cell, by kvcal eval's own builder: the settings' options by name, the
    configuration's format (or plan file: `kvcal eval -f plan.json`), scale source and skip layers. A calibrated
    cell is named by its label (its file may not exist yet; the run loads it)."""
    options = EvalConfig(
        model=model,
        kv_format=plan or fmt,
        tasks=[task],
        scales=str(cal.path) if cal else (FIRST_BATCH if label == FIRST_BATCH else None),
        skip_layers=None if skip == "none" or plan else skip,
        **eval_options(cfg, task),
    )
    return eval_spec(options, scales_tag=label if cal else None)


def task_cells(
    cfg: SweepConfig,
    root: Path,
    fmt: str,
    label: str,
    skip: str,
    cal: Calibration | None,
    baseline: bool,
    plan: str | None = None,
) -> list[Cell]:
    """One configuration's cell per task (run directory root/<task>/<the spec's name>), each with its status on
    disk. `plan`: a plan file, whose format is `fmt` and whose 16-bit layers are `skip`."""
    cells = []
    # the baseline is the plain BF16 cache: LMCache's storage tier (prefix_serde) is a cost of the candidates, not
    # of the reference they are compared with (and `auto` takes no serde)
    settings = dataclasses.replace(cfg, prefix_serde=None, prefix_tokens=None) if baseline else cfg
    for task in cfg.tasks:
        spec = cell_spec(settings, cfg.model, task, fmt, label, skip, cal, plan)
        path = _cell_dir(root / task, spec)
        spec = spec.with_output(path)
        cell = Cell(path.name, task, fmt, label, skip, path, cal, baseline, spec, plan=plan)
        cell.status, cell.detail = _cell_state(cell)
        cells.append(cell)
    return cells


def _cell_dir(folder: Path, spec: EvalSpec) -> Path:
    """folder/run_dir_name(spec); a run directory that a sweep before kvcal 0.x named without the
    `__kvin-...` suffix (sweeps named cells without it) is used where it exists and the new name does not."""
    new = folder / run_dir_name(spec)
    legacy = folder / base_dir_name(spec)
    return legacy if not new.exists() and legacy != new and legacy.exists() else new


def _configurations(cfg: SweepConfig) -> Iterator[tuple[KVConfig, str | None, Recipe | None, bool]]:
    """(configuration, granularity and recipe of its calibration, is_baseline) of every configuration: the
    baseline first, without skipped layers; BF16 / auto never skip layers; then every plan file in each scale
    variant of its format (its 16-bit layers are its own, the skip_layers list does not apply)."""
    base_fmt = get_format(cfg.baseline).name
    yield KVConfig(base_fmt), None, None, True
    for fmt in cfg.formats:
        if fmt == base_fmt:
            continue
        skips = ["none"] if fmt in ("auto", "bf16") else cfg.skip_layers
        for label, gran, recipe in _scale_variants(fmt, cfg):
            for skip in skips:
                yield KVConfig(fmt, label, skip), gran, recipe, False
    for path in cfg.plans:
        fmt, skip = _plan_format(path)
        for label, gran, recipe in _scale_variants(fmt, cfg):
            yield KVConfig(fmt, label, skip, path), gran, recipe, False


def _plan_format(path: str) -> tuple[str, str]:
    """(format, 16-bit layers as a --skip-layers value or 'none') of a plan file the config parser accepted."""
    from kvcal.planfile import load_plan, one_format_plus_16_bit

    fmt, skip = one_format_plus_16_bit(load_plan(path))
    return fmt, skip or "none"


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


def _cell_state(cell: Cell) -> tuple[str, str]:
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
    cal = cell.calibration
    sha = sha256_file(cal.path) if cal is not None and cal.path.is_file() else None
    diffs = cell.spec.differences(have, scales_sha256=sha)
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


# ---- execution ----------------------------------------------------------------------------------------------


def execute_sweep(
    cfg: SweepConfig,
    runs_dir: str | os.PathLike[str],
    plan: SweepPlan | None = None,
    progress: ProgressCallback | None = None,
    warn: Callable[[str], None] | None = None,
    gpqa_password: str | None = None,
    shard: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Calibrate what is missing, run the baseline and every incomplete cell, and report what happened.

    `progress(event)` receives {"done", "total", "message"} over the whole matrix (complete cells and existing
    scale files count as done from the start). A failing cell is recorded and the sweep goes on; stale cells
    (another configuration in their directory) are never touched. `shard=(I, N)` runs slice I of N (shard_plan)
    of `plan`, which is the whole matrix's (plan_sweep); a cell another process holds is left to it (`busy`).
    """
    root = Path(runs_dir)
    plan = plan or plan_sweep(cfg, root)
    if shard is not None:
        plan = shard_plan(plan, shard)
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
    made = calibrate_all(cfg, needed, step, warn or (lambda _m: None), root)
    work = run_cells(cfg, plan, made.errors, step, gpqa_password)
    summary = {
        "runs_dir": str(root),
        "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
        "ran": len(work.ran),
        "skipped_complete": skipped + len(work.found_complete),
        "failed": failed + work.failed,
        "calibrated": made.calibrated,
        "ran_cells": work.ran,
        "busy": work.busy,
        "context": cfg.context,
        "plan": plan.to_dict(),
        "engine_commands": engine_commands_of(plan.cells),
    }
    atomic_write_json(root / summary_name(shard), summary)
    return summary


def engine_commands_of(cells: list[Cell]) -> dict[str, dict[str, Any]]:
    """{configuration: {engine: commands}} of the complete cells (kvcal.engines), tasks merged."""
    from kvcal.engines import commands_dict, group_setups, setup_from_run_dir

    named = []
    for cell in cells:
        setup = setup_from_run_dir(cell.path, cell.name) if (cell.path / COMPLETE).is_file() else None
        if setup is not None:
            named.append((cell.name, setup))
    return {label: commands_dict(setup) for label, setup in group_setups(named)}


def _stepper(plan: SweepPlan, progress: ProgressCallback | None) -> Step:
    """step(message, advance): count progress units over the whole matrix and report each event."""
    state = {"done": plan.n_done + sum(c.status == "done" for c in plan.calibrations)}

    def step(message: str, advance: bool) -> None:
        if advance:
            state["done"] += 1
        if progress:
            progress({"done": state["done"], "total": plan.total_steps, "message": message})

    return step


@dataclass
class Calibrated:
    errors: dict[str, str]  # scale file -> error
    calibrated: int  # scale files this process wrote


def calibrate_all(
    cfg: SweepConfig,
    todo: list[Calibration],
    step: Step,
    warn: Callable[[str], None],
    root: Path | None = None,
) -> Calibrated:
    """Write every missing scale file; one model load for all of them (loaded only when one is still missing).
    With `root` (RUNS_DIR) each file is written under its lock and re-checked first: a file another process
    wrote meanwhile is used as is."""
    errors: dict[str, str] = {}
    written = 0
    lm = None
    for cal in todo:
        lock = file_lock(lock_path(root, cal)) if root is not None else contextlib.nullcontext(True)
        with lock:
            if root is not None and _scale_file_ok(cal.path):  # another process calibrated it meanwhile
                cal.status = "done"
                step(f"{cal.name}: calibrated by another process", True)
                continue
            if lm is None:
                lm = _calibration_model(cfg, step)
            if _calibrate_one(cfg, lm, cal, step, warn, errors):
                written += 1
    return Calibrated(errors, written)


def _calibration_model(cfg: SweepConfig, step: Step) -> Any:
    model_dir = resolve_model(cfg.model)
    step(f"loading {cfg.model} for calibration", False)
    return load_model(str(model_dir), dtype=cfg.dtype, device=cfg.device)


def _calibrate_one(
    cfg: SweepConfig,
    lm: Any,
    cal: Calibration,
    step: Step,
    warn: Callable[[str], None],
    errors: dict[str, str],
) -> bool:
    """Write one scale file; True when written, else its error is put in `errors`."""
    from kvcal.calibrate.run import calibrate  # imports transformers: planning (--dry-run) stays without it

    r = cal.recipe
    step(f"calibrating {cal.name}", False)
    ok = False
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
        ok = True
    except KvcalError as exc:
        if os.environ.get("KVCAL_DEBUG"):
            raise
        errors[str(cal.path)] = str(exc)
    step(f"calibrated {cal.name}", True)
    return ok


@dataclass
class CellWork:
    """What run_cells did, by cell label (task/name)."""

    ran: list[str] = dataclasses.field(default_factory=list)
    failed: list[dict[str, str]] = dataclasses.field(default_factory=list)
    busy: list[str] = dataclasses.field(default_factory=list)  # held by another process: left to it
    # completed by another process between the plan and this process taking the cell's lock
    found_complete: list[str] = dataclasses.field(default_factory=list)


def run_cells(
    cfg: SweepConfig, plan: SweepPlan, cal_errors: dict[str, str], step: Step, gpqa_password: str | None
) -> CellWork:
    """Run every cell still to run (the baseline first), each under its lock and only if it is still to run
    when the lock is held."""
    work = CellWork()
    for cell in sorted(plan.todo, key=lambda c: (not c.is_baseline, c.name, c.task)):
        label = f"{cell.task}/{cell.name}"
        if cell.calibration is not None and str(cell.calibration.path) in cal_errors:
            work.failed.append(
                {"cell": label, "error": f"calibration failed: {cal_errors[str(cell.calibration.path)]}"}
            )
            step(f"{label}: skipped (calibration failed)", True)
            continue
        with file_lock(lock_path(plan.runs_dir, cell), blocking=False) as held:
            if not held:
                work.busy.append(label)
                step(f"{label}: running in another process", True)
                continue
            _run_locked(cell, label, step, gpqa_password, work)
    return work


def _run_locked(cell: Cell, label: str, step: Step, gpqa_password: str | None, work: CellWork) -> None:
    """One cell, its lock held: re-read its state (another process may have finished it), then run it."""
    cell.status, cell.detail = _cell_state(cell)
    if cell.status == "complete":
        work.found_complete.append(label)
        step(f"{label}: completed by another process", True)
        return
    if cell.status == "stale":
        work.failed.append({"cell": label, "error": cell.detail})
        step(f"{label}: stale", True)
        return
    step(f"{label}: running", False)
    try:
        spec = dataclasses.replace(cell.spec, gpqa_password=gpqa_password)
        run_eval(spec, progress=lambda m: step(f"{label}: {m}", False))
        cell.status = "complete"
        work.ran.append(label)
    except KvcalError as exc:
        if os.environ.get("KVCAL_DEBUG"):
            raise
        work.failed.append({"cell": label, "error": str(exc)})
        cell.status, cell.detail = "failed", str(exc)
    step(f"{label}: {cell.status}", True)
