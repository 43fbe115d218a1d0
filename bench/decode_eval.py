"""Benchmark: decode speed on the user's path, every format against `auto`, whole `kvcal eval` processes.

    OMP_NUM_THREADS=2 python bench/decode_eval.py --data-dir ../shared/data [--model smollm2] [--task gsm8k] \\
        [--limit 5] [--max-gen-toks 256] [--formats auto,bf16,fp8_e4m3,...] [--rounds 2] [-o bench/out/decode_eval.json]

Each cell is one `kvcal eval MODEL -f FORMAT --tasks TASK --limit N --max-gen-toks T` process (bench/eval_child.py);
its decode rate is the run's own metrics.json `decode_tokens_per_s` (generated tokens per second of decode steps:
kvcal.evaluate.timing), so start-up, load and prefill do not enter. The reference (`auto`) runs before every
`--every` formats and last; each format's ratio is to the mean of the reference runs just before and after it (the
order rotating per round), then the median over rounds, so drift in machine load hits both sides of a ratio alike. Uncalibrated scales (`--scales` to give a
file). Goal (issue 26): every format >= 0.9x `auto`. Prints a table; writes JSON.
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

FORMATS = ("auto,bf16,float16,fp8_e4m3,fp8_e5m2,int8_per_tensor,fp8_per_token_head,int8_per_token_head,int4_per_token_head,"
           "nvfp4,nvfp4_4over6,fp4_e2m1,mxfp4,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc")


def run_cell(args: argparse.Namespace, fmt: str, tag: str, data: list[str]) -> dict[str, Any]:
    cmd = [args.model, "-f", fmt, "--tasks", args.task, "--limit", str(args.limit),
           "--max-gen-toks", str(args.max_gen_toks), *data]  # fmt: skip
    if fmt != "auto" and args.scales:
        cmd += ["--scales", args.scales]
    res = run_eval(cmd, args.code, Path(args.work) / tag, args.threads)
    m = res.pop("metrics")
    res.update({k: m.get(k) for k in ("decode_tokens_per_s", "decode_tokens", "decode_steps", "tpot_s")})
    print(f"  {tag:26s} decode {res['decode_tokens_per_s'] or float('nan'):7.2f} tok/s  "
          f"({res['decode_tokens']} tokens)  wall {res['wall_s']:6.1f} s", flush=True)  # fmt: skip
    return res


def one_round(args: argparse.Namespace, r: int, formats: list[str], data: list[str]) -> dict[str, dict[str, Any]]:
    """The reference (formats[0]) first, after every --every formats and last; each format's ratio is to the mean of
    the reference runs just before and after it. The formats' order rotates by --every per round."""
    ref_fmt, others = formats[0], formats[1:]
    shift = r * args.every % len(others)
    others = others[shift:] + others[:shift]
    cells: dict[str, dict[str, Any]] = {}
    refs = [run_cell(args, ref_fmt, f"{ref_fmt}-0-r{r}", data)]
    pending: list[str] = []
    for i, fmt in enumerate(others):
        cells[fmt] = run_cell(args, fmt, f"{fmt}-r{r}", data)
        pending.append(fmt)
        if (i + 1) % args.every == 0 or i == len(others) - 1:
            refs.append(run_cell(args, ref_fmt, f"{ref_fmt}-{len(refs)}-r{r}", data))
            base = (refs[-2]["decode_tokens_per_s"] + refs[-1]["decode_tokens_per_s"]) / 2
            for f in pending:
                cells[f]["ratio"] = cells[f]["decode_tokens_per_s"] / base
            pending.clear()
    cells[ref_fmt] = {**refs[0], "ratio": 1.0, "reference_runs": refs}
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", default="gsm8k")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument("--formats", default=FORMATS, help="comma-separated; the first is the reference (auto)")
    p.add_argument("--scales", default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--every", type=int, default=4, help="formats between two runs of the reference")
    p.add_argument("--code", default=".", help="the tree to run (a checkout or an exported one)")
    p.add_argument("--work", default=str(ROOT / "bench" / "out" / "decode_eval"))
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "decode_eval.json"))
    args = p.parse_args()
    formats = args.formats.split(",")
    ref_fmt = formats[0]
    data = ["--data-dir", str(Path(args.data_dir).resolve())] if args.data_dir else []
    rounds = [one_round(args, r, formats, data) for r in range(args.rounds)]
    table = []
    for fmt in formats:
        rates = [c[fmt]["decode_tokens_per_s"] for c in rounds]
        ratios = [c[fmt]["ratio"] for c in rounds]
        table.append({"format": fmt, "decode_tokens_per_s": statistics.median(rates), "ratios": ratios,
                      "vs_" + ref_fmt: statistics.median(ratios),
                      "decode_tokens": [c[fmt]["decode_tokens"] for c in rounds]})  # fmt: skip
    report = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rounds, "cells": table}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{args.model} {args.task} --limit {args.limit} --max-gen-toks {args.max_gen_toks}, {args.rounds} round(s)")
    print(f"{'format':22s} {'decode tok/s':>13s} {'x ' + ref_fmt:>8s} {'per round':>24s} {'tokens':>12s}")
    for row in table:
        per = " ".join(f"{x:.2f}" for x in row["ratios"])
        print(f"{row['format']:22s} {row['decode_tokens_per_s']:13.2f} {row['vs_' + ref_fmt]:8.2f} {per:>24s} "
              f"{'/'.join(str(t) for t in row['decode_tokens']):>12s}")  # fmt: skip
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
