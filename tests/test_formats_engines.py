"""FP4 variants the engines accept today, each bit for bit against the engine's own quantize routine transcribed.

vLLM `--kv-cache-dtype nvfp4_4over6` (vllm/config/cache.py CacheDType @ 002f10e0cfa1373a19a0d2756598a34b700d20e5
lists auto, float16, bfloat16, fp8*, fp8_ds_mla, nvfp4_ds_mla, turboquant_*, int4/int8/fp8_per_token_head, nvfp4,
nvfp4_4over6): transcribed below from vllm-project/vllm csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu @
0cd789b397efc1a8992489076db9fe28d41aed69 (`round_to_nearest_e2m1`, `nvfp4_candidate_scale`,
`nvfp4_reconstruction_error`, `cvt_warp_fp16_to_fp4_4over6`, with `pack_fp4`'s cvt.rn.satfinite.e2m1x2.f32),
one 16-element group per row, in the kernel's order of operations. The transcription takes the CUDA
`reciprocal_approximate_ftz` as a correctly rounded reciprocal and no fused multiply-add (see kvcal.formats).

Not emulated, and why (the error names the reason): vLLM's nvfp4_ds_mla / fp8_ds_mla (DeepSeek MLA latents).
SGLang's fp4_e2m1 is tests/test_formats.py's transcription. LMDeploy/TurboMind accepts no FP4 KV cache
(lmdeploy/messages.py QuantPolicy @ 1263d5cd889b7ad500e85b8eb20401327a4516ab: NONE, INT4, INT8, FP8, FP8_E5M2,
TURBO_QUANT).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.errors import UsageError
from kvcal.formats import (
    FORMATS,
    dequantize,
    fake_quantize,
    get_format,
    pack_fp4,
    quantize,
    unpack_fp4,
)

E4M3 = torch.float8_e4m3fn


# ---- vLLM's routine, transcribed ------------------------------------------------------------------------------


def _vllm_round_to_nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """`round_to_nearest_e2m1`: ties to even, as cvt.rn.satfinite.e2m1x2.f32."""
    ax = x.abs()
    q = torch.full_like(x, 6.0)
    for bound, value, inclusive in (
        (5.0, 4.0, True),
        (3.5, 3.0, False),
        (2.5, 2.0, True),
        (1.75, 1.5, False),
        (1.25, 1.0, True),
        (0.75, 0.5, False),
        (0.25, 0.0, True),
    ):
        q = torch.where(ax <= bound if inclusive else ax < bound, value, q)
    return torch.copysign(q, x)


def _vllm_cvt_e2m1(x: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e2m1x2.f32 of one float: 4-bit code, sign bit from the sign (-0 -> 8)."""
    mag = _vllm_round_to_nearest_e2m1(x).abs()
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for i, v in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)):
        code = torch.where(mag == v, i, code).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _vllm_candidate_scale(sf_scale_val: torch.Tensor, vec_max: torch.Tensor, denominator: float):
    """`nvfp4_candidate_scale` -> (fp8 block scale byte, outputScale) per group."""
    sf_value = sf_scale_val * (vec_max * (1.0 / denominator))
    tmp = sf_value.clamp(max=448.0).to(E4M3)  # __nv_fp8_e4m3(float): round to nearest, saturate to finite
    sf_value = tmp.float()
    output_scale = torch.where(
        sf_value != 0.0, 1.0 / (sf_value * (1.0 / sf_scale_val)), torch.zeros_like(sf_value)
    )
    return tmp.view(torch.uint8), output_scale


def _vllm_reconstruction_error(vec: torch.Tensor, output_scale: torch.Tensor) -> torch.Tensor:
    """`nvfp4_reconstruction_error` of groups vec [N, 16] (one thread holds all 16: NVFP4_ENABLE_ELTS16)."""
    error = torch.zeros(vec.shape[0])
    dequant_scale = torch.where(output_scale != 0.0, 1.0 / output_scale, torch.zeros_like(output_scale))
    for i in range(8):
        x, y = vec[:, 2 * i], vec[:, 2 * i + 1]
        dx = _vllm_round_to_nearest_e2m1(x * output_scale) * dequant_scale - x
        dy = _vllm_round_to_nearest_e2m1(y * output_scale) * dequant_scale - y
        term = torch.where(output_scale == 0.0, x * x + y * y, dx * dx + dy * dy)
        error = error + term
    return error


