"""Plan exports parse back to the plan (ModelOpt's per-layer map, vLLM skip layers, TRT-LLM's range string), and
each engine's refusal names what it lacks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcal.errors import UsageError
from kvcal.models.geometry import FULL, SLIDING, KVSpec, LayerSpec
from kvcal.pipeline.plan_export import (
    engine_commands,
    modelopt_config,
    parse_modelopt_config,
    parse_trtllm_dtype,
    parse_vllm_skip_layers,
    trtllm_dtype,
    vllm_skip_layers,
)


def _spec(types: list[str]) -> KVSpec:
    layers = tuple(LayerSpec(i, t, 512 if t == SLIDING else None, 4, 1, 64) for i, t in enumerate(types))
    return KVSpec("test", layers, 4096, "bfloat16")


MIXED = ["fp8_e4m3", "fp8_e4m3", "nvfp4", "bf16", "nvfp4", "nvfp4", "fp8_e4m3"]


def test_modelopt_map_parses_back() -> None:
    cfg = modelopt_config(MIXED, "kvcal test")
    q = cfg["quantization"]
    assert q["quant_algo"] == q["kv_cache_quant_algo"] == "MIXED_PRECISION"
    assert q["kv_cache_schema_version"] == 1 and q["quantized_layers"] == {}
    assert q["kv_cache_quantized_layers"]["model.layers.2.self_attn"] == {"quant_algo": "NVFP4"}
    assert "model.layers.3.self_attn" not in q["kv_cache_quantized_layers"]  # 16-bit: left out
    assert parse_modelopt_config(cfg, len(MIXED)) == MIXED


def test_trtllm_range_string_parses_back() -> None:
    spec = trtllm_dtype(MIXED)
    assert spec == "0-1:fp8,2:nvfp4,3:bf16,4-5:nvfp4,6:fp8"
    assert parse_trtllm_dtype(spec, len(MIXED)) == MIXED
    assert trtllm_dtype(["nvfp4"] * 4) == "0-3:nvfp4"


def test_two_level_plan_is_vllm_skip_layers() -> None:
    kv = _spec([FULL] * 6)
    layers = ["bf16", "nvfp4", "nvfp4", "bf16", "nvfp4", "nvfp4"]
    assert vllm_skip_layers(layers, kv) == ("nvfp4", "0,3")
    assert parse_vllm_skip_layers("nvfp4", "0,3", kv) == layers
    gemma = _spec([SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL])
    sliding_bf16 = ["bf16", "bf16", "fp8_e4m3", "bf16", "bf16", "fp8_e4m3"]
    assert vllm_skip_layers(sliding_bf16, gemma) == ("fp8", "sliding_window")
    assert parse_vllm_skip_layers("fp8", "sliding_window", gemma) == sliding_bf16
    assert vllm_skip_layers(["fp8_e4m3"] * 6, kv) == ("fp8", "")


def test_refusals_name_what_the_engine_lacks() -> None:
    kv = _spec([FULL] * 7)
    pair = ["k=fp8_e4m3,v=nvfp4"] + MIXED[1:]
    for fn in (lambda x: modelopt_config(x, ""), trtllm_dtype, lambda x: vllm_skip_layers(x, kv)):
        with pytest.raises(
            UsageError, match=r"cannot express layer 0's k=fp8_e4m3,v=nvfp4: .*mixed-K/V kernel"
        ):
            fn(pair)
    with pytest.raises(UsageError, match="reads FP8 and NVFP4 layers only"):
        modelopt_config(["int8_per_token_head"] + MIXED[1:], "")
    with pytest.raises(UsageError, match="cannot express layer 0's fp8_e5m2: it takes fp8_e4m3, nvfp4, bf16"):
        trtllm_dtype(["fp8_e5m2"] + MIXED[1:])
    with pytest.raises(UsageError, match="cannot express a plan of 2 quantized formats"):
        vllm_skip_layers(MIXED, kv)
    commands = engine_commands("m", MIXED, kv, "plan.json")
    assert "refused" in commands["vllm-skip-layers"]
    assert "--kv-cache-dtype auto" in commands["vllm-modelopt"]["command"]
    assert '"0-1:fp8,2:nvfp4,3:bf16,4-5:nvfp4,6:fp8"' in commands["trtllm"]["command"]


def test_a_two_level_plan_file_is_one_format_plus_skip_layers(tmp_path: Path) -> None:
    from kvcal.planfile import load_plan, one_format_plus_16_bit, plan_record, save_plan

    kv = _spec([FULL] * 4)
    binding = {"num_layers": 4}
    path = save_plan(tmp_path / "p.json", plan_record("m", binding, kv, ["bf16", "nvfp4", "nvfp4", "bf16"]))
    assert one_format_plus_16_bit(load_plan(path)) == ("nvfp4", "0,3")
    mixed = save_plan(tmp_path / "q.json", plan_record("m", binding, kv, ["fp8_e4m3", "nvfp4", "nvfp4", "bf16"]))
    with pytest.raises(UsageError, match=r"uses 2 quantized formats \(fp8_e4m3, nvfp4\); kvcal's quantized cache"):
        one_format_plus_16_bit(load_plan(mixed))
    (tmp_path / "bad.json").write_text('{"kvcal_plan": 1, "layers": [{"layer": 1}]}')
    with pytest.raises(UsageError, match="is malformed"):
        load_plan(tmp_path / "bad.json")


def test_modelopt_export_is_what_vllms_loader_takes(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    """vLLM PR #56116's loader: hf_quant_config.json counts as ModelOpt's only with producer "modelopt" and only
    when config.json has no quantization_config; the flat form in config.json is read first. -o config.json embeds
    the map there (everything else kept), and either form is refused where vLLM would ignore it."""
    plan = tmp_path / "plan.json"
    code, _, err = invoke([
        "plan", str(tiny_llama_dir), "--candidates", "bf16,fp8_e4m3,nvfp4", "--capacity", "3.0x",
        "--num-samples", "1", "--seq-len", "12", "--heldout-windows", "1", "--heldout-seq-len", "12", "-o", str(plan),
    ])  # fmt: skip
    assert code == 0, err
    layers = json.loads(plan.read_text())["layers"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    original = json.loads((tiny_llama_dir / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(original))

    code, _, err = invoke(["plan-export", str(plan), "--engine", "vllm-modelopt", "-o", str(ckpt / "hf_quant_config.json")])
    assert code == 0, err
    hf = json.loads((ckpt / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt"
    assert parse_modelopt_config(hf, len(layers)) == [f["kv_format"] for f in layers]

    code, _, err = invoke(["plan-export", str(plan), "--engine", "vllm-modelopt", "-o", str(ckpt / "config.json")])
    assert code == 0, err
    embedded = json.loads((ckpt / "config.json").read_text())
    q = embedded.pop("quantization_config")
    assert embedded == original  # nothing else changed
    assert q["quant_method"] == "modelopt" and q["quant_algo"] == "MIXED_PRECISION" and q["quantized_layers"] == {}
    assert parse_modelopt_config(q, len(layers)) == [f["kv_format"] for f in layers]

    # config.json now has a quantization_config: vLLM would read it, not an hf_quant_config.json beside it
    for target in ("hf_quant_config.json", "config.json"):
        before = (ckpt / "config.json").read_text()
        code, _, err = invoke(["plan-export", str(plan), "--engine", "vllm-modelopt", "-o", str(ckpt / target)])
        assert code == 2
        [line] = err.splitlines()
        assert line.startswith("Error: ") and "quantization_config" in line
        assert (ckpt / "config.json").read_text() == before  # nothing lost
