"""The run directory's state machine: fresh, resume, complete (skip), other configuration (refused), and a run
directory written before `run_format` existed (still the same run)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.runstore import RunStore, config_hash
from kvcal.rundir import RunConfig

CFG = RunConfig(
    model="m",
    model_dir="/cache/m",
    kv_format="fp8_e4m3",
    tasks=["wikitext", "kl"],
    limit=2,
    kvcal_version="0.1.0",
)


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
    assert store.open(dataclasses.replace(CFG, kvcal_version="9.9")) == "complete"
    assert json.loads((tmp_path / "run" / "COMPLETE").read_text())["config_hash"] == config_hash(CFG)


def test_other_configuration_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    store.open(CFG)
    store.mark_complete(CFG)
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(KvcalError, match="different configuration.*kv_format"):
        store.open(dataclasses.replace(CFG, kv_format="nvfp4"))
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


def test_run_directory_of_kvcal_0_1_is_the_same_run(tmp_path: Path) -> None:
    # kvcal 0.1 wrote config.yaml as a plain dict without `run_format` and hashed every key except these four
    run = tmp_path / "run"
    run.mkdir()
    old = {k: v for k, v in CFG.to_dict().items() if k != "run_format"}
    (run / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    old_identity = {
        k: v for k, v in old.items() if k not in ("kvcal_version", "run_dir", "scales_path", "model_dir")
    }
    old_hash = hashlib.sha256(json.dumps(old_identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    (run / "COMPLETE").write_text(json.dumps({"finished": "2025-01-01T00:00:00Z", "config_hash": old_hash}))
    assert config_hash(CFG) == old_hash
    assert RunStore(run).open(CFG) == "complete"
    with pytest.raises(KvcalError, match="different configuration.*limit"):
        RunStore(run).open(dataclasses.replace(CFG, limit=3))


def test_output_path_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="cannot create the run directory"):
        RunStore(tmp_path / "file" / "run").open(CFG)
    with pytest.raises(UsageError, match="cannot create the run directory"):
        RunStore("/proc/kvcal-no-such-dir/run").open(CFG)
