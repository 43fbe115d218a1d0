#!/usr/bin/env python3
"""Regenerate a `kvcal plan` study page (docs/studies/plan-<model>.md) from the plans' own `--json` reports.

Each study is a list of `kvcal plan ... --frontier --compare-uniform --json` commands (one per budget context); the
report of each goes to `{root}/<name>.json`. The page puts, for each context and each target budget, the plan of
the frontier (solved exactly at that target) beside the best uniform configuration whose capacity meets it, with
the paired per-window difference (plan - uniform, a t interval over the held-out windows; kvcal.pipeline.plan.
interval), and the estimated vs measured KL of every plan.

    python scripts/plan_study.py plan-gemma            # write the page from {root}/*.json
    python scripts/plan_study.py plan-gemma --make     # first run the commands whose report is missing

Exit codes: 0 written, 1 a report is missing, 2 a bad option — each with one `Error: ...` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvcal.io import atomic_write_text  # noqa: E402
from kvcal.pipeline.plan import interval  # noqa: E402
from kvcal.pipeline.plan_export import layer_runs  # noqa: E402

DATA = "../shared/data"
_PLAN = ["--capacity", "3.0x", "--num-samples", "8", "--seq-len", "512", "--heldout-windows", "16",
         "--heldout-seq-len", "512", "--data-dir", DATA, "--frontier", "--frontier-step", "0.5",
         "--compare-uniform", "--json"]  # fmt: skip
TARGETS = (2.0, 2.5, 3.0, 3.5)

# name -> title, what the page says first, root, runs (name -> kvcal argv; {root} = the study's folder)
STUDIES: dict[str, dict[str, Any]] = {
    "plan-smollm2": {
        "title": "Per-layer KV plans under a capacity budget, SmolLM2-135M (`kvcal plan`, 16 held-out windows of 512)",
        "about": (
            "SmolLM2-135M-Instruct (30 layers, no sliding-window layer, so the budget's context changes no "
            "capacity: one run serves 4k and 32k). Candidates bf16, fp8_e4m3, nvfp4, k=fp8_e4m3,v=nvfp4; damage on "
            "8 calibration samples of 512 tokens (kvcal's default corpus, seed 0), minmax scales per tensor on "
            "them; every plan and uniform configuration measured jointly on the same 16 held-out WikiText-2 test "
            "windows of 512 tokens (the kl task's text)."
        ),
        "root": "studies/plan-smollm2",
        "runs": {
            "any context": ["plan", "smollm2", *_PLAN, "--context", "4096", "--batch-size", "4",
                            "--checkpoint", "{root}/damage.json", "-o", "{root}/smollm2.plan.json"],  # fmt: skip
        },
    },
    "plan-gemma": {
        "title": "Per-layer KV plans under a capacity budget, Gemma-3-270M at 4k and 32k (`kvcal plan`)",
        "about": (
            "Gemma-3-270M (18 layers: 15 sliding-window layers of window 512, 3 full-attention layers), so the "
            "budget's context matters: a sliding layer holds min(context, 512) tokens, 1/8 of a full layer at 4k and "
            "1/64 at 32k (kvcal capacity's count). Candidates bf16, fp8_e4m3, nvfp4, k=fp8_e4m3,v=nvfp4; damage on "
            "8 calibration samples of 512 tokens (kvcal's default corpus, seed 0), minmax scales per tensor; the "
            "32k run reuses the 4k run's damage (`--checkpoint`: the same samples, scales and candidates) and "
            "re-solves; every plan and uniform configuration measured jointly on the same 16 held-out WikiText-2 "
            "test windows of 512 tokens."
        ),
        "root": "studies/plan-gemma",
        "runs": {
            "4k": ["plan", "gemma3-270m", *_PLAN, "--context", "4096", "--batch-size", "2",
                   "--checkpoint", "{root}/damage.json", "-o", "{root}/gemma-4k.plan.json"],  # fmt: skip
            "32k": ["plan", "gemma3-270m", *_PLAN, "--context", "32768", "--batch-size", "2",
                    "--checkpoint", "{root}/damage.json", "-o", "{root}/gemma-32k.plan.json"],  # fmt: skip
        },
    },
}


class StudyError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _argv(study: dict[str, Any], run: str, root: Path) -> list[str]:
    return [a.replace("{root}", str(root)) for a in study["runs"][run]]


def _report_path(root: Path, run: str) -> Path:
    return root / f"{run.replace(' ', '-')}.json"


def make(name: str, root: Path) -> None:
    """Run every command whose report is missing (each report written atomically: a stopped run reruns)."""
    study = STUDIES[name]
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for run in study["runs"]:
        out = _report_path(root, run)
        if out.exists():
            continue
        argv = _argv(study, run, root)
        print("kvcal " + " ".join(argv), flush=True)
        proc = subprocess.run([sys.executable, "-m", "kvcal.cli", *argv], capture_output=True, text=True, env=env,
                              cwd=REPO)  # fmt: skip
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-3000:])
            raise StudyError(f"kvcal plan failed for run '{run}' (exit {proc.returncode})", 1)
        atomic_write_text(out, proc.stdout)


def _ci(m: dict[str, Any]) -> str:
    kl = m["kl"]
    if kl["lo"] is None:
        return f"{kl['mean']:.4g}"
    return f"{kl['mean']:.4g} [{kl['lo']:.4g}, {kl['hi']:.4g}]"


def signed_ci(d: dict[str, Any]) -> str:
    return f"{d['mean']:+.3g} [{d['lo']:+.3g}, {d['hi']:+.3g}]"


def _diff(a: list[float], b: list[float]) -> dict[str, Any]:
    return interval([x - y for x, y in zip(a, b, strict=True)])


def _verdict(d: dict[str, Any]) -> str:
    if d["hi"] is not None and d["hi"] < 0:
        return "plan better"
    if d["lo"] is not None and d["lo"] > 0:
        return "**uniform better**"
    return "not distinguishable"


def context_section(run: str, argv: list[str], r: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The markdown of one report, and one record per target (for the summary)."""
    lines = [f"## Context: {run}", "", "```bash", "kvcal " + " ".join(argv), "```", ""]
    uniform = r["uniform"]
    lines += ["Uniform configurations (the same held-out windows):", "",
              "| configuration | xBF16 | KL [95% CI] | top-1 agree |", "|---|---:|---|---:|"]  # fmt: skip
    for u in sorted(uniform, key=lambda u: u["capacity"]["multiplier_vs_bf16"]):
        lines.append(f"| {u['config']} | {u['capacity']['multiplier_vs_bf16']:.3f} | {_ci(u['measured'])} | "
                     f"{u['measured']['top1_agree']:.3f} |")  # fmt: skip
    lines += ["", "The plan at each target vs the best uniform configuration that meets it (least measured KL among "
              "those with capacity ≥ the target); paired difference = plan − uniform per window:", "",
              "| target | plan xBF16 | estimated KL | measured KL [95% CI] | est./meas. | best uniform (xBF16) | its KL "
              "[95% CI] | plan − uniform [95% CI] | verdict |", "|---|---:|---:|---|---:|---|---|---|---|"]  # fmt: skip
    records = []
    for target in TARGETS:
        plan = _at(r["frontier"], target)
        if plan is None:
            lines.append(f"| {target:.1f}x | — (no plan reaches it) | | | | | | | |")
            continue
        meeting = [u for u in uniform if u["capacity"]["multiplier_vs_bf16"] >= target * (1 - 1e-12)]
        pm = plan["measured"]
        ratio = plan["estimated_kl"] / pm["kl"]["mean"] if pm["kl"]["mean"] > 0 else float("nan")
        if not meeting:
            lines.append(f"| {target:.1f}x | {plan['capacity']:.3f} | {plan['estimated_kl']:.4g} | {_ci(pm)} | "
                         f"{ratio:.2f} | none meets it | | | plan only |")  # fmt: skip
            records.append({"target": target, "verdict": "no uniform configuration meets it"})
            continue
        best = min(meeting, key=lambda u: u["measured"]["kl"]["mean"])
        d = _diff(pm["kl_per_window"], best["measured"]["kl_per_window"])
        v = "the same configuration" if pm["kl_per_window"] == best["measured"]["kl_per_window"] else _verdict(d)
        lines.append(
            f"| {target:.1f}x | {plan['capacity']:.3f} | {plan['estimated_kl']:.4g} | {_ci(pm)} | {ratio:.2f} | "
            f"{best['config']} ({best['capacity']['multiplier_vs_bf16']:.3f}) | {_ci(best['measured'])} | "
            f"{signed_ci(d)} | {v} |"
        )
        records.append({"target": target, "verdict": v, "uniform": best["config"]})
    lines += ["", "Plans (layer ranges):", ""]
    for target in TARGETS:
        plan = _at(r["frontier"], target)
        if plan is not None:
            g = plan.get("uniform_guard")  # reports of kvcal plan with the uniform guard (module docstring, 5)
            took = "" if not g or g["chosen"] == "plan" else (
                f" — the uniform guard took {g['chosen']} (joint KL on the calibration samples "
                f"{g['calibration_kl'][g['chosen']]:.4g} vs the solved plan's {g['calibration_kl']['plan']:.4g})"
            )
            lines.append(
                f"- {target:.1f}x (frontier row {plan['target']:g}x): `{layer_runs(plan['layers'], '; ')}`{took}"
            )
    lines.append("")
    return lines, records


