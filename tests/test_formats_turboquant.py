"""vLLM's TurboQuant presets (turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc) against
a literal transcription of vLLM's arithmetic, one (token, head) row at a time in numpy float32 scalars:

- vllm/model_executor/layers/quantization/turboquant/config.py @ 1471680b24719d9d3b2fe1235878196142af89cc
  (TQ_PRESETS, key_packed_size, value_packed_size, slot_size_aligned, get_boundary_skip_layers),
- .../turboquant/centroids.py @ 06d0369d75e060e83dffac3e0190ceff8fc37e12 (solve_lloyd_max),
- vllm/v1/attention/backends/turboquant_attn.py of vLLM 0.32.0 / 0.33.0 (the same file in both wheels:
  _build_hadamard_cached, _ensure_on_device: PiT = Pi = H / sqrt(d) for every layer, no signs),
- vllm/v1/attention/ops/triton_turboquant_store.py @ 0135d081c30fa476130ae77a152539ce317ab8b1 and
  triton_turboquant_decode.py @ 055e47c28003156421365af985d676fc921cb075 (store, decode and dequant kernels).

Where vLLM's order of a float32 reduction is its GPU's (the key norm, the x_hat @ PiT GEMM, the norm correction's
sum), the transcription takes the exact value rounded once to float32, which is what kvcal's spec says it computes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.capacity import kv_bytes_per_token
from kvcal.errors import UsageError
from kvcal.kernels.reference import quantized_attention_ref
from kvcal.models.geometry import FULL, SLIDING, KVSpec, LayerSpec

F32 = np.float32
PRESETS = list(formats.TQ_PRESETS)


# ---- transcriptions --------------------------------------------------------------------------------------------


def vllm_pit(d: int) -> np.ndarray:
    """_ensure_on_device's PiT = _build_hadamard(d) = H / sqrt(d) (Sylvester H built on CPU in float32), float64."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).double().numpy()


def vllm_centroids(d: int, bits: int) -> np.ndarray:
    """solve_lloyd_max(d, bits)[0] as float32."""
    n = 2**bits
    var = 1.0 / d
    sd = math.sqrt(var)

    def density(x: float) -> float:
        return (1.0 / math.sqrt(2 * math.pi * var)) * math.exp(-x * x / (2 * var))

    def integral(fn, a: float, b: float) -> float:
        step = (b - a) / 200
        total = 0.5 * (fn(a) + fn(b))
        for i in range(1, 200):
            total += fn(a + i * step)
        return total * step

    lo, hi = -3.5 * sd, 3.5 * sd
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    it = 0
    while it < 200:
        b = [(c[i] + c[i + 1]) / 2.0 for i in range(n - 1)]
        e = [lo * 3] + b + [hi * 3]
        nxt = []
        for i in range(n):
            den = integral(density, e[i], e[i + 1])
            num = integral(lambda x: x * density(x), e[i], e[i + 1])
            nxt.append(num / den if den > 1e-15 else c[i])
        if max(abs(nxt[i] - c[i]) for i in range(n)) < 1e-10:
            break
        c = nxt
        it += 1
    return np.array(c, dtype=F32)


