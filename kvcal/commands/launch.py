"""`--num-processes N`: run this very command in N processes under torchrun (kvcal.parallel.launch).

The command line is rebuilt from the parsed options (the command's typer.Context), not from sys.argv, so it works the same
from the console script and from Typer's test runner: every option that differs from its default is passed on,
except --num-processes itself; an option read from an environment variable (a password) travels in the
environment, never on a command line.
"""

from __future__ import annotations

import os
from typing import Any

import typer

from kvcal import parallel
from kvcal.errors import UsageError


def _option_args(param: Any, value: Any) -> list[str]:
    """The command-line words that give `param` (a Click parameter) the value `value` (nothing for its default)."""
    if param.param_type_name == "argument":
        values = value if isinstance(value, (list, tuple)) else [value]
        return [str(v) for v in values if v is not None]
    if value is None or value == param.default or (param.multiple and not value):
        return []
    flag = param.opts[0]
    if param.is_flag:
        if param.secondary_opts and not value:
            return [param.secondary_opts[0]]
        return [flag] if value else []
    values = value if param.multiple else [value]
    return [word for v in values for word in (flag, str(v))]


def command_argv(
    ctx: typer.Context, drop: tuple[str, ...] = ("num_processes",)
) -> tuple[list[str], dict[str, str]]:
    """(argv after `kvcal`, extra environment) that rerun the command of `ctx` with the same options."""
    argv = [str(ctx.info_name)]
    env: dict[str, str] = {}
    for param in ctx.command.params:
        if param.name in drop or param.name is None:
            continue
        value = ctx.params.get(param.name)
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str) and value not in (None, param.default):
            env[envvar] = str(value)
            continue
        argv += _option_args(param, value)
    return argv, env


def run_in_processes(ctx: typer.Context, num_processes: int, work: dict[str, int | None]) -> None:
    """Launch the current command in `num_processes` processes and exit with their exit code. `work`: how many
    items each split of the work has (None: not known before the model loads), checked against the processes
    before anything starts."""
    if num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {num_processes}")
    if parallel.from_env().active:
        raise UsageError("--num-processes starts its own processes; drop it when launching with torchrun")
    for what, n in work.items():
        if n is not None:
            parallel.check_enough_work(n, what, parallel.Dist(world_size=num_processes))
    argv, env = command_argv(ctx)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = parallel.launch(argv, num_processes)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    raise typer.Exit(code)


def is_main_process() -> bool:
    """False in ranks 1.. of a multi-process run: they compute, rank 0 renders."""
    return parallel.from_env().is_main
