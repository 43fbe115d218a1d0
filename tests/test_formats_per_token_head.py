"""fp8_per_token_head, int8_per_token_head, int4_per_token_head and float16 against transcriptions of vLLM's kernels.

The transcriptions follow the Triton kernels line by line, one (token, head) row at a time in float32 scalars:
vllm/v1/attention/ops/triton_reshape_and_cache_flash.py of vLLM 0.32.0 and 0.33.0 (`_reshape_cache_per_token_head`;
INT8: launch constants 127 / -128 and IS_INT_QUANT, round half away from zero before the truncating store; the
release's own kernel runs in tests/conformance) and vllm/v1/attention/ops/int4_per_token_head.py @
055e47c28003156421365af985d676fc921cb075 (`_reshape_cache_int4_kernel`, `single_rht`, `_get_rht_signs`, the
PyTorch butterfly of `fast_hadamard_transform`, `unified_attention_int4`). kvcal's versions are vectorised over rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels.reference import quantized_attention_ref

F32 = np.float32


# ---- transcriptions (one row at a time, numpy float32 scalars: every op rounds to float32 as the kernel's) ----


def vllm_pth_row(
    x: np.ndarray, quant_max: float, quant_min: float, is_int: bool = False
) -> tuple[list[np.float32], np.float32]:
    """`_reshape_cache_per_token_head` for one (token, head), up to its store: (the clamped float32 values
    `tl.store` is handed, scale). One kernel for FP8 (+-448) and INT8 (127 / -128, IS_INT_QUANT: +-0.5 first):
    only the constants and the cache pointer's dtype differ."""
    amax = F32(0.0)
    for e in x:
        amax = max(amax, F32(abs(e)))
    k_scale = max(F32(amax / F32(quant_max)), F32(1e-6))
    inv = F32(F32(1.0) / k_scale)
    q = [F32(e * inv) for e in x]
    if is_int:  # "Round half away from zero before the int8 store truncates."
        q = [F32(v + F32(0.5)) if v >= 0 else F32(v - F32(0.5)) for v in q]
    return [min(max(v, F32(quant_min)), F32(quant_max)) for v in q], k_scale


def triton_store_to_int8(y: np.float32) -> int:
    """`tl.store` of a float32 into an int8 pointer: Triton converts with fptosi, truncation toward zero
    (checked against Triton's own interpreter in test_triton_store_into_int8_truncates)."""
    return int(np.trunc(y))


def vllm_fp8_pth_row(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """FP8 per-token-head: (e4m3 code values as float32, scale). tl.store into a float8e4nv pointer rounds to
    nearest even (torch's cast does the same)."""
    q, s = vllm_pth_row(x, 448.0, -448.0)
    return torch.from_numpy(np.array(q, dtype=F32)).to(torch.float8_e4m3fn).float().numpy(), s


def vllm_int8_pth_row(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """INT8 per-token-head: (int8 codes, scale)."""
    q, s = vllm_pth_row(x, 127.0, -128.0, is_int=True)
    return np.array([triton_store_to_int8(v) for v in q], dtype=np.int8), s


def vllm_signs(d: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9 + 0 * 0x517CC1B7)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5, device="cpu"), generator=gen) - 1.0


