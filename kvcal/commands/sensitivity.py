"""CLI: `kvcal sensitivity` — per-layer damage of a KV format (KL vs the untouched cache) and skip-layer advice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from kvcal.commands._app import app, console, print_json, warn
from kvcal.commands.calibrate import _ProgressRenderer


@app.command("sensitivity")
def sensitivity_cmd(
    model: str = typer.Argument(..., help="HF model folder, hub id, .gguf file, or smollm2 / gemma3-270m."),
    kv_format: str = typer.Option(
        ..., "--kv-format", "-f", help="Any KV format (fp8, nvfp4, fp4_e2m1, ...)."
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the report as JSON here."),
    scales: str | None = typer.Option(
        None, "--scales", help="Scale file for fp8/nvfp4; default: minmax per tensor on the same samples."
    ),
    dataset: str | None = typer.Option(None, "--dataset", help="Text to measure on (as for calibrate)."),
    text_field: str | None = typer.Option(None, "--text-field", help="Record field holding the text."),
    num_samples: int = typer.Option(8, "--num-samples", help="Sequences."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per sequence (at most)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the text sampling."),
    factor: float = typer.Option(2.0, "--factor", help="Flag layers whose damage exceeds this x the median."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
) -> None:
    """Quantize one layer's KV cache at a time; report each layer's KL damage and which layers to skip."""
    from kvcal.pipeline.sensitivity import sensitivity

    with _ProgressRenderer(enabled=not json_out) as progress:
        report = sensitivity(
            model, kv_format, scales=scales, dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed,
            output=str(output) if output else None, progress=progress, text_field=text_field, dtype=dtype,
            device=device, factor=factor,
        )  # fmt: skip
    for message in report["warnings"]:
        warn(message)
    if json_out:
        print_json(report)
        return
    _render(report, output)


def _render(r: dict[str, Any], output: Path | None) -> None:
    table = Table(title=f"{r['model']} — {r['kv_format']} KV, one layer at a time ({r['scales']})")
    for col in ("layer", "type", "KL nats", "top-1 agree"):
        table.add_column(col, justify="right")
    worst = set(r["worst"][:3])
    for row in r["layers"]:
        mark = " ◀" if row["layer"] in worst else ""
        table.add_row(str(row["layer"]), row["type"], f"{row['kl']:.3g}{mark}", f"{row['top1_agree']:.3f}")
    table.add_row("all", "", f"{r['all_layers']['kl']:.3g}", f"{r['all_layers']['top1_agree']:.3f}")
    console.print(table)
    advice = r["advice"]
    console.print(
        f"suggested --skip-layers: {advice['skip_layers'] or 'none'} ({'; '.join(advice['reasons'])})"
    )
    if output:
        console.print(f"wrote {output}")
