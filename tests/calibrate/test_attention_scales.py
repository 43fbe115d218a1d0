"""`kvcal calibrate --attention-scales`: q_scale from the post-RoPE queries (equal to the amax recomputed from the
weights), the scale file's version 2 (old files still load), the vLLM export written as
llm-compressor writes it and loaded by transformers + compressed-tensors, and `kvcal eval --attention fp8`'s bad
input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.calibrate.export import SCALE_SHARD, export_vllm, quantization_config
from kvcal.calibrate.run import calibrate
from kvcal.errors import UsageError
from kvcal.models.config import load_config
from kvcal.models.geometry import kv_spec
from kvcal.scales import (
    Q_NAME,
    SCHEMA_VERSION,
    compute_binding,
    load_scale_file,
    make_scale_set,
    save_scale_file,
)

N, L = 4, 20
Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture of tests/conftest.py

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_q_amax(model_dir: Path, samples: list[torch.Tensor]) -> list[float]:
    """Post-RoPE query amax per layer recomputed from the weights (independent of kvcal's attention hook): the
    layer's input norm of its input hidden state, q_proj, Llama's rotary embedding."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    heads, d = model.config.num_attention_heads, model.config.head_dim
    amax = [0.0] * model.config.num_hidden_layers
    with torch.no_grad():
        for ids in samples:
            t = ids.numel()
            hidden = model(ids[None], output_hidden_states=True).hidden_states
            pos = torch.arange(t)[None]
            for i, layer in enumerate(model.model.layers):
                h = layer.input_layernorm(hidden[i])
                q = layer.self_attn.q_proj(h).view(1, t, heads, d).transpose(1, 2)
                cos, sin = model.model.rotary_emb(h, pos)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                amax[i] = max(amax[i], float(q.abs().max()))
    return amax


def test_q_scales_are_post_rope_query_amax_over_448(tiny_llama_dir: Path, tmp_path: Path) -> None:
    res = calibrate(
        str(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L, attention_scales=True,
        output=tmp_path / "s.safetensors",
    )  # fmt: skip
    ss = res.scale_set
    assert ss.q_scales is not None and len(ss.q_scales) == ss.num_layers
    record = ss.manifest["attention_scales"]
    for i, q in enumerate(ss.q_scales):
        assert tuple(q.shape) == (1,) and float(q) == pytest.approx(record["q_amax"][i] / 448, rel=1e-7)
    ours = [float(q) for q in ss.q_scales]
    want = [a / 448 for a in _reference_q_amax(tiny_llama_dir, list(res.samples.samples))]
    assert ours == pytest.approx(want, rel=1e-6)
    # K/V scales are the same as without --attention-scales, and the file round-trips with its q_scale
    plain = calibrate(str(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L)
    for a, b in zip(plain.scale_set.k_scales, ss.k_scales, strict=True):
        assert torch.equal(a, b)
    back = load_scale_file(tmp_path / "s.safetensors")
    assert back.manifest["schema_version"] == SCHEMA_VERSION == 2
    assert [float(q) for q in back.q_scales] == ours
    assert plain.scale_set.q_scales is None


def _scale_set(model_dir: Path, granularity: str = "tensor", q: bool = True, version: int | None = None):
    kv = kv_spec(load_config(model_dir))
    g = torch.Generator().manual_seed(1)
    shape = (1,) if granularity == "tensor" else (kv.layers[0].kv_heads,)
    ss = make_scale_set(
        "fp8_e4m3",
        granularity,
        [torch.rand(shape, generator=g) * 0.1 + 0.01 for _ in range(kv.num_layers)],
        [torch.rand(shape, generator=g) * 0.1 + 0.01 for _ in range(kv.num_layers)],
        observer="minmax",
        binding=compute_binding(str(model_dir), model_dir, kv),
        q_scales=[torch.rand(1, generator=g) * 0.05 + 0.001 for _ in range(kv.num_layers)] if q else None,
    )
    if version is not None:
        ss.manifest["schema_version"] = version
    return ss


def test_version_1_files_still_load(word_llama_dir: Path, tmp_path: Path) -> None:
    old = save_scale_file(tmp_path / "v1.safetensors", _scale_set(word_llama_dir, q=False, version=1))
    ss = load_scale_file(old)
    assert ss.manifest["schema_version"] == 1 and ss.q_scales is None
    new = load_scale_file(save_scale_file(tmp_path / "v2.safetensors", _scale_set(word_llama_dir)))
    assert new.q_scales is not None and len(new.q_scales) == 2


def test_vllm_export_of_q_scale_loads_with_transformers(word_llama_dir: Path, tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    ss = _scale_set(word_llama_dir)
    summary = export_vllm(ss, word_llama_dir, tmp_path / "out")
    assert summary["q_scale"] is True
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = config["quantization_config"]
    # as llm-compressor 0.14 writes an attention scheme (recorded from a real oneshot; see kvcal.calibrate.export)
    assert qc == quantization_config("tensor", ["LlamaAttention"])
    assert qc["config_groups"]["group_0"]["targets"] == ["LlamaAttention"]
    assert qc["config_groups"]["group_0"]["input_activations"] == qc["kv_cache_scheme"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.config_groups["group_0"].input_activations.num_bits == 8
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"][Q_NAME.format(i=1)] == SCALE_SHARD
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert tuple(attn.q_scale.shape) == (1,)
        torch.testing.assert_close(attn.q_scale.detach(), ss.q_scales[i], rtol=0, atol=0)
        torch.testing.assert_close(attn.k_scale.detach().reshape(-1), ss.k_scales[i], rtol=0, atol=0)
    # per-head K/V with q_scale: one attention scheme cannot hold both; refused
    with pytest.raises(UsageError, match="per-head K/V scales cannot be exported with q_scale"):
        export_vllm(_scale_set(word_llama_dir, "head"), word_llama_dir, tmp_path / "head")
    assert not (tmp_path / "head").exists()


def test_cli_attention_fp8_bad_input_and_calibrate_flag(
    word_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    no_q = save_scale_file(tmp_path / "no_q.safetensors", _scale_set(word_llama_dir, q=False))
    code, _, err = invoke(
        ["eval", str(word_llama_dir), "-f", "fp8_e4m3", "--tasks", "kl", "--scales", str(no_q), "--attention",
         "fp8", "--limit", "1", "--kl-seq-len", "8", "-o", str(tmp_path / "run")]
    )  # fmt: skip
    assert code == 2 and err.startswith("Error: ") and len(err.strip().splitlines()) == 1, err
    assert "q_scale" in err and "kvcal calibrate --attention-scales" in err
    assert not (tmp_path / "run").exists()
    code, _, err = invoke(
        ["eval", str(word_llama_dir), "-f", "nvfp4", "--tasks", "kl", "--attention", "fp8", "--limit", "1",
         "-o", str(tmp_path / "run2")]
    )  # fmt: skip
    assert code == 2 and err.startswith("Error: ") and "fp8_e4m3" in err, err
    code, out, err = invoke(
        ["calibrate", str(word_llama_dir), "-f", "fp8", "-o", str(tmp_path / "q.safetensors"), "--num-samples",
         "2", "--seq-len", "8", "--attention-scales", "--json"]
    )  # fmt: skip
    assert code == 0, err
    assert len(json.loads(out)["q_scales"]) == 2
    assert load_scale_file(tmp_path / "q.safetensors").q_scales is not None
