"""`kvcal release MODEL --config release.yaml -o OUT`: verify / drift-check / recalibrate, evaluate, gate, export.
Exit 0 ship, 1 gate or drift policy failed, 2 usage. The library: kvcal.pipeline.release."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcal.commands.options import CapacityContextOpt, JsonOpt, ModelArg, output_option
from kvcal.commands.output import console, err_console, print_json, warn


def release_cmd(
    model: ModelArg,
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Release YAML (see configs/release-smollm2.yaml).")
    ],
    output: Annotated[
        Path,
        output_option("OUT: release.json, release.md, scales/, runs/ (the run store), drift/, exports/."),
    ],
    context: CapacityContextOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Decide whether this checkpoint ships with its KV-cache scales; write OUT/release.json and release.md.

    Verify the scale file against the checkpoint (stale: recalibrate), check drift on a traffic sample (drifted:
    recalibrate or fail), evaluate against BF16, gate, export for vLLM / SGLang and print the serving flags.
    A rerun with nothing changed reuses everything in OUT. Exit 0 ship, 1 gate or drift policy failed, 2 usage."""
    from kvcal.errors import KvcalError, UsageError
    from kvcal.pipeline.release import run_release
    from kvcal.pipeline.release_config import load_release_config

    cfg = load_release_config(config)
    if context is not None:  # --context over the YAML's gate.context
        if context < 1:
            raise UsageError(f"--context must be a positive number of tokens (e.g. 8192), got {context}")
        cfg.gate.context = context

    def say(message: str) -> None:
        if not json_out:
            err_console.print(f"release: {message}", highlight=False, markup=False, soft_wrap=True)

    try:
        record = run_release(model, cfg, output, progress=say, warn=warn)
    except KeyboardInterrupt:
        raise KvcalError(
            f"release interrupted; finished work is kept in '{output}' — rerun the same command to resume"
        ) from None
    if json_out:
        print_json(record)
    else:
        _render(record, output)
    if record["exit_code"]:
        sys.exit(record["exit_code"])


def _line(text: str, err: bool = False) -> None:
    """One line as is: no markup, no wrapping (serve commands are copied from here)."""
    (err_console if err else console).print(text, highlight=False, markup=False, soft_wrap=True)


def _render(r: dict[str, Any], output: Path) -> None:
    w = r["work"]
    decision = "SHIP" if r["decision"] == "ship" else "DO NOT SHIP"
    _line(f"{decision} {r['model']}: {r['kv_format']} per-{r['granularity']} scales {r['scales_path']}")
    _line(f"recalibrated: {'yes' if r['recalibrated'] else 'no'} ({r['reason']})")
    if r["drift"] is not None:
        _line(f"drift: {r['drift']['verdict']} on {r['drift']['traffic']}")
    for p in r.get("plans", []):
        _line(f"plan: {p['label']} ({p['kv_format']}) {'solved' if p['solved'] else 'reused'}: {p['plan_file']}")
    _line(f"gate: {r['gate']}")
    for c in r["configurations"]:
        if c["role"] != "baseline":
            _line(f"  {c['gate']:>5}  {c['label']} ({c['role']}): {c['verdict']}")
    if r.get("failed_because"):
        _line(f"release failed: {r['failed_because']}", err=True)
    for engine, cmd in r["serve_commands"].items():
        _line(f"serve ({engine}): {cmd}")
    from kvcal.commands.engines import print_engine_dicts

    print_engine_dicts(r.get("engine_commands", {}))
    if w["reused_everything"]:
        done = "everything reused (nothing calibrated, drift-checked, planned, evaluated or exported)"
    else:
        done = (
            f"{w['calibrations_run']} calibration(s), {w['drift_checks_run']} drift check(s), "
            f"{w['evaluations_run']} evaluation(s) run"
            + (f", {w['plans_solved']} plan(s) solved" if w.get("plans_solved") else "")
        )
    _line(f"{done}; record: {output / 'release.json'}, report: {output / 'release.md'}")
