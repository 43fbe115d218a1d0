"""Shared by the CLI tests: run kvcal's app the way the console script does."""

from __future__ import annotations

import sys

from typer.testing import CliRunner

from kvcal.cli import app


def invoke(args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `kvcal ARGS`; kvcal's app renders `Error: ...` and exits itself, so the
    SystemExit is caught here rather than by CliRunner.invoke (which would hide the stderr line)."""
    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        try:
            app(args=args, prog_name="kvcal")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode()
