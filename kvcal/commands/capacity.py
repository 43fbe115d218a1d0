"""`kvcal capacity`: bytes per token and tokens that fit, per KV format (config only, no weights loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from kvcal.capacity import GIB
from kvcal.commands.options import JsonOpt, KvFormatsOpt, ModelArg, SkipLayersOpt
from kvcal.commands.output import console, print_json
from kvcal.formats import split_formats


def capacity_cmd(
    model: ModelArg,
    kv_format: KvFormatsOpt = None,
    skip_layers: SkipLayersOpt = None,
    context: Annotated[
        int | None,
        typer.Option(
            "--context", help="Sequence length: sliding-window layers then hold min(context, window) tokens."
        ),
    ] = None,
    gpu_mem_gib: Annotated[
        float | None,
        typer.Option("--gpu-mem-gib", help="GPU memory for this model (GiB); adds the tokens that fit."),
    ] = None,
    weights_gib: Annotated[
        float | None,
        typer.Option(
            "--weights-gib", help="Weights on the GPU (GiB); default: size of the checkpoint files."
        ),
    ] = None,
    tq_boundary_layers: Annotated[
        int,
        typer.Option(
            "--tq-boundary-layers",
            help="TurboQuant presets: first and last N layers counted in BF16 (vLLM's default 2; 0 = none).",
        ),
    ] = 2,
    prefix_serde: Annotated[
        str | None,
        typer.Option(
            "--prefix-serde",
            help="LMCache's storage tier: also report the bytes per token this LMCache serde writes to disk / a "
            "remote store (fp8, aesgcm, asym_k16_v8, turboquant_k8v4, ...), apart from the live cache's.",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Bytes per token (codes + scales, all layers), multiplier vs BF16 and tokens that fit, per KV format
    (`-f plan.json`: a `kvcal plan` file, its format per layer)."""
    from kvcal.pipeline.plan_cost import capacity_with_plans

    formats = [f for item in (kv_format or []) for f in split_formats(item)] or None
    table = capacity_with_plans(
        model, formats, skip_layers, context, gpu_mem_gib, weights_gib, tq_boundary=tq_boundary_layers,
        prefix_serde=prefix_serde,
    )  # fmt: skip
    if json_out:
        print_json(table)
        return
    console.print(_table(table))
    if table.get("storage"):
        console.print(_storage_line(table["storage"]), highlight=False)


def _storage_line(s: dict[str, Any]) -> str:
    """LMCache's storage tier, below (never inside) the live cache's table."""
    b = s["bytes_per_token"]
    emulated = "" if s["emulated"] else " (bytes only: kvcal eval does not emulate this serde)"
    return (
        f"LMCache storage tier, serde {s['serde']}: {b:,.0f} B/token, {s['bits_per_element']:.3g} bits/element, "
        f"{s['multiplier_vs_bf16']:.2f}x BF16 — on disk / a remote store, beside the live cache above{emulated}"
    )


def _title(t: dict[str, Any]) -> str:
    sliding = len(t["sliding_layers"])
    return (
        f"{Path(t['model']).name}: {t['model_type']}, {t['num_layers']} layers ({sliding} sliding), "
        f"KV heads {'/'.join(map(str, t['kv_heads']))}, head_dim {'/'.join(map(str, t['head_dim']))}"
    )


def _caption(t: dict[str, Any]) -> str | None:
    parts = []
    if t["skip_layers"]:
        parts.append(f"skipped (16-bit) layers: {','.join(map(str, t['skip_layers']))}")
    if t["context"]:
        parts.append(f"context {t['context']} tokens")
    if t["gpu_mem_bytes"] is not None:
        parts.append(
            f"GPU {t['gpu_mem_bytes'] / GIB:g} GiB - weights {t['weights_bytes'] / GIB:.3f} GiB ({t['weights_source']})"
        )
    return "; ".join(parts) or None


def _row(t: dict[str, Any], row: dict[str, Any]) -> list[str]:
    b = row["bytes_per_token"]
    cells = [
        row["kv_format"],
        f"{row['bits_per_element']:.3g}",
        f"{b:,.0f}" if b == int(b) else f"{b:,.1f}",
        f"{row['multiplier_vs_bf16']:.2f}x",
        f"{row['multiplier_vs_fp8']:.2f}x",
    ]
    if t["gpu_mem_bytes"] is not None:
        cells.append(f"{row['max_tokens']:,}")
        if t["context"]:
            cells.append(f"{row['max_sequences']:,}")
    return cells


def _table(t: dict[str, Any]) -> Table:
    table = Table(title=_title(t), caption=_caption(t), box=box.SIMPLE_HEAD)
    headers = ["KV format", "bits", "B/token", "xBF16", "xFP8"]
    if t["gpu_mem_bytes"] is not None:  # tokens (and sequences) that fit
        headers.append("tokens")
        if t["context"]:
            headers.append(f"seqs@{t['context']}")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in t["formats"]:
        table.add_row(*_row(t, row))
    return table
