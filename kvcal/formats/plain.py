"""Unquantized families: auto (the model's own K/V), bf16, float16 (docs/formats.md: float16)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcal.formats.codec import Codec, register
from kvcal.formats.constants import BF16_MAX
from kvcal.formats.qtensor import QTensor, _to, as_f32

if TYPE_CHECKING:
    from kvcal.formats.codec import KVFormat
    from kvcal.formats.e2m1 import E2M1Rounding


def _full_width(f: KVFormat, d: int) -> tuple[int, int | None]:
    return d, None


def _quantize_auto(x: torch.Tensor, f: KVFormat, scale: object, checked: bool) -> QTensor:
    return QTensor(codes=x)


def _dequantize_float(q: QTensor, f: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    c = q.codes
    # bf16 -> float16 saturates (65504 stored as bf16 is 65536)
    return c if c.dtype == dtype else _to(c.float(), dtype)


def _quantize_bf16(x: torch.Tensor, f: KVFormat, scale: object, checked: bool) -> QTensor:
    if x.dtype == torch.bfloat16:
        # the float32 detour changes nothing for bf16 input (the bounds are bf16 values): one op instead of three
        return QTensor(codes=x.clamp(-BF16_MAX, BF16_MAX))
    return _bf16_f32(as_f32(x), f, None, None)  # type: ignore[arg-type]


def _bf16_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    return QTensor(codes=xf.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16))


def _fp16_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    return QTensor(codes=xf.to(torch.float16))  # IEEE cast: beyond +-65504 rounds to +-Inf, as the engine


def _dequantize_fp16(q: QTensor, f: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    c = q.codes
    return c if c.dtype == dtype else c.to(dtype)  # a float16 cache's +-Inf stays +-Inf (the engine reads it)


AUTO = Codec(
    "auto",
    quantize_f32=lambda xf, f, s, e2m1: QTensor(codes=xf),
    dequantize=_dequantize_float,
    bits=lambda f, d, model_bits: float(model_bits),
    widths=_full_width,
    quantize=_quantize_auto,
)
BF16 = Codec(
    "bf16", _bf16_f32, _dequantize_float, lambda f, d, mb: 16.0, _full_width, quantize=_quantize_bf16
)
FP16 = Codec("fp16", _fp16_f32, _dequantize_fp16, lambda f, d, mb: 16.0, _full_width)
register(AUTO, BF16, FP16)
