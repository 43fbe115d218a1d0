"""CLI commands: eval (not built yet)."""

from __future__ import annotations

from kvcal.cli._app import app
from kvcal.errors import UsageError


@app.command("eval", help="Evaluate lm-eval tasks through kvcal's quantized KV cache. [not built yet]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def eval_cmd() -> None:
    raise UsageError("`kvcal eval` is not built yet in this version of kvcal")
