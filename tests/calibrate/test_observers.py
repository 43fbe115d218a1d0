"""Observers and their streamed statistics against direct computation on the data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.calibrate import histogram as hist
from kvcal.calibrate.histogram import HIST_HI, HIST_LO, histogram, histogram_ref
from kvcal.calibrate.observers import (
    OBSERVERS,
    CandidateEval,
    TensorStats,
    check_calibratable,
    clip_to_scale,
    get_observer,
)
from kvcal.calibrate.run import calibrate
from kvcal.errors import UsageError
from kvcal.formats import fake_quantize, get_format

needs_c = pytest.mark.skipif(hist.library() is None, reason="histogram.c not built (KVCAL_C=0 or no compiler)")


def _heavy_tailed(seed: int = 0) -> list[torch.Tensor]:
    # K-like batches [B, H_kv, T, D]: gaussian bulk, head 1 with rare large outliers
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(2, 2, 40, 32, generator=g)
        x[:, 1] *= 3.0
        mask = torch.rand(x.shape, generator=g) < 0.002
        x = torch.where(mask, x * 25, x)
        out.append(x)
    return out


def _stats(batches: list[torch.Tensor]) -> TensorStats:
    ts = TensorStats(batches[0].shape[1])
    for x in batches:
        ts.update(x)
    return ts


@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_histogram_error_matches_direct_fake_quantize(fmt_name: str, granularity: str) -> None:
    fmt = get_format(fmt_name)
    batches = _heavy_tailed()
    g = _stats(batches).grouped(granularity)
    allx = torch.cat(batches, dim=2)  # [B, H, T, D]
    amax_h = allx.abs().amax(dim=(0, 2, 3))
    amax = amax_h if granularity == "head" else allx.abs().amax().reshape(1)
    torch.testing.assert_close(g.amax, amax, rtol=0, atol=0)
    for ratio in (1.0, 0.6, 0.2):
        clip = ratio * amax
        scale = clip_to_scale(clip, fmt)
        s = scale if granularity == "head" else scale.reshape(())
        err = fake_quantize(allx, fmt, scale=s) - allx
        direct_noise = float((err.double() ** 2).sum())
        hist_noise = float(g.fp8_noise(fmt, scale).sum())
        assert hist_noise == pytest.approx(direct_noise, rel=0.02)
        thr = clip.reshape(1, -1, 1, 1) if granularity == "head" else clip
        direct_clipped = float((allx.abs() > thr).sum())
        assert float(g.clipped(clip).sum()) == pytest.approx(direct_clipped, rel=0.05, abs=2.0)
    assert float(g.signal.sum()) == pytest.approx(float((allx.double() ** 2).sum()), rel=1e-9)


def test_percentile_matches_torch_quantile() -> None:
    batches = _heavy_tailed(1)
    ts = _stats(batches)
    allx = torch.cat(batches, dim=2).abs()
    obs = get_observer("percentile", {"percentile": 99.0})
    clip = obs.clip(ts.grouped("head"), get_format("fp8"))
    ref = torch.stack([torch.quantile(allx[:, h].flatten(), 0.99) for h in range(2)])
    torch.testing.assert_close(clip, ref, rtol=0.01, atol=0)


def test_mse_picks_the_grid_ratio_with_the_least_direct_error() -> None:
    fmt = get_format("fp8_e4m3")
    batches = _heavy_tailed(2)
    g = _stats(batches).grouped("tensor")
    obs = get_observer("mse")
    mse_clip = obs.clip(g, fmt)
    allx = torch.cat(batches, dim=2)

    def err(clip: torch.Tensor) -> float:
        return float(
            (
                (fake_quantize(allx, fmt, scale=clip_to_scale(clip, fmt).reshape(())) - allx).double() ** 2
            ).sum()
        )

    direct = [err(r * g.amax) for r in obs.ratios()]
    assert err(mse_clip) <= min(direct) * 1.01
    assert float(mse_clip) <= float(g.amax)


def test_nvfp4_candidate_eval_is_direct_and_mse_picks_the_best() -> None:
    fmt = get_format("nvfp4")
    batches = _heavy_tailed(3)
    g = _stats(batches).grouped("tensor")
    clips = get_observer("mse").candidates(g, fmt)  # [C, 1]
    ev = CandidateEval(fmt, clips, "tensor")
    for x in batches:
        ev.update(x)
    allx = torch.cat(batches, dim=2)
    for c in range(clips.shape[0]):
        e = fake_quantize(allx, fmt, scale=ev.scales[c].reshape(())) - allx
        # per-call fake_quantize of separate batches equals one call on the concatenation (static global scale)
        assert float(ev.noise[c, 0]) == pytest.approx(float((e.double() ** 2).sum()), rel=1e-6)
    assert int(ev.best()[0]) == int(ev.noise[:, 0].argmin())
    # minmax global scale is amax / (448 * 6)
    torch.testing.assert_close(
        clip_to_scale(get_observer("minmax").clip(g, fmt), fmt), allx.abs().amax().reshape(1) / (448 * 6)
    )


@pytest.mark.parametrize("name", ["fp4_e2m1", "mxfp4", "int8_per_token_head", "bf16", "auto"])
def test_dynamic_formats_have_nothing_to_calibrate(name: str) -> None:
    with pytest.raises(UsageError, match="nothing to calibrate") as info:
        check_calibratable(get_format(name), "tensor")
    assert info.value.exit_code == 2


def test_registry_and_bad_names() -> None:
    assert set(OBSERVERS) == {"minmax", "percentile", "mse"}
    with pytest.raises(UsageError, match="unknown observer"):
        get_observer("ema")
    with pytest.raises(UsageError, match="granularity"):
        check_calibratable(get_format("fp8"), "channel")


# |x| values where the bins are decided: 0, subnormals, the histogram's ends, the float32 maximum, exact powers of
# two and their neighbours (bin edges at whole octaves), and the values in between
_EDGES = [0.0, 1e-45, 2.0**-126, 2.0**HIST_LO, 2.0**HIST_LO * 0.999, 2.0**HIST_HI, 2.0**HIST_HI * 1.001, torch.finfo(torch.float32).max]
_EDGES += [float(torch.nextafter(torch.tensor(2.0**e), torch.tensor(d)).item()) for e in (-3, 0, 5) for d in (0.0, 1e9)]


def _from_bits(u: int) -> float:
    return float(torch.tensor([u], dtype=torch.int32).view(torch.float32).item())


_magnitudes = st.one_of(
    st.sampled_from(_EDGES),
    st.integers(0, 0x7F7FFFFF).map(_from_bits),  # any finite float32: every bin of every octave in play
    st.floats(min_value=0, max_value=torch.finfo(torch.float32).max, allow_nan=False, width=32),
)


@needs_c
@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(0.0, 12.0),
    values=st.lists(_magnitudes, max_size=40),
)
def test_c_histogram_equals_the_torch_reference_bit_for_bit(
    heads: int, cols: int, seed: int, spread: float, values: list[float]
) -> None:
    """The C pass (histogram.c `kvcal_hist_update`) and `histogram_ref` (log2 bins, three float64 bincounts):
    identical counts and sums, bit for bit: log-normal |x| of any spread (every part of a bin in play), with the
    bins' edges and any float32 put in."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(heads * cols, generator=g) * spread).exp()
    put = torch.tensor(values, dtype=torch.float32)[: a.numel()]
    a[torch.randperm(a.numel(), generator=g)[: put.numel()]] = put
    a = a.view(heads, cols)
    for got, want in zip(histogram(a), histogram_ref(a), strict=True):
        assert torch.equal(got, want)


