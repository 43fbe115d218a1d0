"""The run directory's state machine: fresh, resume, complete (skip), other configuration (refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcal.errors import KvcalError
from kvcal.evaluate.runstore import RunStore, config_hash

CFG = {
    "model": "m",
    "kv_format": "fp8_e4m3",
    "tasks": ["wikitext", "kl"],
    "limit": 2,
    "kvcal_version": "0.1.0",
}


def test_fresh_resume_complete(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    assert store.open(CFG) == "fresh"
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert store.finished_task("wikitext") is None
    store.save_task("wikitext", {"results": {"wikitext": {"word_perplexity,none": 3.0}}}, [{"doc_id": 0}])
    assert store.open(CFG) == "resume"
    assert store.finished_task("wikitext") == {"results": {"wikitext": {"word_perplexity,none": 3.0}}}
    assert json.loads((tmp_path / "run" / "samples_wikitext.jsonl").read_text()) == {"doc_id": 0}
    store.mark_complete(CFG)
    assert store.open(CFG) == "complete"
    # a newer kvcal version with the same settings is the same run
    assert store.open({**CFG, "kvcal_version": "9.9"}) == "complete"
    assert json.loads((tmp_path / "run" / "COMPLETE").read_text())["config_hash"] == config_hash(CFG)


def test_other_configuration_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    store.open(CFG)
    store.mark_complete(CFG)
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(KvcalError, match="different configuration.*kv_format"):
        store.open({**CFG, "kv_format": "nvfp4"})
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before


def test_task_without_samples_is_not_finished(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    store.open(CFG)
    store.save_task("kl", {"results": {}}, [])
    (tmp_path / "run" / "samples_kl.jsonl").unlink()  # a crash between the two writes
    assert store.finished_task("kl") is None


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(KvcalError, match="not empty"):
        RunStore(tmp_path / "run").open(CFG)
    (tmp_path / "file").write_text("x")
    with pytest.raises(KvcalError, match="is a file"):
        RunStore(tmp_path / "file").open(CFG)
