"""vLLM's TurboQuant presets through kvcal's cache and attention: each layer its own rotation, vLLM's boundary
layers in BF16 by default, decode reads what prefill reads, --impl triton through the model (Triton's CPU
interpreter here) against the torch path, and the refusal of sliding-window layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels.runtime import KVRuntime, resolve_impl

pytestmark = pytest.mark.usefixtures("one_thread")
PRESETS = list(formats.TQ_PRESETS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes of codes or scales (float8 / float16 compared bit for bit, NaN included)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


@pytest.mark.parametrize("preset", PRESETS)
def test_each_layer_stores_its_writes_with_the_shared_rotation(
    preset: str, kv_model: Callable[..., torch.nn.Module], batch: Callable[..., Any], kv_recorder: Any
) -> None:
    """Every write of every layer (a padded batch, prefill then decode) stores, for its real tokens, exactly what
    formats.quantize gives its K (the releases' H / sqrt(D), the same for every layer: no per-layer state, none
    in the stored QTensor) and V."""
    model = kv_model("llama", head_dim=16)
    rt = KVRuntime(model, preset, impl="torch")
    rec = kv_recorder(rt)
    ids, mask = batch(length=9, pad=3)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       past_key_values=rt.new_cache())  # fmt: skip
    kf, vf = formats.TQ_PRESETS[preset]
    checked = 0
    for cache in rec.caches:
        for layer, k, v, valid, got_k, got_v in cache.writes:
            real = torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool) if valid is None else valid
            real = real[:, None, :, None].expand(*k.shape[:-1], 1).squeeze(-1)  # [B, H_kv, T_new]
            for x, got, f in ((k, got_k, kf), (v, got_v, vf)):
                want = formats.quantize(x, f)  # KVRuntime without kv_input_dtype: K/V as computed
                assert torch.equal(_bits(got.codes[real]), _bits(want.codes[real])), (layer, f.name)
                if want.block_scales is not None:
                    assert torch.equal(_bits(got.block_scales[real]), _bits(want.block_scales[real])), layer
                assert got.scale is None
            checked += 1
    assert checked >= 2 * 4


def test_boundary_layers_are_bf16(kv_model: Callable[..., torch.nn.Module]) -> None:
    """`kvcal eval`'s binding (kvcal.evaluate.bound) adds vLLM's boundary layers, the first and last 2 capped at
    half the layers (3 layers: 0 and 2), to the skipped ones, which the runtime keeps in BF16."""
    from kvcal.evaluate.spec import EvalConfig, eval_spec

    model = kv_model("llama", head_dim=16)
    boundary = formats.tq_boundary_layers(model.config.num_hidden_layers)
    assert boundary == {0, 2}
    rt = KVRuntime(model, "turboquant_4bit_nc", impl="torch", skip_layers=boundary)
    assert [p.fmt.name for p in rt.plans] == ["bf16", "tq_mse4_nc", "bf16"]
    assert rt.plans[1].side_format("v").name == "tq_uniform4"
    assert rt.describe()["layers"][1]["format"] == "turboquant_4bit_nc"
    spec = eval_spec(EvalConfig(model="m", kv_format="turboquant_4bit_nc", tasks=["kl"]))
    assert spec.tq_boundary_layers == 2 and spec.recorded_fields()["tq_boundary_layers"] == 2
    assert eval_spec(EvalConfig(model="m", kv_format="nvfp4", tasks=["kl"])).recorded_fields()["tq_boundary_layers"] is None
    with pytest.raises(UsageError, match="--tq-boundary-layers"):
        eval_spec(EvalConfig(model="m", kv_format="turboquant_4bit_nc", tasks=["kl"], tq_boundary_layers=-1))


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_decode_reads_what_prefill_reads(
    preset: str, kv_model: Callable[..., torch.nn.Module], batch: Callable[..., Any]
) -> None:
    """A sequence prefilled at once and the same tokens fed one per forward store the same codes, so their last
    logits agree to float rounding (the attention's split differs)."""
    model = kv_model("llama", head_dim=16)
    rt = KVRuntime(model, preset, impl="torch")
    ids, _ = batch(length=8, pad=0)
    ids = ids[:1]
    with torch.no_grad():
        full = model(input_ids=ids, past_key_values=rt.new_cache()).logits[:, -1]
        cache = rt.new_cache()
        for t in range(ids.shape[1]):
            step = model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits[:, -1]
    assert torch.allclose(full, step, rtol=0, atol=1e-4)


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_k3v4_nc"])
def test_triton_impl_through_the_model_matches_torch(
    preset: str,
    monkeypatch: pytest.MonkeyPatch,
    kv_model: Callable[..., torch.nn.Module],
    batch: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """--impl triton reads the TurboQuant cache (FP8 keys; MSE keys in the rotated domain; uniform values): a
    left-padded prefill and one decode step through the model (GQA 4 / 2, head_dim 16, so padded kernel tiles)
    give the torch path's logits up to the two attention kernels' float32 rounding as the later layers' codes
    amplify it — held to `batch_bound`, derived from the same comparison through a BF16 cache and the preset's
    own response to BF16 rounding of its input (tests/conftest.py). The tight check of the kernel's arithmetic
    is tests/kernels/test_triton_kernels.py's, against the reference on the same storage."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = kv_model("llama", head_dim=16)
    ids, mask = batch(length=9, pad=3)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)

    def logits(impl: str, fmt: str, kin: str | None = None) -> torch.Tensor:
        """The real positions' prefill logits and the decode step's: [N_real + B, V]."""
        rt = KVRuntime(model, fmt, impl=impl, kv_input_dtype=kin)
        assert rt.impl == ("transformers" if fmt == "auto" else impl)
        cache = rt.new_cache()
        with torch.no_grad():
            pre = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits  # [B, T, V]
            step = model(input_ids=ids[:, -1:], attention_mask=step_mask, past_key_values=cache).logits
        return torch.cat([pre[mask.bool()], step[:, -1]])

    out = {
        (impl, fmt, kin): logits(impl, fmt, kin)
        for impl, fmt, kin in (
            ("torch", "auto", None),
            ("torch", "bf16", None),
            ("triton", "bf16", None),
            ("torch", preset, "bfloat16"),
            ("torch", preset, None),
            ("triton", preset, None),
        )
    }
    gap = lambda a, b: float((out[a] - out[b]).abs().max())  # noqa: E731
    bound = batch_bound(
        gap(("torch", preset, None), ("torch", preset, "bfloat16")),
        gap(("triton", "bf16", None), ("torch", "bf16", None)),
        gap(("torch", "bf16", None), ("torch", "auto", None)),
    )
    assert gap(("triton", preset, None), ("torch", preset, None)) <= bound, bound
    assert gap(("torch", preset, None), ("torch", "auto", None)) > bound  # the preset's quantization is visible


def test_auto_impl_and_sliding_layers(
    monkeypatch: pytest.MonkeyPatch, kv_model: Callable[..., torch.nn.Module]
) -> None:
    """--impl auto picks what it picks for every format (torch without CUDA); sliding-window layers stay refused
    under either implementation (vLLM's TurboQuant attention takes no window) unless kept in BF16."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # --impl triton accepted on this machine: the refusal is the window's
    model = kv_model("llama", head_dim=16)
    assert KVRuntime(model, "turboquant_4bit_nc", impl="auto").impl == resolve_impl("auto", torch.device("cpu"))
    gemma = kv_model("gemma3", head_dim=16)  # sliding, full, sliding
    for impl in ("torch", "triton"):
        with pytest.raises(UsageError, match="sliding_window"):
            KVRuntime(gemma, "turboquant_k8v4", impl=impl)
    rt = KVRuntime(gemma, "turboquant_k8v4", impl="torch", skip_layers="sliding_window")
    assert [p.skipped for p in rt.plans] == [True, False, True]
