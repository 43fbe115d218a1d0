"""CLI: `kvcal calibrate` — observe K/V on calibration text, write a checkpoint-bound scale file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kvcal.commands._app import app, console, err_console, print_json, warn

PHASES = {
    "load": "loading model",
    "observe": "observing K/V",
    "evaluate": "measuring scales",
    "llmcompressor": "llm-compressor oneshot",
}


class _ProgressRenderer:
    """Turns the library's progress(done, total, phase) callbacks into a Rich bar (samples/s, ETA) on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}

    def __enter__(self) -> _ProgressRenderer:
        if self.enabled:
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=err_console,
                transient=False,
            )
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, done: int, total: int, phase: str) -> None:
        if self.progress is None:
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(PHASES.get(phase, phase), total=total, rate="")
            self.started[phase] = time.perf_counter()
        elapsed = time.perf_counter() - self.started[phase]
        rate = f"{done / elapsed:.2f} samples/s" if done and elapsed > 0 and phase != "load" else ""
        self.progress.update(self.tasks[phase], completed=done, total=total, rate=rate)


@app.command("calibrate")
def calibrate_cmd(
    model: str = typer.Argument(..., help="HF model folder, hub id, .gguf file, or smollm2 / gemma3-270m."),
    kv_format: str = typer.Option(..., "--kv-format", "-f", help="fp8_e4m3 (fp8), fp8_e5m2 or nvfp4."),
    output: Path = typer.Option(..., "--output", "-o", help="Scale file to write (.safetensors)."),
    granularity: str = typer.Option("tensor", "--granularity", help="tensor (one scale per layer) or head."),
    observer: str = typer.Option("minmax", "--observer", help="minmax, percentile or mse."),
    percentile: float = typer.Option(
        99.99, "--percentile", help="Percentile of |x| for --observer percentile."
    ),
    dataset: str | None = typer.Option(
        None,
        "--dataset",
        help=".jsonl/.json/.txt/.parquet file, a folder of them, or a hub dataset id (ID@SPLIT); "
        "default: kvcal's generated corpus (no network).",
    ),
    text_field: str | None = typer.Option(None, "--text-field", help="Record field holding the text."),
    num_samples: int = typer.Option(128, "--num-samples", help="Sequences to calibrate on."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sequence (at most)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the text sampling."),
    engine: str = typer.Option(
        "native", "--engine", help="native or llmcompressor (oneshot, fp8_e4m3 only)."
    ),
    llmc_observer: str = typer.Option(
        "static_minmax",
        "--llmc-observer",
        help="llm-compressor observer for --engine llmcompressor (its default 'minmax' is a moving average "
        "that under-estimates amax).",
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable result on stdout."),
) -> None:
    """Calibrate K/V scales on a dataset and write a checkpoint-bound scale file."""
    from kvcal.calibrate.run import calibrate

    params = {"percentile": percentile} if observer == "percentile" else None
    with _ProgressRenderer(enabled=not json_out) as progress:
        result = calibrate(
            model,
            kv_format,
            granularity=granularity,
            observer=observer,
            dataset=dataset,
            num_samples=num_samples,
            seq_len=seq_len,
            seed=seed,
            engine=engine,
            output=output,
            progress=progress,
            text_field=text_field,
            dtype=dtype,
            device=device,
            observer_params=params,
            llmc_observer=llmc_observer,
        )
    for message in result.warnings:
        warn(message)
    ss = result.scale_set
    if json_out:
        print_json(
            {
                "output": str(result.output),
                "kv_format": ss.kv_format,
                "granularity": ss.granularity,
                "observer": ss.manifest["observer"],
                "engine": ss.manifest.get("engine"),
                "calibration": ss.manifest["calibration"],
                "k_scales": [k.tolist() for k in ss.k_scales],
                "v_scales": [v.tolist() for v in ss.v_scales],
                "layer_stats": ss.layer_stats,
                "timings": {k: round(v, 3) for k, v in result.timings.items()},
                "warnings": result.warnings,
            }
        )
        return
    _render(result)


def _fmt_db(x: float | None) -> str:
    return "lossless" if x is None else f"{x:.1f}"


def _render(result: Any) -> None:
    ss = result.scale_set
    cal = ss.manifest["calibration"]
    title = (
        f"{ss.kv_format} scales ({ss.granularity}, {ss.manifest['observer']['name']}) — "
        f"{cal['num_samples']} samples x <= {cal['seq_len']} tokens ({cal['num_tokens']} tokens)"
    )
    table = Table(title=title)
    for col in (
        "layer",
        "K scale",
        "K amax",
        "K clipped",
        "K SQNR dB",
        "V scale",
        "V amax",
        "V clipped",
        "V SQNR dB",
    ):
        table.add_column(col, justify="right")
    for i, st in enumerate(ss.layer_stats):
        k, v = ss.k_scales[i], ss.v_scales[i]
        table.add_row(
            str(i),
            f"{float(k.max()):.4g}" + ("*" if k.numel() > 1 else ""),
            f"{st['k_amax']:.4g}",
            f"{st['k_clipped_fraction']:.2e}",
            _fmt_db(st["k_sqnr_db"]),
            f"{float(v.max()):.4g}" + ("*" if v.numel() > 1 else ""),
            f"{st['v_amax']:.4g}",
            f"{st['v_clipped_fraction']:.2e}",
            _fmt_db(st["v_sqnr_db"]),
        )
    console.print(table)
    if ss.granularity == "head":
        console.print("* max over KV heads; `kvcal show` lists every head")
    console.print(
        f"wrote {result.output} in {result.timings['total_s']:.1f} s "
        f"(data {cal['source']}, token sha256 {cal['token_ids_sha256'][:12]}…)"
    )
