"""`kvcal plan`: one KV format per layer for a capacity budget (solved exactly, measured jointly), and
`kvcal plan-export`: a plan file in the form an engine reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from kvcal.commands.options import (
    DatasetOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    NumSamplesOpt,
    ObserveBatchOpt,
    SeedOpt,
    SeqLenOpt,
    TextFieldOpt,
    config_from_options,
    output_option,
)
from kvcal.commands.output import console, emit_result, print_json
from kvcal.commands.progress import run_with_progress
from kvcal.pipeline.plan import DEFAULT_CANDIDATES, PlanConfig

CLI_ONLY = ("json_out",)


# `kvcal plan`'s option help, by option (the shared options' are in kvcal.commands.options).
_HELP = {
    "candidates": "Formats a layer may take, comma-separated; k=A,v=B pairs allowed.",
    "capacity": "Budget: at least this many x BF16's tokens, e.g. 3.0x.",
    "effective_bits": "Budget instead: mean storage bits per K/V element (ModelOpt's).",
    "context": "Sequence length of the budget: sliding layers hold min(context, window).",
    "scales": "Scale file of a candidate format (repeat per format); default: minmax.",
    "heldout_windows": "Held-out windows the chosen plan is measured on.",
    "heldout_seq_len": "Tokens per held-out window.",
    "data_dir": "Offline data (WikiText-2 test is the held-out text).",
    "frontier": "Also solve 1.0x, 1.0x+step, ...: the Pareto table.",
    "frontier_step": "Capacity step of --frontier.",
    "refine": "Rounds of re-solving with measured in-context layer costs (0: off).",
    "compare_uniform": "Also measure every one-format configuration of the candidates.",
    "checkpoint": "Damage file (ModelOpt auto_quantize's checkpoint): reused when it exists, written when not.",
}


def plan_cmd(
    model: ModelArg,
    candidates: Annotated[str, typer.Option("--candidates", help=_HELP["candidates"])] = DEFAULT_CANDIDATES,
    capacity: Annotated[str | None, typer.Option("--capacity", help=_HELP["capacity"])] = None,
    effective_bits: Annotated[float | None, typer.Option("--effective-bits", help=_HELP["effective_bits"])] = None,
    context: Annotated[int | None, typer.Option("--context", help=_HELP["context"])] = None,
    scales: Annotated[list[str] | None, typer.Option("--scales", help=_HELP["scales"])] = None,
    dataset: DatasetOpt = None,
    text_field: TextFieldOpt = None,
    num_samples: NumSamplesOpt = 16,
    seq_len: SeqLenOpt = 512,
    seed: SeedOpt = 0,
    heldout_windows: Annotated[int, typer.Option("--heldout-windows", help=_HELP["heldout_windows"])] = 16,
    heldout_seq_len: Annotated[int, typer.Option("--heldout-seq-len", help=_HELP["heldout_seq_len"])] = 512,
    data_dir: Annotated[str | None, typer.Option("--data-dir", help=_HELP["data_dir"])] = None,
    frontier: Annotated[bool, typer.Option("--frontier", help=_HELP["frontier"])] = False,
    frontier_step: Annotated[float, typer.Option("--frontier-step", help=_HELP["frontier_step"])] = 0.25,
    refine: Annotated[int, typer.Option("--refine", help=_HELP["refine"])] = 0,
    compare_uniform: Annotated[bool, typer.Option("--compare-uniform", help=_HELP["compare_uniform"])] = False,
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help=_HELP["checkpoint"])] = None,
    output: Annotated[Path | None, output_option("Write the plan file (JSON) here.")] = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    batch_size: ObserveBatchOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """Choose a KV format per layer that loses least for a capacity budget; measure it; print engine commands."""
    options = dict(locals())  # first: exactly the command's options
    from kvcal.pipeline.plan import plan_spec, run_plan

    spec = plan_spec(config_from_options(PlanConfig, options, cli_only=CLI_ONLY))  # before the model loads
    report = run_with_progress(run_plan, spec, enabled=not json_out)
    if not emit_result(report, json_out, report["warnings"]):
        _render(report)


def _fmt_interval(m: dict[str, Any]) -> str:
    kl = m["kl"]
    if kl["lo"] is None:
        return f"{kl['mean']:.4g}"
    return f"{kl['mean']:.4g} [{kl['lo']:.4g}, {kl['hi']:.4g}]"


def _render(r: dict[str, Any]) -> None:
    from kvcal.pipeline.plan_export import layer_runs  # (kvcal.formats imports torch: not at CLI start)

    b = r["budget"]
    what = f"{b['value']:g}x BF16" if b["kind"] == "capacity" else f"{b['value']:g} effective bits"
    at = f" at context {b['context']}" if b["context"] else ""
    console.print(f"[bold]{r['model']}[/bold]: plan for {what}{at}")
    console.print(f"layers: {layer_runs(r['layers'])}")
    cap = r["capacity"]
    console.print(
        f"capacity {cap['multiplier_vs_bf16']:.3f}x BF16 ({cap['bytes_per_token']:,.1f} B/token, "
        f"{cap['bits_per_element']:.3g} bits/element)"
    )
    console.print(
        f"KL nats/token: estimated (sum of one-layer damage) {r['estimated_kl']:.4g}; measured jointly on "
        f"{r['heldout']['windows']} held-out windows of {r['heldout']['seq_len']} ({r['heldout']['source']}) "
        f"{_fmt_interval(r['measured'])}, top-1 agree {r['measured']['top1_agree']:.4f}"
    )
    for row in r["refine_rounds"]:
        console.print(f"refine round {row['round']}: " + (
            f"measured {row['measured_kl']:.4g} ({'kept' if row.get('kept') else 'not better, stopped'})"
            if row["changed"] else "no change"
        ))  # fmt: skip
    g = r["uniform_guard"]
    others = {k: v for k, v in g["calibration_kl"].items() if k != "plan"}
    if others:
        best = min(others, key=others.__getitem__)
        console.print(
            f"uniform guard (joint KL on the calibration samples): solved plan {g['calibration_kl']['plan']:.4g}, "
            f"best uniform meeting the budget {best} {others[best]:.4g} -> "
            + ("kept the solved plan" if g["chosen"] == "plan" else f"took {g['chosen']}")
        )
    if r.get("frontier"):
        table = Table(
            title="Pareto frontier (estimated KL; measured with --compare-uniform)", box=box.SIMPLE_HEAD
        )
        for col in ("target", "xBF16", "est. KL", "measured KL", "layers"):
            table.add_column(col, justify="left" if col == "layers" else "right")
        for row in r["frontier"]:
            table.add_row(
                f"{row['target']:g}x",
                f"{row['capacity']:.3f}",
                f"{row['estimated_kl']:.4g}",
                _fmt_interval(row["measured"]) if "measured" in row else "-",
                layer_runs(row["layers"]),
            )
        console.print(table)
    if r.get("uniform"):
        table = Table(title="uniform configurations, same held-out windows", box=box.SIMPLE_HEAD)
        for col in ("config", "xBF16", "meets", "KL [95% CI]", "plan - uniform [95% CI]"):
            table.add_column(col, justify="left" if col == "config" else "right")
        for row in r["uniform"]:
            d = row["plan_minus_uniform"]
            diff = (
                f"{d['mean']:.3g}" if d["lo"] is None else f"{d['mean']:.3g} [{d['lo']:.3g}, {d['hi']:.3g}]"
            )
            table.add_row(
                row["config"], f"{row['capacity']['multiplier_vs_bf16']:.3f}", "yes" if row["meets_budget"] else "no",
                _fmt_interval(row["measured"]), diff,
            )  # fmt: skip
        console.print(table)
    for engine, e in r["engines"].items():
        console.print(
            f"{engine}: {e['command']}" if "command" in e else f"{engine}: not expressible — {e['refused']}"
        )
    if r.get("plan_file"):
        console.print(f"wrote {r['plan_file']}")


def plan_export_cmd(
    plan_file: Annotated[Path, typer.Argument(help="A plan file from `kvcal plan -o`.", show_default=False)],
    engine: Annotated[str, typer.Option("--engine", help="vllm-modelopt, vllm-skip-layers or trtllm.")],
    output: Annotated[
        Path | None,
        output_option(
            "vllm-modelopt: write CHECKPOINT/hf_quant_config.json, or embed the map in an existing CHECKPOINT/config.json."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Check the plan was solved on this checkpoint first.")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """A plan file as the engine reads it: ModelOpt's per-layer map, vLLM skip layers, or TRT-LLM's range string."""
    from kvcal import __version__
    from kvcal.errors import UsageError
    from kvcal.io import atomic_write_text, output_problem
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec
    from kvcal.pipeline.plan_export import (
        ENGINES,
        modelopt_config,
        modelopt_file_text,
        trtllm_dtype,
        vllm_skip_layers,
    )
    from kvcal.planfile import load_plan

    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got '{engine}'")
    if output is not None and engine != "vllm-modelopt":
        raise UsageError(
            f"-o writes vllm-modelopt's hf_quant_config.json; --engine {engine} prints its settings (nothing to "
            "write): drop -o, or use --engine vllm-modelopt"
        )
    if output is not None:
        if (problem := output_problem(output, "-o")) is not None:
            raise UsageError(problem)
    if model is not None:
        from kvcal.models.real import resolve_real_name
        from kvcal.planfile import load_plan_for_model
        from kvcal.scales import resolve_model_and_spec

        model_dir, kv = resolve_model_and_spec(model)
        p = load_plan_for_model(plan_file, resolve_real_name(model), model_dir, kv)
    else:
        p = load_plan(plan_file)
        model = p.model
    if engine == "vllm-modelopt":
        config = modelopt_config(p.layers, f"kvcal {__version__}")
        text = json.dumps(config, indent=2) + "\n"
        result: dict[str, object] = {"engine": engine, "hf_quant_config": config}
        if output is not None:
            text = modelopt_file_text(output, config)
            atomic_write_text(output, text)
            result["wrote"] = str(output)
            result["command"] = f"vllm serve {output.parent} --kv-cache-dtype auto"
        if json_out:
            print_json(result)
        elif output is None:
            console.print(text, end="", markup=False, highlight=False)
        else:
            console.print(f"wrote {output}; serve the checkpoint with: {result['command']}")
    elif engine == "vllm-skip-layers":
        kv = kv_spec(load_config(p.record["binding"].get("model_dir") or model))
        dtype, skip = vllm_skip_layers(p.layers, kv)
        extra = f" --kv-cache-dtype-skip-layers {skip}" if skip else ""
        command = f"vllm serve {model} --kv-cache-dtype {dtype}{extra}"
        if json_out:
            print_json({"engine": engine, "kv_cache_dtype": dtype, "skip_layers": skip, "command": command})
        else:
            console.print(command, markup=False, highlight=False)
    else:
        spec = trtllm_dtype(p.layers)
        if json_out:
            print_json({"engine": engine, "kv_cache_config": {"dtype": spec}})
        else:
            console.print(f'kv_cache_config:\n  dtype: "{spec}"', markup=False, highlight=False)
