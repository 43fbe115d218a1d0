"""A Rich progress bar (samples/s, ETA) on stderr fed by the library's progress(done, total, phase) callbacks;
shared by `kvcal calibrate` and `kvcal sensitivity`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kvcal.commands.output import err_console

S = TypeVar("S")
R = TypeVar("R")

# The library's phase names -> what the bar says.
PHASES = {
    "load": "loading model",
    "observe": "observing K/V",
    "evaluate": "measuring scales",
    "llmcompressor": "llm-compressor oneshot",
}


class ProgressRenderer:
    """A context manager and a progress callback: one bar per phase; silent when disabled (--json)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}

    def __enter__(self) -> ProgressRenderer:
        return self

    def _start(self) -> Progress:
        """The bar starts with the first callback, so input refused before any work leaves stderr one line."""
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=err_console,
            transient=False,
        )
        progress.__enter__()
        return progress

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, done: int, total: int, phase: str) -> None:
        if not self.enabled:
            return
        if self.progress is None:
            self.progress = self._start()
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(PHASES.get(phase, phase), total=total, rate="")
            self.started[phase] = time.perf_counter()
        elapsed = time.perf_counter() - self.started[phase]
        rate = f"{done / elapsed:.2f} samples/s" if done and elapsed > 0 and phase != "load" else ""
        self.progress.update(self.tasks[phase], completed=done, total=total, rate=rate)


def run_with_progress(run: Callable[[S, Any], R], spec: S, enabled: bool) -> R:
    """`run(spec, progress)`, the library's run of a parsed spec, with the bar on stderr (none when not `enabled`:
    --json, or a rank other than 0)."""
    with ProgressRenderer(enabled=enabled) as progress:
        return run(spec, progress)
