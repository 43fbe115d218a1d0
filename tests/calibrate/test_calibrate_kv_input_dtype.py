"""`kvcal calibrate --kv-input-dtype`: the observers see K/V rounded as `kvcal eval` quantizes them; the scale
file records the dtype observed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvcal.calibrate.data import build_samples, load_texts
from kvcal.calibrate.run import calibrate
from kvcal.models.loading import load_model
from kvcal.scales import ScaleSet

N, L = 4, 24

pytestmark = pytest.mark.usefixtures("one_thread")


def _amax_per_layer(model_dir: Path, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """amax of each layer's K over the calibration samples, after rounding K to `dtype` (plain DynamicCache)."""
    lm = load_model(model_dir)
    data = build_samples(load_texts(None), lm.tokenizer, N, L, seed=0)
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for ids in data.samples:
            cache = DynamicCache()
            lm.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                a = layer.keys.to(dtype).float().abs().amax()
                out[i] = torch.maximum(out.get(i, a), a)
    return out


def test_scales_are_measured_on_bf16_rounded_kv_and_the_file_says_so(tiny_llama_dir: Path) -> None:
    bf16 = calibrate(str(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L, kv_input_dtype="bf16")
    as_is = calibrate(str(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L)
    assert bf16.scale_set.manifest["calibration"]["kv_input_dtype"] == "bfloat16"
    assert as_is.scale_set.manifest["calibration"]["kv_input_dtype"] == "float32"  # the model's dtype
    want = _amax_per_layer(tiny_llama_dir, torch.bfloat16)
    for i, a in want.items():
        assert torch.equal(bf16.scale_set.k_scales[i].reshape(()), a / 448)
    assert any(
        not torch.equal(x, y) for x, y in zip(bf16.scale_set.k_scales, as_is.scale_set.k_scales, strict=True)
    )
    legacy = ScaleSet("fp8_e4m3", "tensor", [], [], {"calibration": {"dtype": "float32"}})
    assert legacy.kv_input_dtype == "float32"  # a file written before the option
    assert (
        ScaleSet("fp8_e4m3", "tensor", [], [], {"calibration": {"dtype": "bfloat16"}}).kv_input_dtype
        == "bfloat16"
    )
