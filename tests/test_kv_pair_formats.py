"""Separate K and V formats (`--kv-format k=fp8_e4m3,v=nvfp4`): parsing, capacity counting each side's bits, a cache
storing each side exactly as its single format does, attention (torch and Triton) reading each side with its own
format, calibration per side, and exports that refuse a pair no engine loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal import formats
from kvcal.capacity import kv_bytes_per_token
from kvcal.errors import UsageError
from kvcal.formats import kv_pair, parse_kv_format
from kvcal.kernels.cache import LayerPlan, QuantizedLayer
from kvcal.kernels.reference import attention_dense, quantized_attention_ref
from kvcal.models.config import load_config
from kvcal.models.geometry import kv_spec

Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture of tests/conftest.py


def test_parse_pairs() -> None:
    assert parse_kv_format("k=fp8,v=nvfp4") == "k=fp8_e4m3,v=nvfp4"
    assert parse_kv_format(" V=nv_fp4 , K=e4m3 ") == "k=fp8_e4m3,v=nvfp4"
    assert parse_kv_format("k=fp8,v=fp8_e4m3") == "fp8_e4m3"  # the same format on both sides is that format
    k, v = kv_pair("k=int8_per_token_head,v=mxfp4")
    assert (k.name, v.name) == ("int8_per_token_head", "mxfp4")
    assert kv_pair("nvfp4") == (formats.get_format("nvfp4"),) * 2
    for bad, message in (
        ("k=fp8", "needs both sides"),
        ("k=fp8,v=fp8,k=nvfp4", "malformed"),
        ("q=fp8,v=fp8", "malformed"),
        ("k=auto,v=fp8", "cannot be 'auto'"),
        ("k=fp9,v=fp8", "unknown KV format"),
    ):
        with pytest.raises(UsageError, match=message):
            parse_kv_format(bad)


def test_capacity_counts_each_side(word_llama_dir: Path) -> None:
    kv = kv_spec(load_config(word_llama_dir))  # 2 layers, 2 KV heads, head_dim 16
    elems = sum(layer.kv_heads * layer.head_dim for layer in kv.layers)  # per side
    # K: fp8 8 bits; V: nvfp4 4 bits + one E4M3 byte per 16 elements = 4.5 bits (vLLM PR #53770: 12.5 bits a pair)
    assert kv_bytes_per_token(kv, "k=fp8_e4m3,v=nvfp4") == elems * (8 + 4.5) / 8
    assert kv_bytes_per_token(kv, "k=nvfp4,v=fp8_e4m3") == elems * (8 + 4.5) / 8
    assert kv_bytes_per_token(kv, "k=int8_per_token_head,v=mxfp4") == elems * (8 + 32 / 16 + 4 + 8 / 32) / 8
    assert kv_bytes_per_token(kv, "k=fp8,v=fp8") == kv_bytes_per_token(kv, "fp8_e4m3")
    # skipped layers stay 16 bits on both sides
    assert (
        kv_bytes_per_token(kv, "k=fp8,v=nvfp4", frozenset({0}))
        == elems / 2 * (16 + 16) / 8 + elems / 2 * 12.5 / 8
    )


def _write(plan: LayerPlan, k: torch.Tensor, v: torch.Tensor):
    layer = QuantizedLayer(plan)
    kph, _ = layer.update(k, v)
    return layer, kph.kvcal_read


@pytest.mark.parametrize("pair", [("fp8_e4m3", "nvfp4"), ("nvfp4", "int8_per_token_head"), ("mxfp4", "bf16")])
def test_cache_stores_each_side_as_its_single_format(pair: tuple[str, str]) -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 9, 32, generator=g), torch.randn(2, 2, 9, 32, generator=g) * 3
    fk, fv = (formats.get_format(n) for n in pair)
    _, read = _write(LayerPlan(index=0, fmt=fk, v_fmt=fv), k, v)
    _, k_only = _write(LayerPlan(index=0, fmt=fk), k, v)
    _, v_only = _write(LayerPlan(index=0, fmt=fv), k, v)
    for got, want in ((read.k, k_only.k), (read.v, v_only.v)):
        assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
        for a, b in ((got.block_scales, want.block_scales), (got.scale, want.scale)):
            assert (a is None and b is None) or torch.equal(a.float(), b.float())
    assert read.fmt is fk and read.v_fmt is fv
    # attention reads K with K's format and V with V's
    q = torch.randn(2, 4, 9, 32, generator=g)
    kw = dict(scaling=32**-0.5, q_start=0, k_start=0)
    got = quantized_attention_ref(q, read.k, read.v, fk, v_fmt=fv, **kw)
    want = attention_dense(
        q, formats.dequantize(read.k, fk), formats.dequantize(read.v, fv), causal=True, **kw
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _model_and_batch(model_dir: Path) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A fresh copy of the tiny Llama (KVRuntime modifies it) and two prompts, the second left-padded by 3."""
    from kvcal.models.loading import load_model

    model = load_model(model_dir).model
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return model, ids, mask


def test_pair_of_one_format_is_that_format_exactly(tiny_llama_dir: Path) -> None:
    """k=fp8,v=fp8 through the runtime, and a plan that names V's format explicitly, give fp8_e4m3's logits bit
    for bit."""
    from kvcal.kernels.runtime import KVRuntime, install_plans

    model, ids, mask = _model_and_batch(tiny_llama_dir)

    def logits(rt_or_plans) -> torch.Tensor:
        with torch.no_grad():
            return model(ids, attention_mask=mask, past_key_values=rt_or_plans()).logits

    single = KVRuntime(model, "fp8_e4m3", impl="torch")
    want = logits(single.new_cache)
    pair = KVRuntime(model, "k=fp8,v=fp8_e4m3", impl="torch")
    assert pair.kv_format == "fp8_e4m3" and torch.equal(logits(pair.new_cache), want)
    fp8 = formats.get_format("fp8_e4m3")
    explicit = [LayerPlan(index=p.index, fmt=fp8, window=p.window, v_fmt=fp8) for p in single.plans]
    install_plans(model, explicit, "torch")
    from kvcal.kernels.cache import QuantizedKVCache

    assert torch.equal(logits(lambda: QuantizedKVCache(explicit)), want)


