"""CLI commands: `kvcal sweep` (a resumable matrix of runs) and `kvcal compare` (report + regression gate)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from kvcal.commands.options import CapacityContextOpt, JsonOpt
from kvcal.commands.output import console, err_console, print_json, warn
from kvcal.io import atomic_write_text

if TYPE_CHECKING:
    from kvcal.engines import EngineSetup
    from kvcal.pipeline.sweep import SweepConfig, SweepPlan
    from kvcal.report.compare import Comparison


# `kvcal compare`'s option help, by option: the signature below declares one option a line.
_HELP = {
    "run_dirs": "Run directories, lm-eval output folders (`lm_eval ... --output_path P --log_samples`: P, or "
        "P@DATE_ID for one of several results files; the latest by default), or folders holding either (a "
        "sweep's RUNS_DIR).",
    "label": "NAME=PATH: the configuration's name for the run at PATH (repeatable).",
    "conformance": "ENGINE=EMULATION (labels of the quantized runs, repeatable): test that the engine's damage (its run "
        "minus its BF16 run, per sample) is equivalent to kvcal's emulation's (TOST against --margin). Without "
        "it, every quantized vLLM/SGLang lm-eval run is tested against the kvcal run of the same format, scales "
        "and skip layers when there is one. Runs that differ in dtype, max length, few-shot, chat template, "
        "generation kwargs, limit or task version are refused. Not equivalent fails --fail-on-regression; not "
        "judged (no BF16 runs, not shown at this sample size) too, unless --allow-unjudged.",
    "conformance_bf16": "ENGINE_BF16=EMULATION_BF16 (labels): the BF16 runs the damage is measured from (the engine with "
        "kv_cache_dtype=auto, kvcal eval --kv-format bf16), once for every pair or once per --conformance in "
        "order. Default: the one BF16 run of each side's lm-eval backend.",
    "conformance_noise": "PERTURBED_Q=PERTURBED_BF16 (labels): kvcal runs of the emulated configuration and of BF16 "
        "with perturbed weights (kvcal eval --perturb-weights 1, the emulation's settings), once for every pair or "
        "once per --conformance in order. The margin is then how far the quantization's damage moves between these "
        "two correct implementations of the model: the mean per-sample |perturbed damage - emulated damage|.",
    "margin": "Conformance's equivalence margin in the key metric's per-sample unit (wikitext: nats per word; "
        "accuracy: a fraction). Default: the mean per-sample |engine BF16 - emulation BF16|, or the perturbed "
        "emulation's (--conformance-noise).",
    "baseline": "Baseline: a run directory name or a kv format.",
    "output": "Write the Markdown report here.",
    "html_out": "Also write one self-contained HTML report here.",
    "fail_on_regression": "Exit 1 when the gate does not pass: a configuration fails it (see --gate), or one could not be "
        "judged (too few paired samples, no task in common; --allow-unjudged lets those pass).",
    "gate": "regression: fail a configuration that degrades significantly beyond --max-drop; noninferiority: "
        "pass only one whose one-sided (1 - alpha) upper bound of the degradation is under --max-drop (prints "
        "the paired samples that would show it when it does not).",
    "allow_unjudged": "With --fail-on-regression: configurations the gate could not judge pass instead of failing.",
    "max_drop": "Gate threshold, repeatable: a bare number is the default for every gated metric (absolute for "
        "accuracy, relative for perplexity, nats for kl); METRIC=VALUE or TASK/METRIC=VALUE sets one metric "
        "(e.g. --max-drop 0.02 --max-drop kl=0.05 --max-drop gsm8k/exact_match=0.03); naming a metric makes it "
        "gate (top1_agree is reported but gates only when named). Default: 0.02.",
    "max_length_change": "Gate on the paired change in generated length (tokens) of every generative task, as a fraction "
        "of the baseline's (e.g. 0.25): regression fails a significant change beyond it either way; "
        "noninferiority passes only an interval inside it. Without it the change is reported, not gated.",
    "alpha": "Significance level of every test and interval (intervals are 1 - alpha).",
    "min_samples": "Fewer paired samples than this: 'insufficient data', not judged (the gate fails on it unless "
        "--allow-unjudged; the report lists it).",
    "no_correction": "Test each key metric at --alpha on its own instead of Holm-Bonferroni over all of them.",
    "on_bad_run": "Incomplete/corrupt run directory: fail or skip.",
    "bootstrap": "Paired bootstrap resamples.",
    "seed": "Bootstrap seed.",
    "at_length": "Divergence tasks: the generated lengths (tokens, k = 1024) the fraction of outputs still identical "
        "to the baseline's is projected to from the measured hazard, e.g. 8k,32k for a reasoning task's traces.",
}


def compare_cmd(
    run_dirs: list[str] = typer.Argument(..., help=_HELP["run_dirs"]),
    label: list[str] | None = typer.Option(None, "--label", help=_HELP["label"]),
    conformance: list[str] | None = typer.Option(None, "--conformance", help=_HELP["conformance"]),
    conformance_bf16: list[str] | None = typer.Option(None, "--conformance-bf16", help=_HELP["conformance_bf16"]),
    conformance_noise: list[str] | None = typer.Option(None, "--conformance-noise", help=_HELP["conformance_noise"]),
    margin: float | None = typer.Option(None, "--margin", help=_HELP["margin"]),
    baseline: str = typer.Option("bf16", "--baseline", help=_HELP["baseline"]),
    output: Path | None = typer.Option(None, "-o", "--output", help=_HELP["output"]),
    html_out: Path | None = typer.Option(None, "--html", help=_HELP["html_out"]),
    fail_on_regression: bool = typer.Option(False, "--fail-on-regression", help=_HELP["fail_on_regression"]),
    gate: str = typer.Option("regression", "--gate", help=_HELP["gate"]),
    allow_unjudged: bool = typer.Option(False, "--allow-unjudged", help=_HELP["allow_unjudged"]),
    max_drop: list[str] | None = typer.Option(None, "--max-drop", help=_HELP["max_drop"]),
    max_length_change: float | None = typer.Option(None, "--max-length-change", help=_HELP["max_length_change"]),
    alpha: float = typer.Option(0.05, "--alpha", help=_HELP["alpha"]),
    min_samples: int = typer.Option(10, "--min-samples", help=_HELP["min_samples"]),
    no_correction: bool = typer.Option(False, "--no-multiple-testing-correction", help=_HELP["no_correction"]),
    on_bad_run: str = typer.Option("fail", "--on-bad-run", help=_HELP["on_bad_run"]),
    bootstrap: int = typer.Option(2000, "--bootstrap", help=_HELP["bootstrap"]),
    seed: int = typer.Option(1234, "--seed", help=_HELP["seed"]),
    context: CapacityContextOpt = None,
    at_length: str = typer.Option("4k,16k,32k", "--at-length", help=_HELP["at_length"]),
    as_json: JsonOpt = False,
) -> None:
    """Compare run directories against a baseline: report with error bars and a regression gate."""
    from kvcal.errors import UsageError
    from kvcal.evaluate.passkey import parse_lengths
    from kvcal.io import output_problem
    from kvcal.pipeline.sweep import recorded_context
    from kvcal.report.compare import compare_runs
    from kvcal.report.conformance import add_conformance, before_pairing

    if bootstrap < 100:
        raise UsageError(f"--bootstrap must be at least 100, got {bootstrap}")
    for flag, path in (("-o", output), ("--html", html_out)):
        if path is not None:  # before any run is read: the report has somewhere to go
            if (problem := output_problem(path, flag)) is not None:
                raise UsageError(problem)
    source = "--context"
    if context is None:  # a sweep's RUNS_DIR says which context its capacity assumes (sweep.yaml `context:`)
        context = next((c for c in map(recorded_context, map(Path, run_dirs)) if c is not None), None)
        source = "the sweep's context: in sweep.yaml"
    cmp = compare_runs(
        run_dirs,
        baseline=baseline,
        max_drop=max_drop,
        on_bad_run=on_bad_run,
        alpha=alpha,
        n_boot=bootstrap,
        seed=seed,
        warn=warn,
        min_samples=min_samples,
        multiple_testing="none" if no_correction else "holm",
        context=context,
        context_source=source,
        gate=gate,
        allow_unjudged=allow_unjudged,
        labels=label,
        at_lengths=parse_lengths(at_length, "--at-length"),
        max_length_change=max_length_change,
        before_pairing=before_pairing(conformance, conformance_bf16, margin, conformance_noise),
    )
    add_conformance(cmp, conformance, warn, conformance_bf16, margin, conformance_noise)
    failed = fail_on_regression and not cmp.gate_passed
    _write_outputs(cmp, output, html_out, as_json)
    _print_gate(cmp, failed)
    if failed:
        sys.exit(1)


def _write_outputs(cmp: Comparison, output: Path | None, html_out: Path | None, as_json: bool) -> None:
    """The Markdown report (-o), the HTML report (--html), and on stdout the JSON or a summary table."""
    from kvcal.engines import commands_dict, markdown_section
    from kvcal.report.html import render_html
    from kvcal.report.markdown import render_markdown

    named = _engine_setups(cmp)
    md = render_markdown(cmp).rstrip("\n") + "\n\n" + markdown_section(named) + "\n"
    if output is not None:
        atomic_write_text(output, md)
    if html_out is not None:
        atomic_write_text(html_out, render_html(cmp))
    if as_json:
        payload = cmp.to_dict()
        payload["report"] = str(output) if output else None
        payload["html"] = str(html_out) if html_out else None
        payload["engine_commands"] = {label: commands_dict(setup) for label, setup in named}
        print_json(payload)
        return
    console.print(_summary_table(cmp))
    if output is not None or html_out:
        from kvcal.commands.engines import print_engine_commands

        print_engine_commands(named)
    if output is not None:
        console.print(f"Report: {output}" + (f"  HTML: {html_out}" if html_out else ""), highlight=False)
    elif not html_out:
        console.print(md, markup=False, highlight=False)


def _engine_setups(cmp: Comparison) -> list[tuple[str, EngineSetup]]:
    """(label, EngineSetup) per configuration, the tasks of all its runs merged."""
    from kvcal.engines import EngineSetup, group_setups

    return group_setups(
        [(c.label, EngineSetup.from_run_config(r.config, c.label)) for c in cmp.configs for r in c.runs]
    )


_GATE_STYLE = {
    "FAIL": "[red]FAIL[/red]",
    "pass": "[green]pass[/green]",
    "insufficient data": "[yellow]insufficient data[/yellow]",
    "not judged: no task in common": "[yellow]not judged: no task in common[/yellow]",
}


def _summary_table(cmp: Comparison) -> Table:
    from kvcal.report.numbers import capacity_heading

    table = Table(title=f"{cmp.model} vs baseline {cmp.baseline}", show_lines=False)
    for col in ("configuration", capacity_heading(cmp.context), "gate", "verdict"):
        table.add_column(col, overflow="fold")
    for c in cmp.configs[1:]:
        table.add_row(
            c.label,
            "n/a" if c.capacity is None else f"{c.capacity:.2f}x",
            _GATE_STYLE[cmp.config_gate(c.label)],
            cmp.config_verdict(c.label),
        )
    return table


def _print_gate(cmp: Comparison, failed: bool) -> None:
    """What failed the gate and what it could not judge, on stderr (each verdict carries its numbers; a
    non-inferiority one the paired samples that would show it)."""
    mode = cmp.settings.gate
    if cmp.failures:
        lines = [f"  {r.config}: {r.verdict}" for r in cmp.failures]
        if mode == "noninferiority":
            head = "Non-inferiority gate FAILED:" if failed else "Not shown non-inferior:"
        else:
            head = "Regression gate FAILED:" if failed else "Regressions over the threshold:"
        err_console.print("\n".join([head, *lines]), highlight=False, markup=False)
    unjudged = [f"  {r.config}: {r.verdict}" for r in cmp.insufficient]
    unjudged += [f"  {label}: {cmp.config_verdict(label)}" for label in cmp.no_common_task]
    if unjudged:
        if cmp.settings.allow_unjudged:
            head = "Not judged by the gate (passed by --allow-unjudged):"
        elif failed and not cmp.failures:
            head = f"{mode.capitalize()} gate FAILED: not judged (pass --allow-unjudged to let them pass):"
        else:
            head = "Not judged by the gate (fails it; --allow-unjudged lets them pass):"
        err_console.print("\n".join([head, *unjudged]), highlight=False, markup=False)
    for c in cmp.conformance:
        err_console.print(f"Engine vs emulation: {c.engine}: {c.verdict}", highlight=False, markup=False)
    for r in cmp.length_rows:  # --max-length-change
        if r.status in ("FAIL", "not judged"):
            err_console.print(
                f"Length change {r.status}: {r.config} on {r.task}: {r.reason}", highlight=False, markup=False
            )


def sweep_cmd(
    config: Path = typer.Argument(..., help="Sweep YAML (see configs/)."),
    output: Path = typer.Option(
        ..., "-o", "--output", help="RUNS_DIR: run directories, scales/ and sweep.json."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan (what is done, what would run) and stop."
    ),
    shard: str | None = typer.Option(
        None,
        "--shard",
        help="I/N: run only slice I of N disjoint slices of the cells (a Slurm array or Kubernetes indexed Job "
        "runs one per task); processes may share one RUNS_DIR (a lock per cell).",
    ),
    report_only: bool = typer.Option(
        False,
        "--report-only",
        help="Run nothing: once every cell is complete (all slices done), write RUNS_DIR/report.md and sweep.json.",
    ),
    context: CapacityContextOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a resumable matrix of formats x scales x skip-layers x tasks."""
    import dataclasses

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvcal.errors import UsageError
    from kvcal.io import output_problem
    from kvcal.pipeline.sweep import (
        execute_sweep,
        load_sweep_config,
        parse_shard,
        plan_sweep,
        shard_plan,
    )

    slice_ = parse_shard(shard) if shard is not None else None
    if (problem := output_problem(output, "-o", folder=True)) is not None:
        raise UsageError(problem)
    if slice_ is not None and report_only:
        raise UsageError("--report-only assembles every slice's cells; drop --shard")
    cfg = load_sweep_config(config)
    if context is not None:  # --context over the YAML's `context:`
        if context < 1:
            raise UsageError(f"--context must be a positive number of tokens (e.g. 8192), got {context}")
        cfg = dataclasses.replace(cfg, context=context)
    plan = plan_sweep(cfg, output)
    if report_only:
        _sweep_report(cfg, output, plan, as_json)
        return
    full = plan  # execute_sweep takes the whole plan and slices it itself
    if slice_ is not None:
        plan = shard_plan(plan, slice_)
    if dry_run:
        _print_sweep_plan(cfg, output, plan, as_json)
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    ) as progress:
        bar = progress.add_task("sweep", total=plan.total_steps)

        def on_progress(event: dict) -> None:
            progress.update(bar, completed=event["done"], description=event["message"][:80])

        result = execute_sweep(cfg, output, plan=full, progress=on_progress, warn=warn, shard=slice_)
    if as_json:
        print_json(result)
    else:
        _print_sweep_result(cfg, config, output, shard, result)
    if result["failed"]:
        for f in result["failed"]:
            err_console.print(f"failed: {f['cell']}: {f['error']}", highlight=False, markup=False)
        sys.exit(1)


