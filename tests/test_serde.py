"""LMCache's storage serdes (`kvcal.serde`): each round trip bit for bit against a plain transcription of what the
LMCache file computes, the option checks, and the storage bytes `kvcal capacity` reports.

The fp8 serde (lmcache/v1/distributed/serde/fp8.py @ 049f1036) is `tensor.to(torch.float8_e4m3fn)` and back: the
transcription below derives every e4m3 value from its bits (no torch cast) and rounds to nearest, ties to the even
code, saturating |x| > 448 and +-Inf to +-448 (torch 2.13's c10 fp8e4m3fn_from_fp32_value), NaN -> NaN, the sign of
zero kept. A torch whose cast does otherwise (older releases turned an overflow into NaN) fails here.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from kvcal import serde
from kvcal.errors import UsageError

# ---- a plain transcription of the e4m3 cast -----------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    """The value of an e4m3fn code 0..255 from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    is subnormal (m * 2**-9); 0x7f / 0xff are NaN (no Inf)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0**-9
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


_POSITIVE = [(c, _e4m3_value(c)) for c in range(0x7F)]  # 0 .. 448, ascending


def _plain_e4m3(x: float) -> float:
    """RNE to e4m3fn of one float (its exact float64 value), saturating as the serde's cast does."""
    if math.isnan(x):
        return math.nan
    neg = math.copysign(1.0, x) < 0
    a = abs(x)
    if a >= 448.0:  # finite overflow and Inf: 0x7e
        return -448.0 if neg else 448.0
    best_code, best = 0, 0.0
    for code, v in _POSITIVE:
        if v <= a:
            best_code, best = code, v
    if best < a:  # between best and the next value up: nearest, a tie to the even code
        up_code, up = best_code + 1, _POSITIVE[best_code + 1][1]
        if (a - best > up - a) or (a - best == up - a and up_code % 2 == 0):
            best = up
    return -best if neg else best


