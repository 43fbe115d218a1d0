"""`kvcal drift`: does a calibrated scale file still fit a sample of the traffic? Exit 0 fits, 1 drifted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal.calibrate.drift import (
    DEFAULT_MAX_CLIP,
    DEFAULT_MAX_SQNR_LOSS_DB,
    DRIFTED,
    DriftConfig,
    DriftReport,
)
from kvcal.commands.options import (
    DatasetOpt,
    DeviceOpt,
    JsonOpt,
    ManifestDtypeOpt,
    ManifestSeqLenOpt,
    ModelArg,
    NumSamplesOpt,
    ObserveBatchOpt,
    SeedOpt,
    TextFieldOpt,
    config_from_options,
)
from kvcal.commands.output import console, emit_result, err_console
from kvcal.commands.progress import run_with_progress

CLI_ONLY = ("json_out",)


def drift_cmd(
    scales: Annotated[
        Path, typer.Argument(help="Scale file (.safetensors) from `kvcal calibrate`.", show_default=False)
    ],
    model: ModelArg,
    dataset: DatasetOpt = None,
    text_field: TextFieldOpt = None,
    num_samples: NumSamplesOpt = 32,
    seq_len: ManifestSeqLenOpt = None,
    seed: SeedOpt = 0,
    max_clip: Annotated[
        float,
        typer.Option(
            "--max-clip",
            help="Drifted when the current scales saturate more than this fraction of any scale group's "
            "elements beyond what fresh scales of the file's observer saturate on the traffic (minmax: none).",
        ),
    ] = DEFAULT_MAX_CLIP,
    max_sqnr_loss_db: Annotated[
        float,
        typer.Option(
            "--max-sqnr-loss-db",
            help="Drifted when any scale group's SQNR with the current scales is this many dB below its SQNR "
            "with fresh scales (the file's observer) on the traffic.",
        ),
    ] = DEFAULT_MAX_SQNR_LOSS_DB,
    force: Annotated[
        bool, typer.Option("--force", help="Check a scale file calibrated on another checkpoint anyway.")
    ] = False,
    dtype: ManifestDtypeOpt = None,
    kv_input_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-input-dtype",
            help="Default and only accepted value: the scale file's (manifest calibration.kv_input_dtype); "
            "K/V are rounded to it before they are measured, as calibrate measured them.",
        ),
    ] = None,
    batch_size: ObserveBatchOpt = 1,
    device: DeviceOpt = "cpu",
    json_out: JsonOpt = False,
) -> None:
    """Check a scale file against a traffic sample (--dataset): clip fractions and SQNR vs fresh scales, per layer.

    K/V are observed through calibrate's own path, as the scale file's manifest says the calibration observed them (K/V input dtype, model dtype, sequence length, sampling, BOS rule): the calibration text itself fits, clipping nothing beyond what fresh scales of the file's observer clip.

    Exit 0: the scales fit the traffic; 1: drifted (recalibrate on the traffic); 2: bad input."""
    options = dict(locals())  # first: exactly the command's options
    from kvcal.calibrate.drift import drift_spec, run_drift

    spec = drift_spec(config_from_options(DriftConfig, options, cli_only=CLI_ONLY))  # before the model loads
    report = run_with_progress(run_drift, spec, enabled=not json_out)
    if not emit_result(report, json_out, report.warnings, DriftReport.to_dict):
        _render(report)
    if report.verdict == DRIFTED:
        sys.exit(1)


def _db(x: float | None) -> str:
    return "lossless" if x is None else f"{x:.1f}"


# per kind: traffic amax / calibrated amax, saturated fraction, SQNR current / fresh (dB)
_COLUMNS = ("layer", "K amax/calib", "K clipped", "K SQNR/fresh", "V amax/calib", "V clipped", "V SQNR/fresh")


def _cells(rec: dict[str, Any]) -> list[str]:
    cells: list[str] = []
    for k in ("k", "v"):
        cells += [
            f"{rec[f'{k}_amax']:.3g}/{rec[f'{k}_calibrated_amax']:.3g}",
            f"{rec[f'{k}_clip_fraction']:.1e}",
            f"{_db(rec[f'{k}_sqnr_db'])}/{_db(rec[f'{k}_sqnr_fresh_db'])}",
        ]
    return cells


def _table(report: Any) -> Table:
    t = report.traffic
    table = Table(
        title=f"{report.kv_format} scales ({report.granularity}) on {t['num_samples']} traffic samples x <= "
        f"{t['seq_len']} tokens ({t['num_tokens']} tokens)"
    )
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    for rec in report.layers:
        table.add_row(str(rec["layer"]), *_cells(rec))
        for h in rec.get("heads", []):
            table.add_row(f"  head {h['head']}", *_cells(h))
    return table


def _render(report: Any) -> None:
    console.print(_table(report))
    console.print(
        "amax/calib: the traffic's amax / the calibration data's; clipped: fraction of elements above the "
        "calibrated clip (saturated); SQNR/fresh: dB with the current scales / with fresh scales (the file's observer) on the "
        "traffic",
        highlight=False,
    )
    w = report.worst()
    loss = "n/a" if w["sqnr_loss_db"] is None else f"{w['sqnr_loss_db']:.2f} dB"
    line = (
        f"{report.verdict}: worst clip fraction {w['clip_fraction']:.2e} (layer {w['clip_layer']} "
        f"{w['clip_kind'].upper()}), worst SQNR loss {loss} — thresholds --max-clip {report.max_clip:g}, "
        f"--max-sqnr-loss-db {report.max_sqnr_loss_db:g}"
    )
    if report.verdict == DRIFTED:
        err_console.print(line, style="red", highlight=False, markup=False)
        err_console.print("\n".join(f"  {r}" for r in report.reasons[:20]), highlight=False, markup=False)
        if len(report.reasons) > 20:
            err_console.print(
                f"  ... and {len(report.reasons) - 20} more (--json lists all)", highlight=False
            )
        err_console.print(
            f"Recalibrate on the traffic: kvcal calibrate MODEL --kv-format {report.kv_format} "
            f"--granularity {report.granularity} --dataset TRAFFIC -o NEW.safetensors",
            highlight=False,
            markup=False,
        )
    else:
        console.print(line, style="green", highlight=False, markup=False)
