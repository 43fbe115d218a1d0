"""Printing the engine commands of evaluated configurations (kvcal.engines builds them) for eval, compare, sweep
and release: one line each, as is (they are copied from here)."""

from __future__ import annotations

from kvcal.commands.output import console
from kvcal.engines import EngineSetup, engine_commands, group_setups


def print_engine_commands(named: list[tuple[str, EngineSetup]]) -> None:
    """Per configuration: each engine's export / serve / lm_eval command, or why it cannot run it."""
    for label, setup in group_setups(named):
        console.print(f"engine commands for {label}:", highlight=False, markup=False, soft_wrap=True)
        for cmd in engine_commands(setup):
            for line in cmd.lines():
                console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
