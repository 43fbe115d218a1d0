"""Every `kvcal ...` line of a shell block in README.md and docs/commands.md parses as written: the command
exists, and every required argument and option is there (click's own parser, nothing runs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from kvcal.cli import app

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "docs" / "commands.md"]
BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


def command_lines(page: Path) -> list[str]:
    """`kvcal` command lines of the page's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in BLOCK.findall(page.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("kvcal "):
                out.append(line)
    return out


CASES = [(p, line) for p in PAGES for line in command_lines(p)]


def test_pages_have_commands():
    assert {p for p, _ in CASES} == set(PAGES)


@pytest.mark.parametrize(("page", "line"), CASES, ids=[line[:60] for _, line in CASES])
def test_command_parses(page: Path, line: str):
    group = typer.main.get_command(app)
    argv = shlex.split(line)[1:]
    cmd = group
    ctx = group.make_context("kvcal", list(argv), resilient_parsing=True)
    while hasattr(cmd, "resolve_command"):  # a group (typer's own click): down to the leaf, `models list`
        name, cmd, argv = cmd.resolve_command(ctx, argv)
        assert cmd is not None, f"no command {name!r}"
        # the leaf parses strictly: a missing required argument or option raises here
        ctx = cmd.make_context(
            name, list(argv), parent=ctx, resilient_parsing=hasattr(cmd, "resolve_command")
        )
