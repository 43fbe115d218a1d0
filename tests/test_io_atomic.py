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
