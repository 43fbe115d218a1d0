"""kvcal.evaluate.spec: one spec per evaluation, whoever builds it (kvcal eval, a sweep cell, a release candidate):
equal specs, one run-directory name, one recorded config; a scale file read once per run; differences named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcal.errors import UsageError
from kvcal.evaluate.spec import EvalConfig, eval_spec, run_dir_name
from kvcal.rundir import RunConfig

SETTINGS = {"limit": 2, "kl_seq_len": 16, "seed": 3, "dtype": "float32", "kv_input_dtype": "fp32"}


def _sweep_cell(llama: Path, scale_file: Path, root: Path, fmt: str = "fp8_e4m3", skip: str = "none"):
    from kvcal.pipeline import sweep

    cfg = sweep.parse_sweep_config(
        {"model": str(llama), "tasks": ["kl"], "formats": [fmt], "scales": ["tensor"], "skip_layers": [skip],
         **SETTINGS}  # fmt: skip
    )
    plan = sweep.plan_sweep(cfg, root)
    cell = next(c for c in plan.cells if not c.is_baseline and c.skip == skip)
    assert cell.calibration is not None
    return cfg, cell


def test_cli_sweep_cell_and_release_candidate_build_one_spec(llama: Path, scale_file: Path, tmp_path: Path) -> None:
    """Same settings -> equal specs, the same run-directory name, the same recorded fields (config.yaml)."""
    from kvcal.pipeline import release, release_config, sweep
    from kvcal.pipeline.settings import eval_options

    cfg, cell = _sweep_cell(llama, scale_file, tmp_path / "runs", skip="sliding_window")
    # the cell's scale file is calibrated later; put this one there (what calibrate_all writes)
    cell.calibration.path.parent.mkdir(parents=True, exist_ok=True)
    cell.calibration.path.write_bytes(scale_file.read_bytes())
    cli = eval_spec(
        EvalConfig(model=str(llama), kv_format="fp8", tasks=["kl"], scales=str(cell.calibration.path),
                   skip_layers="sliding_window", output=str(cell.path), **SETTINGS)  # fmt: skip
    )
    assert cli == cell.spec
    assert run_dir_name(cli) == run_dir_name(cell.spec) == cell.name == cell.path.name
    assert cell.name.endswith("__fp8_e4m3__calib-tensor__skip-sliding_window__kvin-float32")
    assert cli.recorded_fields() == cell.spec.recorded_fields()
    assert cli.scales.loaded is not None and cell.spec.scales.loaded is None  # the cell reads its file when run

    # a release candidate: the release's evaluate section is the sweep's settings, its cells the sweep's cells
    rel = release_config.parse_release_config(
        {"ship": {"kv_format": "fp8_e4m3", "skip_layers": "sliding_window"},
         "evaluate": {"tasks": ["kl"], **SETTINGS}}  # fmt: skip
    )
    scfg = release_config.sweep_config(str(llama), rel)
    assert eval_options(scfg, "kl") == eval_options(cfg, "kl")
    ship = next(c for c in release.configurations(rel) if c.role == "ship")
    cal = sweep.Calibration(rel.calibration, ship.kv_format, "tensor", cell.calibration.path, "done")
    (rel_cell,) = sweep.task_cells(scfg, cell.path.parent.parent, ship.kv_format, ship.label, ship.skip, cal, False)
    assert rel_cell.spec == cli and rel_cell.name == cell.name
    assert rel_cell.spec.recorded_fields() == cli.recorded_fields()


def test_recorded_config_is_byte_for_byte_the_run_identity(llama: Path, scale_file: Path, tmp_path: Path) -> None:
    """A sweep cell run by run_eval writes the config.yaml the CLI's spec records, so the sweep finds it complete;
    and the scale file is read once in that run (kvcal.scales.load_scale_file counted: the cell's spec, the
    binding check and the lm-eval adapter all use the one ScaleSet)."""
    import kvcal.scales
    from kvcal.evaluate.run import run_eval
    from kvcal.pipeline import sweep

    cfg, cell = _sweep_cell(llama, scale_file, tmp_path / "runs")
    cell.calibration.path.parent.mkdir(parents=True, exist_ok=True)
    cell.calibration.path.write_bytes(scale_file.read_bytes())
    loads: list[str] = []
    real = kvcal.scales.load_scale_file

    def counting(path):  # type: ignore[no-untyped-def]
        loads.append(str(path))
        return real(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcal.scales, "load_scale_file", counting)
        out = run_eval(cell.spec)
    assert loads == [str(cell.calibration.path)]
    assert sweep.plan_sweep(cfg, tmp_path / "runs").n_done == 1
    recorded = (out / "config.yaml").read_text()
    cli = eval_spec(
        EvalConfig(model=str(llama), kv_format="fp8_e4m3", tasks=["kl"], scales=str(cell.calibration.path),
                   output=str(out), **SETTINGS)  # fmt: skip
    )
    loads.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcal.scales, "load_scale_file", counting)
        assert run_eval(cli) == out  # complete: the same identity, nothing rerun
    assert loads == []  # eval_spec read it (before the patch); the run did not read it again
    assert (out / "config.yaml").read_text() == recorded


def test_differences_name_the_field(llama: Path) -> None:
    spec = eval_spec(EvalConfig(model=str(llama), kv_format="nvfp4", tasks=["kl"], limit=4, kl_seq_len=32))
    rec = RunConfig(**spec.recorded_fields(), model_dir="/x", dtype="float32")
    assert spec.differences(rec) == []
    assert spec.differences(dataclasses.replace(rec, limit=8)) == ["limit: 8 there, 4 here"]
    assert spec.differences(dataclasses.replace(rec, kl_seq_len=64)) == ["kl_seq_len: 64 there, 32 here"]
    legacy = dataclasses.replace(rec, kv_input_dtype=None)  # before --kv-input-dtype: quantized as computed
    assert spec.differences(legacy) == ["kv_input_dtype: 'float32' there, 'bfloat16' here"]
    assert "skip_layers" in spec.differences(dataclasses.replace(rec, skip_layers="0,1"))[0]
    assert spec.differences(dataclasses.replace(rec, dtype="bfloat16")) == []  # dtype auto: any resolved one


def test_options_are_parsed_once_into_values(llama: Path) -> None:
    spec = eval_spec(
        EvalConfig(model=str(llama), kv_format="k=fp8,v=nvfp4", tasks=["passkey,kl"], passkey_lengths="1k,2048",
                   passkey_depths="0,1", kv_input_dtype="bf16")  # fmt: skip
    )
    assert spec.kv_format == "k=fp8_e4m3,v=nvfp4" and spec.kv_input_dtype == "bfloat16"
    assert spec.tasks == ("passkey", "kl") and spec.passkey_lengths == (1024, 2048)
    assert spec.passkey_depths == (0.0, 1.0)
    with pytest.raises(UsageError, match="--passkey-lengths"):
        eval_spec(EvalConfig(model="m", tasks=["passkey"], passkey_lengths="1.5"))
    with pytest.raises(UsageError, match="scale file 'nope.safetensors' does not exist"):
        eval_spec(EvalConfig(model="m", kv_format="fp8", scales="nope.safetensors"))


def test_one_dtype_default_per_kind_of_command() -> None:
    from kvcal.evaluate.spec import DEFAULT_DTYPE, PIPELINE_DTYPE
    from kvcal.pipeline.settings import EvalSettings

    assert EvalConfig(model="m").dtype == DEFAULT_DTYPE == "auto"  # kvcal eval: the checkpoint's own
    assert EvalSettings().dtype == PIPELINE_DTYPE == "float32"  # sweep / release: calibrate's dtype


def test_sweep_settings_are_eval_options_by_name() -> None:
    from kvcal.pipeline.settings import EvalSettings

    names = {f.name for f in dataclasses.fields(EvalConfig)}
    assert {f.name for f in dataclasses.fields(EvalSettings)} <= names