def _at(frontier: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The frontier plan solved for `target` (the Pareto rows drop a target whose plan a cheaper row dominates:
    then the least-KL row that still meets the target)."""
    ok = [f for f in frontier if f["capacity"] >= target * (1 - 1e-12)]
    return min(ok, key=lambda f: f["estimated_kl"]) if ok else None


def render(name: str, root: Path) -> str:
    study = STUDIES[name]
    missing = [run for run in study["runs"] if not _report_path(root, run).exists()]
    if missing:
        raise StudyError(f"no report for run(s) {missing} under {root}; run with --make first", 1)
    out = [f"# {study['title']}", "",
           f"Generated by `python scripts/plan_study.py {name}` from the `kvcal plan --json` reports under "
           f"`{study['root']}/` (not committed; `--make` runs them). {study['about']} KL = mean per-token "
           "KL(untouched cache ‖ configuration) in nats per window, 95% t interval over the windows (scipy).", ""]  # fmt: skip
    summary = []
    for run in study["runs"]:
        r = json.loads(_report_path(root, run).read_text())
        lines, records = context_section(run, _argv(study, run, Path(study["root"])), r)
        out += lines
        summary += [(run, rec) for rec in records]
    out += ["## Summary", "", "| context | target | verdict |", "|---|---|---|"]
    out += [f"| {run} | {rec['target']:.1f}x | {rec['verdict']} |" for run, rec in summary]
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=sorted(STUDIES))
    p.add_argument("--root", help="the folder of the reports (default: the study's root)")
    p.add_argument("--make", action="store_true", help="run the commands whose report is missing first")
    p.add_argument("-o", "--output", help="the page (default docs/studies/<study>.md)")
    args = p.parse_args(argv)
    root = Path(args.root or REPO / STUDIES[args.study]["root"])
    try:
        if args.make:
            make(args.study, root)
        page = render(args.study, root)
    except StudyError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.code
    out = Path(args.output or REPO / "docs" / "studies" / f"{args.study}.md")
    atomic_write_text(out, page)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
