"""Observers: turn streamed K/V statistics into static scales, and measure what those scales cost.

Streaming statistics (`TensorStats`, one per layer and K/V) keep, per KV head, the exact amax and a fine
log2-spaced histogram of |x| (128 bins per octave, 2^-40 .. 2^24) with each bin's count, sum and sum of squares.
That is enough, without keeping activations, to
- take a quantile of |x| (percentile observer, to 0.5 % of the value),
- compute the exact squared error of an ELEMENTWISE format (fp8) for any scale: inside a bin the fp8 rounding
  target q is constant unless a rounding boundary falls in the bin (8 of 128 bins per octave for E4M3), and
  sum (x - q)^2 = S2 - 2 q S1 + n q^2 — so the mse observer's clip search and the reported SQNR and clipped
  fraction need one pass only.
NVFP4 quantizes in 16-element blocks (its global scale acts through the E4M3 block scales), so its error is not a
function of |x| alone: its SQNR / clipped fraction and the mse search run on the data in a second pass
(`CandidateEval`).

Observers (registry `OBSERVERS`, by name) return the CLIP value per group (the |x| that maps to the format's
largest magnitude); `clip_to_scale` turns it into the stored scale: fp8 scale = clip / 448 (E4M3) or / 57344
(E5M2) — llm-compressor's `amax / 448`; nvfp4 global scale = clip / (448 * 6).
- `minmax`: clip = amax over everything seen (llm-compressor's `static_minmax`).
- `percentile`: clip = the p-th percentile of |x| (default 99.99).
- `mse`: clip = ratio * amax, ratio from a grid (1.00, 0.99, ... 0.30), minimising the format's own squared error
  (kvcal.formats.fake_quantize).
Granularity: statistics are always kept per KV head; 'tensor' merges the heads (one scale per layer), 'head'
keeps one scale per KV head (dim 1 of [B, H_kv, T, D]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcal import parallel
from kvcal.calibrate.histogram import BINS_PER_OCTAVE, HIST_LO, NBINS, histogram
from kvcal.errors import UsageError
from kvcal.formats import FP8_E4M3_MAX, KVFormat, fake_quantize
from kvcal.scales import GRANULARITIES


def format_range(fmt: KVFormat) -> float:
    """The |x| / scale that maps to the largest code: fp8 max_value; nvfp4 448 (E4M3 block scale) * 6 (E2M1)."""
    if fmt.codec.global_scale:  # nvfp4, nvfp4_4over6: the global scale's range
        return FP8_E4M3_MAX * float(fmt.max_value)
    return float(fmt.max_value)


def is_elementwise(fmt: KVFormat) -> bool:
    """Formats whose per-element error depends only on x and the static scale (histogram statistics are exact)."""
    return fmt.block_size == 0


def check_calibratable(fmt: KVFormat, granularity: str) -> None:
    if not fmt.calibratable:
        raise UsageError(
            f"KV format '{fmt.name}' has nothing to calibrate: its scales are "
            + ("dynamic (computed per block or token at run time)" if fmt.max_value else "absent")
            + "; calibrate fp8_e4m3, fp8_e5m2, int8_per_tensor or nvfp4, or evaluate this format without --scales"
        )
    if granularity not in GRANULARITIES:
        raise UsageError(f"unknown granularity '{granularity}'; use {' or '.join(GRANULARITIES)}")


class TensorStats:
    """Streaming per-KV-head statistics of one K or V tensor stream: amax, |x| histogram with S1/S2 per bin."""

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.amax = torch.zeros(heads, dtype=torch.float32)
        self.count = torch.zeros(heads, NBINS, dtype=torch.float64)
        self.sum1 = torch.zeros(heads, NBINS, dtype=torch.float64)
        self.sum2 = torch.zeros(heads, NBINS, dtype=torch.float64)

    def update(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """x: [B, H_kv, T, D] (finite). amax: [H_kv] if the caller already has it."""
        a = x.detach().abs().transpose(0, 1).reshape(self.heads, -1).to(torch.float32)  # [H, B*T*D]
        if amax is None:
            amax = a.amax(dim=1)
        self.amax = torch.maximum(self.amax, amax.cpu().float())
        count, sum1, sum2 = histogram(a)
        self.count += count.cpu()
        self.sum1 += sum1.cpu()
        self.sum2 += sum2.cpu()

    def merge_(self, other: TensorStats) -> None:
        """Add another stream's statistics (another process's samples): amax is the max, histograms add up, so
        every observer's clip equals the one of a single stream over all the samples."""
        self.amax = torch.maximum(self.amax, other.amax)
        self.count += other.count
        self.sum1 += other.sum1
        self.sum2 += other.sum2

    def grouped(self, granularity: str) -> GroupedStats:
        if granularity == "head":
            return GroupedStats(self.amax.clone(), self.count, self.sum1, self.sum2)
        return GroupedStats(
            self.amax.max().reshape(1),
            self.count.sum(0, keepdim=True),
            self.sum1.sum(0, keepdim=True),
            self.sum2.sum(0, keepdim=True),
        )