def vllm_fwht(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        a = xv[..., 0, :]
        b = xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def vllm_single_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    d1 = vllm_signs(x.shape[-1])
    return vllm_fwht(x) * d1 if inverse else vllm_fwht(x * d1)


def _rha(y: np.float32) -> np.float32:
    """tl.where(y >= 0, (y + 0.5).to(int32), (y - 0.5).to(int32)).to(float32)"""
    return F32(int(F32(y + F32(0.5)))) if y >= 0 else F32(int(F32(y - F32(0.5))))


def vllm_int4_row(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """`_reshape_cache_int4_kernel` for one (token, head) of already rotated values: (packed bytes, scale word)."""
    k_min = F32(min(x))
    k_max = F32(max(x))
    k_scale = max(F32(F32(k_max - k_min) / F32(15.0)), F32(1e-6))
    t = F32(F32(-k_min) / k_scale)
    zp = min(max(_rha(t), F32(0.0)), F32(15.0))
    inv = F32(F32(1.0) / k_scale)
    q = [min(max(_rha(F32(F32(e * inv) + zp)), F32(0.0)), F32(15.0)) for e in x]
    packed = np.array([(int(q[2 * i]) & 0xF) | ((int(q[2 * i + 1]) & 0xF) << 4) for i in range(len(x) // 2)], np.uint8)
    bits = np.array([k_scale], F32).view(np.int32)[0]
    word = np.array([(int(bits) & -16) | (int(zp) & 0xF)], np.int32).view(F32)[0]
    return packed, word


def vllm_int4_write(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reshape_and_cache_int4: key = single_rht(key.float()).to(key.dtype), then the kernel per row."""
    xr = vllm_single_rht(x.float()).to(x.dtype).float().numpy().reshape(-1, x.shape[-1])
    rows = [vllm_int4_row(r) for r in xr]
    packed = torch.from_numpy(np.stack([r[0] for r in rows])).reshape(*x.shape[:-1], -1)
    words = torch.from_numpy(np.array([r[1] for r in rows], F32)).reshape(*x.shape[:-1], 1)
    return packed, words


# ---- inputs ----


def _rows(seed: int, d: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 2, n, d] K/V with the edge values: +-0, subnormals, tiny and huge magnitudes, an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, n, d, generator=g) * torch.exp(torch.randn(1, 2, n, 1, generator=g) * 3)
    edge = torch.tensor([0.0, -0.0, 1e-40, -1e-41, 3e-39, 1e-30, -7e4, 65504.0, 448.0, -1e-6])
    x[0, 0, 0, : min(d, edge.numel())] = edge[:d]
    x[0, 1, 0] = 0.0  # all-zero row
    if n > 1:
        x[0, 1, 1] = -0.0
    return x.to(dtype)


# ---- fp8_per_token_head ----


PTH_ROWS = {
    "fp8_per_token_head": (vllm_fp8_pth_row, torch.float8_e4m3fn),
    "int8_per_token_head": (vllm_int8_pth_row, torch.int8),
}


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from([64, 96, 80, 130, 7]),
    dtype=st.sampled_from(["bf16", "f32"]),
    fmt=st.sampled_from(sorted(PTH_ROWS)),
)
def test_per_token_head_equals_vllm(seed: int, d: int, dtype: str, fmt: str) -> None:
    """FP8 and INT8 per-token-head codes and scales bit for bit against vLLM's write (INT8: rounded half away from zero),
    any head_dim (vLLM masks a padded power-of-two tile: odd D works)."""
    row, code_dtype = PTH_ROWS[fmt]
    x = _rows(seed, d, 3, torch.bfloat16 if dtype == "bf16" else torch.float32)
    q = formats.quantize(x, fmt)
    assert q.codes.dtype == code_dtype and q.block_scales.shape == (1, 2, 3, 1)
    for h in range(2):
        for t in range(3):
            codes, s = row(x[0, h, t].float().numpy())
            assert q.block_scales[0, h, t, 0].numpy().view(np.int32) == np.array([s], F32).view(np.int32)[0]
            assert np.array_equal(q.codes[0, h, t].float().numpy().view(np.int32), codes.astype(F32).view(np.int32))
    assert torch.equal(formats.dequantize(q, fmt), q.codes.float() * q.block_scales)


def test_fp8_per_token_head_saturation_zero_rows_and_nonfinite() -> None:
    x = torch.zeros(1, 1, 4, 8)
    x[0, 0, 1] = torch.tensor([1e30, -1e30, 1.0, 0, 0, 0, 0, 0])
    x[0, 0, 2] = torch.tensor([float("nan"), 2.0, -1.0, float("inf"), float("-inf"), 0, 0, 0])
    x[0, 0, 3] = torch.tensor([-0.0, 1e-42, 0, 0, 0, 0, 0, 0])
    q = formats.quantize(x, "fp8_per_token_head")
    s = q.block_scales[0, 0, :, 0]
    assert s[0] == torch.tensor(1e-6, dtype=torch.float32) and torch.all(q.codes[0, 0, 0].float() == 0)
    assert q.codes[0, 0, 1, :2].float().tolist() == [448.0, -448.0]  # the row maximum is the largest code
    # NaN/Inf: the scale comes from the finite values (2.0 / 448); NaN stays NaN, +-Inf saturates to +-448
    assert s[2] == torch.tensor(2.0) / 448.0
    c2 = q.codes[0, 0, 2].float()
    assert math.isnan(c2[0]) and c2[1] == 448.0 and c2[3] == 448.0 and c2[4] == -448.0
    assert math.isnan(formats.dequantize(q, "fp8_per_token_head")[0, 0, 2, 0])
    # a subnormal row: floored scale 1e-6, codes 0
    assert s[3] == torch.tensor(1e-6) and torch.all(q.codes[0, 0, 3].float() == 0)


# ---- int8_per_token_head ----


def test_int8_per_token_head_rounds_half_away_hand_computed() -> None:
    # amax 7.9375 = 127 / 16: scale 1/16 and its reciprocal 16 exact; x * 16 = 127, -0.5, 1.5, 2.5, -3.5, 1.6, -127
    x = torch.tensor([7.9375, -0.03125, 0.09375, 0.15625, -0.21875, 0.1, -7.9375, 0.0]).reshape(1, 1, 1, 8)
    q = formats.quantize(x, "int8_per_token_head")
    assert q.block_scales.item() == 0.0625
    assert q.codes.flatten().tolist() == [127, -1, 2, 3, -4, 2, -127, 0]  # ties away from zero (not to even)
    # the row maximum itself is stored as +-127: amax 0.5 -> scale 0.5/127 rounded to float32, 0.5 * float32(1 /
    # scale) within half a code of 127
    y = torch.tensor([0.5, -0.5, 0.25, 0.0]).reshape(1, 1, 1, 4)
    s = np.float32(np.float32(0.5) / np.float32(127.0))
    top = np.float32(np.float32(0.5) * np.float32(np.float32(1.0) / s))
    assert abs(float(top) - 127.0) < 0.5
    assert formats.quantize(y, "int8_per_token_head").codes.flatten().tolist() == [127, -127, 64, 0]


def test_int8_per_token_head_zero_rows_and_nonfinite() -> None:
    x = torch.zeros(1, 1, 3, 6)
    x[0, 0, 1] = torch.tensor([float("nan"), 2.0, -1.0, float("inf"), float("-inf"), 0.0])
    x[0, 0, 2] = torch.tensor([-0.0, 1e-42, 0, 0, 0, 0])
    q = formats.quantize(x, "int8_per_token_head")
    s = q.block_scales[0, 0, :, 0]
    assert s[0] == torch.tensor(1e-6) and s[2] == torch.tensor(1e-6)  # vLLM's floor, codes 0
    assert q.codes[0, 0, 0].tolist() == [0] * 6 and q.codes[0, 0, 2].tolist() == [0] * 6
    # kvcal's non-finite policy: the scale from the finite values, NaN -> the NaN marker, +-Inf -> +-127
    assert s[1] == torch.tensor(2.0) / 127.0
    assert q.codes[0, 0, 1].tolist() == [formats.INT8_NAN, 127, -64, 127, -127, 0]  # -63.5 away from zero
    y = formats.dequantize(q, "int8_per_token_head")[0, 0, 1]
    assert math.isnan(y[0]) and torch.isfinite(y[1:]).all()


def test_triton_store_into_int8_truncates(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the transcription assumes of `tl.store` into vLLM's int8 cache, asked of Triton itself (its
    interpreter; on a GPU the same conversion is PTX cvt.rzi.s8.f32)."""
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def store(src: Any, dst: Any, n: Any, BLOCK: tl.constexpr) -> None:
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    kern = triton.jit(store)
    y = torch.tensor([126.99, -126.99, 0.5, -0.5, 1.5, -2.5, 127.0, -128.0, 63.7])
    out = torch.zeros(y.numel(), dtype=torch.int8)
    kern[(1,)](y, out, y.numel(), BLOCK=16)
    assert out.tolist() == [126, -126, 0, 0, 1, -2, 127, -128, 63]
    assert out.tolist() == [triton_store_to_int8(np.float32(v)) for v in y.tolist()]


# ---- int4_per_token_head ----


def test_rht_is_vllms_and_inverts() -> None:
    for d in (2, 16, 64, 256):
        assert torch.equal(formats.rht_signs(d), vllm_signs(d))
        x = torch.randn(5, d)
        assert torch.equal(formats.rht(x), vllm_single_rht(x))
        assert torch.equal(formats.rht(x, inverse=True), vllm_single_rht(x, inverse=True))
        h = formats.hadamard(torch.eye(d))
        assert torch.equal(h @ h, d * torch.eye(d))  # H H = d I exactly (entries +-1, sums of integers)
        assert torch.allclose(formats.rht(formats.rht(x), inverse=True) / d, x, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([2, 16, 64, 128, 256]), dtype=st.sampled_from(["bf16", "f32"]))
def test_int4_per_token_head_equals_vllm(seed: int, d: int, dtype: str) -> None:
    """Packed codes (element 2i low nibble) and the scale word (zero point in its 4 low bits) bit for bit,
    including the rotation rounded to the K/V dtype (bf16 here, as the engine holds a bf16 model's K/V)."""
    x = _rows(seed, d, 3, torch.bfloat16 if dtype == "bf16" else torch.float32)
    q = formats.quantize(x, "int4_per_token_head")
    packed, words = vllm_int4_write(x)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (1, 2, 3, d // 2)
    assert torch.equal(q.codes, packed)
    assert torch.equal(q.block_scales.view(torch.int32), words.view(torch.int32))


def test_int4_dequantize_is_vllms_attention() -> None:
    """formats.dequantize un-rotates ((code - zp) * scale, then rht(., inverse) / D). vLLM's read path instead
    rotates q, scores (q_r . codes - sum(q_r) zp) * scale * sm_scale / D and rotates the output back: the same
    attention up to float32 rounding (computed here in float64 from the stored codes)."""
    torch.manual_seed(3)
    d, tk = 64, 19
    k = torch.randn(1, 1, tk, d).bfloat16()
    v = torch.randn(1, 1, tk, d).bfloat16()
    q = torch.randn(1, 1, 1, d)
    kq, vq = formats.quantize(k, "int4_per_token_head"), formats.quantize(v, "int4_per_token_head")

    def side(x: formats.QTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = x.codes.double()
        codes = torch.stack((c % 16, torch.div(c, 16, rounding_mode="floor")), -1).flatten(-2)  # [.., tk, d]
        bits = x.block_scales.view(torch.int32)
        return codes, (bits & -16).view(torch.float32).double(), (bits & 0xF).double()

    kc, ks, kz = side(kq)
    vc, vs, vz = side(vq)
    qr = vllm_single_rht(q.double())  # [1, 1, 1, d]
    s = (qr @ kc.transpose(-1, -2) - qr.sum(-1, keepdim=True) * kz.transpose(-1, -2)) * ks.transpose(-1, -2)
    p = torch.softmax(s * (d**-0.5 / d), dim=-1)  # [1, 1, 1, tk]
    pv = p * vs.transpose(-1, -2)
    out_r = pv @ vc - (pv * vz.transpose(-1, -2)).sum(-1, keepdim=True)
    want = vllm_single_rht(out_r, inverse=True) / d
    got = quantized_attention_ref(q.double(), kq, vq, "int4_per_token_head", scaling=d**-0.5, q_start=tk - 1,
                                  k_start=0, compute_dtype=torch.float64)  # fmt: skip
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


def test_int4_nonfinite_rows_are_nan_and_zero_rows_exact() -> None:
    x = torch.randn(1, 1, 3, 16)
    x[0, 0, 0, 3] = float("nan")
    x[0, 0, 1, 5] = float("inf")
    x[0, 0, 2] = 0.0
    y = formats.fake_quantize(x, "int4_per_token_head")
    assert torch.isnan(y[0, 0, 0]).all() and torch.isnan(y[0, 0, 1]).all()  # the rotation mixes every element
    assert torch.equal(y[0, 0, 2], torch.zeros(16))
    q = formats.quantize(x[..., 2:, :], "int4_per_token_head")
    assert torch.equal(q.codes, torch.zeros_like(q.codes))


@pytest.mark.parametrize("d", [96, 80, 7])
def test_int4_needs_a_power_of_two_head_dim(d: int) -> None:
    with pytest.raises(UsageError, match="power-of-two head_dim"):
        formats.quantize(torch.randn(1, 1, 2, d), "int4_per_token_head")


# ---- float16 ----


def test_float16_overflows_to_inf_as_the_engine_cast() -> None:
    """bf16 K/V beyond +-65504 become +-Inf in a float16 cache (IEEE round to nearest, what vLLM's Triton
    reshape_and_cache does storing a bf16 value into a float16 cache); below, the cast is RNE."""
    x = torch.tensor([65504.0, 65519.0, 65520.0, -1e5, 1e-8, float("nan")]).bfloat16()
    q = formats.quantize(x, "float16")
    assert q.codes.dtype == torch.float16
    y = formats.dequantize(q, "float16")
    want = x.float().to(torch.float16).float()
    assert torch.equal(y[:-1], want[:-1]) and math.isnan(y[-1])
    assert y[0] == y[1] == y[2] == float("inf")  # bf16 rounds each of them to 65536, beyond float16
    assert y[3] == float("-inf")


def test_capacity_bytes_equal_vllms_page_size() -> None:
    """vLLM's page: data (head_size, or head_size // 2 for INT4) + one fp32 scale per (token, head), K and V."""
    for d in (64, 256):
        for name, data in (("fp8_per_token_head", d), ("int4_per_token_head", d // 2), ("float16", 2 * d)):
            f = formats.get_format(name)
            scale = 0 if name == "float16" else 4
            assert f.bits_per_element(d) * d / 8 == data + scale


# ---- int8_per_tensor (TensorRT-LLM's INT8 KV cache) ----


def trtllm_int8(x: float, inv: np.float32) -> int:
    """cuda_cast<int8_t, float>(x * kv_orig_quant_scale): PTX cvt.rni.sat.s8.f32 (round half to even, saturate to
    [-128, 127], NaN -> 0) of the float32 product."""
    y = F32(F32(x) * inv)
    if math.isnan(y):
        return 0
    return int(min(max(np.rint(y), -128.0), 127.0))  # np.rint: half to even


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([64, 7, 96]), per_head=st.booleans())
def test_int8_per_tensor_equals_trtllm(seed: int, d: int, per_head: bool) -> None:
    x = _rows(seed, d, 3, torch.float32)
    x[0, 0, 2, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -1e30])[: min(4, d)]
    amax = torch.tensor([3.0, 0.7]) if per_head else torch.tensor(2.5)
    scale = amax / 127.0  # ModelOpt's convention: kv scale = amax / 127
    q = formats.quantize(x, "int8_per_tensor", scale)
    assert q.codes.dtype == torch.int8 and q.block_scales is None
    for h in range(2):
        s = scale[h] if per_head else scale
        inv = F32(1.0) / F32(s.item())
        want = [trtllm_int8(e, F32(inv)) for e in x[0, h].reshape(-1).tolist()]
        assert q.codes[0, h].reshape(-1).tolist() == want
    y = formats.dequantize(q, "int8_per_tensor")
    bs = scale.reshape(1, -1, 1, 1) if per_head else scale
    assert torch.equal(y, q.codes.float() * bs)


def test_int8_per_tensor_ties_and_saturation() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.4, 127.5, -128.4, -129.0, 1e6])
    assert formats.quantize(x, "int8_per_tensor", 1.0).codes.tolist() == [0, 2, 2, 0, -2, 127, 127, -128, -128, 127]
