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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.calibrate.data import CalibrationSamples, build_samples, load_texts, max_model_len
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
from kvcal.models import KVSpec, LoadedModel, kv_spec, load_model

ENGINES = ("native", "llmcompressor")


@dataclass
class CalibrationResult:
    scale_set: Any  # kvcal.scales.ScaleSet
    output: Path | None
    samples: CalibrationSamples
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def check_output_path(output: str | os.PathLike[str] | None) -> Path | None:
    """Fail before any work when the scale file cannot be written there."""
    if output is None:
        return None
    out = Path(output).expanduser()
    if out.is_dir():
        raise UsageError(f"output '{out}' is a directory; pass a file name like {out / 'scales.safetensors'}")
    parent = out.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"cannot write '{out}': '{probe}' is a file, not a folder; choose another -o path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write '{out}': folder '{probe}' is not writable; choose another -o path")
    return out


class _Collector:
    """Sink for hooks: one TensorStats per (layer, 'k'|'v'), with a finiteness check naming the layer."""

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
    """Calibrate K/V scales and (when `output` is given) write the scale file atomically."""
    from kvcal.scales import compute_binding, make_scale_set, save_scale_file

    t0 = time.perf_counter()
    fmt = get_format(kv_format)
    check_calibratable(fmt, granularity)
    obs = get_observer(observer, observer_params)
    if engine not in ENGINES:
        raise UsageError(f"unknown engine '{engine}'; choose native or llmcompressor")
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
    out = check_output_path(output)
    timings: dict[str, float] = {}

    if progress:
        progress(0, 1, "load")
    lm = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
    kv = kv_spec(lm.model.config)
    timings["load_s"] = time.perf_counter() - t0
    if progress:
        progress(1, 1, "load")

    t = time.perf_counter()
    source = load_texts(dataset)
    data = build_samples(
        source,
        lm.tokenizer,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        text_field=text_field,
        max_len=max_model_len(lm.model.config),
    )
    timings["data_s"] = time.perf_counter() - t

    collector = _Collector()
    t = time.perf_counter()
    extra: dict[str, Any] = {"engine": engine}
    imported: dict[tuple[int, str], torch.Tensor] | None = None
    if engine == "native":
        observe(lm.model, data.samples, collector, kv.num_layers, progress=progress, phase="observe")
    else:
        from kvcal.calibrate.llmcompressor_engine import llmcompressor_scales

        if progress:
            progress(0, data.num_samples, "llmcompressor")
        ks, vs = llmcompressor_scales(
            lm.model, data.samples, granularity, observer=llmc_observer, sink=collector
        )
        if progress:
            progress(data.num_samples, data.num_samples, "llmcompressor")
        imported = {}
        for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
            imported[(i, "k")], imported[(i, "v")] = k, v
        extra["llmcompressor"] = {"observer": llmc_observer, "pipeline": "basic", "strategy": granularity}
        if (
            not collector.stats
        ):  # our hook did not fire (llm-compressor internals changed): measure separately
            observe(lm.model, data.samples, collector, kv.num_layers, progress=progress, phase="observe")
    timings["observe_s"] = time.perf_counter() - t

    def second_pass(evals: dict[tuple[int, str], CandidateEval]) -> None:
        observe(lm.model, data.samples, _EvalSink(evals), kv.num_layers, progress=progress, phase="evaluate")

    t = time.perf_counter()
    k_scales, v_scales, records = scales_from_stats(
        collector.stats, kv, fmt, granularity, obs, imported=imported, second_pass=second_pass
    )
    timings["scales_s"] = time.perf_counter() - t

    binding = compute_binding(lm.ref, lm.model_dir, kv)
    calibration = {
        **data.manifest(),
        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(lm.model.parameters()).device),
    }
    obs_name = obs.name if engine == "native" else f"llmcompressor:{llmc_observer}"
    ss = make_scale_set(
        fmt.name,
        granularity,
        k_scales,
        v_scales,
        observer=obs_name,
        observer_params=obs.params if engine == "native" else {},
        binding=binding,
        calibration=calibration,
        layer_stats=records,
        extra=extra,
    )
    timings["total_s"] = time.perf_counter() - t0
    ss.manifest["calibration"]["wall_s"] = round(timings["total_s"], 3)
    if out is not None:
        save_scale_file(out, ss)
    return CalibrationResult(
        scale_set=ss, output=out, samples=data, warnings=list(data.warnings), timings=timings
    )
