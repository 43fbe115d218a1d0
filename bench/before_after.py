"""Benchmark: one kvcal command under two source trees, interleaved — does a change make the user's path slower,
and does it change the results?

    OMP_NUM_THREADS=2 python bench/before_after.py --code before=/tmp/before --code after=. [--rounds 3] \\
        [-o bench/out/before_after.json] -- eval smollm2 -f fp8_e4m3 --tasks gsm8k --limit 3 --max-gen-toks 128

`/tmp/before` is an exported tree (`git archive REV | tar -x -C /tmp/before`). Each run is one whole
`python -m kvcal.cli ARGS -o OUT` process with PYTHONPATH = that tree (bench/eval_child.py's child, any command that
takes `-o`); per round the trees run in turn, the order alternating, so a drift in machine load hits both. Figures
per run: wall and CPU seconds (user + sys) of the child, its peak RSS (wait4), and for `eval` its decode rate
(metrics.json `decode_tokens_per_s`). Per tree the median over rounds; the ratio is each tree's over the first's,
pair by pair within a round, then the median. Results: every `samples_*.jsonl` (per document: its responses and
filtered responses) and every `.safetensors` file's tensors (not its metadata, which names the code's commit) are
hashed; "identical" says whether every run of every tree produced the same hash. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from eval_child import run_eval  # noqa: E402


def results_hash(out: Path) -> str:
    """A hash of what the run computed: the samples' responses per document and the scale files' tensors."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for path in sorted(out.rglob("samples_*.jsonl")):
        h.update(path.name.encode())
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                h.update(json.dumps([row.get("doc_id"), row.get("resps"), row.get("filtered_resps")]).encode())
    for path in sorted(out.rglob("*.safetensors")):
        h.update(path.name.encode())
        for name, tensor in sorted(load_file(str(path)).items()):
            h.update(name.encode())
            h.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_once(cmd: list[str], code: str, out: Path, threads: int) -> dict[str, Any]:
    """One `kvcal CMD ... -o OUT` child. `calibrate` writes a file: its -o is OUT/scales.safetensors."""
    target = out
    if cmd[0] == "calibrate":
        out.mkdir(parents=True)
        target = out / "scales.safetensors"
    res = run_eval(cmd[1:], code, target, threads, command=cmd[0])
    m = res.pop("metrics")
    res["decode_tokens_per_s"] = m.get("decode_tokens_per_s")
    res["results"] = results_hash(out)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", required=True, help="NAME=TREE (twice or more; the first is the base)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(ROOT / "bench" / "out" / "before_after"))
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "before_after.json"))
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- KVCAL-COMMAND ARGS (without -o)")
    args = p.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd or len(args.code) < 2 or any("=" not in c for c in args.code):
        p.error("give --code NAME=TREE twice or more and a kvcal command after --")
    trees = dict(c.split("=", 1) for c in args.code)
    names = list(trees)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            res = run_once(cmd, trees[name], Path(args.work) / stamp / f"{name}-r{r}", args.threads)
            runs[name].append(res)
            rate = res["decode_tokens_per_s"]
            print(f"  round {r} {name:10s} wall {res['wall_s']:7.1f} s  cpu {res['cpu_s']:7.1f} s  "
                  f"rss {res['peak_rss_mib']:6.0f} MiB" + (f"  decode {rate:6.2f} tok/s" if rate else ""),
                  flush=True)  # fmt: skip
    base = names[0]
    table = []
    for name in names:
        row: dict[str, Any] = {"code": name, "tree": trees[name]}
        for key in ("wall_s", "cpu_s", "peak_rss_mib", "decode_tokens_per_s"):
            vals = [x[key] for x in runs[name]]
            if any(v is None for v in vals):
                continue
            row[key] = statistics.median(vals)
            row[key + "_ratio"] = statistics.median([a[key] / b[key] for a, b in zip(runs[name], runs[base], strict=True)])
        table.append(row)
    identical = len({x["results"] for rs in runs.values() for x in rs}) == 1
    report = {"command": cmd, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds,
              "threads": args.threads, "runs": runs, "table": table, "results_identical": identical}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nkvcal {' '.join(cmd)}: {args.rounds} round(s), medians; ratio = this tree / {base}, paired per round")
    print(f"{'code':10s} {'wall s':>8s} {'ratio':>6s} {'cpu s':>8s} {'ratio':>6s} {'rss MiB':>8s} {'decode tok/s':>13s} "
          f"{'ratio':>6s}")  # fmt: skip
    for row in table:
        dec = row.get("decode_tokens_per_s")
        print(f"{row['code']:10s} {row['wall_s']:8.1f} {row['wall_s_ratio']:6.3f} {row['cpu_s']:8.1f} "
              f"{row['cpu_s_ratio']:6.3f} {row['peak_rss_mib']:8.0f} "
              + (f"{dec:13.2f} {row['decode_tokens_per_s_ratio']:6.3f}" if dec else f"{'—':>13s} {'':>6s}"))  # fmt: skip
    print(f"results identical across trees and rounds: {'yes' if identical else 'NO'}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
