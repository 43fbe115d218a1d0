"""Evaluation: the lm-eval adapter (`kvcal` model), tasks (+ kvcal's kl), the run directory store and `run_eval`.

`from kvcal.evaluate import EvalConfig, EvalSpec, eval_spec, run_eval, run_dir_name` is loaded lazily so that importing a submodule
(tasks, runstore) does not import torch or lm-eval.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EvalConfig", "EvalSpec", "eval_spec", "run_eval", "run_dir_name"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvcal.evaluate import run, spec

        return getattr(spec if hasattr(spec, name) else run, name)
    raise AttributeError(f"module 'kvcal.evaluate' has no attribute '{name}'")
