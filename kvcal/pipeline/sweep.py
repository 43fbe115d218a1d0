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
its run directory has COMPLETE and its config.yaml matches the sweep's settings; an interrupted cell resumes
(run_eval skips its finished tasks); a directory holding another configuration is never overwritten.

Scale variants only where meaningful: uncalibrated / calibrated per tensor / per head for the calibratable
formats (fp8_e4m3, fp8_e5m2, nvfp4); every other format runs once with its dynamic scales. The BF16 baseline
runs once per task, without skipped layers.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.io import atomic_write_json, atomic_write_text

SCALE_VARIANTS = ("uncalibrated", "tensor", "head")
_TOP_KEYS = {
    "model", "tasks", "formats", "scales", "skip_layers", "calibration", "limit", "num_fewshot", "data_dir",
    "include_path", "dtype", "device", "impl", "batch_size", "seed", "kl_seq_len", "max_gen_toks", "baseline",
}  # fmt: skip
_RECIPE_KEYS = {
    "name", "observer", "granularity", "dataset", "num_samples", "seq_len", "seed", "engine", "observer_params",
    "text_field",
}  # fmt: skip
# config.yaml fields of a run directory that must match the sweep's for a cell to count as done.
_MATCH_FIELDS = ("kv_format", "limit", "num_fewshot", "dtype", "device", "impl", "batch_size", "seed")

ProgressCallback = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Recipe:
    """One calibration recipe (the arguments of kvcal.calibrate.run.calibrate)."""

    name: str = "default"
    observer: str = "minmax"
    granularity: tuple[str, ...] | None = None  # restrict the recipe to these granularities; None = all asked
    dataset: str | None = None  # None = kvcal's built-in generated corpus
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    engine: str = "native"
    observer_params: dict[str, Any] | None = None
    text_field: str | None = None


@dataclass
class SweepConfig:
    model: str
    tasks: list[str]
    formats: list[str]
    scales: list[str] = field(default_factory=lambda: ["uncalibrated", "tensor"])
    skip_layers: list[str] = field(default_factory=lambda: ["none"])
    recipes: list[Recipe] = field(default_factory=lambda: [Recipe()])
    limit: int | dict[str, int] | None = None  # samples per task; a mapping gives each task its own
    num_fewshot: int | None = None
    data_dir: str | None = None
    include_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    impl: str = "auto"
    batch_size: int = 1
    seed: int = 0
    kl_seq_len: int | None = None
    max_gen_toks: int | None = None  # cap on generated tokens (lm-eval's aime25 asks for 32768)
    baseline: str = "bf16"

    def limit_for(self, task: str) -> int | None:
        if isinstance(self.limit, dict):
            return self.limit.get(task, self.limit.get("default"))
        return self.limit


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


# --------------------------------------------------------------------------------------------------------------
# Config


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text)).strip("-").lower() or "x"


def _as_list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()] if key != "skip_layers" else [value]
    if isinstance(value, list):
        return value
    raise UsageError(f"sweep config: '{key}' must be a list, got {type(value).__name__}")


