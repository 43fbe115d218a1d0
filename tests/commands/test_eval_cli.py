"""`kvcal eval` / `kvcal models` command lines: bad input is refused before any model loads or file is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from kvcal.cli import app
from kvcal.errors import UsageError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
runner = CliRunner()


def _eval(tmp_path: Path, *extra: str):
    return runner.invoke(app, ["eval", str(tmp_path / "no-model"), "-o", str(tmp_path / "run"), *extra])


def test_eval_bad_input(tmp_path: Path) -> None:
    res = _eval(tmp_path, "--kv-format", "fp8", "--tasks", "kl", "--limit", "0")
    assert isinstance(res.exception, UsageError) and "--limit" in str(res.exception)
    res = _eval(tmp_path, "--kv-format", "fp8", "--tasks", "wikitxt")
    assert isinstance(res.exception, UsageError) and "did you mean wikitext" in str(res.exception)
    res = _eval(tmp_path, "--kv-format", "fp9", "--tasks", "kl")
    assert isinstance(res.exception, UsageError)
    res = _eval(tmp_path, "--kv-format", "fp8", "--tasks", "kl", "--data-dir", str(tmp_path / "nodata"))
    assert isinstance(res.exception, UsageError) and "--data-dir" in str(res.exception)
    res = _eval(
        tmp_path, "--kv-format", "fp8", "--tasks", "kl", "--scales", str(tmp_path / "none.safetensors")
    )
    assert isinstance(res.exception, UsageError) and "does not exist" in str(res.exception)
    assert not (tmp_path / "run").exists()


def test_models_list_json() -> None:
    res = runner.invoke(app, ["models", "list", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [r["name"] for r in rows] == ["smollm2", "gemma3-270m"]
    assert all("install" in r and "installed" in r for r in rows)
