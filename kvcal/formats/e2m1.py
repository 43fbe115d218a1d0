"""E2M1 / E8M0 codes and FP4 packing (the FP4 families' element codes; kernels and tests use these)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcal.errors import UsageError
from kvcal.formats.constants import E2M1_MIDPOINTS, E2M1_NAN, _const


def e2m1_encode(y: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """4-bit E2M1 codes (uint8, one per element) of already-scaled values y; saturates at +-6.

    ties='even': round to nearest, ties to even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    ties='away': ties away from zero, SGLang's `sum(|y| >= bounds)` rule. A value that rounds to zero gets code 0
    (+0, whatever its sign); NaN gets E2M1_NAN (8); +-Inf saturates to +-6."""
    if ties not in ("even", "away"):
        raise ValueError(f"ties must be 'even' or 'away', not {ties!r}")
    a = y.abs().float()
    # magnitude code = number of midpoints below a. At a tie (a == midpoint i, between codes i and i+1) 'away' goes
    # up; 'even' goes up only to an even code, i.e. at the odd-indexed midpoints 0.75, 1.75, 3.5.
    # (Seven elementwise compares: torch.bucketize is ~2x slower on a large CPU tensor; kvcal.kernels.fast takes it
    # for a small one, one op instead of ~20, with the same codes.)
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, b in enumerate(E2M1_MIDPOINTS):
        mag += (a >= b) if (ties == "away" or i % 2 == 1) else (a > b)
    sign = ((y < 0) & (mag > 0)).to(torch.uint8) << 3
    return torch.where(torch.isnan(y), E2M1_NAN, sign | mag).to(torch.uint8)


@dataclass(frozen=True)
class E2M1Rounding:
    """How quantize rounds scaled values to E2M1: `encode(y, ties)` -> 4-bit codes (`e2m1_encode`) and `round(y)` ->
    the E2M1 value y rounds to, ties to even (`e2m1_decode(e2m1_encode(y, 'even'))`). The spec's are
    `PLAIN_E2M1`; kvcal.kernels.fast passes another pair with the same bits for small tensors."""

    encode: Callable[[torch.Tensor, str], torch.Tensor]
    round: Callable[[torch.Tensor], torch.Tensor]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes (uint8, low 4 bits used); code 8 is NaN."""
    return _const("values", codes.device)[(codes & 0x0F).long()]


PLAIN_E2M1 = E2M1Rounding(e2m1_encode, lambda y: e2m1_decode(e2m1_encode(y, ties="even")))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] 4-bit codes -> [..., D//2] uint8; element 2j in the low nibble, 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise UsageError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return _pack(c & 0x0F)


def _pack(c: torch.Tensor) -> torch.Tensor:
    """pack_fp4 of uint8 codes already in 0..15 (what e2m1_encode returns): no masking; `* 16` is `<< 4` here
    (no carry) and ~4x cheaper on a small CPU tensor (torch's << wraps its scalar in a tensor first)."""
    return c[..., 0::2] | (c[..., 1::2] * 16)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., N] uint8 -> [..., 2N] 4-bit codes (uint8); inverse of pack_fp4."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-127, 127] (built from bits; 2**-127 is the subnormal 0x00400000)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(e == -127, 2.0**-127, normal)


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """float32 value 2**(byte - 127) of E8M0 bytes (uint8)."""
    return exp2_int(byte.to(torch.int32) - 127)