def test_pair_runtime_torch_equals_triton(
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """A pair through the Triton kernels (CPU interpreter) against the torch path: the same logits up to the two
    kernels' float32 rounding as amplified by the later layers' FP4/FP8 codes — `batch_bound`, derived here from
    the same comparison through a BF16 cache and the pair's response to BF16 rounding of its K/V input."""
    pytest.importorskip("triton")
    from kvcal.kernels.runtime import KVRuntime

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, ids, mask = _model_and_batch(tiny_llama_dir)
    real = mask.bool()
    out = {}
    for impl, fmt, kin in (
        ("torch", "auto", None),
        ("torch", "bf16", None),
        ("triton", "bf16", None),
        ("torch", "k=fp8_e4m3,v=nvfp4", "bfloat16"),
        ("torch", "k=fp8_e4m3,v=nvfp4", None),
        ("triton", "k=fp8_e4m3,v=nvfp4", None),
        ("torch", "fp8_e4m3", None),
    ):
        rt = KVRuntime(model, fmt, impl=impl, kv_input_dtype=kin)
        if fmt.startswith("k="):
            assert rt.describe()["layer_formats"][0] == "k=fp8_e4m3,v=nvfp4"
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, past_key_values=rt.new_cache()).logits
        out[impl, fmt, kin] = logits[real]  # [N_real, V]: padding positions carry no meaning
    gap = lambda a, b: float((out[a] - out[b]).abs().max())  # noqa: E731
    pair = "k=fp8_e4m3,v=nvfp4"
    bound = batch_bound(
        gap(("torch", pair, None), ("torch", pair, "bfloat16")),
        gap(("triton", "bf16", None), ("torch", "bf16", None)),
        gap(("torch", "bf16", None), ("torch", "auto", None)),
    )
    assert gap(("torch", pair, None), ("triton", pair, None)) <= bound, bound
    assert gap(("torch", pair, None), ("torch", "fp8_e4m3", None)) > bound  # V really is nvfp4


@pytest.mark.usefixtures("one_thread")
def test_calibrate_pair_calibrates_each_side_for_its_format(tiny_llama_dir: Path) -> None:
    from kvcal.calibrate.run import calibrate

    small = dict(num_samples=3, seq_len=16)
    pair = calibrate(str(tiny_llama_dir), "k=fp8_e4m3,v=nvfp4", **small).scale_set
    fp8 = calibrate(str(tiny_llama_dir), "fp8_e4m3", **small).scale_set
    nvfp4 = calibrate(str(tiny_llama_dir), "nvfp4", **small).scale_set
    assert pair.kv_format == "k=fp8_e4m3,v=nvfp4"
    for i in range(pair.num_layers):
        assert torch.equal(pair.k_scales[i], fp8.k_scales[i])
        assert torch.equal(pair.v_scales[i], nvfp4.v_scales[i])


def test_exports_refuse_pairs(word_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    from kvcal.calibrate.export import export_sglang, export_vllm
    from kvcal.scales import compute_binding, make_scale_set, save_scale_file

    kv = kv_spec(load_config(word_llama_dir))
    ss = make_scale_set(
        "k=fp8_e4m3,v=nvfp4", "tensor", [0.1, 0.1], [0.01, 0.01], observer="minmax",
        binding=compute_binding(str(word_llama_dir), word_llama_dir, kv),
    )  # fmt: skip
    for fn, out in ((export_vllm, tmp_path / "v"), (export_sglang, tmp_path / "s.json")):
        with pytest.raises(UsageError, match="one KV cache dtype for K and V"):
            fn(ss, word_llama_dir, out)
        assert not out.exists()
    path = save_scale_file(tmp_path / "pair.safetensors", ss)
    code, _, err = invoke(
        ["export", str(path), str(word_llama_dir), "--to", "vllm", "-o", str(tmp_path / "v")]
    )
    assert code == 2 and err.startswith("Error: ") and len(err.strip().splitlines()) == 1, err
    assert "k=fp8_e4m3,v=nvfp4" in err


def test_eval_runs_a_pair_end_to_end(word_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    """`kvcal eval -f k=fp8_e4m3,v=nvfp4`: the run records the pair, its capacity counts each side, and the
    default run directory name writes the pair file-name-safe."""
    import json

    from kvcal.evaluate.run import EvalConfig, run_dir_name

    out = tmp_path / "run"
    code, stdout, err = invoke(
        ["eval", str(word_llama_dir), "-f", "k=fp8,v=nvfp4", "--tasks", "kl", "--limit", "1", "--kl-seq-len",
         "16", "-o", str(out), "--json"]
    )  # fmt: skip
    assert code == 0, err
    metrics = json.loads(stdout)["metrics"]
    assert metrics["bits_per_element"] == pytest.approx(6.25)
    assert "kv_format: k=fp8_e4m3,v=nvfp4" in (out / "config.yaml").read_text()
    name = run_dir_name(EvalConfig(model=str(word_llama_dir), kv_format="k=fp8,v=nvfp4"))
    assert "__k-fp8_e4m3-v-nvfp4__" in name
