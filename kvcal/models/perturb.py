"""The same model computed by another correct implementation: every weight moved by a few of its dtype's ulps.

Two correct implementations of one model (other GEMM orders, fused kernels, another attention) never agree bit for
bit; through a quantized KV cache their tiny disagreement grows (a value near a code boundary flips its code, which
moves later K/V across other boundaries), so an engine's per-sample damage can be no closer to kvcal's emulation
than the emulation is to itself under a perturbation of that size. `kvcal eval --perturb-weights ULPS` runs the
emulation so perturbed, and `kvcal compare --conformance-noise` takes its damage's own scatter as the conformance
margin (kvcal.report.conformance).

    w' = round_to_dtype(w * (1 + s * ulps * eps(dtype))),   s = +-1 per element (seeded)

computed in float32 (float64 for float64 weights). eps is the dtype's machine epsilon (bfloat16 2**-7, float16
2**-10, float32 2**-23): `ulps` 1 moves a bfloat16 weight by one or two of its own ulps (its relative ulp is between
eps / 2 and eps). Zero stays zero, signs never flip.
"""

from __future__ import annotations

import math
from typing import Any

from kvcal.errors import UsageError


def check_perturbation(value: float | str | None, flag: str = "--perturb-weights") -> float | None:
    """None / 0 / '': no perturbation (None); else a positive finite number of ulps, at most 64 (more is another
    model, not another implementation of it)."""
    try:
        ulps = 0.0 if value is None or value == "" else float(value)
    except ValueError:
        ulps = math.nan
    if ulps == 0:
        return None
    if not (math.isfinite(ulps) and 0 < ulps <= 64):
        raise UsageError(
            f"{flag} {value}: give the weights' perturbation in ulps of their dtype, a number in (0, 64] "
            "(1: another correct implementation's size; 0 or omitted: none)"
        )
    return float(ulps)


def perturb_weights(model: Any, ulps: float, seed: int = 0) -> int:
    """Every floating-point parameter of `model` times 1 +- ulps * eps(its dtype), random signs from `seed`
    (torch.Generator on the CPU, parameters in `model.parameters()` order: the same perturbation on any device).
    In place, under no_grad; tied parameters once. Returns the number of elements perturbed."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            wide = torch.float64 if p.dtype == torch.float64 else torch.float32
            sign = torch.randint(0, 2, p.shape, generator=g).to(wide) * 2 - 1  # [*p.shape] +-1
            step = ulps * torch.finfo(p.dtype).eps
            p.copy_((p.to(wide) * (1 + sign.to(p.device) * step)).to(p.dtype))
            n += p.numel()
    return n
