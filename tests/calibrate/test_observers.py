"""Observers and their streamed statistics against direct computation on the data."""

from __future__ import annotations

import pytest
import torch

from kvcal.calibrate.observers import (
    OBSERVERS,
    CandidateEval,
    TensorStats,
    check_calibratable,
    clip_to_scale,
    get_observer,
)
from kvcal.errors import UsageError
from kvcal.formats import fake_quantize, get_format


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
