"""Atomic file writes: a temporary file in the same folder, fsync, then rename. A crash leaves either the
old file or the new one, never a partial one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on error removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_path: Path | None = None
    try:
        with _sigint_deferred():  # Ctrl-C cannot land between the file's creation and `finally` owning it
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            tmp_path = Path(tmp)
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, public_mode(0o666))  # mkstemp made it 0600; outputs are shared like any new file
        os.replace(tmp_path, target)
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """SIGINT held back for the block (a few instructions that a KeyboardInterrupt must not split) and acted on
    when it ends. Python runs signal handlers in the main thread whichever thread the kernel delivers to, so the
    handler is swapped for one that only records, not the thread's signal mask. Elsewhere than the main thread
    there is no handler to swap."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and callable(old):
            old(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt here
        elif got and old == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)



def temp_dir_beside(path: str | os.PathLike[str]) -> Path:
    """A new empty folder beside `path` (same filesystem, hidden name), to fill and then os.replace onto `path`;
    the caller removes it if that fails. OSError when the parent cannot be created or written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))


def output_problem(path: str | os.PathLike[str], flag: str = "-o", folder: bool = False) -> str | None:
    """Before any work: why `path` (a file, or with `folder` a folder) cannot be written, found without creating
    anything, or None. A file must not be a folder (a folder not a file); the nearest existing parent must be a
    folder this process can write and enter. The message names `flag` and the fix (callers raise it as their
    usage error: this module sits below kvcal.errors)."""
    out = Path(path).expanduser()
    kind = "folder" if folder else "file"
    if out.exists() and out.is_dir() != folder:
        return f"{flag} '{out}' is a {'file' if folder else 'folder'}; pass a {kind} path"
    probe = out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot write {flag} '{out}': '{probe}' is a file, not a folder; choose another {flag} path"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot write {flag} '{out}': folder '{probe}' is not writable; choose another {flag} path"
    return None


def public_mode(mode: int) -> int:
    """`mode` filtered by the process umask (what open() would have given a new file)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text: split on "\n" only. str.splitlines also splits on U+2028, U+0085, \x0b, \x0c
    and \x1c-\x1e, which JSON strings may hold raw (lm-eval's GPQA samples do): a record would be cut in two."""
    return text.split("\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    """The records of a JSONL file (UTF-8), blank lines skipped."""
    return [json.loads(line) for line in jsonl_lines(Path(path).read_text(encoding="utf-8")) if line.strip()]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False, default=str) + "\n")


def atomic_write_with(path: str | os.PathLike[str], writer: Callable[[Path], None]) -> None:
    """Call `writer(tmp_path)` (e.g. safetensors' save_file) and rename the result onto `path`."""
    with atomic_path(path) as tmp:
        writer(tmp)


@contextmanager
def file_lock(path: str | os.PathLike[str], blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on `path` (created if missing) for the block; yields False without waiting when
    `blocking` is False and another process holds it.

    flock(2): the kernel releases the lock when the holder exits, however it exits (a killed process leaves no
    stale lock behind, so its work can be taken over at once). The lock file itself stays; it holds the
    holder's pid for a human looking at it."""
    import fcntl

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield True
    finally:
        os.close(fd)
