"""The sweep YAML is read through one declaration (the dataclass fields) and written back from it; cells are matched
against run directories through kvcal.rundir.RunConfig, the format `kvcal eval` writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from kvcal.errors import UsageError
from kvcal.filecache import sha256_file
from kvcal.pipeline import sweep
from kvcal.rundir import COMPLETE, CONFIG, RunConfig

STUDY = {
    "model": "/models/gemma-3-270m",
    "tasks": ["kl", "wikitext"],
    "formats": ["fp8", "nvfp4", "mxfp4"],
    "scales": ["uncalibrated", "per_tensor", "head"],
    "skip_layers": ["none", "sliding_window"],
    "limit": {"kl": 8, "default": 4},
    "num_fewshot": 0,
    "kl_seq_len": 128,
    "max_gen_toks": 64,
    "calibration": [
        {"name": "C4 slice", "num_samples": 16, "seq_len": 256, "granularity": "tensor"},
        {"observer": "mse", "observer_params": {"grid": 8}},
    ],
}


def test_config_round_trips_through_sweep_yaml(tmp_path: Path) -> None:
    cfg = sweep.parse_sweep_config(STUDY)
    assert [r.name for r in cfg.recipes] == ["c4-slice", "recipe2"]
    assert cfg.recipes[0].granularity == ("tensor",) and cfg.recipes[1].observer_params == {"grid": 8}
    assert cfg.scales == ["uncalibrated", "tensor", "head"] and cfg.limit_for("wikitext") == 4
    written = tmp_path / "sweep.yaml"
    written.write_text(yaml.safe_dump(sweep.config_dict(cfg), sort_keys=False))
    assert sweep.load_sweep_config(written) == cfg
    # every field is one YAML key (the recipes are `calibration`), written in the declaration's order
    names = [f.metadata.get("yaml") or f.name for f in dataclasses.fields(sweep.SweepConfig)]
    assert list(sweep.config_dict(cfg)) == names and names[-1] == "calibration"
    with pytest.raises(
        UsageError, match=r"unknown key\(s\) calibrations; valid: baseline, batch_size, calibration"
    ):
        sweep.parse_sweep_config(dict(STUDY, calibrations=[]))
    with pytest.raises(UsageError, match=r"unknown calibration key\(s\) samples; valid: dataset, engine"):
        sweep.parse_sweep_config(dict(STUDY, calibration={"samples": 3}))


def test_defaults_and_nulls() -> None:
    cfg = sweep.parse_sweep_config(
        {"model": "m", "tasks": "kl,wikitext", "formats": "fp8", "skip_layers": None}
    )
    assert cfg.tasks == ["kl", "wikitext"] and cfg.formats == ["fp8_e4m3"]
    assert cfg.skip_layers == ["none"] and cfg.scales == ["uncalibrated", "tensor"]
    assert cfg.recipes == [sweep.Recipe()] and cfg.dtype == "float32" and cfg.batch_size == 1


def test_bad_values_name_the_key() -> None:
    with pytest.raises(UsageError, match="'batch_size' must be an integer, got 'two'"):
        sweep.parse_sweep_config(dict(STUDY, batch_size="two"))
    with pytest.raises(UsageError, match="'num_samples' must be an integer, got True"):
        sweep.parse_sweep_config(dict(STUDY, calibration={"num_samples": True}))
    with pytest.raises(UsageError, match="unknown dtype 'fp64'"):
        sweep.parse_sweep_config(dict(STUDY, dtype="fp64"))
    with pytest.raises(UsageError, match="recipe names must be unique"):
        sweep.parse_sweep_config(dict(STUDY, calibration=[{"name": "a"}, {"name": "A"}]))
    with pytest.raises(UsageError, match="'model' is required"):
        sweep.parse_sweep_config({k: v for k, v in STUDY.items() if k != "model"})


def _written_by_eval(cell: sweep.Cell, cfg: sweep.SweepConfig, **override: object) -> None:
    """What `kvcal eval` records for this cell (kvcal.rundir.RunConfig), then COMPLETE."""
    cal = cell.calibration
    rc = RunConfig(
        model=cfg.model, model_dir="/cache/models/x", kv_format=cell.kv_format, tasks=[cell.task],
        scales_path=str(cal.path) if cal else None,
        scales={"sha256": sha256_file(cal.path), "granularity": cal.granularity} if cal else None,
        skip_layers="" if cell.skip == "none" else cell.skip, limit=cfg.limit_for(cell.task),
        num_fewshot=cfg.num_fewshot, impl=cfg.impl, dtype=cfg.dtype, device=cfg.device,
        batch_size=cfg.batch_size, seed=cfg.seed, kl_seq_len=cfg.kl_seq_len,
        kv_input_dtype=None if cell.kv_format in ("auto", "bf16") else cfg.kv_input_dtype,
        scale_source="first-batch" if cell.scales_label == "first-batch" else None,
    )  # fmt: skip
    for key, value in override.items():
        setattr(rc, key, value)
    cell.path.mkdir(parents=True, exist_ok=True)
    (cell.path / CONFIG).write_text(yaml.safe_dump(rc.to_dict()))
    (cell.path / COMPLETE).write_text("{}")


def test_cells_match_what_eval_records(tmp_path: Path) -> None:
    cfg = sweep.parse_sweep_config(dict(STUDY, dtype="bf16", calibration={"num_samples": 4}))
    assert cfg.dtype == "bfloat16"  # the name `kvcal eval` records, so an alias still resumes
    root = tmp_path / "runs"
    plan = sweep.plan_sweep(cfg, root)
    for cal in plan.calibrations:
        cal.path.parent.mkdir(parents=True, exist_ok=True)
        cal.path.write_bytes(cal.name.encode())  # any bytes: only their sha256 is compared
    for cell in plan.cells:
        _written_by_eval(cell, cfg)
    assert sweep.plan_sweep(cfg, root).n_done == len(plan.cells)

    fp8_tensor = next(c for c in plan.cells if c.scales_label == "calib-tensor" and c.kv_format == "fp8_e4m3")
    fp8_tensor.calibration.path.write_bytes(b"recalibrated")
    mxfp4 = next(c for c in plan.cells if c.kv_format == "mxfp4" and c.skip == "sliding_window")
    _written_by_eval(mxfp4, cfg, seed=1, impl="triton")
    broken = next(c for c in plan.cells if c.is_baseline)
    (broken.path / CONFIG).write_text("kv_format: bf16\n")  # no model: not a run config
    states = {(c.name, c.task): c for c in sweep.plan_sweep(cfg, root).cells}
    assert (
        "used another version of default__fp8_e4m3__tensor.safetensors"
        in states[(fp8_tensor.name, fp8_tensor.task)].detail
    )
    assert (
        "impl: 'triton' there, 'auto' here; seed: 1 there, 0 here" in states[(mxfp4.name, mxfp4.task)].detail
    )
    assert "does not parse" in states[(broken.name, broken.task)].detail
    # a sweep asking for the checkpoint's own dtype matches whatever it resolved to
    auto = dataclasses.replace(cfg, dtype="auto")
    assert sweep.plan_sweep(auto, root).n_done == sweep.plan_sweep(cfg, root).n_done


def test_long_context_settings_reach_eval_and_decide_a_match(tmp_path: Path) -> None:
    """prefill_chunk and the passkey lengths / depths are sweep (and release `evaluate:`) keys: checked when the YAML
    is read, handed to each cell's `kvcal eval`, and a run made with another window, chunk or passkey grid is not
    taken for a cell."""
    long = {"model": "/models/m", "tasks": ["kl", "passkey_mc"], "formats": ["fp8"], "scales": ["uncalibrated"],
            "kl_seq_len": 4096, "prefill_chunk": 1024, "passkey_lengths": ["1k", "2k"], "passkey_depths": "0,1"}  # fmt: skip
    cfg = sweep.parse_sweep_config(long)
    assert cfg.passkey_lengths == "1k,2k" and cfg.passkey_depths == "0,1" and cfg.prefill_chunk == 1024
    written = tmp_path / "sweep.yaml"
    written.write_text(yaml.safe_dump(sweep.config_dict(cfg), sort_keys=False))
    assert sweep.load_sweep_config(written) == cfg
    plan = sweep.plan_sweep(cfg, tmp_path / "runs")
    kl = next(c for c in plan.cells if c.task == "kl" and not c.is_baseline)
    pk = next(c for c in plan.cells if c.task == "passkey_mc" and not c.is_baseline)
    ec = pk.spec  # the cell's `kvcal eval` spec: the YAML's values, parsed
    assert (ec.kl_seq_len, ec.prefill_chunk, ec.passkey_lengths, ec.passkey_depths) == (4096, 1024, (1024, 2048), (0.0, 1.0))
    _written_by_eval(kl, cfg, prefill_chunk=1024)
    _written_by_eval(pk, cfg, kl_seq_len=None, passkey_lengths=[1024, 2048], passkey_depths=[0.0, 1.0])
    assert sweep.plan_sweep(cfg, tmp_path / "runs").n_done == 2
    _written_by_eval(kl, cfg, prefill_chunk=2048)
    _written_by_eval(pk, cfg, kl_seq_len=None, passkey_lengths=[1024], passkey_depths=[0.0, 1.0])
    states = {c.task: c for c in sweep.plan_sweep(cfg, tmp_path / "runs").cells if not c.is_baseline}
    assert "prefill_chunk: 2048 there, 1024 here" in states["kl"].detail
    assert "passkey_lengths: [1024] there, [1024, 2048] here" in states["passkey_mc"].detail
    with pytest.raises(UsageError, match=r"sweep config: passkey_lengths: '1\.5' is not a whole number of tokens"):
        sweep.parse_sweep_config(dict(long, passkey_lengths="1k,1.5"))
    with pytest.raises(UsageError, match="sweep config: 'prefill_chunk' must be a positive number of tokens"):
        sweep.parse_sweep_config(dict(long, prefill_chunk=0))


def test_kl_subsample_is_a_sweep_key(tmp_path: Path) -> None:
    """kl_subsample: checked when the YAML is read, handed to each cell's `kvcal eval`, and a kl run scored at
    other positions is not taken for a cell."""
    base = {"model": "/models/m", "tasks": ["kl"], "formats": ["fp8"], "scales": ["uncalibrated"],
            "kl_seq_len": 8192, "kl_subsample": 8}  # fmt: skip
    cfg = sweep.parse_sweep_config(base)
    assert cfg.kl_subsample == 8
    written = tmp_path / "sweep.yaml"
    written.write_text(yaml.safe_dump(sweep.config_dict(cfg), sort_keys=False))
    assert sweep.load_sweep_config(written) == cfg
    kl = next(c for c in sweep.plan_sweep(cfg, tmp_path / "runs").cells if c.task == "kl" and not c.is_baseline)
    assert kl.spec.kl_subsample == 8
    _written_by_eval(kl, cfg, prefill_chunk=2048, kl_subsample=8)
    assert sweep.plan_sweep(cfg, tmp_path / "runs").n_done == 1
    _written_by_eval(kl, cfg, prefill_chunk=2048)  # every position scored
    cell = next(c for c in sweep.plan_sweep(cfg, tmp_path / "runs").cells if c.task == "kl" and not c.is_baseline)
    assert "kl_subsample: None there, 8 here" in cell.detail
    with pytest.raises(UsageError, match="sweep config: 'kl_subsample': --kl-subsample must be a power of two"):
        sweep.parse_sweep_config(dict(base, kl_subsample=6))
