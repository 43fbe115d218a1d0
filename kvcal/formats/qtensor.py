"""The stored form of a K or V tensor (`QTensor`) and the float32 / scale helpers every family shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.errors import UsageError
from kvcal.formats.constants import F32_MAX, _scalar


@dataclass
class QTensor:
    """The stored form of one K or V tensor x: [..., D] (docs/formats.md has the layout per format)."""

    codes: torch.Tensor
    block_scales: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of codes + block scales (the per-tensor / per-head `scale` is not counted)."""
        n = self.codes.numel() * self.codes.element_size()
        if self.block_scales is not None:
            n += self.block_scales.numel() * self.block_scales.element_size()
        return n


def as_f32(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise UsageError(f"KV tensors must be floating point, got {x.dtype}")
    if x.dtype == torch.float64:
        x = x.clamp(-F32_MAX, F32_MAX)  # so float64 input cannot overflow to inf (NaN stays NaN)
    return x.float()


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf replaced by 0: what every scale is computed from (docs/formats.md: non-finite
    input)."""
    return x.abs().nan_to_num_(nan=0.0, posinf=0.0)  # |x| has no -inf


def static_scale(
    scale: float | torch.Tensor | None, x: torch.Tensor, default: float | None, checked: bool = False
) -> torch.Tensor | None:
    """A user scale as fp32 0-d, [H_kv] or [B, 1, 1, 1]; validated finite and positive (on CPU, to avoid a
    device sync) unless `checked`: the caller passes a tensor it validated before (`check_scale`; a cache passes
    the same tensor at every write and validates it once)."""
    if scale is None:
        return None if default is None else _scalar(default, x.device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.numel() == 1:
        s = s if s.dim() == 0 else s.reshape(())  # a 0-d tensor stays the same tensor
    elif s.dim() == 4 and x.dim() == 4 and s.shape[0] == x.shape[0] and s.shape[1:] == (1, 1, 1):
        pass  # one scale per sequence
    elif s.dim() != 1 or x.dim() < 3 or x.shape[1] != s.numel():
        raise UsageError(
            f"a scale of shape {tuple(s.shape)} does not fit K/V of shape {tuple(x.shape)}: it must be one "
            "number, [H_kv] (per KV head) or [B, 1, 1, 1] (per sequence) for x [B, H_kv, T, D]"
        )
    if not checked and s.device.type == "cpu" and not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise UsageError("KV scales must be finite and positive; recalibrate or check the scale file")
    return s


def check_scale(scale: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`scale` for K/V x [B, H_kv, T, D] as the fp32 tensor quantize uses (0-d, [H_kv] or [B, 1, 1, 1]), validated
    finite and positive (UsageError otherwise): pass it with `scale_checked=True` to skip the validation."""
    return static_scale(scale, x, None)  # type: ignore[return-value]


def _bcast(s: torch.Tensor, ndim: int) -> torch.Tensor:
    """fp32 0-d, [H] or [B, 1, 1, 1] scale -> broadcastable against an ndim-D tensor [B, H, ...]."""
    if s.dim() in (0, ndim):
        return s
    return s.reshape((1, -1) + (1,) * (ndim - 2))


def _blocks(xf: torch.Tensor, block: int) -> torch.Tensor:
    d = xf.shape[-1]
    if d % block:
        raise UsageError(f"head_dim {d} is not a multiple of the format's block size {block}")
    return xf.unflatten(-1, (d // block, block))  # [..., D/block, block]


def _to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast saturating: a dequantized value may round just past the largest finite value of `dtype`
    (codes * scale near float32's max, or the x's own float16 max times a block scale rounded up). NaN stays."""
    if dtype.is_floating_point:
        fi = torch.finfo(dtype) if dtype.itemsize <= 4 else torch.finfo(torch.float32)
        y = y.clamp(fi.min, fi.max)
    return y.to(dtype)


def _to_keep_inf(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_to` for values whose +-Inf the engine itself produced (TurboQuant's float16 norms and scales): finite
    values saturate, +-Inf and NaN stay."""
    return torch.where(torch.isinf(y), y, _to(y, torch.float32)).to(dtype) if dtype.is_floating_point else _to(y, dtype)


def dequantize_static(q: QTensor, f: object, dtype: torch.dtype) -> torch.Tensor:
    """`codes * scale` of a static-scale family (fp8_*, int8_per_tensor; scale default 1.0), as `dtype`."""
    c = q.codes
    s = q.scale if q.scale is not None else torch.tensor(1.0, device=c.device)
    return _to(c.float() * _bcast(s.float(), c.dim()), dtype)
