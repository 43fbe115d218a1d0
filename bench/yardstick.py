"""The yardstick (issue 42): the same task through the real engine and through `kvcal eval`, time per token and memory.

    OMP_NUM_THREADS=2 python bench/yardstick.py --data-dir ../shared/data [--model smollm2] [--tasks wikitext,gsm8k] \\
        [--formats auto,bf16,fp8_e4m3] [--limits 2,6] [--max-length 2048] [--max-gen-toks 64] [--rounds 2] \\
        [-o bench/out/yardstick.json]

Each cell is one whole process, as a user runs it:
  engine  the `kvcal-lm-eval --model vllm ...` command kvcal prints for the configuration (kvcal.engines, vLLM's
          CPU build in <repo>/.venv-vllm), unchanged but for its --output_path;
  kvcal   `kvcal eval MODEL -f FORMAT --dtype D --tasks TASK --limit N --max-length L --max-gen-toks T`.
Every cell runs at two sizes (`--limits A,B` documents or questions): the engine's start-up (minutes on a small
CPU) and kvcal's model load are fixed costs, so the steady cost per token is the MARGINAL one,
(wall(B) - wall(A)) / (tokens(B) - tokens(A)); the whole-process time at B is reported beside it.
Same model, dtype, documents and window on both sides. The engine runs `auto` (its cache in the model dtype: the
row for kvcal's `auto` and `bf16`) and `fp8_e4m3` where the CPU has AVX-512 or AMX (elsewhere the cell says why it
is missing). Cells are interleaved: each round runs every (task, side, format) in an order rotated per round.

Figures per cell: whole-process wall seconds (start-up and model load included: what the user waits for), the
tokens the task scored (wikitext: the documents' tokens, by the model's tokenizer) or generated (gsm8k: the first
filter's responses re-tokenized, the same count on both sides), marginal ms per token, and memory: the peak over the run of
the process tree's summed PSS (proportional set size, so pages the engine's processes share count once) and the
largest single-process RSS, sampled every 0.5 s (psutil). kvcal's ratio: its marginal ms per token over the
engine's of the same task and format (`auto` for kvcal's auto and bf16; goal, issue 42: <= 2x for the formats the
engine runs; every other kvcal format: <= 2x kvcal's `auto`, the `/ kvcal auto` column, which `--sides kvcal`
measures alone). `--profile` adds one cProfile'd
`kvcal eval` per task and format (`--profile-formats` picks some), grouped by where the time goes (model forward,
kvcal's cache and attention, scoring, lm-eval, loading).

`--engine-env VAR=VALUE` (repeatable) adds a second engine side, `engine+env`, the same printed command with those
variables set: e.g. `VLLM_CPU_NUM_OF_RESERVED_CPU=0`, since vLLM's CPU build keeps one core per rank for its
scheduler on x86 and computes with the rest (one OpenMP thread on a 2-core machine). kvcal's rows are compared with
the engine as a user starts it (`engine`) and, when given, with `engine+env`. The JSON is rewritten after every cell,
so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "vllm-cpu"


def _env(threads: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}  # fmt: skip
    env.pop("ATEN_CPU_CAPABILITY", None)
    return env


def _tree_memory(pid: int) -> tuple[float, float]:
    """(sum of PSS over the process and its descendants, largest single RSS), MiB."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    pss = rss = 0.0
    for p in procs:
        try:
            full = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        pss += getattr(full, "pss", full.rss)
        rss = max(rss, full.rss)
    return pss / 2**20, rss / 2**20


