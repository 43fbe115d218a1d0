"""`kvcal show`, `kvcal verify`, `kvcal export`: scale files. Parse, call kvcal.scales / kvcal.calibrate.export,
render."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal.commands.options import JsonOpt, ModelArg, output_option
from kvcal.commands.output import console, print_json, warn
from kvcal.errors import KvcalError, UsageError

ScaleFileArg = Annotated[
    Path, typer.Argument(help="Scale file (.safetensors) written by `kvcal calibrate`.", show_default=False)
]


def _fmt_scale(t: Any) -> str:
    vals = t.reshape(-1).tolist()
    if len(vals) == 1:
        return f"{vals[0]:.4g}"
    return f"{min(vals):.4g}–{max(vals):.4g}"


def _fmt_stat(x: Any, fmt: Callable[[float], str]) -> str:
    """A statistic for the table: one value, or the max of a per-group list (None entries skipped); — if none."""
    if x is None:
        return "—"
    if isinstance(x, list):
        vals = [v for v in x if v is not None]
        return f"{fmt(max(vals))} (max)" if vals else "—"
    return fmt(x)


def _fmt_num(x: Any, spec: str = ".4g") -> str:
    return _fmt_stat(x, lambda v: f"{v:{spec}}")


def _fmt_pct(x: Any) -> str:
    return _fmt_stat(x, lambda v: f"{100 * v:.3g}%")


def _short(h: Any) -> str:
    return str(h)[:12] if h else "—"


# ---- show ----------------------------------------------------------------------------------------------------


def show_cmd(scales: ScaleFileArg, json_out: JsonOpt = False) -> None:
    """Show a scale file's manifest and every scale it holds per layer (K, V and, where calibrated for FP8
    attention, Q) with its statistics."""
    from kvcal.scales import load_scale_file

    ss = load_scale_file(scales)
    if json_out:
        print_json(
            {
                "file": str(scales),
                "kv_format": ss.kv_format,
                "granularity": ss.granularity,
                "num_layers": ss.num_layers,
                "k_scales": [t.tolist() for t in ss.k_scales],
                "v_scales": [t.tolist() for t in ss.v_scales],
                "q_scales": None if ss.q_scales is None else [t.tolist() for t in ss.q_scales],
                "manifest": ss.manifest,
            }
        )
        return
    for line in _show_header(scales, ss):
        console.print(line, highlight=False)
    console.print(_show_table(ss))


def _show_header(scales: Path, ss: Any) -> list[str]:
    """File, format/observer, bound checkpoint and calibration data: one line each."""
    m, b = ss.manifest, ss.binding
    cal = m.get("calibration", {})
    obs = m.get("observer", {})
    params = ", ".join(f"{k}={v}" for k, v in (obs.get("params") or {}).items())
    lines = [
        f"[bold]{scales}[/bold]  (kvcal {m.get('kvcal_version')}, {m.get('created')})",
        f"format [bold]{ss.kv_format}[/bold], granularity {ss.granularity}, observer {obs.get('name')}"
        + (f" ({params})" if params else "")
        + (f", engine {m['engine']}" if m.get("engine") else ""),
        f"model {b.get('model')} ({b.get('model_type')}): {b.get('num_layers')} layers, "
        f"{b.get('num_kv_heads')} KV heads, head_dim {b.get('head_dim')}; config {_short(b.get('config_sha256'))}, "
        f"tokenizer {_short(b.get('tokenizer_sha256'))}, weights {_short(b.get('weights_sha256'))} "
        f"({len(b.get('weight_files') or {})} files)",
    ]
    if cal:
        lines.append(
            f"calibration: {cal.get('source', '—')}, {cal.get('num_samples', '—')} samples x "
            f"{cal.get('seq_len', '—')} tokens, seed {cal.get('seed', '—')}, "
            f"token ids {_short(cal.get('token_ids_sha256'))}"
        )
    return lines


_SHOW_COLUMNS = (
    "layer",
    "type",
    "K scale",
    "V scale",
    "K amax",
    "V amax",
    "K clip",
    "V clip",
    "K SQNR dB",
    "V SQNR dB",
)


def _show_table(ss: Any) -> Table:
    stats = {s.get("layer", i): s for i, s in enumerate(ss.layer_stats)}
    types = ss.binding.get("layer_types") or []
    table = Table(show_edge=False, header_style="bold")
    # the query's FP8 scale (schema 2, `calibrate --attention-scales`) beside K and V when the file holds one
    columns = _SHOW_COLUMNS if ss.q_scales is None else (*_SHOW_COLUMNS[:4], "Q scale", *_SHOW_COLUMNS[4:])
    for col in columns:
        table.add_column(col, justify="left" if col == "type" else "right")
    for i in range(ss.num_layers):
        s = stats.get(i, {})
        ltype = types[i] if i < len(types) else "—"
        q = [] if ss.q_scales is None else [_fmt_scale(ss.q_scales[i])]
        table.add_row(
            str(i),
            ltype.replace("_attention", ""),
            _fmt_scale(ss.k_scales[i]),
            _fmt_scale(ss.v_scales[i]),
            *q,
            _fmt_num(s.get("k_amax")),
            _fmt_num(s.get("v_amax")),
            _fmt_pct(s.get("k_clipped_fraction")),
            _fmt_pct(s.get("v_clipped_fraction")),
            _fmt_num(s.get("k_sqnr_db"), ".1f"),
            _fmt_num(s.get("v_sqnr_db"), ".1f"),
        )
    return table


# ---- verify --------------------------------------------------------------------------------------------------


def verify_cmd(scales: ScaleFileArg, model: ModelArg, json_out: JsonOpt = False) -> None:
    """Check that a scale file is bound to this checkpoint (exit 0) or stale (exit 1)."""
    from kvcal.scales import binding_differences, load_scale_file, resolve_model_and_spec

    ss = load_scale_file(scales)
    model_dir, kv = resolve_model_and_spec(model)
    diffs = binding_differences(ss, model, model_dir, kv)
    if json_out:
        print_json({"scales": str(scales), "model": model, "bound": not diffs, "differences": diffs})
        if diffs:
            raise typer.Exit(1)
        return
    if diffs:
        raise KvcalError(
            f"scale file '{scales}' is stale for '{model}': {'; '.join(diffs)}; "
            "re-run `kvcal calibrate` on this checkpoint"
        )
    console.print(
        f"bound: {scales} matches {model} (config.json, tokenizer, {len(ss.binding.get('weight_files') or {})} "
        f"weight file(s), {ss.num_layers} layers)",
        highlight=False,
    )


# ---- export --------------------------------------------------------------------------------------------------


def export_cmd(
    scales: ScaleFileArg,
    model: ModelArg,
    to: Annotated[
        str, typer.Option("--to", help="Target engine: vllm (checkpoint folder) or sglang (JSON file).")
    ],
    output: Annotated[Path, output_option("vllm: new folder; sglang: JSON file.")],
    force: Annotated[
        bool, typer.Option("--force", help="Export even if the scales are bound to another checkpoint.")
    ] = False,
    tp_size: Annotated[
        int, typer.Option("--tp-size", help="sglang: tensor-parallel size the JSON is written for.")
    ] = 1,
    reduce_heads: Annotated[
        bool,
        typer.Option(
            "--reduce-heads", help="sglang: reduce per-head scales to one per layer (max over heads)."
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Export scales as a vLLM checkpoint folder or an SGLang scale JSON (FP8 E4M3)."""
    from kvcal.calibrate.export import export_sglang, export_vllm
    from kvcal.io import output_problem
    from kvcal.scales import load_scales_for_model, resolve_model_and_spec

    engine = to.strip().lower()
    if engine not in ("vllm", "sglang"):
        raise UsageError(f"unknown export target '{to}'; use --to vllm or --to sglang")
    if tp_size < 1:
        raise UsageError(f"--tp-size must be at least 1, got {tp_size}")
    if engine == "vllm" and (tp_size != 1 or reduce_heads):
        given = "--tp-size" if tp_size != 1 else "--reduce-heads"
        raise UsageError(
            f"{given} shapes SGLang's JSON; vLLM's checkpoint export holds the scales as calibrated (vLLM splits "
            f"them across ranks itself): drop {given}, or export --to sglang"
        )
    if (problem := output_problem(output, "-o", folder=engine == "vllm")) is not None:
        raise UsageError(problem)
    model_dir, kv = resolve_model_and_spec(model)
    ss = load_scales_for_model(scales, model, model_dir, kv, force=force)
    for w in ss.binding_warnings:
        warn(w)
    if engine == "vllm":
        summary = export_vllm(ss, model_dir, output)
    else:
        summary = export_sglang(ss, model_dir, output, tp_size=tp_size, reduce_heads=reduce_heads)
        if ss.granularity == "head":
            warn("per-head scales reduced to one per layer (max over heads) for SGLang")
    summary["binding_warnings"] = ss.binding_warnings
    if json_out:
        print_json(summary)
        return
    _render_export(engine, output, summary)


def _render_export(engine: str, output: Path, summary: dict[str, Any]) -> None:
    if engine == "vllm":
        console.print(
            f"wrote {output}: {summary['num_layers']} layers of {summary['strategy']} FP8 scales in "
            f"{summary['scale_shard']}; {summary['files_linked']} file(s) hard-linked (do not edit them in "
            f"place), {summary['files_copied']} copied",
            highlight=False,
        )
    else:
        console.print(
            f"wrote {output}: {summary['num_layers']} layers x {summary['tp_size']} TP rank(s), one scale per "
            "layer = max(k_scale, v_scale)",
            highlight=False,
        )
    for note in summary.get("notes", []):
        console.print(f"note: {note}", highlight=False)
    console.print(f"serve: {summary['serve']}", highlight=False)
