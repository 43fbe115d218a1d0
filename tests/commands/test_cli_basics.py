"""The CLI contract shared by every command: --version, help, one-line errors with exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcal import __version__
from kvcal.cli import app
from kvcal.errors import KvcalError, UsageError
from kvcal.io import atomic_write_json, atomic_write_with

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvcal {__version__}"


def test_every_design_command_exists() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in (
        "calibrate",
        "show",
        "verify",
        "export",
        "eval",
        "sweep",
        "compare",
        "capacity",
        "sensitivity",
    ):
        assert name in result.stdout, name


def test_anticipated_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    # A real process: the console-script path renders KvcalError itself (CliRunner would catch it).
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-c", "from kvcal.cli import app; app()", "capacity", str(missing)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_error_classes_carry_exit_codes() -> None:
    assert KvcalError("x").exit_code == 1
    assert UsageError("x").exit_code == 2


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    atomic_write_json(target, {"a": 1})

    def boom(tmp: Path) -> None:
        tmp.write_text("partial")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        atomic_write_with(target, boom)
    assert target.read_text().strip().startswith("{")  # the old file survives
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left behind
