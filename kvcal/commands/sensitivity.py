"""`kvcal sensitivity`: per-layer damage of a KV format (KL vs the untouched cache) and skip-layer advice."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal.commands.options import (
    DatasetOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvFormatOpt,
    MaxMemoryOpt,
    ModelArg,
    NumSamplesOpt,
    ObserveBatchOpt,
    OffloadFolderOpt,
    SeedOpt,
    SeqLenOpt,
    TextFieldOpt,
    config_from_options,
    output_option,
    scales_option,
)
from kvcal.commands.output import console, emit_result
from kvcal.commands.progress import run_with_progress
from kvcal.pipeline.sensitivity import SensitivityConfig

CLI_ONLY = ("json_out",)


def sensitivity_cmd(
    model: ModelArg,
    kv_format: KvFormatOpt,
    output: Annotated[Path | None, output_option("Write the report as JSON here.")] = None,
    scales: Annotated[
        str | None,
        scales_option(
            "Scale file for fp8/nvfp4, or 'minmax' (per tensor on the same samples); default: scale 1.0, "
            "as `kvcal eval` and vLLM without scales."
        ),
    ] = None,
    dataset: DatasetOpt = None,
    text_field: TextFieldOpt = None,
    num_samples: NumSamplesOpt = 8,
    seq_len: SeqLenOpt = 256,
    seed: SeedOpt = 0,
    factor: Annotated[
        float, typer.Option("--factor", help="Flag layers whose damage exceeds this x the median.")
    ] = 2.0,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
    batch_size: ObserveBatchOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """Quantize one layer's KV cache at a time; report each layer's KL damage and which layers to skip."""
    options = dict(locals())  # first: exactly the command's options
    from kvcal.pipeline.sensitivity import run_sensitivity, sensitivity_spec

    spec = sensitivity_spec(config_from_options(SensitivityConfig, options, cli_only=CLI_ONLY))
    report = run_with_progress(run_sensitivity, spec, enabled=not json_out)
    if not emit_result(report, json_out, report["warnings"]):
        _render(report, output)


def _table(r: dict[str, Any]) -> Table:
    table = Table(title=f"{r['model']} — {r['kv_format']} KV, one layer at a time ({r['scales']})")
    for col in ("layer", "type", "KL nats", "top-1 agree"):
        table.add_column(col, justify="right")
    keep = set(r["advice"]["layers"])  # exactly the layers the suggested --skip-layers keeps in BF16
    for row in r["layers"]:
        mark = " ◀" if row["layer"] in keep else ""
        table.add_row(str(row["layer"]), row["type"], f"{row['kl']:.3g}{mark}", f"{row['top1_agree']:.3f}")
    table.add_row("all", "", f"{r['all_layers']['kl']:.3g}", f"{r['all_layers']['top1_agree']:.3f}")
    return table


def _render(r: dict[str, Any], output: Path | None) -> None:
    console.print(_table(r))
    advice = r["advice"]
    console.print(
        f"suggested --skip-layers: {advice['skip_layers'] or 'none'} ({'; '.join(advice['reasons'])}); "
        f"◀ marks the layers it keeps in BF16; scales: {r['scales']}",
        highlight=False,
    )
    if output:
        console.print(f"wrote {output}")
