"""`kvcal eval`: lm-eval tasks (and kvcal's kl) through a quantized KV cache, into one run directory.

The command's options are EvalConfig's fields, by name and default: `config_from_options` builds the options and
kvcal.evaluate.spec.eval_spec parses them (as for a sweep cell or a release candidate), so a new EvalConfig field
needs one option here (tests/commands/test_options.py checks that none is forgotten).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal import rundir
from kvcal.commands.options import (
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvFormatOpt,
    KvInputDtypeOpt,
    MaxMemoryOpt,
    ModelArg,
    NumProcessesOpt,
    OffloadFolderOpt,
    SkipLayersOpt,
    config_defaults,
    config_from_options,
    output_option,
    scales_option,
)
from kvcal.commands.output import console, err_console, print_json, warn
from kvcal.evaluate.spec import EvalConfig

# EvalConfig fields that have no option (they keep EvalConfig's default), and options that are not fields.
FIELDS_WITHOUT_OPTION: frozenset[str] = frozenset()
CLI_ONLY = ("json_out", "num_processes")
_DEFAULT = config_defaults(EvalConfig)  # the options' defaults are EvalConfig's

# eval's own options (the shared ones are in kvcal.commands.options).
TasksOpt = Annotated[
    list[str],
    typer.Option(
        "--tasks",
        help="Comma-separated or repeated: gsm8k, aime25, gpqa_diamond, wikitext, kl, passkey, passkey_mc, "
        "divergence (divergence_aime25, divergence_gpqa_diamond), or a task of --include-path.",
    ),
]
RunDirOpt = Annotated[str, output_option("Run directory (skipped when complete, resumed otherwise).")]
EvalScalesOpt = Annotated[
    str | None,
    scales_option(
        "Scale file (.safetensors) from `kvcal calibrate`, or first-batch: vLLM's --calculate-kv-scales (up to "
        "v0.18; each layer's K/V scale = amax of the first batch / 200 (K) or / 100 (V), fixed afterwards). "
        "Default: none (fp8 at scale 1.0, the engines' uncalibrated default)."
    ),
]
ForceScalesOpt = Annotated[
    bool, typer.Option("--force-scales", help="Use scales bound to another checkpoint.")
]
IncludePathOpt = Annotated[
    str | None, typer.Option("--include-path", help="Folder of your own lm-eval task YAMLs.")
]
LimitOpt = Annotated[
    int | None,
    typer.Option(
        "--limit", help="Samples per task (kl: windows; passkey: per (length, depth) cell, default 10)."
    ),
]
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
KlSeqLenOpt = Annotated[
    int, typer.Option("--kl-seq-len", help="Tokens per kl window (up to the model's positions).")
]
PrefillChunkOpt = Annotated[
    int,
    typer.Option(
        "--prefill-chunk",
        help="kl windows, and with --scoring continuation log-likelihood contexts, longer than this run by "
        "chunked prefill through the quantized cache, this many tokens per forward.",
    ),
]
KlSubsampleOpt = Annotated[
    int,
    typer.Option(
        "--kl-subsample",
        help="kl scores every Nth position of a window (N a power of two up to 512; every token still fills the "
        "cache): the LM head and statistics cost 1/N at long windows.",
    ),
]
MaxGenToksOpt = Annotated[
    int | None,
    typer.Option(
        "--max-gen-toks",
        help="Cap generated tokens (lm-eval's aime25 asks for 32768); divergence tasks: the length (default 256).",
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Run the checkpoint's own Python code (config.json auto_map)."),
]
ScoringOpt = Annotated[
    str,
    typer.Option(
        "--scoring",
        help="loglikelihood requests (multiple choice, rolling perplexity): 'full' (lm-eval's own path, every "
        "position's logits), 'continuation' (logits only for the continuation's rows; a question's choices "
        "share one prefill; float32 log-softmax) or 'continuation-whole' (logits only for the continuation's "
        "rows, every request's whole window in one forward as lm-eval runs it: lm-eval's numbers through a "
        "quantized cache too).",
    ),
]
LogprobDtypeOpt = Annotated[
    str,
    typer.Option(
        "--logprob-dtype",
        help="Log-likelihoods' log-softmax and sums: float32 (whatever the model's dtype, as engines compute "
        "log-probs) or model (lm-eval's HFLM default: the model's dtype; in bfloat16 a wikitext document's total "
        "rounds to tens of nats). Recorded in config.yaml for a 16-bit model.",
    ),
]
MaxLengthOpt = Annotated[
    int | None,
    typer.Option(
        "--max-length",
        help="lm-eval's max_length: the rolling window of loglikelihood_rolling (wikitext) and the truncation of "
        "contexts, in tokens (an engine's max_model_len). Default: the model's positions (lm-eval's).",
    ),
]
PerturbWeightsOpt = Annotated[
    float | None,
    typer.Option(
        "--perturb-weights",
        help="Move every weight by this many ulps of its dtype (random signs from --seed): the same model as "
        "another correct implementation computes it. A yardstick run for kvcal compare --conformance-noise (how "
        "far a quantized cache's damage moves under such a difference), not a configuration to serve.",
    ),
]
RepeatsOpt = Annotated[
    int | None,
    typer.Option(
        "--repeats",
        help="Generative tasks: generate each document N times (a seed per document and repeat, the same in every "
        "configuration) and score it by the mean over its N generations, as AIME25 is scored over 10 samples.",
    ),
]
GenKwargsOpt = Annotated[
    str | None,
    typer.Option(
        "--gen-kwargs",
        help="lm-eval's --gen_kwargs for generative tasks, e.g. 'temperature=0.6,top_p=0.95' (a temperature "
        "above 0 samples, as in vLLM).",
    ),
]
PromptsOpt = Annotated[
    str | None,
    typer.Option(
        "--prompts",
        help="The divergence task's prompts from your own JSONL (one {\"prompt\": ...} per line, e.g. logged "
        "requests) instead of gsm8k's; the answer compared is then the whole output.",
    ),
]
TqBoundaryOpt = Annotated[
    int,
    typer.Option(
        "--tq-boundary-layers",
        help="TurboQuant presets: the first and last N layers stay BF16, vLLM's default boundary protection "
        "(N = 2, which vLLM offers no flag to change); 0 quantizes every layer (kvcal only).",
    ),
]
PrefixSerdeOpt = Annotated[
    str | None,
    typer.Option(
        "--prefix-serde",
        help="LMCache's storage tier: the K/V of each sequence's first --prefix-tokens tokens round-trip through "
        "this LMCache serde (fp8: a plain e4m3 cast, no scale; aesgcm: exact; turboquant_k8v4 / _4bit_nc / "
        "_k3v4_nc / _3bit_nc: vLLM's TurboQuant store, LMCache's float16 load) before the live cache stores them, "
        "as a prefix reloaded from disk or a remote store. Default: off.",
    ),
]
PrefixTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--prefix-tokens",
        help="With --prefix-serde: how many of each sequence's first tokens (its own, padding not counted) come "
        "back from the storage tier (N >= 1).",
    ),
]
Nvfp4GlobalOpt = Annotated[
    str,
    typer.Option(
        "--nvfp4-global",
        help="nvfp4 without --scales: 'one' (global scale 1.0, vLLM's default) or 'per_sequence' "
        "(each sequence's amax/(448*6) over its real tokens, fixed at its first write).",
    ),
]
AttentionOpt = Annotated[
    str,
    typer.Option(
        "--attention",
        help="kv (default: K/V quantized, attention in the model's dtype) or fp8 (vLLM's FlashAttention-3 FP8 "
        "attention: Q cast to e4m3 with the scale file's q_scale, 1.0 without --scales, and softmax P cast to "
        "e4m3; needs --kv-format fp8_e4m3).",
    ),
]
PasskeyLengthsOpt = Annotated[
    str,
    typer.Option(
        "--passkey-lengths",
        help="passkey / passkey_mc prompt lengths in the model's tokens, comma-separated (1k = 1024): each prompt "
        "plus its answer must fit the model's positions, and longer than ~2k needs --data-dir (WikiText-2 filler).",
    ),
]
PasskeyDepthsOpt = Annotated[
    str,
    typer.Option(
        "--passkey-depths",
        help="passkey / passkey_mc key positions: fractions of the filler before the key (0 = start, 1 = end).",
    ),
]
StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Fail when a NaN/Inf K/V value reaches the cache (default: warn, count in metrics.json).",
    ),
]


def _refuse_unused(ctx: typer.Context, spec: Any) -> None:
    """An option typed on the command line that nothing asked uses is an error naming why (a sweep or release
    applies its shared settings to the tasks they fit; here the user named the option for this run)."""
    from typer._click.core import ParameterSource  # typer 0.29 vendors click

    from kvcal.errors import UsageError
    from kvcal.formats import is_tq_preset
    from kvcal.tasknames import KL_TASK, OWN_TASKS

    lm_eval_tasks = [t for t in spec.tasks if t not in OWN_TASKS]
    generates = [t for t in spec.tasks if t != KL_TASK]

    def typed(name: str) -> bool:
        return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)

    needs = [
        ("kl_seq_len", "--kl-seq-len", spec.has_kl, "sets the kl task's window; add kl to --tasks or drop it"),
        ("kl_subsample", "--kl-subsample", spec.has_kl, "thins the kl task's positions; add kl or drop it"),
        ("passkey_lengths", "--passkey-lengths", spec.has_passkey, "sets the passkey tasks' prompt lengths; add "
         "passkey or passkey_mc to --tasks or drop it"),
        ("passkey_depths", "--passkey-depths", spec.has_passkey, "sets the passkey tasks' key depths; add passkey "
         "or passkey_mc to --tasks or drop it"),
        ("tq_boundary_layers", "--tq-boundary-layers", is_tq_preset(spec.kv_format), "counts a TurboQuant preset's "
         f"BF16 boundary layers; --kv-format {spec.kv_format} is not one: drop it"),
        ("repeats", "--repeats", bool(lm_eval_tasks), "repeats a generative lm-eval task's generations; "
         f"{', '.join(spec.tasks)} {'is' if len(spec.tasks) == 1 else 'are'} kvcal's own: drop it"),
        ("gen_kwargs", "--gen-kwargs", bool(generates), "sets how tasks generate; kl generates nothing: drop it"),
        ("max_gen_toks", "--max-gen-toks", bool(generates), "caps generated tokens; kl generates nothing: drop it"),
    ]  # fmt: skip
    for name, flag, applies, why in needs:
        if typed(name) and not applies:
            raise UsageError(f"{flag} {why}")


def eval_cmd(
    ctx: typer.Context,
    model: ModelArg,
    kv_format: KvFormatOpt,
    tasks: TasksOpt,
    output: RunDirOpt,
    scales: EvalScalesOpt = _DEFAULT["scales"],
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
    device_map: DeviceMapOpt = _DEFAULT["device_map"],
    max_memory: MaxMemoryOpt = _DEFAULT["max_memory"],
    offload_folder: OffloadFolderOpt = _DEFAULT["offload_folder"],
    batch_size: BatchSizeOpt = _DEFAULT["batch_size"],
    seed: EvalSeedOpt = _DEFAULT["seed"],
    kl_seq_len: KlSeqLenOpt = _DEFAULT["kl_seq_len"],
    prefill_chunk: PrefillChunkOpt = _DEFAULT["prefill_chunk"],
    kl_subsample: KlSubsampleOpt = _DEFAULT["kl_subsample"],
    max_gen_toks: MaxGenToksOpt = _DEFAULT["max_gen_toks"],
    trust_remote_code: TrustRemoteCodeOpt = _DEFAULT["trust_remote_code"],
    nvfp4_global: Nvfp4GlobalOpt = _DEFAULT["nvfp4_global"],
    kv_input_dtype: KvInputDtypeOpt = _DEFAULT["kv_input_dtype"],
    attention: AttentionOpt = _DEFAULT["attention"],
    passkey_lengths: PasskeyLengthsOpt = _DEFAULT["passkey_lengths"],
    passkey_depths: PasskeyDepthsOpt = _DEFAULT["passkey_depths"],
    strict: StrictOpt = _DEFAULT["strict"],
    scoring: ScoringOpt = _DEFAULT["scoring"],
    logprob_dtype: LogprobDtypeOpt = _DEFAULT["logprob_dtype"],
    max_length: MaxLengthOpt = _DEFAULT["max_length"],
    perturb_weights: PerturbWeightsOpt = _DEFAULT["perturb_weights"],
    repeats: RepeatsOpt = _DEFAULT["repeats"],
    gen_kwargs: GenKwargsOpt = _DEFAULT["gen_kwargs"],
    prompts: PromptsOpt = _DEFAULT["prompts"],
    tq_boundary_layers: TqBoundaryOpt = _DEFAULT["tq_boundary_layers"],
    prefix_serde: PrefixSerdeOpt = _DEFAULT["prefix_serde"],
    prefix_tokens: PrefixTokensOpt = _DEFAULT["prefix_tokens"],
    num_processes: NumProcessesOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """Evaluate lm-eval tasks (and kvcal's kl) through kvcal's quantized KV cache."""
    options = {k: v for k, v in locals().items() if k != "ctx"}  # first: exactly the options (ctx: Typer's)
    from kvcal.commands.launch import is_main_process, run_in_processes
    from kvcal.evaluate.run import run_eval
    from kvcal.evaluate.spec import eval_spec

    if num_processes != 1:
        run_in_processes(ctx, num_processes, {"samples (--limit)": limit})

    config = config_from_options(EvalConfig, options, cli_only=CLI_ONLY, no_option=FIELDS_WITHOUT_OPTION)
    spec = eval_spec(config)  # parsed and checked once
    _refuse_unused(ctx, spec)
    if force_scales and scales:
        warn(
            "--force-scales: scales measured on another checkpoint will be used; the run's config records it"
        )
    run_dir = run_eval(spec, progress=lambda msg: err_console.print(f"[dim]{msg}[/dim]", highlight=False))
    if not is_main_process():
        return  # rank 0 wrote the run directory and renders it
    results = json.loads((run_dir / rundir.RESULTS).read_text())
    metrics = json.loads((run_dir / rundir.METRICS).read_text())
    from kvcal.engines import commands_dict, setup_from_run_dir

    engine_setup = setup_from_run_dir(run_dir)
    if json_out:
        print_json({
            "run_dir": str(run_dir), "results": results.get("results", {}), "metrics": metrics,
            "engine_commands": commands_dict(engine_setup) if engine_setup else {},
        })  # fmt: skip
        return
    kv = results.get("kvcal", {}).get("kv_format", kv_format)
    console.print(_results_table(results, title=f"{model} · kv {kv} · {run_dir}"))
    env = json.loads((run_dir / rundir.ENV).read_text()) if (run_dir / rundir.ENV).is_file() else {}
    console.print(_metrics_line(metrics, env), highlight=False)
    if engine_setup is not None:
        from kvcal.commands.engines import print_engine_commands

        print_engine_commands([(run_dir.name, engine_setup)])


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


def _metrics_line(metrics: dict[str, Any], env: dict[str, Any]) -> str:
    """The closing line: prefill tokens/s and, where the run generated, decode tokens/s and TPOT
    (metrics.json, kvcal.evaluate.timing) — the emulator's speed on this device, not an engine's."""
    device = env.get("gpu") or " ".join(str(p) for p in (env.get("device"), env.get("processor")) if p) or "?"
    speed = [f"prefill {_rate(metrics.get('prefill_tokens_per_s'))} tokens/s"]
    if metrics.get("decode_tokens"):
        tpot = metrics.get("tpot_s")
        speed.append(f"decode {_rate(metrics.get('decode_tokens_per_s'))} tokens/s")
        speed.append(f"TPOT {'-' if tpot is None else f'{tpot * 1e3:.1f} ms'}")
    return (
        f"emulation on {device}: {' · '.join(speed)} · peak RSS "
        f"{metrics.get('peak_rss_bytes', 0) / 2**30:.2f} GiB · cache {metrics.get('bytes_per_token', 0):.0f} B/token "
        f"({metrics.get('capacity_multiplier_vs_bf16', 0):.2f}x BF16 capacity)"
    )


def _rate(value: Any) -> str:
    return "-" if not value else f"{value:.4g}"
