"""`kvcal release MODEL --config release.yaml -o OUT`: the one command a pipeline runs on every model update.

    cfg = load_release_config("configs/release-smollm2.yaml")   # kvcal.pipeline.release_config (the YAML schema)
    record = run_release("smollm2", cfg, "OUT", progress=print)
    record["decision"], record["exit_code"]                       # "ship" 0 | "fail" 1

Steps, each reusing what OUT already holds (so a rerun with nothing changed runs no forward pass):
1. scales — verify `scales:` (the file in service) against MODEL's checkpoint (kvcal.scales binding). Bound: it is
   the candidate. Stale, another format, or none configured: calibrate with `calibration:` (the sweep's
   calibration step) into OUT/scales/<model>__<format>__<granularity>__<checkpoint>-<recipe>.safetensors. A file
   of that name that loads and is bound to the checkpoint is reused, never recomputed.
2. drift — when `drift:` is configured, `kvcal drift` (kvcal.calibrate.drift.check_drift) of the candidate scales
   on the traffic sample; its report is kept in OUT/drift/<key>.json (key: checkpoint, scale file, traffic file
   contents, settings) and reused. Policy: `on_drift: recalibrate` (default) calibrates again on the TRAFFIC sample
   (calibration's observer, sample count and length; its own dataset and text field) and ships those scales;
   `on_drift: fail` stops: decision fail, exit 1, nothing evaluated or exported.
3. plans — each `evaluate.candidates` entry `{plan: {capacity: 3.0x, ...}}`: `kvcal plan` (kvcal.pipeline.plan) with
   candidates bf16 and its format, on the release's scale file when the candidate is calibrated, written to
   OUT/plans/<model>__plan-<budget>-<format>__<key>.plan.json (key: checkpoint, recipe, scale file, settings); a
   file of that name bound to the checkpoint is reused, never re-solved. `{plan: FILE}` is checked and used as is.
   evaluate — BF16, the shipped configuration and every `evaluate.candidates` entry on every task, one run
   directory per (configuration, task) through the sweep's cells and kvcal eval's run store under
   OUT/runs/<checkpoint>-<settings>/ (calibrated cells under scales-<scale file>/): complete cells are skipped,
   interrupted ones resume.
4. gate — kvcal compare's statistics (kvcal.report.compare.compare_runs) with `gate:`'s per-metric policy and mode
   (non-inferiority by default: each configuration shown within its threshold; unjudged ones fail); every
   evaluated configuration must pass.
5. export — on a pass, for each of `export.engines`: vLLM checkpoint folder OUT/exports/vllm-<scale file>/,
   SGLang JSON OUT/exports/sglang-<scale file>-tp<N>.json (earlier exports there are replaced), and the exact
   serving flags.
6. OUT/release.md, then OUT/release.json (written last, atomically, each replacing the previous release's only
   when complete: a release that fails or is refused leaves the last decision byte for byte). Every input is
   checked before any work and before OUT is created (check_out, check_evaluations, check_tasks, the traffic
   sample, the scale file in service, the checkpoint's fit). Exit 0 ship, 1 gate or drift policy failed, 2 usage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcal import __version__
from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import sha256_file
from kvcal.formats import check_head_dims, get_format
from kvcal.io import atomic_write_json, atomic_write_text
from kvcal.kvconfig import KVConfig
from kvcal.models.geometry import KVSpec, parse_skip_layers
from kvcal.pipeline import sweep
from kvcal.pipeline.release_config import PlanCandidate, ReleaseConfig, sweep_config

RELEASE_JSON = "release.json"
RELEASE_MD = "release.md"
RELEASE_FORMAT = 1
Say = Callable[[str], None]


@dataclass
class Work:
    """What this release computed and what it reused from OUT."""

    calibrations_run: int = 0
    calibrations_reused: int = 0
    drift_checks_run: int = 0
    drift_checks_reused: int = 0
    evaluations_run: int = 0
    evaluations_reused: int = 0
    exports_written: int = 0
    exports_reused: int = 0
    plans_solved: int = 0
    plans_reused: int = 0

    @property
    def reused_everything(self) -> bool:
        return not (
            self.calibrations_run or self.drift_checks_run or self.evaluations_run or self.exports_written
            or self.plans_solved
        )


@dataclass
class Scales:
    """The scale file the release ships and why."""

    path: Path
    sha256: str
    recalibrated: bool
    reason: str
    verify: dict[str, Any] | None  # the configured file's check against the checkpoint; None: none configured
    reasons: list[str] = field(default_factory=list)


@dataclass
class Context:
    """Everything the steps share."""

    model: str
    cfg: ReleaseConfig
    out: Path
    model_dir: Path
    kv: KVSpec
    model_sha256: str
    scfg: sweep.SweepConfig
    work: Work
    say: Say
    warn: Say
    gpqa_password: str | None


# ---- inputs ----------------------------------------------------------------------------------------------------


def check_out(out: Path) -> None:
    """OUT must be a folder we can write in, checked without creating anything: an existing folder is probed with
    a file that is removed again; a missing one needs its nearest existing parent to be a writable folder. OUT is
    created only once every input has been accepted (run_release)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o '{out}' is a file; pass a folder for the release")
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"cannot write to -o '{out}' ('{parent}' is a file); pass a writable folder")
    try:
        probe = parent / f".kvcal-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"cannot write to -o '{out}' ({exc.strerror or exc}); pass a writable folder"
        ) from None


