"""Benchmark: log-likelihood tasks on the user's path, continuation-only scoring against lm-eval's own path.

    python bench/loglikelihood.py --model gemma3-270m --task passkey_mc --passkey-length 2k --limit 5 \\
        --formats auto,fp8_e4m3 --code before=/tmp/kvcal-before --code after=. [--rounds 2] [-o bench/out/ll.json]
    python bench/loglikelihood.py --model gemma3-270m --task gpqa_diamond_zeroshot --limit 40 --data-dir DATA ...
    python bench/loglikelihood.py ... --code full=.,scoring=full --code continuation=.,scoring=continuation
        (one tree, the two scorings: continuation scoring is opt-in, `kvcal eval --scoring continuation`)

Each cell is one whole `kvcal eval MODEL -f FORMAT --tasks TASK --limit N` process (fresh, PYTHONPATH = that code's
tree: a checkout or an exported one, `git archive REV | tar -x -C DIR`), so its wall time counts everything a user
waits for and its peak RSS (`wait4`'s ru_maxrss) is that run's own; "task s" is the evaluation alone (metrics.json's
per-task wall time: no start-up, model load or binding). Cells are interleaved, the order rotating per
round, so load from other jobs hits all alike; the median over rounds is reported. `auto` of the code before
continuation-only scoring is lm-eval's own HFLM path (`lm_eval --model hf`; tests/evaluate/test_eval.py checks the
two are equal sample for sample), so "auto before" is the plain lm-eval reference. Per-sample log-likelihoods
(samples_<task>.jsonl) of every cell are compared with the first code's cell of the same format: max |difference|
and whether every is_greedy is the same. Prints a table; writes JSON (-o).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from eval_child import run_eval  # noqa: E402


def parse_code(value: str) -> tuple[str, tuple[str, str | None]]:
    """'LABEL=DIR' or 'LABEL=DIR,scoring=continuation' -> (LABEL, (DIR, scoring or None: kvcal eval's default))."""
    label, _, rest = value.partition("=")
    tree, _, opt = rest.partition(",scoring=")
    return label, (tree, opt or None)


def run_cell(args: argparse.Namespace, code: tuple[str, str | None], fmt: str, out: Path) -> dict[str, Any]:
    tree, scoring = code
    cmd = [args.model, "-f", fmt, "--tasks", args.task, "--limit", str(args.limit), "--batch-size", str(args.batch_size)]
    if scoring:
        cmd += ["--scoring", scoring]
    if args.task.startswith("passkey"):
        cmd += ["--passkey-lengths", args.passkey_length, "--passkey-depths", args.passkey_depth]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if fmt != "auto" and args.scales:
        cmd += ["--scales", args.scales]
    res = run_eval(cmd, tree, out, args.threads)
    per_task = res.pop("metrics").get("per_task", {})  # the evaluation alone (no start-up, load, binding)
    res["task_s"] = per_task[args.task]["wall_s"] if args.task in per_task else float("nan")
    return res


def samples(out: Path, task: str) -> dict[int, list[tuple[float, bool]]]:
    """doc_id -> [(log-likelihood, is_greedy) per choice] of a run directory's samples file."""
    found = sorted(out.rglob(f"samples_{task}*.jsonl"))
    if not found:
        return {}
    per_doc: dict[int, list[tuple[float, bool]]] = {}
    for line in found[0].read_text().splitlines():
        rec = json.loads(line)
        if "resps" in rec:
            per_doc[int(rec["doc_id"])] = [(float(r[0][0]), bool(r[0][1])) for r in rec["resps"]]
        elif rec.get("filter") == "none" and "filtered_resps" in rec:  # GPQA's samples keep only these
            per_doc[int(rec["doc_id"])] = [(float(r[0]), bool(r[1])) for r in rec["filtered_resps"]]
    return per_doc


def compare(a: dict[int, list[tuple[float, bool]]], b: dict[int, list[tuple[float, bool]]]) -> dict[str, Any]:
    if not a or a.keys() != b.keys():
        return {"compared": 0}
    pairs = [(x, y) for d in a for x, y in zip(a[d], b[d], strict=True)]
    return {
        "compared": len(pairs),
        "max_abs_ll_diff": max(abs(x[0] - y[0]) for x, y in pairs),
        "is_greedy_identical": all(x[1] == y[1] for x, y in pairs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--task", default="passkey_mc")
    p.add_argument("--passkey-length", default="2k")
    p.add_argument("--passkey-depth", default="0.5")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--formats", default="auto,fp8_e4m3")
    p.add_argument("--scales", default=None, help="scale file for the quantized formats (default: uncalibrated)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--code", action="append", default=[],
                   help="LABEL=DIR[,scoring=full|continuation] (repeatable); default after=.")  # fmt: skip
    p.add_argument("--work", default=str(ROOT / "bench" / "out" / "loglikelihood"))
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "loglikelihood.json"))
    args = p.parse_args()
    codes = dict(parse_code(c) for c in (args.code or ["after=."]))
    formats = args.formats.split(",")
    cells = [(c, f) for f in formats for c in codes]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {cell: [] for cell in cells}
    work = Path(args.work)
    for r in range(args.rounds):
        for code, fmt in cells[r % len(cells) :] + cells[: r % len(cells)]:
            out = work / f"{code}-{fmt}-r{r}"
            res = run_cell(args, codes[code], fmt, out)
            runs[code, fmt].append(res)
            print(f"  round {r} {code:8s} {fmt:10s} wall {res['wall_s']:7.1f} s  task {res['task_s']:7.1f} s  "
                  f"CPU {res['cpu_s']:7.1f} s  "
                  f"peak RSS {res['peak_rss_mib']:6.0f} MiB", flush=True)  # fmt: skip
    first = next(iter(codes))
    table = []
    for code, fmt in cells:
        rs = runs[code, fmt]
        med = {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "task_s", "cpu_s", "peak_rss_mib")}
        ref = runs[first, fmt]
        row = {"code": code, "format": fmt, "runs": len(rs), **med,
               "speedup_wall": statistics.median(x["wall_s"] for x in ref) / med["wall_s"],
               "speedup_cpu": statistics.median(x["cpu_s"] for x in ref) / med["cpu_s"],
               "speedup_task": statistics.median(x["task_s"] for x in ref) / med["task_s"],
               "vs_" + first: compare(samples(work / f"{first}-{fmt}-r0", args.task),
                                      samples(work / f"{code}-{fmt}-r0", args.task))}  # fmt: skip
        table.append(row)
    report = {"args": vars(args), "codes": codes, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": table}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{args.model} {args.task} (limit {args.limit}"
          + (f", length {args.passkey_length})" if args.task.startswith("passkey") else ")"))  # fmt: skip
    print(f"{'code':8s} {'format':10s} {'wall s':>8s} {'task s':>8s} {'CPU s':>8s} {'RSS MiB':>8s} {'x wall':>7s} "
          f"{'x task':>7s} {'x CPU':>7s}"
          f" {'max |dLL| vs ' + first:>18s} {'greedy same':>12s}")  # fmt: skip
    for row in table:
        c = row["vs_" + first]
        print(f"{row['code']:8s} {row['format']:10s} {row['wall_s']:8.1f} {row['task_s']:8.1f} {row['cpu_s']:8.1f} "
              f"{row['peak_rss_mib']:8.0f} {row['speedup_wall']:7.2f} {row['speedup_task']:7.2f} "
              f"{row['speedup_cpu']:7.2f} "
              f"{c.get('max_abs_ll_diff', float('nan')):18.2e} {str(c.get('is_greedy_identical', '-')):>12s}")  # fmt: skip
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
