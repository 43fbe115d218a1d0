"""The torch reference (`kvcal.kernels.reference`) against a float64 loop written straight from its docstring."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels.fast import dequantize_fast
from kvcal.kernels.reference import attention_dense, quantized_attention_ref, visibility_mask
from kvcal.kernels.testing import naive_attention

CASES = [
    # (hq, hkv, tq, tk, q_start, k_start, causal, window, softcap, sinks, padded)
    (4, 4, 7, 7, 0, 0, True, None, None, False, False),  # prefill, MHA
    (6, 2, 9, 9, 0, 0, True, 4, None, False, True),  # GQA 3, window, left padding (empty rows)
    (8, 2, 1, 13, 12, 0, True, None, None, True, True),  # decode, GQA 4, sinks
    (8, 1, 5, 11, 10, 4, True, 6, 2.0, True, False),  # MQA, window cache (k_start > 0), softcap + sinks
    (4, 2, 6, 6, 0, 0, False, None, 1.5, False, True),  # non-causal, softcap
    (4, 2, 1, 9, 8, 0, True, None, None, False, False),  # decode, all keys visible: unmasked SDPA path
    (4, 2, 1, 6, 8, 3, True, 6, None, False, False),  # decode in a full window: unmasked SDPA path
    (4, 2, 2, 6, 8, 3, True, 6, None, False, False),  # two queries, oldest key leaves the window: masked
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_float64_loop(case) -> None:
    hq, hkv, tq, tk, q_start, k_start, causal, window, softcap, with_sinks, padded = case
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    b, d = 2, 16
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) * 2 if with_sinks else None
    kp = None
    if padded:
        kp = torch.ones(b, tk, dtype=torch.bool)
        kp[1, : tk // 2 + 1] = False
    kw = dict(
        scaling=d**-0.5,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        sliding_window=window,
        softcap=softcap,
        sinks=sinks,
        key_padding=kp,
    )
    want = naive_attention(
        q, k, v, scaling=d**-0.5, q_start=q_start, k_start=k_start, causal=causal, window=window,
        softcap=softcap, sinks=sinks, key_padding=kp,
    )  # fmt: skip
    got64 = attention_dense(q, k, v, **kw)
    assert torch.allclose(got64, want, atol=1e-12, rtol=0)
    # float32: the reference's own error, tiny on the scale of the outputs
    got32 = attention_dense(
        q.float(), k.float(), v.float(), **{**kw, "sinks": None if sinks is None else sinks.float()}
    )
    assert (got32.double() - want).abs().max() < 1e-5 * want.abs().max().clamp(min=1)
    assert not torch.isnan(got32).any()
    # rows that see no key (left-padding queries) are exactly zero, not NaN
    empty = ~visibility_mask(tq, tk, q_start=q_start, k_start=k_start, causal=causal,
                             sliding_window=window, key_padding=kp).any(-1)  # fmt: skip
    empty = empty.expand(b, hq, tq)
    assert torch.equal(got32[empty], torch.zeros_like(got32[empty]))
    if case == CASES[1]:
        assert empty.any()


def test_explicit_path_chunks_query_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcal.kernels.reference as ref

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    kw = dict(scaling=0.3, q_start=0, k_start=0, softcap=2.0, sinks=torch.tensor([0.5, -1.0]))
    whole = attention_dense(q, k, v, **kw)
    monkeypatch.setattr(ref, "_LOGITS_BUDGET", 2 * 9 * 2)  # two query rows per chunk
    assert torch.allclose(attention_dense(q, k, v, **kw), whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
def test_masked_sdpa_path_blocks_query_rows_within_the_mask_budget(
    padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked prefill's queries against the whole cache (the masked SDPA path) run in blocks of query rows whose
    boolean mask (and SDPA's float copy of it) stays within _MASK_BUDGET elements whatever the context; the result
    is the float64 truth within the float32 bound of test_reference_matches_float64_loop, empty rows zero."""
    import kvcal.kernels.reference as ref

    g = torch.Generator().manual_seed(11)
    b, tq, tk, d = 2, 13, 40, 16
    q64 = torch.randn(b, 6, tq, d, generator=g, dtype=torch.float64)
    k64, v64 = (torch.randn(b, 2, tk, d, generator=g, dtype=torch.float64) for _ in range(2))
    kp = None
    if padded:
        kp = torch.ones(b, tk, dtype=torch.bool)
        kp[1, :30] = False  # row 1's first queries see no key
    kw = dict(scaling=d**-0.5, q_start=tk - tq + 3, k_start=3, causal=True, sliding_window=25, key_padding=kp)
    want = naive_attention(q64, k64, v64, scaling=d**-0.5, q_start=tk - tq + 3, k_start=3, causal=True, window=25,
                           softcap=None, sinks=None, key_padding=kp)  # fmt: skip
    shapes: list[tuple[int, ...]] = []
    real = ref.visibility_mask

    def recorded(*a: Any, **k: Any) -> torch.Tensor:
        mask = real(*a, **k)
        shapes.append(tuple(mask.shape))
        return mask

    monkeypatch.setattr(ref, "visibility_mask", recorded)
    budget = 3 * tk * (b if padded else 1)  # three query rows per block
    monkeypatch.setattr(ref, "_MASK_BUDGET", budget)
    got = attention_dense(q64.float(), k64.float(), v64.float(), **kw)
    assert [s[2] for s in shapes] == [3, 3, 3, 3, 1] and all(math.prod(s) <= budget for s in shapes)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max().clamp(min=1)
    empty = ~real(tq, tk, q_start=tk - tq + 3, k_start=3, sliding_window=25, key_padding=kp).any(-1)
    empty = empty.expand(b, 6, tq)
    assert torch.equal(got[empty], torch.zeros_like(got[empty])) and bool(empty.any()) == padded