def vllm_nvfp4_4over6(x: torch.Tensor, k_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's NVFP4 4-over-6 store of x [..., D] (bf16) with checkpoint scale k_scale: (packed [..., D/2] uint8,
    block scales [..., D/16] uint8), linear scale layout."""
    lead, d = x.shape[:-1], x.shape[-1]
    vec = x.float().reshape(-1, 16)  # the kernel's PackedVec, converted with cast_to_float2
    global_scale = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(k_scale, dtype=torch.float32)
    vec_max = x.reshape(-1, 16).abs().amax(-1).float()  # __habs2 / __hmax2 in bf16, then float()
    sf6, os6 = _vllm_candidate_scale(global_scale, vec_max, 6.0)
    sf4, os4 = _vllm_candidate_scale(global_scale, vec_max, 4.0)
    use4 = _vllm_reconstruction_error(vec, os4) < _vllm_reconstruction_error(vec, os6)
    output_scale = torch.where(use4, os4, os6)
    sf = torch.where(use4, sf4, sf6)
    codes = _vllm_cvt_e2m1(vec * output_scale[:, None])  # [N, 16]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # pack_fp4: element 2j in the low nibble
    return packed.reshape(*lead, d // 2), sf.reshape(*lead, d // 16)


def _minus_zero_to_plus(packed: torch.Tensor) -> torch.Tensor:
    """vLLM stores -0 (code 8) for a negative value that rounds to zero; kvcal +0 (8 is its NaN marker)."""
    codes = unpack_fp4(packed)
    return pack_fp4(torch.where(codes == 8, torch.zeros_like(codes), codes))


def _assert_matches_vllm(x: torch.Tensor, k_scale: float) -> None:
    packed, sf = vllm_nvfp4_4over6(x, k_scale)
    q = quantize(x, "nvfp4_4over6", k_scale)
    assert torch.equal(q.block_scales.view(torch.uint8), sf)
    assert torch.equal(q.codes, _minus_zero_to_plus(packed))


# ---- bit-exact agreement ----------------------------------------------------------------------------------------


def _edge_blocks() -> torch.Tensor:
    """[rows, 16] bf16 blocks at the decision's edges."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = [
        [0.0] * 16,  # all zero: both candidate scales 0
        [6.0] + [0.0] * 15,  # max exactly representable by both candidates: errors tie at 0 -> max/6
        [6.0, *ties, *[-t for t in ties], 0.0],  # E2M1 ties after the max/6 scale
        [4.0, 3.0, 2.0, 1.0, -4.0, -3.0, -2.0, -1.0] * 2,  # fits max/4 exactly: 4 wins
        [6.0, 5.0, 4.5, 4.0, -5.5, 3.9, 2.9, 1.1] * 2,  # near-maximal values (4/6's motivation)
        [1e4] + [1.0] * 15,  # block scale saturates at 448 (k_scale 1)
        [1e-6, -3e-7] * 8,  # block scale underflows E4M3: stored as zeros
        [-1e-3] + [1e-9] * 15,  # tiny negatives round to (-)0
    ]
    return torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("k_scale", [1.0, 2.0**-5, 0.0123, 3.7])
def test_nvfp4_4over6_matches_vllm_on_edge_blocks(k_scale: float) -> None:
    x = _edge_blocks().reshape(1, 1, -1, 64)  # [B, H_kv, T, D]: 32 blocks, 8 planted rows x 4 scalings
    x = torch.cat([x, x * 2.0**-7, x * 2.0**9, x * 0.3], dim=2)
    _assert_matches_vllm(x, k_scale)