def _bits(t: torch.Tensor) -> list[int]:
    """The raw bits of a float tensor (NaN payloads and -0 compared exactly)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.contiguous().view(view).flatten().tolist()


def _edge_values() -> torch.Tensor:
    f32_min_sub = struct.unpack("<f", struct.pack("<I", 1))[0]
    vals = [0.0, -0.0, 448.0, -448.0, 449.0, 456.0, 464.0, 464.0001, 479.99, 480.0, -480.0, 481.0, 1e4, -1e30,
            math.inf, -math.inf, math.nan, 2.0**-6, 2.0**-7, 2.0**-9, -(2.0**-9), 2.0**-10, -(2.0**-10),
            1.5 * 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-11, f32_min_sub, -f32_min_sub, 1.0625, 1.1875,
            17.0, 19.0, 240.0, 248.0, 264.0]  # fmt: skip
    return torch.tensor(vals, dtype=torch.float32)


def _random_values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(4096).uniform_(-14, 10, generator=g))  # subnormals of e4m3 to beyond 448
    sign = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_round_trip_is_the_plain_e4m3_cast(dtype: torch.dtype) -> None:
    x = torch.cat([_edge_values(), _random_values(0)]).to(dtype)  # [N]
    got = serde.round_trip("fp8", x.reshape(1, 2, -1, 2))  # any [..., D] layout
    assert got.dtype == dtype and got.shape == (1, 2, x.numel() // 4, 2)
    want = torch.tensor([_plain_e4m3(v) for v in x.double().tolist()], dtype=torch.float64).to(dtype)
    got = got.flatten()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)  # NaN in, NaN out (its payload is torch's, not compared)
    assert _bits(got[~nan]) == _bits(want[~nan]), "fp8 serde round trip differs from the plain e4m3 transcription"


def test_fp8_round_trip_edges_spelled_out() -> None:
    x = torch.tensor([math.inf, -math.inf, 500.0, 464.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-10, math.nan])
    got = serde.round_trip("fp8", x)
    # Inf and overflow saturate (no scale: nothing else bounds them); ties go to even codes; -0 stays -0
    assert got[:5].tolist() == [448.0, -448.0, 448.0, 448.0, 0.0]
    assert math.copysign(1.0, got[5].item()) < 0 and got[5].item() == 0.0
    assert got[6].item() == 2.0**-8 and math.isnan(got[7].item())


def test_aesgcm_round_trip_is_exact_bits() -> None:
    x = torch.cat([_edge_values(), _random_values(1)]).to(torch.bfloat16)
    assert _bits(serde.round_trip("aesgcm", x)) == _bits(x)


# ---- the options ------------------------------------------------------------------------------------------


def test_neither_option_is_off() -> None:
    assert serde.check_prefix_serde(None, None) == (None, 0)


def test_both_options_parse() -> None:
    assert serde.check_prefix_serde("FP8", 64) == ("fp8", 64)
    assert serde.check_prefix_serde("aesgcm", 1) == ("aesgcm", 1)


@pytest.mark.parametrize(
    ("name", "tokens", "needles"),
    [
        ("fp8", None, ["--prefix-serde fp8 needs --prefix-tokens N"]),
        (None, 8, ["--prefix-tokens 8 needs --prefix-serde NAME", "fp8"]),
        ("fp8", 0, ["--prefix-tokens must be at least 1", "got 0"]),
        ("fp8", -3, ["--prefix-tokens must be at least 1", "got -3"]),
        ("zstd", 4, ["unknown --prefix-serde 'zstd'", "fp8, aesgcm"]),
        ("asym_k16_v8", 4, ["asym_k16_v8 is not emulated", "amax of a whole stored object", "every layer", "kvcal capacity"]),
    ],
)
def test_bad_options_are_one_usage_error(name: str | None, tokens: int | None, needles: list[str]) -> None:
    with pytest.raises(UsageError) as err:
        serde.check_prefix_serde(name, tokens)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_every_serde_is_emulated_or_says_why() -> None:
    for name in serde.SERDES:
        emulated = name in serde._ROUND_TRIPS
        assert emulated != (name in serde.NOT_EMULATED), name


# ---- storage bytes ----------------------------------------------------------------------------------------


def _lmcache_tq_slot(preset: str, d: int) -> int:
    """TurboQuantSerdeConfig.slot_size_aligned, from its TQ_PRESETS (key bits, value bits) spelled out here."""
    kbits, vbits = {"turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4), "turboquant_k3v4_nc": (3, 4),
                    "turboquant_3bit_nc": (3, 3)}[preset]  # fmt: skip
    key = d if kbits == 8 else math.ceil(d * kbits / 8) + 2  # fp8 bytes, or packed codes + fp16 norm
    value = math.ceil(d * vbits / 8) + 4  # packed codes + fp16 scale + fp16 zero
    s = key + value
    return s + s % 2


def test_storage_bytes_per_layer() -> None:
    h, d = 4, 64
    assert serde.layer_storage_bytes("fp8", 0, 30, h, d) == 2 * h * d
    assert serde.layer_storage_bytes("aesgcm", 0, 30, h, d) == 2 * h * d * 2
    assert serde.layer_storage_bytes("asym_k16_v8", 0, 30, h, d) == h * d * 3
    for preset in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
        per_layer = [serde.layer_storage_bytes(preset, i, 30, h, d) for i in range(30)]
        raw = 2 * h * d * 2
        # the first and last 2 layers raw, every other one in slots of slot_size_aligned bytes per head
        assert per_layer[:2] == [raw, raw] and per_layer[-2:] == [raw, raw]
        assert set(per_layer[2:-2]) == {h * _lmcache_tq_slot(preset, d)}


def test_tq_serde_layers_of_a_short_model() -> None:
    # LMCache's _layer_ranges: quantized = [min(2, L), max(that, L - 2)): a 3-layer model keeps every layer raw
    raw = 2 * 2 * 16 * 2
    assert [serde.layer_storage_bytes("turboquant_k8v4", i, 3, 2, 16) for i in range(3)] == [raw] * 3
    assert serde.layer_storage_bytes("turboquant_k8v4", 2, 5, 2, 16) == 2 * _lmcache_tq_slot("turboquant_k8v4", 16)


def test_tq_serde_needs_a_power_of_two_head_dim() -> None:
    with pytest.raises(UsageError, match="power-of-two head_dim"):
        serde.layer_storage_bytes("turboquant_4bit_nc", 3, 30, 2, 96)


# ---- TurboQuant: LMCache's load path, row by row from the stored bytes ---------------------------------------
# The store is vLLM's (kvcal's `formats.quantize` of a TurboQuant side, tested against vLLM's store in
# tests/test_formats_turboquant.py). What LMCache adds is its load: turboquant/decode_kernel.py @ 06597f1c
# `_tq_full_dequant_kv` (bit arithmetic of the packed codes, norm correction, float16 stores) and turboquant.py @
# 2375bc65 (keys `(k16.float() @ PiT.T).to(float16)`, then `.to(dst dtype)`), transcribed here per (token, head)
# with numpy float32 / float16 scalars.

TQ = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def _unpack_row(packed: list[int], j: int, bits: int) -> int:
    """The kernel's code of element j: a 16-bit little-endian window at byte (j * bits) // 8, shifted and masked."""
    off = j * bits
    lo, hi = packed[off // 8], packed[off // 8 + 1] if off // 8 + 1 < len(packed) else 0
    return ((lo | (hi << 8)) >> (off % 8)) & ((1 << bits) - 1)


def _sylvester(d: int) -> list[list[int]]:
    h = [[1]]
    while len(h) < d:
        h = [r + r for r in h] + [r + [-v for v in r] for r in h]
    return h


def _lmcache_signs(d: int, layer: int) -> torch.Tensor:
    """LMCache turboquant.py `_generate_wht_signs(head_dim, seed=42 + layer_idx * 1337)`: randint(0, 2) * 2 - 1."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(42 + layer * 1337)
    return torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1


def _lmcache_tq_row(preset: str, side: str, q: object, idx: tuple[int, ...], d: int, layer: int) -> list[float]:
    """One (token, head) row of LMCache's load in float32 values of float16 results (before the dst cast)."""
    import numpy as np

    from kvcal import formats

    f = formats.TQ_PRESETS[preset][0 if side == "k" else 1]
    codes = q.codes[idx]  # type: ignore[attr-defined]
    if f.element == "tq_fp8":  # e4m3 bits -> float32 -> float16 (exact)
        return [float(np.float16(_e4m3_value(int(b)))) for b in codes.view(torch.uint8).tolist()]
    packed = codes.tolist()
    cidx = [_unpack_row(packed, j, f.bits) for j in range(d)]
    if f.element == "tq_uniform":
        scale16, zero16 = (float(v) for v in q.block_scales[idx].tolist())  # type: ignore[attr-defined]
        # v_idx * v_scale + v_zero in float32 with one rounding (the FMA; the product is exact), stored float16
        return [float(np.float16(np.float32(c * scale16 + zero16))) for c in cidx]
    cents = formats.tq_centroids(d, f.bits).tolist()
    c = [np.float32(cents[i]) for i in cidx]
    # NORM_CORRECTION with kvcal's correctly rounded float32 sum / sqrt / reciprocal
    nsq = np.float32(np.float32(sum(float(v) * float(v) for v in c)) + np.float32(1e-16))
    inv = np.float32(1.0 / float(np.float32(math.sqrt(float(nsq)))))
    norm16 = np.float32(float(q.block_scales[idx].item()))  # type: ignore[attr-defined]
    k_rot16 = [np.float16(norm16 * np.float32(v * inv)) for v in c]  # K_out store
    # host: k_rot16.float() @ PiT.T, PiT = diag(signs) H / sqrt(D); sums exact in float64, rounded once to float32
    signs = _lmcache_signs(d, layer).tolist()
    h = _sylvester(d)
    entry = formats.tq_hadamard_entry(d)
    out = []
    for j in range(d):
        acc = sum(h[j][i] * float(k_rot16[i]) for i in range(d))
        out.append(float(np.float16(np.float32(acc * entry * signs[j]))))
    return out


@pytest.mark.parametrize("preset", TQ)
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("d", [16, 64])
def test_turboquant_round_trip_is_lmcaches_load_row_by_row(preset: str, side: str, d: int) -> None:
    from kvcal import formats

    layer = 5
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(2, 2, 3, d, generator=g) * torch.logspace(-2, 2, d)).to(torch.bfloat16)  # [B, H, T, D]
    x[0, 1, 2, 3] = 600.0  # FP8 keys saturate at 448
    got = serde.round_trip(preset, x, side, layer)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    f = formats.TQ_PRESETS[preset][0 if side == "k" else 1]
    # LMCache's store is the vLLM store kvcal transcribes, but MSE keys keep LMCache's per-layer signed rotation
    signs = _lmcache_signs(d, layer)
    assert torch.equal(serde.lmcache_tq_signs(d, layer), signs)
    q = formats.tq_quantize_mse(x.float(), f, signs) if f.element == "tq_mse" else formats.quantize(x, f)
    for idx in [(b, h, t) for b in range(2) for h in range(2) for t in range(3)]:
        row16 = torch.tensor(_lmcache_tq_row(preset, side, q, idx, d, layer), dtype=torch.float16)
        assert _bits(got[idx]) == _bits(row16.to(torch.bfloat16)), (preset, side, idx)  # float16 -> bf16 dst


