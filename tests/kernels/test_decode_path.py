"""The torch path's decode-step dequantization: FP8 by table lookup, and only the tokens written since the last
read (`kvcal.kernels.fast`: the cache side's `Workspace`, handed to the attention in `KVRead.workspaces`). Both must give exactly `kvcal.formats.dequantize`'s values, step after step,
whatever the format, scale, sliding window, padding or batch re-indexing.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcal import formats
from kvcal.kernels.buffer import TokenBuffer
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache
from kvcal.kernels.fast import dequantize_fast, quantized_attention_fast

FORMATS = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "nvfp4", "mxfp4"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN equal to NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(
    "scale",
    [None, torch.tensor(0.37), torch.tensor([0.37]), torch.tensor([0.5, 2.0**-20, 3.0]), torch.tensor(1e38)],
)
@pytest.mark.parametrize("tokens", [7, 100])  # a few elements are cast, many looked up (fast._FEW)
def test_fp8_table_is_bit_identical(fmt: str, scale: torch.Tensor | None, tokens: int) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, tokens, 32, generator=g) * torch.logspace(-8, 3, 32)
    x[0, 1, 2, :4] = torch.tensor([math.nan, 0.0, -0.0, 1e30])
    q = formats.quantize(x, fmt, scale=scale)
    ref = formats.dequantize(q, fmt)
    assert _same(dequantize_fast(q, fmt), ref)
    if scale is not None and float(scale.reshape(-1)[0]) == 1e38:
        assert torch.isinf(q.codes.float() * 1e38).any() and ref.abs().max() == torch.finfo(torch.float32).max


def test_nvfp4_saturation_still_clamps() -> None:
    codes = torch.full((1, 2, 5, 16), 0x17, dtype=torch.uint8)  # E2M1 codes 7 (6.0) and 1 (0.5)
    bs = torch.full((1, 2, 5, 2), 448.0).to(torch.float8_e4m3fn)
    # 6 * 448 * 1e36 > float32 max
    q = formats.QTensor(codes=codes, block_scales=bs, scale=torch.tensor(1e36))
    assert _same(dequantize_fast(q, "nvfp4"), formats.dequantize(q, "nvfp4"))
    assert dequantize_fast(q, "nvfp4").abs().max() == torch.finfo(torch.float32).max


def test_nvfp4_bound_kept_on_the_scale_follows_in_place_changes() -> None:
    """The global scale's bound is remembered on the scale tensor; changing the tensor in place must not reuse it."""
    codes = torch.full((1, 2, 5, 16), 0x17, dtype=torch.uint8)
    bs = torch.full((1, 2, 5, 2), 448.0).to(torch.float8_e4m3fn)
    g = torch.tensor(1.0)
    q = formats.QTensor(codes=codes, block_scales=bs, scale=g)
    assert _same(dequantize_fast(q, "nvfp4"), formats.dequantize(q, "nvfp4"))  # bound 2688 kept on g
    g.fill_(1e36)
    assert dequantize_fast(q, "nvfp4").abs().max() == torch.finfo(torch.float32).max


def _plans(fmt: str, window: int | None, **kw: object) -> list[LayerPlan]:
    return [LayerPlan(index=0, fmt=formats.get_format(fmt), window=window, **kw)]  # type: ignore[arg-type]


def _decode(cache: QuantizedKVCache, fmt: str, steps: list[int], mask: torch.Tensor | None = None) -> int:
    """Write chunks of `steps` tokens into layer 0 and check every read against formats.dequantize; returns how
    many reads found the previous read's values (the incremental path)."""
    g = torch.Generator().manual_seed(11)
    reused = 0
    for n in steps:
        k = torch.randn(2, 2, n, 32, generator=g) * 4
        v = torch.randn(2, 2, n, 32, generator=g)
        if mask is not None:
            cache.set_attention_mask(mask[:, : cache.layers[0].cumulative_length + n])
        kph, _ = cache.update(k, v, 0)
        read = kph.kvcal_read
        ws, first = read.workspaces[0], read.k_start
        held = ws.first + len(ws.values)
        reused += len(ws.values) > 0 and ws.first <= first < held  # the workspace holds this read's start
        for q, side_ws in ((read.k, read.workspaces[0]), (read.v, read.workspaces[1])):
            assert _same(dequantize_fast(q, fmt, side_ws, first), formats.dequantize(q, fmt))
            # the memo: same values again
            assert _same(dequantize_fast(q, fmt, side_ws, first), formats.dequantize(q, fmt))
    return reused


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [None, 6])
def test_incremental_reads_are_bit_identical(fmt: str, window: int | None) -> None:
    cache = QuantizedKVCache(_plans(fmt, window))
    reused = _decode(cache, fmt, [5, 1, 1, 3, 1, 1, 1])
    if window is None:
        assert reused == 6  # every read after the first extended the previous one
    assert cache.layers[0].kept == (13 if window is None else 6)


def test_per_sequence_global_and_padding() -> None:
    """nvfp4 per-sequence globals fixed at a sequence's first real token (left padding): a read whose scale
    changed recomputes everything, and still equals formats.dequantize."""
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # row 1: five padding positions, then real tokens
    cache = QuantizedKVCache(_plans("nvfp4", None, nvfp4_global="per_sequence"))
    _decode(cache, "nvfp4", [3, 2, 1, 1, 1], mask)


