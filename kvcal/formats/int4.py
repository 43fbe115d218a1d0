"""int4_per_token_head: vLLM's randomized Hadamard rotation, then asymmetric 4-bit codes per (token, KV head)
(docs/formats.md: int4_per_token_head).

vLLM vllm/v1/attention/ops/int4_per_token_head.py @ 055e47c28003156421365af985d676fc921cb075 (`_get_rht_signs`,
`single_rht`, `fast_hadamard_transform`'s PyTorch butterfly tier, `_reshape_cache_int4_kernel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcal.errors import UsageError
from kvcal.formats.codec import Codec, register
from kvcal.formats.constants import _CONST_CACHE, INT4_LEVELS, PTH_SCALE_MIN, RHT_SEED
from kvcal.formats.e2m1 import _pack
from kvcal.formats.qtensor import QTensor, _to, as_f32

if TYPE_CHECKING:
    from kvcal.formats.codec import KVFormat


def rht_signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's deterministic +-1 signs D1 of the randomized Hadamard transform, float32 [d]: torch's CPU Bernoulli
    draws from a CPU generator seeded 0x9E3779B9 (cached per (d, device))."""
    key = (f"rht_signs:{d}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(RHT_SEED)
        signs = 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0
        t = _CONST_CACHE[key] = signs.to(device)
    return t


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform H_d x along the last dim (H_d H_d = d I), vLLM's PyTorch butterfly
    (the order of its float additions); d must be a power of two."""
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's `single_rht`: H (D1 x) forward, (H x) D1 inverse (x float32 [..., d]). The inverse of the forward is
    rht(y, inverse=True) / d."""
    d1 = rht_signs(x.shape[-1], x.device)
    return hadamard(x) * d1 if inverse else hadamard(x * d1)


def check_int4_head_dim(d: int) -> None:
    if d < 2 or d & (d - 1):
        raise UsageError(
            f"int4_per_token_head needs a power-of-two head_dim (vLLM rotates K/V by a {d}-point Hadamard transform, "
            f"which exists only for powers of two), got {d}"
        )


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """vLLM's `where(y >= 0, (y + 0.5).to(int32), (y - 0.5).to(int32))` as float32 (truncation toward zero of
    y +- 0.5 in float32; |y| stays far below 2**31 here)."""
    return torch.where(y >= 0, torch.trunc(y + 0.5), torch.trunc(y - 0.5))

def _quantize_int4_rht(x: torch.Tensor) -> QTensor:
    """x: K or V in the dtype the engine holds them ([..., D], D a power of two)."""
    check_int4_head_dim(x.shape[-1])
    # vLLM: key = single_rht(key.float()).to(key.dtype) -- the rotated values are rounded to K/V's own dtype
    xr = rht(as_f32(x))
    if x.dtype in (torch.bfloat16, torch.float16):
        xr = xr.to(x.dtype)
    y = xr.float()
    bad = ~torch.isfinite(y).all(dim=-1, keepdim=True)  # [..., 1]: a non-finite input spreads over its whole row
    yz = torch.where(bad, 0.0, y)
    lo, hi = yz.amin(dim=-1, keepdim=True), yz.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / INT4_LEVELS).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    zp = _round_half_away(-lo / s).clamp_(0.0, INT4_LEVELS)
    q = _round_half_away(yz * (1.0 / s) + zp).clamp_(0.0, INT4_LEVELS).to(torch.uint8)
    # the zero point replaces the 4 low mantissa bits of the fp32 scale
    word = (s.view(torch.int32) & -16) | zp.to(torch.int32)
    word = torch.where(bad, torch.tensor(float("nan")).view(torch.int32), word)  # kvcal's NaN marker: the row
    return QTensor(codes=_pack(q), block_scales=word.view(torch.float32))


def int4_scale_zero(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) float32 of int4_per_token_head's packed fp32 words [..., 1]: the word with its 4 low
    mantissa bits cleared, and those bits (vLLM's read kernel)."""
    bits = word.view(torch.int32)
    return (bits & -16).view(torch.float32), (bits & 0xF).float()


def _dequantize_int4_rht(q: QTensor) -> torch.Tensor:
    """Unrotated float32 values: ((code - zp) * scale) in the rotated basis, rotated back by rht(., inverse) / D.
    vLLM's attention instead rotates Q (rounded to its dtype) and rotates the output back; with exact arithmetic
    the two give the same attention output."""
    c = q.codes
    codes = torch.stack((c & 0x0F, c >> 4), dim=-1).flatten(-2).float()  # [..., D]
    s, zp = int4_scale_zero(q.block_scales)
    y = (codes - zp) * s
    return rht(y, inverse=True) / float(codes.shape[-1])


def _check_head_dim(name: str, f: KVFormat, d: int) -> None:
    check_int4_head_dim(d)


def _quantize(x: torch.Tensor, f: KVFormat, scale: object, checked: bool) -> QTensor:
    return _quantize_int4_rht(x)  # rounds its rotation to x's own dtype, as vLLM does


INT4_RHT = Codec(
    "int4_rht",
    lambda xf, f, s, e2m1: _quantize_int4_rht(xf),
    lambda q, f, dtype: _to(_dequantize_int4_rht(q), dtype),
    # two codes per byte + one fp32 scale (zero point inside) per (token, head)
    lambda f, d, model_bits: 4.0 + 32.0 / d,
    lambda f, d: (d // 2, 1),
    quantize=_quantize,
    check_head_dim=_check_head_dim,
    pow2_head_dim=True,
    c_aux=lambda f, d: rht_signs(d),  # [D] float32, cached
)
register(INT4_RHT)
