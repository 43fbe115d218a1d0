"""`kvcal calibrate`: observe K/V on calibration text, write a checkpoint-bound scale file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal.calibrate.run import CalibrateConfig
from kvcal.commands.options import (
    DatasetOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvFormatOpt,
    KvInputDtypeOpt,
    MaxMemoryOpt,
    ModelArg,
    NumProcessesOpt,
    NumSamplesOpt,
    ObserveBatchOpt,
    OffloadFolderOpt,
    SeedOpt,
    SeqLenOpt,
    TextFieldOpt,
    config_from_options,
    output_option,
)
from kvcal.commands.output import console, emit_result
from kvcal.commands.progress import run_with_progress

# Options that are not fields of kvcal.calibrate.run.CalibrateConfig (its keyword callers pass observer_params).
CLI_ONLY = ("json_out", "num_processes")
FIELDS_WITHOUT_OPTION = ("observer_params",)
DEFAULT_PERCENTILE = 99.99  # the percentile observer's own default (kvcal.calibrate.observers)


def calibrate_cmd(
    ctx: typer.Context,
    model: ModelArg,
    kv_format: KvFormatOpt,
    output: Annotated[Path, output_option("Scale file to write (.safetensors).")],
    granularity: Annotated[
        str, typer.Option("--granularity", help="tensor (one scale per layer) or head.")
    ] = "tensor",
    observer: Annotated[str, typer.Option("--observer", help="minmax, percentile or mse.")] = "minmax",
    percentile: Annotated[
        float | None,
        typer.Option(
            "--percentile",
            help=f"Percentile of |x| for --observer percentile (default {DEFAULT_PERCENTILE}).",
        ),
    ] = None,
    dataset: DatasetOpt = None,
    text_field: TextFieldOpt = None,
    num_samples: NumSamplesOpt = 128,
    seq_len: SeqLenOpt = 512,
    seed: SeedOpt = 0,
    engine: Annotated[
        str, typer.Option("--engine", help="native or llmcompressor (oneshot, fp8_e4m3 only).")
    ] = "native",
    llmc_observer: Annotated[
        str,
        typer.Option(
            "--llmc-observer",
            help="llm-compressor observer for --engine llmcompressor (its default 'minmax' is a moving "
            "average that under-estimates amax).",
        ),
    ] = "static_minmax",
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
    batch_size: ObserveBatchOpt = 1,
    kv_input_dtype: KvInputDtypeOpt = "bfloat16",  # the library's default is None (as the model computes K/V)
    attention_scales: Annotated[
        bool,
        typer.Option(
            "--attention-scales",
            help="Also observe the post-RoPE queries and store q_scale per layer (amax / 448), for "
            "`kvcal eval --attention fp8` and vLLM's FP8 attention (FlashAttention-3).",
        ),
    ] = False,
    num_processes: NumProcessesOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """Calibrate K/V scales on a dataset and write a checkpoint-bound scale file."""
    options = {k: v for k, v in locals().items() if k != "ctx"}  # first: exactly the options (ctx: Typer's)
    from kvcal.commands.launch import is_main_process, run_in_processes

    if num_processes != 1:
        run_in_processes(ctx, num_processes, {"calibration samples (--num-samples)": num_samples})
    from kvcal.calibrate.run import calibrate_spec, run_calibration

    config = config_from_options(CalibrateConfig, options, cli_only=CLI_ONLY, no_option=FIELDS_WITHOUT_OPTION)
    spec = calibrate_spec(config)  # parsed and checked once, before the model loads
    result = run_with_progress(run_calibration, spec, enabled=not json_out and is_main_process())
    if not is_main_process():
        return  # rank 0 wrote the scale file and renders it
    if not emit_result(result, json_out, result.warnings, _json):
        _render(result)


def _json(result: Any) -> dict[str, Any]:
    ss = result.scale_set
    return {
        "output": str(result.output),
        "kv_format": ss.kv_format,
        "granularity": ss.granularity,
        "observer": ss.manifest["observer"],
        "engine": ss.manifest.get("engine"),
        "calibration": ss.manifest["calibration"],
        "k_scales": [k.tolist() for k in ss.k_scales],
        "v_scales": [v.tolist() for v in ss.v_scales],
        "q_scales": None if ss.q_scales is None else [q.tolist() for q in ss.q_scales],
        "layer_stats": ss.layer_stats,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "warnings": result.warnings,
    }


def _fmt_db(x: float | None) -> str:
    return "lossless" if x is None else f"{x:.1f}"


def _fmt_scale(t: Any) -> str:
    """The scale (max over heads, starred, for per-head scales)."""
    return f"{float(t.max()):.4g}" + ("*" if t.numel() > 1 else "")


_COLUMNS = (
    "layer",
    "K scale",
    "K amax",
    "K clipped",
    "K SQNR dB",
    "V scale",
    "V amax",
    "V clipped",
    "V SQNR dB",
)


def _table(ss: Any) -> Table:
    cal = ss.manifest["calibration"]
    table = Table(
        title=f"{ss.kv_format} scales ({ss.granularity}, {ss.manifest['observer']['name']}) — "
        f"{cal['num_samples']} samples x <= {cal['seq_len']} tokens ({cal['num_tokens']} tokens)"
    )
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    for i, st in enumerate(ss.layer_stats):
        cells = [str(i)]
        for kv, scale in (("k", ss.k_scales[i]), ("v", ss.v_scales[i])):
            cells += [
                _fmt_scale(scale),
                f"{st[f'{kv}_amax']:.4g}",
                f"{st[f'{kv}_clipped_fraction']:.2e}",
                _fmt_db(st[f"{kv}_sqnr_db"]),
            ]
        table.add_row(*cells)
    return table


def _render(result: Any) -> None:
    ss = result.scale_set
    cal = ss.manifest["calibration"]
    console.print(_table(ss))
    if ss.granularity == "head":
        console.print("* max over KV heads; `kvcal show` lists every head")
    console.print(
        f"wrote {result.output} in {result.timings['total_s']:.1f} s "
        f"(data {cal['source']}, token sha256 {cal['token_ids_sha256'][:12]}…)"
    )
