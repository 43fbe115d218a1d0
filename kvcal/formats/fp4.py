"""FP4 block families: nvfp4 / nvfp4_4over6 (E4M3 block scales x a global scale) and fp4_e2m1 / mxfp4 (E8M0
power-of-two block scales). Two E2M1 codes per byte (`kvcal.formats.e2m1`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcal.formats.codec import Codec, register
from kvcal.formats.constants import E2M1_MAX, FP8_E4M3_MAX, _const
from kvcal.formats.e2m1 import E2M1Rounding, _pack, e2m1_decode, e8m0_to_float, exp2_int, unpack_fp4
from kvcal.formats.qtensor import QTensor, _bcast, _blocks, _to, as_f32, finite_abs

if TYPE_CHECKING:
    from kvcal.formats.codec import KVFormat


def nvfp4_dynamic_global(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """nvfp4's dynamic global scale `amax / (448 * 6)` over the finite values of x, fp32.

    x: [B, H_kv, T, D] -> one scale per sequence, [B, 1, 1, 1]; any other rank -> one 0-d scale. `valid`: [B, T]
    bool (True = a real token) leaves padding out of the amax. A sequence with no finite nonzero value gets 1.0
    (any scale stores its zeros exactly)."""
    a = finite_abs(as_f32(x))
    if x.dim() != 4:
        amax = a.amax() if a.numel() else a.new_zeros(())
    else:
        if valid is not None:
            a = a * valid.to(device=a.device, dtype=a.dtype)[:, None, :, None]
        amax = a.amax(dim=(1, 2, 3), keepdim=True) if a[0].numel() else a.new_zeros(x.shape[0], 1, 1, 1)
    g = amax / (FP8_E4M3_MAX * E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


def _divide_blocks(xb: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """xb [..., nb, bs] / eff [..., nb, 1] in element units; a block of scale 0 (all finite values zero) gives 0,
    except NaN, which stays NaN."""
    ok = eff > 0
    y = xb / torch.where(ok, eff, 1.0)
    return torch.where(ok, y, torch.where(torch.isnan(xb), xb, 0.0))


def _quantize_nvfp4(xf: torch.Tensor, g: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    """g: the validated global scale (`static_scale`), None = dynamic."""
    xb = _blocks(xf, 16)  # [..., D/16, 16]
    bmax = finite_abs(xb).amax(dim=-1)  # [..., D/16]
    if g is None:
        g = nvfp4_dynamic_global(xf)
    gb = _bcast(g, xf.dim())
    bs = (bmax / (E2M1_MAX * gb)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # [..., D/16]
    y = _divide_blocks(xb, (bs.float() * gb).unsqueeze(-1))
    codes = e2m1.encode(y, "even")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=bs, scale=g)


def _nvfp4_candidate(
    bmax: torch.Tensor, sf_scale: torch.Tensor, reciprocal: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `nvfp4_candidate_scale`: (E4M3 block scale, element multiplier) of a block with maximum `bmax`
    [..., nb] mapped to the denominators n (6 or 4) whose float32 reciprocals 1/n are `reciprocal`, broadcast
    against bmax (a [2, 1, ...] tensor computes both candidates at once: [2, ..., nb]). sf_scale = 1 / global
    scale, broadcastable to bmax. (bmax * (1/n) in float32 is what `bmax * (1.0 / n)` with a Python float
    computes: torch applies a scalar in the tensor's dtype.)"""
    sf = (sf_scale * (bmax * reciprocal)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # satfinite
    sfv = sf.float()
    inv = torch.where(sfv != 0, 1.0 / (sfv * (1.0 / sf_scale)), 0.0)
    return sf, inv


def _nvfp4_sq_error(xb: torch.Tensor, mult: torch.Tensor, e2m1: E2M1Rounding) -> torch.Tensor:
    """vLLM's `nvfp4_reconstruction_error` per block [..., nb]: sum of (e2m1_rne(x * mult) / mult - x)**2 (a block
    of multiplier 0 stores zeros), summed in the kernel's order: pairs (2i, 2i+1), then i = 0..7 in sequence.
    xb: [..., nb, 16] finite; mult: [..., nb] (or [2, ..., nb]: both candidates, xb broadcast)."""
    m = mult.unsqueeze(-1)
    deq = torch.where(m != 0, 1.0 / m, 0.0)
    d = e2m1.round(xb * m) * deq - xb
    sq = d * d
    pair = sq[..., 0::2] + sq[..., 1::2]  # [..., nb, 8]
    first, *rest = pair.unbind(-1)
    err = first
    for p in rest:  # in sequence, as the kernel adds them (a torch.sum would reorder)
        err = err + p
    return err


def _quantize_nvfp4_4over6(xf: torch.Tensor, g: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    """g: the validated global scale (`static_scale`), None = dynamic."""
    # vLLM csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu `cvt_warp_fp16_to_fp4_4over6` (see the docstring)
    xb = _blocks(xf, 16)  # [..., D/16, 16]
    fin = xb.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # the choice never depends on NaN/Inf
    bmax = fin.abs().amax(dim=-1)  # [..., D/16]
    if g is None:
        g = nvfp4_dynamic_global(xf)
    sf_scale = 1.0 / _bcast(g, xf.dim())  # the kernel's SFScaleVal = 1 / k_scale
    # both candidates in one pass, dim 0 = (max/4, max/6): [2, ..., D/16]
    recip = _const("recip_4_6", xf.device).view((2,) + (1,) * bmax.dim())
    sf, mult = _nvfp4_candidate(bmax, sf_scale, recip)
    err = _nvfp4_sq_error(fin, mult, e2m1)
    use4 = err[0] < err[1]  # ties keep max/6
    bs = torch.where(use4, sf[0].view(torch.uint8), sf[1].view(torch.uint8)).view(torch.float8_e4m3fn)
    mult = torch.where(use4, mult[0], mult[1]).unsqueeze(-1)
    y = torch.where(mult != 0, xb * mult, torch.where(torch.isnan(xb), xb, 0.0))
    codes = e2m1.encode(y, "even")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=bs, scale=g)


FP4_E2M1_MIN_RATIO = 1e-10  # SGLang's floor of a block's max / 6 (an all-zero block gets exponent -33)


def fp4_e2m1_exponent(bmax: torch.Tensor) -> torch.Tensor:
    """fp4_e2m1's block exponent (float32, integral) of block maxima bmax [..., D/16] (SGLang's rule:
    ceil(log2(clamp(bmax / 6, min=1e-10))); in place on the quotient, the same bits as out of place). torch's CPU
    log2 may round its last bit differently in a vectorised loop than in its scalar tail, so an element's exponent
    can depend on its place in the tensor: kvcal.kernels.cpu_write takes torch's log2 of a tensor of this shape."""
    return (bmax / E2M1_MAX).clamp_(min=FP4_E2M1_MIN_RATIO).log2_().ceil_()


def _quantize_fp4_e2m1(xf: torch.Tensor, e2m1: E2M1Rounding) -> QTensor:
    # SGLang KVFP4QuantizeUtil.batched_quantize, float32
    xb = _blocks(xf, 16)
    bmax = finite_abs(xb).amax(dim=-1)  # [..., D/16]
    scale_exp = fp4_e2m1_exponent(bmax)  # [..., D/16]
    y = xb / exp2_int(scale_exp).unsqueeze(-1)
    codes = e2m1.encode(y, "away")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=(scale_exp + 127).to(torch.uint8))


