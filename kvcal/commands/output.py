"""What every command shares for output: the consoles, the --json writer and warnings.

Human output goes to stdout, diagnostics (progress, warnings) to stderr, so `--json` output can be piped.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout (the --json contract): indented JSON, one document."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    err_console.print(f"[yellow]Warning:[/yellow] {message}", highlight=False)
