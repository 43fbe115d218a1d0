"""Triton for kvcal: its import (a Linux-only dependency: kvcal imports without it), the interpreter flag
(`TRITON_INTERPRET=1`: the kernels run on CPU, how the tests run them) and whether the Triton path is available.
The one place kvcal asks; `kvcal.kernels.triton_attention` and `kvcal.kernels.runtime` read it. Nothing here
imports triton until `load()` is called (the runtime asks `triton_available()` without importing it)."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any


@functools.cache
def load() -> tuple[Any, Any, str | None]:
    """(triton, triton.language, None), or (None, None, why) where triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
        return None, None, str(exc)
    return triton, tl, None


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (read when asked: tests set it per test)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """Triton and kvcal's Triton kernels are importable (without importing them)."""
    try:
        return (
            importlib.util.find_spec("triton") is not None
            and importlib.util.find_spec("kvcal.kernels.triton_attention") is not None
        )
    except (ImportError, ValueError):
        return False
