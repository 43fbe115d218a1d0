"""Benchmark: one linear layer's GEMM in float32, bfloat16 and float16 on this CPU, interleaved (issue 42's profile:
why a `--dtype bfloat16` evaluation spends its time in `torch._C._nn.linear`).

    OMP_NUM_THREADS=2 python bench/gemm_dtype.py [--tokens 2048] [--shapes 576x576,1536x576,576x1536] \\
        [--repeats 3] [--rounds 3] [-o bench/out/gemm_dtype.json]

Each shape OUTxIN is a weight [OUT, IN] (SmolLM2-135M's attention projection and MLP by default) applied to
[tokens, IN] activations: `torch.nn.functional.linear` in each dtype, the dtypes in turn per round (order rotated),
median over rounds of the mean of `--repeats` calls after one warm-up call. Prints ms and GFLOP/s per dtype and the
ratio to float32; writes JSON. Without native BF16/FP16 arithmetic (AVX2: no AVX512_BF16, AVX512_FP16 or AMX),
16-bit GEMMs run through conversions and lose to float32 by several times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_linear(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    """Mean seconds of one `linear(x [T, IN], w [OUT, IN])` over `repeats` calls, after a warm-up call."""
    torch.nn.functional.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--shapes", default="576x576,1536x576,576x1536", help="weights OUTxIN")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "gemm_dtype.json"))
    args = p.parse_args()
    names = args.dtypes.split(",")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        out_f, in_f = (int(v) for v in shape.split("x"))
        x = torch.randn(args.tokens, in_f, generator=gen)
        w = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                times[n].append(time_linear(x.to(DTYPES[n]), w.to(DTYPES[n]), args.repeats))
        flop = 2 * args.tokens * in_f * out_f
        med = {n: statistics.median(ts) for n, ts in times.items()}
        for n in names:
            rows.append({"shape": shape, "dtype": n, "ms": 1e3 * med[n], "gflops": flop / med[n] / 1e9,
                         "vs_float32": med[n] / med["float32"] if "float32" in med else None,
                         "times_s": times[n]})  # fmt: skip
    report = {
        "bench": "gemm_dtype", "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": torch.get_num_threads()},
        "rows": rows,
    }  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} "
          f"thread(s), [{args.tokens}, IN] x [OUT, IN]^T, median of {args.rounds} rounds")  # fmt: skip
    print("| weight OUTxIN | dtype | ms | GFLOP/s | time / float32 |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        ratio = "" if row["vs_float32"] is None else f"{row['vs_float32']:.2f}x"
        print(f"| {row['shape']} | {row['dtype']} | {row['ms']:.1f} | {row['gflops']:.1f} | {ratio} |")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