def _content_sha(path: Path) -> str:
    """sha256 of a file, or of a folder's files (names and contents)."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{sha256_file(f)}\n".encode())
    return h.hexdigest()


def check_traffic(cfg: ReleaseConfig) -> str | None:
    """The traffic sample's content hash after reading it once (empty / unreadable / missing: UsageError)."""
    if cfg.drift is None:
        return None
    from kvcal.calibrate.drift import load_traffic

    path = Path(cfg.drift.dataset)
    if not path.exists():
        raise UsageError(
            f"drift.dataset '{path}' does not exist; point it at a local sample of the traffic "
            "(.jsonl/.json/.txt/.parquet file or a folder of them)"
        )
    try:
        load_traffic(path)
        return _content_sha(path)
    except UsageError as exc:
        raise UsageError(f"drift.dataset: {exc}") from None
    except (KvcalError, OSError) as exc:
        raise UsageError(f"drift.dataset: {exc}") from None


def _check_model_fit(cfg: ReleaseConfig, kv: KVSpec) -> None:
    """What the checkpoint bounds, before any work: sequence lengths, skip-layer specs, block formats' head_dim."""
    heads = [layer.head_dim for layer in kv.layers]
    for i, fmt in enumerate([cfg.ship.kv_format] + [c.kv_format for c in cfg.evaluate.candidates]):
        try:
            check_head_dims(get_format(fmt), heads)
        except UsageError as exc:
            raise UsageError(
                f"{'ship' if i == 0 else f'evaluate.candidates[{i}]'}.kv_format: {exc}"
            ) from None
    limit = kv.max_position_embeddings
    lengths = {"calibration.seq_len": cfg.calibration.seq_len}
    if cfg.drift is not None:
        lengths["drift.seq_len"] = cfg.drift.seq_len
    for key, n in lengths.items():
        if limit and n > limit:
            raise UsageError(f"{key} {n} is longer than the model's {limit} positions; use {limit} or less")
    _check_plan_budgets(cfg, kv)
    for key, spec in [("ship.skip_layers", cfg.ship.skip_layers)] + [
        (f"evaluate.candidates[{i + 1}].skip_layers", c.skip_layers)
        for i, c in enumerate(cfg.evaluate.candidates)
    ]:
        try:
            parse_skip_layers(spec, kv)
        except UsageError as exc:
            raise UsageError(f"{key}: {exc}") from None


def _check_plan_budgets(cfg: ReleaseConfig, kv: KVSpec) -> None:
    """A plan recipe's budget that bf16 and its format cannot reach on this model, before any work."""
    from kvcal.pipeline.plan_cost import check_reachable, parse_budget

    for i, c in enumerate(cfg.evaluate.candidates):
        if isinstance(c, PlanCandidate) and c.recipe is not None:
            r = c.recipe
            try:
                check_reachable(kv, ["bf16", c.kv_format], parse_budget(r.capacity, r.effective_bits, r.context))
            except UsageError as exc:
                raise UsageError(f"evaluate.candidates[{i + 1}].plan: {str(exc).replace('--', '')}") from None


