"""Long context through kvcal's quantized cache: prefill time and peak memory of one window, and decode speed.

For each context length L and KV format (plus `auto`, the model's own attention over its own-dtype cache), one
fresh process loads the model and
  1. prefills one window of L tokens by chunked prefill (`--prefill-chunk`, as `kvcal eval --tasks kl` does):
     one forward per chunk with the cache as past_key_values, each chunk's logits turned into float16 log-probs
     and dropped (kl's per-chunk work), so peak memory holds the cache and ONE chunk's logits, never L x vocab;
  2. runs `--decode-steps` greedy decode steps after it (one token each, reading the whole cache).
A fresh process per cell makes its peak RSS (`ru_maxrss`) that cell's own; `rss_over_model` is the peak minus the
RSS after loading the model. Times are process CPU time with `--threads` torch threads (default 1: wall time on a
shared machine is meaningless; CPU time is what the work costs), or CUDA-synchronised wall time on a GPU. Rounds
rotate the order of the formats so drift hits all alike; the median over rounds is reported, with each format's
decode speed and prefill time as a ratio to `auto` at the same length. Decode is reported two ways: the median
step ("decode ms", "speed/auto": robust to bursts of load from other jobs) and the mean step ("mean ms",
"mean s/a": includes the occasional step that moves a cache buffer to a larger one).

    OMP_NUM_THREADS=1 python bench/long_context.py --model smollm2 --lengths 512,2k,4k,8k -o bench/long_context.json
    python bench/long_context.py --model gemma3-270m --lengths 2k,8k,32k --decode-steps 16
    python bench/long_context.py --device cuda --impl triton --lengths 8k,32k --model gemma3-270m   # a GPU
    # before/after a change, side by side in one run (cells interleaved, so load on the machine hits both alike):
    python bench/long_context.py --lengths 512 --code before=/tmp/kvcal-before --code after=.
`--code LABEL=DIR` (repeatable) runs each cell with DIR's kvcal package (PYTHONPATH=DIR; a checkout or an
exported tree, e.g. `git archive HEAD | tar -x -C DIR`); ratios are against `auto` of the same code.

Goal (issue 14): decode of every format >= 0.9x `auto` on CPU at 512 tokens and within 1.5x (>= 0.67x) at 8k.
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
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parse_length(text: str) -> int:
    """'2k' -> 2048, '512' -> 512."""
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _clock(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def _cache_bytes(cache: Any) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def one_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one (format, length) in this process (run by a subprocess of `main`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    from kvcal.evaluate.kl import _fp16_logprobs_blocked, forward_session
    from kvcal.kernels.runtime import KVRuntime
    from kvcal.models.resolve import resolve_model

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    model_dir = resolve_model(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, spec["dtype"]))
    model = model.to(device).eval()
    rss_model = _rss()
    fmt, length, chunk = spec["kv_format"], spec["length"], spec["chunk"]
    rt = KVRuntime(model, fmt, impl=spec["impl"])
    cache = DynamicCache(config=model.config) if fmt == "auto" else rt.new_cache()
    ids = torch.randint(
        100, model.config.vocab_size - 100, (1, length), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(device)
    step = forward_session(model, cache)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = _clock(device)
    for s in range(0, length, chunk):
        logits = step(ids[:, s : s + chunk])[0]  # [c, V]
        lp16 = _fp16_logprobs_blocked(logits)  # kl's per-chunk work
        nxt = logits[-1:].argmax(-1)[None]  # [1, 1]
        del logits, lp16
    prefill_s = _clock(device) - t0
    rss_prefill = _rss()
    gpu_prefill = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    step_s = []  # each decode step's time: the median resists bursts of load from other jobs on the machine
    for _ in range(spec["decode_steps"]):
        t0 = _clock(device)
        nxt = step(nxt)[0, -1:].argmax(-1)[None]
        step_s.append(_clock(device) - t0)
    decode_s = sum(step_s)
    return {
        "kv_format": fmt,
        "length": length,
        "prefill_s": prefill_s,
        "decode_ms_per_step": 1e3 * decode_s / max(1, spec["decode_steps"]),
        "decode_ms_median_step": 1e3 * statistics.median(step_s) if step_s else None,
        "decode_tokens_per_s": spec["decode_steps"] / decode_s if decode_s > 0 else None,
        "peak_rss_bytes": rss_prefill,
        "rss_over_model_bytes": rss_prefill - rss_model,
        "peak_gpu_bytes": gpu_prefill,
        "cache_bytes": _cache_bytes(cache),
        "impl": getattr(rt, "impl", "transformers"),
    }


def interleaved_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """`--interleave`: every format's decode steps in ONE process, alternating format at every step (the order
    rotating each round), so a burst of load from other jobs hits all formats alike; speed vs auto is the median
    over rounds of auto's step time / the format's in the same round (paired). Each format's cache is prefilled
    first (chunked, as in one_cell); the model carries one KV configuration at a time, so each step re-installs
    its format's (`KVRuntime`, outside the timed region)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvcal.models.resolve import resolve_model

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model(spec["model"])), dtype=getattr(torch, spec["dtype"])
    )
    model = model.to(device).eval()
    fmts, length = spec["formats"], spec["length"]
    ids = torch.randint(
        100, model.config.vocab_size - 100, (1, length), generator=torch.Generator().manual_seed(0)
    ).to(device)
    times, _ = interleaved_steps(model, fmts, ids, spec["chunk"], spec["decode_steps"], spec["impl"], device)
    return {"length": length, "step_s": times}


