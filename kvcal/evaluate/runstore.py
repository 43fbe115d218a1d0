"""The run directory: what one `kvcal eval` writes, how a rerun recognises it, how a crash resumes.

RUN_DIR/
  config.yaml            everything needed to rerun (written first; its hash identifies the run)
  env.json               versions, device, kvcal git revision
  tasks/<task>.json      one finished task: lm-eval's results dict for that task alone (resume skips it)
  samples_<task>.jsonl   per-sample records (lm-eval's --log_samples records; kvcal's kl: one per window)
  results.json           lm-eval's results dict, merged over the tasks
  metrics.json           wall time, tokens/s, peak RSS / GPU memory, cache bytes per token, capacity multiplier
  COMPLETE               written last: {"finished": ..., "config_hash": ...}

Every file is written atomically (kvcal.io), so an interrupted run leaves only whole files and no COMPLETE.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import KvcalError
from kvcal.io import atomic_write_json, atomic_write_text

CONFIG = "config.yaml"
ENV = "env.json"
RESULTS = "results.json"
METRICS = "metrics.json"
COMPLETE = "COMPLETE"
TASKS_DIR = "tasks"

# Config keys that do not change what is measured (a rerun with another value is the same run). model_dir is where
# kvcal's cache happens to hold a converted GGUF (its name can change between kvcal versions); `model` names it.
NON_IDENTITY_KEYS = frozenset({"kvcal_version", "run_dir", "scales_path", "model_dir"})


def identity(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in NON_IDENTITY_KEYS}


def config_hash(config: dict[str, Any]) -> str:
    blob = json.dumps(identity(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def samples_file(task: str) -> str:
    return f"samples_{task}.jsonl"


class RunStore:
    """One run directory. `open()` decides: fresh, resume (same config, no COMPLETE), complete (skip) or
    mismatch (KvcalError, nothing touched)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # ---- state ------------------------------------------------------------------------------------------

    def read_config(self) -> dict[str, Any] | None:
        path = self.root / CONFIG
        if not path.is_file():
            return None
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise KvcalError(
                f"'{path}' is not valid YAML ({exc}); move the run directory aside and rerun"
            ) from exc
        if not isinstance(cfg, dict):
            raise KvcalError(f"'{path}' is not a kvcal run config; choose another -o directory")
        return cfg

    def is_complete(self, config: dict[str, Any] | None = None) -> bool:
        marker = self.root / COMPLETE
        if not marker.is_file():
            return False
        if config is None:
            return True
        try:
            return json.loads(marker.read_text(encoding="utf-8")).get("config_hash") == config_hash(config)
        except (json.JSONDecodeError, AttributeError):
            return False

    def open(self, config: dict[str, Any]) -> str:
        """Prepare the directory for `config`: returns 'complete', 'resume' or 'fresh'."""
        if self.root.exists() and not self.root.is_dir():
            raise KvcalError(f"-o '{self.root}' is a file; pass a directory for the run")
        existing = self.read_config()
        if existing is None:
            if self.root.is_dir() and any(p for p in self.root.iterdir() if not p.name.startswith(".")):
                raise KvcalError(
                    f"'{self.root}' is not empty and holds no kvcal run (no {CONFIG}); choose an empty or new -o directory"
                )
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.root / CONFIG, yaml.safe_dump(config, sort_keys=False))
            return "fresh"
        diffs = config_differences(existing, config)
        if diffs:
            raise KvcalError(
                f"run directory '{self.root}' belongs to a different configuration ({'; '.join(diffs[:4])}); "
                "choose another -o directory (nothing was changed)"
            )
        if self.is_complete(config):
            return "complete"
        return "resume"

    # ---- per task ---------------------------------------------------------------------------------------

    def task_result_path(self, task: str) -> Path:
        return self.root / TASKS_DIR / f"{task}.json"

    def finished_task(self, task: str) -> dict[str, Any] | None:
        path = self.task_result_path(task)
        if not path.is_file() or not (self.root / samples_file(task)).is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return None  # cannot happen with atomic writes, but a hand-edited file is simply redone

    def save_task(self, task: str, result: dict[str, Any], samples: list[dict[str, Any]]) -> None:
        """Samples first, then the per-task result: a task counts as finished only when both exist."""
        lines = "".join(json.dumps(s, default=_json_default, ensure_ascii=False) + "\n" for s in samples)
        atomic_write_text(self.root / samples_file(task), lines)
        atomic_write_json(self.task_result_path(task), result)

    # ---- whole run --------------------------------------------------------------------------------------

    def write_json(self, name: str, obj: Any) -> None:
        atomic_write_json(self.root / name, obj)

    def mark_complete(self, config: dict[str, Any]) -> None:
        atomic_write_json(
            self.root / COMPLETE,
            {
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "config_hash": config_hash(config),
            },
        )


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = identity(old), identity(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key)!r} here, {b.get(key)!r} asked")
    return out


def _json_default(obj: Any) -> Any:
    """lm-eval sample records hold tuples, numpy scalars and the odd object; write them as JSON values."""
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)