def model_sha256(binding: dict[str, Any]) -> str:
    """The checkpoint's identity: sha256 over the hashes of config.json, the tokenizer files and the weight files
    (the scale-file binding's, from kvcal's hash cache: no weights are re-read while they are unchanged)."""
    parts = {k: binding.get(k) for k in ("config_sha256", "tokenizer_sha256", "weights_sha256")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _key(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


# ---- 1. scales -------------------------------------------------------------------------------------------------


def _bound_file(ctx: Context, path: Path) -> list[str] | None:
    """Binding differences of a scale file against the checkpoint; None when it does not load."""
    from kvcal.scales import binding_differences, load_scale_file

    try:
        ss = load_scale_file(path)
    except KvcalError:
        return None
    return binding_differences(ss, ctx.model, ctx.model_dir, ctx.kv)


def calibrated_scales(ctx: Context, recipe: sweep.Recipe) -> tuple[Path, bool]:
    """(the scale file of `recipe` on this checkpoint in OUT/scales, whether this run calibrated it): reused when
    it is there and bound, else calibrated (the sweep's calibration step: one model load)."""
    from kvcal.evaluate.spec import model_short

    ship, e = ctx.cfg.ship, ctx.cfg.evaluate
    key = _key(dataclasses.asdict(recipe), ship.kv_format, ship.granularity, e.dtype, e.device)
    if recipe.dataset:
        key = _key(key, _content_sha(Path(recipe.dataset))) if Path(recipe.dataset).exists() else key
    name = f"{model_short(ctx.model)}__{ship.kv_format}__{ship.granularity}__{ctx.model_sha256[:12]}-{key}"
    path = ctx.out / "scales" / f"{name}.safetensors"
    if path.is_file() and _bound_file(ctx, path) == []:
        ctx.work.calibrations_reused += 1
        ctx.say(f"scales: {path.name} already calibrated on this checkpoint, reused")
        return path, False
    cal = sweep.Calibration(recipe, ship.kv_format, ship.granularity, path, "todo")
    errors = sweep.calibrate_all(ctx.scfg, [cal], lambda m, _a: ctx.say(m), ctx.warn).errors
    if errors:
        raise KvcalError(f"calibration of {path.name} failed: {errors[str(path)]}")
    ctx.work.calibrations_run += 1
    return path, True


def _calibration_reason(why: str, path: Path, ran: bool, done: str = "recalibrated") -> str:
    """`WHY: recalibrated` when this run calibrated; when an earlier release in OUT did, it says so (the record's
    `recalibrated` is false then: nothing was calibrated)."""
    return f"{why}: {done}" if ran else f"{why}: calibrated by an earlier release ({path.name}), reused"


def decide_scales(ctx: Context) -> Scales:
    """Step 1: the configured scale file when it is bound to this checkpoint and holds the shipped format, else a
    calibration (reason: none configured / another format / stale: what changed)."""
    from kvcal.scales import binding_differences, load_scale_file

    ship, configured = ctx.cfg.ship, ctx.cfg.scales
    verify: dict[str, Any] | None = None
    if configured is None:
        reason = "no scale file configured (scales:)"
    else:
        ss = load_scale_file(configured)
        verify = {"scales": configured, "sha256": sha256_file(configured), "kv_format": ss.kv_format,
                  "granularity": ss.granularity, "bound": None, "differences": []}  # fmt: skip
        if (ss.kv_format, ss.granularity) != (ship.kv_format, ship.granularity):
            reason = (
                f"the configured scale file holds {ss.kv_format} per-{ss.granularity} scales; the release ships "
                f"{ship.kv_format} per-{ship.granularity}"
            )
        else:
            diffs = binding_differences(ss, ctx.model, ctx.model_dir, ctx.kv)
            verify.update(bound=not diffs, differences=diffs)
            if not diffs:
                ctx.say(f"scales: {configured} is bound to this checkpoint")
                return Scales(Path(configured), verify["sha256"], False, "bound to this checkpoint", verify)
            reason = f"stale: {'; '.join(diffs)}"
    ctx.say(f"scales: {reason}")
    path, ran = calibrated_scales(ctx, ctx.cfg.calibration)
    reason = _calibration_reason(reason, path, ran)
    return Scales(path, sha256_file(path), ran, reason, verify, [reason])


# ---- 2. drift --------------------------------------------------------------------------------------------------


def drift_report(ctx: Context, scales: Scales, traffic_sha: str) -> dict[str, Any]:
    """`kvcal drift` of `scales` on the traffic sample, or its stored report when the same check ran before."""
    d, e = ctx.cfg.drift, ctx.cfg.evaluate
    assert d is not None
    settings = {k: v for k, v in dataclasses.asdict(d).items() if k not in ("dataset", "on_drift")}
    memo = ctx.out / "drift" / f"{_key(ctx.model_sha256, scales.sha256, traffic_sha, settings, e.dtype)}.json"
    if memo.is_file():
        try:
            stored = json.loads(memo.read_text(encoding="utf-8"))
            if isinstance(stored, dict) and stored.get("verdict") in ("fits", "drifted"):
                ctx.work.drift_checks_reused += 1
                ctx.say(f"drift: {stored['verdict']} (stored check {memo.name}, reused)")
                return stored
        except (OSError, json.JSONDecodeError):
            pass  # redone below
    from kvcal.calibrate.drift import check_drift

    thresholds = {k: getattr(d, k) for k in ("max_clip", "max_sqnr_loss_db") if getattr(d, k) is not None}
    ctx.say(f"drift: checking {scales.path.name} on {d.dataset}")
    rep = check_drift(
        str(scales.path), ctx.model, dataset=d.dataset, num_samples=d.num_samples, seq_len=d.seq_len, seed=d.seed,
        dtype=e.dtype, device=e.device, text_field=d.text_field, **thresholds,
    )  # fmt: skip
    stored = {"verdict": rep.verdict, "reasons": list(rep.reasons), "traffic_sha256": traffic_sha,
              "scales_sha256": scales.sha256, "report": rep.to_dict()}  # fmt: skip
    atomic_write_json(memo, stored)
    ctx.work.drift_checks_run += 1
    for w in rep.warnings:
        ctx.warn(f"drift: {w}")
    ctx.say(f"drift: {rep.verdict}")
    return stored


def apply_drift(
    ctx: Context, scales: Scales, traffic_sha: str | None
) -> tuple[Scales, dict[str, Any] | None]:
    """Step 2: (the scales to ship, the drift record or None). Drifted + on_drift recalibrate: calibrated again
    on the traffic sample; drifted + fail: the record says so and the caller stops."""
    d = ctx.cfg.drift
    if d is None or traffic_sha is None:
        return scales, None
    stored = drift_report(ctx, scales, traffic_sha)
    record = {
        "verdict": stored["verdict"], "reasons": stored["reasons"], "traffic": d.dataset,
        "traffic_sha256": traffic_sha, "checked_scales_sha256": scales.sha256, "on_drift": d.on_drift,
        "worst": stored["report"].get("worst"),
    }  # fmt: skip
    if stored["verdict"] != "drifted" or d.on_drift == "fail":
        return scales, record
    recipe = dataclasses.replace(ctx.cfg.calibration, dataset=d.dataset, text_field=d.text_field)
    path, ran = calibrated_scales(ctx, recipe)
    drifted = f"drifted on {Path(d.dataset).name}: {'; '.join(stored['reasons'][:3])}"
    why = _calibration_reason(drifted, path, ran, "recalibrated on the traffic")
    reason = f"{scales.reason}; then {why}" if scales.reasons else why
    recalibrated = ran or scales.recalibrated
    return Scales(
        path, sha256_file(path), recalibrated, reason, scales.verify, [*scales.reasons, why]
    ), record


# ---- 3. evaluate -----------------------------------------------------------------------------------------------


@dataclass
class Configuration:
    role: str  # 'baseline' | 'ship' | 'candidate'
    kv_format: str
    label: str  # sweep scales label: none | calib-<granularity> | uncalibrated | dynamic
    skip: str
    calibrated: bool
    plan: str | None = None  # a plan candidate's file (its 16-bit layers are `skip`)

    @property
    def key(self) -> KVConfig:
        """The configuration it evaluates (a candidate that repeats another's is dropped)."""
        return KVConfig(self.kv_format, self.label, self.skip, self.plan)


def _calibrated(cfg: ReleaseConfig, fmt: str, scales: str | None) -> bool:
    """A candidate takes the release's scale file when it stores the shipped format and is not `uncalibrated`."""
    return fmt == cfg.ship.kv_format and scales != "uncalibrated"


def configurations(cfg: ReleaseConfig, plans: dict[int, Path] | None = None) -> list[Configuration]:
    """BF16, the shipped configuration, then each candidate (duplicates dropped); `plans`: the plan file of each
    plan candidate, by its index in evaluate.candidates (step 3)."""
    from kvcal.planfile import load_plan, one_format_plus_16_bit

    ship = cfg.ship
    out = [
        Configuration("baseline", "bf16", "none", "none", False),
        Configuration("ship", ship.kv_format, f"calib-{ship.granularity}", ship.skip_layers, True),
    ]
    for i, c in enumerate(cfg.evaluate.candidates):
        plan = None if plans is None or not isinstance(c, PlanCandidate) else plans[i]
        if isinstance(c, PlanCandidate) and plan is None:
            continue  # not solved yet
        fmt, skip = get_format(c.kv_format), c.skip_layers
        if plan is not None:
            skip = one_format_plus_16_bit(load_plan(plan))[1] or "none"
        calibrated = _calibrated(cfg, c.kv_format, c.scales)
        if fmt.name in ("auto", "bf16"):
            label = "none"
        elif calibrated:
            label = f"calib-{ship.granularity}"
        else:
            label = "uncalibrated" if fmt.calibratable else "dynamic"
        conf = Configuration("candidate", fmt.name, label, skip, calibrated, None if plan is None else str(plan))
        if all(x.key != conf.key for x in out):
            out.append(conf)
    return out


def plan_cells(
    ctx: Context, scales: Scales, plans: dict[int, Path] | None = None
) -> tuple[sweep.SweepPlan, dict[str, str]]:
    """The sweep plan of every (configuration, task) cell with its status on disk, and run-dir name -> role.
    Runs are keyed by checkpoint and evaluation settings; calibrated ones also by the scale file."""
    e = ctx.cfg.evaluate
    settings = {k: v for k, v in dataclasses.asdict(e).items() if k not in ("tasks", "candidates")}
    root = ctx.out / "runs" / f"{ctx.model_sha256[:12]}-{_key(settings)}"
    ship = ctx.cfg.ship
    cal = sweep.Calibration(ctx.cfg.calibration, ship.kv_format, ship.granularity, scales.path, "done")
    cells: list[sweep.Cell] = []
    roles: dict[str, str] = {}
    for conf in configurations(ctx.cfg, plans):
        base = root / f"scales-{scales.sha256[:12]}" if conf.calibrated else root
        key = conf.key
        mine = sweep.task_cells(ctx.scfg, base, key.kv_format, key.scales, key.skip,
                                cal if conf.calibrated else None, conf.role == "baseline", key.plan)  # fmt: skip
        roles.update({c.name: conf.role for c in mine})
        cells += mine
    return sweep.SweepPlan(root, cells, [cal]), roles


# ---- 3. plans --------------------------------------------------------------------------------------------------


def _plan_path(ctx: Context, c: PlanCandidate, scales: Scales | None) -> Path:
    """OUT/plans/<model>__plan-<budget>-<format>__<key>.plan.json: key over checkpoint, recipe, scale file and
    the evaluation settings the plan is measured in."""
    from kvcal.evaluate.spec import model_short, slug
    from kvcal.pipeline.plan_cost import parse_budget
    from kvcal.planfile import plan_label

    r, e = c.recipe, ctx.cfg.evaluate
    assert r is not None and r.format is not None
    key = _key(ctx.model_sha256, dataclasses.asdict(r), scales.sha256 if scales else None, e.dtype, e.device,
               e.data_dir, _content_sha(Path(r.dataset)) if r.dataset and Path(r.dataset).exists() else None)  # fmt: skip
    label = plan_label({"budget": parse_budget(r.capacity, r.effective_bits, r.context).to_dict()})
    fmt = slug(r.format) if "=" in r.format else r.format
    return ctx.out / "plans" / f"{model_short(ctx.model)}__{slug(label)}-{fmt}__{key}.plan.json"


def _bound_plan(ctx: Context, path: Path) -> bool:
    from kvcal.planfile import load_plan_for_model

    try:
        load_plan_for_model(path, ctx.model, ctx.model_dir, ctx.kv)
    except KvcalError:
        return False
    return True


def solve_plan(ctx: Context, c: PlanCandidate, scales: Scales) -> tuple[Path, bool]:
    """(the plan file of a plan candidate, whether this run solved it): a bound file of its name is reused."""
    from kvcal.pipeline.plan import PlanConfig, plan_spec, run_plan

    if c.file is not None:
        from kvcal.planfile import load_plan_for_model

        load_plan_for_model(c.file, ctx.model, ctx.model_dir, ctx.kv)  # refused on another checkpoint
        return Path(c.file), False
    r, e = c.recipe, ctx.cfg.evaluate
    assert r is not None and r.format is not None
    calibrated = _calibrated(ctx.cfg, r.format, c.scales)
    path = _plan_path(ctx, c, scales if calibrated else None)
    if path.is_file() and _bound_plan(ctx, path):
        ctx.work.plans_reused += 1
        ctx.say(f"plan: {path.name} already solved on this checkpoint, reused")
        return path, False
    ctx.say(f"plan: solving {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    config = PlanConfig(
        ctx.model, ["bf16", r.format], capacity=r.capacity, effective_bits=r.effective_bits, context=r.context,
        scales=[str(scales.path)] if calibrated else [], dataset=r.dataset, num_samples=r.num_samples,
        seq_len=r.seq_len, seed=r.seed, heldout_windows=r.heldout_windows, heldout_seq_len=r.heldout_seq_len,
        data_dir=e.data_dir, output=str(path), text_field=r.text_field, dtype=e.dtype, device=e.device,
        batch_size=r.batch_size,
    )  # fmt: skip
    report = run_plan(plan_spec(config))
    for w in report["warnings"]:
        ctx.warn(f"plan: {w}")
    ctx.work.plans_solved += 1
    return path, True


def solve_plans(ctx: Context, scales: Scales) -> tuple[dict[int, Path], list[dict[str, Any]]]:
    """Step 3: the plan file of every plan candidate (by index in evaluate.candidates) and release.json's
    record of each (label, file, format, layers, capacity, estimated and measured KL, whether solved now)."""
    from kvcal.planfile import load_plan

    files: dict[int, Path] = {}
    records: list[dict[str, Any]] = []
    for i, c in enumerate(ctx.cfg.evaluate.candidates):
        if not isinstance(c, PlanCandidate):
            continue
        path, solved = solve_plan(ctx, c, scales)
        files[i] = path
        p = load_plan(path)
        records.append({
            "candidate": i + 1, "label": p.label, "plan_file": str(path), "sha256": sha256_file(path),
            "kv_format": c.kv_format, "layers": p.layers, "budget": p.record.get("budget"),
            "capacity": p.record.get("capacity"), "estimated_kl": p.record.get("estimated_kl"),
            "measured_kl": (p.record.get("measured") or {}).get("kl"), "solved": solved,
        })  # fmt: skip
    return files, records


def check_tasks(model: str, cfg: ReleaseConfig, gpqa_password: str | None) -> None:
    """Everything kvcal eval checks without a model (tasks, data files), once per task, before any work."""
    from kvcal.evaluate.spec import EvalConfig, eval_spec

    e = cfg.evaluate
    for task in e.tasks:
        options = EvalConfig(model=model, kv_format="bf16", tasks=[task], include_path=e.include_path,
                             data_dir=e.data_dir, gpqa_password=gpqa_password, impl=e.impl, dtype="auto",
                             device=e.device, limit=sweep_config(model, cfg).limit_for(task))  # fmt: skip
        eval_spec(options).task_plan()


def check_evaluations(model: str, cfg: ReleaseConfig) -> None:
    """Every evaluation the release will run, built now by kvcal eval's spec builder (the sweep's cell_spec) for
    each configuration and task, before any work: a setting kvcal eval would refuse (evaluate.batch_size 0, an
    impl or device this machine lacks, a prefix serde without prefix tokens ...) is a UsageError naming the YAML
    key, not the command-line option. Plan recipes are checked as their format with 16-bit layers to come."""
    from kvcal.pipeline.settings import yaml_words

    e, ship = cfg.evaluate, cfg.ship
    scfg = sweep_config(model, cfg)
    cal = sweep.Calibration(cfg.calibration, ship.kv_format, ship.granularity, Path("scales.safetensors"), "todo")
    # (YAML place, format, calibrated, skip layers, baseline, plan file)
    checks: list[tuple[str, str, bool, str, bool, str | None]] = [
        ("evaluate", "bf16", False, "none", True, None),
        ("ship", ship.kv_format, True, ship.skip_layers, False, None),
    ]
    for i, c in enumerate(e.candidates):
        where = f"evaluate.candidates[{i + 1}]"
        fmt = get_format(c.kv_format).name
        calibrated = _calibrated(cfg, fmt, c.scales) and fmt not in ("auto", "bf16")
        plan = c.file if isinstance(c, PlanCandidate) else None
        checks.append((where, fmt, calibrated, "none" if plan else c.skip_layers, False, plan))
    for task in e.tasks:
        for where, fmt, calibrated, skip, baseline, plan in checks:
            settings = dataclasses.replace(scfg, prefix_serde=None, prefix_tokens=None) if baseline else scfg
            label = f"calib-{ship.granularity}" if calibrated else "none"
            try:
                sweep.cell_spec(settings, model, task, fmt, label, skip, cal if calibrated else None, plan)
            except UsageError as exc:
                msg = yaml_words(str(exc), "evaluate", where)
                raise UsageError(msg if msg.startswith(("evaluate", "ship")) else f"{where}: {msg}") from None


def evaluate(
    ctx: Context, scales: Scales, plans: dict[int, Path] | None = None
) -> tuple[list[sweep.Cell], dict[str, str]]:
    """Step 3: run every cell that is not complete (interrupted ones resume); KvcalError when one fails."""
    plan, roles = plan_cells(ctx, scales, plans)
    if plan.stale:
        raise KvcalError(f"{plan.stale[0].detail}")
    ctx.work.evaluations_reused += plan.n_done
    ctx.say(f"evaluate: {plan.n_done} of {len(plan.cells)} runs complete, {len(plan.todo)} to run")
    work = sweep.run_cells(ctx.scfg, plan, {}, lambda m, _a: ctx.say(m), ctx.gpqa_password)
    ctx.work.evaluations_run += len(work.ran)
    ctx.work.evaluations_reused += len(work.found_complete)
    if work.failed:
        raise KvcalError(f"evaluation {work.failed[0]['cell']} failed: {work.failed[0]['error']}")
    if work.busy:
        raise KvcalError(
            f"evaluation {work.busy[0]} is running in another process on {ctx.out}; rerun when it has finished"
        )
    return plan.cells, roles


# ---- 4. gate ---------------------------------------------------------------------------------------------------


def gate(ctx: Context, cells: list[sweep.Cell]) -> Any:
    """Step 4: kvcal compare over the release's runs (a Comparison)."""
    from kvcal.report.compare import compare_runs

    g = ctx.cfg.gate
    return compare_runs(
        [c.path for c in cells], baseline="bf16", max_drop=g.max_drop, alpha=g.alpha, n_boot=g.bootstrap,
        seed=g.seed, min_samples=g.min_samples, warn=ctx.warn, context=g.context, gate=g.mode,
        allow_unjudged=g.allow_unjudged, max_length_change=g.max_length_change,
    )  # fmt: skip


def configuration_records(cmp: Any, roles: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for c in cmp.configs:
        out.append({
            "label": c.label, "role": roles.get(c.label, "candidate"), "kv_format": c.kv_format,
            "scales": c.scales, "skip_layers": c.skip, "gate": cmp.config_gate(c.label),
            "verdict": "baseline" if c.label == cmp.baseline else cmp.config_verdict(c.label),
            "capacity_vs_bf16": c.capacity, "plan": c.runs[0].config.plan,
        })  # fmt: skip
    return out


# ---- 5. export -------------------------------------------------------------------------------------------------


def _replace_older(folder: Path, prefix: str, keep: Path) -> None:
    """Earlier exports of one engine in OUT/exports: only the current one stays."""
    for p in folder.glob(f"{prefix}*"):
        if p != keep and not p.name.startswith("."):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def serve_flags(ctx: Context, engine: str, path: Path) -> tuple[list[str], str]:
    """(the engine's KV flags, the full serve command) for the shipped configuration."""
    ship = ctx.cfg.ship
    fmt = get_format(ship.kv_format)
    if engine == "vllm":
        flags = ["--kv-cache-dtype", str(fmt.engine_names["vllm"])]
        skip = sorted(parse_skip_layers(ship.skip_layers, ctx.kv))
        if skip:  # vLLM's CacheConfig.kv_cache_dtype_skip_layers: layer indices (or attention type names)
            flags += ["--kv-cache-dtype-skip-layers", *(str(i) for i in skip)]
        return flags, " ".join(["vllm", "serve", str(path), *flags])
    flags = ["--kv-cache-dtype", str(fmt.engine_names["sglang"]), "--quantization-param-path", str(path)]
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(ctx.model_dir), *flags]
    return flags, " ".join(cmd)


def export(ctx: Context, scales: Scales) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, str]]:
    """Step 5: (exports, serve flags, serve commands) per configured engine; an export already there is reused."""
    from kvcal.calibrate.export import PROVENANCE, export_sglang, export_vllm
    from kvcal.scales import load_scales_for_model

    e = ctx.cfg.export
    if not e.engines:
        return {}, {}, {}
    ss = load_scales_for_model(
        scales.path, ctx.model, ctx.model_dir, ctx.kv, kv_format=ctx.cfg.ship.kv_format
    )
    folder = ctx.out / "exports"
    exports: dict[str, Any] = {}
    flags: dict[str, list[str]] = {}
    commands: dict[str, str] = {}
    for engine in e.engines:
        if engine == "vllm":
            path = folder / f"vllm-{scales.sha256[:12]}"
            done = (path / PROVENANCE).is_file()
            if not done:
                export_vllm(ss, ctx.model_dir, path)
            kind = "checkpoint folder"
        else:
            path = folder / f"sglang-{scales.sha256[:12]}-tp{e.tp_size}.json"
            done = path.is_file()
            if not done:
                export_sglang(ss, ctx.model_dir, path, tp_size=e.tp_size, reduce_heads=e.reduce_heads)
            kind = "--quantization-param-path JSON"
        _replace_older(folder, f"{engine}-", path)
        if done:
            ctx.work.exports_reused += 1
        else:
            ctx.work.exports_written += 1
        ctx.say(f"export: {engine} {path} ({'reused' if done else 'written'})")
        exports[engine] = {
            "path": str(path),
            "kind": kind,
            "kv_format": ss.kv_format,
            "granularity": ss.granularity,
        }
        flags[engine], commands[engine] = serve_flags(ctx, engine, path)
    return exports, flags, commands


