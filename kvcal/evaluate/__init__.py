"""Evaluation: the lm-eval adapter (`kvcal` model), tasks (+ kvcal's kl), the run directory, and (engineer E's)
sweep, statistics and comparison reports.

`from kvcal.evaluate import EvalConfig, run_eval, run_dir_name` — loaded lazily so that importing
kvcal.evaluate.compare (no torch, no lm-eval) stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EvalConfig", "run_eval", "run_dir_name"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvcal.evaluate import run

        return getattr(run, name)
    raise AttributeError(f"module 'kvcal.evaluate' has no attribute '{name}'")