def exact_dot_f32(a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """a [D] float32 @ m [D, D] (float32 entries): each output the exact sum rounded once to float32 (a row holding
    +-Inf: the float64 sum, whose Inf / NaN does not depend on the order)."""
    if not np.isfinite(a).all():
        with np.errstate(invalid="ignore"):
            return (a.astype(np.float64) @ m).astype(F32)
    return np.array([F32(math.fsum(float(x) * float(y) for x, y in zip(a, m[:, j], strict=True)))
                     for j in range(m.shape[1])], dtype=F32)  # fmt: skip


def pack_bits(idx: list[int], bits: int) -> list[int]:
    """_tq_fused_store_mse / _store_quantized_value packing."""
    if bits == 4:
        return [(idx[2 * i] & 0xF) | ((idx[2 * i + 1] & 0xF) << 4) for i in range(len(idx) // 2)]
    out = []
    for g in range(len(idx) // 8):
        w = sum((idx[8 * g + j] & 7) << (3 * j) for j in range(8))
        out += [w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF]
    return out


def vllm_store_key(k: np.ndarray, pit: np.ndarray, mids: np.ndarray, bits: int) -> tuple[list[int], np.float16]:
    """The launcher (norm, x / (norm + 1e-8), @ PiT) and _tq_fused_store_mse for one row: packed bytes, fp16 norm."""
    norm = F32(math.sqrt(math.fsum(float(e) * float(e) for e in k)))
    xhat = np.array([F32(e / F32(norm + F32(1e-8))) for e in k], dtype=F32)
    y = exact_dot_f32(xhat, pit)
    n = len(mids) + 1
    idx = []
    for v in y:  # the kernel's binary search
        lo, hi = 0, n - 1
        for _ in range(bits):
            mid = (lo + hi) >> 1
            if v >= mids[min(mid, n - 2)]:
                lo = mid + 1
            else:
                hi = mid
        idx.append(min(lo, n - 1))
    with np.errstate(over="ignore"):
        return pack_bits(idx, bits), np.float16(norm)


def vllm_dequant_key(packed: list[int], norm16: np.float16, pit: np.ndarray, cents: np.ndarray, bits: int,
                     d: int) -> np.ndarray:  # fmt: skip
    """_tq_full_dequant_kv (NORM_CORRECTION) then `k @ Pi` of _continuation_prefill, one row."""
    raw = packed + [0]
    idx = []
    for j in range(d):
        bit = j * bits
        r16 = raw[bit // 8] | (raw[bit // 8 + 1] << 8)
        idx.append((r16 >> (bit % 8)) & ((1 << bits) - 1))
    c = cents[idx]
    nsq = F32(math.fsum(float(x) * float(x) for x in c))
    inv = F32(F32(1.0) / F32(np.sqrt(F32(nsq + F32(1e-16)))))
    with np.errstate(over="ignore", invalid="ignore"):
        k_rot = np.array([F32(F32(norm16) * F32(x * inv)) for x in c], dtype=F32)
        return exact_dot_f32(k_rot, pit.T.copy())


def vllm_store_value(v: np.ndarray, bits: int) -> tuple[list[int], np.float16, np.float16]:
    """_store_quantized_value for one row: packed bytes, fp16 scale, fp16 zero (the minimum)."""
    levels = 2**bits - 1
    vmin, vmax = F32(v.min()), F32(v.max())
    with np.errstate(over="ignore"):
        s = F32(F32(vmax - vmin) / F32(levels))
        s = s if s > F32(1e-8) else F32(1e-8)
        q = [min(max(int(F32(F32(F32(e - vmin) / s) + F32(0.5))), 0), levels) for e in v]
        return pack_bits(q, bits), np.float16(s), np.float16(vmin)


def vllm_dequant_value(q: list[int], s16: np.float16, z16: np.float16) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array([F32(F32(x) * F32(s16) + F32(z16)) for x in q], dtype=F32)


def _rows(seed: int, d: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 2, n, d] finite K/V with the edge values: +-0, subnormals, tiny and huge magnitudes, an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, n, d, generator=g) * torch.exp(torch.randn(1, 2, n, 1, generator=g) * 3)
    edge = torch.tensor([0.0, -0.0, 1e-40, -1e-41, 3e-39, 1e-30, -7e4, 65504.0, 448.0, -1e-6])
    x[0, 0, 0, : min(d, edge.numel())] = edge[:d]
    x[0, 1, 0] = 0.0
    if n > 1:
        x[0, 1, 1] = -0.0
    if n > 2:
        x[0, 0, 2] *= 1e4  # a row whose norm / range is beyond float16: Inf stored, as the engine
    return x.to(dtype)


def _geometry(n: int, kv_heads: int, d: int, sliding_every: int = 0, window: int = 512) -> KVSpec:
    """n layers; with sliding_every = k, every k-th layer (index k-1, 2k-1, ...) full attention, the rest sliding."""
    layers = []
    for i in range(n):
        full = sliding_every == 0 or i % sliding_every == sliding_every - 1
        layers.append(LayerSpec(i, FULL if full else SLIDING, None if full else window, kv_heads, kv_heads, d))
    return KVSpec("test", tuple(layers), None, None)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---- codebooks, rotation, constants ----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_centroids_and_midpoints_are_vllms(d: int, bits: int) -> None:
    c = formats.tq_centroids(d, bits)
    assert np.array_equal(c.numpy(), vllm_centroids(d, bits))
    assert torch.equal(c, -c.flip(0))  # N(0, 1/d) is symmetric; so is Lloyd-Max's fixed point from a symmetric start
    cs = torch.from_numpy(np.sort(vllm_centroids(d, bits)))
    assert torch.equal(formats.tq_midpoints(d, bits), (cs[:-1] + cs[1:]) / 2)


@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_rotation_is_vllms_pit(d: int) -> None:
    """x @ PiT with PiT = H / sqrt(d), every layer's; PiT is symmetric, so the inverse Pi = PiT^T is the same map."""
    pit = vllm_pit(d)
    assert np.array_equal(pit, pit.T)
    x = torch.randn(3, d)
    want = torch.from_numpy(np.stack([exact_dot_f32(r, pit) for r in x.numpy()]))
    _same(formats.tq_rotate(x), want)


def test_slot_sizes_and_boundary_layers_are_vllms() -> None:
    # TurboQuantConfig: key = D (FP8) or ceil(D * b / 8) + 2; value = ceil(D * b / 8) + 4; slot rounded up to even
    # turboquant_attn.py's docstring says "[100 bytes key | 512 bytes value] = 612" for k3v4_nc at 256: stale (fp16
    # values, an older key layout); the config's properties, which size the cache, give 98 + 132
    assert formats.tq_slot_bytes("turboquant_k3v4_nc", 256) == 98 + 132
    for d in (8, 64, 128, 256):
        for name, (k, v) in formats.TQ_PRESETS.items():
            key = d if k.bits == 8 else math.ceil(d * k.bits / 8) + 2
            val = math.ceil(d * v.bits / 8) + 4
            assert formats.tq_slot_bytes(name, d) == key + val + (key + val) % 2
            assert k.bits_per_element(d) * d / 8 == key and v.bits_per_element(d) * d / 8 == val
    assert formats.tq_boundary_layers(30) == {0, 1, 28, 29}
    assert formats.tq_boundary_layers(18) == {0, 1, 16, 17}
    assert formats.tq_boundary_layers(3) == {0, 2}  # n capped at num_layers // 2
    assert formats.tq_boundary_layers(1) == set() and formats.tq_boundary_layers(30, 0) == set()


# ---- quantize / dequantize bit for bit --------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([8, 16, 64, 128]),
       dtype=st.sampled_from(["bf16", "f32"]), preset=st.sampled_from(PRESETS[1:]))  # fmt: skip
@example(seed=39916799, d=128, dtype="bf16", preset="turboquant_k3v4_nc")  # torch's f32 sqrt is 1 ulp off
def test_keys_equal_vllm(seed: int, d: int, dtype: str, preset: str) -> None:
    """MSE keys: packed codes and the fp16 norm bit for bit, and the dequantized (un-rotated) key."""
    kf = formats.TQ_PRESETS[preset][0]
    x = _rows(seed, d, 3, torch.bfloat16 if dtype == "bf16" else torch.float32)
    q = formats.quantize(x, kf)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (1, 2, 3, d * kf.bits // 8)
    assert q.block_scales.dtype == torch.float16 and q.block_scales.shape == (1, 2, 3, 1)
    got = formats.dequantize(q, kf)
    pit, cents = vllm_pit(d), vllm_centroids(d, kf.bits)
    mids = (np.sort(cents)[:-1] + np.sort(cents)[1:]) / F32(2)
    for h in range(2):
        for t in range(3):
            packed, norm16 = vllm_store_key(x[0, h, t].float().numpy(), pit, mids, kf.bits)
            assert q.codes[0, h, t].tolist() == packed
            assert q.block_scales[0, h, t].view(torch.int16).item() == np.array(norm16).view(np.int16)
            want = vllm_dequant_key(packed, norm16, pit, cents, kf.bits, d)
            _same(got[0, h, t], torch.from_numpy(want))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([8, 16, 64, 256]), bits=st.sampled_from([3, 4]),
       dtype=st.sampled_from(["bf16", "f32"]))  # fmt: skip
def test_values_equal_vllm(seed: int, d: int, bits: int, dtype: str) -> None:
    """Uniform values: packed codes, fp16 scale and zero bit for bit, and idx * scale + zero."""
    vf = formats.TQ_SIDES[f"tq_uniform{bits}"]
    x = _rows(seed, d, 3, torch.bfloat16 if dtype == "bf16" else torch.float32)
    q = formats.quantize(x, vf)
    assert q.codes.shape == (1, 2, 3, d * bits // 8) and q.block_scales.shape == (1, 2, 3, 2)
    got = formats.dequantize(q, vf)
    for h in range(2):
        for t in range(3):
            packed, s16, z16 = vllm_store_value(x[0, h, t].float().numpy(), bits)
            assert q.codes[0, h, t].tolist() == packed
            words = q.block_scales[0, h, t].view(torch.int16).tolist()
            assert words == [int(np.array(s16).view(np.int16)), int(np.array(z16).view(np.int16))]
            idx = formats.tq_unpack(q.codes[0, h, t], bits, d).tolist()
            _same(got[0, h, t], torch.from_numpy(vllm_dequant_value(idx, s16, z16)))


def test_fp8_keys_are_unscaled_saturating_e4m3() -> None:
    """turboquant_k8v4's keys: `k.to(float8e4nv)` in the store kernel, no k_scale, +-448 saturated, NaN kept."""
    kf = formats.TQ_PRESETS["turboquant_k8v4"][0]
    x = torch.tensor([0.0, -0.0, 1e-40, 300.7, 448.0, 1e4, -float("inf"), float("nan")])
    q = formats.quantize(x, kf)
    assert q.codes.dtype == torch.float8_e4m3fn and q.block_scales is None and q.scale is None
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.codes.view(torch.uint8), want.view(torch.uint8))
    _same(formats.dequantize(q, kf), want.float())


# ---- non-finite policy, refusals ---------------------------------------------------------------------------------


def test_nonfinite_rows_are_nan_and_zero_rows_exact() -> None:
    """A (token, head) row with a NaN or Inf is stored with a NaN norm / scale (kvcal's marker: vLLM's key row
    turns NaN / +-Inf as well; its value row would store NaN as the row minimum); an all-zero row reads back 0."""
    for preset in PRESETS[1:]:
        for side in formats.TQ_PRESETS[preset]:
            x = torch.randn(1, 1, 3, 64)
            x[0, 0, 0, 3] = float("nan")
            x[0, 0, 1, 5] = float("inf")
            x[0, 0, 2] = 0.0
            y = formats.fake_quantize(x, side)
            assert torch.isnan(y[0, 0, :2]).all(), (preset, side.name)
            assert torch.equal(y[0, 0, 2], torch.zeros(64))


@pytest.mark.parametrize("d", [96, 80, 7, 1])
@pytest.mark.parametrize("preset", PRESETS)
def test_non_power_of_two_head_dim_is_refused(preset: str, d: int) -> None:
    kv = _geometry(8, 2, d)
    with pytest.raises(UsageError, match="power-of-two head_dim") as e:
        kv_bytes_per_token(kv, preset)
    assert "\n" not in str(e.value)
    for side in formats.TQ_PRESETS[preset]:
        with pytest.raises(UsageError, match="power-of-two head_dim"):
            formats.quantize(torch.randn(1, 1, 2, d), side)


def test_three_bit_needs_groups_of_eight() -> None:
    kv = _geometry(8, 2, 4)
    with pytest.raises(UsageError, match="groups of 8"):
        kv_bytes_per_token(kv, "turboquant_3bit_nc")
    assert kv_bytes_per_token(kv, "turboquant_4bit_nc", tq_boundary=0) == 8 * 2 * formats.tq_slot_bytes(
        "turboquant_4bit_nc", 4
    )


def test_sides_are_no_format_of_their_own() -> None:
    assert formats.parse_kv_format("TurboQuant_4bit_NC") == "turboquant_4bit_nc"
    assert formats.kv_pair("turboquant_k8v4") == formats.TQ_PRESETS["turboquant_k8v4"]
    with pytest.raises(UsageError, match="one side of a TurboQuant preset"):
        formats.parse_kv_format("k=tq_mse4_nc,v=nvfp4")
    with pytest.raises(UsageError, match="K/V pair"):
        formats.get_format("turboquant_3bit_nc")
    for preset, (k, v) in formats.TQ_PRESETS.items():
        assert formats.pair_name(k, v) == preset
    assert set(formats.TQ_PRESETS) <= set(formats.format_names().split(", "))


# ---- attention: vLLM scores rotated queries against the rotated codes -----------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_dequantized_attention_is_vllms_decode(preset: str) -> None:
    """_tq_decode_stage1: q_rot = q @ PiT, score = norm * (q_rot . c_nc) * scale (FP8 keys: q . k), softmax,
    values idx * scale + zero. kvcal dequantizes K back to the unrotated basis instead: the same attention up to
    float32 rounding (here computed in float64 from the stored codes)."""
    torch.manual_seed(5)
    d, tk = 64, 23
    kf, vf = formats.TQ_PRESETS[preset]
    k = torch.randn(1, 1, tk, d).bfloat16()
    v = torch.randn(1, 1, tk, d).bfloat16()
    q = torch.randn(1, 2, 1, d)  # GQA: two query heads on one KV head
    kq, vq = formats.quantize(k, kf), formats.quantize(v, vf)
    if kf.element == "tq_fp8":
        scores = q.double() @ kq.codes.double().transpose(-1, -2)
    else:
        c = formats.tq_centroids(d, kf.bits).double()[formats.tq_unpack(kq.codes, kf.bits, d)]
        c = c / c.norm(dim=-1, keepdim=True)
        q_rot = q.double() @ torch.from_numpy(vllm_pit(d))
        scores = (q_rot @ c.transpose(-1, -2)) * kq.block_scales.double().transpose(-1, -2)
    p = torch.softmax(scores * d**-0.5, dim=-1)  # [1, 2, 1, tk]
    w = vq.block_scales.double()
    vals = formats.tq_unpack(vq.codes, vf.bits, d).double() * w[..., :1] + w[..., 1:]
    want = p @ vals
    got = quantized_attention_ref(q.double(), kq, vq, kf, v_fmt=vf, scaling=d**-0.5, q_start=tk - 1, k_start=0,
                                  compute_dtype=torch.float64)  # fmt: skip
    assert torch.allclose(got, want, rtol=0, atol=2e-5)


# ---- capacity: vLLM's page-size arithmetic ------------------------------------------------------------------------


def test_capacity_is_vllms_page_size_smollm2_and_gemma3() -> None:
    """TQFullAttentionSpec: block_size x kv_heads x slot_size_aligned bytes per page for a TurboQuant layer, a
    standard BF16 page (2 x kv_heads x head_dim x 2) for the boundary / skipped layers."""
    smol = _geometry(30, 3, 64)  # SmolLM2-135M
    for preset in PRESETS:
        tq = 3 * formats.tq_slot_bytes(preset, 64)
        assert kv_bytes_per_token(smol, preset) == 26 * tq + 4 * 2 * 3 * 64 * 2
        assert kv_bytes_per_token(smol, preset, tq_boundary=0) == 30 * tq
    assert kv_bytes_per_token(smol, "turboquant_4bit_nc") == 8532
    # Gemma-3-270M: 18 layers, every 6th full attention, the rest sliding (window 512), 1 KV head of 256
    gemma = _geometry(18, 1, 256, sliding_every=6)
    with pytest.raises(UsageError, match="sliding_window"):
        kv_bytes_per_token(gemma, "turboquant_4bit_nc")
    sliding = frozenset(i for i in range(18) if i % 6 != 5)
    for preset in PRESETS:
        # layers 5 and 11 TurboQuant; 17 is a boundary layer; the 15 sliding ones skipped
        want = 2 * formats.tq_slot_bytes(preset, 256) + 16 * 2 * 256 * 2
        assert kv_bytes_per_token(gemma, preset, sliding) == want
    assert formats.tq_slot_bytes("turboquant_4bit_nc", 256) == 262