# ---- the release -----------------------------------------------------------------------------------------------


def _context(model: str, cfg: ReleaseConfig, out: Path, say: Say, warn: Say, gpqa: str | None) -> Context:
    from kvcal.scales import compute_binding, resolve_model_and_spec

    model_dir, kv = resolve_model_and_spec(model)
    _check_model_fit(cfg, kv)
    sha = model_sha256(compute_binding(model, model_dir, kv))
    return Context(model, cfg, out, model_dir, kv, sha, sweep_config(model, cfg), Work(), say, warn, gpqa)


def run_release(
    model: str,
    cfg: ReleaseConfig,
    out: str | os.PathLike[str],
    *,
    progress: Say | None = None,
    warn: Say | None = None,
    gpqa_password: str | None = None,
) -> dict[str, Any]:
    """Run the release (module docstring) and return the record written to OUT/release.json."""
    t0 = time.perf_counter()
    out_dir = Path(out)
    # Every input is checked before any work and before OUT is created: nothing below this block refuses input
    # that could have been refused here, and a refused release leaves OUT as it was (release.json included).
    check_out(out_dir)
    check_evaluations(model, cfg)
    check_tasks(model, cfg, gpqa_password)
    traffic_sha = check_traffic(cfg)
    # A missing or corrupt scale file in service is bad input: refused before any work.
    if cfg.scales is not None:
        from kvcal.scales import load_scale_file

        load_scale_file(cfg.scales)
    ctx = _context(
        model, cfg, out_dir, progress or (lambda _m: None), warn or (lambda _m: None), gpqa_password
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # The previous release.json / release.md stay until this release replaces them (atomically, at the end): a
    # release that fails on the way leaves the last decision as it was.
    timings: dict[str, float] = {}
    t = time.perf_counter()
    scales = decide_scales(ctx)
    timings["scales_s"] = time.perf_counter() - t
    t = time.perf_counter()
    scales, drift = apply_drift(ctx, scales, traffic_sha)
    timings["drift_s"] = time.perf_counter() - t
    record = _record(ctx, scales, drift)
    if drift is not None and drift["verdict"] == "drifted" and cfg.drift and cfg.drift.on_drift == "fail":
        record.update(decision="fail", exit_code=1, gate="not run",
                      failed_because="drift: the traffic drifted and drift.on_drift is fail")  # fmt: skip
        return _finish(ctx, record, None, timings, t0)
    t = time.perf_counter()
    plans, record["plans"] = solve_plans(ctx, scales)
    timings["plans_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cells, roles = evaluate(ctx, scales, plans)
    timings["evaluate_s"] = time.perf_counter() - t
    record["engine_commands"] = sweep.engine_commands_of(cells)  # every configuration's, kvcal.engines
    t = time.perf_counter()
    cmp = gate(ctx, cells)
    passed = cmp.gate_passed
    record.update(
        gate="pass" if passed else "fail", configurations=configuration_records(cmp, roles),
        gate_failures=cmp.to_dict()["gate"]["failures"], runs=[str(c.path) for c in cells],
        capacity_context=cmp.context,
    )  # fmt: skip
    timings["gate_s"] = time.perf_counter() - t
    if passed:
        t = time.perf_counter()
        record["exports"], record["serve_flags"], record["serve_commands"] = export(ctx, scales)
        timings["export_s"] = time.perf_counter() - t
        record.update(decision="ship", exit_code=0)
    else:
        record.update(decision="fail", exit_code=1, failed_because=_gate_failure(cmp))
    return _finish(ctx, record, cmp, timings, t0)


def _gate_failure(cmp: Any) -> str:
    """Why the gate did not pass, in release.json's words."""
    if cmp.failures:
        if cmp.settings.gate == "noninferiority":
            return "gate: a configuration was not shown non-inferior (gate.mode noninferiority)"
        return "gate: a configuration regressed"
    if cmp.length_failures:
        worst = ", ".join(sorted({r.config for r in cmp.length_failures}))
        return f"gate: generated length changed beyond gate.max_length_change ({worst})"
    return (
        f"gate: not judged ({', '.join(cmp.unjudged_configs)}: too few paired samples or no task in common); "
        "raise evaluate.limit or set gate.allow_unjudged"
    )


def _record(ctx: Context, scales: Scales, drift: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "release_format": RELEASE_FORMAT,
        "kvcal_version": __version__,
        "model": ctx.model,
        "model_dir": str(ctx.model_dir),
        "model_sha256": ctx.model_sha256,
        "decision": None,
        "exit_code": None,
        "failed_because": None,
        "scales_path": str(scales.path),
        "scales_sha256": scales.sha256,
        "kv_format": ctx.cfg.ship.kv_format,
        "granularity": ctx.cfg.ship.granularity,
        "skip_layers": ctx.cfg.ship.skip_layers,
        "recalibrated": scales.recalibrated,
        "reason": scales.reason,
        "verify": scales.verify,
        "drift": drift,
        "gate": None,
        "gate_failures": [],
        "configurations": [],
        "exports": {},
        "serve_flags": {},
        "serve_commands": {},
        "engine_commands": {},
        "plans": [],
        "runs": [],
    }


def _finish(
    ctx: Context, record: dict[str, Any], cmp: Any, timings: dict[str, float], t0: float
) -> dict[str, Any]:
    timings["total_s"] = time.perf_counter() - t0
    work = dataclasses.asdict(ctx.work)
    record.update(
        work={**work, "reused_everything": ctx.work.reused_everything},
        timings={k: round(v, 3) for k, v in timings.items()},
        config=ctx.cfg.to_dict(),
        finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    from kvcal.pipeline.release_report import render_release

    atomic_write_text(ctx.out / RELEASE_MD, render_release(record, cmp))
    atomic_write_json(ctx.out / RELEASE_JSON, record)
    return record