def _print_sweep_plan(cfg: SweepConfig, output: Path, plan: SweepPlan, as_json: bool) -> None:
    """--dry-run: the cells (what is done, what would run) and the scale files to calibrate."""
    if as_json:
        print_json(plan.to_dict())
        return
    table = Table(title=f"sweep plan: {cfg.model} -> {output}")
    for col in ("cell", "task", "kv format", "scales", "skip", "status"):
        table.add_column(col, overflow="fold")
    for cell in plan.cells:
        table.add_row(cell.name, cell.task, cell.kv_format, cell.scales_label, cell.skip, cell.status)
    console.print(table)
    todo = plan.calibrations_todo
    console.print(
        f"{len(plan.cells)} cells: {plan.n_done} complete, {len(plan.todo)} to run; "
        f"{len(plan.calibrations)} scale files ({len(todo)} to calibrate)",
        highlight=False,
    )


def _print_sweep_result(
    cfg: SweepConfig, config: Path, output: Path, shard: str | None, result: dict[str, Any]
) -> None:
    """The engine commands of the cells run and a closing line: what ran, what failed, what to do next."""
    from kvcal.commands.engines import print_engine_dicts
    from kvcal.pipeline.sweep import parse_shard, summary_name

    slice_ = parse_shard(shard) if shard is not None else None
    print_engine_dicts(result["engine_commands"])
    where = f"slice {shard} " if shard else ""
    then = (
        f"When every slice is done: kvcal sweep {config} -o {output} --report-only"
        if slice_
        else f"Compare with: kvcal compare {output} -o REPORT.md"
    )
    console.print(
        f"sweep {where}finished: {result['ran']} ran, {result['skipped_complete']} already complete, "
        f"{len(result['busy'])} running in another process, {len(result['failed'])} failed "
        f"({output / summary_name(slice_)}). {then}"
        + (f" (capacity at {cfg.context} tokens of context, from sweep.yaml)" if cfg.context else ""),
        highlight=False,
    )


