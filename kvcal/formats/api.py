"""quantize / dequantize / fake_quantize of any row: each asks the row's codec (`KVFormat.codec`)."""

from __future__ import annotations

import torch

from kvcal.formats.codec import KVFormat
from kvcal.formats.e2m1 import PLAIN_E2M1, E2M1Rounding
from kvcal.formats.qtensor import QTensor, as_f32, static_scale
from kvcal.formats.table import get_format


def quantize(
    x: torch.Tensor,
    fmt: str | KVFormat,
    scale: float | torch.Tensor | None = None,
    *,
    scale_checked: bool = False,
    e2m1: E2M1Rounding = PLAIN_E2M1,
) -> QTensor:
    """Quantize x: [..., D] (cache layout [B, H_kv, T, D]) to `fmt`'s storage layout.

    `scale`: fp8_* — the static scale (x ~ codes * scale): float / 0-d / [H_kv] along dim 1 / [B, 1, 1, 1] per
    sequence, default 1.0; nvfp4 / nvfp4_4over6 — the global scale (same shapes), default
    `nvfp4_dynamic_global(x)`; other formats ignore it. `scale_checked`: scale is a tensor `check_scale` returned
    (or one computed positive and finite), not validated again. `e2m1`: how scaled values round to E2M1 (the
    spec's; kvcal.kernels.fast passes another pair with the same bits for small tensors)."""
    f = get_format(fmt)
    codec = f.codec
    if codec.quantize is not None:
        return codec.quantize(x, f, scale, scale_checked)
    xf = as_f32(x)
    s = static_scale(scale, xf, codec.scale_default, scale_checked) if f.calibratable else None
    return codec.quantize_f32(xf, f, s, e2m1)


def quantize_f32(
    xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding = PLAIN_E2M1
) -> QTensor:
    """quantize's body: xf float32 [..., D] (`as_f32`), s the scale of a calibratable format as `static_scale`
    returns it (ignored by the others), E2M1 rounding by `e2m1`."""
    return f.codec.quantize_f32(xf, f, s, e2m1)


def dequantize(q: QTensor, fmt: str | KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a QTensor stands for, as `dtype` ([..., D])."""
    f = get_format(fmt)
    return f.codec.dequantize(q, f, dtype)


def fake_quantize(
    x: torch.Tensor, fmt: str | KVFormat, scale: float | torch.Tensor | None = None
) -> torch.Tensor:
    """quantize then dequantize; returns x's dtype and shape ('auto' returns x itself)."""
    f = get_format(fmt)
    if f.name == "auto":
        return x
    return dequantize(quantize(x, f, scale), f, dtype=x.dtype)