def parse_sweep_config(raw: dict[str, Any], base_dir: Path | None = None) -> SweepConfig:
    """Validate a sweep config dict (the YAML). Relative paths are taken relative to `base_dir` when they exist
    there, else to the current folder."""
    from kvcal.evaluate.tasks import parse_task_list
    from kvcal.formats import get_format

    if not isinstance(raw, dict):
        raise UsageError("sweep config must be a YAML mapping (see configs/ for examples)")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise UsageError(
            f"sweep config: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(_TOP_KEYS))}"
        )
    for key in ("model", "tasks", "formats"):
        if not raw.get(key):
            raise UsageError(f"sweep config: '{key}' is required (see configs/ for examples)")

    def _path(p: Any) -> str | None:
        if p in (None, ""):
            return None
        cand = Path(str(p)).expanduser()
        if not cand.is_absolute() and base_dir is not None and (base_dir / cand).exists():
            return str((base_dir / cand).resolve())
        return str(cand)

    tasks = parse_task_list([str(t) for t in _as_list(raw["tasks"], "tasks")])
    formats: list[str] = []
    for f in _as_list(raw["formats"], "formats"):
        canon = get_format(str(f)).name
        if canon not in formats:
            formats.append(canon)
    scales = [str(s).lower() for s in _as_list(raw.get("scales", ["uncalibrated", "tensor"]), "scales")]
    scales = [
        "tensor" if s in ("per_tensor", "calibrated") else "head" if s == "per_head" else s for s in scales
    ]
    bad = [s for s in scales if s not in SCALE_VARIANTS]
    if bad or not scales:
        raise UsageError(
            f"sweep config: scales must be a list of {', '.join(SCALE_VARIANTS)}; got {bad or 'nothing'}"
        )
    skips: list[str] = []
    for s in _as_list(raw.get("skip_layers", ["none"]), "skip_layers"):
        s = "none" if s in (None, "", False) else str(s).strip()
        if isinstance(s, str) and s.lower() == "none":
            s = "none"
        if s not in skips:
            skips.append(s)
    cal = raw.get("calibration")
    recipes_raw = [cal] if isinstance(cal, dict) else (cal or [{}])
    if not isinstance(recipes_raw, list):
        raise UsageError("sweep config: 'calibration' must be a recipe mapping or a list of them")
    recipes: list[Recipe] = []
    for i, r in enumerate(recipes_raw):
        if not isinstance(r, dict):
            raise UsageError(f"sweep config: calibration recipe {i + 1} must be a mapping")
        unknown = sorted(set(r) - _RECIPE_KEYS)
        if unknown:
            raise UsageError(
                f"sweep config: unknown calibration key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_RECIPE_KEYS))}"
            )
        gran = r.get("granularity")
        gran_t = tuple(str(g) for g in _as_list(gran, "granularity")) if gran else None
        if gran_t and any(g not in ("tensor", "head") for g in gran_t):
            raise UsageError(f"sweep config: recipe granularity must be tensor or head, got {list(gran_t)}")
        name = _slug(r.get("name") or ("default" if len(recipes_raw) == 1 else f"recipe{i + 1}"))
        recipes.append(
            Recipe(
                name=name,
                observer=str(r.get("observer", "minmax")),
                granularity=gran_t,
                dataset=_path(r.get("dataset")),
                num_samples=int(r.get("num_samples", 128)),
                seq_len=int(r.get("seq_len", 512)),
                seed=int(r.get("seed", 0)),
                engine=str(r.get("engine", "native")),
                observer_params=r.get("observer_params"),
                text_field=r.get("text_field"),
            )
        )
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise UsageError(f"sweep config: calibration recipe names must be unique, got {names}")
    limit = raw.get("limit")
    if isinstance(limit, dict):
        limit = {("default" if k == "default" else parse_task_list([str(k)])[0]): v for k, v in limit.items()}
        values = list(limit.values())
    else:
        values = [limit]
    if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0) for v in values):
        raise UsageError(
            f"sweep config: limit must be a positive integer or a mapping task: integer, got {raw.get('limit')!r}"
        )
    return SweepConfig(
        model=str(raw["model"]),
        tasks=tasks,
        formats=formats,
        scales=scales,
        skip_layers=skips,
        recipes=recipes,
        limit=limit,
        num_fewshot=raw.get("num_fewshot"),
        data_dir=_path(raw.get("data_dir")),
        include_path=_path(raw.get("include_path")),
        dtype=str(raw.get("dtype", "float32")),
        device=str(raw.get("device", "cpu")),
        impl=str(raw.get("impl", "auto")),
        batch_size=int(raw.get("batch_size", 1)),
        seed=int(raw.get("seed", 0)),
        kl_seq_len=raw.get("kl_seq_len"),
        max_gen_toks=int(raw["max_gen_toks"]) if raw.get("max_gen_toks") is not None else None,
        baseline=str(raw.get("baseline", "bf16")),
    )


def load_sweep_config(path: str | os.PathLike[str]) -> SweepConfig:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"sweep config {p} does not exist; see configs/ for examples")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"sweep config {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
    return parse_sweep_config(raw, base_dir=p.parent)


# --------------------------------------------------------------------------------------------------------------
# Planning


def _model_short(model: str) -> str:
    try:
        from kvcal.evaluate.run import model_short

        return model_short(model)
    except ImportError:  # pragma: no cover - run.py is part of the package
        return _slug(Path(model.rstrip("/")).name.removesuffix(".gguf"))


def _skip_tag(skip: str) -> str:
    return "none" if skip == "none" else _slug(skip.replace(",", "-"))


def _scale_variants(fmt_name: str, cfg: SweepConfig) -> list[tuple[str, str | None, Recipe | None]]:
    """[(label, granularity, recipe)] for one format: only calibratable formats get scale variants."""
    from kvcal.formats import get_format

    fmt = get_format(fmt_name)
    if fmt.name in ("auto", "bf16"):
        return [("none", None, None)]
    if not fmt.calibratable:
        return [("dynamic", None, None)]
    out: list[tuple[str, str | None, Recipe | None]] = []
    if "uncalibrated" in cfg.scales:
        out.append(("uncalibrated", None, None))
    for gran in ("tensor", "head"):
        if gran not in cfg.scales:
            continue
        for recipe in cfg.recipes:
            if recipe.granularity and gran not in recipe.granularity:
                continue
            label = f"calib-{gran}" if len(cfg.recipes) == 1 else f"calib-{gran}-{recipe.name}"
            out.append((label, gran, recipe))
    return out


