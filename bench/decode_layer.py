"""Where a decode step's KV overhead goes: kvcal's cache write + attention for one new token, per format vs `auto`.

Two measurements, side by side in one process (process CPU time, 1 torch thread by default):
  isolated  one attention layer's `Cache.update` + attention function for a 1-token query over a cache of
            `--length` tokens, the same layer repeated (`--reps` calls, median; formats rotated over `--rounds`):
            what the kvcal code costs when everything it touches is hot in the CPU caches;
  in-model  real decode steps of the whole model, formats alternating at every step
            (`bench/long_context.py`'s `interleaved_steps`, as its `--interleave`), with a timer around every `Cache.update`: the cache write's
            share of a step when the model's weights stream through the caches between layers.

    OMP_NUM_THREADS=1 python bench/decode_layer.py --model smollm2 --length 512 -o bench/out/decode_layer.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _isolated(model: Any, fmt: str, length: int, reps: int, layer: int) -> float:
    """Median µs of one cache update + attention call for one new token on layer `layer`."""
    import torch
    from transformers.cache_utils import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvcal.kernels.attention import kvcal_attention_forward
    from kvcal.kernels.runtime import KVRuntime

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    mod = model.model.layers[layer].self_attn
    rt = KVRuntime(model, fmt, impl="torch")
    cache = DynamicCache(config=cfg) if fmt == "auto" else rt.new_cache()
    g = torch.Generator().manual_seed(0)
    cache.update(
        torch.randn(1, hkv, length, d, generator=g), torch.randn(1, hkv, length, d, generator=g), layer
    )
    q = torch.randn(1, hq, 1, d, generator=g)
    k, v = torch.randn(1, hkv, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g)
    attend = sdpa_attention_forward if fmt == "auto" else kvcal_attention_forward
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.process_time()
            kk, vv = cache.update(k, v, layer)
            attend(mod, q, kk, vv, None, scaling=d**-0.5)
            times.append(time.process_time() - t0)
    return 1e6 * statistics.median(times)


def _in_model(model: Any, fmts: list[str], length: int, steps: int) -> dict[str, dict[str, float]]:
    """Median ms per decode step and of its `Cache.update` calls, formats alternating at every step."""
    import torch
    from long_context import interleaved_steps  # bench/ is on sys.path when this file runs as a script
    from transformers.cache_utils import DynamicCache

    from kvcal.kernels.cache import QuantizedKVCache

    spent = [0.0]

    def timed(update: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return update(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - t0

        return wrapper

    originals = (DynamicCache.update, QuantizedKVCache.update)
    DynamicCache.update, QuantizedKVCache.update = timed(originals[0]), timed(originals[1])  # type: ignore[method-assign]
    try:
        ids = torch.randint(
            100, model.config.vocab_size - 100, (1, length), generator=torch.Generator().manual_seed(0)
        )
        # the prefill in one forward; the update time of each step is the change of the running total
        times, updates = interleaved_steps(
            model, fmts, ids, length, steps, "torch", "cpu", probe=lambda: spent[0]
        )
    finally:
        DynamicCache.update, QuantizedKVCache.update = originals  # type: ignore[method-assign]
    rec = {f: {"step": times[f], "update": updates[f]} for f in fmts}
    return {f: {k: 1e3 * statistics.median(v) for k, v in r.items()} for f, r in rec.items()}


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from kvcal.formats import FORMATS
    from kvcal.models.resolve import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=512, help="tokens in the cache")
    ap.add_argument("--formats", default=",".join(n for n in FORMATS if n != "auto"))
    ap.add_argument("--reps", type=int, default=64, help="isolated: calls per format and round")
    ap.add_argument("--rounds", type=int, default=5, help="isolated: rounds (formats rotated)")
    ap.add_argument("--steps", type=int, default=30, help="in-model: decode steps per format")
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-o", "--output", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=torch.float32).eval()
    fmts = ["auto", *[f for f in args.formats.split(",") if f and f != "auto"]]
    iso: dict[str, list[float]] = {f: [] for f in fmts}
    for r in range(args.rounds):
        for fmt in fmts[r % len(fmts) :] + fmts[: r % len(fmts)]:
            iso[fmt].append(_isolated(model, fmt, args.length, args.reps, args.layer))
    inm = _in_model(model, fmts, args.length, args.steps)
    rows = []
    for fmt in fmts:
        rows.append({
            "kv_format": fmt, "isolated_us_per_layer": statistics.median(iso[fmt]),
            "in_model_step_ms": inm[fmt]["step"], "in_model_update_ms_per_step": inm[fmt]["update"],
        })  # fmt: skip
    n_layers = model.config.num_hidden_layers
    print(
        f"\n{args.model}, {args.length} tokens cached, process CPU time, {args.threads} thread(s); isolated: median "
        f"of {args.rounds} rounds x {args.reps} calls on layer {args.layer}; in-model: median of {args.steps} "
        f"interleaved steps ({n_layers} layers)"
    )
    print(f"{'format':20s} {'isolated us/layer':>17s} {'x auto':>7s} {'step ms':>8s} {'update ms/step':>14s}")
    auto = rows[0]
    for r in rows:
        print(
            f"{r['kv_format']:20s} {r['isolated_us_per_layer']:17.1f} "
            f"{r['isolated_us_per_layer'] / auto['isolated_us_per_layer']:7.2f} {r['in_model_step_ms']:8.1f} "
            f"{r['in_model_update_ms_per_step']:14.1f}"
        )
    if args.output:
        from kvcal.io import atomic_write_json

        atomic_write_json(args.output, {
            "benchmark": "decode_layer", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:] if argv is None else argv, "model": args.model, "length": args.length,
            "threads": args.threads, "platform": platform.platform(), "rows": rows,
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
