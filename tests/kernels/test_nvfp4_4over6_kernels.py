"""nvfp4_4over6 shares nvfp4's storage (KVFormat.layout): the torch reference and the Triton kernel (interpreter)
read it as nvfp4, and a model runs on it end to end."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcal import formats
from kvcal.kernels.fast import dequantize_fast
from kvcal.kernels.reference import quantized_attention_ref
from kvcal.kernels.runtime import KVRuntime

pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(seed: int = 0) -> tuple[torch.Tensor, formats.QTensor, formats.QTensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 3, 64, generator=g)
    k = torch.randn(1, 2, 33, 64, generator=g) * 2.0
    v = torch.randn(1, 2, 33, 64, generator=g)
    return q, formats.quantize(k, "nvfp4_4over6", 0.01), formats.quantize(v, "nvfp4_4over6", 0.005)


def test_reference_reads_the_4over6_storage() -> None:
    _, kq, _ = _qkv()
    assert torch.equal(dequantize_fast(kq, "nvfp4_4over6"), formats.dequantize(kq, "nvfp4_4over6"))


def test_triton_kernel_reads_it_as_nvfp4(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from kvcal.kernels import triton_attention as ta

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, kq, vq = _qkv(1)
    kw = dict(scaling=64**-0.5, q_start=30, k_start=0, causal=True)
    out = ta.attention(q, kq, vq, "nvfp4_4over6", **kw)
    assert torch.equal(out, ta.attention(q, kq, vq, "nvfp4", **kw))  # same kernel, same storage
    ref = quantized_attention_ref(q, kq, vq, "nvfp4_4over6", **kw)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_model_runs_on_a_4over6_cache(kv_model: Callable[..., torch.nn.Module]) -> None:
    model = kv_model("gemma3", head_dim=32)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    outs = {}
    for fmt in ("nvfp4", "nvfp4_4over6"):
        rt = KVRuntime(model, fmt, impl="torch", kv_input_dtype="bfloat16")
        with torch.no_grad():
            outs[fmt] = model(ids, past_key_values=rt.new_cache(), use_cache=True).logits
        assert rt.describe()["scale_source"].startswith("uncalibrated (global scale")
    assert torch.isfinite(outs["nvfp4_4over6"]).all() and not torch.equal(outs["nvfp4"], outs["nvfp4_4over6"])
    KVRuntime(model, "auto")
