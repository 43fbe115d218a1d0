"""`kvcal plan` on a tiny random-weight Llama (wiring and exact numerics, not accuracy): the damage is kvcal
sensitivity's, batching changes no number, the plan file is bound to its checkpoint, bad input is one Error line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.errors import KvcalError, UsageError
from kvcal.models.geometry import kv_spec
from kvcal.models.loading import load_model
from kvcal.pipeline.plan import measure_damage, parse_candidates, per_sample_kl, plan_quant
from kvcal.pipeline.sensitivity import sensitivity
from kvcal.planfile import load_plan, load_plan_for_model

Invoke = Callable[[list[str]], tuple[int, str, str]]
pytestmark = pytest.mark.usefixtures("one_thread")


def _samples(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (length - i,), generator=g) for i in range(n)]


def test_damage_is_sensitivitys_and_batching_changes_nothing(tiny_llama_dir: Path) -> None:
    lm = load_model(str(tiny_llama_dir))
    kv = kv_spec(lm.model.config)
    report = sensitivity(lm, "fp4_e2m1", num_samples=3, seq_len=16, batch_size=1)
    from kvcal.calibrate.observation import ObserveOptions

    samples = ObserveOptions.parse(num_samples=3, seq_len=16).samples(lm).samples
    one = measure_damage(lm.model, samples, kv, ["bf16", "fp4_e2m1", "int8_per_token_head"], {}, batch_size=1)
    two = measure_damage(lm.model, samples, kv, ["bf16", "fp4_e2m1", "int8_per_token_head"], {}, batch_size=2)
    assert [row[1] for row in one.mean] == pytest.approx([r["kl"] for r in report["layers"]], rel=1e-12)
    assert all(row[0] == 0.0 for row in one.mean)  # bf16: the model's own cache
    assert torch.equal(one.per_sample, two.per_sample)


def test_joint_kl_of_an_all_16_bit_plan_is_zero(tiny_llama_dir: Path) -> None:
    lm = load_model(str(tiny_llama_dir))
    kl = per_sample_kl(lm.model, _samples(2, 12), [plan_quant(["bf16"] * 3, {})], batch_size=2)
    assert torch.equal(kl[0], torch.zeros(2, 1, dtype=torch.float64))


def test_plan_cli_writes_a_bound_plan_file(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    out = tmp_path / "plan.json"
    args = [
        "plan", str(tiny_llama_dir), "--candidates", "bf16,fp8_e4m3,nvfp4", "--capacity", "2.5x",
        "--num-samples", "2", "--seq-len", "16", "--heldout-windows", "2", "--heldout-seq-len", "16",
        "--frontier", "--compare-uniform", "--refine", "1", "-o", str(out),
    ]  # fmt: skip
    code, stdout, err = invoke([*args, "--json"])
    assert code == 0, err
    r = json.loads(stdout)
    assert len(r["layers"]) == 3 and r["capacity"]["multiplier_vs_bf16"] >= 2.5
    assert r["measured"]["kl"]["n"] == 2 and r["estimated_kl"] >= 0
    assert [row["config"] for row in r["uniform"]] == ["fp8_e4m3", "nvfp4"]
    assert r["frontier"][0]["target"] == 1.0 and r["frontier"][0]["estimated_kl"] == 0.0
    # the uniform guard measured the solved plan beside the uniform configurations meeting 2.5x (nvfp4 only)
    guard = r["uniform_guard"]
    assert set(guard["calibration_kl"]) == {"plan", "nvfp4"}
    if guard["chosen"] == "plan":
        assert guard["calibration_kl"]["plan"] <= guard["calibration_kl"]["nvfp4"]
    else:
        assert r["layers"] == ["nvfp4"] * 3 and guard["calibration_kl"]["nvfp4"] < guard["calibration_kl"]["plan"]
    assert all("uniform_guard" in row for row in r["frontier"])
    plan = load_plan_for_model(
        out, str(tiny_llama_dir), tiny_llama_dir, kv_spec(load_model(str(tiny_llama_dir)).model.config)
    )
    assert plan.layers == r["layers"]

    code, stdout, err = invoke(["plan-export", str(out), "--engine", "trtllm"])
    assert code == 0, err
    assert "dtype:" in stdout
    hf = tmp_path / "hf_quant_config.json"
    code, stdout, err = invoke(["plan-export", str(out), "--engine", "vllm-modelopt", "-o", str(hf)])
    assert code == 0, err
    assert json.loads(hf.read_text())["quantization"]["kv_cache_quant_algo"] == "MIXED_PRECISION"


def test_uniform_guard_takes_a_uniform_configuration_only_where_it_loses_less_within_the_budget(
    tiny_llama_dir: Path,
) -> None:
    """The guard's choice (module docstring, 5) from given joint KLs: a uniform configuration replaces the solved
    plan only when it meets the plan's budget by exact integer costs (fp8_e4m3 is exactly 2.0x: it meets 2.0x, not
    2.01x) and loses less on the calibration samples; otherwise the plan stays."""
    from kvcal.pipeline.plan import uniform_guard
    from kvcal.pipeline.plan_cost import Budget

    kv = kv_spec(load_model(str(tiny_llama_dir)).model.config)
    cands = ["bf16", "fp8_e4m3", "nvfp4"]
    plan = ["bf16", "nvfp4", "nvfp4"]
    given = {"plan": 0.5, "fp8_e4m3": 0.2, "nvfp4": 0.3}

    def joint(variants: list[list[str]], samples: list[torch.Tensor], phase: str) -> torch.Tensor:
        names = ["plan"] * (len(variants) - 2) + ["fp8_e4m3", "nvfp4"]  # plans first, then the configurations
        assert variants[-2:] == [["fp8_e4m3"] * 3, ["nvfp4"] * 3] and phase == "uniform guard"
        kl = torch.tensor([given[n] for n in names], dtype=torch.float64)
        return torch.stack([kl.expand(len(samples), -1), torch.ones(len(samples), len(names))])  # [2, N, V]

    samples = _samples(2, 8)
    b = [Budget("capacity", 2.0, None), Budget("capacity", 2.01, None), Budget("capacity", 3.0, None)]
    g = uniform_guard(kv, cands, b, [plan, plan, plan], samples, joint)
    assert [x["chosen"] for x in g] == ["fp8_e4m3", "nvfp4", "nvfp4"]  # 2.01x: fp8 (2.0x) does not meet it
    assert g[0]["layers"] == ["fp8_e4m3"] * 3 and set(g[1]["calibration_kl"]) == {"plan", "nvfp4"}
    given["plan"] = 0.25  # better than nvfp4, worse than fp8
    g = uniform_guard(kv, cands, b, [plan, plan, plan], samples, joint)
    assert [x["chosen"] for x in g] == ["fp8_e4m3", "plan", "plan"] and g[1]["layers"] == plan


def test_meets_budget_is_exact_at_the_edge(tiny_llama_dir: Path) -> None:
    """One exact test (integer costs, no float tolerance) for the solver, the guard and the report's uniform rows:
    fp8_e4m3 stores exactly half of bf16's bits, so it meets 2.0x and not 2.0x plus the least float step; a plan
    whose bits per element are exactly B meets B and not B less a step."""
    import math

    from kvcal.pipeline.plan_cost import Budget, meets_budget, plan_capacity

    kv = kv_spec(load_model(str(tiny_llama_dir)).model.config)
    fp8 = ["fp8_e4m3"] * kv.num_layers
    assert meets_budget(kv, fp8, Budget("capacity", 2.0, None))
    assert not meets_budget(kv, fp8, Budget("capacity", math.nextafter(2.0, 3.0), None))
    mixed = ["bf16"] + ["nvfp4"] * (kv.num_layers - 1)
    bits = plan_capacity(kv, mixed, None)["bits_per_element"]
    assert meets_budget(kv, mixed, Budget("effective_bits", bits, None))
    assert not meets_budget(kv, mixed, Budget("effective_bits", math.nextafter(bits, 0.0), None))


def test_plan_file_is_refused_on_another_checkpoint(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    out = tmp_path / "plan.json"
    code, _, err = invoke([
        "plan", str(tiny_llama_dir), "--candidates", "bf16,fp8_e4m3", "--capacity", "1.5x", "--num-samples", "1",
        "--seq-len", "12", "--heldout-windows", "1", "--heldout-seq-len", "12", "-o", str(out),
    ])  # fmt: skip
    assert code == 0, err
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the weights changed
    weights.write_bytes(bytes(data))
    kv = kv_spec(load_model(str(tiny_llama_dir)).model.config)
    with pytest.raises(
        KvcalError, match=r"solved for another checkpoint .*weights changed \(model.safetensors\)"
    ):
        load_plan_for_model(out, str(other), other, kv)
    code, _, err = invoke(["plan-export", str(out), "--engine", "trtllm", "--model", str(other)])
    assert code == 1
    [line] = err.splitlines()
    assert line.startswith("Error: plan file") and "run `kvcal plan` on this checkpoint" in line
    assert load_plan(out).layers  # the file itself is fine


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--capacity", "5x"],
            r"Error: --capacity 5x is out of reach: the cheapest candidates \(nvfp4 on every layer\) give 3.55x",
        ),
        (["--capacity", "0.5x"], "Error: --capacity 0.5x: a plan holds at least BF16's tokens"),
        (
            ["--capacity", "2x", "--candidates", "auto,fp8"],
            "Error: --candidates: 'auto' is not a storage format",
        ),
    ],
)
def test_bad_input_is_one_error_line(
    tiny_llama_dir: Path, invoke: Invoke, extra: list[str], message: str
) -> None:
    code, _, err = invoke(["plan", str(tiny_llama_dir), "--candidates", "bf16,fp8_e4m3,nvfp4", *extra])
    assert code == 2, err
    [line] = err.splitlines()
    assert __import__("re").match(message, line), line


def test_export_refusal_is_one_error_line(tmp_path: Path, invoke: Invoke, tiny_llama_dir: Path) -> None:
    out = tmp_path / "plan.json"
    code, _, err = invoke([
        "plan", str(tiny_llama_dir), "--candidates", "bf16,k=fp8_e4m3,v=nvfp4", "--capacity", "1.2x",
        "--num-samples", "1", "--seq-len", "12", "--heldout-windows", "1", "--heldout-seq-len", "12", "-o", str(out),
    ])  # fmt: skip
    assert code == 0, err
    code, _, err = invoke(["plan-export", str(out), "--engine", "vllm-modelopt"])
    assert code == 2
    [line] = err.splitlines()
    assert "cannot express layer" in line and "mixed-K/V kernel" in line


def test_candidates_are_canonical() -> None:
    assert parse_candidates(["bf16", "fp8", "k=fp8,v=fp8", "k=fp8,v=nvfp4"]) == [
        "bf16",
        "fp8_e4m3",
        "k=fp8_e4m3,v=nvfp4",
    ]
    with pytest.raises(UsageError, match="at least two formats"):
        parse_candidates(["fp8"])


def test_damage_costs_one_reference_and_one_forward_per_layer_and_quantized_candidate(
    tiny_llama_dir: Path,
) -> None:
    """The cost claim of docs/commands.md: per batch, L x K' + 1 forwards (bf16 needs none, the reference is
    shared by every one-layer forward), against sensitivity's L + 2 per format."""
    lm = load_model(str(tiny_llama_dir))
    kv = kv_spec(lm.model.config)
    calls = []
    handle = lm.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        measure_damage(lm.model, _samples(4, 10), kv, ["bf16", "fp4_e2m1", "int8_per_token_head"], {}, 2)
    finally:
        handle.remove()
    assert len(calls) == 2 * (3 * 2 + 1)  # 2 batches x (3 layers x 2 quantized candidates + 1 reference)