@needs_c
def test_c_histogram_on_gaussian_k_v_and_a_non_contiguous_stream() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 37, 24, generator=g) * torch.exp(torch.randn(3, 2, 37, 24, generator=g) * 6)
    a = x.abs().transpose(0, 1).reshape(2, -1)
    for got, want in zip(histogram(a), histogram_ref(a), strict=True):
        assert torch.equal(got, want)
    b = x.abs()[:, 1].transpose(0, 1).flatten(1)  # [T, B*D]: not contiguous
    for got, want in zip(histogram(b), histogram_ref(b), strict=True):
        assert torch.equal(got, want)


@needs_c
@pytest.mark.parametrize("observer", ["mse", "percentile"])
def test_scale_file_is_the_same_with_the_c_histogram_off(
    observer: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observers that read the histogram (mse's clip search, percentile, every SQNR and clipped fraction) give
    the same scales and statistics with the C pass as with torch ops (KVCAL_C=0)."""
    runs = []
    for env in ("1", "0"):
        monkeypatch.setenv("KVCAL_C", env)
        hist.library.cache_clear()
        try:
            runs.append(calibrate(str(tiny_llama_dir), "fp8_e4m3", observer=observer, num_samples=3, seq_len=24).scale_set)
            assert (hist.library() is None) == (env == "0")
        finally:
            monkeypatch.delenv("KVCAL_C")
            hist.library.cache_clear()
    on, off = runs
    assert all(torch.equal(a, b) for a, b in zip(on.k_scales + on.v_scales, off.k_scales + off.v_scales, strict=True))
    assert on.layer_stats == off.layer_stats


def test_a_failed_build_warns_once_and_the_histogram_is_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A histogram.c that does not compile: one RuntimeWarning with the compiler's words and how to skip the
    build, and the statistics computed with torch ops, the same values."""
    broken = tmp_path / "histogram.c"
    broken.write_text(hist.SOURCE.read_text().replace("#include <stdint.h>", "#include <stdint.h>\noops", 1))
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hist, "SOURCE", broken)
    hist.library.cache_clear()
    try:
        a = torch.rand(2, 50) * 10
        with pytest.warns(RuntimeWarning, match="KVCAL_C=0") as rec:
            got = histogram(a)
            histogram(a)
        assert len(rec) == 1 and "oops" in str(rec[0].message)
        assert all(torch.equal(g, w) for g, w in zip(got, histogram_ref(a), strict=True))
    finally:
        hist.library.cache_clear()
