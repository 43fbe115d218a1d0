"""kvcal's command line: THE Typer app the `kvcal` console script runs (`kvcal = "kvcal.cli:app"`).

This module owns the app (one-line `Error: ...` rendering of KvcalError with its exit code, --version) and
assembles it: kvcal/commands/<area>.py define plain command functions, registered here. Commands never import
this module.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from kvcal import __version__
from kvcal.commands.calibrate import calibrate_cmd
from kvcal.commands.capacity import capacity_cmd
from kvcal.commands.compare import compare_cmd, sweep_cmd
from kvcal.commands.drift import drift_cmd
from kvcal.commands.evaluate import eval_cmd
from kvcal.commands.models import models_install, models_list, models_path
from kvcal.commands.plan import plan_cmd, plan_export_cmd
from kvcal.commands.release import release_cmd
from kvcal.commands.scalefile import export_cmd, show_cmd, verify_cmd
from kvcal.commands.sensitivity import sensitivity_cmd
from kvcal.errors import KvcalError, UsageError


class _App(typer.Typer):
    """A Typer app that renders anticipated errors as one line `Error: ...` with the error's exit code
    (KvcalError 1, UsageError 2); KVCAL_DEBUG=1 lets the traceback through."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                raise
            if _says_error(exc):
                print(f"Error: {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)


def _says_error(exc: KvcalError) -> bool:
    """One Error line per multi-process run: rank 0 prints bad input (every rank finds the same), and under
    `--num-processes` the launcher reports a lost rank instead of every survivor (kvcal.parallel)."""
    from kvcal import parallel

    rank = os.environ.get("RANK", "0")
    if isinstance(exc, UsageError) and rank != "0":
        return False
    return not (isinstance(exc, parallel.PeerLost) and os.environ.get(parallel.LAUNCHED_ENV))


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
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """kvcal: calibrate K/V scales, evaluate quantized KV caches through lm-eval, compare runs."""


# In the order of the workflow: size it, calibrate, inspect and ship the scales, evaluate, compare.
app.command("capacity")(capacity_cmd)
app.command("calibrate")(calibrate_cmd)
app.command("sensitivity")(sensitivity_cmd)
app.command("plan")(plan_cmd)
app.command("plan-export")(plan_export_cmd)
app.command("show")(show_cmd)
app.command("verify")(verify_cmd)
app.command("drift")(drift_cmd)
app.command("export")(export_cmd)
app.command("eval")(eval_cmd)
app.command("sweep")(sweep_cmd)
app.command("compare")(compare_cmd)
app.command("release")(release_cmd)

models_app = typer.Typer(
    help="The two real models of kvcal's demos: install, list, locate/convert.", no_args_is_help=True
)
models_app.command("list")(models_list)
models_app.command("install")(models_install)
models_app.command("path")(models_path)
app.add_typer(models_app, name="models")

__all__ = ["app"]

if __name__ == "__main__":  # `python -m kvcal.cli`: what torchrun starts in each rank (kvcal.parallel)
    app()
