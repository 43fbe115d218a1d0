"""TurboQuant's numbers: the rotation (the orthonormal Hadamard matrix H / sqrt(D), shared by every layer), the
Lloyd-Max centroids, the b-bit packing (docs/formats.md: turboquant_*). Those of the vLLM releases kvcal matches
(0.32.0 and 0.33.0: the files are the same in both wheels, and tests/conformance/test_vllm_turboquant.py runs them):
   vllm/model_executor/layers/quantization/turboquant/centroids.py (solve_lloyd_max, get_centroids)
   vllm/v1/attention/backends/turboquant_attn.py (_build_hadamard_cached: Sylvester H in float32 on CPU, divided by
     math.sqrt(D); _ensure_on_device: PiT = Pi = H / sqrt(D) for every layer, "random sign flips do not improve
     Lloyd-Max quantization quality"; the midpoints of the sorted float32 centroids)
   vllm/v1/attention/ops/triton_turboquant_store.py (triton_turboquant_store: norm, x / (norm + 1e-8), @ PiT;
     _tq_fused_store_mse / _fp8 / _store_quantized_value)
   vllm/v1/attention/ops/triton_turboquant_decode.py (_tq_decode_stage1, _tq_full_dequant_kv: NORM_CORRECTION,
     value = idx * scale + zero)
LMCache's TurboQuant serde (kvcal.serde) rotates by diag(s) H / sqrt(D) with per-layer random signs s of its own:
`tq_rotate` takes them, the releases' store never does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import torch

from kvcal.formats.constants import _CONST_CACHE, TQ_NORM_EPS
from kvcal.formats.e2m1 import _pack
from kvcal.formats.int4 import hadamard

_LLOYD_MAX_ITER, _LLOYD_MAX_TOL, _TRAPZ_N = 200, 1e-10, 200


@cache
def tq_hadamard_entry(d: int) -> float:
    """|entry| of vLLM's orthonormal Hadamard matrix, the float32 `1 / sqrt(d)` its `H / math.sqrt(d)` stores (every
    entry of the d x d float32 division on CPU, where vLLM builds it)."""
    h = torch.ones(d, d) / math.sqrt(d)
    if not bool((h == h[0, 0]).all()):  # one value, whatever path torch's division takes
        raise RuntimeError(f"Hadamard entries of size {d} differ")
    return float(h[0, 0])


def tq_rotate(x: torch.Tensor, signs: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """x float32 [..., D] times the releases' rotation `x @ PiT`, PiT = H / sqrt(D) (symmetric: its own inverse).
    Each output is h * (a sum of +-x_i), h = `tq_hadamard_entry`: kvcal sums in float64 (the butterfly `hadamard`,
    exact but in the rarest cases) and rounds h * sum to float32 once, so the result never depends on a BLAS or on
    the tensor's shape; the release's float32 GEMM (cuBLAS; torch's CPU matmul where its launcher runs on a CPU)
    rounds each product and sums in its own order (the same value to an ulp or two).
    signs [D] (LMCache's serde only): PiT = diag(signs) H / sqrt(D), forward `x @ PiT`, inverse `x @ PiT^T`."""
    xd = x.double()
    s = None if signs is None else signs.to(device=x.device, dtype=torch.float64)
    if s is not None and not inverse:
        xd = xd * s
    y = hadamard(xd) * tq_hadamard_entry(x.shape[-1])
    if s is not None and inverse:
        y = y * s
    return y.float()


def tq_unit_rotate(x: torch.Tensor, signs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The store launcher's first steps on finite keys x float32 [..., D]: (norm float32 [..., 1], y float32
    [..., D] = tq_rotate(x / (norm + 1e-8))). The release's `k_flat.norm(dim=1)` is a float32 reduction in its own
    order; kvcal takes the float64 norm rounded once (no reduction order to depend on)."""
    norm = x.double().square().sum(dim=-1, keepdim=True).sqrt().float()  # [..., 1]
    return norm, tq_rotate(x / (norm + TQ_NORM_EPS), signs)


def _lloyd_max(d: int, bits: int) -> list[float]:
    """vLLM's solve_lloyd_max(d, bits) centroids in float64, the same float operations in the same order: N(0, 1/d)
    density, trapezoid integrals of 200 steps, start uniform on +-3.5 sigma, outer edges at 3x that, stop (keeping
    the previous centroids) once no centroid moves by 1e-10."""
    n_levels = 2**bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)
    coef = 1.0 / math.sqrt(2 * math.pi * sigma2)

    def pdf(x: float) -> float:
        return coef * math.exp(-x * x / (2 * sigma2))

    def trapz(f: Callable[[float], float], a: float, b: float) -> float:
        h = (b - a) / _TRAPZ_N
        acc = 0.5 * (f(a) + f(b))
        for i in range(1, _TRAPZ_N):
            acc += f(a + i * h)
        return acc * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    cents = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(_LLOYD_MAX_ITER):
        mids = [(cents[i] + cents[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3, *mids, hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = trapz(lambda x: x * pdf(x), a, b)
            den = trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else cents[i])
        if max(abs(new[i] - cents[i]) for i in range(n_levels)) < _LLOYD_MAX_TOL:
            break
        cents = new
    return cents


def tq_centroids(d: int, bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's get_centroids(d, bits): the Lloyd-Max levels of N(0, 1/d), float32 [2**bits], ascending."""
    key = (f"tq_centroids:{d}:{bits}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = torch.tensor(_lloyd_max(d, bits), dtype=torch.float32).to(device)
    return t


def tq_midpoints(d: int, bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The store kernel's decision boundaries float32 [2**bits - 1]: (c[i] + c[i+1]) / 2 of the sorted float32
    centroids, in float32 (_ensure_on_device)."""
    c = tq_centroids(d, bits, device).sort().values
    return (c[:-1] + c[1:]) / 2


def tq_pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., D] (uint8, < 2**bits) -> uint8 [..., ceil(D * bits / 8)], vLLM's packing: 4 bits: element 2i in
    the low nibble of byte i; 3 bits: each 8 elements form a 24-bit little-endian word, element j at bit 3j."""
    if bits == 4:
        return _pack(idx)
    g = idx.unflatten(-1, (-1, 8)).to(torch.int32)  # [..., D/8, 8]
    word = (g << torch.arange(0, 24, 3, dtype=torch.int32, device=idx.device)).sum(-1)  # disjoint bits: | = +
    out = torch.stack([(word >> sh) & 0xFF for sh in (0, 8, 16)], dim=-1)  # [..., D/8, 3]
    return out.flatten(-2).to(torch.uint8)


def tq_unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of tq_pack: int64 codes [..., d] (what the read kernels' byte / bit arithmetic extracts)."""
    if bits == 4:
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)[..., :d].long()
    b = packed.unflatten(-1, (-1, 3)).long()  # [..., D/8, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, 24, 3, device=packed.device)
    return ((word.unsqueeze(-1) >> shifts) & 7).flatten(-2)
