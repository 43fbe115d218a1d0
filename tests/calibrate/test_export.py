"""Export for engines: the vLLM checkpoint (compressed-tensors' parser accepts it, transformers loads the scales)
and SGLang's --quantization-param-path JSON."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.calibrate.export import (
    INDEX_NAME,
    RENAMED_SINGLE,
    SCALE_SHARD,
    export_sglang,
    export_vllm,
    quantization_config,
)
from kvcal.errors import KvcalError, UsageError
from kvcal.models.config import load_config
from kvcal.models.geometry import kv_spec
from kvcal.scales import K_NAME, compute_binding, make_scale_set, save_scale_file

NUM_LAYERS, KV_HEADS = 2, 2  # the geometry of tests/conftest.py's `word_llama_dir`

# What llm-compressor 0.14.0.1 `oneshot` wrote into config.json for a kv_cache_scheme-only recipe (FP8,
# strategy tensor) on a tiny Llama with compressed-tensors 0.19.0 (recorded from a real run).
LLMCOMPRESSOR_QUANTIZATION_CONFIG = {
    "config_groups": {},
    "format": "dense",
    "global_compression_ratio": None,
    "ignore": [],
    "kv_cache_scheme": {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "tensor",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    },
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "transform_config": {},
    "version": "0.19.0",
}


Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture of tests/conftest.py


def scale_set(model_dir: Path, granularity: str = "tensor", kv_format: str = "fp8_e4m3"):
    kv = kv_spec(load_config(model_dir))
    g = torch.Generator().manual_seed(1)
    shape = (1,) if granularity == "tensor" else (KV_HEADS,)
    return make_scale_set(
        kv_format,
        granularity,
        [torch.rand(shape, generator=g) * 0.1 + 0.01 for _ in range(NUM_LAYERS)],
        [torch.rand(shape, generator=g) * 0.1 + 0.01 for _ in range(NUM_LAYERS)],
        observer="minmax",
        binding=compute_binding(str(model_dir), model_dir, kv),
    )


def test_quantization_config_matches_llmcompressor_and_parses() -> None:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    qc = quantization_config("tensor")
    assert qc == LLMCOMPRESSOR_QUANTIZATION_CONFIG
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.num_bits == 8 and parsed.kv_cache_scheme.type == "float"
    assert parsed.kv_cache_scheme.strategy == QuantizationStrategy.TENSOR
    assert parsed.kv_cache_scheme.dynamic is False and parsed.kv_cache_scheme.symmetric is True
    head = QuantizationConfig.model_validate(quantization_config("head"))
    assert head.kv_cache_scheme.strategy == QuantizationStrategy.ATTN_HEAD


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_vllm_export_loads_with_transformers(word_llama_dir: Path, tmp_path: Path, granularity: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ss = scale_set(word_llama_dir, granularity)
    before = {p.name: p.read_bytes() for p in word_llama_dir.iterdir() if p.is_file()}
    out = tmp_path / "export"
    summary = export_vllm(ss, word_llama_dir, out)
    assert (
        summary["num_layers"] == NUM_LAYERS
        and summary["strategy"] == {"tensor": "tensor", "head": "attn_head"}[granularity]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp folder left
    # the source checkpoint is untouched; weights are hard links
    assert {p.name: p.read_bytes() for p in word_llama_dir.iterdir() if p.is_file()} == before
    assert not (out / "model.safetensors").exists()  # linked under a shard name (see kvcal.calibrate.export)
    assert (out / RENAMED_SINGLE).stat().st_ino == (word_llama_dir / "model.safetensors").stat().st_ino
    assert (out / "tokenizer.json").is_file()
    # the index maps every tensor of every shard
    index = json.loads((out / INDEX_NAME).read_text())
    on_disk = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(out / shard), "pt") as fh:
            on_disk.update(dict.fromkeys(fh.keys(), shard))
    assert index["weight_map"] == on_disk
    assert index["weight_map"][K_NAME.format(i=1)] == SCALE_SHARD
    # config.json: compressed-tensors' own parser accepts the quantization_config
    config = json.loads((out / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.kv_cache_scheme.strategy == ("tensor" if granularity == "tensor" else "attn_head")
    # transformers (with compressed-tensors) attaches k_scale / v_scale to every attention module
    model = AutoModelForCausalLM.from_pretrained(out)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        want_shape = (1,) if granularity == "tensor" else (KV_HEADS, 1, 1)
        assert tuple(attn.k_scale.shape) == want_shape
        torch.testing.assert_close(attn.k_scale.detach().reshape(-1), ss.k_scales[i], rtol=0, atol=0)
        torch.testing.assert_close(attn.v_scale.detach().reshape(-1), ss.v_scales[i], rtol=0, atol=0)
    # and the weights are the original ones
    src = AutoModelForCausalLM.from_pretrained(word_llama_dir)
    torch.testing.assert_close(model.lm_head.weight, src.lm_head.weight, rtol=0, atol=0)


def test_vllm_export_sharded_checkpoint(word_llama_dir: Path, tmp_path: Path) -> None:
    """A checkpoint that already has an index: the index is extended, the shards keep their names."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(word_llama_dir).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(word_llama_dir / name, sharded / name)
    src_index = json.loads((sharded / INDEX_NAME).read_text())
    assert len(set(src_index["weight_map"].values())) > 1
    ss = scale_set(sharded)
    export_vllm(ss, sharded, tmp_path / "out")
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert index["weight_map"] == {
        **src_index["weight_map"],
        **{
            f"model.layers.{i}.self_attn.{kind}_scale": SCALE_SHARD
            for i in range(NUM_LAYERS)
            for kind in "kv"
        },
    }
    assert index["metadata"]["total_size"] == src_index["metadata"]["total_size"] + 2 * NUM_LAYERS * 4
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(model.model.layers[1].self_attn.v_scale.detach(), ss.v_scales[1])


