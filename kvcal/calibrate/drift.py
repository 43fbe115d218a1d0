"""Does a calibrated scale file still fit the traffic? `kvcal drift SCALES MODEL --dataset TRAFFIC`.

Scales belong to a checkpoint *and a workload*. This module observes K/V on a traffic sample through calibrate's
one observation path (`observation.ObserveOptions`: K/V exactly as the model writes them into its cache, sampled
by `data.build_samples`), set up exactly as the scale file's manifest says the calibration observed them
(`ObserveOptions.for_scale_file`: K/V rounded to calibration.kv_input_dtype; the model in calibration.dtype and
sequences of calibration.seq_len unless asked otherwise), so the calibration text itself reads the calibration's
numbers. Per layer and per scale group (one group per layer for a per-tensor file, one per KV head for a
per-head file) it measures:

- the traffic's amax vs the calibrated amax (the file's per-layer statistics; the clip `scale * range` when a
  file has none) and the clip itself;
- the fraction of elements the current scales saturate: |x| > clip = scale * range (fp8: range = max code, 448 for
  E4M3, 57344 for E5M2; nvfp4: 448 * 6, where the E4M3 block scale saturates), counted exactly in the pass, and
  the same count for fresh scales of the file's own observer on the traffic (0 for minmax; a percentile or mse
  file clips its own calibration text by design): their difference is the excess clip fraction;
- SQNR with the current scales and with fresh scales (the file's observer on the traffic), computed the way
  calibrate computes it: fp8 from the |x| histograms (one pass, exact within a bin), nvfp4 by fake-quantizing
  the traffic again with the current and the candidate global scales (a second pass).

Verdict: `drifted` when any scale group clips more than `max_clip` of its elements beyond what fresh scales clip,
or loses more than `max_sqnr_loss_db` against fresh scales; `fits` otherwise. The file's observer on its own
calibration text chooses the file's scales again, so there both numbers are 0 exactly
(tests/calibrate/test_drift_calibration_traffic.py); elsewhere they measure how far the traffic has moved.

Defaults, chosen in the gap between ordinary traffic variation and a calibration that no longer holds, measured
on SmolLM2-135M-Instruct (float32, CPU). Scales: `kvcal calibrate smollm2 --kv-format fp8_e4m3 --granularity
tensor --observer minmax --dataset ../shared/data/c4_calib --num-samples 32 --seq-len 512` (8,472 tokens).
Traffic: `kvcal drift SCALES smollm2 --dtype float32 --dataset D [--text-field question] --num-samples N
--seq-len 512`; "x0.7" = the same scales times 0.7 (a calibration on text 30 % quieter than the traffic);
KL: `kvcal eval smollm2 --tasks kl --limit 12 --kl-seq-len 128 --kv-format fp8_e4m3 --scales ...`.

    traffic (N)                           worst clip fraction   worst SQNR loss   verdict   KL vs BF16 (nats)
    C4, other documents (--seed 1, 16)    6.4e-6                0.32 dB           fits      0.0067 (the scales)
    GSM8K questions (32)                  1.0e-5                0.27 dB           fits
    GSM8K as chat (chat template, 32)     3.1e-5                0.18 dB           fits
    Python source (kvcal's own, 16)       6.3e-5                0.41 dB           fits
    GSM8K questions, scales x0.7 (16)     6.6e-3                9.2 dB            drifted   0.010
    GSM8K questions, scales x0.5 (16)     1.5e-2                17.4 dB           drifted   0.057
    GSM8K questions, scales x0.25 (16)    8.8e-2                24.4 dB           drifted   0.44

- DEFAULT_MAX_CLIP = 1e-4: 1.6x the worst clipping of the four real traffic samples (6.3e-5, code), 66x below
  the x0.7 calibration. E4M3 rounding costs up to ~3 % of an element; a clipped one loses (|x| - clip) / |x|,
  up to 30 % at x0.7 — what that costs is the KL column. No measurement falls between 6.3e-5 and 6.6e-3: the
  threshold sits low in that gap, so a release recalibrates early rather than late: at x0.7 the KL (0.010)
  is still under `kvcal compare`'s default gate of 0.02 nats, and recalibrating costs one pass.
- DEFAULT_MAX_SQNR_LOSS_DB = 1.0: E4M3's rounding SQNR is 31.4 dB on every layer whatever the scale, and real
  traffic lost at most 0.41 dB; 1 dB (noise power +26 %) cannot come from rounding: it is clipping, or small
  values underflowing under a scale calibrated on much larger ones.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.calibrate.data import CalibrationSamples, TextSource, load_texts
from kvcal.calibrate.hooks import ProgressFn
from kvcal.calibrate.observation import ObserveOptions
from kvcal.calibrate.observers import (
    CandidateEval,
    GroupedStats,
    Observer,
    clip_to_scale,
    format_range,
    get_observer,
    is_elementwise,
    sqnr_db,
)
from kvcal.calibrate.run import StatsCollector
from kvcal.errors import KvcalError, UsageError
from kvcal.formats import KVFormat, get_format
from kvcal.models.geometry import KVSpec, kv_spec
from kvcal.models.loading import LoadedModel, check_device, load_model

DEFAULT_MAX_CLIP = 1e-4
DEFAULT_MAX_SQNR_LOSS_DB = 1.0
DEFAULT_SEQ_LEN = 512  # a scale file without calibration.seq_len: calibrate's default
FITS, DRIFTED = "fits", "drifted"
CLIP_RTOL = 1e-6  # |x| counts as saturated above clip * (1 + CLIP_RTOL), as observers.GroupedStats.clipped
KINDS = ("k", "v")
# per kind in a layer's / head's record, besides amax, calibrated amax and clip
RECORDED = ("clip_fraction", "fresh_clip_fraction", "excess_clip_fraction", "sqnr_db", "sqnr_fresh_db",
            "sqnr_loss_db")  # fmt: skip
_KIND_NAME = {"k": "K", "v": "V"}
Key = tuple[int, str]  # (layer, 'k' | 'v')


@dataclass
class DriftReport:
    """The verdict and its evidence. `layers`: one dict per layer (see `_layer_record`); `reasons`: one sentence
    per scale group over a threshold (empty when the verdict is 'fits')."""

    verdict: str
    layers: list[dict[str, Any]]
    reasons: list[str]
    scales_path: str
    model: str
    kv_format: str
    granularity: str
    max_clip: float
    max_sqnr_loss_db: float
    traffic: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return self.verdict == DRIFTED

    def worst(self) -> dict[str, Any]:
        """The largest clip fraction and SQNR loss over all layers and K/V (None where nothing is defined)."""
        clips = [(r[f"{k}_excess_clip_fraction"], r["layer"], k) for r in self.layers for k in KINDS]
        losses = [(r[f"{k}_sqnr_loss_db"], r["layer"], k) for r in self.layers for k in KINDS]
        losses = [x for x in losses if x[0] is not None]
        c, l_ = max(clips), (max(losses) if losses else None)
        return {
            "clip_fraction": c[0], "clip_layer": c[1], "clip_kind": c[2],
            "sqnr_loss_db": l_[0] if l_ else None, "sqnr_loss_layer": l_[1] if l_ else None,
            "sqnr_loss_kind": l_[2] if l_ else None,
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reasons": self.reasons,
            "scales": self.scales_path,
            "model": self.model,
            "kv_format": self.kv_format,
            "granularity": self.granularity,
            "thresholds": {"max_clip": self.max_clip, "max_sqnr_loss_db": self.max_sqnr_loss_db},
            "traffic": self.traffic,
            "worst": self.worst(),
            "layers": self.layers,
            "warnings": self.warnings,
        }


# ---- inputs -------------------------------------------------------------------------------------------------


def _check_thresholds(max_clip: float, max_sqnr_loss_db: float) -> None:
    if not (0.0 <= max_clip < 1.0) or math.isnan(max_clip):
        raise UsageError(f"--max-clip must be a fraction in [0, 1) (e.g. 1e-4), got {max_clip}")
    if not max_sqnr_loss_db >= 0.0 or math.isinf(max_sqnr_loss_db):
        raise UsageError(
            f"--max-sqnr-loss-db must be a finite number >= 0 (e.g. 1.0), got {max_sqnr_loss_db}"
        )


def load_traffic(dataset: str | os.PathLike[str] | None) -> TextSource:
    """The traffic's records (calibrate's reader); an empty or unreadable traffic file is one clear error."""
    path = Path(dataset).expanduser() if dataset is not None else None
    if path is not None and path.is_file():
        try:
            with path.open("rb") as fh:
                empty = not fh.read(1 << 16).strip()
        except OSError as exc:
            raise KvcalError(
                f"cannot read traffic file '{path}' ({exc.strerror or exc}); make it readable or pass another "
                "--dataset"
            ) from None
        if empty and path.stat().st_size < (1 << 16):
            raise KvcalError(f"traffic file '{path}' is empty; pass a sample of the traffic (one text or record "
                             "per line/paragraph)")  # fmt: skip
    try:
        return load_texts(dataset)
    except OSError as exc:  # a folder's member unreadable, a parquet file that cannot be opened
        raise KvcalError(
            f"cannot read traffic '{dataset}' ({exc.strerror or exc}); make it readable or pass another --dataset"
        ) from None


def _bound_scales(scales_path: str | os.PathLike[str], model: str | LoadedModel, force: bool) -> Any:
    """The scale set, checked against MODEL before any weights load (stale -> KvcalError unless `force`)."""
    from kvcal.scales import load_scales_for_model, resolve_model_and_spec

    if isinstance(model, LoadedModel):
        ref, model_dir, kv = model.ref, model.model_dir, kv_spec(model.config)
    else:
        ref = str(model)
        model_dir, kv = resolve_model_and_spec(ref)
    return load_scales_for_model(scales_path, ref, model_dir, kv, force=force)


# ---- observing ----------------------------------------------------------------------------------------------


class ClipCounter:
    """KV sink counting exactly the elements above a clip, per KV head (|x| > clip * (1 + CLIP_RTOL))."""

    def __init__(self, clips: dict[Key, torch.Tensor]) -> None:
        self.clips = clips  # (layer, kind) -> clip [G] (G = 1 or H_kv)
        self.over: dict[Key, torch.Tensor] = {}  # (layer, kind) -> [H_kv] count of |x| > clip

    def __call__(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for kind, x in (("k", k), ("v", v)):
            # x: [B, H_kv, T, D]; clip broadcast along dim 1 (per head) or as a scalar
            # a clip within float32 rounding of amax ((amax / range) * range) saturates nothing that matters
            clip = self.clips[(layer_idx, kind)].to(x.device) * (1 + CLIP_RTOL)
            clip = clip.reshape(1, -1, 1, 1) if clip.numel() > 1 else clip.reshape(())
            n = (x.detach().abs().float() > clip).sum(dim=(0, 2, 3)).cpu().double()  # [H_kv]
            key = (layer_idx, kind)
            self.over[key] = self.over[key] + n if key in self.over else n


class DriftSink(StatsCollector):
    """calibrate's StatsCollector plus the exact count of elements above the current clip, per KV head."""

    def __init__(self, clips: dict[Key, torch.Tensor]) -> None:
        super().__init__()
        self.counter = ClipCounter(clips)
        self.over = self.counter.over

    def __call__(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__call__(layer_idx, k, v)
        self.counter(layer_idx, k, v)


@dataclass
class _Measured:
    """Per scale group [G] of one (layer, kind): traffic amax, element count, clipped count, signal, noise with
    the current and with fresh scales, the fresh scales and (filled after a counting pass) their clipped count."""

    amax: torch.Tensor
    total: torch.Tensor
    clipped: torch.Tensor
    signal: torch.Tensor
    noise_current: torch.Tensor
    noise_fresh: torch.Tensor
    fresh_scale: torch.Tensor
    clipped_fresh: torch.Tensor | None = None


def _group(per_head: torch.Tensor, granularity: str) -> torch.Tensor:
    return per_head if granularity == "head" else per_head.sum().reshape(1)


def file_observer(ss: Any) -> Observer:
    """The observer the scale file was calibrated with (manifest `observer`: name and params), which drift runs
    on the traffic for its fresh scales. llm-compressor's static_minmax and a name this kvcal does not know
    (a newer kvcal's) are minmax, the observer whose clip is the amax."""
    rec = ss.manifest.get("observer") or {}
    name, params = str(rec.get("name", "minmax")), rec.get("params") or {}
    try:
        return get_observer(name, dict(params))
    except Exception:  # noqa: BLE001 - 'llmcompressor:static_minmax', a newer observer, bad params
        return get_observer("minmax")


def _measure_elementwise(
    g: GroupedStats, fmt: KVFormat, scale: torch.Tensor, clipped: torch.Tensor, observer: Observer
) -> _Measured:
    # fresh scales: the file's observer on the traffic, exactly as calibrate chooses them (minmax: amax / range)
    fresh = clip_to_scale(observer.clip(g, fmt), fmt)
    return _Measured(
        g.amax, g.total, clipped, g.signal, g.fp8_noise(fmt, scale.float()), g.fp8_noise(fmt, fresh), fresh
    )


def _measure_block(
    model: Any, samples: list[torch.Tensor], kv: KVSpec, fmt: KVFormat, granularity: str,
    grouped: dict[Key, GroupedStats], scales: dict[Key, torch.Tensor], clipped: dict[Key, torch.Tensor],
    observer: Observer, opts: ObserveOptions, progress: ProgressFn | None,
) -> dict[Key, _Measured]:  # fmt: skip
    """nvfp4: the current global scale and the file observer's candidates on the traffic (minmax: the amax)
    fake-quantize the traffic in a second pass; the fresh scale is the best candidate, as calibrate picks it."""
    from kvcal.calibrate.run import candidate_pass

    evals: dict[Key, CandidateEval] = {}
    for key, g in grouped.items():
        current = scales[key].float().reshape(-1)
        cands = observer.candidates(g, fmt).float()  # [C, G]
        clips = torch.cat([(current * format_range(fmt)).unsqueeze(0), cands])  # [1 + C, G]
        ev = CandidateEval(fmt, clips, granularity)
        # the stored scales themselves, not clip_to_scale's round trip through the clip
        ev.scales = torch.cat([current.unsqueeze(0), clip_to_scale(cands, fmt)])
        evals[key] = ev
    candidate_pass(model, samples, kv.num_layers, opts, progress)(evals)
    out: dict[Key, _Measured] = {}
    for key, g in grouped.items():
        ev = evals[key]
        best = 1 + ev.noise[1:].argmin(0)  # [G], as CandidateEval.best over the candidates alone
        groups = torch.arange(best.numel())
        out[key] = _Measured(g.amax, ev.total, clipped[key], ev.signal, ev.noise[0], ev.noise[best, groups],
                             ev.scales[best, groups])  # fmt: skip
    return out


def _observe(
    lm: LoadedModel, data: CalibrationSamples, ss: Any, fmt: KVFormat, opts: ObserveOptions,
    progress: ProgressFn | None,
) -> tuple[dict[Key, _Measured], dict[Key, torch.Tensor]]:  # fmt: skip
    """Observe the traffic as `opts` (the file's observation) says, measure it again for nvfp4, and count what
    fresh scales of the file's observer clip (0 by construction for minmax: nothing exceeds the amax; other
    observers: one more pass): (measurements per (layer, kind), clips [G])."""
    kv = kv_spec(lm.model.config)
    scales = {(i, kind): (ss.k_scales if kind == "k" else ss.v_scales)[i].float().reshape(-1)
              for i in range(kv.num_layers) for kind in KINDS}  # fmt: skip
    clips = {key: s * format_range(fmt) for key, s in scales.items()}  # [G]
    observer = file_observer(ss)
    sink = DriftSink(clips)
    opts.observe(lm.model, data.samples, sink, kv.num_layers, progress=progress)
    grouped = {key: sink.stats[key].grouped(ss.granularity) for key in scales}
    clipped = {key: _group(sink.over[key], ss.granularity) for key in scales}
    if is_elementwise(fmt):
        measured = {
            key: _measure_elementwise(grouped[key], fmt, scales[key], clipped[key], observer) for key in scales
        }
    else:
        measured = _measure_block(
            lm.model, data.samples, kv, fmt, ss.granularity, grouped, scales, clipped, observer, opts, progress
        )
    if observer.name == "minmax":
        for m in measured.values():
            m.clipped_fresh = torch.zeros_like(m.clipped)
    else:
        counter = ClipCounter({key: m.fresh_scale * format_range(fmt) for key, m in measured.items()})
        opts.observe(lm.model, data.samples, counter, kv.num_layers, progress=progress, phase="count")
        for key, m in measured.items():
            m.clipped_fresh = _group(counter.over[key], ss.granularity)
    return measured, clips


# ---- per-layer records and the verdict ----------------------------------------------------------------------


def _loss(current: float | None, fresh: float | None) -> float | None:
    """dB the current scales lose against fresh ones (None = lossless). Lossless current scales lose nothing;
    lossless fresh ones against lossy current ones is an infinite loss in dB: None, judged by the clip fraction."""
    if current is None:
        return 0.0  # the current scales are lossless: no loss
    if fresh is None:
        return None
    return fresh - current


def _numbers(m: _Measured, idx: slice | int) -> dict[str, Any]:
    """clip fraction and SQNRs of the groups `idx` of one measurement, summed over those groups."""
    total = float(m.total[idx].sum())
    signal = float(m.signal[idx].sum())
    current = sqnr_db(signal, float(m.noise_current[idx].sum()))
    fresh = sqnr_db(signal, float(m.noise_fresh[idx].sum()))
    assert m.clipped_fresh is not None
    clip_fraction = float(m.clipped[idx].sum()) / max(total, 1.0)
    fresh_clip = float(m.clipped_fresh[idx].sum()) / max(total, 1.0)
    return {
        "amax": float(m.amax[idx].max()),
        "clip_fraction": clip_fraction,
        "fresh_clip_fraction": fresh_clip,
        # what the current scales clip beyond what the file's own observer clips on this traffic: the drift
        "excess_clip_fraction": clip_fraction - fresh_clip,
        "sqnr_db": current,
        "sqnr_fresh_db": fresh,
        "sqnr_loss_db": _loss(current, fresh),
    }


def _calibrated_amax(ss: Any, layer: int, kind: str, clip: torch.Tensor) -> list[float]:
    """The amax the file was calibrated on, per group: the manifest's per-layer statistics (per head for a
    per-head file), else the clip the scales stand for (a file without statistics)."""
    stats = ss.layer_stats[layer] if layer < len(ss.layer_stats) else {}
    per_head, whole = stats.get(f"{kind}_amax_per_head"), stats.get(f"{kind}_amax")
    if ss.granularity == "head" and isinstance(per_head, list) and len(per_head) == clip.numel():
        return [float(a) for a in per_head]
    if ss.granularity != "head" and isinstance(whole, int | float):
        return [float(whole)]
    return [float(c) for c in clip]


def _layer_record(
    layer: int, measured: dict[Key, _Measured], clips: dict[Key, torch.Tensor], ss: Any
) -> dict[str, Any]:
    """One layer: per kind amax (traffic, calibrated), clip, clip fraction, SQNR current / fresh / loss; a
    per-head file adds `heads` with the same numbers per KV head."""
    rec: dict[str, Any] = {"layer": layer}
    for kind in KINDS:
        m, clip = measured[(layer, kind)], clips[(layer, kind)]
        nums = _numbers(m, slice(None))
        rec[f"{kind}_amax"] = nums["amax"]
        rec[f"{kind}_calibrated_amax"] = max(_calibrated_amax(ss, layer, kind, clip))
        rec[f"{kind}_clip"] = float(clip.max())
        for name in RECORDED:
            rec[f"{kind}_{name}"] = nums[name]
    if ss.granularity == "head":
        rec["heads"] = [
            _head_record(layer, h, measured, clips, ss) for h in range(clips[(layer, "k")].numel())
        ]
    return rec


def _head_record(
    layer: int, h: int, measured: dict[Key, _Measured], clips: dict[Key, torch.Tensor], ss: Any
) -> dict[str, Any]:
    rec: dict[str, Any] = {"head": h}
    for kind in KINDS:
        nums = _numbers(measured[(layer, kind)], slice(h, h + 1))
        rec[f"{kind}_amax"] = nums["amax"]
        rec[f"{kind}_calibrated_amax"] = _calibrated_amax(ss, layer, kind, clips[(layer, kind)])[h]
        rec[f"{kind}_clip"] = float(clips[(layer, kind)][h])
        for name in RECORDED:
            rec[f"{kind}_{name}"] = nums[name]
    return rec


def _reasons(layers: list[dict[str, Any]], max_clip: float, max_loss: float) -> list[str]:
    """One sentence per scale group over a threshold: per tensor for a per-tensor file, per KV head otherwise."""
    out: list[str] = []
    for rec in layers:
        groups = [(f"layer {rec['layer']} head {h['head']}", h) for h in rec["heads"]] if "heads" in rec else [
            (f"layer {rec['layer']}", rec)]  # fmt: skip
        for where, g in groups:
            for kind in KINDS:
                name = f"{where} {_KIND_NAME[kind]}"
                clip_frac, loss = g[f"{kind}_clip_fraction"], g[f"{kind}_sqnr_loss_db"]
                excess, fresh = g[f"{kind}_excess_clip_fraction"], g[f"{kind}_fresh_clip_fraction"]
                if excess > max_clip:
                    beyond = f", {excess:.2e} more than fresh scales clip ({fresh:.2e})" if fresh > 0 else ""
                    out.append(
                        f"{name}: {clip_frac:.2e} of the elements exceed the calibrated clip {g[f'{kind}_clip']:.4g} "
                        f"(traffic amax {g[f'{kind}_amax']:.4g}){beyond}, more than --max-clip {max_clip:g}"
                    )
                if loss is not None and loss > max_loss:
                    out.append(
                        f"{name}: SQNR {g[f'{kind}_sqnr_db']:.1f} dB with the current scales vs "
                        f"{g[f'{kind}_sqnr_fresh_db']:.1f} dB with fresh ones ({loss:.2f} dB lost), more than "
                        f"--max-sqnr-loss-db {max_loss:g}"
                    )
    return out


# ---- the check ----------------------------------------------------------------------------------------------


@dataclass
class DriftConfig:
    """The options of `kvcal drift` as given (by name and default); `drift_spec` parses them once."""

    scales: str | os.PathLike[str]  # the scale file (SCALES)
    model: str | LoadedModel
    dataset: str | None = None  # the traffic sample
    text_field: str | None = None
    num_samples: int = 32
    seq_len: int | None = None  # None: the scale file's calibration.seq_len
    seed: int = 0
    max_clip: float = DEFAULT_MAX_CLIP
    max_sqnr_loss_db: float = DEFAULT_MAX_SQNR_LOSS_DB
    force: bool = False  # check a file bound to another checkpoint anyway
    dtype: str | None = None  # None: the scale file's calibration.dtype
    kv_input_dtype: str | None = None  # None or the scale file's own (another is refused)
    batch_size: int = 1
    device: str = "cpu"


@dataclass(frozen=True)
class DriftSpec:
    """One drift check, parsed and checked without a forward pass (build it with `drift_spec`)."""

    scales_path: str | os.PathLike[str]
    model: str | LoadedModel
    scale_set: Any  # kvcal.scales.ScaleSet, bound to the model (or forced)
    source: TextSource  # the traffic's records
    opts: ObserveOptions  # set up as the scale file's calibration observed (ObserveOptions.for_scale_file)
    fmt: KVFormat
    load_dtype: str  # the model's dtype: --dtype, else the calibration's
    device: str
    max_clip: float
    max_sqnr_loss_db: float

    @property
    def calibration(self) -> dict[str, Any]:
        """The scale file's manifest record of its calibration."""
        return self.scale_set.manifest.get("calibration") or {}


def drift_spec(config: DriftConfig) -> DriftSpec:
    """Every check that needs no forward pass, in this order: thresholds, device, traffic file, scale file and its
    binding to MODEL (stale is a KvcalError unless `force`), the observation options read from the manifest."""
    c = config
    _check_thresholds(c.max_clip, c.max_sqnr_loss_db)
    if not isinstance(c.model, LoadedModel):
        check_device(c.device)
    source = load_traffic(c.dataset)
    ss = _bound_scales(c.scales, c.model, c.force)
    cal = ss.manifest.get("calibration") or {}
    seq_len = int(cal.get("seq_len") or DEFAULT_SEQ_LEN) if c.seq_len is None else c.seq_len
    opts = ObserveOptions.parse(
        dataset=c.dataset, text_field=c.text_field, num_samples=c.num_samples, seq_len=seq_len, seed=c.seed,
        batch_size=c.batch_size,
    ).for_scale_file(ss, c.kv_input_dtype)  # fmt: skip
    load_dtype = c.dtype if c.dtype is not None else str(cal.get("dtype") or "auto")
    return DriftSpec(
        c.scales,
        c.model,
        ss,
        source,
        opts,
        get_format(ss.kv_format),
        load_dtype,
        c.device,
        c.max_clip,
        c.max_sqnr_loss_db,
    )


def check_drift(
    scales_path: str | Path,
    model: str | LoadedModel,
    *,
    dataset: str | None,
    num_samples: int,
    seq_len: int | None = None,
    seed: int = 0,
    max_clip: float = DEFAULT_MAX_CLIP,
    max_sqnr_loss_db: float = DEFAULT_MAX_SQNR_LOSS_DB,
    dtype: str | None = None,
    device: str = "cpu",
    force: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    text_field: str | None = None,
    kv_input_dtype: str | None = None,
    batch_size: int = 1,
) -> DriftReport:
    """`run_drift(drift_spec(DriftConfig(...)))` for keyword callers: `scales_path` is DriftConfig's `scales`, the
    other keywords its fields (see there), `progress` the callback `progress(done, total, phase)`."""
    options = {
        k: v for k, v in locals().items() if k not in ("progress", "scales_path")
    }  # DriftConfig's fields
    return run_drift(drift_spec(DriftConfig(scales=scales_path, **options)), progress)


def run_drift(spec: DriftSpec, progress: ProgressFn | None = None) -> DriftReport:
    """Observe K/V on the traffic exactly as the scale file's manifest says its calibration observed them
    (`ObserveOptions.for_scale_file`: K/V rounded to calibration.kv_input_dtype; the model in calibration.dtype
    unless --dtype says otherwise, a warning then; calibrate's sampling and BOS rule) and judge whether the file
    still fits."""
    ss, opts, cal = spec.scale_set, spec.opts, spec.calibration
    if progress:
        progress(0, 1, "load")
    model = spec.model
    lm = model if isinstance(model, LoadedModel) else load_model(model, dtype=spec.load_dtype, device=spec.device)
    if progress:
        progress(1, 1, "load")
    warnings = _dtype_warning(lm, cal.get("dtype"))
    data = opts.samples(lm, spec.source)
    measured, clips = _observe(lm, data, ss, spec.fmt, opts, progress)
    layers = [_layer_record(i, measured, clips, ss) for i in range(ss.num_layers)]
    reasons = _reasons(layers, spec.max_clip, spec.max_sqnr_loss_db)
    traffic = {
        **data.manifest(),
        "kv_input_dtype": opts.kv_input_dtype,
        "dtype": _model_dtype(lm),
        "calibration_text": data.token_sha256 == cal.get("token_ids_sha256"),
    }
    return DriftReport(
        verdict=DRIFTED if reasons else FITS, layers=layers, reasons=reasons, scales_path=str(spec.scales_path),
        model=lm.ref, kv_format=ss.kv_format, granularity=ss.granularity, max_clip=spec.max_clip,
        max_sqnr_loss_db=spec.max_sqnr_loss_db, traffic=traffic,
        warnings=list(data.warnings) + list(ss.binding_warnings) + warnings,
    )  # fmt: skip


def _model_dtype(lm: LoadedModel) -> str:
    return str(next(lm.model.parameters()).dtype).replace("torch.", "")


def _dtype_warning(lm: LoadedModel, calibrated: str | None) -> list[str]:
    """A warning when the model runs in another dtype than the calibration's: its K/V then differ even on the
    calibration text, so drift measures the dtype change as well as the traffic's."""
    have = _model_dtype(lm)
    if calibrated is None or have == calibrated:
        return []
    return [
        f"the model runs in {have}, the scales were calibrated in {calibrated}: its K/V differ from the "
        f"calibration's even on the same text; pass --dtype {calibrated} to check the traffic alone"
    ]
