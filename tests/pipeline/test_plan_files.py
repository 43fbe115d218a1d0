"""A plan file as a configuration (issue 25) on tiny random-weight models: `kvcal capacity -f plan.json` counts
exactly the plan's own budget; a sweep runs it as a cell recording the plan; compare shows it beside the uniform
formats; a release solves, writes and gates one. Bad input is one Error line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

Invoke = Callable[[list[str]], tuple[int, str, str]]
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--num-samples", "2", "--seq-len", "16", "--heldout-windows", "1", "--heldout-seq-len", "16"]


def _solve(invoke: Invoke, model: Path, out: Path, *budget: str, candidates: str = "bf16,nvfp4") -> dict:
    code, stdout, err = invoke(
        ["plan", str(model), "--candidates", candidates, *budget, *SMALL, "-o", str(out), "--json"]
    )
    assert code == 0, err
    return json.loads(stdout)


@pytest.fixture(scope="module")
def gemma_plan(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3.0x plan at context 16 of the tiny Gemma 3 (sliding window 8: its sliding layers count half)."""
    from typer.testing import CliRunner

    from kvcal.cli import app

    out = tmp_path_factory.mktemp("plan") / "gemma.plan.json"
    args = ["plan", str(tiny_model_dir("gemma3")), "--candidates", "bf16,fp8_e4m3,nvfp4", "--capacity", "3.0x",
            "--context", "16", *SMALL, "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_capacity_of_a_plan_is_the_plans_own_count(
    gemma_plan: Path, tiny_model_dir: Callable[[str], Path], invoke: Invoke
) -> None:
    model = tiny_model_dir("gemma3")
    recorded = json.loads(gemma_plan.read_text())
    code, stdout, err = invoke(["capacity", str(model), "-f", "bf16", "-f", str(gemma_plan), "--json"])
    assert code == 0, err
    table = json.loads(stdout)
    assert table["context"] == 16  # the plan's budget context, since --context was not given
    bf16, row = table["formats"]
    assert row["kv_format"] == "plan@3.0x/ctx16" and row["plan_file"] == str(gemma_plan)
    assert row["layers"] == [r["kv_format"] for r in recorded["layers"]]
    for key in ("bytes_per_token", "multiplier_vs_bf16", "bits_per_element"):
        assert row[key] == recorded["capacity"][key], key  # the same count, not a re-derivation
    assert row["multiplier_vs_bf16"] >= 3.0 and bf16["multiplier_vs_bf16"] == 1.0
    code, stdout, err = invoke(["capacity", str(model), "-f", str(gemma_plan), "--context", "64", "--json"])
    assert code == 0, err
    [row64] = json.loads(stdout)["formats"]
    assert row64["bytes_per_token"] < row["bytes_per_token"]  # sliding layers hold 8 of 64 tokens, not 8 of 16
    code, stdout, err = invoke(["capacity", str(model), "-f", str(gemma_plan), "--context", "16"])
    assert code == 0 and "plan@3.0x/ctx16" in stdout, err


def test_capacity_refuses_a_plan_of_another_checkpoint(
    gemma_plan: Path, tiny_model_dir: Callable[[str], Path], tmp_path: Path, invoke: Invoke
) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir("gemma3"), other)
    config = json.loads((other / "config.json").read_text())
    config["kvcal_note"] = "edited"
    (other / "config.json").write_text(json.dumps(config))
    code, _, err = invoke(["capacity", str(other), "-f", str(gemma_plan)])
    assert code == 1
    [line] = err.splitlines()
    assert line.startswith("Error: plan file") and "config.json changed" in line
    code, _, err = invoke(
        ["capacity", str(tiny_model_dir("gemma3")), "-f", str(gemma_plan), "--skip-layers", "0"]
    )
    assert code == 2 and err.splitlines() == [
        "Error: --skip-layers does not apply to a plan file (its 16-bit layers are the plan's); drop one"
    ]