def test_eval_takes_a_plan_file(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    """`kvcal eval -f plan.json`: a one-format plan runs as --kv-format X --skip-layers (the 16-bit layers);
    refused on another checkpoint and when it mixes formats the quantized cache cannot run together."""
    import yaml

    from kvcal.planfile import plan_record, save_plan
    from kvcal.scales import compute_binding

    kv = kv_spec(load_model(str(tiny_llama_dir)).model.config)
    binding = compute_binding(str(tiny_llama_dir), tiny_llama_dir, kv)
    good = save_plan(tmp_path / "p.json", plan_record("m", binding, kv, ["bf16", "fp4_e2m1", "fp4_e2m1"]))
    run = tmp_path / "run"
    code, _, err = invoke(
        ["eval", str(tiny_llama_dir), "-f", str(good), "--tasks", "kl", "--limit", "1", "--kl-seq-len", "16",
         "-o", str(run)]
    )  # fmt: skip
    assert code == 0, err
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["kv_format"] == "fp4_e2m1" and str(recorded["skip_layers"]) == "0"
    assert recorded["plan"] == {"label": "plan", "budget": None, "path": str(good.resolve()),
                                "sha256": __import__("hashlib").sha256(good.read_bytes()).hexdigest()}  # fmt: skip
    mixed = save_plan(tmp_path / "q.json", plan_record("m", binding, kv, ["bf16", "fp4_e2m1", "nvfp4"]))
    code, _, err = invoke(
        ["eval", str(tiny_llama_dir), "-f", str(mixed), "--tasks", "kl", "-o", str(tmp_path / "r2")]
    )
    assert code == 2 and err.startswith("Error: plan file") and "2 quantized formats" in err
    other = dict(binding, config_sha256="0" * 64)
    stale = save_plan(tmp_path / "s.json", plan_record("m", other, kv, ["bf16", "fp4_e2m1", "fp4_e2m1"]))
    code, _, err = invoke(
        ["eval", str(tiny_llama_dir), "-f", str(stale), "--tasks", "kl", "-o", str(tmp_path / "r3")]
    )
    assert code == 1 and "solved for another checkpoint" in err and "config.json changed" in err
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_damage_checkpoint_is_reused_for_another_budget_and_refused_when_measured_otherwise(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelOpt auto_quantize's `checkpoint`: the first plan measures and saves the damage, a second plan for
    another budget reuses it (no damage forward, the same numbers), other calibration tokens are refused."""
    ck = tmp_path / "damage" / "smol.json"
    base = [
        "plan", str(tiny_llama_dir), "--candidates", "bf16,fp8_e4m3,nvfp4", "--num-samples", "2", "--seq-len", "16",
        "--heldout-windows", "1", "--heldout-seq-len", "16", "--checkpoint", str(ck), "--json",
    ]  # fmt: skip
    code, stdout, err = invoke([*base, "--capacity", "2.0x"])
    assert code == 0, err
    first = json.loads(stdout)
    saved = json.loads(ck.read_text())
    assert saved["kind"] == "kvcal plan damage" and len(saved["per_sample"]) == 2  # [N][L][K]

    import kvcal.pipeline.plan as plan_module

    calls = []
    original = plan_module.measure_damage
    monkeypatch.setattr(plan_module, "measure_damage", lambda *a, **k: calls.append(1) or original(*a, **k))
    code, stdout, err = invoke([*base, "--capacity", "3.0x"])
    assert code == 0, err
    assert calls == []  # reused, not measured
    assert json.loads(stdout)["damage"]["per_layer"] == first["damage"]["per_layer"]

    code, _, err = invoke([*base, "--capacity", "2.0x", "--seed", "1"])
    assert code == 2
    [line] = [x for x in err.splitlines() if x.startswith("Error:")]  # (transformers warns about the text)
    assert line.startswith("Error: --checkpoint") and "calibration" in line and "different checkpoint path" in line

    ck.write_text("{}")
    code, _, err = invoke([*base, "--capacity", "2.0x"])
    assert code == 2 and "is not a kvcal plan damage file" in err
