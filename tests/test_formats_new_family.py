"""A format family added from outside kvcal's sources, to show the shape of adding one (issue 39): its codec
(quantize, dequantize, storage widths and bits: `kvcal.formats.Codec`, registered) and its row (names, storage
dtypes, its Triton loader id and C id: `kvcal.formats.add_format`), and nothing else. Every consumer asks the
row's codec, so the name parser, capacity, the plain and fast torch paths, the Triton kernel and the cache take it
as it is.

The demonstration family, `demo_int8_rha_per_token_head` (test-only, no engine's format): int8_per_token_head's
storage (int8 codes, one fp32 scale per (token, KV head), code -128 = NaN) with its codes rounded half away from
zero instead of truncated. Its layout is int8_per_token_head's, so it declares the int8 tile loader
(`triton_kernel` 2) and no C id (the cache writes it with torch ops)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcal import formats
from kvcal.formats import Codec, KVFormat, QTensor
from kvcal.formats.codec import CODECS, register
from kvcal.formats.fp8 import per_token_bits, per_token_widths

NAME = "demo_int8_rha_per_token_head"
FAMILY = "demo_int8_rha"


def _quantize(xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: object) -> QTensor:
    """xf float32 [..., D]: scale = max(amax / 127, 1e-6) over the finite values, codes = round half away from zero
    of x * (1 / scale) clamped to +-127, NaN -> -128."""
    scale = (formats.finite_abs(xf).amax(dim=-1, keepdim=True) / 127.0).clamp_(min=1e-6)  # [..., 1]
    y = (xf * (1.0 / scale)).clamp_(-127.0, 127.0)
    codes = torch.where(y >= 0, torch.trunc(y + 0.5), torch.trunc(y - 0.5))
    codes = torch.where(torch.isnan(xf), -128.0, codes).to(torch.int8)
    return QTensor(codes=codes, block_scales=scale)


def _dequantize(q: QTensor, f: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    y = q.codes.float() * q.block_scales
    return torch.where(q.codes == -128, float("nan"), y).to(dtype)


@pytest.fixture
def demo() -> Iterator[KVFormat]:
    """The family's codec and row, registered for one test and taken out again."""
    if FAMILY not in CODECS:
        register(Codec(FAMILY, _quantize, _dequantize, per_token_bits, per_token_widths))
    row = KVFormat(
        NAME, ("demo_rha",), FAMILY, 0, False, 127.0, {}, "test-only: int8 per token head, codes rounded half away",
        "", torch.int8, torch.float32, triton_kernel=2, c_kernel=None,
    )  # fmt: skip
    formats.add_format(row)
    try:
        yield row
    finally:
        formats.remove_format(NAME)


def test_the_table_takes_the_row(demo: KVFormat) -> None:
    assert formats.get_format("DEMO_RHA") is demo and formats.parse_kv_format("demo_rha") == NAME
    assert formats.kv_pair(f"k={NAME},v=fp8") == (demo, formats.get_format("fp8_e4m3"))
    assert demo.bits_per_element(64) == 8.5 and demo.storage_widths(64) == (64, 1)
    with pytest.raises(ValueError, match="already taken"):
        formats.add_format(demo)
    from kvcal.capacity import kv_bytes_per_token
    from kvcal.models.geometry import KVSpec, LayerSpec

    layers = tuple(LayerSpec(i, "full_attention", None, 4, 2, 64) for i in range(4))
    kv = KVSpec("llama", layers, None, None)
    assert kv_bytes_per_token(kv, NAME) == 4 * 2 * 64 * 2 * 8.5 / 8  # 4 layers x 2 heads x 64 x (K + V)


def test_quantize_rounds_half_away_and_keeps_nan(demo: KVFormat) -> None:
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 0.0, float("nan"), 63.5]])  # scale 1: codes are x rounded
    q = formats.quantize(x, demo)
    assert q.codes.tolist() == [[127, 1, -1, 2, -3, 0, -128, 64]]
    y = formats.dequantize(q, demo)
    assert torch.isnan(y[0, 6]) and y[0, :6].tolist() == [127.0, 1.0, -1.0, 2.0, -3.0, 0.0]
    # the fast path asks the same codec (no fast dequantization of its own: formats' is used)
    from kvcal.kernels import fast

    xs = torch.randn(2, 3, 5, 64)
    qf, qs = fast.quantize(xs, demo), formats.quantize(xs, demo)
    assert torch.equal(qf.codes, qs.codes) and torch.equal(qf.block_scales, qs.block_scales)
    assert torch.equal(fast.dequantize_fast(qs, demo), formats.dequantize(qs, demo))


def test_triton_kernel_reads_it_with_its_declared_loader(demo: KVFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from kvcal.kernels import triton_attention as ta
    from kvcal.kernels.reference import quantized_attention_ref

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(3)
    q = torch.randn(1, 4, 1, 64)
    k, v = torch.randn(1, 2, 37, 64) * 2.0, torch.randn(1, 2, 37, 64)
    kq, vq = formats.quantize(k, demo), formats.quantize(v, demo)
    kw = dict(scaling=64**-0.5, q_start=36, k_start=0)
    got = ta.quantized_attention_triton(q, kq, vq, demo, **kw)
    want = quantized_attention_ref(q, kq, vq, demo, **kw)
    want64 = quantized_attention_ref(q, kq, vq, demo, compute_dtype=torch.float64, **kw)
    ref_err = float((want.double() - want64).abs().max())
    err = float((got.double() - want64).abs().max())
    assert err <= 8.0 * ref_err + 4 * torch.finfo(torch.float32).eps * float(want64.abs().max())
