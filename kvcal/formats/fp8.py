"""FP8 families: fp8_e4m3 / fp8_e5m2 with a static scale, fp8_per_token_head (vLLM's per-token-head kernel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcal.formats.codec import Codec, register
from kvcal.formats.constants import FP8_E4M3_MAX, PTH_SCALE_MIN
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


def _quantize_fp8_token(xf: torch.Tensor) -> QTensor:
    # scale = max(amax / 448, 1e-6) over the finite values; codes = e4m3(clamp(x * (1 / scale), +-448))
    s = (finite_abs(xf).amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    codes = (xf * (1.0 / s)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # NaN stays NaN
    return QTensor(codes=codes, block_scales=s)


def _static_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    return _quantize_fp8(xf, f, s)  # type: ignore[arg-type]


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
E4M3_TOKEN = Codec("e4m3_token", _token_f32, _dequantize_token, per_token_bits, per_token_widths)
register(E4M3, E5M2, E4M3_TOKEN)
