"""`kvcal eval`: lm-eval tasks (and kvcal's kl) through a quantized KV cache, into one run directory.

The command's options are EvalConfig's fields, by name and default: `config_from_options` builds the config, so a
new EvalConfig field needs one option here (tests/commands/test_options.py checks that none is forgotten).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal import rundir
from kvcal.commands.options import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvFormatOpt,
    ModelArg,
    ScalesOpt,
    SkipLayersOpt,
    config_defaults,
    config_from_options,
    output_option,
)
from kvcal.commands.output import console, err_console, print_json, warn
from kvcal.evaluate.run import EvalConfig

# EvalConfig fields that have no option (they keep EvalConfig's default), and options that are not fields.
FIELDS_WITHOUT_OPTION: frozenset[str] = frozenset()
CLI_ONLY = ("json_out",)
_DEFAULT = config_defaults(EvalConfig)  # the options' defaults are EvalConfig's

# eval's own options (the shared ones are in kvcal.commands.options).
TasksOpt = Annotated[
    list[str],
    typer.Option(
        "--tasks",
        help="Comma-separated or repeated: gsm8k, aime25, gpqa_diamond, wikitext, kl, or a task of --include-path.",
    ),
]
RunDirOpt = Annotated[str, output_option("Run directory (skipped when complete, resumed otherwise).")]
ForceScalesOpt = Annotated[
    bool, typer.Option("--force-scales", help="Use scales bound to another checkpoint.")
]
IncludePathOpt = Annotated[
    str | None, typer.Option("--include-path", help="Folder of your own lm-eval task YAMLs.")
]
LimitOpt = Annotated[int | None, typer.Option("--limit", help="Samples per task (kl: windows).")]
NumFewshotOpt = Annotated[
    int | None, typer.Option("--num-fewshot", help="Override the task's few-shot count.")
]
DataDirOpt = Annotated[
    str | None, typer.Option("--data-dir", help="Offline data laid out like ../shared/data.")
]
GpqaPasswordOpt = Annotated[
    str | None,
    typer.Option(
        "--gpqa-password", envvar="KVCAL_GPQA_PASSWORD", show_envvar=True, help="Password of GPQA's zip."
    ),
]
ImplOpt = Annotated[str, typer.Option("--impl", help="Attention: auto, torch or triton.")]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", help="lm-eval batch size.")]
EvalSeedOpt = Annotated[int, typer.Option("--seed", help="0 = lm-eval's default seeds.")]
KlSeqLenOpt = Annotated[int, typer.Option("--kl-seq-len", help="Tokens per kl window.")]
MaxGenToksOpt = Annotated[
    int | None, typer.Option("--max-gen-toks", help="Cap generated tokens (lm-eval's aime25 asks for 32768).")
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Run the checkpoint's own Python code (config.json auto_map)."),
]
Nvfp4GlobalOpt = Annotated[
    str,
    typer.Option(
        "--nvfp4-global",
        help="nvfp4 without --scales: 'one' (global scale 1.0, vLLM's default) or 'per_sequence' "
        "(each sequence's amax/(448*6) over its real tokens, fixed at its first write).",
    ),
]
StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Fail when a NaN/Inf K/V value reaches the cache (default: warn, count in metrics.json).",
    ),
]


def eval_cmd(
    model: ModelArg,
    kv_format: KvFormatOpt,
    tasks: TasksOpt,
    output: RunDirOpt,
    scales: ScalesOpt = _DEFAULT["scales"],
    force_scales: ForceScalesOpt = _DEFAULT["force_scales"],
    skip_layers: SkipLayersOpt = _DEFAULT["skip_layers"],
    include_path: IncludePathOpt = _DEFAULT["include_path"],
    limit: LimitOpt = _DEFAULT["limit"],
    num_fewshot: NumFewshotOpt = _DEFAULT["num_fewshot"],
    data_dir: DataDirOpt = _DEFAULT["data_dir"],
    gpqa_password: GpqaPasswordOpt = _DEFAULT["gpqa_password"],
    impl: ImplOpt = _DEFAULT["impl"],
    dtype: DtypeOpt = _DEFAULT["dtype"],
    device: DeviceOpt = _DEFAULT["device"],
    batch_size: BatchSizeOpt = _DEFAULT["batch_size"],
    seed: EvalSeedOpt = _DEFAULT["seed"],
    kl_seq_len: KlSeqLenOpt = _DEFAULT["kl_seq_len"],
    max_gen_toks: MaxGenToksOpt = _DEFAULT["max_gen_toks"],
    trust_remote_code: TrustRemoteCodeOpt = _DEFAULT["trust_remote_code"],
    nvfp4_global: Nvfp4GlobalOpt = _DEFAULT["nvfp4_global"],
    strict: StrictOpt = _DEFAULT["strict"],
    json_out: JsonOpt = False,
) -> None:
    """Evaluate lm-eval tasks (and kvcal's kl) through kvcal's quantized KV cache."""
    options = dict(locals())  # first: exactly the command's options
    from kvcal.evaluate.run import run_eval

    config = config_from_options(EvalConfig, options, cli_only=CLI_ONLY, no_option=FIELDS_WITHOUT_OPTION)
    if force_scales and scales:
        warn(
            "--force-scales: scales measured on another checkpoint will be used; the run's config records it"
        )
    run_dir = run_eval(config, progress=lambda msg: err_console.print(f"[dim]{msg}[/dim]", highlight=False))
    results = json.loads((run_dir / rundir.RESULTS).read_text())
    metrics = json.loads((run_dir / rundir.METRICS).read_text())
    if json_out:
        print_json({"run_dir": str(run_dir), "results": results.get("results", {}), "metrics": metrics})
        return
    kv = results.get("kvcal", {}).get("kv_format", kv_format)
    console.print(_results_table(results, title=f"{model} · kv {kv} · {run_dir}"))
    console.print(_metrics_line(metrics), highlight=False)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _metric_rows(task: str, entry: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(task, metric (filter), value, stderr) for each numeric metric of lm-eval's `metric,filter` keys."""
    rows = []
    for key, value in entry.items():
        if "_stderr," in key or "," not in key or not isinstance(value, (int, float)):
            continue  # alias, name, sample_len and stderr columns
        metric, _, filt = key.partition(",")
        stderr = entry.get(f"{metric}_stderr,{filt}", "")
        name = metric if filt in ("none", "") else f"{metric} ({filt})"
        rows.append((task, name, _fmt(value), _fmt(stderr)))
    return rows


def _results_table(results: dict[str, Any], title: str) -> Table:
    table = Table(title=title)
    for col in ("task", "metric", "value", "stderr"):
        table.add_column(col, justify="right" if col in ("value", "stderr") else "left")
    for task, entry in results.get("results", {}).items():
        for row in _metric_rows(task, entry):
            table.add_row(*row)
    return table


def _metrics_line(metrics: dict[str, Any]) -> str:
    tps = metrics.get("tokens_per_s")
    return (
        f"wall {metrics.get('wall_s', 0):.1f} s · {_fmt(tps) if tps else '-'} tokens/s · peak RSS "
        f"{metrics.get('peak_rss_bytes', 0) / 2**30:.2f} GiB · cache {metrics.get('bytes_per_token', 0):.0f} B/token "
        f"({metrics.get('capacity_multiplier_vs_bf16', 0):.2f}x BF16 capacity)"
    )