@dataclass
class GroupedStats:
    """Statistics per scale group G (1 for a per-tensor scale, H_kv per head): amax [G], histograms [G, NBINS]."""

    amax: torch.Tensor
    count: torch.Tensor
    sum1: torch.Tensor
    sum2: torch.Tensor

    @property
    def signal(self) -> torch.Tensor:  # [G] sum of x^2
        return self.sum2.sum(1)

    @property
    def total(self) -> torch.Tensor:  # [G] number of elements
        return self.count.sum(1)

    def quantile(self, q: float) -> torch.Tensor:
        """q-quantile of |x| per group (geometric interpolation inside the bin), capped at amax: [G]."""
        cum = self.count.cumsum(1)  # [G, NBINS]
        target = (q * self.total).unsqueeze(1)  # [G, 1]
        b = torch.searchsorted(cum, target).clamp(max=NBINS - 1).squeeze(1)  # [G] first bin reaching target
        prev = torch.where(
            b > 0,
            cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
            torch.zeros_like(b, dtype=cum.dtype),
        )
        inbin = self.count.gather(1, b.unsqueeze(1)).squeeze(1)
        frac = torch.where(inbin > 0, (target.squeeze(1) - prev) / inbin.clamp(min=1), torch.ones_like(inbin))
        log_edge = HIST_LO + (b.double() + frac.clamp(0, 1)) / BINS_PER_OCTAVE
        return torch.minimum(torch.exp2(log_edge).float(), self.amax)

    def fp8_noise(self, fmt: KVFormat, scale: torch.Tensor) -> torch.Tensor:
        """Exact-within-bin squared error sum (x - fq(x))^2 per group for an elementwise format; scale [G]."""
        mean = torch.where(self.count > 0, self.sum1 / self.count.clamp(min=1), torch.zeros_like(self.sum1))
        # one rounding target per bin: fake-quantize the bin means as a [1, G, NBINS, 1] tensor, scale along dim 1
        q = fake_quantize(mean.float().reshape(1, -1, NBINS, 1), fmt, scale=scale.reshape(-1))
        q = q.reshape(-1, NBINS).double()
        noise = self.sum2 - 2 * q * self.sum1 + self.count * q * q  # [G, NBINS]
        return noise.clamp(min=0).sum(1)

    def clipped(self, clip: torch.Tensor) -> torch.Tensor:
        """Number of elements with |x| > clip per group (bin-resolution, log-interpolated in the straddling bin)."""
        edges = torch.exp2(
            HIST_LO + torch.arange(NBINS + 1, dtype=torch.float64) / BINS_PER_OCTAVE
        )  # [NBINS+1]
        lo, hi = edges[:-1].unsqueeze(0), edges[1:].unsqueeze(0)  # [1, NBINS]
        thr = clip.double().unsqueeze(1)  # [G, 1]
        top = torch.minimum(hi.expand(thr.shape[0], -1), self.amax.double().unsqueeze(1))  # values <= amax
        frac = ((top.log2() - thr.log2()) / (top.log2() - lo.log2()).clamp(min=1e-12)).clamp(0, 1)
        # a threshold within float32 rounding of amax (minmax: (amax / 448) * 448) clips nothing that matters
        frac = torch.where(thr >= self.amax.double().unsqueeze(1) * (1 - 1e-6), torch.zeros_like(frac), frac)
        return (self.count * frac).sum(1)


