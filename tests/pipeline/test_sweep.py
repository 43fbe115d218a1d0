"""kvcal sweep: the matrix (scale variants only where meaningful), resume from what is on disk, and one real
end-to-end sweep on a tiny random Gemma 3 (sliding layers) built here -> kvcal compare on its RUNS_DIR."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvcal.cli import app
from kvcal.errors import UsageError
from kvcal.pipeline import sweep

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STUDY = {
    "model": "/models/gemma-3-270m",
    "tasks": ["kl", "wikitext"],
    "formats": ["fp8", "nvfp4", "fp4_e2m1", "mxfp4", "int8_per_token_head"],
    "scales": ["uncalibrated", "tensor", "head"],
    "skip_layers": ["none", "sliding_window"],
    "limit": 8,
    "calibration": {"observer": "minmax", "num_samples": 16, "seq_len": 256},
}


def _mark(cell: sweep.Cell, cfg: sweep.SweepConfig, complete: bool = True, **override: object) -> None:
    """Write what `kvcal eval` leaves in a run directory (config.yaml and, when finished, COMPLETE)."""
    cell.path.mkdir(parents=True, exist_ok=True)
    conf = {
        "model": cfg.model,
        "kv_format": cell.kv_format,
        "scales_path": str(cell.calibration.path) if cell.calibration else None,
        "skip_layers": "" if cell.skip == "none" else cell.skip,
        "tasks": [cell.task],
        "limit": cfg.limit,
        "num_fewshot": cfg.num_fewshot,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "impl": cfg.impl,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "kl_seq_len": (cfg.kl_seq_len or 256) if cell.task == "kl" else None,
    }
    if cell.kv_format not in ("auto", "bf16"):  # eval records the K/V input dtype of every quantized format
        conf["kv_input_dtype"] = cfg.kv_input_dtype
    conf.update(override)
    (cell.path / "config.yaml").write_text(yaml.safe_dump(conf))
    if complete:
        (cell.path / "COMPLETE").write_text(json.dumps({"finished": "t", "config_hash": "x"}))


def test_matrix_only_meaningful_variants(tmp_path: Path) -> None:
    cfg = sweep.parse_sweep_config(STUDY)
    assert cfg.formats == ["fp8_e4m3", "nvfp4", "fp4_e2m1", "mxfp4", "int8_per_token_head"]
    plan = sweep.plan_sweep(cfg, tmp_path / "runs")
    names = sorted({c.name for c in plan.cells})
    # baseline 1 + fp8 (uncal, tensor, head) x 2 skips + nvfp4 x 6 + three dynamic formats x 2 skips
    assert len(names) == 1 + 6 + 6 + 2 + 2 + 2
    assert len(plan.cells) == len(names) * 2
    assert "gemma-3-270m__bf16__none__skip-none" in names
    assert "gemma-3-270m__fp8_e4m3__calib-head__skip-sliding_window" in names
    assert "gemma-3-270m__mxfp4__none__skip-sliding_window" in names
    assert not any(
        n.startswith("gemma-3-270m__mxfp4__calib") or "bf16__none__skip-sliding" in n for n in names
    )
    baseline = [c for c in plan.cells if c.is_baseline]
    assert [c.task for c in baseline] == ["kl", "wikitext"] and all(c.kv_format == "bf16" for c in baseline)
    assert sorted(c.path.name for c in plan.calibrations) == [
        "default__fp8_e4m3__head.safetensors",
        "default__fp8_e4m3__tensor.safetensors",
        "default__nvfp4__head.safetensors",
        "default__nvfp4__tensor.safetensors",
    ]
    assert all(c.path.parent == tmp_path / "runs" / "wikitext" for c in plan.cells if c.task == "wikitext")
    assert plan.n_done == 0 and len(plan.todo) == len(plan.cells) and plan.total_steps == 38 + 4
    # two recipes: calibrated variants per recipe, tagged with the recipe name
    two = dict(
        STUDY,
        formats=["fp8"],
        calibration=[{"name": "c4", "num_samples": 8}, {"name": "wiki", "granularity": "tensor"}],
    )
    plan2 = sweep.plan_sweep(sweep.parse_sweep_config(two), tmp_path / "r2")
    labels = sorted({c.scales_label for c in plan2.cells if c.kv_format == "fp8_e4m3"})
    assert labels == ["calib-head-c4", "calib-tensor-c4", "calib-tensor-wiki", "uncalibrated"]


def test_resume_status_from_disk(tmp_path: Path) -> None:
    cfg = sweep.parse_sweep_config(STUDY)
    root = tmp_path / "runs"
    plan = sweep.plan_sweep(cfg, root)
    by = {(c.name, c.task): c for c in plan.cells}
    done = [c for c in plan.cells if c.kv_format in ("bf16", "mxfp4")]
    for c in done:
        _mark(c, cfg)
    fp8_tensor = [c for c in plan.cells if c.scales_label == "calib-tensor" and c.kv_format == "fp8_e4m3"]
    for c in fp8_tensor:
        _mark(c, cfg)
    partial = by[("gemma-3-270m__fp4_e2m1__none__skip-none", "kl")]
    _mark(partial, cfg, complete=False)
    stale = by[("gemma-3-270m__fp4_e2m1__none__skip-none", "wikitext")]
    _mark(stale, cfg, limit=100)
    replan = sweep.plan_sweep(cfg, root)
    status = {(c.name, c.task): c.status for c in replan.cells}
    assert all(status[(c.name, c.task)] == "complete" for c in done + fp8_tensor)
    assert status[(partial.name, "kl")] == "partial"
    assert status[(stale.name, "wikitext")] == "stale"
    st = next(c for c in replan.cells if c.status == "stale")
    assert "limit: 100 there, 8 here" in st.detail
    assert replan.n_done == len(done) + len(fp8_tensor)
    assert (
        len(replan.todo) == len(replan.cells) - replan.n_done - 1
    )  # the partial one resumes; stale never runs
    # the fp8 per-tensor scale file is no longer needed: all its cells are complete
    assert sorted(c.path.name for c in replan.calibrations_todo) == [
        "default__fp8_e4m3__head.safetensors",
        "default__nvfp4__head.safetensors",
        "default__nvfp4__tensor.safetensors",
    ]
    # a per-task limit: only the wikitext cells change
    per_task = sweep.plan_sweep(sweep.parse_sweep_config(dict(STUDY, limit={"kl": 8, "wikitext": 2})), root)
    assert {
        c.status for c in per_task.cells if c.task == "wikitext" and c.name in {d.name for d in done}
    } == {"stale"}
    assert all(c.status == "complete" for c in per_task.cells if c.task == "kl" and c.kv_format == "mxfp4")
    # a grown matrix (one more task) runs only the new cells
    grown = sweep.plan_sweep(sweep.parse_sweep_config(dict(STUDY, tasks=["kl", "wikitext", "gsm8k"])), root)
    assert grown.n_done == replan.n_done
    assert all(c.status == "todo" for c in grown.cells if c.task == "gsm8k")


def test_bad_sweep_configs(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown key"):
        sweep.parse_sweep_config(dict(STUDY, formatz=["fp8"]))
    with pytest.raises(UsageError, match="'formats' is required"):
        sweep.parse_sweep_config({k: v for k, v in STUDY.items() if k != "formats"})
    with pytest.raises(UsageError):
        sweep.parse_sweep_config(dict(STUDY, formats=["fp7"]))
    with pytest.raises(UsageError, match="scales must be"):
        sweep.parse_sweep_config(dict(STUDY, scales=["per_channel"]))
    with pytest.raises(UsageError, match="limit"):
        sweep.parse_sweep_config(dict(STUDY, limit=0))
    with pytest.raises(UsageError, match="limit"):
        sweep.parse_sweep_config(dict(STUDY, limit={"kl": -1}))
    assert (
        sweep.parse_sweep_config(dict(STUDY, limit={"gpqa_diamond": 5})).limit_for("gpqa_diamond_zeroshot")
        == 5
    )
    with pytest.raises(UsageError, match="does not exist"):
        sweep.load_sweep_config(tmp_path / "nope.yaml")


def test_shipped_configs_parse() -> None:
    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("sweep*.yaml"))
    assert len(configs) >= 2
    for p in configs:
        cfg = sweep.load_sweep_config(p)
        assert cfg.formats and cfg.tasks


def test_cli_dry_run_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "s.yaml"
    conf.write_text(yaml.safe_dump(STUDY))
    with pytest.raises(SystemExit) as exc:
        app(["sweep", str(conf), "-o", str(tmp_path / "runs"), "--dry-run", "--json"], prog_name="kvcal")
    assert exc.value.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["summary"] == {
        "cells": 38,
        "complete": 0,
        "to_run": 38,
        "stale": 0,
        "scale_files": 4,
        "to_calibrate": 4,
    }
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


# ---- a real sweep on a tiny random model ---------------------------------------------------------------------

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "a quick brown fox jumps over the lazy dog near the river bank",
    "paris is the capital of france and rome is the capital of italy",
]


@pytest.mark.slow
def test_real_sweep_resume_and_compare(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tiny_lm_dir: Callable[..., Path],
    lm_eval_task: Callable[..., None],
) -> None:
    pytest.importorskip("kvcal.calibrate.run")
    # A tiny Gemma 3 (sliding layers) with large K/V (k_proj x 8), so that uncalibrated FP8 (scale 1.0) and FP4
    # measurably differ; copied to a folder named "model", the name the run labels below carry.
    model = tmp_path / "model"
    shutil.copytree(tiny_lm_dir("gemma3", CORPUS, vocab_size=300, k_gain=8.0), model)
    tasks = tmp_path / "tasks"
    lm_eval_task(
        tasks, "tiny_roll", "loglikelihood_rolling", [{"text": t} for t in CORPUS],
        ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    )  # fmt: skip
    conf = {
        "model": str(model),
        "tasks": ["tiny_roll"],
        "include_path": str(tasks),
        "formats": ["fp8_e4m3"],
        "scales": ["tensor"],
        "skip_layers": ["none"],
        "calibration": {"num_samples": 4, "seq_len": 32},
        "max_gen_toks": 7,
    }
    runs = tmp_path / "runs"
    events: list[dict] = []
    res = sweep.execute_sweep(sweep.parse_sweep_config(conf), runs, progress=events.append)
    assert res["failed"] == [], res["failed"]
    assert res["ran"] == 2 and res["calibrated"] == 1
    assert events[-1]["done"] == events[-1]["total"] == 3
    assert (runs / "scales" / "default__fp8_e4m3__tensor.safetensors").is_file()
    run_cfg = yaml.safe_load(
        (runs / "tiny_roll" / "model__fp8_e4m3__calib-tensor__skip-none" / "config.yaml").read_text()
    )
    assert run_cfg["max_gen_toks"] == 7  # the sweep passes generation caps through to every run
    # the matrix grows (skip the sliding layers too): only the new cells run, the scale file is reused
    conf["skip_layers"] = ["none", "sliding_window"]
    cfg = sweep.parse_sweep_config(conf)
    plan = sweep.plan_sweep(cfg, runs)
    assert plan.n_done == 2 and len(plan.todo) == 1 and plan.calibrations_todo == []
    res = sweep.execute_sweep(cfg, runs, plan=plan)
    assert res["failed"] == [] and res["ran"] == 1 and res["skipped_complete"] == 2 and res["calibrated"] == 0
    assert (runs / "tiny_roll" / "model__fp8_e4m3__calib-tensor__skip-sliding_window" / "COMPLETE").is_file()
    assert sweep.plan_sweep(cfg, runs).todo == []
    # compare the sweep's RUNS_DIR directly
    from kvcal.report.compare import compare_runs

    cmp = compare_runs([runs], n_boot=200)
    assert cmp.baseline == "model__bf16__none__skip-none"
    assert len(cmp.configs) == 3
    wp = {r.config: r for r in cmp.results if r.metric == "word_perplexity"}
    assert len(wp) == 2
    assert all(r.n == len(CORPUS) for r in wp.values())
    caps = {c.label: c.capacity for c in cmp.configs}
    assert caps["model__fp8_e4m3__calib-tensor__skip-none"] == pytest.approx(2.0)
    # skipping the 2 sliding layers of 3 (equal size) keeps them at 16 bits: 3 / (2 + 8/16)
    assert caps["model__fp8_e4m3__calib-tensor__skip-sliding_window"] == pytest.approx(1.2)
    assert wp["model__fp8_e4m3__calib-tensor__skip-none"].diff != 0.0  # FP8 changes the model's outputs
