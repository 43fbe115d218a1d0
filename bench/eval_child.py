"""One whole `kvcal eval` child process, as the user runs it, timed from outside (shared by the benches that
compare such processes: bench/loglikelihood.py, bench/decode_eval.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_eval(args: list[str], code: str | Path, out: Path, threads: int, command: str = "eval") -> dict[str, Any]:
    """`python -m kvcal.cli COMMAND ARGS -o OUT` (COMMAND: eval unless given) with PYTHONPATH = `code` (a checkout or an exported tree) -> the child's
    wall s, CPU s (user + sys), peak RSS MiB (wait4's ru_maxrss) and its metrics.json (the run's own timing)."""
    if out.exists():  # kvcal eval would resume it (or skip it, complete): nothing would be timed
        raise SystemExit(f"{out} exists: remove it or pass another --work folder")
    cmd = [sys.executable, "-m", "kvcal.cli", command, *args, "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(code).resolve()), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=Path(code))
    output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.stderr.write(output[-3000:])
        raise SystemExit(f"kvcal {command} {' '.join(args)} failed (code {code})")
    found = sorted(out.rglob("metrics.json")) if out.is_dir() else []
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "metrics": json.loads(found[0].read_text()) if found else {},
    }
