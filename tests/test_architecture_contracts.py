"""The import contracts of pyproject.toml ([tool.importlinter], docs/architecture.md): they hold on this tree, they
cover every kvcal module, and they break on a planted upward import (checked on a scratch copy of the package)."""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvcal

ROOT = Path(__file__).resolve().parents[1]
CLI_MODULES = {"kvcal.cli", "kvcal.commands"}


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the dev extra's `lint-imports` on the package and pyproject.toml found in `cwd`."""
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.is_file(), f"{exe} is missing: install the dev extra (pip install -e '.[dev]')"
    return subprocess.run(
        [str(exe), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_contracts_hold_on_this_tree() -> None:
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_cli_contract_names_every_library_module() -> None:
    # The layers contract is exhaustive (a new module fails it until placed); the forbidden contract lists its
    # sources by hand, so a new top-level module must be added there too.
    top = {f"kvcal.{m.name}" for m in pkgutil.iter_modules(kvcal.__path__)}
    sources = set(_contracts()["no-cli-in-library"]["source_modules"])
    assert sources == top - CLI_MODULES


def _scratch_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "kvcal", tmp_path / "kvcal", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(path: Path, line: str) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(f"\n\ndef _planted() -> None:\n    {line}  # planted by the test\n")


@pytest.mark.parametrize(
    ("module", "line", "messages"),
    [
        pytest.param(
            "formats/__init__.py",
            "from kvcal.report import stats  # noqa: F401",
            ["kvcal.formats is not allowed to import kvcal.report", "kvcal.formats -> kvcal.report.stats"],
            id="upward-import-breaks-the-layers",
        ),
        pytest.param(
            "calibrate/hooks.py",
            "from kvcal.kernels import cache  # noqa: F401",
            ["kvcal.calibrate is not allowed to import kvcal.kernels"],
            id="calibrate-importing-kernels-breaks-independence",
        ),
        pytest.param(
            "io.py",
            "import rich  # noqa: F401",
            ["kvcal.io is not allowed to import rich"],
            id="rich-in-library-code-breaks-the-forbidden-contract",
        ),
        pytest.param(
            "report/stats.py",
            "from kvcal.report import compare  # noqa: F401",
            ["No cycles are allowed in kvcal.report"],
            id="an-import-circle-breaks-no-cycles",
        ),
    ],
)
def test_planted_import_breaks_a_contract(
    tmp_path: Path, module: str, line: str, messages: list[str]
) -> None:
    scratch = _scratch_copy(tmp_path)
    _plant(scratch / "kvcal" / module, line)
    proc = _lint_imports(scratch)
    assert proc.returncode == 1, proc.stdout
    for message in messages:
        assert message in proc.stdout


def test_unplaced_module_breaks_the_exhaustive_layers(tmp_path: Path) -> None:
    scratch = _scratch_copy(tmp_path)
    (scratch / "kvcal" / "newthing.py").write_text('"""A module no layer names."""\n', encoding="utf-8")
    proc = _lint_imports(scratch)
    assert proc.returncode == 1, proc.stdout
    assert "kvcal.newthing" in proc.stdout