def test_sweep_runs_a_plan_file_as_a_configuration_and_compare_shows_it(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    import yaml

    plan_file = tmp_path / "p.plan.json"
    solved = _solve(invoke, tiny_llama_dir, plan_file, "--capacity", "1.5x")
    quantized = sorted(set(solved["layers"]) - {"bf16"})
    assert quantized == ["nvfp4"]
    conf = {"model": str(tiny_llama_dir), "tasks": ["kl"], "formats": ["nvfp4"], "plans": [str(plan_file)],
            "scales": ["uncalibrated"], "limit": 2, "kl_seq_len": 16, "impl": "torch"}  # fmt: skip
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(conf))
    runs = tmp_path / "runs"
    code, stdout, err = invoke(["sweep", str(tmp_path / "sweep.yaml"), "-o", str(runs), "--dry-run", "--json"])
    assert code == 0, err
    [cell] = [c for c in json.loads(stdout)["cells"] if c["plan"]]
    name = f"{tiny_llama_dir.name}__plan-1.5x-nvfp4__none"
    assert cell["name"] == name and cell["plan"] == str(plan_file) and cell["kv_format"] == "nvfp4"
    code, _, err = invoke(["sweep", str(tmp_path / "sweep.yaml"), "-o", str(runs)])
    assert code == 0, err
    recorded = yaml.safe_load((runs / "kl" / name / "config.yaml").read_text())
    skipped = [i for i, f in enumerate(solved["layers"]) if f == "bf16"]
    assert recorded["kv_format"] == "nvfp4" and recorded["skip_layer_indices"] == skipped
    assert recorded["plan"]["label"] == "plan@1.5x" and recorded["plan"]["path"] == str(plan_file.resolve())
    assert recorded["plan"]["budget"] == solved["budget"]

    code, stdout, err = invoke(["compare", str(runs), "--json"])
    assert code in (0, 1), err
    configs = {c["label"]: c for c in json.loads(stdout)["configurations"]}
    short = tiny_llama_dir.name
    assert set(configs) == {f"{short}__bf16__none__skip-none", f"{short}__nvfp4__none__skip-none", name}
    assert configs[name]["plan"]["label"] == "plan@1.5x"
    assert configs[name]["capacity_vs_bf16"] == solved["capacity"]["multiplier_vs_bf16"]
    code, stdout, _ = invoke(["compare", str(runs)])
    assert "plan@1.5x (nvfp4)" in stdout  # the summary's kv format column


def test_sweep_refuses_a_plan_of_another_checkpoint(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    import yaml

    plan_file = tmp_path / "p.plan.json"
    _solve(invoke, tiny_llama_dir, plan_file, "--capacity", "1.5x")
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["kvcal_note"] = "edited"
    (other / "config.json").write_text(json.dumps(config))
    conf = {"model": str(other), "tasks": ["kl"], "plans": [str(plan_file)], "limit": 2, "kl_seq_len": 16}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(conf))
    code, _, err = invoke(["sweep", str(tmp_path / "sweep.yaml"), "-o", str(tmp_path / "runs"), "--dry-run"])
    assert code == 1
    [line] = err.splitlines()
    assert line.startswith("Error: plan file") and "config.json changed" in line
    from kvcal.models.geometry import kv_spec
    from kvcal.models.loading import load_model
    from kvcal.planfile import plan_record, save_plan
    from kvcal.scales import compute_binding

    kv = kv_spec(load_model(str(tiny_llama_dir)).model.config)
    binding = compute_binding(str(tiny_llama_dir), tiny_llama_dir, kv)
    mixed = save_plan(tmp_path / "mixed.json", plan_record("m", binding, kv, ["bf16", "fp8_e4m3", "nvfp4"]))
    conf.update(model=str(tiny_llama_dir), plans=[str(mixed)])
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(conf))
    code, _, err = invoke(["sweep", str(tmp_path / "sweep.yaml"), "-o", str(tmp_path / "runs"), "--dry-run"])
    assert code == 2
    [line] = err.splitlines()
    assert line.startswith("Error: sweep config: plans: plan file") and "2 quantized formats" in line


