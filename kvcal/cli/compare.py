"""CLI commands: sweep, compare (not built yet)."""

from __future__ import annotations

from kvcal.cli._app import app
from kvcal.errors import UsageError


@app.command("sweep", help="Run a resumable matrix of formats x scales x skip-layers x tasks. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sweep_cmd() -> None:
    raise UsageError("`kvcal sweep` is not built yet in this version of kvcal")


@app.command("compare", help="Compare run directories: report with error bars and a regression gate. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def compare_cmd() -> None:
    raise UsageError("`kvcal compare` is not built yet in this version of kvcal")
