"""Where the peak RSS of a `kvcal eval ... --tasks kl` run comes from, phase by phase (Linux only).

Runs the given `kvcal eval` command in this process with probes: at every boundary of kl's work (each chunk's
forward per side, the last layer, the LM head, the baseline's float16 log-probs, the statistics) it records the
RSS now and the peak RSS since the previous boundary (`VmHWM` of /proc/self/status, reset at each boundary by
writing 5 to /proc/self/clear_refs), and the bytes the kl caches hold in codes (+ block scales) and in the torch
path's float32 workspaces. Then it breaks the peak down: mapped files (shared libraries, and the weights where
transformers maps the safetensors file, as it does when the file's dtype is the load's), the anonymous memory the
process had when the model was loaded (Python, torch, lm-eval, tokenizer, text), the caches' codes and workspaces,
the chunk's logits alive there (the evaluated side's logits and the baseline's float16 log-probs), and the rest
(temporaries of the phase, freed memory the allocator kept).

    python bench/kl_memory.py -o bench/out/kl_memory_8k.json -- smollm2 -f nvfp4 --tasks kl --kl-seq-len 8192 \\
        --limit 1 --data-dir ../shared/data -o /tmp/kl-8k

The run's peak is the largest of the phases' peaks: resetting VmHWM also resets the high-water mark the kernel
reports as `ru_maxrss`, so `/usr/bin/time`'s maximum and kvcal's own "peak RSS" line show only the last phase's.

The probes wrap `kvcal.evaluate.kl.forward_session`, `token_stats` and `_fp16_logprobs_blocked` and hook the model's
last decoder layer and LM head (a Llama-like `model.model.layers` / `lm_head`); they allocate nothing measurable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MiB = 2**20


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon (tensors, the heap) and RssFile (mapped files: libraries, weights read by mmap), bytes."""
    text = open("/proc/self/status").read()
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in keys}  # type: ignore[union-attr]


