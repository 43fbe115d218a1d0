"""The torch path's fast quantization (`kvcal.kernels.fast.quantize` / `quantize_kv`: what the cache writes with; a
decode step quantizes one token per K/V per layer) gives the bits of the plain spec, `kvcal.formats.quantize`.
Codes, block scales and scales are compared bit for bit, NaN payloads included, over random K/V with NaN, +-Inf,
+-0, subnormals, huge values, exact E2M1 ties and padded (all-zero) tokens, in every format, with every scale shape
(none, 0-d, [H_kv], [B, 1, 1, 1]) and input dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.formats import E2M1_MIDPOINTS, FORMATS, QTensor, quantize
from kvcal.kernels import fast

QUANTIZED = [n for n in FORMATS if n != "auto"]


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
def test_fast_quantize_equals_the_spec(
    name: str, seed: int, b: int, h: int, t: int, d: int, log_mag: float, special: float, ties: float,
    pad: bool, dtype: torch.dtype, scale_kind: str, scale_value: float,
) -> None:  # fmt: skip
    shape = (b, h, t, d)
    x = _kv(seed, shape, log_mag, special, ties, pad).to(dtype)
    scale = _scale_for(scale_kind, shape, scale_value) if FORMATS[name].calibratable else None
    ref = quantize(x, name, scale)
    _assert_same(fast.quantize(x, name, scale), ref)
    if isinstance(scale, torch.Tensor):  # the cache's case: a scale validated once, then passed as checked
        _assert_same(fast.quantize(x, name, formats.check_scale(scale, x), scale_checked=True), ref)


@pytest.mark.parametrize("name", QUANTIZED)
def test_at_the_small_tensor_limit(name: str) -> None:
    """At fast.SMALL elements the bucketize path, one token more formats' compares: the same bits either side."""
    for t in (fast.SMALL // 256, fast.SMALL // 256 + 1):
        x = _kv(11, (1, 4, t, 64), 3.0, 0.02, 0.3, True)
        scale = torch.tensor(0.37) if FORMATS[name].calibratable else None
        _assert_same(fast.quantize(x, name, scale), quantize(x, name, scale))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 300),
    log_mag=st.floats(-3, 5),
    ties=st.sampled_from(["even", "away"]),
)
def test_e2m1_small_path_equals_the_compares(seed: int, n: int, log_mag: float, ties: str) -> None:
    x = _kv(seed, (1, 1, 1, n), log_mag, 0.1, 0.5, False).flatten()
    assert torch.equal(fast.e2m1_encode(x, ties), formats.e2m1_encode(x, ties))
    if ties == "even":
        assert torch.equal(fast._e2m1_round(x).nan_to_num(9.0), formats.PLAIN_E2M1.round(x).nan_to_num(9.0))


def test_e2m1_small_path_at_every_boundary() -> None:
    """Each midpoint, its neighbours one ulp away, both signs, +-0, +-Inf, NaN: bucketize == compares."""
    m = torch.tensor(E2M1_MIDPOINTS + (0.5, 6.0, 7.0, 1e30))
    near = torch.cat([m, torch.nextafter(m, torch.tensor(0.0)), torch.nextafter(m, torch.tensor(1e38))])
    x = torch.cat([near, -near, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45])])
    for ties in ("even", "away"):
        assert torch.equal(fast.e2m1_encode(x, ties), formats.e2m1_encode(x, ties))
        big = x.repeat(fast.SMALL // x.numel() + 1)  # past SMALL: formats' compares
        assert torch.equal(fast.e2m1_encode(big, ties)[: x.numel()], fast.e2m1_encode(x, ties))


def test_changed_scale_is_validated_again() -> None:
    """formats validates a scale at every call (no memo: a scale changed in place is refused)."""
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
    if name == "int4_per_token_head" and d & (d - 1):
        d = 128  # its Hadamard rotation needs a power-of-two head_dim
    shape = (b, h, t, d)
    k = _kv(seed, shape, log_mag, special, 0.3, seed % 2 == 0).to(dtype)
    v = _kv(seed + 1, shape, log_mag - 3, special, 0.3, False).to(dtype)
    calib = FORMATS[name].calibratable
    ks = _scale_for(k_kind, shape, 0.37) if calib else None
    vs = ks if v_kind == "same" else (_scale_for(v_kind, shape, 5.0) if calib else None)
    qk, qv = fast.quantize_kv(k, v, name, ks, vs)
    _assert_same(qk, quantize(k, name, ks))
    _assert_same(qv, quantize(v, name, vs))
