"""The run directory's life cycle: what one `kvcal eval` writes, how a rerun recognises it, how a crash resumes.

The layout, file names and config fields are kvcal.rundir's (RUN_DIR/config.yaml, env.json, tasks/<task>.json,
samples_<task>.jsonl, results.json, metrics.json, COMPLETE). A run is identified by the hash of its config's
identity fields, so a config.yaml written before `run_format` existed hashes as it did then.

Every file is written atomically (kvcal.io), so an interrupted run leaves only whole files and no COMPLETE.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.io import atomic_write_json, atomic_write_text
from kvcal.rundir import COMPLETE, CONFIG, TASKS_DIR, RunConfig, samples_file


def config_hash(config: RunConfig) -> str:
    blob = json.dumps(config.identity(), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class RunStore:
    """One run directory. `open()` decides: fresh, resume (same config, no COMPLETE), complete (skip) or
    mismatch (KvcalError, nothing touched)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # ---- state ------------------------------------------------------------------------------------------

    def read_config(self) -> RunConfig | None:
        path = self.root / CONFIG
        if not path.is_file():
            return None
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise KvcalError(
                f"'{path}' is not valid YAML ({exc}); move the run directory aside and rerun"
            ) from exc
        if not isinstance(raw, dict):
            raise KvcalError(f"'{path}' is not a kvcal run config; choose another -o directory")
        try:
            return RunConfig.from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise KvcalError(
                f"'{path}' is not a kvcal run config ({exc}); choose another -o directory"
            ) from exc

    def is_complete(self, config: RunConfig | None = None) -> bool:
        marker = self.root / COMPLETE
        if not marker.is_file():
            return False
        if config is None:
            return True
        try:
            return json.loads(marker.read_text(encoding="utf-8")).get("config_hash") == config_hash(config)
        except (json.JSONDecodeError, AttributeError):
            return False

    def open(self, config: RunConfig) -> str:
        """Prepare the directory for `config`: returns 'complete', 'resume' or 'fresh'."""
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"-o '{self.root}' is a file; pass a directory for the run")
        existing = self.read_config()
        if existing is not None:
            diffs = config_differences(existing, config)
            if diffs:
                raise KvcalError(
                    f"run directory '{self.root}' belongs to a different configuration ({'; '.join(diffs[:4])}); "
                    "choose another -o directory (nothing was changed)"
                )
            return "complete" if self.is_complete(config) else "resume"
        if self.root.is_dir() and any(p for p in self.root.iterdir() if not p.name.startswith(".")):
            raise KvcalError(
                f"'{self.root}' is not empty and holds no kvcal run (no {CONFIG}); choose an empty or new -o directory"
            )
        self._create(config)
        return "fresh"

    def _create(self, config: RunConfig) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.root / CONFIG, yaml.safe_dump(config.to_dict(), sort_keys=False))
        except OSError as exc:
            raise UsageError(
                f"cannot create the run directory '{self.root}' ({exc.strerror or exc}); "
                "pass an -o path in a writable folder"
            ) from exc

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

    def finished_parts(self, tasks: list[str]) -> list[dict[str, Any]]:
        """Every task's saved part ({} for one not saved)."""
        return [self.finished_task(t) or {} for t in tasks]

    def finish(self, records: dict[str, Any], config: RunConfig) -> None:
        """The whole run's files (name -> JSON object: results.json, metrics.json, env.json), then COMPLETE."""
        for name, obj in records.items():
            atomic_write_json(self.root / name, obj)
        self.mark_complete(config)

    def mark_complete(self, config: RunConfig) -> None:
        atomic_write_json(
            self.root / COMPLETE,
            {
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "config_hash": config_hash(config),
            },
        )


def config_differences(old: RunConfig, new: RunConfig) -> list[str]:
    a, b = old.identity(), new.identity()
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key)!r} here, {b.get(key)!r} asked")
    return out


def _json_default(obj: Any) -> Any:
    """lm-eval sample records hold tuples, numpy scalars and the odd object; write them as JSON values."""
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


def open_shared(store: RunStore, config: RunConfig, tasks: list[str], dist: Any) -> tuple[str, list[str]]:
    """`store.open(config)` on rank 0 ('fresh', 'resume' or 'complete') and the `tasks` not finished yet, shared
    with every rank of `dist` (kvcal.parallel.Dist), so every rank runs the same tasks; a refusal stops all of
    them (rank 0 says why)."""
    from kvcal.parallel import broadcast_object

    outcome: tuple[str, str, list[str]] = ("", "", [])
    if dist.is_main:
        try:
            pending = [t for t in tasks if store.finished_task(t) is None]  # read-only: nothing written yet
            outcome = ("ok", store.open(config), pending)
        except KvcalError as exc:
            broadcast_object(("error", str(exc), []), dist)
            raise
    outcome = broadcast_object(outcome, dist)
    if outcome[0] == "error":
        raise UsageError(f"rank {dist.rank}: rank 0 refused the run directory: {outcome[1]}")
    return outcome[1], outcome[2]