def _sweep_report(cfg: SweepConfig, output: Path, plan: SweepPlan, as_json: bool) -> None:
    """--report-only: every cell complete, else one Error naming what is missing; then the comparison of RUNS_DIR
    into RUNS_DIR/report.md and the assembled plan (with every slice's summary) into sweep.json."""
    from kvcal.errors import KvcalError
    from kvcal.io import atomic_write_json
    from kvcal.pipeline.sweep import engine_commands_of
    from kvcal.report.compare import compare_runs

    missing = [c for c in plan.cells if c.status != "complete"]
    if missing:
        shown = ", ".join(f"{c.task}/{c.name} ({c.status})" for c in missing[:3])
        raise KvcalError(
            f"--report-only: {len(missing)} of {len(plan.cells)} cells are not complete ({shown}"
            f"{', ...' if len(missing) > 3 else ''}); run the slices that hold them (kvcal sweep CONFIG -o "
            f"{output} --shard I/N, or without --shard) and report again"
        )
    cmp = compare_runs(
        [output],
        baseline=cfg.baseline,
        warn=warn,
        context=cfg.context,
        context_source="the sweep's context: in sweep.yaml",
    )
    report = output / "report.md"
    shards = sorted(output.glob("sweep.shard-*-of-*.json"))
    atomic_write_json(
        output / "sweep.json",
        {
            "runs_dir": str(output),
            "report": str(report),
            "shards": {p.name: _json_or_none(p) for p in shards},
            "context": cfg.context,
            "plan": plan.to_dict(),
            "engine_commands": engine_commands_of(plan.cells),
        },
    )
    _write_outputs(cmp, report, None, as_json)


def _json_or_none(path: Path) -> object:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
