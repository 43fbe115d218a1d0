"""CLI commands: sensitivity (not built yet)."""

from __future__ import annotations

from kvcal.cli._app import app
from kvcal.errors import UsageError


@app.command("sensitivity", help="Per-layer damage of a KV format and skip-layer advice. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sensitivity_cmd() -> None:
    raise UsageError("`kvcal sensitivity` is not built yet in this version of kvcal")
