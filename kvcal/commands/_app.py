"""The Typer app and the helpers every command module shares: error rendering, JSON output, consoles.

Command modules (`kvcal/commands/<area>.py`, assembled by kvcal/cli.py) import `app` from here and register their commands; they parse,
call the library, render — nothing else.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer
from rich.console import Console

from kvcal import __version__
from kvcal.errors import KvcalError

# Human output on stdout, diagnostics (progress, warnings) on stderr.
console = Console()
err_console = Console(stderr=True)


class _App(typer.Typer):
    """A Typer app that renders anticipated errors as one line `Error: ...` with the right exit code."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                raise
            print(f"Error: {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)


app = _App(
    name="kvcal",
    help="Calibrate, evaluate and compare FP8 / FP4 / INT8 KV caches for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvcal {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """kvcal: calibrate K/V scales, evaluate quantized KV caches through lm-eval, compare runs."""


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout (the --json contract)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    err_console.print(f"[yellow]Warning:[/yellow] {message}", highlight=False)