def run_process(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run `cmd` to the end; its wall seconds and memory peaks (sampled every 0.5 s)."""
    peak = {"pss": 0.0, "rss": 0.0}
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                pss, rss = _tree_memory(proc.pid)
                peak["pss"], peak["rss"] = max(peak["pss"], pss), max(peak["rss"], rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        done.set()
        sampler.join()
    wall = time.perf_counter() - t0
    if code != 0:
        sys.stderr.write(log.read_text()[-3000:])
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}  (log: {log})")
    return {"wall_s": wall, "peak_pss_mib": peak["pss"], "peak_rss_mib": peak["rss"]}


def _samples(folder: Path, task: str) -> list[dict[str, Any]]:
    """The per-sample records of `task` under an lm-eval output folder or a kvcal run directory."""
    files = sorted(folder.rglob(f"samples_{task}*.jsonl"))
    if not files:
        raise SystemExit(f"no samples_{task}*.jsonl under {folder}")
    return [json.loads(x) for x in files[-1].read_text().splitlines() if x.strip()]


def count_tokens(tokenizer: Any, samples: list[dict[str, Any]], task: str) -> int:
    """Tokens the task scored (a rolling log-likelihood task: its documents) or generated (the first filter's
    responses), counted by one tokenizer the same way for either side."""
    if task == "wikitext":
        return sum(len(tokenizer(s["doc"]["page"])["input_ids"]) for s in samples)
    first = samples[0].get("filter")
    resps = [s["resps"][0][0] for s in samples if s.get("filter") == first]  # the first generation, raw text
    return sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in resps)


def engine_command(
    args: argparse.Namespace, model_dir: str, task: str, fmt: str, limit: int, out: Path
) -> list[str] | str:
    """The printed engine command for the cell (argv), or why the engine cannot run it here."""
    from kvcal.engine_env import find_engine
    from kvcal.engines import EngineSetup, commands_dict
    from kvcal.errors import UsageError

    setup = EngineSetup(model_dir=model_dir, kv_format=fmt, dtype=args.dtype, tasks=(task,), limit=limit,
                        max_gen_toks=args.max_gen_toks if task != "wikitext" else None, max_length=args.max_length,
                        data_dir=args.data_dir, label=f"{task}-{fmt}")  # fmt: skip
    d = commands_dict(setup)[ENGINE]
    if d.get("refused"):
        return str(d["refused"])
    try:
        env = find_engine("vllm")
    except UsageError as exc:
        return str(exc)
    if fmt != "auto" and env.fp8_kv is not None:
        return env.fp8_kv
    argv = list(d["lm_eval_argv"])  # the printed command's argument list (EngineCommand.to_dict)
    argv[argv.index("--output_path") + 1] = str(out)
    return [sys.executable, "-m", "kvcal.evaluate.lm_eval_cli", *argv[1:]]


def kvcal_command(args: argparse.Namespace, task: str, fmt: str, limit: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "kvcal.cli", "eval", args.model, "-f", fmt, "--dtype", args.dtype, "--tasks", task,
           "--limit", str(limit), "--max-length", str(args.max_length), "-o", str(out)]  # fmt: skip
    if task != "wikitext":
        cmd += ["--max-gen-toks", str(args.max_gen_toks)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.kvcal_batch_size:
        cmd += ["--batch-size", str(args.kvcal_batch_size)]
    return cmd


_GROUPS = (  # (group, substrings of a profiled function's file): the first match wins
    ("loading", ("safetensors", "transformers/modeling_utils", "tokenization", "transformers/models/auto/")),
    ("kvcal cache + attention", ("kvcal/kernels/", "kvcal/formats/")),
    ("kvcal scoring", ("kvcal/evaluate/scoring", "kvcal/evaluate/adapter", "kvcal/evaluate/rolling")),
    ("lm-eval", ("lm_eval/",)),
    ("model forward", ("transformers/", "torch/nn/")),
)


def _group(file: str) -> str:
    return next((name for name, keys in _GROUPS if any(k in file for k in keys)), "other")


def profile_kvcal(cmd: list[str], out: Path) -> dict[str, float]:
    """cProfile one `kvcal eval` (in this process): tottime per group of _GROUPS, s."""
    from kvcal.cli import app

    prof = cProfile.Profile()
    argv = cmd[cmd.index("eval") :]
    try:
        prof.runcall(app, argv, standalone_mode=False)
    finally:
        prof.dump_stats(str(out / "profile.pstats"))
    return group_profile(out / "profile.pstats")


def group_profile(path: Path) -> dict[str, float]:
    """A saved profile's (profile.pstats) own time per group of _GROUPS, s; run again on an old profile to regroup it."""
    stats = pstats.Stats(str(path))
    groups: dict[str, float] = {g: 0.0 for g, _ in _GROUPS} | {"other": 0.0}
    for (file, _, _), (_, _, tt, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file != "~":
            groups[_group(file)] += tt
            continue
        # a builtin (torch's C++ ops: matmuls, SDPA, the codec's casts) has no file: its time goes to the groups of
        # the functions that called it, each caller's share as cProfile recorded it
        shares = {c: v[2] for c, v in callers.items()}
        total = sum(shares.values())
        if not total:
            groups["other"] += tt
            continue
        for caller, share in shares.items():
            groups[_group(caller[0])] += tt * share / total
    return groups


def summarize(
    cells: list[dict[str, Any]], plan: list[tuple[str, str, str, int]], limits: list[int]
) -> list[dict[str, Any]]:
    """One row per (task, side, format): medians over rounds at each size, the marginal ms per token between the
    two sizes, and kvcal's ratio to the engine's row of the same task and format (`auto` for kvcal's auto / bf16)."""

    def med(task: str, side: str, fmt: str, n: int, key: str) -> float | None:
        xs = [c[key] for c in cells if (c["task"], c["side"], c["format"], c["limit"]) == (task, side, fmt, n)]
        return statistics.median(xs) if xs else None

    def marginal(task: str, side: str, fmt: str) -> float | None:
        a, b = (med(task, side, fmt, n, "wall_s") for n in limits)
        ta, tb = (med(task, side, fmt, n, "tokens") for n in limits)
        if None in (a, b, ta, tb) or tb <= ta:  # type: ignore[operator]
            return None
        return 1000 * (b - a) / (tb - ta)  # type: ignore[operator]

    rows = []
    for task, side, fmt in dict.fromkeys((t, s, f) for t, s, f, _ in plan):
        ms = marginal(task, side, fmt)
        if ms is None:
            continue
        eng_fmt = "fp8_e4m3" if fmt.startswith("fp8") else "auto"
        kv_auto = marginal(task, "kvcal", "auto")
        eng, eng_env = marginal(task, "engine", eng_fmt), marginal(task, "engine+env", eng_fmt)
        rows.append({"task": task, "side": side, "format": fmt, "wall_s": med(task, side, fmt, limits[1], "wall_s"),
                     "tokens": med(task, side, fmt, limits[1], "tokens"), "marginal_ms_per_token": ms,
                     "vs_engine_same_format": ms / eng if eng and side != "engine" else None,
                     "vs_engine_env_same_format": ms / eng_env if eng_env and side == "kvcal" else None,
                     "vs_kvcal_auto": ms / kv_auto if side == "kvcal" and kv_auto else None,
                     "peak_pss_mib": med(task, side, fmt, limits[1], "peak_pss_mib"),
                     "peak_rss_mib": med(task, side, fmt, limits[1], "peak_rss_mib")})  # fmt: skip
    return rows


def _var(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--engine-env takes VAR=VALUE, got {text!r}")
    return name, value


def _write(
    args: argparse.Namespace, extra: dict[str, str], missing: dict[str, str], cells: list[dict[str, Any]],
    table: list[dict[str, Any]], profiles: dict[str, dict[str, float]],
) -> None:
    """The JSON report, rewritten whole (atomically) after every cell."""
    from kvcal.io import atomic_write_text

    report = {
        "bench": "yardstick", "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "note": args.note, "engine_env": extra, "goal": {"vs_engine_same_format": 2.0}, "missing": missing,
        "cells": cells, "table": table, "profiles": profiles,
    }  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output, json.dumps(report, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", default="wikitext,gsm8k")
    p.add_argument(
        "--formats", default="auto,bf16,fp8_e4m3", help="kvcal's formats; the engine runs auto and fp8"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sides", default="engine,kvcal", help="engine, kvcal or both (kvcal alone: formats vs auto)")
    p.add_argument("--limits", default="2,6", help="two sizes A,B (documents / questions): the marginal cost")
    p.add_argument(
        "--max-length", type=int, default=2048, help="the window: lm-eval max_length = max_model_len"
    )
    p.add_argument("--max-gen-toks", type=int, default=64)
    p.add_argument(
        "--kvcal-batch-size", type=int, default=None, help="kvcal eval --batch-size (default: its own)"
    )
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="one cProfile'd kvcal eval per task and format")
    p.add_argument("--profile-formats", default=None, help="with --profile: these formats only (default: all)")
    p.add_argument(
        "--engine-env", action="append", default=[], metavar="VAR=VALUE",
        help="add an `engine+env` side: the engine's command with these variables set (repeatable)",
    )
    p.add_argument("--note", default="", help="what else ran on the machine (recorded in the JSON)")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "yardstick.json"))
    args = p.parse_args()
    if args.data_dir:
        args.data_dir = str(Path(args.data_dir).resolve())
    from transformers import AutoTokenizer

    from kvcal.models.resolve import resolve_model

    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tasks, formats = args.tasks.split(","), args.formats.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="kvcal-bench-yardstick-"))
    work.mkdir(parents=True, exist_ok=True)
    env = _env(args.threads)
    extra = dict(_var(x) for x in args.engine_env)
    sides = set(args.sides.split(","))
    if not sides or sides - {"engine", "kvcal"}:
        raise SystemExit(f"--sides takes engine, kvcal or both, got {args.sides}")
    limits = [int(x) for x in args.limits.split(",")]
    if len(limits) != 2 or not 0 < limits[0] < limits[1]:
        raise SystemExit(f"--limits takes two sizes A,B with 0 < A < B, got {args.limits}")
    engine_sides = (("engine", "engine+env") if extra else ("engine",)) if "engine" in sides else ()
    plan: list[tuple[str, str, str, int]] = []  # (task, side, format, limit)
    for task in tasks:
        for n in limits:
            for side in engine_sides:
                plan += [(task, side, f, n) for f in ("auto", "fp8_e4m3") if f in formats or f == "auto"]
            plan += [(task, "kvcal", f, n) for f in formats if "kvcal" in sides]
    cells: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    for r in range(args.rounds):
        shift = (r * len(plan)) // max(args.rounds, 1)
        for task, side, fmt, n in plan[shift:] + plan[:shift]:
            out = work / f"{task}-{side}-{fmt}-n{n}-r{r}"
            if side.startswith("engine"):
                cmd = engine_command(args, model_dir, task, fmt, n, out)
                if isinstance(cmd, str):
                    missing[f"{task} {side} {fmt}"] = cmd
                    continue
            else:
                cmd = kvcal_command(args, task, fmt, n, out)
            load0 = os.getloadavg()
            res = run_process(cmd, {**env, **extra} if side == "engine+env" else env, work / f"{out.name}.log")
            tokens = count_tokens(tokenizer, _samples(out, task), task)
            cells.append({"task": task, "side": side, "format": fmt, "limit": n, "round": r, "tokens": tokens,
                          **res, "loadavg_before": load0, "loadavg_after": os.getloadavg(), "command": cmd})  # fmt: skip
            print(f"  {task:9s} {side:10s} {fmt:9s} n={n:<3d} r{r}: {res['wall_s']:7.1f} s, {tokens} tokens, "
                  f"PSS {res['peak_pss_mib']:.0f} MiB (load {load0[0]:.1f})", flush=True)  # fmt: skip
            _write(args, extra, missing, cells, summarize(cells, plan, limits), {})
    table = summarize(cells, plan, limits)
    profiles: dict[str, dict[str, float]] = {}
    if args.profile:
        os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM")})
        for task in tasks:
            for fmt in args.profile_formats.split(",") if args.profile_formats else formats:
                out = work / f"profile-{task}-{fmt}"
                out.mkdir()
                profiles[f"{task} {fmt}"] = profile_kvcal(kvcal_command(args, task, fmt, limits[1], out / "run"), out)
    _write(args, extra, missing, cells, table, profiles)
    print(f"\n{args.model} --dtype {args.dtype} --limits {args.limits} --max-length {args.max_length} "
          f"--max-gen-toks {args.max_gen_toks}, {args.rounds} round(s), {args.threads} thread(s)"
          f"{'; ' + args.note if args.note else ''}")  # fmt: skip
    print(f"| task | side | format | wall s at {limits[1]} | tokens at {limits[1]} | marginal ms/token | "
          "/ engine same format | / kvcal auto | peak PSS MiB | peak RSS MiB |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in table:
        same = "" if row["vs_engine_same_format"] is None else f"{row['vs_engine_same_format']:.2f}x"
        if row["vs_engine_env_same_format"] is not None:
            same += f" (engine+env: {row['vs_engine_env_same_format']:.2f}x)"
        kv = "" if row["vs_kvcal_auto"] is None else f"{row['vs_kvcal_auto']:.2f}x"
        print(f"| {row['task']} | {row['side']} | {row['format']} | {row['wall_s']:.1f} | {row['tokens']:.0f} | "
              f"{row['marginal_ms_per_token']:.2f} | {same} | {kv} | {row['peak_pss_mib']:.0f} | "
              f"{row['peak_rss_mib']:.0f} |")  # fmt: skip
    if extra:
        print("engine+env: the engine with " + " ".join(f"{k}={v}" for k, v in extra.items()))
    for cell, why in missing.items():
        print(f"missing: {cell}: {why}")
    for name, groups in profiles.items():
        total = sum(groups.values())
        print(f"profile {name}: " + ", ".join(f"{g} {t:.1f} s ({t / total:.0%})" for g, t in groups.items()))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
