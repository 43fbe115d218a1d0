"""Numbers of the format spec (docs/formats.md) and per-device constant tensors."""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
E2M1_MAX = 6.0
INT8_MAX = 127.0
INT8_NAN = -128  # int8 code kvcal reads as NaN (the symmetric grid is +-127)
E2M1_NAN = 8  # E2M1 code kvcal reads as NaN (the -0 pattern; quantize writes +0 for zero)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP16_MAX = float(torch.finfo(torch.float16).max)
F32_MAX = float(torch.finfo(torch.float32).max)

# Index = 4-bit E2M1 code (bit 3 sign); code 8 (-0 in standard E2M1) is kvcal's NaN marker.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, float("nan"), -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between consecutive E2M1 magnitudes; bound i separates magnitude code i from i+1.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_CONST_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A shared fp32 0-d tensor of `value` per device (the default scale): the same tensor at every write, so what
    the torch path remembers of a cache side's scale (`kvcal.kernels.fast.ScaleMemo`) is computed once. Never
    modify it."""
    key = (f"scalar:{value!r}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return t


def _const(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = _CONSTS[name]().to(device)
    return t


# constants of the spec, built per device on first use (`_const`)
_CONSTS = {
    "values": lambda: E2M1_VALUES,
    # nvfp4_4over6's two candidate denominators, as float32 reciprocals (1/4, 1/6)
    "recip_4_6": lambda: torch.tensor([1.0 / 4.0, 1.0 / 6.0], dtype=torch.float32),
}

# per-token-head formats (vLLM's Triton backend)
RHT_SEED = 0x9E3779B9  # vLLM's seed of round 0 of the sign vector (0x9E3779B9 + round_idx * 0x517CC1B7)
PTH_SCALE_MIN = 1e-6  # vLLM's floor of a per-token-head scale (tl.maximum(..., 1e-6))
INT4_LEVELS = 15.0

# TurboQuant (kvcal.formats.turboquant: the vLLM files and commits these come from)
TQ_BOUNDARY_LAYERS = 2  # get_boundary_skip_layers(model_config, n=2): first and last 2 layers stay 'auto'
TQ_NORM_EPS = 1e-8  # x / (norm + 1e-8)
TQ_SCALE_MIN = 1e-8  # values: tl.where(v_scale > 1e-8, v_scale, 1e-8)
TQ_NC_EPS = 1e-16  # norm correction: 1 / sqrt(sum(c * c) + 1e-16)
