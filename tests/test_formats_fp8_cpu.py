"""fp8_e4m3_cpu / fp8_e5m2_cpu: vLLM's CPU build's FP8 stores (mantissa truncated toward zero), exactly; held to
the engine's own bytes by tests/conformance/test_vllm_cpu_fp8.py where the CPU runs the engine's FP8 path (AVX-512
/ AMX)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.engines import EngineSetup, commands_dict

# every finite non-negative E4M3 value, ascending (byte 0x00 .. 0x7E); E5M2's (0x00 .. 0x7B, before inf)
E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E5M2 = torch.arange(0, 0x7C, dtype=torch.uint8).view(torch.float8_e5m2).float()


def _truncated(v: float, grid: torch.Tensor = E4M3) -> float:
    """The largest grid magnitude <= |v| (saturating at the grid's maximum), with v's sign: truncation toward
    zero."""
    mag = min(abs(v), float(grid.max()))
    below = grid[grid <= mag]
    return float(below.max()) * (1.0 if v >= 0 else -1.0)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.floats(min_value=-1000.0, max_value=1000.0, allow_nan=False, width=32), min_size=1, max_size=64),
    st.sampled_from([1.0, 0.37, 2.5, 1e-3]),
)
def test_cpu_store_truncates_toward_zero(values: list[float], scale: float) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    q = formats.quantize(x, "fp8_e4m3_cpu", scale)
    got = q.codes.float()
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    v = (x * inv).tolist()  # the engine multiplies by float32(1 / scale)
    want = torch.tensor([_truncated(t) for t in v])
    assert torch.equal(got.abs(), want.abs())
    assert torch.equal(formats.dequantize(q, "fp8_e4m3_cpu"), got * float(q.scale))
    # never larger in magnitude than round-to-nearest (kvcal's fp8_e4m3, the GPU store)
    rne = formats.quantize(x, "fp8_e4m3", scale).codes.float()
    assert bool((got.abs() <= rne.abs()).all())


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e5, max_value=1e5, allow_nan=False, width=32), min_size=1, max_size=64),
    st.sampled_from([1.0, 0.37, 2.5, 1e-3, 1e4]),
)
def test_cpu_e5m2_store_truncates_toward_zero(values: list[float], scale: float) -> None:
    """Every finite value, subnormal codes and saturation included (1e4 scales values down into E5M2's
    subnormals, 1e-3 up past 57344)."""
    x = torch.tensor(values, dtype=torch.float32)
    q = formats.quantize(x, "fp8_e5m2_cpu", scale)
    got = q.codes.float()
    v = (x * torch.tensor(1.0 / scale, dtype=torch.float32)).tolist()
    want = torch.tensor([_truncated(t, E5M2) for t in v])
    assert torch.equal(got.abs(), want.abs())
    assert torch.equal(formats.dequantize(q, "fp8_e5m2_cpu"), got * float(q.scale))
    rne = formats.quantize(x, "fp8_e5m2", scale).codes.float()
    assert bool((got.abs() <= rne.abs()).all())


def test_cpu_e5m2_special_values() -> None:
    """What float_to_fp8e5m2_scalar does at the edges: 1.7 -> 1.5 (RNE 1.75), NaN and +-inf saturate at 57344,
    a value under the smallest subnormal (2**-16) keeps its sign as -0, subnormals truncate (3.9 * 2**-16 -> 3)."""
    x = torch.tensor([1.7, float("nan"), float("inf"), -float("inf"), -1e-9, 3.9 * 2.0**-16, 0.0, 6e4, -2.0**-15])
    b = formats.quantize(x, "fp8_e5m2_cpu").codes.view(torch.uint8)
    got = b.view(torch.float8_e5m2).float().tolist()
    assert got[0] == 1.5 and got[1] == 57344.0 and got[2] == 57344.0 and got[3] == -57344.0
    assert b[4].item() == 0x80 and got[5] == 3 * 2.0**-16 and b[6].item() == 0 and got[7] == 57344.0
    assert got[8] == -(2.0**-15)
    assert formats.quantize(x[:1], "fp8_e5m2").codes.float().item() == 1.75  # RNE rounds 1.7 up
    assert torch.equal(formats.cpu_e5m2_bytes(x), b)


def test_cpu_store_special_values() -> None:
    x = torch.tensor([124.3, 0.0137, float("nan"), -1e-9, 500.0, -3.0, 0.0, float("inf"), -float("inf")])
    b = formats.quantize(x, "fp8_e4m3_cpu").codes.view(torch.uint8)
    got = b.view(torch.float8_e4m3fn).float().tolist()
    assert got[0] == 120.0 and got[1] == 7 * 2.0**-9 and got[2] == 448.0 and got[4] == 448.0 and got[5] == -3.0
    assert b[3].item() == 0x80 and b[6].item() == 0 and got[7] == 448.0 and got[8] == -448.0
    assert formats.quantize(x[:1], "fp8_e4m3").codes.float().item() == 128.0  # RNE rounds 124.3 up


def test_cpu_store_commands() -> None:
    for cpu, engine_dtype, rne in (("fp8_e4m3_cpu", "fp8", "fp8_e4m3"), ("fp8_e5m2_cpu", "fp8_e5m2", "fp8_e5m2")):
        d = commands_dict(EngineSetup("ckpt", cpu, dtype="bfloat16", tasks=("wikitext",)))
        assert d["vllm-cpu"]["serve_argv"][5:7] == ["--kv-cache-dtype", engine_dtype]
        assert "rounds to nearest" in d["vllm"]["refused"] and f"evaluate {rne}" in d["vllm"]["refused"]
        notes = commands_dict(EngineSetup("ckpt", rne, dtype="bfloat16"))["vllm-cpu"]["notes"]
        assert any(f"-f {cpu}" in n for n in notes)