def _cell_state(cell: Cell, cfg: SweepConfig) -> tuple[str, str]:
    """('complete'|'partial'|'todo'|'stale', detail) from what is on disk; never modifies anything."""
    d = cell.path
    conf = d / "config.yaml"
    if not d.exists():
        return "todo", ""
    if not conf.is_file():
        if any(p for p in d.iterdir() if not p.name.startswith(".")):
            return "stale", f"{d} exists but holds no run (no config.yaml); move it aside"
        return "todo", ""
    try:
        have = yaml.safe_load(conf.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError):
        return "stale", f"{conf} does not parse; move {d} aside"
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
    diffs = [
        f"{k}: {have.get(k)!r} there, {want[k]!r} here"
        for k in _MATCH_FIELDS
        if k in have and have.get(k) != want[k]
    ]
    if have.get("tasks") not in (None, [cell.task]):
        diffs.append(f"tasks: {have.get('tasks')!r} there, {[cell.task]!r} here")
    skip_have = have.get("skip_layers") or "none"
    if str(skip_have) != cell.skip:
        diffs.append(f"skip_layers: {skip_have!r} there, {cell.skip!r} here")
    if bool(have.get("scales_path")) != (cell.calibration is not None):
        diffs.append(
            "scales: " + ("calibrated there, not here" if have.get("scales_path") else "not calibrated there")
        )
    elif cell.calibration is not None and cell.calibration.path.is_file():
        sha = (have.get("scales") or {}).get("sha256") if isinstance(have.get("scales"), dict) else None
        if sha and sha != _sha256(cell.calibration.path):
            diffs.append(f"scales: {d.name} used another version of {cell.calibration.path.name}")
    if diffs:
        return (
            "stale",
            f"{d} holds another configuration ({'; '.join(diffs[:3])}); use a new RUNS_DIR or move it aside",
        )
    if (d / "COMPLETE").is_file():
        return "complete", ""
    return "partial", "interrupted; resumes"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _scale_file_ok(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        from kvcal.scales import load_scale_file

        load_scale_file(path)
        return True
    except KvcalError:
        return False


def plan_sweep(cfg: SweepConfig, runs_dir: str | os.PathLike[str]) -> SweepPlan:
    """The whole matrix with the status of every cell and scale file, from what is on disk (touches nothing)."""
    root = Path(runs_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(f"-o {root} is a file; pass a directory for the sweep's runs")
    model = _model_short(cfg.model)
    calibrations: dict[tuple[str, str, str], Calibration] = {}
    cells: list[Cell] = []

    def add_cells(
        fmt: str, label: str, gran: str | None, recipe: Recipe | None, skip: str, baseline: bool
    ) -> None:
        cal = None
        if gran is not None and recipe is not None:
            key = (recipe.name, fmt, gran)
            if key not in calibrations:
                path = root / "scales" / f"{recipe.name}__{fmt}__{gran}.safetensors"
                calibrations[key] = Calibration(
                    recipe, fmt, gran, path, "done" if _scale_file_ok(path) else "todo"
                )
            cal = calibrations[key]
        # the directory name scheme of kvcal eval (run_dir_name): uncalibrated and dynamic are both 'none'
        tag = label if label.startswith("calib-") else "none"
        name = f"{model}__{fmt}__{tag}__skip-{_skip_tag(skip)}"
        for task in cfg.tasks:
            cell = Cell(name, task, fmt, label, skip, root / task / name, cal, baseline)
            cell.status, cell.detail = _cell_state(cell, cfg)
            cells.append(cell)

    from kvcal.formats import get_format

    base_fmt = get_format(cfg.baseline).name
    add_cells(base_fmt, "none", None, None, "none", True)
    for fmt in cfg.formats:
        if fmt == base_fmt:
            continue
        skips = ["none"] if fmt in ("auto", "bf16") else cfg.skip_layers
        for label, gran, recipe in _scale_variants(fmt, cfg):
            for skip in skips:
                add_cells(fmt, label, gran, recipe, skip, False)
    return SweepPlan(root, cells, list(calibrations.values()))


# --------------------------------------------------------------------------------------------------------------
# Execution


def _calibrate_all(
    cfg: SweepConfig,
    todo: list[Calibration],
    step: Callable[[str, bool], None],
    warn: Callable[[str], None],
) -> dict[str, str]:
    """Write every missing scale file; one model load for all of them. Returns {scale file: error}."""
    if not todo:
        return {}
    from kvcal.calibrate.run import calibrate
    from kvcal.evaluate.adapter import resolve_pretrained
    from kvcal.models import load_model

    _, model_dir = resolve_pretrained(cfg.model)
    step(f"loading {cfg.model} for calibration", False)
    lm = load_model(str(model_dir), dtype=cfg.dtype, device=cfg.device)
    errors: dict[str, str] = {}
    for cal in todo:
        r = cal.recipe
        step(f"calibrating {cal.name}", False)
        try:
            res = calibrate(
                lm,
                cal.kv_format,
                granularity=cal.granularity,
                observer=r.observer,
                dataset=r.dataset,
                num_samples=r.num_samples,
                seq_len=r.seq_len,
                seed=r.seed,
                engine=r.engine,
                output=cal.path,
                observer_params=r.observer_params,
                text_field=r.text_field,
                dtype=cfg.dtype,
                device=cfg.device,
            )
            for w in getattr(res, "warnings", []) or []:
                warn(f"{cal.name}: {w}")
            cal.status = "done"
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                raise
            errors[str(cal.path)] = str(exc)
        step(f"calibrated {cal.name}", True)
    return errors


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
    from kvcal.evaluate.run import EvalConfig, run_eval

    root = Path(runs_dir)
    plan = plan or plan_sweep(cfg, root)
    say_warn = warn or (lambda _m: None)
    total = plan.total_steps
    done = plan.n_done + sum(c.status == "done" for c in plan.calibrations)
    state = {"done": done}

    def step(message: str, advance: bool) -> None:
        if advance:
            state["done"] += 1
        if progress:
            progress({"done": state["done"], "total": total, "message": message})

    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "sweep.yaml", yaml.safe_dump(_config_dict(cfg), sort_keys=False))
    step(f"{plan.n_done} of {len(plan.cells)} cells complete", False)

    failed: list[dict[str, str]] = []
    for cell in plan.stale:
        failed.append({"cell": f"{cell.task}/{cell.name}", "error": cell.detail})
    needed = plan.calibrations_todo
    unused = [c for c in plan.calibrations if c.status == "todo" and c not in needed]
    for c in unused:  # scale files whose cells are all complete or stale: nothing to do, count them as done
        step(f"{c.name}: not needed", True)
    cal_errors = _calibrate_all(cfg, needed, step, say_warn)

    ran = skipped = 0
    order = sorted(plan.cells, key=lambda c: (not c.is_baseline, c.name, c.task))
    for cell in order:
        if cell.status in ("complete", "stale"):
            if cell.status == "complete":
                skipped += 1
            continue
        label = f"{cell.task}/{cell.name}"
        if cell.calibration is not None and str(cell.calibration.path) in cal_errors:
            failed.append(
                {"cell": label, "error": f"calibration failed: {cal_errors[str(cell.calibration.path)]}"}
            )
            step(f"{label}: skipped (calibration failed)", True)
            continue
        step(f"{label}: running", False)
        ec = EvalConfig(
            model=cfg.model,
            kv_format=cell.kv_format,
            tasks=[cell.task],
            output=str(cell.path),
            scales=str(cell.calibration.path) if cell.calibration else None,
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
        )
        if cfg.kl_seq_len is not None:
            ec.kl_seq_len = int(cfg.kl_seq_len)
        ec.max_gen_toks = cfg.max_gen_toks
        try:
            run_eval(ec, progress=lambda m, _l=label: step(f"{_l}: {m}", False))
            cell.status = "complete"
            ran += 1
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                raise
            failed.append({"cell": label, "error": str(exc)})
            cell.status, cell.detail = "failed", str(exc)
        step(f"{label}: {cell.status}", True)

    summary = {
        "runs_dir": str(root),
        "ran": ran,
        "skipped_complete": skipped,
        "failed": failed,
        "calibrated": sum(1 for c in needed if c.status == "done"),
        "plan": plan.to_dict(),
    }
    atomic_write_json(root / "sweep.json", summary)
    return summary


def _config_dict(cfg: SweepConfig) -> dict[str, Any]:
    d: dict[str, Any] = {
        k: getattr(cfg, k)
        for k in ("model", "tasks", "formats", "scales", "skip_layers", "limit", "num_fewshot", "data_dir",
                  "include_path", "dtype", "device", "impl", "batch_size", "seed", "kl_seq_len", "max_gen_toks", "baseline")
    }  # fmt: skip
    d["calibration"] = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in r.__dict__.items() if v is not None}
        for r in cfg.recipes
    ]
    return d
