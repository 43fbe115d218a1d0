"""`--kv-input-dtype`: K/V reach the quantizer in the engine's serving dtype (bf16 by default), recorded in runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.evaluate.spec import EvalConfig, eval_spec, run_dir_name
from kvcal.kernels.cache import LayerPlan, NonFiniteCount, QuantizedLayer
from kvcal.kernels.runtime import KVRuntime
from kvcal.rundir import RunConfig

Model = Callable[..., torch.nn.Module]
QUANT = ["fp8_e4m3", "int8_per_token_head", "nvfp4", "nvfp4_4over6", "fp4_e2m1", "mxfp4"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _x(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 5, 32, generator=g) * torch.logspace(
        -3, 3, 32
    )  # [B, H_kv, T, D], not bf16 values


@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None])
def test_the_quantizer_sees_kv_rounded_to_the_input_dtype(fmt: str, dtype: torch.dtype | None) -> None:
    f = formats.get_format(fmt)
    x = _x(0)
    layer = QuantizedLayer(LayerPlan(index=0, fmt=f, kv_input_dtype=dtype))
    layer.update(x, x)
    rounded = x if dtype is None else x.to(dtype)
    scale = 1.0 if f.layout == "nvfp4" else None  # the cache's default global for nvfp4 without a scale file
    assert torch.equal(formats.dequantize(layer.k, f), formats.fake_quantize(rounded.float(), f, scale))


def test_bf16_rounding_lands_on_e2m1_midpoints() -> None:
    # the issue's mechanism: a float32 K value just above an E2M1 midpoint (after mxfp4's power-of-two scale)
    # rounds up; its bf16 rounding lies ON the midpoint and RNE sends it down
    x = torch.zeros(1, 1, 1, 32)
    x[..., 0] = 6.0  # block max -> shared exponent 0
    x[..., 1] = 2.5 + 2.0**-12  # float32: above the 2 | 3 midpoint; bf16: exactly 2.5
    f32 = QuantizedLayer(LayerPlan(index=0, fmt=formats.get_format("mxfp4")))
    b16 = QuantizedLayer(LayerPlan(index=0, fmt=formats.get_format("mxfp4"), kv_input_dtype=torch.bfloat16))
    f32.update(x, x)
    b16.update(x, x)
    assert formats.dequantize(f32.k, "mxfp4")[..., 1].item() == 3.0
    assert formats.dequantize(b16.k, "mxfp4")[..., 1].item() == 2.0


def test_an_overflow_of_the_input_dtype_is_counted_as_non_finite() -> None:
    count = NonFiniteCount(1)
    x = torch.ones(1, 1, 2, 32)
    x[0, 0, 1, 3] = 1e5  # beyond float16's 65504: Inf once the engine holds it in float16
    layer = QuantizedLayer(
        LayerPlan(index=0, fmt=formats.get_format("fp8_e4m3"), kv_input_dtype=torch.float16), count
    )
    layer.update(x, x)
    assert count.take()["total"] == 2  # K and V


def test_runtime_parses_and_reports_the_input_dtype(kv_model: Model) -> None:
    model = kv_model("llama", head_dim=32)
    rt = KVRuntime(model, "mxfp4", kv_input_dtype="bf16", impl="torch")
    assert {p.kv_input_dtype for p in rt.plans} == {torch.bfloat16}
    assert rt.describe()["kv_input_dtype"] == "bfloat16"
    assert {p.kv_input_dtype for p in KVRuntime(model, "mxfp4", impl="torch").plans} == {None}
    with pytest.raises(UsageError, match="kv-input-dtype 'int8'"):
        KVRuntime(model, "mxfp4", kv_input_dtype="int8")
    KVRuntime(model, "auto")


def test_runs_record_it_for_quantized_formats_and_old_runs_read_as_float32() -> None:
    cfg = EvalConfig(model="smollm2", kv_format="mxfp4")
    assert cfg.kv_input_dtype == "bfloat16"  # the engine's serving dtype by default
    assert eval_spec(cfg).recorded_kv_input_dtype == "bfloat16"
    for fmt in ("bf16", "auto"):
        assert eval_spec(EvalConfig(model="smollm2", kv_format=fmt)).recorded_kv_input_dtype is None
    assert run_dir_name(cfg) == "smollm2__mxfp4__none__skip-none"
    opt_out = EvalConfig(model="smollm2", kv_format="mxfp4", kv_input_dtype="fp32")
    assert run_dir_name(opt_out) == "smollm2__mxfp4__none__skip-none__kvin-float32"
    base = {"model": "m", "model_dir": "", "kv_format": "mxfp4", "tasks": ["kl"]}
    old = RunConfig.from_dict(base)  # written before --kv-input-dtype
    assert "kv_input_dtype" not in old.to_dict() and old.kv_input_dtype_or_legacy == "float32"
    new = RunConfig.from_dict({**base, "kv_input_dtype": "bfloat16"})
    assert new.to_dict()["kv_input_dtype"] == "bfloat16"
    assert new.identity() != old.identity()  # an old run is never taken for a bf16-input run
    assert RunConfig.from_dict({**base, "kv_format": "bf16"}).kv_input_dtype_or_legacy is None