def interleaved_steps(
    model: Any,
    fmts: list[str],
    ids: Any,
    chunk: int,
    steps: int,
    impl: str,
    device: str,
    probe: Callable[[], float] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Prefill one cache per format with ids [1, L] (chunked), then `steps` rounds of one greedy decode step per
    format, the order rotating each round and each step's format re-installed (`KVRuntime`) outside the timed
    region. Returns ({format: seconds per step}, {format: change of probe() over each step}; empty without probe:
    e.g. a running total of time spent inside Cache.update)."""
    from transformers.cache_utils import DynamicCache

    from kvcal.evaluate.kl import forward_session
    from kvcal.kernels.runtime import KVRuntime

    step, nxt = {}, {}
    for fmt in fmts:
        rt = KVRuntime(model, fmt, impl=impl)
        step[fmt] = forward_session(
            model, DynamicCache(config=model.config) if fmt == "auto" else rt.new_cache()
        )
        for s in range(0, ids.shape[1], chunk):
            logits = step[fmt](ids[:, s : s + chunk])[0]
        nxt[fmt] = logits[-1:].argmax(-1)[None]
        del logits
    times: dict[str, list[float]] = {f: [] for f in fmts}
    probed: dict[str, list[float]] = {f: [] for f in fmts} if probe is not None else {}
    for r in range(steps):
        for fmt in fmts[r % len(fmts) :] + fmts[: r % len(fmts)]:
            KVRuntime(model, fmt, impl=impl)  # this format's attention on the model
            p0 = probe() if probe is not None else 0.0
            t0 = _clock(device)
            nxt[fmt] = step[fmt](nxt[fmt])[0, -1:].argmax(-1)[None]
            times[fmt].append(_clock(device) - t0)
            if probe is not None:
                probed[fmt].append(probe() - p0)
    return times, probed


def _interleaved_rows(cell: dict[str, Any], code: str) -> list[dict[str, Any]]:
    auto = cell["step_s"]["auto"]
    rows = []
    for fmt, ts in cell["step_s"].items():
        paired = [a / t for a, t in zip(auto, ts, strict=True)]
        rows.append({
            "length": cell["length"], "code": code, "kv_format": fmt, "steps": len(ts),
            "decode_ms_median_step": 1e3 * statistics.median(ts),
            "decode_speed_vs_auto": statistics.median(paired),
            "speed_q1": statistics.quantiles(paired, n=4)[0] if len(paired) > 1 else None,
            "speed_q3": statistics.quantiles(paired, n=4)[2] if len(paired) > 1 else None,
        })  # fmt: skip
    return rows


def _run_cell(spec: dict[str, Any], code_dir: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if code_dir is not None:  # this code's kvcal first on the path
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(code_dir), *filter(None, [env.get("PYTHONPATH")])]
        )
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"cell {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _summarise(
    cells: list[dict[str, Any]], lengths: list[int], formats: list[str], codes: list[str]
) -> list[dict[str, Any]]:
    rows = []
    for length, code in ((n, c) for n in lengths for c in codes):
        by_fmt = {}
        for fmt in ["auto", *formats]:
            mine = [c for c in cells if c["length"] == length and c["kv_format"] == fmt and c["code"] == code]
            by_fmt[fmt] = {
                "prefill_s": statistics.median(c["prefill_s"] for c in mine),
                "decode_ms_per_step": statistics.median(c["decode_ms_per_step"] for c in mine),
                "decode_ms_median_step": statistics.median(c["decode_ms_median_step"] for c in mine),
                "peak_rss_bytes": max(c["peak_rss_bytes"] for c in mine),
                "rss_over_model_bytes": max(c["rss_over_model_bytes"] for c in mine),
                "cache_bytes": mine[0]["cache_bytes"],
                "impl": mine[0]["impl"],
                "rounds": len(mine),
            }
        auto = by_fmt["auto"]
        for fmt, r in by_fmt.items():
            r["decode_speed_vs_auto"] = auto["decode_ms_median_step"] / r["decode_ms_median_step"]
            r["decode_mean_speed_vs_auto"] = auto["decode_ms_per_step"] / r["decode_ms_per_step"]
            r["prefill_time_vs_auto"] = r["prefill_s"] / auto["prefill_s"]
            rows.append({"length": length, "code": code, "kv_format": fmt, **r})
    return rows


def _print_table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    head = (
        f"{'length':>7s} {'code':8s} {'format':20s} {'prefill s':>9s} {'x auto':>6s} {'decode ms':>9s} "
        f"{'speed/auto':>10s} {'mean ms':>8s} {'mean s/a':>8s} {'cache MiB':>9s} {'RSS GiB':>7s} {'+RSS MiB':>8s}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['length']:7d} {r['code']:8s} {r['kv_format']:20s} {r['prefill_s']:9.2f} "
            f"{r['prefill_time_vs_auto']:6.2f} {r['decode_ms_median_step']:9.1f} {r['decode_speed_vs_auto']:10.2f} "
            f"{r['decode_ms_per_step']:8.1f} {r['decode_mean_speed_vs_auto']:8.2f} {r['cache_bytes'] / 2**20:9.1f} "
            f"{r['peak_rss_bytes'] / 2**30:7.2f} {r['rss_over_model_bytes'] / 2**20:8.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one cell, print its JSON
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | HF folder | .gguf")
    ap.add_argument("--lengths", default="2k,4k,8k", help="context lengths, e.g. 512,2k,4k,8k (k = 1024)")
    from kvcal.formats import FORMATS  # every KV format kvcal has; auto is always measured as the reference

    default_formats = ",".join(n for n in FORMATS if n != "auto")
    ap.add_argument("--formats", default=default_formats, help="KV formats besides auto")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", default="auto", help="kvcal attention: auto (triton on CUDA) | torch | triton")
    ap.add_argument(
        "--code",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="measure DIR's kvcal as LABEL (repeatable; before/after side by side); default: this checkout",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="decode only: all formats in one process, alternating at every step (paired speed vs auto)",
    )
    ap.add_argument("-o", "--output", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(interleaved_cell(spec) if "formats" in spec else one_cell(spec)))
        return 0

    lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip() and f.strip() != "auto"]
    configs = ["auto", *formats]
    codes = dict(c.split("=", 1) for c in args.code) if args.code else {"this": None}
    if any("=" not in c for c in args.code):
        raise SystemExit("--code takes LABEL=DIR")
    if args.interleave:
        return _main_interleaved(args, lengths, configs, codes)
    cells = []
    for r in range(args.rounds):
        for length in lengths:
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for fmt, code in ((f, c) for f in order for c in codes):
                spec = dict(
                    model=args.model, kv_format=fmt, length=length, chunk=args.prefill_chunk,
                    decode_steps=args.decode_steps, threads=args.threads, dtype=args.dtype, device=args.device,
                    impl=args.impl,
                )  # fmt: skip
                cell = {"code": code, **_run_cell(spec, codes[code])}
                cells.append(cell)
                print(
                    f"round {r + 1}: L={length} {code} {fmt:10s} prefill {cell['prefill_s']:.2f} s, decode "
                    f"{cell['decode_ms_per_step']:.1f} ms/step, peak RSS {cell['peak_rss_bytes'] / 2**30:.2f} GiB",
                    file=sys.stderr,
                )
    rows = _summarise(cells, lengths, formats, list(codes))
    clock = (
        "CUDA wall time" if args.device.startswith("cuda") else f"process CPU time, {args.threads} thread(s)"
    )
    _print_table(
        rows,
        f"{args.model}, {args.dtype} on {args.device}, prefill chunk {args.prefill_chunk}, {args.decode_steps} "
        f"decode steps, median of {args.rounds} round(s), {clock}",
    )
    out = {
        "benchmark": "long_context",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv[1:] if argv is None else argv,
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "prefill_chunk": args.prefill_chunk,
        "decode_steps": args.decode_steps,
        "threads": args.threads,
        "code": codes,
        "platform": platform.platform(),
        "rows": rows,
        "cells": cells,
    }
    if args.output:
        from kvcal.io import atomic_write_json

        atomic_write_json(args.output, out)
    return 0


def _main_interleaved(
    args: argparse.Namespace, lengths: list[int], configs: list[str], codes: dict[str, str | None]
) -> int:
    rows, cells = [], []
    for length in lengths:
        for code in codes:
            spec = dict(
                model=args.model, formats=configs, length=length, chunk=args.prefill_chunk,
                decode_steps=args.decode_steps, threads=args.threads, dtype=args.dtype, device=args.device,
                impl=args.impl,
            )  # fmt: skip
            cell = _run_cell(spec, codes[code])
            cells.append({"code": code, **cell})
            rows += _interleaved_rows(cell, code)
    clock = (
        "CUDA wall time" if args.device.startswith("cuda") else f"process CPU time, {args.threads} thread(s)"
    )
    print(
        f"\n{args.model}, {args.dtype} on {args.device}, decode steps interleaved across formats "
        f"({args.decode_steps} rounds), {clock}; speed/auto = median over rounds of auto's step / the format's "
        "(q1-q3 of those ratios)"
    )
    print(f"{'length':>7s} {'code':8s} {'format':20s} {'decode ms':>9s} {'speed/auto':>10s} {'q1-q3':>11s}")
    for r in rows:
        q = f"{r['speed_q1']:.2f}-{r['speed_q3']:.2f}" if r["speed_q1"] is not None else ""
        print(
            f"{r['length']:7d} {r['code']:8s} {r['kv_format']:20s} {r['decode_ms_median_step']:9.1f} "
            f"{r['decode_speed_vs_auto']:10.2f} {q:>11s}"
        )
    if args.output:
        from kvcal.io import atomic_write_json

        atomic_write_json(args.output, {
            "benchmark": "long_context_interleaved", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:], "model": args.model, "dtype": args.dtype, "device": args.device,
            "threads": args.threads, "code": codes, "platform": platform.platform(), "rows": rows, "cells": cells,
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
