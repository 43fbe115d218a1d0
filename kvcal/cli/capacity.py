"""CLI commands: capacity (not built yet)."""

from __future__ import annotations

from kvcal.cli._app import app
from kvcal.errors import UsageError


@app.command("capacity", help="Bytes per token and tokens that fit, per KV format. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def capacity_cmd() -> None:
    raise UsageError("`kvcal capacity` is not built yet in this version of kvcal")
