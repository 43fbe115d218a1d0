"""The torch path the runtime runs (`kvcal.kernels.fast.quantized_attention_fast`) against the plain reference
(`kvcal.kernels.reference.quantized_attention_ref`: `formats.dequantize`, no tables, no memos), bit for bit: both
attend over the same float32 values with the same code, so any difference is a dequantization bug of the fast path.
Every format and a K/V pair; prefill and decode, odd lengths, MHA / GQA / MQA, sliding window with k_start > 0,
left padding (empty rows), softcap, sinks, FP8 attention; and through a real `QuantizedKVCache`, step after step,
where the fast path reads the cache side's `Workspace` (only new tokens dequantized, the scale's table remembered).
"""

from __future__ import annotations

import pytest
import torch

from kvcal import formats
from kvcal.kernels import cpu_write
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache
from kvcal.kernels.fast import Workspace, quantized_attention_fast
from kvcal.kernels.reference import quantized_attention_ref

QUANTIZED = [n for n in formats.FORMATS if n != "auto"]
PAIR = "k=fp8_e4m3,v=nvfp4"

# (hq, hkv, tq, tk, q_start, k_start, window, softcap, sinks, padded)
CASES = [
    (4, 4, 7, 7, 0, 0, None, None, False, False),  # prefill, MHA, odd length
    (6, 2, 9, 9, 0, 0, 4, None, False, True),  # GQA 3, window, left padding (empty rows)
    (8, 2, 1, 13, 12, 0, None, None, True, True),  # decode, GQA 4, sinks
    (8, 1, 5, 11, 10, 4, 6, 2.0, True, False),  # MQA, a window cache (k_start > 0), softcap + sinks
    (4, 2, 1, 6, 8, 3, 6, None, False, False),  # decode in a full window
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN where NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _kv(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """K/V spanning many binades, with zeros, so every table entry range and both saturation paths are hit."""
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    x[..., 0, :3] = 0.0
    return x


def _scale(name: str, hkv: int, g: torch.Generator) -> torch.Tensor | None:
    f = formats.get_format(name)
    if not f.calibratable:
        return None
    return torch.rand(hkv, generator=g) * 0.5 + 0.01  # per KV head


@pytest.mark.parametrize("fmt", [*QUANTIZED, PAIR])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fast_equals_the_plain_reference(fmt: str, case: tuple, q_dtype: torch.dtype) -> None:
    hq, hkv, tq, tk, q_start, k_start, window, softcap, sinks, padded = case
    g = torch.Generator().manual_seed(hq * 31 + tk)
    fk, fv = formats.kv_pair(fmt)
    b, d = 2, 32
    q = torch.randn(b, hq, tq, d, generator=g).to(q_dtype)
    k = formats.quantize(_kv(g, (b, hkv, tk, d)), fk, _scale(fk.name, hkv, g))
    v = formats.quantize(_kv(g, (b, hkv, tk, d)), fv, _scale(fv.name, hkv, g))
    pad = None
    if padded:
        pad = torch.ones(b, tk, dtype=torch.bool)
        pad[1, :3] = False
    kw = dict(
        scaling=d**-0.5, q_start=q_start, k_start=k_start, sliding_window=window, softcap=softcap,
        sinks=torch.randn(hq, generator=g) if sinks else None, key_padding=pad, v_fmt=fv,
    )  # fmt: skip
    ref = quantized_attention_ref(q, k, v, fk, **kw)
    assert _same(quantized_attention_fast(q, k, v, fk, **kw).float(), ref.float())
    # the same through (fresh) workspaces, twice: the second read is the workspace's values
    ws = (Workspace(), Workspace())
    for _ in range(2):
        assert _same(quantized_attention_fast(q, k, v, fk, workspaces=ws, **kw).float(), ref.float())


@pytest.mark.parametrize("scale", [None, 0.25])
def test_fp8_attention_fast_equals_reference(scale: float | None) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 3, 32, generator=g)
    s = None if scale is None else torch.tensor(scale)
    k = formats.quantize(_kv(g, (2, 2, 9, 32)), "fp8_e4m3", s)
    v = formats.quantize(_kv(g, (2, 2, 9, 32)), "fp8_e4m3", s)
    kw = dict(scaling=0.2, q_start=6, k_start=0, q_scale=0.5, p_tile=4)
    ref = quantized_attention_ref(q, k, v, "fp8_e4m3", **kw)
    assert _same(quantized_attention_fast(q, k, v, "fp8_e4m3", **kw), ref)


@pytest.mark.parametrize("fmt", [*QUANTIZED, PAIR, "turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_through_the_cache_equals_the_reference(
    fmt: str, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache layer (GQA 2, left padding) written by an odd prefill then single tokens: at every step the fast
    path over the layer's read (its workspaces) gives the reference's bits, also after the window moved. From the
    second step on, the formats cpu_write.c writes are written by it where it is built (the workspace then holds
    every token), so this also holds the C write to the plain reference inside the cache."""
    fk, fv = formats.kv_pair(fmt)
    calls: list[int] = []
    write = cpu_write.write_into
    monkeypatch.setattr(cpu_write, "write_into", lambda *a: calls.append(1) or write(*a))
    k_scale = torch.tensor([0.05, 0.2]) if fk.calibratable else None
    plan = LayerPlan(index=0, fmt=fk, window=window, v_fmt=None if fv is fk else fv, k_scale=k_scale)
    cache = QuantizedKVCache([plan])
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :2] = 0
    for n in [7, 1, 1, 1, 1, 1, 1]:
        t0 = cache.layers[0].cumulative_length
        cache.set_attention_mask(mask[:, : t0 + n])
        kph, _ = cache.update(_kv(g, (2, 2, n, 32)) * 3, _kv(g, (2, 2, n, 32)), 0)
        read = kph.kvcal_read
        tk = read.k.codes.shape[-2]
        q = torch.randn(2, 4, n, 32, generator=g)
        kw = dict(
            scaling=32**-0.5, q_start=read.q_start, k_start=read.k_start, sliding_window=window,
            key_padding=mask[:, read.k_start : read.k_start + tk].bool(), v_fmt=read.v_fmt,
        )  # fmt: skip
        ref = quantized_attention_ref(q, read.k, read.v, read.fmt, **kw)
        fast = quantized_attention_fast(q, read.k, read.v, read.fmt, workspaces=read.workspaces, **kw)
        assert _same(fast, ref), f"step at position {t0}"
    assert window is None or cache.layers[0].kept <= window
    # K/V formats cpu_write.c writes (every single format, K != V pairs, TurboQuant's sides)
    fused = cpu_write.library() is not None and fk.c_kernel is not None and fv.c_kernel is not None
    assert len(calls) == (6 if fused else 0)  # every decode step, where the kernel is built


def _ws_bytes(cache: QuantizedKVCache) -> int:
    """Bytes the torch path's workspaces of every layer and K/V have allocated."""
    return sum(
        side.workspace.values.data.nbytes
        for layer in cache.layers
        for side in layer._sides.values()
        if side.workspace.values.data is not None
    )


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "nvfp4", "int8_per_token_head"])
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_chunks_keep_no_workspace_whatever_the_layer_count(fmt: str, window: int | None) -> None:
    """Chunks of more than WORKSPACE_MAX_QUERIES queries read their context through a temporary (freed after the
    layer's attention): after a chunked prefill no layer's workspace holds anything, for 1 layer as for 4, so the
    torch path's float32 memory is one layer's, not one per layer. Every read keeps the reference's bits; the first
    decode step then fills each workspace once (every kept token), and a later long chunk reads through the values
    held without growing them."""
    from kvcal.kernels import fast

    f = formats.get_format(fmt)
    chunk = fast.WORKSPACE_MAX_QUERIES + 3
    g = torch.Generator().manual_seed(9)
    for n_layers in (1, 4):
        cache = QuantizedKVCache([LayerPlan(index=i, fmt=f, window=window) for i in range(n_layers)])
        held_after_decode: list[int] = []
        for step, n in enumerate([chunk, chunk, 1, 1, chunk]):
            for i in range(n_layers):
                kph, _ = cache.update(_kv(g, (1, 2, n, 16)) * 3, _kv(g, (1, 2, n, 16)), i)
                read = kph.kvcal_read
                q = torch.randn(1, 4, n, 16, generator=g)
                kw = dict(scaling=0.25, q_start=read.q_start, k_start=read.k_start, sliding_window=window)
                ref = quantized_attention_ref(q, read.k, read.v, read.fmt, **kw)
                got = quantized_attention_fast(q, read.k, read.v, read.fmt, workspaces=read.workspaces, **kw)
                assert _same(got, ref), (n_layers, step, i)
                tk = read.k.codes.shape[-2]  # the same for every layer
            if step < 2:  # the prefill chunks
                assert _ws_bytes(cache) == 0, (n_layers, step)
            elif step == 3:  # each workspace holds every token the decode step read
                for layer in cache.layers:
                    assert all(len(s.workspace.values) == tk for s in layer._sides.values())
                held_after_decode.append(_ws_bytes(cache))
        # the long chunk after the decode steps read the held values and left them as they were
        assert _ws_bytes(cache) == held_after_decode[-1] > 0
