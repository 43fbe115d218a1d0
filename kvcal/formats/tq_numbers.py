"""TurboQuant's numbers: the per-layer rotation (signs, Hadamard entry), the Lloyd-Max centroids, the b-bit packing
(docs/formats.md: turboquant_*). Transcribed from vllm-project/vllm:
   .../turboquant/centroids.py @ 06d0369d75e060e83dffac3e0190ceff8fc37e12 (solve_lloyd_max, get_centroids)
   .../turboquant/quantizer.py @ 52768069832's version with generate_wht_signs (torch.randint signs) and
   vllm/model_executor/layers/attention/attention.py (_init_turboquant_buffers: seed 42 + layer * 1337)
   vllm/v1/attention/backends/turboquant_attn.py @ bcbe0bc87502ab0f12208c359954c8940fe0aec8 (_build_hadamard,
     _ensure_on_device: PiT = signs[:, None] * H / sqrt(D), midpoints of the sorted centroids)
   vllm/v1/attention/ops/triton_turboquant_store.py @ 0135d081c30fa476130ae77a152539ce317ab8b1 (launcher: norm,
     x / (norm + 1e-8), @ PiT; _tq_fused_store_mse / _fp8 / _store_quantized_value)
   vllm/v1/attention/ops/triton_turboquant_decode.py @ 055e47c28003156421365af985d676fc921cb075 (_tq_decode_stage1,
     _tq_full_dequant_kv: NORM_CORRECTION, value = idx * scale + zero)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import torch

from kvcal.formats.constants import _CONST_CACHE, TQ_LAYER_SEED_STRIDE, TQ_SEED
from kvcal.formats.e2m1 import _pack
from kvcal.formats.int4 import hadamard

_LLOYD_MAX_ITER, _LLOYD_MAX_TOL, _TRAPZ_N = 200, 1e-10, 200


def tq_signs(d: int, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The +-1 signs float32 [d] of layer `layer`'s rotation (vLLM's generate_wht_signs): torch.randint(0, 2) from a
    CPU generator seeded 42 + layer * 1337, times 2 minus 1."""
    key = (f"tq_signs:{d}:{layer}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(TQ_SEED + layer * TQ_LAYER_SEED_STRIDE)
        bits = torch.randint(0, 2, (d,), generator=gen, device="cpu")
        t = _CONST_CACHE[key] = (bits.float() * 2 - 1).to(device)
    return t


@cache
def tq_hadamard_entry(d: int) -> float:
    """|entry| of vLLM's orthonormal Hadamard matrix, the float32 `1 / sqrt(d)` its `H / math.sqrt(d)` stores (every
    entry of the d x d float32 division on CPU, where vLLM builds it)."""
    h = torch.ones(d, d) / math.sqrt(d)
    if not bool((h == h[0, 0]).all()):  # one value, whatever path torch's division takes
        raise RuntimeError(f"Hadamard entries of size {d} differ")
    return float(h[0, 0])


def tq_rotate(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x float32 [..., D] times vLLM's rotation: forward `x @ PiT` with PiT = diag(signs) H / sqrt(D), inverse
    `x @ Pi` (Pi = PiT^T). Each output is h * (a sum of +-x_i), h = `tq_hadamard_entry`: kvcal sums in float64 (the
    butterfly `hadamard`, exact but in the rarest cases) and rounds h * sum to float32 once, so the result never
    depends on a BLAS or on the tensor's shape; vLLM's cuBLAS GEMM rounds each product and sums in its own order
    (the same value to an ulp or two)."""
    xd = x.double()
    s = signs.to(device=x.device, dtype=torch.float64)
    if not inverse:
        xd = xd * s
    y = hadamard(xd) * tq_hadamard_entry(x.shape[-1])
    if inverse:
        y = y * s
    return y.float()


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