def test_sdpa_path_equals_explicit_path() -> None:
    """A sink of -inf changes nothing mathematically but forces the explicit path: both paths must agree."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 9, 32, generator=g)
    k = torch.randn(2, 2, 12, 32, generator=g)
    v = torch.randn(2, 2, 12, 32, generator=g)
    kp = torch.ones(2, 12, dtype=torch.bool)
    kp[0, :5] = False
    kw = dict(scaling=0.2, q_start=3, k_start=0, sliding_window=5, key_padding=kp)
    fast = attention_dense(q, k, v, **kw)
    explicit = attention_dense(q, k, v, sinks=torch.full((6,), -math.inf), **kw)
    assert torch.allclose(fast, explicit, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int8_per_token_head", "nvfp4", "fp4_e2m1", "mxfp4"])
def test_quantized_reference_is_attention_over_dequantized_values(fmt: str) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 3, 32, generator=g)
    k = torch.randn(1, 2, 10, 32, generator=g) * 3
    v = torch.randn(1, 2, 10, 32, generator=g)
    kq, vq = formats.quantize(k, fmt), formats.quantize(v, fmt)
    kw = dict(scaling=32**-0.5, q_start=7, k_start=0)
    got = quantized_attention_ref(q, kq, vq, fmt, **kw)
    want = attention_dense(q, formats.fake_quantize(k, fmt), formats.fake_quantize(v, fmt), **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    got64 = quantized_attention_ref(q, kq, vq, fmt, compute_dtype=torch.float64, **kw)
    assert (got64 - got).abs().max() < 1e-5
    # the quantization is visible: not the same as attention over the unquantized K/V (fp4 especially)
    exact = attention_dense(q, k, v, **kw)
    assert (got - exact).abs().max() > 0


def test_bad_shapes() -> None:
    q = torch.randn(1, 3, 2, 16)
    k = torch.randn(1, 2, 4, 16)
    with pytest.raises(UsageError, match="multiple of KV heads"):
        attention_dense(q, k, k, scaling=1.0, q_start=2, k_start=0)
    with pytest.raises(UsageError, match="key_padding"):
        attention_dense(
            torch.randn(1, 4, 2, 16),
            k,
            k,
            scaling=1.0,
            q_start=2,
            k_start=0,
            key_padding=torch.ones(1, 3).bool(),
        )


@pytest.mark.parametrize(
    "fmt",
    ["auto", "bf16", "fp8_e5m2", "fp8_e4m3_cpu", "fp8_e5m2_cpu", "int8_per_token_head", "nvfp4", "fp4_e2m1", "mxfp4"],
)
def test_fast_dequantize_is_bit_identical(fmt: str) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 9, 64, generator=g) * torch.logspace(-6, 6, 64)  # tiny to huge, zeros below
    x[0, 0, 0] = 0.0
    x[1, 2, 3] = torch.finfo(torch.float32).max * torch.sign(torch.randn(64, generator=g))  # saturation
    scales = [None, torch.tensor([0.5, 2.0**-20, 3.0])] if fmt == "nvfp4" else [None]
    if fmt.endswith("_cpu"):  # per-KV-head and per-tensor scales
        scales += [torch.tensor([0.37, 2.0**-20, 3.0]), torch.tensor(0.0371)]
    for scale in scales:
        q = formats.quantize(x, fmt, scale=scale)
        assert torch.equal(dequantize_fast(q, fmt), formats.dequantize(q, fmt))
