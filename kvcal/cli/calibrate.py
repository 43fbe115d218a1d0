"""CLI commands: calibrate (not built yet)."""

from __future__ import annotations

from kvcal.cli._app import app
from kvcal.errors import UsageError


@app.command("calibrate", help="Calibrate K/V scales on a dataset and write a checkpoint-bound scale file. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def calibrate_cmd() -> None:
    raise UsageError("`kvcal calibrate` is not built yet in this version of kvcal")