def sqnr_db(signal: float, noise: float) -> float | None:
    """10 log10(signal / noise); None when the quantization was lossless (noise 0)."""
    if noise <= 0:
        return None
    if signal <= 0:
        return 0.0
    return 10.0 * math.log10(signal / noise)


def clip_to_scale(clip: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Stored scale from a clip value: fp8 clip / max; nvfp4 clip / (448 * 6). Zero clips (an all-zero head)
    get the smallest normal float32 so the scale file stays positive."""
    return (clip.float() / format_range(fmt)).clamp(min=torch.finfo(torch.float32).tiny)


# ----- observers (registry by name) -----


@dataclass
class Observer:
    """Chooses the clip value per group from grouped statistics."""

    name: str = "base"
    params: dict[str, Any] = field(default_factory=dict)

    def clip(self, stats: GroupedStats, fmt: KVFormat) -> torch.Tensor:
        raise NotImplementedError

    def candidates(self, stats: GroupedStats, fmt: KVFormat) -> torch.Tensor:
        """Clip candidates [C, G] to evaluate on the data when the format is not elementwise (nvfp4)."""
        return self.clip(stats, fmt).unsqueeze(0)


@dataclass
class MinMaxObserver(Observer):
    name: str = "minmax"

    def clip(self, stats: GroupedStats, fmt: KVFormat) -> torch.Tensor:
        return stats.amax.clone()


@dataclass
class PercentileObserver(Observer):
    name: str = "percentile"
    params: dict[str, Any] = field(default_factory=lambda: {"percentile": 99.99})

    def clip(self, stats: GroupedStats, fmt: KVFormat) -> torch.Tensor:
        p = float(self.params.get("percentile", 99.99))
        if not 0 < p <= 100:
            raise UsageError(f"percentile must be in (0, 100], got {p}")
        return stats.quantile(p / 100.0)


@dataclass
class MSEObserver(Observer):
    name: str = "mse"
    params: dict[str, Any] = field(default_factory=lambda: {"min_ratio": 0.3, "steps": 71})

    def ratios(self) -> torch.Tensor:
        lo = float(self.params.get("min_ratio", 0.3))
        steps = int(self.params.get("steps", 71))
        return torch.linspace(1.0, lo, steps)

    def clip(self, stats: GroupedStats, fmt: KVFormat) -> torch.Tensor:
        if not is_elementwise(fmt):
            raise ValueError("block formats choose among candidates() on the data")
        ratios = self.ratios()
        errors = torch.stack(
            [stats.fp8_noise(fmt, clip_to_scale(r * stats.amax, fmt)) for r in ratios]
        )  # [C, G]
        best = errors.argmin(0)  # [G]; ties resolve to the larger ratio (listed first)
        return ratios[best] * stats.amax

    def candidates(self, stats: GroupedStats, fmt: KVFormat) -> torch.Tensor:
        # nvfp4: a coarse grid, each candidate costs a fake-quantization of every K/V tensor in the second pass
        ratios = torch.tensor([1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6])
        return ratios.unsqueeze(1) * stats.amax.unsqueeze(0)  # [C, G]


OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "percentile": PercentileObserver,
    "mse": MSEObserver,
}


def get_observer(name: str, params: dict[str, Any] | None = None) -> Observer:
    cls = OBSERVERS.get(name)
    if cls is None:
        raise UsageError(f"unknown observer '{name}'; choose one of {', '.join(OBSERVERS)}")
    obs = cls()
    if params:
        obs.params = {**obs.params, **params}
    return obs


def all_reduce_stats(stats: dict[tuple[int, str], TensorStats], dist: parallel.Dist) -> None:
    """In place on every rank: each TensorStats merged over all ranks (`TensorStats.merge_` as collectives: max
    of amax, sum of the histograms; two all-reduces for all layers). Every rank must hold the same keys."""
    if not dist.active:
        return
    keys = sorted(stats)
    amax = torch.cat([stats[k].amax for k in keys])
    parallel.all_reduce_(amax, "max", dist, what="merging amax")
    hists = torch.cat([torch.stack([stats[k].count, stats[k].sum1, stats[k].sum2]).flatten() for k in keys])
    parallel.all_reduce_(hists, "sum", dist, what="merging histograms")
    a_off = h_off = 0
    for k in keys:
        ts = stats[k]
        ts.amax = amax[a_off : a_off + ts.heads].clone()
        n = 3 * ts.heads * NBINS
        ts.count, ts.sum1, ts.sum2 = hists[h_off : h_off + n].view(3, ts.heads, NBINS).clone().unbind(0)
        a_off, h_off = a_off + ts.heads, h_off + n


def all_reduce_evals(evals: dict[tuple[int, str], CandidateEval], dist: parallel.Dist) -> None:
    """In place: the second pass's error sums (noise, clipped, signal, total) added over all ranks."""
    if not dist.active:
        return
    keys = sorted(evals)
    parts = [t for k in keys for t in (evals[k].noise, evals[k].clipped, evals[k].signal, evals[k].total)]
    flat = torch.cat([t.flatten() for t in parts])
    parallel.all_reduce_(flat, "sum", dist, what="merging the candidate errors")
    off = 0
    for t in parts:
        t.copy_(flat[off : off + t.numel()].view_as(t))
        off += t.numel()


class CandidateEval:
    """Second-pass error accounting for block formats (nvfp4): per clip candidate c and group g, the squared
    error of fake_quantize(x, fmt, scale), the signal, and the clipped count (|x| > clip)."""

    def __init__(self, fmt: KVFormat, clips: torch.Tensor, granularity: str) -> None:
        self.fmt = fmt
        self.clips = clips  # [C, G]
        self.scales = clip_to_scale(clips, fmt)  # [C, G]
        self.granularity = granularity
        c, g = clips.shape
        self.noise = torch.zeros(c, g, dtype=torch.float64)
        self.clipped = torch.zeros(c, g, dtype=torch.float64)
        self.signal = torch.zeros(g, dtype=torch.float64)
        self.total = torch.zeros(g, dtype=torch.float64)

    def _per_group(self, t: torch.Tensor) -> torch.Tensor:
        # t: [B, H, T, D] -> [G]
        per_head = t.double().sum(dim=(0, 2, 3))
        return per_head if self.granularity == "head" else per_head.sum().reshape(1)

    def update(self, x: torch.Tensor) -> None:
        xf = x.detach().float()  # [B, H_kv, T, D]
        self.signal += self._per_group(xf * xf).cpu()
        self.total += self._per_group(torch.ones_like(xf[..., :1]) * xf.shape[-1]).cpu()
        for c in range(self.clips.shape[0]):
            s = self.scales[c].to(xf.device)
            s = s.reshape(()) if s.numel() == 1 else s
            err = fake_quantize(xf, self.fmt, scale=s) - xf
            self.noise[c] += self._per_group(err * err).cpu()
            clip = self.clips[c].to(xf.device)
            clip = clip.reshape(1, -1, 1, 1) if clip.numel() > 1 else clip.reshape(())
            self.clipped[c] += self._per_group((xf.abs() > clip).float()).cpu()

    def best(self) -> torch.Tensor:
        """Index of the lowest-error candidate per group: [G]."""
        return self.noise.argmin(0)
