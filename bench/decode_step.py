"""Benchmark: one layer's decode step on the CPU torch path, in process (the cache write + the read that keeps the
torch path's workspace in step, so the fused C write engages where the format has one).

    OMP_NUM_THREADS=1 PYTHONPATH=<tree> python bench/decode_step.py [--formats int8_per_token_head,nvfp4,...] \\
        [--steps 300] [-o bench/out/decode_step.json]

Per format: a 256-token prefill into a one-layer `QuantizedKVCache` (2 KV heads, head_dim 64), 20 warm-up steps,
then `--steps` timed steps of one token (`update` + `fast.dequantize_fast` of K and V); the median in microseconds.
Run it on two trees alternately (PYTHONPATH=<before>, then <after>, several rounds) to compare a change: the tree
is whatever `kvcal` imports. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvcal import formats
from kvcal.kernels import fast
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache

FORMATS = "int8_per_token_head,nvfp4,fp8_e4m3,fp4_e2m1,int4_per_token_head,turboquant_4bit_nc,turboquant_k3v4_nc,bf16"


def step_us(name: str, steps: int) -> float:
    kf, vf = formats.kv_pair(name)
    # trees before issue 40 rotated TurboQuant keys with per-layer signs, read from the plan's k_scale (their C write
    # needs them there); later trees rotate by the releases' H / sqrt(D) and take no scale
    signed = kf.name.startswith("tq_mse") and hasattr(formats, "tq_signs")
    kw = {"k_scale": formats.tq_signs(64, 3)} if signed else {}
    cache = QuantizedKVCache([LayerPlan(index=3, fmt=kf, v_fmt=None if vf is kf else vf, **kw)])
    g = torch.Generator().manual_seed(0)

    def step(t: int) -> None:
        k, v = torch.randn(1, 2, t, 64, generator=g), torch.randn(1, 2, t, 64, generator=g)
        r = cache.update(k, v, 0)[0].kvcal_read
        fast.dequantize_fast(r.k, r.fmt, r.workspaces[0], r.k_start)
        fast.dequantize_fast(r.v, r.v_fmt or r.fmt, r.workspaces[1], r.k_start)

    step(256)
    for _ in range(20):
        step(1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=FORMATS)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("-o", "--output", default=str(Path(__file__).parent / "out" / "decode_step.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [{"format": f, "step_us": round(step_us(f, args.steps), 1)} for f in args.formats.split(",")]
    print(f"{'format':24s} {'us/step':>8s}")
    for r in rows:
        print(f"{r['format']:24s} {r['step_us']:8.1f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kvcal": formats.__file__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
