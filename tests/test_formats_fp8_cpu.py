"""fp8_e4m3_cpu: vLLM's CPU build's FP8 store (mantissa truncated toward zero), exactly; held to the engine's own
bytes by tests/conformance/test_vllm_cpu_fp8.py where the CPU runs the engine's FP8 path (AVX-512 / AMX)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.engines import EngineSetup, commands_dict

# every finite non-negative E4M3 value, ascending (byte 0x00 .. 0x7E)
E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _truncated(v: float) -> float:
    """The largest E4M3 magnitude <= |v| (saturating at 448), with v's sign: truncation toward zero."""
    mag = min(abs(v), 448.0)
    below = E4M3[E4M3 <= mag]
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


def test_cpu_store_special_values() -> None:
    x = torch.tensor([124.3, 0.0137, float("nan"), -1e-9, 500.0, -3.0, 0.0, float("inf"), -float("inf")])
    b = formats.quantize(x, "fp8_e4m3_cpu").codes.view(torch.uint8)
    got = b.view(torch.float8_e4m3fn).float().tolist()
    assert got[0] == 120.0 and got[1] == 7 * 2.0**-9 and got[2] == 448.0 and got[4] == 448.0 and got[5] == -3.0
    assert b[3].item() == 0x80 and b[6].item() == 0 and got[7] == 448.0 and got[8] == -448.0
    assert formats.quantize(x[:1], "fp8_e4m3").codes.float().item() == 128.0  # RNE rounds 124.3 up


def test_cpu_store_commands() -> None:
    d = commands_dict(EngineSetup("ckpt", "fp8_e4m3_cpu", dtype="bfloat16", tasks=("wikitext",)))
    assert d["vllm-cpu"]["serve_argv"][5:7] == ["--kv-cache-dtype", "fp8"]
    assert "rounds to nearest" in d["vllm"]["refused"]
    notes = commands_dict(EngineSetup("ckpt", "fp8_e4m3", dtype="bfloat16"))["vllm-cpu"]["notes"]
    assert any("fp8_e4m3_cpu" in n for n in notes)
