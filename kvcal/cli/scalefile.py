"""CLI commands: show, verify, export (not built yet)."""

from __future__ import annotations

from kvcal.cli._app import app
from kvcal.errors import UsageError


@app.command("show", help="Show a scale file's manifest and per-layer scales. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def show_cmd() -> None:
    raise UsageError("`kvcal show` is not built yet in this version of kvcal")


@app.command("verify", help="Check that a scale file is bound to this checkpoint. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def verify_cmd() -> None:
    raise UsageError("`kvcal verify` is not built yet in this version of kvcal")


@app.command("export", help="Export scales as a vLLM checkpoint or SGLang scale JSON. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def export_cmd() -> None:
    raise UsageError("`kvcal export` is not built yet in this version of kvcal")
