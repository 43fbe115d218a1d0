"""What does evaluating through kvcal's quantized cache cost, compared with plain `lm_eval --model hf`?

Runs lm-eval's `wikitext` (perplexity, loglikelihood_rolling) on the same model, dtype and limit through:
  hf            lm-eval's HFLM (the reference)
  kvcal-auto    kvcal's adapter, cache untouched (parity: same perplexity as hf, to the last bit)
  kvcal-bf16    kvcal's adapter with a BF16 cache
  kvcal-fp8     ... fp8_e4m3 (uncalibrated)
  kvcal-nvfp4   ... nvfp4
Each configuration gets its own model instance, loaded once; the timed part is one simple_evaluate call. Rounds
are interleaved (hf, bf16, fp8, nvfp4, hf, ...) so drift in machine load hits every configuration alike; the
median per configuration and its ratio to hf are printed and written as JSON.

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \\
        python bench/eval_overhead.py --data-dir ../shared/data --limit 2 --rounds 3 -o bench/eval_overhead.json

Goal (issue 5): kvcal fp8 at most 1.10x plain lm-eval on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

CONFIGS = [
    ("hf", None),
    ("kvcal-auto", "auto"),  # parity: must equal hf exactly
    ("kvcal-bf16", "bf16"),
    ("kvcal-fp8", "fp8_e4m3"),
    ("kvcal-nvfp4", "nvfp4"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | HF folder | .gguf")
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    ap.add_argument("--limit", type=int, default=2, help="wikitext documents")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("-o", "--output", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)

    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from kvcal.evaluate.adapter import KvcalLM
    from kvcal.evaluate.tasks import resolve_tasks, task_manager_for
    from kvcal.models.resolve import resolve_model

    model_dir = resolve_model(args.model)
    plan = resolve_tasks("wikitext", data_dir=args.data_dir if Path(args.data_dir).is_dir() else None)
    spec = plan.lm_eval_specs["wikitext"]
    tm = task_manager_for(plan)

    lms: dict[str, Any] = {}
    for name, fmt in CONFIGS:
        common = dict(pretrained=str(model_dir), dtype=args.dtype, device=args.device, batch_size=1)
        lms[name] = HFLM(**common) if fmt is None else KvcalLM(kv_format=fmt, impl=args.impl, **common)

    times: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    ppl: dict[str, float] = {}
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]  # rotate who goes first
        for name, _ in order:
            t0 = time.perf_counter()
            res = simple_evaluate(
                model=lms[name], tasks=[spec], limit=args.limit, task_manager=tm, log_samples=False
            )
            times[name].append(time.perf_counter() - t0)
            ppl[name] = res["results"]["wikitext"]["word_perplexity,none"]
            print(
                f"round {r + 1}: {name:12s} {times[name][-1]:7.2f} s  word_ppl {ppl[name]:.4f}",
                file=sys.stderr,
            )

    ref = statistics.median(times["hf"])
    rows = []
    for name, fmt in CONFIGS:
        med = statistics.median(times[name])
        rows.append(
            {
                "config": name,
                "kv_format": fmt or "auto (HFLM)",
                "median_s": med,
                "ratio_vs_hf": med / ref,
                "times_s": times[name],
                "word_perplexity": ppl[name],
            }
        )
    print(
        f"\nwikitext, {args.model}, limit {args.limit}, {args.rounds} interleaved rounds, {args.dtype} on {args.device}"
    )
    print(f"{'config':14s} {'median s':>9s} {'x hf':>6s} {'word_ppl':>10s}")
    for row in rows:
        print(
            f"{row['config']:14s} {row['median_s']:9.2f} {row['ratio_vs_hf']:6.2f} {row['word_perplexity']:10.4f}"
        )
    out = {
        "benchmark": "eval_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": args.model,
        "model_dir": str(model_dir),
        "limit": args.limit,
        "rounds": args.rounds,
        "dtype": args.dtype,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "rows": rows,
    }
    if args.output:
        from kvcal.io import atomic_write_json

        atomic_write_json(args.output, out)
    out["auto_equals_hf"] = ppl["kvcal-auto"] == ppl["hf"]
    print(f"parity: kvcal-auto word_perplexity == hf: {out['auto_equals_hf']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
