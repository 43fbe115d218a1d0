"""Decode-attention benchmark over a quantized KV cache: check, time, print a table, write JSON — one call.

    .venv/bin/python bench/attention.py                 # CUDA when present, else the CPU part
    .venv/bin/python bench/attention.py --device cpu    # torch reference decode step vs SDPA on BF16 (ratios)
    .venv/bin/python bench/attention.py --device cuda --max-tokens 1048576   # a shorter GPU run

CPU: the torch path (`kvcal.kernels.fast.quantized_attention_fast`, the plain reference's bits: table dequantize,
then float32 attention; no workspace, so every token is dequantized) for one decode step at 4k and 16k context, per
format, against `torch.nn.functional.scaled_dot_product_attention` on BF16 K/V (ratio = torch path time / SDPA
time; the cost that CPU evaluation pays for seeing quantized K/V).

CUDA: first a correctness sweep (every format and vLLM's TurboQuant presets, decode and prefill, GQA, softcap, sinks,
windows, padding) of the Triton kernels against the reference at small sizes; then, for bf16, fp8_e4m3, nvfp4 and
the four TurboQuant presets (a K/V pair each; MSE keys with layer 0's rotation) and batch x context from
64k to 4M total tokens (one layer of a Llama-3-8B-shaped model: 32 query heads, 8 KV heads, head_dim 128), the
Triton decode kernel is checked against the reference on the first batch row and timed (CUDA events, median of
repeats after autotuning). Achieved bandwidth = bytes of K/V codes + scales + q read (+ output written) / time,
reported against the device's measured copy bandwidth (a 4 GiB device-to-device copy: read + write bytes / time),
with speed-ups over kvcal's own BF16 path (the same kernel on BF16 K/V) and over torch SDPA on BF16 K/V.
Goals on an H200 (issue 4): >= 80% of copy bandwidth at long context, FP8 >= 1.8x BF16, FP4 >= 3x BF16.

Output: a table on stdout and `bench/out/attention.json` (or --out).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from kvcal import formats  # noqa: E402
from kvcal.io import atomic_write_json  # noqa: E402
from kvcal.kernels.fast import quantized_attention_fast  # noqa: E402
from kvcal.kernels.reference import quantized_attention_ref  # noqa: E402

# One attention layer of a Llama-3-8B-shaped model (also Mistral-7B, Qwen2.5-7B: 28/4 heads differ, same idea).
H_Q, H_KV, HEAD_DIM = 32, 8, 128
CPU_CONTEXTS = (4096, 16384)
TQ_FORMATS = tuple(formats.TQ_PRESETS)  # K/V pairs of side formats (formats.kv_pair)
CPU_FORMATS = ("bf16", "fp8_e4m3", "int8_per_token_head", "nvfp4", "fp4_e2m1", "mxfp4", "turboquant_4bit_nc")
GPU_FORMATS = ("bf16", "fp8_e4m3", "nvfp4", *TQ_FORMATS)
# (batch, context): 64k .. 4M tokens in total
GPU_SHAPES = ((1, 65536), (4, 65536), (1, 1048576), (8, 131072), (32, 131072))


def _median_time_cpu(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, clock: Callable[[], float] = time.perf_counter
) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _median_time_cuda(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _quantize_chunked(
    x: torch.Tensor, fmt: str | formats.KVFormat, scale: torch.Tensor | None, rows: int
) -> formats.QTensor:
    """formats.quantize over batch chunks of about `rows` tokens (bounds the float32 temporaries of a multi-GB
    tensor); a static scale makes the chunks identical to one call."""
    b, _, t, _ = x.shape
    step = max(1, rows // t)
    parts = [formats.quantize(x[i : i + step], fmt, scale=scale) for i in range(0, b, step)]
    if len(parts) == 1:
        return parts[0]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return formats.QTensor(
        codes=cat([p.codes for p in parts]),
        block_scales=cat([p.block_scales for p in parts]),
        scale=parts[0].scale,
    )


def _sides(fmt: str) -> tuple[formats.KVFormat, formats.KVFormat, dict[str, Any]]:
    """(K's format, V's format, the `v_fmt` keyword the attention functions take) of a format or TurboQuant preset."""
    kf, vf = formats.kv_pair(fmt)
    return kf, vf, {} if vf is kf else {"v_fmt": vf}


def _static_scale(fmt: str, x: torch.Tensor) -> torch.Tensor | None:
    """A calibrated per-tensor scale, as a scale file would give (fp8: amax/448; nvfp4 global: amax/(448*6))."""
    amax = x.abs().amax().float()
    if fmt.startswith("fp8"):
        return (amax / 448.0).reshape(())
    if fmt == "nvfp4":
        return (amax / (448.0 * 6.0)).reshape(())
    return None


def _slice_q(qt: formats.QTensor, n: int) -> formats.QTensor:
    return formats.QTensor(
        codes=qt.codes[:n],
        block_scales=None if qt.block_scales is None else qt.block_scales[:n],
        scale=qt.scale,
    )


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------------------
# CPU


def bench_cpu(repeats: int, contexts: tuple[int, ...], threads: int) -> dict[str, Any]:
    """Process CPU time (not wall time: a shared machine's time slicing would swamp wall-clock figures) of one
    decode step, median of `repeats`, with `threads` torch threads."""
    torch.manual_seed(0)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows: list[dict[str, Any]] = []
    scaling = HEAD_DIM**-0.5
    timer = functools.partial(_median_time_cpu, clock=time.process_time)
    try:
        for tk in contexts:
            q32 = torch.randn(1, H_Q, 1, HEAD_DIM)
            k32 = torch.randn(1, H_KV, tk, HEAD_DIM)
            v32 = torch.randn(1, H_KV, tk, HEAD_DIM)
            sdpa_ms = {}
            for name, dt in (("bf16", torch.bfloat16), ("f32", torch.float32)):
                sdpa = functools.partial(
                    F.scaled_dot_product_attention,
                    q32.to(dt),
                    k32.to(dt),
                    v32.to(dt),
                    scale=scaling,
                    enable_gqa=True,
                )
                sdpa_ms[name] = timer(sdpa, repeats) * 1e3
            for fmt in CPU_FORMATS:
                kf, vf, kw = _sides(fmt)
                kq = formats.quantize(k32, kf, scale=_static_scale(fmt, k32))
                vq = formats.quantize(v32, vf, scale=_static_scale(fmt, v32))
                kw.update(scaling=scaling, q_start=tk - 1, k_start=0)
                ref_ms = (
                    timer(functools.partial(quantized_attention_fast, q32, kq, vq, kf, **kw), repeats) * 1e3
                )
                rows.append(
                    {
                        "context": tk,
                        "format": fmt,
                        "ref_ms": ref_ms,
                        "sdpa_bf16_ms": sdpa_ms["bf16"],
                        "sdpa_f32_ms": sdpa_ms["f32"],
                        "ratio_ref_over_sdpa": ref_ms / sdpa_ms["bf16"],
                        "ratio_ref_over_sdpa_f32": ref_ms / sdpa_ms["f32"],
                        "kv_bytes": kq.nbytes + vq.nbytes,
                    }
                )
    finally:
        torch.set_num_threads(old_threads)
    return {"rows": rows, "threads": threads, "clock": "process_time", "shape": [1, H_Q, H_KV, HEAD_DIM]}


def print_cpu(res: dict[str, Any]) -> None:
    print(
        f"CPU decode step (process CPU time, median), q [1, {H_Q}, 1, {HEAD_DIM}], {H_KV} KV heads, "
        f"{res['threads']} thread(s)"
    )
    print(
        f"{'context':>8} {'format':<20} {'ref ms':>9} {'sdpa bf16 ms':>13} {'ref/sdpa bf16':>14} "
        f"{'sdpa f32 ms':>12} {'ref/sdpa f32':>13}"
    )
    for r in res["rows"]:
        print(
            f"{r['context']:>8} {r['format']:<20} {r['ref_ms']:>9.2f} {r['sdpa_bf16_ms']:>13.2f} "
            f"{r['ratio_ref_over_sdpa']:>14.2f} {r['sdpa_f32_ms']:>12.2f} {r['ratio_ref_over_sdpa_f32']:>13.2f}"
        )


# ---------------------------------------------------------------------------------------------------------------
# CUDA


def _timer(device: torch.device) -> Callable[..., float]:
    return _median_time_cuda if device.type == "cuda" else _median_time_cpu


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _timer(device)(functools.partial(dst.copy_, src), repeats=10)
    del src, dst
    _empty_cache(device)
    return 2 * nbytes / t


# (tq, tk, group, head_dim, extras) of the correctness sweep; DRY_* are the tiny sizes of --dry-run
CHECK_CASES: tuple[tuple[int, int, int, int, dict[str, Any]], ...] = (
    (1, 4099, 8, 128, {"softcap": 30.0, "sinks": True}),
    (3, 1000, 1, 256, {"sliding_window": 256}),
    (300, 1300, 4, 64, {"sliding_window": 128, "sinks": True, "key_padding": True}),
)
DRY_CHECK_CASES: tuple[tuple[int, int, int, int, dict[str, Any]], ...] = (
    (1, 99, 8, 64, {"softcap": 30.0, "sinks": True}),
    (20, 60, 4, 64, {"sliding_window": 16, "sinks": True, "key_padding": True}),
)
DRY_SHAPES = ((1, 96), (2, 64))


def check_sweep(
    device: torch.device,
    fmts: tuple[str, ...] = (*formats.FORMATS, *TQ_FORMATS),
    cases: tuple[tuple[int, int, int, int, dict[str, Any]], ...] = CHECK_CASES,
) -> list[dict[str, Any]]:
    """Every format and TurboQuant preset, decode and prefill, at small sizes: the GPU kernels (bf16 dots where
    exact, float32 dots otherwise) against the float32 reference."""
    from kvcal.kernels import triton_attention as ta

    # one pinned config per path: the sweep checks numerics, and autotuning ~40 kernel variants would take minutes
    cfg_decode = ta.KernelConfig(16, 64, 4, 2)
    cfg_prefill = ta.KernelConfig(64, 64, 4, 2)
    torch.manual_seed(0)
    out = []
    for fmt in fmts:
        for tq, tk, group, d, extra in cases:
            b = 2
            q = torch.randn(b, H_KV * group // 2, tq, d, device=device, dtype=torch.bfloat16)
            h_kv = q.shape[1] // group
            k = torch.randn(b, h_kv, tk, d, device=device) * 2
            v = torch.randn(b, h_kv, tk, d, device=device)
            if fmt == "auto":
                k, v = k.bfloat16(), v.bfloat16()
            kf, vf, kw = _sides(fmt)
            kq = formats.quantize(k, kf, scale=_static_scale(fmt, k))
            vq = formats.quantize(v, vf, scale=_static_scale(fmt, v))
            kw.update(scaling=d**-0.5, q_start=tk - tq, k_start=0)
            kw["softcap"] = extra.get("softcap")
            kw["sliding_window"] = extra.get("sliding_window")
            if extra.get("sinks"):
                kw["sinks"] = torch.randn(q.shape[1], device=device)
            if extra.get("key_padding"):
                pad = torch.ones(b, tk, dtype=torch.bool, device=device)
                pad[1, : tk // 3] = False
                kw["key_padding"] = pad
            cfg = cfg_decode if tq * group <= 64 else cfg_prefill
            got = ta.attention(q, kq, vq, kf, config=cfg, **kw)
            ref = quantized_attention_ref(q, kq, vq, kf, **kw)
            err = _rel_err(got, ref)
            out.append(
                {
                    "format": fmt,
                    "tq": tq,
                    "tk": tk,
                    "group": group,
                    "head_dim": d,
                    **{name: bool(val) for name, val in extra.items()},
                    "rel_err": err,
                    "ok": err < 2e-2,
                }
            )
    return out


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_cuda(
    device: torch.device,
    repeats: int,
    max_tokens: int,
    save: Callable[[dict[str, Any]], None],
    shapes: tuple[tuple[int, int], ...] = GPU_SHAPES,
    copy_bytes: int = 4 << 30,
) -> dict[str, Any]:
    """Time the decode kernel per shape and format; `save(partial_result)` after every shape, so a run cut short
    by a time limit still leaves its figures."""
    from kvcal.kernels.triton_attention import quantized_attention_triton

    torch.manual_seed(0)
    scaling = HEAD_DIM**-0.5
    bw_copy = copy_bandwidth(device, copy_bytes)
    timer = _timer(device)
    _log(f"copy bandwidth {bw_copy / 1e9:.0f} GB/s")
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"copy_gb_per_s": bw_copy / 1e9, "rows": rows, "shape": [H_Q, H_KV, HEAD_DIM]}
    for b, tk in shapes:
        if b * tk > max_tokens:
            continue
        _log(f"batch {b} x context {tk}")
        q = torch.randn(b, H_Q, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k = torch.randn(b, H_KV, tk, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v = torch.randn(b, H_KV, tk, HEAD_DIM, device=device, dtype=torch.bfloat16)
        kw = dict(scaling=scaling, q_start=tk - 1, k_start=0)
        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=scaling, enable_gqa=True)
        try:  # a backend without native GQA may expand K/V 4x and run out of memory at 4M tokens
            t_sdpa: float | None = timer(sdpa, repeats)
        except torch.cuda.OutOfMemoryError:
            t_sdpa = None
            _empty_cache(device)
        per_fmt: dict[str, float] = {}
        for fmt in GPU_FORMATS:
            kf, vf, kw_fmt = _sides(fmt)
            kq = _quantize_chunked(k, kf, _static_scale(fmt, k), rows=1 << 18)
            vq = _quantize_chunked(v, vf, _static_scale(fmt, v), rows=1 << 18)
            run = functools.partial(quantized_attention_triton, q, kq, vq, kf, **kw, **kw_fmt)
            got = run()  # first call autotunes
            ref = quantized_attention_ref(q[:1], _slice_q(kq, 1), _slice_q(vq, 1), kf, **kw, **kw_fmt)
            err = _rel_err(got[:1], ref)
            t = timer(run, repeats)
            per_fmt[fmt] = t
            nbytes = kq.nbytes + vq.nbytes + q.numel() * q.element_size() * 2  # + q read + output written
            rows.append(
                {
                    "batch": b,
                    "context": tk,
                    "tokens": b * tk,
                    "format": fmt,
                    "ms": t * 1e3,
                    "bytes": nbytes,
                    "gb_per_s": nbytes / t / 1e9,
                    "frac_copy_bw": nbytes / t / bw_copy,
                    "speedup_vs_kvcal_bf16": per_fmt["bf16"] / t,
                    "speedup_vs_sdpa_bf16": None if t_sdpa is None else t_sdpa / t,
                    "sdpa_bf16_ms": None if t_sdpa is None else t_sdpa * 1e3,
                    "rel_err_vs_ref": err,
                    "ok": err < 2e-2,
                }
            )
            del kq, vq, got, ref, run
            _log(f"  {fmt}: {t * 1e3:.3f} ms, rel err {err:.1e}")
        del q, k, v, sdpa
        _empty_cache(device)
        save(res)
    return res


def _fmt(x: float | None) -> str:
    return f"{'n/a':>7}" if x is None else f"{x:>7.2f}"


def print_cuda(check: list[dict[str, Any]], res: dict[str, Any]) -> None:
    if check:
        bad = [c for c in check if not c["ok"]]
        worst = max(check, key=lambda c: c["rel_err"])
        print(f"check: {len(check) - len(bad)}/{len(check)} kernel-vs-reference cases within 2e-2 relative "
              f"(worst {worst['rel_err']:.2e}: {worst['format']} tq={worst['tq']} tk={worst['tk']})")  # fmt: skip
        for c in bad:
            print(f"  FAILED {c}")
    print(
        f"device copy bandwidth: {res['copy_gb_per_s']:.0f} GB/s; decode, {H_Q} q heads / {H_KV} KV heads / d {HEAD_DIM}"
    )
    head = f"{'batch':>5} {'context':>8} {'tokens':>8} {'format':<18} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'x bf16':>7} {'x sdpa':>7} {'rel err':>8}"  # noqa: E501
    print(head)
    for r in res["rows"]:
        print(
            f"{r['batch']:>5} {r['context']:>8} {r['tokens']:>8} {r['format']:<18} {r['ms']:>8.3f} "
            f"{r['gb_per_s']:>7.0f} {100 * r['frac_copy_bw']:>5.0f}% {r['speedup_vs_kvcal_bf16']:>7.2f} "
            f"{_fmt(r['speedup_vs_sdpa_bf16'])} {r['rel_err_vs_ref']:>8.1e}{'' if r['ok'] else '  FAILED'}"
        )


# ---------------------------------------------------------------------------------------------------------------


def _save(path: Path, payload: dict[str, Any], **update: Any) -> None:
    payload.update(update)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, payload)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed repeats (median); default 20 CUDA, 5 CPU"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=4 << 20, help="CUDA: skip shapes with more batch x context"
    )
    ap.add_argument("--contexts", type=int, nargs="*", default=list(CPU_CONTEXTS), help="CPU contexts")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (CPU time is measured)")
    ap.add_argument("--no-check", action="store_true", help="CUDA: skip the all-format correctness sweep")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="run the CUDA part's code on CPU under TRITON_INTERPRET=1 at tiny sizes (checks the script, times nothing)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "attention.json")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        dev = torch.device("cpu")
        meta.update(device="cpu (dry run under the Triton interpreter; timings meaningless)")
        payload = {"meta": meta}
        fmts = ("bf16", "fp8_e4m3", "nvfp4", "turboquant_3bit_nc")
        check = [] if args.no_check else check_sweep(dev, fmts, DRY_CHECK_CASES)
        save = functools.partial(_save, args.out, payload)
        res = bench_cuda(dev, args.repeats or 1, args.max_tokens, lambda r: save(cuda=r), DRY_SHAPES, 1 << 20)
        print_cuda(check, res)
        payload.update(check=check, cuda=res)
        ok = all(c["ok"] for c in check) and all(r["ok"] for r in res["rows"])
    elif device == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
        import triton

        dev = torch.device("cuda")
        meta.update(device=torch.cuda.get_device_name(dev), triton=triton.__version__)
        payload: dict[str, Any] = {"meta": meta}
        save = functools.partial(_save, args.out, payload)
        _log("correctness sweep (every format, decode + prefill)")
        check = [] if args.no_check else check_sweep(dev)
        save(check=check)
        res = bench_cuda(dev, args.repeats or 20, args.max_tokens, lambda r: save(cuda=r))
        print_cuda(check, res)
        payload["cuda"] = res
        ok = all(c["ok"] for c in check) and all(r["ok"] for r in res["rows"])
    else:
        meta.update(device=f"cpu ({platform.processor() or platform.machine()})")
        res = bench_cpu(args.repeats or 5, tuple(args.contexts), args.threads)
        print_cpu(res)
        payload = {"meta": meta, "cpu": res}
        ok = True
    _save(args.out, payload)
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
