"""Printing the engine commands of evaluated configurations (kvcal.engines builds them) for eval, compare, sweep
and release: one line each, as is (they are copied from here)."""

from __future__ import annotations

from typing import Any

from kvcal.commands.output import console
from kvcal.engines import EngineSetup, command_lines, commands_dict, group_setups


def print_engine_commands(named: list[tuple[str, EngineSetup]]) -> None:
    """Per configuration: each engine's export / serve / lm_eval command, or why it cannot run it."""
    print_engine_dicts({label: commands_dict(setup) for label, setup in group_setups(named)})


def print_engine_dicts(by_config: dict[str, dict[str, dict[str, Any]]]) -> None:
    """The same from {configuration: {engine: EngineCommand.to_dict()}} (sweep.json, release.json)."""
    for label, engines in by_config.items():
        console.print(f"engine commands for {label}:", highlight=False, markup=False, soft_wrap=True)
        for d in engines.values():
            for line in command_lines(d):
                console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
