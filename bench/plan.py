"""Benchmark: `kvcal plan` with four candidates vs one `kvcal sensitivity` run of a single format (issue 25's
goal: the plan costs at most 3x the sensitivity run).

    .venv/bin/python bench/plan.py [--model smollm2] [--num-samples 16] [--seq-len 512] [--heldout-windows 16]
                                   [--heldout-seq-len 512] [--batch-size 4] [--data-dir ../shared/data]
                                   [--repeats 2] [--device cpu]

A = `kvcal plan MODEL --candidates bf16,fp8_e4m3,nvfp4,k=fp8_e4m3,v=nvfp4 --capacity 3.0x` (the default
candidates: three quantized ones, so L x 3 + 1 forwards per calibration batch, then the held-out measurement);
B = `kvcal sensitivity MODEL --kv-format nvfp4 --scales minmax` (L + 2 forwards per batch; minmax scales as the
plan's). Both on the same calibration samples (kvcal's corpus, seed 0), each run a fresh child process, A and B
interleaved (the order alternates per repeat) so machine load hits both alike. Per run: the child's wall time and
CPU time (user + sys of the child: the fairer number on a shared machine). The ratio A / B is taken per repeat
(one A with its neighbouring B), then the median. Prints a table; writes bench/out/plan.json.

`--sensitivity-code NAME=DIR` (repeatable) runs B from another checkout too (PYTHONPATH=DIR), e.g. the commit
before a change to sensitivity, so "the sensitivity run of today" stays the yardstick when both got faster; each B
is interleaved with A, and the ratio is taken against the first one named.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
CANDIDATES = "bf16,fp8_e4m3,nvfp4,k=fp8_e4m3,v=nvfp4"


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The two kvcal command lines, sharing the calibration options."""
    shared = ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--device", args.device, "--json"]  # fmt: skip
    plan = ["plan", args.model, "--candidates", CANDIDATES, "--capacity", "3.0x", "--heldout-windows",
            str(args.heldout_windows), "--heldout-seq-len", str(args.heldout_seq_len), *shared]  # fmt: skip
    if args.data_dir:
        plan += ["--data-dir", args.data_dir]
    sens = ["sensitivity", args.model, "--kv-format", "nvfp4", "--scales", "minmax", *shared]
    return {"plan": plan, "sensitivity": sens}


def run_child(argv: list[str], threads: int, tree: Path = ROOT) -> dict[str, float]:
    """One `kvcal ARGV` in a fresh process (kvcal imported from `tree`): its wall time and CPU time (user + sys)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(tree)}  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvcal.cli", *argv], capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"kvcal {argv[0]} failed with exit code {proc.returncode}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--heldout-windows", type=int, default=16)
    p.add_argument("--heldout-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--sensitivity-code", action="append", default=[], metavar="NAME=DIR",
                   help="run the sensitivity side from checkout DIR too, as sensitivity-NAME (repeatable)")
    p.add_argument("--out", default=str(OUT / "plan.json"))
    args = p.parse_args()
    argv = commands(args)
    trees = {"plan": ROOT}
    for spec in args.sensitivity_code or ["="]:
        name, _, tree = spec.partition("=")
        trees[f"sensitivity-{name}" if name else "sensitivity"] = Path(tree or ROOT).resolve()
    kinds = list(trees)
    yardstick = kinds[1]
    runs: list[dict] = []
    for rep in range(args.repeats):
        order = kinds if rep % 2 == 0 else kinds[::-1]
        for kind in order:
            cmd = argv["plan" if kind == "plan" else "sensitivity"]
            r = {"kind": kind, "repeat": rep, "tree": str(trees[kind]), **run_child(cmd, args.threads, trees[kind])}
            runs.append(r)
            print(f"  run {rep} {kind:22s} wall {r['wall_s']:8.1f} s  CPU {r['cpu_s']:8.1f} s", flush=True)
    ratios = []
    for rep in range(args.repeats):
        by = {r["kind"]: r for r in runs if r["repeat"] == rep}
        row = {"repeat": rep}
        for kind in kinds[1:]:
            a, b = by["plan"], by[kind]
            row[kind] = {"wall": a["wall_s"] / b["wall_s"], "cpu": a["cpu_s"] / b["cpu_s"]}
        ratios.append(row)
    medians = {kind: {k: statistics.median(r[kind][k] for r in ratios) for k in ("wall", "cpu")} for kind in kinds[1:]}
    summary = medians[yardstick]
    print()
    print("| run | wall (median s) | CPU (median s) | plan / it, wall | plan / it, CPU |")
    print("|---|---:|---:|---:|---:|")
    for kind in kinds:
        w = statistics.median(r["wall_s"] for r in runs if r["kind"] == kind)
        c = statistics.median(r["cpu_s"] for r in runs if r["kind"] == kind)
        m = medians.get(kind)
        ratio = f"{m['wall']:.2f}x | {m['cpu']:.2f}x" if m else "— | —"
        print(f"| {kind} | {w:.1f} | {c:.1f} | {ratio} |")
    goal = "met" if summary["cpu"] <= 3.0 else "missed"
    print(f"\ngoal plan / {yardstick} <= 3x (CPU time): {goal}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "commands": {k: "kvcal " + " ".join(v) for k, v in argv.items()}, "runs": runs, "ratios": ratios,
        "median_ratio": summary, "yardstick": yardstick, "median_ratios": medians, "goal_3x": goal, "machine": {"platform": platform.platform(),
        "processor": platform.processor(), "cpus": os.cpu_count(), "threads": args.threads},
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
