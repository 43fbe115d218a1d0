"""`--scales first-batch` (vLLM's calculate_kv_scales): each layer's K/V scale is amax / 200 (K) or amax / 100 (V)
of the first write's real tokens, then fixed for every later write of every cache of the runtime."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels.cache import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    FirstBatchScales,
    LayerPlan,
    QuantizedKVCache,
    QuantizedLayer,
)
from kvcal.kernels.runtime import KVRuntime

Model = Callable[..., torch.nn.Module]
Batch = Callable[..., tuple[torch.Tensor, torch.Tensor]]

pytestmark = pytest.mark.usefixtures("one_thread")


def _x(seed: int, t: int, mag: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, t, 32, generator=g) * mag  # [B, H_kv, T, D]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6"])
def test_scales_are_the_first_writes_amax_over_vllms_ranges_then_fixed(fmt: str) -> None:
    f = formats.get_format(fmt)
    store = FirstBatchScales()
    layer = QuantizedLayer(LayerPlan(index=3, fmt=f, first_batch=store))
    k0, v0 = _x(0, 7, 3.0), _x(1, 7, 0.5)
    layer.update(k0, v0)
    k_scale = k0.abs().amax() / K_SCALE_CONSTANT  # vLLM: abs(key).max() / k_range (200)
    v_scale = v0.abs().amax() / V_SCALE_CONSTANT  # abs(value).max() / v_range (100)
    assert torch.equal(store.scales[(3, "k")], k_scale) and torch.equal(store.scales[(3, "v")], v_scale)
    assert store.as_lists() == {
        "k": [None, None, None, float(k_scale)],
        "v": [None, None, None, float(v_scale)],
    }
    # later writes, 100x larger: the scales stay (values beyond the range saturate, as in vLLM)
    k1, v1 = _x(2, 1, 300.0), _x(3, 1, 50.0)
    layer.update(k1, v1)
    assert torch.equal(store.scales[(3, "k")], k_scale)
    want_k = torch.cat([formats.fake_quantize(k, f, k_scale) for k in (k0, k1)], dim=2)
    want_v = torch.cat([formats.fake_quantize(v, f, v_scale) for v in (v0, v1)], dim=2)
    assert torch.equal(formats.dequantize(layer.k, f), want_k)
    assert torch.equal(formats.dequantize(layer.v, f), want_v)
    # a second cache of the same runtime (the next lm-eval batch) reuses them
    other = QuantizedLayer(LayerPlan(index=3, fmt=f, first_batch=store))
    other.update(k1, v1)
    assert torch.equal(formats.dequantize(other.k, f), formats.fake_quantize(k1, f, k_scale))


def test_padding_and_non_finite_values_never_reach_the_scale() -> None:
    f = formats.get_format("fp8_e4m3")
    store = FirstBatchScales()
    cache = QuantizedKVCache([LayerPlan(index=0, fmt=f, first_batch=store)])
    k = _x(4, 6)
    k[1, :, :2] = 1e6  # left padding of sequence 1: huge junk
    k[0, 0, 3, 5] = float("inf")
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    cache.set_attention_mask(mask)
    cache.update(k, k.clone(), 0)
    real = k.clone()
    real[1, :, :2] = 0.0
    real[0, 0, 3, 5] = 0.0
    assert torch.equal(store.scales[(0, "k")], real.abs().amax() / 200)
    # an all-zero first batch gets 1.0 (vLLM would divide by a zero scale)
    zero = FirstBatchScales()
    QuantizedLayer(LayerPlan(index=0, fmt=f, first_batch=zero)).update(
        torch.zeros(1, 1, 2, 32), torch.zeros(1, 1, 2, 32)
    )
    assert zero.scales[(0, "k")].item() == 1.0


class RecordingCache(QuantizedKVCache):
    """The runtime's cache, recording each layer's K/V as the model writes them (post-RoPE)."""

    def __init__(self, plans: list[LayerPlan]):
        super().__init__(plans)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.seen.setdefault(layer_idx, (key_states.detach().clone(), value_states.detach().clone()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_runtime_fixes_each_layers_scales_at_the_first_forward(kv_model: Model, batch: Batch) -> None:
    model = kv_model("llama", head_dim=32)
    ids, _ = batch(length=9, pad=0)
    rt = KVRuntime(model, "fp8_e4m3", first_batch=True, kv_input_dtype="float32", impl="torch")
    cache = RecordingCache(rt.plans)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    seen = cache.seen
    assert sorted(seen) == [0, 1, 2]
    fixed = rt.first_batch.as_lists()
    for i, (k, v) in seen.items():
        assert fixed["k"][i] == float(k.abs().amax() / 200)
        assert fixed["v"][i] == float(v.abs().amax() / 100)
    other_ids, _ = batch(seed=7, length=5, pad=0)
    with torch.no_grad():
        model(other_ids * 0 + 3, past_key_values=rt.new_cache(), use_cache=True)  # another batch: unchanged
    assert rt.first_batch.as_lists() == fixed
    d = rt.describe()
    assert d["scale_source"].startswith("first-batch") and not d["uncalibrated"]
    assert d["first_batch_scales"] == fixed
    # a runtime built with the same store (KvcalLM.activate_runtime after the kl baseline) keeps them
    again = KVRuntime(model, "fp8_e4m3", first_batch=rt.first_batch, impl="torch")
    assert again.first_batch is rt.first_batch
    KVRuntime(model, "auto")


def test_skipped_layers_take_no_first_batch_scale(kv_model: Model, batch: Batch) -> None:
    model = kv_model("gemma3", head_dim=32)
    ids, _ = batch(length=8, pad=0)
    rt = KVRuntime(model, "nvfp4", first_batch=True, skip_layers="sliding_window", impl="torch")
    with torch.no_grad():
        model(ids, past_key_values=rt.new_cache(), use_cache=True)
    assert rt.first_batch.as_lists()["k"] == [None, rt.first_batch.as_lists()["k"][1]]
    KVRuntime(model, "auto")


def test_first_batch_refuses_dynamic_formats_and_scale_files(kv_model: Model) -> None:
    model = kv_model("llama", head_dim=32)
    with pytest.raises(UsageError, match="computes its scales at write time"):
        KVRuntime(model, "int8_per_token_head", first_batch=True)
    with pytest.raises(UsageError, match="one or the other"):
        KVRuntime(model, "fp8_e4m3", first_batch=True, scales=object())
    KVRuntime(model, "auto")
