"""One calibration run: model + data -> observed K/V statistics -> scales + manifest -> scale file.

    calibrate(model, "fp8_e4m3", granularity="tensor", observer="minmax", dataset=None,
              num_samples=128, seq_len=512, seed=0, engine="native", output="scales.safetensors")

Native engine: one streamed pass (`hooks.observe`) fills per-layer `TensorStats`; fp8 scales and their statistics
come from those histograms; nvfp4 (block format) adds a second pass that measures the candidate global scales on
the data. llm-compressor engine: `llmcompressor_engine.llmcompressor_scales` on the same samples, kvcal's
statistics gathered in the same forwards. Progress goes to an optional callback `progress(done, total, phase)`;
nothing here prints.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.calibrate.data import CalibrationSamples, load_texts, samples_for_model
from kvcal.calibrate.hooks import ProgressFn, check_finite, observe
from kvcal.calibrate.observers import (
    CandidateEval,
    TensorStats,
    check_calibratable,
    clip_to_scale,
    get_observer,
    is_elementwise,
    sqnr_db,
)
from kvcal.errors import KvcalError, UsageError
from kvcal.formats import KVFormat, get_format
from kvcal.models import KVSpec, LoadedModel, check_device, kv_spec, load_model

ENGINES = ("native", "llmcompressor")


@dataclass
class CalibrationResult:
    scale_set: Any  # kvcal.scales.ScaleSet
    output: Path | None
    samples: CalibrationSamples
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def check_output_path(output: str | os.PathLike[str] | None) -> Path | None:
    """Fail before any work when the output file cannot be written there: the missing folders are created and a
    probe file written in them (then all of it removed again), so every reason the OS has is found now."""
    if output is None:
        return None
    out = Path(output).expanduser()
    try:
        if out.is_dir():
            raise UsageError(
                f"output '{out}' is a directory; pass a file name like {out / 'scales.safetensors'}"
            )
        probe = out.parent
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise UsageError(
                f"cannot write '{out}': '{probe}' is a file, not a folder; choose another -o path"
            )
        if not os.access(probe, os.W_OK | os.X_OK):
            raise UsageError(
                f"cannot write '{out}': folder '{probe}' is not writable; choose another -o path"
            )
        _probe_write(out.parent, existing=probe)
    except OSError as exc:
        raise UsageError(f"cannot write '{out}': {exc.strerror or exc}; choose another -o path") from None
    return out


def _probe_write(folder: Path, existing: Path) -> None:
    """Create `folder` (below its existing ancestor `existing`), write and delete a file in it, remove what was
    created: raises the OSError a real write would."""
    created = [p for p in [folder, *folder.parents] if p != existing and existing in p.parents]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    finally:
        for p in created:  # deepest first
            if p.is_dir():
                p.rmdir()


class StatsCollector:
    """KV sink that fills one TensorStats per (layer, 'k'|'v'), with a finiteness check naming the layer."""

    def __init__(self) -> None:
        self.stats: dict[tuple[int, str], TensorStats] = {}

    def __call__(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, x in (("k", k), ("v", v)):
            # x: [B, H_kv, T, D]
            amax = x.detach().abs().amax(dim=(0, 2, 3)).float()  # [H_kv]
            check_finite(layer_idx, "keys" if name == "k" else "values", amax)
            key = (layer_idx, name)
            if key not in self.stats:
                self.stats[key] = TensorStats(x.shape[1])
            self.stats[key].update(x, amax)


class _EvalSink:
    def __init__(self, evals: dict[tuple[int, str], CandidateEval]) -> None:
        self.evals = evals

    def __call__(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.evals[(layer_idx, "k")].update(k)
        self.evals[(layer_idx, "v")].update(v)


def candidate_pass(
    model: Any, samples: Sequence[torch.Tensor], num_layers: int, progress: ProgressFn | None = None
) -> Callable[[dict[tuple[int, str], CandidateEval]], None]:
    """The second pass block formats need (`scales_from_stats(second_pass=...)`): the samples run through the
    model again and every candidate scale is measured on the real K/V."""

    def run(evals: dict[tuple[int, str], CandidateEval]) -> None:
        observe(model, samples, _EvalSink(evals), num_layers, progress=progress, phase="evaluate")

    return run


def _layer_record(layer: int, per_kind: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rec: dict[str, Any] = {"layer": layer}
    for kind in ("k", "v"):
        info = per_kind[kind]
        rec[f"{kind}_amax"] = info["amax"]
        rec[f"{kind}_clipped_fraction"] = info["clipped_fraction"]
        rec[f"{kind}_sqnr_db"] = info["sqnr_db"]
    for kind in ("k", "v"):
        rec[f"{kind}_amax_per_head"] = per_kind[kind]["amax_per_head"]
    return rec


def scales_from_stats(
    stats: dict[tuple[int, str], TensorStats],
    kv: KVSpec,
    fmt: KVFormat,
    granularity: str,
    observer: Any,
    imported: dict[tuple[int, str], torch.Tensor] | None = None,
    second_pass: Callable[[dict[tuple[int, str], CandidateEval]], None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """Per-layer scales and statistics. `imported`: scales chosen elsewhere (llm-compressor) to measure only."""
    missing = [i for i in range(kv.num_layers) if (i, "k") not in stats]
    if missing:
        raise KvcalError(
            f"no K/V was observed for layers {missing[:8]}; the model did not write them to its cache"
        )
    chosen: dict[tuple[int, str], torch.Tensor] = {}  # scale [G]
    info: dict[tuple[int, str], dict[str, Any]] = {}
    evals: dict[tuple[int, str], CandidateEval] = {}
    for key, ts in stats.items():
        g = ts.grouped(granularity)
        base = {"amax": float(ts.amax.max()), "amax_per_head": [float(a) for a in ts.amax]}
        if is_elementwise(fmt):
            if imported is not None:
                scale = imported[key]
                clip = scale * float(fmt.max_value)
            else:
                clip = observer.clip(g, fmt)
                scale = clip_to_scale(clip, fmt)
            noise = float(g.fp8_noise(fmt, scale).sum())
            clipped = float(g.clipped(scale * float(fmt.max_value)).sum())
            chosen[key] = scale
            info[key] = {
                **base,
                "clipped_fraction": clipped / max(float(g.total.sum()), 1.0),
                "sqnr_db": sqnr_db(float(g.signal.sum()), noise),
            }
        else:
            clips = observer.candidates(g, fmt)  # [C, G]
            evals[key] = CandidateEval(fmt, clips, granularity)
            info[key] = base
    if evals:
        if second_pass is None:
            raise ValueError("block formats need a second pass over the data")
        second_pass(evals)
        for key, ev in evals.items():
            best = ev.best()  # [G]
            groups = torch.arange(best.numel())
            chosen[key] = ev.scales[best, groups]
            noise = float(ev.noise[best, groups].sum())
            info[key]["clipped_fraction"] = float(ev.clipped[best, groups].sum()) / max(
                float(ev.total.sum()), 1.0
            )
            info[key]["sqnr_db"] = sqnr_db(float(ev.signal.sum()), noise)
    k_scales = [chosen[(i, "k")] for i in range(kv.num_layers)]
    v_scales = [chosen[(i, "v")] for i in range(kv.num_layers)]
    records = [_layer_record(i, {"k": info[(i, "k")], "v": info[(i, "v")]}) for i in range(kv.num_layers)]
    return k_scales, v_scales, records


def observed_scales(
    model: Any,
    samples: Sequence[torch.Tensor],
    kv: KVSpec,
    fmt: KVFormat,
    granularity: str,
    observer: Any,
    progress: ProgressFn | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """kvcal's native calibration on token samples: observe K/V, choose the scales (a second pass for block
    formats). Returns (k_scales, v_scales, per-layer statistics) as `scales_from_stats` does."""
    collector = StatsCollector()
    observe(model, samples, collector, kv.num_layers, progress=progress, phase="observe")
    return scales_from_stats(
        collector.stats, kv, fmt, granularity, observer,
        second_pass=candidate_pass(model, samples, kv.num_layers, progress),
    )  # fmt: skip


def calibrate(
    model: str | LoadedModel,
    kv_format: str,
    granularity: str = "tensor",
    observer: str = "minmax",
    dataset: str | os.PathLike[str] | None = None,
    num_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    engine: str = "native",
    output: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
    *,
    text_field: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    observer_params: dict[str, Any] | None = None,
    llmc_observer: str = "static_minmax",
) -> CalibrationResult:
    """Calibrate K/V scales and (when `output` is given) write the scale file atomically. Every check that needs
    no model (format, engine, output path, device, the dataset's records) runs before the model loads."""
    from kvcal.scales import save_scale_file

    t0 = time.perf_counter()
    fmt = get_format(kv_format)
    obs = _check_request(fmt, granularity, observer, observer_params, engine)
    out = check_output_path(output)
    if not isinstance(model, LoadedModel):
        check_device(device)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    source = load_texts(dataset)
    timings["data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    lm = _load(model, dtype, device, progress)
    kv = kv_spec(lm.model.config)
    timings["load_s"] = time.perf_counter() - t

    t = time.perf_counter()
    data = samples_for_model(source, lm, num_samples, seq_len, seed, text_field)
    timings["data_s"] += time.perf_counter() - t

    t = time.perf_counter()
    if engine == "native":
        collector = StatsCollector()
        observe(lm.model, data.samples, collector, kv.num_layers, progress=progress, phase="observe")
        imported, extra = None, {"engine": engine}
        obs_name, obs_params = obs.name, obs.params
    else:
        collector, imported, extra = _observe_llmcompressor(
            lm.model, data, kv, granularity, llmc_observer, progress
        )
        obs_name, obs_params = f"llmcompressor:{llmc_observer}", {}
    timings["observe_s"] = time.perf_counter() - t

    t = time.perf_counter()
    chosen = scales_from_stats(
        collector.stats, kv, fmt, granularity, obs, imported=imported,
        second_pass=candidate_pass(lm.model, data.samples, kv.num_layers, progress),
    )  # fmt: skip
    timings["scales_s"] = time.perf_counter() - t

    ss = _scale_set(lm, kv, fmt.name, granularity, chosen, obs_name, obs_params, data, extra)
    timings["total_s"] = time.perf_counter() - t0
    ss.manifest["calibration"]["wall_s"] = round(timings["total_s"], 3)
    if out is not None:
        save_scale_file(out, ss)
    return CalibrationResult(
        scale_set=ss, output=out, samples=data, warnings=list(data.warnings), timings=timings
    )


def _check_request(
    fmt: KVFormat, granularity: str, observer: str, observer_params: dict[str, Any] | None, engine: str
) -> Any:
    """The observer for this request; UsageError for a format, granularity, observer or engine that cannot work."""
    check_calibratable(fmt, granularity)
    obs = get_observer(observer, observer_params)
    if engine not in ENGINES:
        raise UsageError(f"unknown engine '{engine}'; choose {' or '.join(ENGINES)}")
    if engine == "llmcompressor":
        if fmt.name != "fp8_e4m3":
            raise UsageError(
                f"--engine llmcompressor calibrates fp8_e4m3 only (not {fmt.name}); use --engine native"
            )
        if observer != "minmax":
            raise UsageError(
                "--engine llmcompressor uses llm-compressor's own observer (static_minmax); drop --observer "
                "or use --engine native"
            )
    return obs


def _load(model: str | LoadedModel, dtype: str, device: str, progress: ProgressFn | None) -> LoadedModel:
    if progress:
        progress(0, 1, "load")
    lm = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
    if progress:
        progress(1, 1, "load")
    return lm


def _observe_llmcompressor(
    model: Any,
    data: CalibrationSamples,
    kv: KVSpec,
    granularity: str,
    llmc_observer: str,
    progress: ProgressFn | None,
) -> tuple[StatsCollector, dict[tuple[int, str], torch.Tensor], dict[str, Any]]:
    """llm-compressor's oneshot chooses the scales; kvcal's statistics are gathered in the same forwards.
    Returns (statistics, the imported scale [G] per (layer, 'k'|'v'), manifest extras)."""
    from kvcal.calibrate.llmcompressor_engine import llmcompressor_scales

    collector = StatsCollector()
    if progress:
        progress(0, data.num_samples, "llmcompressor")
    ks, vs = llmcompressor_scales(model, data.samples, granularity, observer=llmc_observer, sink=collector)
    if progress:
        progress(data.num_samples, data.num_samples, "llmcompressor")
    imported: dict[tuple[int, str], torch.Tensor] = {}
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        imported[(i, "k")], imported[(i, "v")] = k, v
    if not collector.stats:  # our hook did not fire (llm-compressor internals changed): measure separately
        observe(model, data.samples, collector, kv.num_layers, progress=progress, phase="observe")
    extra = {
        "engine": "llmcompressor",
        "llmcompressor": {"observer": llmc_observer, "pipeline": "basic", "strategy": granularity},
    }
    return collector, imported, extra


def _scale_set(
    lm: LoadedModel,
    kv: KVSpec,
    kv_format: str,
    granularity: str,
    chosen: tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]],
    observer_name: str,
    observer_params: dict[str, Any],
    data: CalibrationSamples,
    extra: dict[str, Any],
) -> Any:
    """The ScaleSet (bound to lm's checkpoint) of the chosen (k_scales, v_scales, per-layer statistics)."""
    from kvcal.scales import compute_binding, make_scale_set

    k_scales, v_scales, records = chosen
    param = next(lm.model.parameters())
    calibration = {
        **data.manifest(),
        "dtype": str(param.dtype).replace("torch.", ""),
        "device": str(param.device),
    }
    return make_scale_set(
        kv_format,
        granularity,
        k_scales,
        v_scales,
        observer=observer_name,
        observer_params=observer_params,
        binding=compute_binding(lm.ref, lm.model_dir, kv),
        calibration=calibration,
        layer_stats=records,
        extra=extra,
    )
