"""kvcal.io's atomic writes: the target is the old file or the new one, and no temporary file is left — also when
Ctrl-C lands while the temporary file is being created (the signal is held back until `finally` owns the file)."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest

from kvcal import io


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    io.atomic_write_text(out, "old")
    with pytest.raises(RuntimeError), io.atomic_path(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer failed")
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]
    io.atomic_write_text(out, "new")
    assert out.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_sigint_while_the_temporary_file_is_created_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT sent from inside mkstemp (right after the file exists): without the hold, the KeyboardInterrupt would
    surface before `finally` owns the file and leave it behind."""
    real = tempfile.mkstemp
    made: list[str] = []

    def mkstemp_then_sigint(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        fd, name = real(*args, **kwargs)
        made.append(name)
        os.kill(os.getpid(), signal.SIGINT)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_sigint)
    out = tmp_path / "s.safetensors"
    # Python's own Ctrl-C handler and SIGINT unblocked, whatever an earlier test in this process left (a clean-clone
    # CI run once saw no KeyboardInterrupt come: another handler installed, or the signal blocked)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with pytest.raises(KeyboardInterrupt), io.atomic_path(out) as tmp:
            tmp.write_bytes(b"new")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, before)
    assert made and not Path(made[0]).exists() and list(tmp_path.iterdir()) == []


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path: Path) -> None:
    """JSON strings may hold U+2028, U+0085, \\x0b, \\x0c, \\x1c raw (lm-eval's GPQA samples do): a JSONL file splits on
    "\\n" only, where str.splitlines would cut the record in two ("line 5 is not JSON")."""
    import json

    from kvcal.io import jsonl_lines, read_jsonl
    from kvcal.report.runs import read_samples_file

    recs = [{"doc_id": i, "doc": {"q": f"a\u2028b\x85c\x0bd\x0ce\x1cf {i}"}, "acc": float(i % 2), "metrics": ["acc"]}
            for i in range(3)]
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in recs) + "\n"
    assert len(text.splitlines()) > 4  # what the reader must not do
    p = tmp_path / "samples_gpqa.jsonl"
    p.write_text(text, encoding="utf-8")
    assert read_jsonl(p) == recs and len([ln for ln in jsonl_lines(text) if ln]) == 3
    got, metrics = read_samples_file(p, "run X")
    assert len(got) == 3 and "acc" in metrics
