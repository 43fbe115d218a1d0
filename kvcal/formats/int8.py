"""INT8 families: int8_per_token_head (vLLM), int8_per_tensor (TensorRT-LLM's INT8 KV cache, static scale)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcal.formats.codec import Codec, register
from kvcal.formats.constants import INT8_MAX, INT8_NAN, PTH_SCALE_MIN
from kvcal.formats.fp8 import byte_bits, full_width, per_token_bits, per_token_widths
from kvcal.formats.qtensor import QTensor, _bcast, _to, dequantize_static, finite_abs

if TYPE_CHECKING:
    from kvcal.formats.codec import KVFormat


def _quantize_int8(xf: torch.Tensor) -> QTensor:
    """vLLM's int8_per_token_head write (`_reshape_cache_per_token_head_kernel`, see the per-token-head section):
    scale = max(amax / 127, 1e-6) over the finite values [..., 1]; codes = the float32 `clamp(x * (1 / scale),
    -128, 127)` stored through Triton's float -> int8 conversion, which truncates toward zero (fptosi), not a
    rounding. +-Inf -> +-127 and NaN -> INT8_NAN are kvcal's non-finite policy (the engine's are undefined)."""
    s = (finite_abs(xf).amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    # vLLM clamps to [-128, 127]; a finite x never goes below -127 (|x * (1 / scale)| <= 127 (1 + 2**-23)), so
    # +-127 is the same clamp for it and keeps -Inf off the NaN marker
    codes = torch.trunc((xf * (1.0 / s)).clamp_(-INT8_MAX, INT8_MAX))
    codes = torch.where(torch.isnan(xf), float(INT8_NAN), codes).to(torch.int8)
    return QTensor(codes=codes, block_scales=s)


def _quantize_int8_static(xf: torch.Tensor, s: torch.Tensor) -> QTensor:
    """TensorRT-LLM's INT8 KV cache: `cuda_cast<int8_t>(x * kv_orig_quant_scale)` = PTX `cvt.rni.sat.s8.f32`
    (round to nearest even, saturate to [-128, 127], NaN -> 0) of x times the fp32 reciprocal of
    kv_cache_scaling_factor (s; x ~ codes * s). The engine's int8 has no NaN: NaN is stored as 0, as there
    (the cache still counts it as non-finite K/V)."""
    y = xf * (1.0 / _bcast(s, xf.dim()))
    codes = torch.round(y).clamp_(-128.0, INT8_MAX).nan_to_num_(nan=0.0)  # torch.round: half to even
    return QTensor(codes=codes.to(torch.int8), scale=s)


def _dequantize_token(q: QTensor, f: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    c = q.codes
    y = c.float() * q.block_scales
    return _to(torch.where(c == INT8_NAN, float("nan"), y), dtype)


INT8_TOKEN = Codec(
    "int8", lambda xf, f, s, e2m1: _quantize_int8(xf), _dequantize_token, per_token_bits, per_token_widths
)
INT8_STATIC = Codec(
    "int8s",
    lambda xf, f, s, e2m1: _quantize_int8_static(xf, s),  # type: ignore[arg-type]
    dequantize_static,
    byte_bits,
    full_width,
    static_scale=True,  # first-batch scales are vLLM's (FP8 / NVFP4); TensorRT-LLM's INT8 takes a calibrated one
)
register(INT8_TOKEN, INT8_STATIC)