def test_vllm_export_refusals(word_llama_dir: Path, tmp_path: Path) -> None:
    for fmt, message in (
        ("fp8_e5m2", "FP8 E4M3 scales only"),
        ("nvfp4", "NVFP4 global scale"),
        ("int8_per_tensor", "only TensorRT-LLM loads one"),  # TensorRT-LLM's INT8 cache: no vLLM/SGLang layout
    ):
        with pytest.raises(UsageError, match=message):
            export_vllm(scale_set(word_llama_dir, kv_format=fmt), word_llama_dir, tmp_path / fmt)
    with pytest.raises(UsageError, match="SGLang has no per-tensor INT8 KV cache"):
        export_sglang(scale_set(word_llama_dir, kv_format="int8_per_tensor"), word_llama_dir, tmp_path / "i8.json")
    (tmp_path / "exists").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        export_vllm(scale_set(word_llama_dir), word_llama_dir, tmp_path / "exists")
    with pytest.raises(UsageError, match="inside the model folder"):
        export_vllm(scale_set(word_llama_dir), word_llama_dir, word_llama_dir / "sub")
    # exporting an export again is refused (it already holds scales)
    export_vllm(scale_set(word_llama_dir), word_llama_dir, tmp_path / "once")
    with pytest.raises(UsageError, match="already holds KV scales"):
        export_vllm(scale_set(word_llama_dir), tmp_path / "once", tmp_path / "twice")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(KvcalError, match="cannot write export folder"):
        export_vllm(scale_set(word_llama_dir), word_llama_dir, tmp_path / "file.txt" / "out")
    with pytest.raises(KvcalError, match="cannot write"):
        export_sglang(scale_set(word_llama_dir), word_llama_dir, tmp_path / "file.txt" / "kv.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "file.txt", "once"]


def test_sglang_json(word_llama_dir: Path, tmp_path: Path) -> None:
    ss = scale_set(word_llama_dir)
    out = tmp_path / "kv.json"
    export_sglang(ss, word_llama_dir, out, tp_size=2)
    doc = json.loads(out.read_text())
    assert doc["model_type"] == "llama"
    assert doc["kv_cache"]["dtype"] == "float8_e4m3fn"
    sf = doc["kv_cache"]["scaling_factor"]
    assert sorted(sf) == ["0", "1"] and sf["0"] == sf["1"]
    # SGLang's schema: dict[int, dict[int, float]], one entry per layer, one scale for K and V of a layer
    assert {int(k): {int(i): float(v) for i, v in m.items()} for k, m in sf.items()}[0] == {
        i: max(ss.k_scales[i].item(), ss.v_scales[i].item()) for i in range(NUM_LAYERS)
    }
    head = scale_set(word_llama_dir, "head")
    with pytest.raises(UsageError, match="per KV head"):
        export_sglang(head, word_llama_dir, tmp_path / "head.json")
    assert not (tmp_path / "head.json").exists()
    export_sglang(head, word_llama_dir, tmp_path / "head.json", reduce_heads=True)
    reduced = json.loads((tmp_path / "head.json").read_text())["kv_cache"]["scaling_factor"]["0"]
    assert reduced["1"] == max(head.k_scales[1].max().item(), head.v_scales[1].max().item())
    with pytest.raises(UsageError, match="FP8 E4M3 scales only"):
        export_sglang(scale_set(word_llama_dir, kv_format="fp8_e5m2"), word_llama_dir, tmp_path / "e5m2.json")


def test_cli_export(word_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    path = save_scale_file(tmp_path / "s.safetensors", scale_set(word_llama_dir))
    code, out, err = invoke(
        ["export", str(path), str(word_llama_dir), "--to", "vllm", "-o", str(tmp_path / "v")]
    )
    assert code == 0, err
    assert "vllm serve" in out and (tmp_path / "v" / SCALE_SHARD).is_file()
    code, out, err = invoke(
        ["export", str(path), str(word_llama_dir), "--to", "sglang", "-o", str(tmp_path / "s.json"), "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["engine"] == "sglang" and (tmp_path / "s.json").is_file()
    code, _, err = invoke(
        ["export", str(path), str(word_llama_dir), "--to", "trtllm", "-o", str(tmp_path / "t")]
    )
    assert code == 2 and err.startswith("Error: ") and "unknown export target" in err
    # stale scales: refused (exit 1), exported with --force and a loud warning
    copy = tmp_path / "copy"
    shutil.copytree(word_llama_dir, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    code, _, err = invoke(["export", str(path), str(copy), "--to", "sglang", "-o", str(tmp_path / "x.json")])
    assert code == 1 and err.startswith("Error: ") and "config.json changed" in err
    assert not (tmp_path / "x.json").exists()
    code, _, err = invoke(
        ["export", str(path), str(copy), "--to", "sglang", "-o", str(tmp_path / "x.json"), "--force"]
    )
    assert code == 0 and "Warning" in err and "config.json changed" in err


def test_an_engine_run_on_the_export_is_the_source_model_with_its_scales(word_llama_dir: Path, tmp_path: Path) -> None:
    """What `kvcal compare` reads of an engine run on a `kvcal export --to vllm` checkpoint: the source model (its
    reference and folder, so the run pairs with kvcal's runs of that model), its calibrated scale shard, and a
    KV-cache scheme (vLLM serves `auto` there as FP8)."""
    from kvcal.models.config import declares_kv_scheme
    from kvcal.report.lmeval_runs import _exported_scales, exported_from

    out = tmp_path / "export"
    export_vllm(scale_set(word_llama_dir, "head"), word_llama_dir, out)
    assert str(word_llama_dir) in exported_from(str(out)) and exported_from(str(word_llama_dir)) == set()
    shard, record = _exported_scales(out)
    assert Path(shard).is_file() and Path(shard).parent == out and record["granularity"] == "head"
    assert record["kv_format"] == "fp8_e4m3" and _exported_scales(word_llama_dir) is None
    assert declares_kv_scheme(out) and not declares_kv_scheme(word_llama_dir)