def test_batch_reindex_and_crop_drop_the_memo() -> None:
    cache = QuantizedKVCache(_plans("fp8_e4m3", None))
    _decode(cache, "fp8_e4m3", [4, 1])
    layer = cache.layers[0]
    held = lambda: len(layer._sides["k"].workspace.values)  # noqa: E731
    assert held() == 5
    layer.batch_select_indices(torch.tensor([1, 0]))
    assert held() == 0
    _decode(cache, "fp8_e4m3", [1])
    assert held() == 6
    layer.crop(-1)
    assert held() == 0
    _decode(cache, "fp8_e4m3", [1, 1])  # still exact after re-indexing and cropping


def test_token_buffer_appends_in_place_and_grows_geometrically() -> None:
    """Appends write into spare room (the buffer moves O(log T) times, not per step); every view equals the
    concatenation of what was appended, and a view handed out earlier is unchanged by later appends."""
    g = torch.Generator().manual_seed(5)
    buf, parts, moves, ptr, views = TokenBuffer(), [], 0, None, []
    for n in [7] + [1] * 120:
        parts.append(torch.randint(0, 255, (2, 3, n, 16), generator=g, dtype=torch.uint8))
        view = buf.append(parts[-1])
        views.append((view, torch.cat(parts, dim=-2)))
        moves += buf.data.data_ptr() != ptr
        ptr = buf.data.data_ptr()
    assert all(torch.equal(v, want) for v, want in views)
    assert len(buf) == 127 and buf.capacity >= 127 and moves <= 10  # 7 -> 14 -> 21 -> ... (x1.5)
    with pytest.raises(ValueError):
        buf.append(torch.zeros(1, 3, 1, 16, dtype=torch.uint8))  # another batch: refused, not broadcast


def test_token_buffer_window_stays_bounded() -> None:
    """A sliding window (keep_last after each append) keeps a bounded buffer, also after a long chunk."""
    buf = TokenBuffer()
    buf.append(torch.arange(100.0).reshape(1, 1, 100, 1))
    buf.keep_last(4)
    assert buf.capacity <= 8 and buf.view().flatten().tolist() == [96.0, 97.0, 98.0, 99.0]
    for i in range(100, 200):
        buf.append(torch.tensor([[[[float(i)]]]]))
        buf.keep_last(4)
        assert buf.capacity <= 10 and buf.view().flatten().tolist() == [i - 3.0, i - 2.0, i - 1.0, float(i)]
    buf.drop_last(1)
    assert buf.view().flatten().tolist() == [196.0, 197.0, 198.0]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4", "int8_per_token_head"])
def test_window_after_a_long_chunk_then_decode(fmt: str) -> None:
    """A sliding layer given a chunk much longer than its window, then decode steps: every read exact, the kept
    storage (codes and the workspace) bounded by the window, not the chunk."""
    cache = QuantizedKVCache(_plans(fmt, 4))
    _decode(cache, fmt, [40] + [1] * 12)
    side = cache.layers[0]._sides["k"]
    assert cache.layers[0].kept == 4 and side.codes.capacity <= 10 and side.workspace.values.capacity <= 10


def test_crop_then_decode_rewrites_positions_exactly() -> None:
    """crop then new tokens at the cropped positions: the reads see the new tokens, not the workspace's old
    values of those positions."""
    cache = QuantizedKVCache(_plans("fp8_e4m3", None))
    _decode(cache, "fp8_e4m3", [6, 1, 1])
    cache.layers[0].crop(-3)
    assert cache.layers[0].kept == 5
    _decode(cache, "fp8_e4m3", [1, 2, 1])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cache_without_workspace_keeps_no_values_and_attends_the_same(fmt: str) -> None:
    """`workspace=False` (continuation scoring's caches, read by one forward after the prefill): the same codes
    stored and the same attention, bit for bit, as a cache whose reads keep their float32 values; nothing is kept
    (decode-sized reads included, which the C write would otherwise fill)."""
    kept, bare = QuantizedKVCache(_plans(fmt, None)), QuantizedKVCache(_plans(fmt, None), workspace=False)
    g = torch.Generator().manual_seed(5)
    for n in [70, 1, 3, 1]:  # a prefill-sized read (keeps nothing anyway), then decode-sized ones
        k, v = torch.randn(2, 2, n, 32, generator=g) * 4, torch.randn(2, 2, n, 32, generator=g)
        q = torch.randn(2, 4, n, 32, generator=g)  # GQA 4:2
        outs = []
        for cache in (kept, bare):
            read = cache.update(k.clone(), v.clone(), 0)[0].kvcal_read
            outs.append((read, quantized_attention_fast(
                q, read.k, read.v, fmt, scaling=32**-0.5, q_start=read.q_start, k_start=read.k_start,
                workspaces=read.workspaces,
            )))  # fmt: skip
        (ra, oa), (rb, ob) = outs
        assert rb.workspaces is None
        for a, b in ((ra.k.codes, rb.k.codes), (ra.v.codes, rb.v.codes)):  # the stored bytes
            assert torch.equal(_bytes(a), _bytes(b))
        assert _same(oa, ob)
    assert len(kept.layers[0]._sides["k"].workspace.values) == 75  # the decode reads kept theirs
    assert bare.layers[0]._sides["k"].workspace.values.data is None
