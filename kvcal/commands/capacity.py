"""CLI: `kvcal capacity` — bytes per token and tokens that fit, per KV format (config only, no weights loaded)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.table import Table

from kvcal.capacity import GIB, model_capacity
from kvcal.commands._app import app, console, print_json
from kvcal.formats import FORMATS


@app.command("capacity")
def capacity_cmd(
    model: str = typer.Argument(
        ..., help="HF model folder, hub id, .gguf file, or an installed real model (smollm2, gemma3-270m)."
    ),
    kv_format: list[str] | None = typer.Option(
        None,
        "--kv-format",
        "-f",
        help=f"KV format (repeatable or comma-separated; default: all). One of: {', '.join(FORMATS)}; "
        "vLLM/SGLang names (fp8, bfloat16, ...) work too.",
    ),
    skip_layers: str | None = typer.Option(
        None,
        "--skip-layers",
        help="Layers kept at 16 bits: sliding_window, full_attention, or indices 0,3,17.",
    ),
    context: int | None = typer.Option(
        None,
        "--context",
        help="Sequence length: sliding-window layers then hold min(context, window) tokens.",
    ),
    gpu_mem_gib: float | None = typer.Option(
        None, "--gpu-mem-gib", help="GPU memory for this model (GiB); adds the tokens that fit."
    ),
    weights_gib: float | None = typer.Option(
        None, "--weights-gib", help="Weights on the GPU (GiB); default: size of the checkpoint files."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output on stdout."),
) -> None:
    """Bytes per token (codes + scales, all layers), multiplier vs BF16 and tokens that fit, per KV format."""
    formats = [f.strip() for item in (kv_format or []) for f in item.split(",") if f.strip()] or None
    table = model_capacity(model, formats, skip_layers, context, gpu_mem_gib, weights_gib)
    if json_out:
        print_json(table)
        return
    _render(table)


def _render(t: dict) -> None:
    sliding = len(t["sliding_layers"])
    title = (
        f"{Path(t['model']).name}: {t['model_type']}, {t['num_layers']} layers ({sliding} sliding), "
        f"KV heads {'/'.join(map(str, t['kv_heads']))}, head_dim {'/'.join(map(str, t['head_dim']))}"
    )
    caption = []
    if t["skip_layers"]:
        caption.append(f"skipped (16-bit) layers: {','.join(map(str, t['skip_layers']))}")
    if t["context"]:
        caption.append(f"context {t['context']} tokens")
    if t["gpu_mem_bytes"] is not None:
        caption.append(
            f"GPU {t['gpu_mem_bytes'] / GIB:g} GiB - weights {t['weights_bytes'] / GIB:.3f} GiB ({t['weights_source']})"
        )
    table = Table(title=title, caption="; ".join(caption) or None, box=box.SIMPLE_HEAD)
    has_tokens = t["gpu_mem_bytes"] is not None
    headers = ["KV format", "bits", "B/token", "xBF16", "xFP8"]
    if has_tokens:
        headers.append("tokens")
        if t["context"]:
            headers.append(f"seqs@{t['context']}")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in t["formats"]:
        b = row["bytes_per_token"]
        cells = [
            row["kv_format"],
            f"{row['bits_per_element']:.3g}",
            f"{b:,.0f}" if b == int(b) else f"{b:,.1f}",
            f"{row['multiplier_vs_bf16']:.2f}x",
            f"{row['multiplier_vs_fp8']:.2f}x",
        ]
        if has_tokens:
            cells.append(f"{row['max_tokens']:,}")
            if t["context"]:
                cells.append(f"{row['max_sequences']:,}")
        table.add_row(*cells)
    console.print(table)