class Probe:
    """Boundaries of kl's work with the RSS there and the peak since the previous one."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.events: list[dict[str, Any]] = []
        self.caches: list[Any] = []
        self.model: Any = None
        self.logits_bytes = {"evaluated": 0, "baseline_lp16": 0}
        self.mark("start")

    def mark(self, label: str, **extra: Any) -> None:
        st = _status()
        self.events.append(
            {
                "label": label,
                "t_s": round(time.time() - self.t0, 1),
                "rss": st["VmRSS"],
                "peak_since_last": st["VmHWM"],
                "rss_anon": st["RssAnon"],
                "rss_file": st["RssFile"],
                **extra,
            }
        )
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS

    def cache_bytes(self) -> dict[str, int]:
        """Bytes allocated by every kl cache so far: codes + block scales, and the float32 workspaces."""
        codes = ws = 0
        for cache in self.caches:
            for layer in getattr(cache, "layers", []):
                for side in getattr(layer, "_sides", {}).values():
                    codes += sum(b.data.nbytes for b in (side.codes, side.block_scales) if b.data is not None)
                    d = side.workspace.values.data
                    ws += 0 if d is None else d.nbytes
        return {"codes": codes, "workspace": ws}

    def install(self) -> None:
        from kvcal.evaluate import kl

        forward_session, token_stats, lp16 = kl.forward_session, kl.token_stats, kl._fp16_logprobs_blocked
        probe = self

        def hooked_session(model: Any, cache: Any) -> Any:
            if probe.model is None:
                probe.model = model
                probe.mark("model loaded")
                model.model.layers[-1].register_forward_hook(lambda *_: probe.mark("  last layer done"))
                model.lm_head.register_forward_hook(lambda _m, _a, out: probe._head(out))
            probe.caches.append(cache)
            side = f"cache {len(probe.caches)}"
            run = forward_session(model, cache)

            def forward(ids: Any, keep: Any = None) -> Any:
                probe.mark(f"{side}: forward of {ids.shape[1]} tokens")
                out = run(ids, keep)
                probe.mark(f"{side}: forward done", **probe.cache_bytes())
                return out

            return forward

        def hooked_stats(*args: Any, **kwargs: Any) -> Any:
            probe.mark("statistics (token_stats)")
            out = token_stats(*args, **kwargs)
            probe.mark("statistics done")
            return out

        def hooked_lp16(logits: Any) -> Any:
            probe.mark("baseline float16 log-probs")
            out = lp16(logits)
            probe.logits_bytes["baseline_lp16"] = out.nbytes
            probe.mark("baseline log-probs done")
            return out

        kl.forward_session, kl.token_stats, kl._fp16_logprobs_blocked = hooked_session, hooked_stats, hooked_lp16

    def _head(self, out: Any) -> None:
        self.logits_bytes["evaluated"] = max(self.logits_bytes["evaluated"], out.nbytes)
        self.mark("  lm_head done")

    def breakdown(self) -> dict[str, Any]:
        """The peak and what it is made of (see the module docstring)."""
        peak_i = max(range(len(self.events)), key=lambda i: self.events[i]["peak_since_last"])
        peak = self.events[peak_i]["peak_since_last"]
        loaded = next(e for e in self.events if e["label"] == "model loaded")
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # the caches' sizes at the end of the forward the peak falls in (or the last one before it)
        after = [e for e in self.events[peak_i:] if "codes" in e][:1]
        before = [e for e in reversed(self.events[:peak_i]) if "codes" in e][:1]
        sizes = (after or before or [{"codes": 0, "workspace": 0}])[0]
        # transformers maps a safetensors file whose dtype is the load's (here the float32 folder of a converted
        # GGUF): the weights are file pages, counted in RssFile once a forward has touched them
        files = self.events[peak_i]["rss_file"]
        parts = {
            "mapped files: shared libraries + model weights (mmap of the safetensors)": files,
            "anonymous memory at model load (Python, torch, lm-eval, tokenizer, text)": loaded["rss_anon"],
            "kl caches: codes + block scales": sizes["codes"],
            "kl caches: torch path's float32 workspaces": sizes["workspace"],
            "chunk logits: evaluated side (model dtype)": self.logits_bytes["evaluated"],
            "chunk logits: baseline float16 log-probs": self.logits_bytes["baseline_lp16"],
        }
        parts["rest (temporaries of the phase, memory the allocator kept)"] = peak - sum(parts.values())
        return {
            "peak_rss": peak,
            "peak_phase": self.events[peak_i]["label"],
            "model_weight_bytes": params,
            "parts": parts,
        }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args:
        print("usage: bench/kl_memory.py [-o OUT.json] -- <kvcal eval arguments>", file=sys.stderr)
        return 2
    cut = args.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", help="JSON file for the phases and the breakdown")
    opts = ap.parse_args(args[:cut])
    probe = Probe()
    probe.install()
    from kvcal.cli import app

    try:
        app(["eval", *args[cut + 1 :]], standalone_mode=True)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return int(exc.code) if isinstance(exc.code, int) else 1
    probe.mark("end")
    if probe.model is None:
        print("no kl forward ran: is --tasks kl in the command?", file=sys.stderr)
        return 1
    result = probe.breakdown()
    print(f"\n{'t s':>7s} {'RSS MiB':>8s} {'anon':>6s} {'file':>6s} {'peak MiB':>8s}  phase ending here")
    for e in probe.events:
        flag = "  <- peak" if e["peak_since_last"] == result["peak_rss"] else ""
        print(
            f"{e['t_s']:7.1f} {e['rss'] / MiB:8.0f} {e['rss_anon'] / MiB:6.0f} {e['rss_file'] / MiB:6.0f} "
            f"{e['peak_since_last'] / MiB:8.0f}  {e['label']}{flag}"
        )
    print(f"\npeak RSS {result['peak_rss'] / MiB:.0f} MiB ({result['peak_rss'] / 2**30:.2f} GiB), in the phase "
          f"ending at '{result['peak_phase'].strip()}':")  # fmt: skip
    for name, b in result["parts"].items():
        print(f"  {b / MiB:8.0f} MiB  {name}")
    print(f"  (model weights: {result['model_weight_bytes'] / MiB:.0f} MiB)")
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"command": ["kvcal", "eval", *args[cut + 1 :]], "events": probe.events, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
