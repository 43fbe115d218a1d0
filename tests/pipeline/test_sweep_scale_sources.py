"""A sweep compares uncalibrated / first-batch / calibrated cells, quantizes bf16 K/V by default, and never takes
a run made before `--kv-input-dtype` (K/V quantized as computed) for one of its cells."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvcal.pipeline import sweep
from kvcal.rundir import COMPLETE, CONFIG, RunConfig

CFG = {
    "model": "/models/m",
    "tasks": ["kl"],
    "formats": ["fp8", "nvfp4_4over6", "mxfp4"],
    "scales": ["uncalibrated", "first_batch", "tensor"],
}


def _record(cell: sweep.Cell, cfg: sweep.SweepConfig, **fields: object) -> None:
    cal = cell.calibration
    rc = RunConfig(
        model=cfg.model, model_dir="/x", kv_format=cell.kv_format, tasks=[cell.task],
        scales_path=str(cal.path) if cal else None, scales={"granularity": cal.granularity} if cal else None,
        limit=cfg.limit_for(cell.task), impl=cfg.impl, dtype=cfg.dtype, device=cfg.device,
        batch_size=cfg.batch_size, seed=cfg.seed, kl_seq_len=256 if cell.task == "kl" else None, **fields,
    )  # fmt: skip
    cell.path.mkdir(parents=True, exist_ok=True)
    (cell.path / CONFIG).write_text(yaml.safe_dump(rc.to_dict()))
    (cell.path / COMPLETE).write_text("{}")


def test_first_batch_cells_and_their_eval(tmp_path: Path) -> None:
    cfg = sweep.parse_sweep_config(CFG)
    assert cfg.scales == ["uncalibrated", "first-batch", "tensor"] and cfg.kv_input_dtype == "bfloat16"
    plan = sweep.plan_sweep(cfg, tmp_path)
    labels = {(c.kv_format, c.scales_label) for c in plan.cells}
    assert ("fp8_e4m3", "first-batch") in labels and ("nvfp4_4over6", "first-batch") in labels
    assert ("mxfp4", "dynamic") in labels and ("mxfp4", "first-batch") not in labels  # nothing static to set
    fb = next(c for c in plan.cells if c.scales_label == "first-batch" and c.kv_format == "fp8_e4m3")
    assert fb.name == "m__fp8_e4m3__first-batch__skip-none"
    ec = fb.spec
    assert ec.scales.first_batch and ec.kv_input_dtype == "bfloat16"
    assert plan.cells[0].spec.scales.kind == "none"  # the baseline


def test_recorded_scale_source_and_input_dtype_decide_a_match(tmp_path: Path) -> None:
    cfg = sweep.parse_sweep_config(CFG)
    plan = sweep.plan_sweep(cfg, tmp_path)
    fb = next(c for c in plan.cells if c.scales_label == "first-batch" and c.kv_format == "fp8_e4m3")
    unc = next(c for c in plan.cells if c.scales_label == "uncalibrated" and c.kv_format == "fp8_e4m3")
    mx = next(c for c in plan.cells if c.kv_format == "mxfp4")
    base = next(c for c in plan.cells if c.is_baseline)
    _record(fb, cfg, scale_source="first-batch", kv_input_dtype="bfloat16")
    _record(unc, cfg, scale_source="first-batch", kv_input_dtype="bfloat16")  # another configuration there
    _record(mx, cfg)  # kvcal before --kv-input-dtype: K/V quantized as computed (float32)
    _record(base, cfg)  # bf16 baseline: the input dtype cannot change its numbers
    states = {c.name: c for c in sweep.plan_sweep(cfg, tmp_path).cells}
    assert states[fb.name].status == "complete" and states[base.name].status == "complete"
    assert states[unc.name].status == "stale" and "scale source" in states[unc.name].detail
    assert states[mx.name].status == "stale"
    assert "kv_input_dtype: 'float32' there, 'bfloat16' here" in states[mx.name].detail
