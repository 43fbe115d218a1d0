"""What every command shares for output: the consoles, the --json writer and warnings.

Human output goes to stdout, diagnostics (progress, warnings) to stderr, so `--json` output can be piped.
Piped or redirected, the consoles are as wide as the content (rich would cut tables to 80 columns and
ellipsize numbers: "0.049…"); in a terminal they fit the terminal, and `--json` is the machine contract.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleDimensions

# Width of a console that is not a terminal: wide enough for every table kvcal prints, so nothing is cut;
# rich tables take their natural width (they never expand to the console's).
PIPE_WIDTH = 10_000


class _Console(Console):
    """A rich Console that is PIPE_WIDTH wide when its file is not a terminal (a pipe, a file, a CI log)."""

    @property
    def size(self) -> ConsoleDimensions:
        if self.is_terminal or self._width is not None:
            return super().size
        return ConsoleDimensions(PIPE_WIDTH, super().size.height)


console = _Console()
err_console = _Console(stderr=True)


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout (the --json contract): indented JSON, one document."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    err_console.print(f"[yellow]Warning:[/yellow] {message}", highlight=False)


def emit_result(result: Any, json_out: bool, warnings: Iterable[str], as_json: Any = None) -> bool:
    """A library result's warnings on stderr, then with --json the result on stdout (`as_json(result)` when the
    result is no plain dict). True when it went out as JSON: the command renders nothing more."""
    for message in warnings:
        warn(message)
    if json_out:
        print_json(result if as_json is None else as_json(result))
    return json_out


class _WarningHandler(logging.Handler):
    """kvcal's library warnings (`logging.getLogger("kvcal....").warning`) as `Warning: ...` on stderr, each
    message once per process (the same selector is parsed by several steps of one run)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.seen:
            self.seen.add(message)
            warn(message)


def route_library_warnings() -> None:
    """Send the `kvcal` loggers' warnings through `warn` (idempotent). Library code never prints."""
    root = logging.getLogger("kvcal")
    if not any(isinstance(h, _WarningHandler) for h in root.handlers):
        root.addHandler(_WarningHandler())  # (Python's last-resort handler printed them bare before)
