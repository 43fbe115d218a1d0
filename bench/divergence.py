"""What does the divergence task cost, next to one plain generation of the same prompts through the same cache?

Both sides run on the user's path, `kvcal eval` as a process:
  divergence  kvcal eval MODEL -f FMT --tasks divergence --limit N --max-gen-toks L   (the BF16 trajectories
              already cached by a warm-up run, as in a sweep: greedy decode through FMT + teacher-forced decode
              of the BF16 tokens + their chunked prefill)
  generate    kvcal eval MODEL -f FMT --tasks gsm8k --limit N --max-gen-toks L        (lm-eval's greedy
              generate_until of the same gsm8k requests through FMT: the plain generation)
The figure is the task time per token the evaluated cache generated (divergence: the quantized greedy outputs'
tokens; generate: `gen_token_ids` of the samples), so the two sides' different stopping rules (gsm8k stops at
"Question:", divergence at EOS or the cap) do not count. Rounds are interleaved (divergence, generate, generate,
divergence, ...); medians and their ratio are printed and written as JSON.

    OMP_NUM_THREADS=2 python bench/divergence.py --data-dir ../shared/data --limit 2 --gen-len 32 --rounds 2 \\
        -o bench/divergence.json

Goal (issue 22): divergence at most 2.2x the plain generation per generated token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _eval(args: argparse.Namespace, task: str, out: Path, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvcal.cli", "eval", args.model, "-f", args.kv_format, "--tasks", task,
           "--limit", str(args.limit), "--max-gen-toks", str(args.gen_len), "--num-fewshot", str(args.num_fewshot),
           "--data-dir", args.data_dir, "-o", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())["per_task"][task]
    samples = [json.loads(x) for x in (out / f"samples_{task}.jsonl").read_text().splitlines()]
    if task == "divergence":
        tokens = sum(int(s["quant_len"]) for s in samples)
    else:
        first = samples[0].get("filter")
        tokens = sum(len(s["gen_token_ids"][0]) for s in samples if s.get("filter") == first)
    return {"wall_s": float(metrics["wall_s"]), "tokens": tokens, "s_per_token": float(metrics["wall_s"]) / tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-format", default="fp8_e4m3")
    ap.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--limit", type=int, default=2, help="gsm8k prompts")
    ap.add_argument("--gen-len", type=int, default=32, help="generated tokens at most (--max-gen-toks)")
    ap.add_argument("--num-fewshot", type=int, default=0, help="gsm8k's few-shot examples in each prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-o", "--output", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="kvcal-bench-divergence-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "KVCAL_CACHE": os.environ.get("KVCAL_CACHE", str(scratch / "cache"))}  # fmt: skip
    _eval(args, "divergence", scratch / "warm-up", env)  # decodes and caches the BF16 trajectories
    runs: dict[str, list[dict[str, Any]]] = {"divergence": [], "generate": []}
    for r in range(args.rounds):
        order = ["divergence", "generate"] if r % 2 == 0 else ["generate", "divergence"]
        for side in order:
            out = scratch / f"{side}-{r}"
            runs[side].append(_eval(args, "divergence" if side == "divergence" else "gsm8k", out, env))
            shutil.rmtree(out, ignore_errors=True)
    med = {side: statistics.median(x["s_per_token"] for x in v) for side, v in runs.items()}
    ratio = med["divergence"] / med["generate"]
    print(f"{'side':<12} {'s / generated token (median)':>30} {'tokens / run':>14}")
    for side, v in runs.items():
        print(f"{side:<12} {med[side]:>30.4f} {v[0]['tokens']:>14}")
    print(f"divergence / generate: {ratio:.2f}x (goal <= 2.2x)")
    record = {
        "bench": "divergence",
        "args": vars(args),
        "runs": runs,
        "median_s_per_token": med,
        "ratio": ratio,
        "goal": 2.2,
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
    }
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=2))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
