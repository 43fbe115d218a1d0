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

from kvcal import parallel
from kvcal.calibrate.data import CalibrationSamples
from kvcal.calibrate.hooks import ProgressFn, check_finite
from kvcal.calibrate.observation import ObserveOptions
from kvcal.calibrate.observers import (
    CandidateEval,
    TensorStats,
    all_reduce_evals,
    all_reduce_stats,
    check_calibratable,
    clip_to_scale,
    get_observer,
    is_elementwise,
    sqnr_db,
)
from kvcal.errors import KvcalError, UsageError
from kvcal.formats import KVFormat, is_tq_preset, kv_pair, parse_kv_format
from kvcal.models.geometry import KVSpec, kv_spec
from kvcal.models.loading import LoadedModel, check_device, loaded
from kvcal.placement import Placement, PlacementOptions

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

    def __init__(self, dist: parallel.Dist | None = None) -> None:
        self.stats: dict[tuple[int, str], TensorStats] = {}
        self._dist = dist or parallel.Dist()

    def __call__(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer_idx == 0:
            parallel.fault_point("calibrate-forward", self._dist)  # tests: a rank dying mid-run
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
        for which, x in (("k", k), ("v", v)):  # a K/V pair may need the second pass on one side only
            ev = self.evals.get((layer_idx, which))
            if ev is not None:
                ev.update(x)


def candidate_pass(
    model: Any,
    samples: Sequence[torch.Tensor],
    num_layers: int,
    opts: ObserveOptions,
    progress: ProgressFn | None = None,
    dist: parallel.Dist | None = None,
) -> Callable[[dict[tuple[int, str], CandidateEval]], None]:
    """The second pass block formats need (`scales_from_stats(second_pass=...)`): the samples run through the
    model again, observed as the first pass was (`opts`), and every candidate scale is measured on the real K/V
    (with `dist`: this rank's samples, the error sums then added over all ranks)."""

    def run(evals: dict[tuple[int, str], CandidateEval]) -> None:
        opts.observe(model, samples, _EvalSink(evals), num_layers, progress=progress, phase="evaluate")
        all_reduce_evals(evals, dist or parallel.Dist())

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
    v_fmt: KVFormat | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """Per-layer scales and statistics. `imported`: scales chosen elsewhere (llm-compressor) to measure only.
    `v_fmt`: V's format when it differs from K's (a K/V pair): each side is calibrated for its own format."""
    missing = [i for i in range(kv.num_layers) if (i, "k") not in stats]
    if missing:
        raise KvcalError(
            f"no K/V was observed for layers {missing[:8]}; the model did not write them to its cache"
        )
    base_fmt = fmt
    chosen: dict[tuple[int, str], torch.Tensor] = {}  # scale [G]
    info: dict[tuple[int, str], dict[str, Any]] = {}
    evals: dict[tuple[int, str], CandidateEval] = {}
    for key, ts in stats.items():
        g = ts.grouped(granularity)
        base = {"amax": float(ts.amax.max()), "amax_per_head": [float(a) for a in ts.amax]}
        fmt = base_fmt if key[1] == "k" or v_fmt is None else v_fmt  # this side's format
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
    opts: ObserveOptions,
    progress: ProgressFn | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """kvcal's native calibration on token samples: observe K/V as `opts` says, choose the scales (a second pass
    for block formats). Returns (k_scales, v_scales, per-layer statistics) as `scales_from_stats` does."""
    collector = StatsCollector()
    opts.observe(model, samples, collector, kv.num_layers, progress=progress)
    return scales_from_stats(
        collector.stats, kv, fmt, granularity, observer,
        second_pass=candidate_pass(model, samples, kv.num_layers, opts, progress),
    )  # fmt: skip


@dataclass
class CalibrateConfig(PlacementOptions):
    """The options of one calibration as given (`kvcal calibrate`'s, by name; `calibrate_spec` parses them once).
    Defaults are the library's; `kvcal calibrate` declares its own --kv-input-dtype default (bfloat16, as eval
    quantizes K/V)."""

    model: str | LoadedModel
    kv_format: str  # may be a K/V pair `k=fp8_e4m3,v=nvfp4`: each side is calibrated for its own format
    granularity: str = "tensor"
    observer: str = "minmax"
    dataset: str | os.PathLike[str] | None = None
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    engine: str = "native"
    output: str | os.PathLike[str] | None = None  # the scale file to write (atomically); None: none written
    text_field: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    observer_params: dict[str, Any] | None = None  # the observer's parameters (library callers)
    percentile: float | None = None  # --percentile: the percentile observer's (None: its default, 99.99)
    llmc_observer: str = "static_minmax"
    attention_scales: bool = False  # also observe the post-RoPE queries: q_scale per layer (FP8 attention)
    batch_size: int = 1  # samples per forward (right-padded; the scales are those of batch 1, hooks.observe)
    # (PlacementOptions: accelerate's big-model placement, device_map / max_memory / offload_folder)
    # the native engine observes K/V rounded to it, as `kvcal eval --kv-input-dtype` quantizes them; None = as
    # the model computes them. The scale file records the dtype observed (manifest calibration.kv_input_dtype)
    kv_input_dtype: str | None = None


@dataclass(frozen=True)
class CalibrateSpec:
    """One calibration, parsed and checked without a model (build it with `calibrate_spec`)."""

    model: str | LoadedModel
    kv_format: str  # canonical (formats.parse_kv_format): what the scale file records
    fmt: KVFormat  # K's format
    v_fmt: KVFormat  # V's (the same object unless a K/V pair)
    granularity: str
    observer: Any  # kvcal.calibrate.observers.Observer, its parameters applied
    engine: str
    llmc_observer: str
    opts: ObserveOptions  # the text, its sampling, the K/V rounding and batching
    output: Path | None  # checked writable (check_output_path)
    placement: Placement
    dtype: str
    device: str  # checked; under several processes on CUDA, this rank's GPU
    attention_scales: bool


def calibrate_spec(config: CalibrateConfig) -> CalibrateSpec:
    """Every check that needs no model (format, observer, engine, processes, output path, device, the dataset's
    records), in this order; UsageError naming the option otherwise."""
    c = config
    if c.percentile is not None and c.observer != "percentile":
        raise UsageError(
            f"--percentile applies to --observer percentile (this run's observer is {c.observer}); drop it"
        )
    params = (
        c.observer_params
        if c.percentile is None
        else {**(c.observer_params or {}), "percentile": c.percentile}
    )
    fmt, v_fmt = kv_pair(c.kv_format)
    if is_tq_preset(c.kv_format):
        raise UsageError(
            f"{c.kv_format} has nothing to calibrate: vLLM's TurboQuant computes its norms and value scales at "
            "write time and applies no k_scale / v_scale; evaluate it without --scales"
        )
    opts = ObserveOptions.parse(
        dataset=c.dataset, text_field=c.text_field, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed,
        kv_input_dtype=c.kv_input_dtype, batch_size=c.batch_size,
    )  # fmt: skip
    obs = _check_request(fmt, c.granularity, c.observer, params, c.engine)
    if v_fmt is not fmt:
        _check_request(v_fmt, c.granularity, c.observer, params, c.engine)
    _check_processes(c.engine, c.attention_scales, opts.num_samples, parallel.from_env())
    out = check_output_path(c.output)
    placement = c.placement()
    device = c.device
    if not isinstance(c.model, LoadedModel):
        check_device(device)
        placement.check()
        device = parallel.rank_device(device, parallel.from_env())  # data parallel on CUDA: a GPU per rank
    return CalibrateSpec(
        model=c.model, kv_format=parse_kv_format(c.kv_format), fmt=fmt, v_fmt=v_fmt, granularity=c.granularity,
        observer=obs, engine=c.engine, llmc_observer=c.llmc_observer, opts=opts, output=out, placement=placement,
        dtype=c.dtype, device=device, attention_scales=c.attention_scales,
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
    percentile: float | None = None,
    llmc_observer: str = "static_minmax",
    attention_scales: bool = False,
    batch_size: int = 1,
    device_map: str | None = None,
    max_memory: str | None = None,
    offload_folder: str | None = None,
    kv_input_dtype: str | None = None,
) -> CalibrationResult:
    """`run_calibration(calibrate_spec(CalibrateConfig(...)))` for keyword callers: the keywords are
    CalibrateConfig's fields (see there), `progress` the callback `progress(done, total, phase)`."""
    options = {k: v for k, v in locals().items() if k != "progress"}  # exactly CalibrateConfig's fields
    return run_calibration(calibrate_spec(CalibrateConfig(**options)), progress)


def run_calibration(spec: CalibrateSpec, progress: ProgressFn | None = None) -> CalibrationResult:
    """Load, sample, observe (native or llm-compressor), choose the scales and, when the spec has an output,
    write the scale file (rank 0 of several processes)."""
    from kvcal.scales import save_scale_file

    t0 = time.perf_counter()
    opts = spec.opts
    timings: dict[str, float] = {}
    t = time.perf_counter()
    source = opts.texts()
    timings["data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    lm = _load(spec.model, spec.dtype, spec.device, progress, spec.placement)
    kv = kv_spec(lm.model.config)
    timings["load_s"] = time.perf_counter() - t

    t = time.perf_counter()
    data = opts.samples(lm, source)
    timings["data_s"] += time.perf_counter() - t
    # several processes (torchrun): rank r observes samples r, r+N, ...; the statistics are merged below
    dist = parallel.setup(spec.device)
    parallel.check_enough_work(data.num_samples, "calibration samples", dist)
    mine = parallel.shard(data.samples, dist)

    t = time.perf_counter()
    collector, imported, extra, obs_name, obs_params = _observe(spec, lm, kv, data, mine, dist, progress)
    timings["observe_s"] = time.perf_counter() - t

    t = time.perf_counter()
    chosen = scales_from_stats(
        collector.stats, kv, spec.fmt, spec.granularity, spec.observer, imported=imported,
        second_pass=candidate_pass(lm.model, mine, kv.num_layers, opts, progress, dist),
        v_fmt=None if spec.v_fmt is spec.fmt else spec.v_fmt,
    )  # fmt: skip
    timings["scales_s"] = time.perf_counter() - t

    q_scales = None
    if spec.attention_scales:
        t = time.perf_counter()
        q_scales, extra["attention_scales"] = _query_scales(lm.model, data.samples, kv.num_layers, progress)
        timings["queries_s"] = time.perf_counter() - t
    ss = _scale_set(
        lm, kv, spec.kv_format, spec.granularity, chosen, obs_name, obs_params, data, extra, q_scales=q_scales
    )
    timings["total_s"] = time.perf_counter() - t0
    _record_observation(ss.manifest["calibration"], spec, lm, timings["total_s"])
    if (
        spec.output is not None and dist.is_main
    ):  # one writer: rank 0 (every rank holds the same merged scales)
        save_scale_file(spec.output, ss)
    parallel.finish(dist)  # every rank waits for rank 0's write, then leaves the process group in order
    return CalibrationResult(
        scale_set=ss, output=spec.output, samples=data, warnings=list(data.warnings), timings=timings
    )


def _observe(
    spec: CalibrateSpec,
    lm: LoadedModel,
    kv: KVSpec,
    data: CalibrationSamples,
    mine: Sequence[torch.Tensor],
    dist: parallel.Dist,
    progress: ProgressFn | None,
) -> tuple[StatsCollector, dict[tuple[int, str], torch.Tensor] | None, dict[str, Any], str, dict[str, Any]]:
    """The first pass: (statistics merged over the ranks, llm-compressor's scales or None, manifest extras,
    observer name and parameters as the manifest records them)."""
    if spec.engine == "native":
        collector = StatsCollector(dist)
        spec.opts.observe(lm.model, mine, collector, kv.num_layers, progress=progress)
        all_reduce_stats(collector.stats, dist)
        return collector, None, {"engine": spec.engine}, spec.observer.name, spec.observer.params
    collector, imported, extra = _observe_llmcompressor(
        lm.model, data, kv, spec.granularity, spec.llmc_observer, progress
    )
    return collector, imported, extra, f"llmcompressor:{spec.llmc_observer}", {}


def _record_observation(
    calibration: dict[str, Any], spec: CalibrateSpec, lm: LoadedModel, wall_s: float
) -> None:
    """The manifest's calibration record of how K/V were observed: wall time, the K/V dtype observed, batching
    and placement."""
    calibration["wall_s"] = round(wall_s, 3)
    # the dtype the observed K/V had: llm-compressor observes inside its own hooks, in the model's dtype
    model_dtype = str(next(lm.model.parameters()).dtype).replace("torch.", "")
    native = spec.engine == "native" and spec.opts.kv_input_dtype is not None
    calibration["kv_input_dtype"] = spec.opts.kv_input_dtype if native else model_dtype
    if spec.opts.batch_size > 1:
        calibration["batch_size"] = spec.opts.batch_size
    if spec.placement.active:
        calibration["placement"] = spec.placement.describe()


def _check_processes(engine: str, attention_scales: bool, num_samples: int, dist: parallel.Dist) -> None:
    """What a multi-process calibration cannot do: split fewer samples than processes, or run the paths whose
    statistics are not merged across processes."""
    if not dist.active:
        return
    parallel.check_enough_work(num_samples, "calibration samples (--num-samples)", dist)
    if engine != "native":
        raise UsageError(f"--engine {engine} runs in one process; use --engine native with several processes")
    if attention_scales:
        raise UsageError("--attention-scales runs in one process; calibrate them without --num-processes")


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


def _load(
    model: str | LoadedModel,
    dtype: str,
    device: str,
    progress: ProgressFn | None,
    placement: Placement | None = None,
) -> LoadedModel:
    """`model` loaded (a LoadedModel is used as it is), reported as the 'load' phase."""
    if progress:
        progress(0, 1, "load")
    lm = loaded(model, dtype, device, placement)
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
        ObserveOptions().observe(model, data.samples, collector, kv.num_layers, progress=progress)
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
    q_scales: list[torch.Tensor] | None = None,
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
        q_scales=q_scales,
    )


def _query_scales(
    model: Any, samples: Any, num_layers: int, progress: ProgressFn | None
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(q_scale per layer, the manifest's `attention_scales` record) from the post-RoPE queries."""
    from kvcal.calibrate.queries import observe_queries

    seen = observe_queries(model, samples, num_layers, progress)
    record = {
        "q_scale": "per tensor, amax / 448 (llm-compressor static min-max, FP8 E4M3)",
        "q_amax": [float(a) for a in seen.amax],
        "prob_scale": None,  # see kvcal/calibrate/queries.py: FA3 quantizes P with a fixed 2**8 offset
    }
    return seen.scales(), record
