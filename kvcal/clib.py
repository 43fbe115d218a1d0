"""kvcal's C sources, compiled once into its cache folder and loaded with ctypes: the fused cache write
(`kvcal/kernels/cpu_write.c`) and calibration's |x| histogram (`kvcal/calibrate/histogram.c`).

Each library is built from its one source with `cc -O2 -ffp-contract=off -fno-fast-math` (no fused multiply-add,
no reassociation: every float operation rounds as torch's does) into `<cache>/<stem>/<stem>-<hash>.so`, where the
hash covers the source, the compiler and the flags; the build is atomic, so concurrent processes write the same
bytes. Each caller has a torch path with the same results and decides what a missing library means (warn or not).
`KVCAL_C=0` turns every C library off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvcal.filecache import cache_root

FLAGS = ("-O2", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
NO_COMPILER = "no C compiler (CC, cc or gcc on PATH)"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(cc: str, source: Path, out: Path) -> str | None:
    """Compile `source` into the shared library `out` (atomically: a concurrent build replaces it with the same
    bytes); None, or why it failed (the compiler's own message)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        try:
            res = subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        except OSError as exc:
            return f"{cc} could not run: {exc}"
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip()
            return f"{cc} exited with {res.returncode}: {msg[-2000:]}"
        os.replace(tmp, out)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, stem: str) -> tuple[ctypes.CDLL | None, str | None, str]:
    """(library, None, path) when `source` is built (now or earlier) and loads; (None, None, reason) when C is
    switched off (KVCAL_C=0) or there is no compiler — an ordinary machine; (None, why, path) when the build or
    the load failed (the caller warns)."""
    if os.environ.get("KVCAL_C", "1") == "0":
        return None, None, "KVCAL_C=0"
    cc = compiler()
    if cc is None:
        return None, None, NO_COMPILER
    tag = hashlib.sha256(source.read_bytes() + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    out = cache_root() / stem / f"{stem}-{tag}.so"
    why = None if out.exists() else build(cc, source, out)
    if why is not None:
        return None, why, str(out)
    try:
        return ctypes.CDLL(str(out)), None, str(out)
    except OSError as exc:
        return None, f"{out} did not load: {exc}", str(out)
