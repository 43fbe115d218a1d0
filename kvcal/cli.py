"""kvcal's command line: THE Typer app the `kvcal` console script runs (`kvcal = "kvcal.cli:app"`).

This module owns the app (one-line `Error: ...` rendering of KvcalError and of click's own usage errors, a
missing option included, with their exit codes; --version) and assembles it: kvcal/commands/<area>.py define plain command functions, registered here. Commands never import
this module.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer._click import exceptions as click_errors  # typer 0.29 vendors click (typer/__init__.py imports it)
from typer.core import TyperGroup

from kvcal import __version__
from kvcal.commands.calibrate import calibrate_cmd
from kvcal.commands.capacity import capacity_cmd
from kvcal.commands.compare import compare_cmd, sweep_cmd
from kvcal.commands.drift import drift_cmd
from kvcal.commands.evaluate import eval_cmd
from kvcal.commands.formats import formats_cmd
from kvcal.commands.models import models_install, models_list, models_path
from kvcal.commands.output import route_library_warnings
from kvcal.commands.plan import plan_cmd, plan_export_cmd
from kvcal.commands.probe import probe_cmd
from kvcal.commands.release import release_cmd
from kvcal.commands.scalefile import export_cmd, show_cmd, verify_cmd
from kvcal.commands.sensitivity import sensitivity_cmd
from kvcal.errors import KvcalError, UsageError


class _Group(TyperGroup):
    """The top-level click group: click's usage errors (a missing option or argument, an unknown option, a bad
    value) become one line `Error: ...` naming the problem and where the options are, exit 2, instead of Typer's
    boxed usage text. `kvcal` alone still prints the help."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        _finite_floats(self)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            # non-standalone: click raises its exceptions to us and returns a raised Exit's code
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click_errors.UsageError as exc:
            print(f"Error: {_usage_message(exc)}", file=sys.stderr)
            sys.exit(exc.exit_code)
        except click_errors.ClickException as exc:
            print(f"Error: {exc.format_message()}", file=sys.stderr)
            sys.exit(exc.exit_code)
        except typer.Abort:
            print("Aborted.", file=sys.stderr)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _finite_floats(group: Any) -> None:
    """Every number option of every command refuses NaN and infinities (click's float type takes 'nan' and
    'inf'), the same way in every command: a usage error naming the option, before the command runs."""
    import math
    import typing

    def check(callback: Any) -> Any:
        def checked(ctx: Any, param: Any, value: Any) -> Any:
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise click_errors.BadParameter(f"{value!r} is not a finite number", ctx=ctx, param=param)
            return callback(ctx, param, value) if callback is not None else value

        checked.kvcal_finite = True  # type: ignore[attr-defined]
        return checked

    for command in getattr(group, "commands", {}).values():
        _finite_floats(command)
        for param in command.params:
            desc = getattr(param, "type_descriptor", None)
            ann = getattr(desc, "annotation", None)
            number = ann is float or float in typing.get_args(ann)  # float, float | None, list[float]
            if number and not getattr(param.callback, "kvcal_finite", False):
                param.callback = check(param.callback)


def _usage_message(exc: click_errors.UsageError) -> str:
    """click's message on one line, plus the command's help to read: "Missing option '-o' / '--output'. See
    `kvcal eval --help`." """
    message = " ".join(exc.format_message().split())
    message += "" if message.endswith(".") else "."
    if exc.ctx is not None:
        message += f" See `{exc.ctx.command_path} --help`."
    return message


class _App(typer.Typer):
    """A Typer app that renders anticipated errors as one line `Error: ...` with the error's exit code
    (KvcalError 1, UsageError 2); KVCAL_DEBUG=1 prints the traceback too and keeps the exit code."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except KvcalError as exc:
            if os.environ.get("KVCAL_DEBUG"):
                traceback.print_exc()
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
    cls=_Group,
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
    route_library_warnings()


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
app.command("probe")(probe_cmd)
app.command("eval")(eval_cmd)
app.command("sweep")(sweep_cmd)
app.command("compare")(compare_cmd)
app.command("release")(release_cmd)
app.command("formats")(formats_cmd)

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