def _quantize_mxfp4(xf: torch.Tensor, e2m1: E2M1Rounding) -> QTensor:
    # OCP MX v1.0 shared exponent floor(log2(amax)) - emax_elem, exact via frexp (amax = m * 2**e, m in [0.5, 1)
    # -> floor(log2(amax)) = e - 1)
    xb = _blocks(xf, 32)
    bmax = finite_abs(xb).amax(dim=-1)  # [..., D/32]
    _, e = torch.frexp(bmax)
    shared = torch.where(bmax > 0, e - 1 - 2, torch.full_like(e, -127)).clamp(-127, 127)
    y = xb / exp2_int(shared).unsqueeze(-1)
    codes = e2m1.encode(y, "even")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=(shared + 127).to(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# per-token-head FP8 / INT4 (vLLM's Triton backend), float16


def _nvfp4_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    if f.name == "nvfp4_4over6":
        return _quantize_nvfp4_4over6(xf, s, e2m1)
    return _quantize_nvfp4(xf, s, e2m1)


def _e8m0_f32(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    if f.name == "fp4_e2m1":
        return _quantize_fp4_e2m1(xf, e2m1)
    return _quantize_mxfp4(xf, e2m1)


def _dequantize(q: QTensor, f: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    c = q.codes
    vals = e2m1_decode(unpack_fp4(c)).unflatten(-1, (-1, f.block_size))  # [..., D/bs, bs]
    if f.codec.global_scale:
        eff = q.block_scales.float() * _bcast(q.scale.float(), c.dim())  # [..., D/16]
    else:
        eff = e8m0_to_float(q.block_scales)
    return _to(vals * eff.unsqueeze(-1), dtype).flatten(-2)


def _bits(f: KVFormat, d: int, model_bits: int) -> float:
    return 4.0 + 8.0 / f.block_size  # 4-bit codes + one 8-bit block scale (E4M3 or E8M0) per block


def _widths(f: KVFormat, d: int) -> tuple[int, int | None]:
    return d // 2, d // f.block_size


# element "e2m1": E4M3 block scales x global scale (nvfp4 storage); "e2m1_e8m0": E8M0 block scales
NVFP4 = Codec("e2m1", _nvfp4_f32, _dequantize, _bits, _widths, global_scale=True, first_batch=True, packed_e2m1=True)
E8M0_FP4 = Codec("e2m1_e8m0", _e8m0_f32, _dequantize, _bits, _widths, packed_e2m1=True)
register(NVFP4, E8M0_FP4)