RELEASE = {
    "ship": {"kv_format": "fp8_e4m3", "granularity": "tensor"},
    "calibration": {"num_samples": 4, "seq_len": 32},
    "evaluate": {"tasks": ["kl"], "limit": 12, "kl_seq_len": 32, "dtype": "float32", "impl": "torch",
                 "candidates": [{"plan": {"capacity": "1.5x", "num_samples": 2, "seq_len": 16,
                                          "heldout_windows": 1, "heldout_seq_len": 16}}]},
    "gate": {"min_samples": 5, "bootstrap": 400, "allow_unjudged": True},
}  # fmt: skip


def test_release_solves_writes_and_gates_a_plan_candidate(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    import yaml

    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama_dir, model)
    cfg = tmp_path / "release.yaml"
    cfg.write_text(yaml.safe_dump(RELEASE))
    out = tmp_path / "out"
    code, stdout, err = invoke(["release", str(model), "--config", str(cfg), "-o", str(out)])
    assert code in (0, 1), err
    record = json.loads((out / "release.json").read_text())
    [plan] = record["plans"]
    assert plan["label"] == "plan@1.5x" and plan["kv_format"] == "fp8_e4m3" and plan["solved"] is True
    plan_file = Path(plan["plan_file"])
    assert plan_file.parent == out / "plans" and plan_file.name.startswith("tiny-llama__plan-1.5x-fp8_e4m3__")
    solved = json.loads(plan_file.read_text())
    assert solved["capacity"]["multiplier_vs_bf16"] >= 1.5
    # the plan's damage was measured on the release's own scale file (the candidate is calibrated: ship's format)
    assert solved["scales"]["fp8_e4m3"] == {"path": record["scales_path"], "sha256": record["scales_sha256"]}
    assert [c["role"] for c in record["configurations"]] == ["baseline", "ship", "candidate"]
    candidate = record["configurations"][2]
    assert candidate["label"] == "tiny-llama__plan-1.5x-fp8_e4m3__calib-tensor"
    assert candidate["plan"]["label"] == "plan@1.5x" and candidate["plan"]["path"] == str(plan_file.resolve())
    assert candidate["capacity_vs_bf16"] == pytest.approx(solved["capacity"]["multiplier_vs_bf16"])
    assert candidate["verdict"] and candidate["gate"] in ("pass", "FAIL", "insufficient data")
    assert record["work"]["plans_solved"] == 1 and record["work"]["evaluations_run"] == 3
    assert "## Plans" in (out / "release.md").read_text() and "plan: plan@1.5x (fp8_e4m3) solved" in stdout

    # Rerun, nothing changed: the plan file is reused, not re-solved; nothing is evaluated again.
    code, stdout, err = invoke(["release", str(model), "--config", str(cfg), "-o", str(out)])
    assert code in (0, 1), err
    again = json.loads((out / "release.json").read_text())
    assert again["work"]["reused_everything"] is True and again["work"]["plans_reused"] == 1
    assert again["plans"][0]["solved"] is False and again["plans"][0]["sha256"] == plan["sha256"]
    assert again["decision"] == record["decision"]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"capacity": "3.0x", "effective_bits": 4}, "Error: release config: evaluate.candidates[1].plan: give "
         "exactly one budget"),
        ({"capacity": "3.0x"}, "Error: evaluate.candidates[1].plan: capacity 3x is out of reach: the cheapest "
         "candidates (fp8_e4m3 on every layer) give 2.00x"),
        ({"capacity": "2x", "format": "bf16"}, "Error: release config: evaluate.candidates[1].plan.format must be "
         "a quantized format"),
        ({"capacity": "2x", "frontier": True}, "Error: release config: unknown key 'evaluate.candidates[1].plan."
         "frontier'"),
    ],
)  # fmt: skip
def test_bad_plan_candidates_are_one_error_line(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, plan: dict, message: str
) -> None:
    import yaml

    raw = json.loads(json.dumps(RELEASE))
    raw["evaluate"]["candidates"] = [{"plan": plan}]
    cfg = tmp_path / "release.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    code, _, err = invoke(["release", str(tiny_llama_dir), "--config", str(cfg), "-o", str(tmp_path / "out")])
    assert code == 2
    [line] = err.splitlines()
    assert line.startswith(message), line
