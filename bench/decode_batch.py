"""Benchmark: generated tokens/s at batch 1, 8, 16, 32 on the user's path, and kvcal's batch scaling against `auto`'s.

    OMP_NUM_THREADS=2 python bench/decode_batch.py --data-dir ../shared/data [--model smollm2] \\
        [--tasks gsm8k,divergence] [--batches 1,8,16,32] [--formats auto,bf16,fp8_e4m3,nvfp4] [--limit 32] \\
        [--max-gen-toks 64] [--rounds 1] [-o bench/out/decode_batch.json]

Every cell is one whole `kvcal eval MODEL -f FORMAT --tasks TASK --batch-size B --limit N --max-gen-toks T` process
(bench/eval_child.py). Its figure: the tokens the evaluated cache generated (gsm8k: the samples' `gen_token_ids`,
first filter; divergence: the quantized greedy outputs' `quant_len`) per second of the task's own wall time
(metrics.json per_task wall_s: prefill, decode and, for divergence, its teacher-forced decode and prefill; model load
and start-up not counted). The divergence task's BF16 trajectories are decoded once per batch size by an untimed
warm-up (`-f bf16`, the same KVCAL_CACHE), as a sweep decodes them once.

Scaling of a format at batch B: its rate at B over its rate at batch 1. kvcal's batch scaling as a ratio of
`auto`'s: scaling(format, B) / scaling(auto, B) (goal, issue 41: >= 0.8). Cells are interleaved: every round runs
each batch size's formats in an order rotated per round, batch sizes in turn, so load drift hits every format;
with several rounds the medians are taken. Prints a table; writes JSON. A bench stopped part way keeps its
measured cells: rerun the same command with the same `--work` and it runs only the rest (`--only-existing`: the
table of what was measured, running nothing). Timings on a loaded machine are not final:
`--note` records the load (the JSON keeps `os.getloadavg()` before and after every cell).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from eval_child import run_eval  # noqa: E402


def _generated(out: Path, task: str) -> int:
    samples = [json.loads(x) for x in (out / f"samples_{task}.jsonl").read_text().splitlines() if x.strip()]
    if task.startswith("divergence"):
        return sum(int(s["quant_len"]) for s in samples)
    first = samples[0].get("filter")
    return sum(len(s["gen_token_ids"][0]) for s in samples if s.get("filter") == first and s.get("gen_token_ids"))


def _fewshot(args: argparse.Namespace) -> list[str]:
    return [] if args.num_fewshot is None else ["--num-fewshot", str(args.num_fewshot)]


def _recovered(task: str, fmt: str, batch: int, out: Path) -> dict[str, Any] | None:
    """A cell a bench measured before it was stopped: its `cell.json`, else (a bench of before cell.json) the
    figures its run directory holds (metrics.json: the task's own wall time; no process figures). None if the
    cell's run is not complete."""
    if (out / "cell.json").is_file():
        return json.loads((out / "cell.json").read_text())
    if not (out / "COMPLETE").is_file():
        return None
    per = json.loads((out / "metrics.json").read_text())["per_task"][task]
    tokens = _generated(out, task)
    return {"task": task, "format": fmt, "batch": batch, "tokens": tokens, "task_wall_s": per["wall_s"],
            "tokens_per_s": tokens / per["wall_s"], "decode_tokens_per_s": per.get("decode_tokens_per_s"),
            "process_wall_s": None, "peak_rss_mib": None, "loadavg_before": None, "loadavg_after": None,
            "recovered": True}  # fmt: skip


def _cell(
    args: argparse.Namespace, task: str, fmt: str, batch: int, out: Path, data: list[str]
) -> dict[str, Any] | None:
    """One measured cell; a cell of an earlier, stopped bench in the same --work folder is read back, not rerun
    (`--only-existing`: nothing is run, missing cells are None)."""
    if out.exists() or args.only_existing:
        got = _recovered(task, fmt, batch, out)
        if got is not None or args.only_existing:
            return got
        shutil.rmtree(out)  # a cell stopped mid-run: its time is lost, it is measured again
    cmd = [args.model, "-f", fmt, "--tasks", task, "--batch-size", str(batch), "--limit", str(args.limit),
           "--max-gen-toks", str(args.max_gen_toks), *_fewshot(args), *data]  # fmt: skip
    load0 = os.getloadavg()
    res = run_eval(cmd, args.code, out, args.threads)
    per = res["metrics"]["per_task"][task]
    tokens = _generated(out, task)
    cell = {
        "task": task, "format": fmt, "batch": batch, "tokens": tokens, "task_wall_s": per["wall_s"],
        "tokens_per_s": tokens / per["wall_s"], "decode_tokens_per_s": per.get("decode_tokens_per_s"),
        "process_wall_s": res["wall_s"], "peak_rss_mib": res["peak_rss_mib"],
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
    }  # fmt: skip
    print(f"  {task:11s} {fmt:10s} batch {batch:3d}: {cell['tokens_per_s']:7.2f} generated tok/s "
          f"({tokens} tokens in {per['wall_s']:.1f} s; load {load0[0]:.1f})", flush=True)  # fmt: skip
    (out / "cell.json").write_text(json.dumps(cell))  # a stopped bench rerun in the same --work reads it back
    return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", default="gsm8k,divergence")
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--formats", default="auto,bf16,fp8_e4m3,nvfp4", help="comma-separated; the first is the reference")
    p.add_argument("--limit", type=int, default=32, help="prompts per cell (at least the largest batch)")
    p.add_argument("--max-gen-toks", type=int, default=64)
    p.add_argument("--num-fewshot", type=int, default=None, help="default: the task's own (gsm8k: 5)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--note", default="", help="what else ran on the machine (recorded in the JSON)")
    p.add_argument("--code", default=str(ROOT), help="the tree to run (a checkout or an exported one)")
    p.add_argument("--work", default=None, help="scratch folder for the runs (default: a temporary one); a stopped "
                   "bench rerun with the same --work reads its measured cells back and runs the rest")
    p.add_argument("--only-existing", action="store_true",
                   help="run nothing: the table and JSON of the cells measured in --work so far")
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "decode_batch.json"))
    args = p.parse_args()
    tasks, formats = args.tasks.split(","), args.formats.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    ref = formats[0]
    data = ["--data-dir", str(Path(args.data_dir).resolve())] if args.data_dir else []
    work = Path(args.work or tempfile.mkdtemp(prefix="kvcal-bench-decode-batch-"))
    os.environ.setdefault("KVCAL_CACHE", str(work / "cache"))  # the children's: the warm-ups' trajectories
    cells: list[dict[str, Any]] = []
    for task in (t for t in tasks if t.startswith("divergence") and not args.only_existing):
        for b in batches:  # untimed: the BF16 trajectories of each batch size, as a sweep decodes them once
            if (work / f"warm-{task}-b{b}" / "COMPLETE").is_file():  # a stopped bench's, same --work
                continue
            run_eval([args.model, "-f", "bf16", "--tasks", task, "--batch-size", str(b), "--limit", str(args.limit),
                      "--max-gen-toks", str(args.max_gen_toks), *_fewshot(args), *data], args.code,
                     work / f"warm-{task}-b{b}", args.threads)  # fmt: skip
    for r in range(args.rounds):
        for task in tasks:
            for i, b in enumerate(batches):
                shift = (r + i) % len(formats)
                for fmt in formats[shift:] + formats[:shift]:
                    cell = _cell(args, task, fmt, b, work / f"{task}-{fmt}-b{b}-r{r}", data)
                    if cell is not None:
                        cells.append({**cell, "round": r})
    table = []
    for task in tasks:
        got = {(f, b): [c["tokens_per_s"] for c in cells if (c["task"], c["format"], c["batch"]) == (task, f, b)]
               for f in formats for b in batches}  # fmt: skip
        rate = {k: statistics.median(v) for k, v in got.items() if v}
        for f in formats:
            for b in batches:
                if not all(k in rate for k in ((f, b), (f, batches[0]), (ref, b), (ref, batches[0]))):
                    continue  # a cell not measured (a stopped bench read back with --only-existing)
                scaling = rate[(f, b)] / rate[(f, batches[0])]
                ref_scaling = rate[(ref, b)] / rate[(ref, batches[0])]
                table.append({"task": task, "format": f, "batch": b, "tokens_per_s": rate[(f, b)],
                              "scaling": scaling, "scaling_vs_" + ref: scaling / ref_scaling,
                              "vs_" + ref + "_same_batch": rate[(f, b)] / rate[(ref, b)]})  # fmt: skip
    report = {
        "bench": "decode_batch", "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "note": args.note, "goal": {"scaling_vs_" + ref: 0.8}, "cells": cells, "table": table,
        "not_measured": [f"{t} {f} batch {b}" for t in tasks for f in formats for b in batches
                         if not any((c["task"], c["format"], c["batch"]) == (t, f, b) for c in cells)],
    }  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    shots = "" if args.num_fewshot is None else f" --num-fewshot {args.num_fewshot}"
    print(f"\n{args.model} --limit {args.limit} --max-gen-toks {args.max_gen_toks}{shots}, {args.rounds} round(s), "
          f"{args.threads} thread(s){'; ' + args.note if args.note else ''}")  # fmt: skip
    print(f"| task | format | batch | generated tok/s | scaling vs batch {batches[0]} | scaling / {ref}'s | "
          f"tok/s / {ref}'s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in table:
        print(f"| {row['task']} | {row['format']} | {row['batch']} | {row['tokens_per_s']:.2f} | "
              f"{row['scaling']:.2f}x | {row['scaling_vs_' + ref]:.2f} | {row['vs_' + ref + '_same_batch']:.2f} |")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