def test_turboquant_round_trip_rounds_through_float16_before_the_dst_dtype() -> None:
    # the same values in a float32 destination keep the float16 grid: every output is a float16 value
    x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(3)) * 5
    for preset in TQ:
        for side in "kv":
            y = serde.round_trip(preset, x, side, 2)
            assert y.dtype == torch.float32 and torch.equal(y, y.half().float())


def test_turboquant_layers_and_seeds() -> None:
    assert list(serde.tq_serde_layers(30)) == list(range(2, 28)) and list(serde.tq_serde_layers(4)) == []
    assert [serde.serde_for_layer("turboquant_4bit_nc", i, 6) for i in range(6)] == [None, None, *["turboquant_4bit_nc"] * 2, None, None]
    assert serde.serde_for_layer("fp8", 0, 6) == "fp8"
    # each layer rotates with its own signs (seed 42 + 1337 * layer): the same K reloads differently
    x = torch.randn(1, 1, 4, 64, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(serde.round_trip("turboquant_4bit_nc", x, "k", 2), serde.round_trip("turboquant_4bit_nc", x, "k", 3))


def test_turboquant_geometry_is_checked() -> None:
    serde.check_serde_geometry("turboquant_4bit_nc", {0: 96, 1: 96, 2: 64, 3: 64, 4: 96, 5: 96})  # raw layers: any
    with pytest.raises(UsageError, match="power-of-two head_dim"):
        serde.check_serde_geometry("turboquant_4bit_nc", {i: 96 for i in range(6)})
    serde.check_serde_geometry("fp8", {i: 96 for i in range(6)})
