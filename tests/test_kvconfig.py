"""One key for a KV configuration (kvcal.kvconfig): what a sweep cell says it will run is what the report reads
back from the run's config.yaml, and a release drops a candidate that repeats another configuration."""

from __future__ import annotations

from pathlib import Path

from kvcal.kvconfig import KVConfig
from kvcal.pipeline import sweep
from kvcal.rundir import RunConfig

CFG = {
    "model": "/models/m",
    "tasks": ["kl"],
    "formats": ["bf16", "fp8", "nvfp4", "nvfp4_4over6", "mxfp4", "k=fp8_e4m3,v=nvfp4"],
    "scales": ["uncalibrated", "first_batch", "tensor", "head"],
    "skip_layers": ["none", "sliding_window"],
}


def _recorded(cell: sweep.Cell) -> RunConfig:
    """The config.yaml the cell's run writes, as far as the spec decides it (bind adds the scale file's record)."""
    fields = {k: v for k, v in cell.spec.recorded_fields().items() if v is not None}
    if cell.calibration is not None:
        fields["scales"] = {"granularity": cell.calibration.granularity}
    return RunConfig(model_dir="/x", **fields)


def test_a_sweep_cells_key_is_what_its_run_records(tmp_path: Path) -> None:
    plan = sweep.plan_sweep(sweep.parse_sweep_config(CFG), tmp_path)
    keys = {c.key for c in plan.cells}
    assert KVConfig("fp8_e4m3", "calib-head", "sliding_window") in keys
    assert KVConfig("mxfp4", "dynamic", "none") in keys and KVConfig("bf16") in keys
    for cell in plan.cells:
        assert KVConfig.of_run(_recorded(cell)) == cell.key, cell.name


def test_a_plan_run_is_its_label_beside_its_format() -> None:
    rc = RunConfig(model="m", model_dir="m", kv_format="nvfp4", tasks=["kl"], skip_layers="0,5",
                   plan={"label": "plan@3.0x"}, nvfp4_global="one")  # fmt: skip
    key = KVConfig.of_run(rc)
    assert key == KVConfig("nvfp4", "uncalibrated", "0,5", "plan@3.0x")
    assert key.format_shown == "plan@3.0x (nvfp4)"
    assert key.without_plan() == KVConfig("nvfp4", "uncalibrated", "0,5")
