"""The small-tensor fast paths of kvcal.formats (a decode step quantizes one token per K/V per layer) give the same
bits as the implementation they replaced, kept below verbatim as the slow reference (kvcal/formats.py at commit
fbb0a1e: e2m1_encode by seven compares, finite_abs by where, _divide_blocks / int8 with *_like tensors, the scale
validated at every call). Codes, block scales and scales are compared bit for bit, NaN payloads included, over
random K/V with NaN, +-Inf, +-0, subnormals, huge values, exact E2M1 ties and padded (all-zero) tokens, in every
format, with every scale shape (none, 0-d, [H_kv], [B, 1, 1, 1]) and input dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.formats import (
    BF16_MAX,
    E2M1_MAX,
    E2M1_MIDPOINTS,
    E2M1_NAN,
    F32_MAX,
    FORMATS,
    FP8_E4M3_MAX,
    INT8_MAX,
    INT8_NAN,
    KVFormat,
    QTensor,
    e2m1_decode,
    e2m1_encode,
    exp2_int,
    get_format,
    quantize,
)

QUANTIZED = [n for n in FORMATS if n != "auto"]

# ------------------------------------------------------------------------------------------------------------
# The previous implementation (verbatim but for the `old_` names), the reference the fast paths must equal.


def old_e2m1_encode(y: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """4-bit E2M1 codes (uint8, one per element) of already-scaled values y; saturates at +-6.

    ties='even': round to nearest, ties to even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    ties='away': ties away from zero, SGLang's `sum(|y| >= bounds)` rule. A value that rounds to zero gets code 0
    (+0, whatever its sign); NaN gets E2M1_NAN (8); +-Inf saturates to +-6."""
    if ties not in ("even", "away"):
        raise ValueError(f"ties must be 'even' or 'away', not {ties!r}")
    a = y.abs().float()
    # magnitude code = number of midpoints below a. At a tie (a == midpoint i, between codes i and i+1) 'away' goes
    # up; 'even' goes up only to an even code, i.e. at the odd-indexed midpoints 0.75, 1.75, 3.5.
    # (Seven elementwise compares: torch.bucketize is orders of magnitude slower on CPU.)
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, b in enumerate(E2M1_MIDPOINTS):
        mag += (a >= b) if (ties == "away" or i % 2 == 1) else (a > b)
    sign = ((y < 0) & (mag > 0)).to(torch.uint8) << 3
    return torch.where(torch.isnan(y), E2M1_NAN, sign | mag).to(torch.uint8)


def old_pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] 4-bit codes -> [..., D//2] uint8; element 2j in the low nibble, 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise UsageError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise UsageError(f"KV tensors must be floating point, got {x.dtype}")
    if x.dtype == torch.float64:
        x = x.clamp(-F32_MAX, F32_MAX)  # so float64 input cannot overflow to inf (NaN stays NaN)
    return x.float()


def old_finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf replaced by 0: what every scale is computed from (see the module docstring)."""
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _static_scale(
    scale: float | torch.Tensor | None, x: torch.Tensor, default: float | None
) -> torch.Tensor | None:
    """A user scale as fp32 0-d, [H_kv] or [B, 1, 1, 1]; validated finite and positive (on CPU, to avoid a
    device sync)."""
    if scale is None:
        return None if default is None else torch.tensor(default, dtype=torch.float32, device=x.device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.numel() == 1:
        s = s.reshape(())
    elif s.dim() == 4 and x.dim() == 4 and s.shape[0] == x.shape[0] and s.shape[1:] == (1, 1, 1):
        pass  # one scale per sequence
    elif s.dim() != 1 or x.dim() < 3 or x.shape[1] != s.numel():
        raise UsageError(
            f"a scale of shape {tuple(s.shape)} does not fit K/V of shape {tuple(x.shape)}: it must be one "
            "number, [H_kv] (per KV head) or [B, 1, 1, 1] (per sequence) for x [B, H_kv, T, D]"
        )
    if s.device.type == "cpu" and not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise UsageError("KV scales must be finite and positive; recalibrate or check the scale file")
    return s


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


def old_nvfp4_dynamic_global(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """nvfp4's dynamic global scale `amax / (448 * 6)` over the finite values of x, fp32.

    x: [B, H_kv, T, D] -> one scale per sequence, [B, 1, 1, 1]; any other rank -> one 0-d scale. `valid`: [B, T]
    bool (True = a real token) leaves padding out of the amax. A sequence with no finite nonzero value gets 1.0
    (any scale stores its zeros exactly)."""
    a = old_finite_abs(_as_f32(x))
    if x.dim() != 4:
        amax = a.amax() if a.numel() else a.new_zeros(())
    else:
        if valid is not None:
            a = a * valid.to(device=a.device, dtype=a.dtype)[:, None, :, None]
        amax = a.amax(dim=(1, 2, 3), keepdim=True) if a[0].numel() else a.new_zeros(x.shape[0], 1, 1, 1)
    g = amax / (FP8_E4M3_MAX * E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


def _quantize_fp8(xf: torch.Tensor, f: KVFormat, scale: float | torch.Tensor | None) -> QTensor:
    s = _static_scale(scale, xf, 1.0)
    dtype = torch.float8_e4m3fn if f.element == "e4m3" else torch.float8_e5m2
    m = f.max_value
    # clamp first: torch's float8 casts do not all saturate (e5m2 overflows to inf); clamp keeps NaN, and the
    # cast stores it as the format's NaN
    codes = (xf / _bcast(s, xf.dim())).clamp(-m, m).to(dtype)
    return QTensor(codes=codes, scale=s)


def _quantize_int8(xf: torch.Tensor) -> QTensor:
    s = old_finite_abs(xf).amax(dim=-1, keepdim=True) / INT8_MAX  # [..., 1]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round(xf / safe).clamp(-INT8_MAX, INT8_MAX)  # torch.round = half to even; +-Inf -> +-127
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    codes = torch.where(torch.isnan(xf), float(INT8_NAN), codes).to(torch.int8)
    return QTensor(codes=codes, block_scales=s)


def _divide_blocks(xb: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """xb [..., nb, bs] / eff [..., nb, 1] in element units; a block of scale 0 (all finite values zero) gives 0,
    except NaN, which stays NaN."""
    ok = eff > 0
    y = xb / torch.where(ok, eff, torch.ones_like(eff))
    return torch.where(ok, y, torch.where(torch.isnan(xb), xb, torch.zeros_like(xb)))


def _quantize_nvfp4(xf: torch.Tensor, scale: float | torch.Tensor | None) -> QTensor:
    xb = _blocks(xf, 16)  # [..., D/16, 16]
    bmax = old_finite_abs(xb).amax(dim=-1)  # [..., D/16]
    g = _static_scale(scale, xf, None)
    if g is None:
        g = old_nvfp4_dynamic_global(xf)
    gb = _bcast(g, xf.dim())
    bs = (bmax / (E2M1_MAX * gb)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # [..., D/16]
    y = _divide_blocks(xb, (bs.float() * gb).unsqueeze(-1))
    codes = old_e2m1_encode(y, ties="even")
    return QTensor(codes=old_pack_fp4(codes.flatten(-2)), block_scales=bs, scale=g)


def _nvfp4_candidate(
    bmax: torch.Tensor, sf_scale: torch.Tensor, denominator: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `nvfp4_candidate_scale`: (E4M3 block scale [..., nb], element multiplier [..., nb]) of a block with
    maximum `bmax` mapped to `denominator` (6 or 4). sf_scale = 1 / global scale, broadcastable to bmax."""
    sf = (
        (sf_scale * (bmax * (1.0 / denominator))).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    )  # satfinite
    sfv = sf.float()
    inv = torch.where(sfv != 0, 1.0 / (sfv * (1.0 / sf_scale)), torch.zeros_like(sfv))
    return sf, inv


def _nvfp4_sq_error(xb: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """vLLM's `nvfp4_reconstruction_error` per block [..., nb]: sum of (e2m1_rne(x * mult) / mult - x)**2 (a block
    of multiplier 0 stores zeros), summed in the kernel's order: pairs (2i, 2i+1), then i = 0..7 in sequence.
    xb: [..., nb, 16] finite; mult: [..., nb]."""
    m = mult.unsqueeze(-1)
    deq = torch.where(m != 0, 1.0 / m, torch.zeros_like(m))
    q = e2m1_decode(old_e2m1_encode(xb * m, ties="even"))
    d = q * deq - xb
    sq = d * d
    pair = sq[..., 0::2] + sq[..., 1::2]  # [..., nb, 8]
    err = pair[..., 0]
    for i in range(1, pair.shape[-1]):
        err = err + pair[..., i]
    return err


def _quantize_nvfp4_4over6(xf: torch.Tensor, scale: float | torch.Tensor | None) -> QTensor:
    # vLLM csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu `cvt_warp_fp16_to_fp4_4over6` (see the docstring)
    xb = _blocks(xf, 16)  # [..., D/16, 16]
    fin = torch.where(torch.isfinite(xb), xb, torch.zeros_like(xb))  # the choice never depends on NaN/Inf
    bmax = fin.abs().amax(dim=-1)  # [..., D/16]
    g = _static_scale(scale, xf, None)
    if g is None:
        g = old_nvfp4_dynamic_global(xf)
    sf_scale = 1.0 / _bcast(g, xf.dim())  # the kernel's SFScaleVal = 1 / k_scale
    sf6, mult6 = _nvfp4_candidate(bmax, sf_scale, 6.0)
    sf4, mult4 = _nvfp4_candidate(bmax, sf_scale, 4.0)
    use4 = _nvfp4_sq_error(fin, mult4) < _nvfp4_sq_error(fin, mult6)  # ties keep max/6
    bs = torch.where(use4, sf4.view(torch.uint8), sf6.view(torch.uint8)).view(torch.float8_e4m3fn)
    mult = torch.where(use4, mult4, mult6).unsqueeze(-1)
    y = torch.where(mult != 0, xb * mult, torch.where(torch.isnan(xb), xb, torch.zeros_like(xb)))
    codes = old_e2m1_encode(y, ties="even")
    return QTensor(codes=old_pack_fp4(codes.flatten(-2)), block_scales=bs, scale=g)


def _quantize_fp4_e2m1(xf: torch.Tensor) -> QTensor:
    # SGLang KVFP4QuantizeUtil.batched_quantize, float32
    xb = _blocks(xf, 16)
    bmax = old_finite_abs(xb).amax(dim=-1)  # [..., D/16]
    scale_exp = torch.ceil(torch.log2(torch.clamp(bmax / E2M1_MAX, min=1e-10)))  # [..., D/16]
    y = xb / exp2_int(scale_exp).unsqueeze(-1)
    codes = old_e2m1_encode(y, ties="away")
    return QTensor(codes=old_pack_fp4(codes.flatten(-2)), block_scales=(scale_exp + 127).to(torch.uint8))


def _quantize_mxfp4(xf: torch.Tensor) -> QTensor:
    # OCP MX v1.0 shared exponent floor(log2(amax)) - emax_elem, exact via frexp (amax = m * 2**e, m in [0.5, 1)
    # -> floor(log2(amax)) = e - 1)
    xb = _blocks(xf, 32)
    bmax = old_finite_abs(xb).amax(dim=-1)  # [..., D/32]
    _, e = torch.frexp(bmax)
    shared = torch.where(bmax > 0, e - 1 - 2, torch.full_like(e, -127)).clamp(-127, 127)
    y = xb / exp2_int(shared).unsqueeze(-1)
    codes = old_e2m1_encode(y, ties="even")
    return QTensor(codes=old_pack_fp4(codes.flatten(-2)), block_scales=(shared + 127).to(torch.uint8))


def old_quantize(x: torch.Tensor, fmt: str | KVFormat, scale: float | torch.Tensor | None = None) -> QTensor:
    """Quantize x: [..., D] (cache layout [B, H_kv, T, D]) to `fmt`'s storage layout.

    `scale`: fp8_* — the static scale (x ~ codes * scale): float / 0-d / [H_kv] along dim 1 / [B, 1, 1, 1] per
    sequence, default 1.0; nvfp4 / nvfp4_4over6 — the global scale (same shapes), default
    `old_nvfp4_dynamic_global(x)`; other formats ignore it."""
    f = get_format(fmt)
    if f.element == "auto":
        return QTensor(codes=x)
    xf = _as_f32(x)
    if f.element == "bf16":
        return QTensor(codes=xf.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16))
    if f.element in ("e4m3", "e5m2"):
        return _quantize_fp8(xf, f, scale)
    if f.element == "int8":
        return _quantize_int8(xf)
    if f.name == "nvfp4":
        return _quantize_nvfp4(xf, scale)
    if f.name == "nvfp4_4over6":
        return _quantize_nvfp4_4over6(xf, scale)
    if f.name == "fp4_e2m1":
        return _quantize_fp4_e2m1(xf)
    return _quantize_mxfp4(xf)


# ------------------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor | None) -> tuple | None:
    """dtype, shape and raw bits of t (NaN payloads compared too)."""
    if t is None:
        return None
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.dtype, tuple(t.shape), t.contiguous().view(ints[t.element_size()]).tolist()


def _assert_same(new: QTensor, ref: QTensor) -> None:
    assert _bits(new.codes) == _bits(ref.codes)
    assert _bits(new.block_scales) == _bits(ref.block_scales)
    assert _bits(new.scale) == _bits(ref.scale)


_SPECIALS = [
    float("nan"),
    float("inf"),
    -float("inf"),
    0.0,
    -0.0,
    1e-40,
    -1e-42,
    3e38,
    -1e30,
    65504.0,
    7.9,
    -6.0,
]


def _kv(
    seed: int, shape: tuple[int, ...], log_mag: float, special: float, ties: float, pad: bool
) -> torch.Tensor:
    """Random K/V [B, H, T, D]: normal * 2**log_mag, a fraction `ties` replaced by signed E2M1 midpoints and grid
    values times a power of two (exact ties after a power-of-two scale), a fraction `special` by _SPECIALS, and
    with `pad` the first token of sequence 0 all zeros (a padded position, as the cache stores it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 2.0**log_mag
    grid = torch.tensor([*E2M1_MIDPOINTS, 0.5, 1.0, 6.0, 12.0])
    pick = grid[torch.randint(len(grid), shape, generator=g)]
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    pow2 = 2.0 ** torch.randint(-8, 9, shape, generator=g).float()
    x = torch.where(torch.rand(shape, generator=g) < ties, pick * sign * pow2, x)
    sp = torch.tensor(_SPECIALS)[torch.randint(len(_SPECIALS), shape, generator=g)]
    x = torch.where(torch.rand(shape, generator=g) < special, sp, x)
    if pad:
        x[0, :, 0] = 0.0
    return x


def _scale_for(kind: str, shape: tuple[int, ...], value: float) -> float | torch.Tensor | None:
    b, h = shape[0], shape[1]
    if kind == "none":
        return None
    if kind == "float":
        return value
    if kind == "0-d":
        return torch.tensor(value)
    if kind == "per_head":
        return torch.linspace(value, 2 * value, h)
    return torch.linspace(value, 3 * value, b).reshape(b, 1, 1, 1)  # per sequence


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(QUANTIZED),
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    t=st.integers(1, 4),
    d=st.sampled_from([32, 64]),
    log_mag=st.floats(-40, 40),
    special=st.sampled_from([0.0, 0.05, 0.5]),
    ties=st.sampled_from([0.0, 0.3, 1.0]),
    pad=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    scale_kind=st.sampled_from(["none", "float", "0-d", "per_head", "per_sequence"]),
    scale_value=st.sampled_from([1.0, 0.25, 3e-3, 7.5, 1e3]),
)
def test_quantize_equals_the_previous_implementation(
    name: str, seed: int, b: int, h: int, t: int, d: int, log_mag: float, special: float, ties: float,
    pad: bool, dtype: torch.dtype, scale_kind: str, scale_value: float,
) -> None:  # fmt: skip
    shape = (b, h, t, d)
    x = _kv(seed, shape, log_mag, special, ties, pad).to(dtype)
    scale = _scale_for(scale_kind, shape, scale_value) if FORMATS[name].calibratable else None
    _assert_same(quantize(x, name, scale), old_quantize(x, name, scale))
    # a second write with the same scale tensor (the cache's case: validated once, then remembered)
    _assert_same(quantize(x, name, scale), old_quantize(x, name, scale))


@pytest.mark.parametrize("name", QUANTIZED)
def test_large_tensors_equal_the_previous_implementation(name: str) -> None:
    """Above formats._SMALL elements the per-element-fast paths run; same bits."""
    shape = (1, 4, formats._SMALL // 256 + 3, 64)  # just over _SMALL elements
    x = _kv(11, shape, 3.0, 0.02, 0.3, True)
    scale = torch.tensor(0.37) if FORMATS[name].calibratable else None
    _assert_same(quantize(x, name, scale), old_quantize(x, name, scale))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 300),
    log_mag=st.floats(-3, 5),
    ties=st.sampled_from(["even", "away"]),
)
def test_e2m1_small_path_equals_the_compares(seed: int, n: int, log_mag: float, ties: str) -> None:
    x = _kv(seed, (1, 1, 1, n), log_mag, 0.1, 0.5, False).flatten()
    assert torch.equal(e2m1_encode(x, ties), old_e2m1_encode(x, ties))


def test_e2m1_small_path_at_every_boundary() -> None:
    """Each midpoint, its neighbours one ulp away, both signs, +-0, +-Inf, NaN: bucketize == compares."""
    m = torch.tensor(E2M1_MIDPOINTS + (0.5, 6.0, 7.0, 1e30))
    near = torch.cat([m, torch.nextafter(m, torch.tensor(0.0)), torch.nextafter(m, torch.tensor(1e38))])
    x = torch.cat([near, -near, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45])])
    for ties in ("even", "away"):
        assert torch.equal(e2m1_encode(x, ties), old_e2m1_encode(x, ties))
        big = x.repeat(formats._SMALL // x.numel() + 1)  # the compares path: same codes
        assert torch.equal(e2m1_encode(big, ties)[: x.numel()], e2m1_encode(x, ties))


def test_changed_scale_is_validated_again() -> None:
    """The per-tensor validation memo follows in-place changes (version counter)."""
    s = torch.tensor(0.5)
    x = torch.randn(1, 1, 1, 16)
    quantize(x, "fp8_e4m3", s)
    s.fill_(-1.0)
    with pytest.raises(UsageError):
        quantize(x, "fp8_e4m3", s)


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(QUANTIZED),
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    h=st.integers(1, 5),
    t=st.integers(1, 3),
    d=st.sampled_from([32, 64, 96]),
    log_mag=st.floats(-40, 40),
    special=st.sampled_from([0.0, 0.05]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    k_kind=st.sampled_from(["none", "0-d", "per_head", "per_sequence"]),
    v_kind=st.sampled_from(["same", "none", "0-d", "per_head", "per_sequence"]),
)
def test_quantize_kv_equals_two_quantize_calls(
    name: str, seed: int, b: int, h: int, t: int, d: int, log_mag: float, special: float,
    dtype: torch.dtype, k_kind: str, v_kind: str,
) -> None:  # fmt: skip
    """K and V quantized in one stacked pass give each side's own bits (odd sizes put elements in a vector's scalar
    tail in one call and not in the other), scales included, for every scale shape pairing."""
    shape = (b, h, t, d)
    k = _kv(seed, shape, log_mag, special, 0.3, seed % 2 == 0).to(dtype)
    v = _kv(seed + 1, shape, log_mag - 3, special, 0.3, False).to(dtype)
    calib = FORMATS[name].calibratable
    ks = _scale_for(k_kind, shape, 0.37) if calib else None
    vs = ks if v_kind == "same" else (_scale_for(v_kind, shape, 5.0) if calib else None)
    qk, qv = formats.quantize_kv(k, v, name, ks, vs)
    _assert_same(qk, old_quantize(k, name, ks))
    _assert_same(qv, old_quantize(v, name, vs))