def test_nvfp4_4over6_edge_decisions() -> None:
    x = _edge_blocks().reshape(8, 16)
    q = quantize(x, "nvfp4_4over6", 1.0)
    bs = q.block_scales.float()
    assert bs[0].item() == 0 and q.codes[0].sum() == 0  # all zero
    assert bs[1].item() == 1.0  # tie -> max/6 (scale 6/6), not 6/4 = 1.5
    assert bs[3].item() == 1.0  # max/4 = 1: every value exact
    assert bs[5].item() == 448.0  # saturated block scale
    assert bs[6].item() == 0.0  # underflow: zeros
    assert torch.equal(fake_quantize(x[3:4], "nvfp4_4over6", 1.0), x[3:4])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_mag=st.floats(-12, 12),
    k_scale=st.sampled_from([1.0, 2.0**-8, 0.00731, 0.5, 17.0]),
    head_dim=st.sampled_from([16, 64, 128]),
    outliers=st.booleans(),
)
def test_nvfp4_4over6_matches_vllm_on_random_input(
    seed: int, log_mag: float, k_scale: float, head_dim: int, outliers: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 5, head_dim, generator=g) * 2.0**log_mag
    if outliers:
        x = x * torch.where(torch.rand(x.shape, generator=g) < 0.05, 40.0, 1.0)
    _assert_matches_vllm(x.to(torch.bfloat16), k_scale)


# ---- the format in kvcal ------------------------------------------------------------------------------------


def test_nvfp4_4over6_is_nvfp4_storage() -> None:
    f = get_format("nvfp4_4over6")
    assert (
        f.layout == "nvfp4"
        and f.calibratable
        and f.block_size == 16
        and f.engine_names["vllm"] == "nvfp4_4over6"
    )
    assert f.bits_per_element(128) == FORMATS["nvfp4"].bits_per_element(128) == 4.5
    x = torch.randn(2, 3, 4, 32)
    q = quantize(x, f, 0.01)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 4, 16)
    assert q.block_scales.dtype == E4M3 and q.block_scales.shape == (2, 3, 4, 2)
    assert torch.equal(dequantize(q, "nvfp4_4over6"), dequantize(q, "nvfp4"))  # one reader for both


def test_nvfp4_4over6_reconstructs_better_than_nvfp4() -> None:
    # per block the smaller of the max/6 and max/4 errors: over Gaussian K/V clearly below nvfp4 (max/6 only)
    x = torch.randn(4, 2, 64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float()
    err46 = (fake_quantize(x, "nvfp4_4over6", 1.0) - x).square().sum()
    err6 = (fake_quantize(x, "nvfp4", 1.0) - x).square().sum()
    assert float(err46) < 0.95 * float(err6)


def test_dynamic_and_per_head_global_scales() -> None:
    x = torch.randn(2, 4, 8, 32, generator=torch.Generator().manual_seed(5))
    q = quantize(x, "nvfp4_4over6")  # no scale: nvfp4's dynamic per-sequence global
    assert q.scale.shape == (2, 1, 1, 1)
    per_head = torch.tensor([0.5, 1.0, 2.0, 4.0])
    q = quantize(x, "nvfp4_4over6", per_head)
    for h in range(4):
        alone = quantize(x[:, h : h + 1], "nvfp4_4over6", float(per_head[h]))
        assert torch.equal(q.codes[:, h : h + 1], alone.codes)
        assert torch.equal(
            q.block_scales[:, h : h + 1].view(torch.uint8), alone.block_scales.view(torch.uint8)
        )


def test_non_finite_input_keeps_the_policy() -> None:
    x = torch.randn(1, 1, 2, 32)
    x[0, 0, 0, 3] = float("nan")
    x[0, 0, 1, 20] = float("inf")
    y = fake_quantize(x, "nvfp4_4over6", 1.0)
    assert torch.isnan(y[0, 0, 0, 3]) and int(torch.isnan(y).sum()) == 1
    clean = x.clone()
    clean[0, 0, 0, 3] = 0.0
    clean[0, 0, 1, 20] = 0.0
    # neighbours are stored exactly as without the non-finite element (scales over finite values only)
    same = fake_quantize(clean, "nvfp4_4over6", 1.0)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, 0, 0, 3] = mask[0, 0, 1, 20] = False
    assert torch.equal(y[mask], same[mask])
    assert y[0, 0, 1, 20].item() > 0  # +Inf saturates


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("nvfp4_ds_mla", "DeepSeek MLA"),
        ("nvfp4_5over6", "unknown KV format"),
        ("fp4", "unknown KV format"),
    ],
)
def test_unknown_or_unemulated_fp4_variant_is_one_line_listing_the_names(name: str, fragment: str) -> None:
    with pytest.raises(UsageError) as exc:
        get_format(name)
    msg = str(exc.value)
    assert fragment in msg and "\n" not in msg
    for known in ("nvfp4", "nvfp4_4over6", "fp4_e2m1", "mxfp4"):
        assert known in msg
