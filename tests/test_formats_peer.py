"""Peer check: kvcal's FP8 and NVFP4 quantization against compressed-tensors' own (what llm-compressor and vLLM use).

Deliberate differences, tested below:
- compressed-tensors stores the NVFP4 global scale as the reciprocal (`global_scale = 448 * 6 / amax`) and
  dequantizes with `block_scale / global_scale`; kvcal's `scale` is the multiplicative `amax / (448 * 6)` and
  dequantizes with `block_scale * scale`. Same codes and block scales; values equal bit for bit when the global
  scale is a power of two, else within float32 rounding of the effective scale (a relative 2**-22).
- compressed-tensors replaces a zero block scale (all-zero block, or a block scale that underflows E4M3) with 0.125;
  kvcal stores 0. The values of such blocks are 0 either way (kvcal writes code +0; compressed-tensors -0 for
  negative inputs).
- A negative value that rounds to zero: compressed-tensors packs -0 (code 8), kvcal +0 (code 0; 8 is kvcal's NaN
  marker). Same value.
"""

from __future__ import annotations

import pytest
import torch

from kvcal.formats import dequantize, e2m1_decode, fake_quantize, quantize, unpack_fp4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import (  # noqa: E402
    fake_quantize as ct_fake_quantize,
)
from compressed_tensors.quantization.lifecycle.forward import (  # noqa: E402
    quantize as ct_quantize,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

FP8_ARGS = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
# compressed-tensors' NVFP4 preset (quant_scheme.NVFP4): FP4 E2M1, 16-element groups, E4M3 group scales + global
NVFP4_ARGS = QuantizationArgs(
    num_bits=4,
    type="float",
    strategy="tensor_group",
    group_size=16,
    symmetric=True,
    scale_dtype=torch.float8_e4m3fn,
)


def _data(seed: int, rows: int = 256, d: int = 128) -> torch.Tensor:
    """K/V-like rows [rows, D] over six decades, one all-zero group, a few large outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[3, 16:32] = 0.0
    x[7, 5] = 5e3
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_per_tensor_matches_compressed_tensors(seed: int) -> None:
    x = _data(seed)
    # compressed-tensors' calibrated scale (amax / 448) and the uncalibrated default 1.0 (values beyond 448 clip)
    scale, zp = calculate_qparams(x.amin(), x.amax(), FP8_ARGS)
    assert torch.allclose(scale, x.abs().amax() / 448, rtol=0, atol=0)
    for s in (scale, torch.ones(1)):
        zero = torch.zeros(1)
        assert torch.equal(fake_quantize(x, "fp8_e4m3", s), ct_fake_quantize(x, s, zero, FP8_ARGS))
        # compressed-tensors' quantize returns the E4M3 grid values in float32: kvcal's codes are those values
        assert torch.equal(quantize(x, "fp8_e4m3", s).codes.float(), ct_quantize(x, s, zero, FP8_ARGS))


def _ct_nvfp4(x: torch.Tensor, global_ct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' group scales, E2M1 values and fake-quantized x for x [rows, D]."""
    xg = x.unflatten(-1, (x.shape[-1] // 16, 16))
    scales, zp = calculate_qparams(xg.amin(-1), xg.amax(-1), NVFP4_ARGS, global_scale=global_ct)
    codes = ct_quantize(x, scales, zp, NVFP4_ARGS, global_scale=global_ct)
    fq = ct_fake_quantize(x, scales, zp, NVFP4_ARGS, global_scale=global_ct)
    return scales, codes, fq


@pytest.mark.parametrize("k", [-6, 0, 5])
def test_nvfp4_power_of_two_global_scale_is_bit_identical(k: int) -> None:
    x = _data(2)
    g = 2.0**k
    ct_scales, ct_codes, ct_fq = _ct_nvfp4(x, torch.tensor([1.0 / g]))  # compressed-tensors: the reciprocal
    q = quantize(x, "nvfp4", g)
    ours = q.block_scales.float()
    assert torch.equal(ours[ours > 0], ct_scales[ours > 0])
    assert (ct_scales[ours == 0] == 0.125).all()  # its zero-scale substitute
    assert torch.equal(e2m1_decode(unpack_fp4(q.codes)), ct_codes)
    assert torch.equal(dequantize(q, "nvfp4"), ct_fq)
    assert torch.equal(fake_quantize(x, "nvfp4", g), ct_fq)
    # packed storage: the same codes as compressed-tensors' checkpoint packing (element 2j in the low nibble),
    # except that it packs a negative value rounding to zero as -0 (code 8) where kvcal writes +0 (code 0)
    ours_codes, ct_packed = unpack_fp4(q.codes), unpack_fp4(pack_fp4_to_uint8(ct_codes))
    minus_zero = ct_packed == 8
    assert int(minus_zero.sum()) > 0 and (ours_codes[minus_zero] == 0).all()
    assert torch.equal(ours_codes[~minus_zero], ct_packed[~minus_zero])


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_nvfp4_dynamic_global_scale_agrees(seed: int) -> None:
    x = _data(seed)
    global_ct = generate_gparam(x.amin(), x.amax())  # 448 * 6 / amax
    q = quantize(x, "nvfp4")  # kvcal default: amax / (448 * 6)
    assert abs(float(q.scale * global_ct) - 1.0) <= 2**-23
    ct_scales, ct_codes, ct_fq = _ct_nvfp4(x, global_ct)
    ours = q.block_scales.float()
    assert torch.equal(ours[ours > 0], ct_scales[ours > 0])
    assert (ct_scales[ours == 0] == 0.125).all()
    assert (
        int((ours == 0).sum()) >= 1
    )  # the all-zero group (and underflowed tiny groups) exercise the difference
    assert torch.equal(e2m1_decode(unpack_fp4(q.codes)), ct_codes)  # identical codes
    y = dequantize(q, "nvfp4")
    assert torch.equal(y == 0, ct_fq == 0)
    assert (
        (y - ct_fq).abs() <= ct_fq.abs() * 2**-22
    ).all()  # effective scale bs*g vs bs/global_ct: an ulp or two
