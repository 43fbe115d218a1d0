"""kvcal's cache folder (`$KVCAL_CACHE`, else ~/.cache/kvcal) and content hashes of files (streamed sha256, and
one index that remembers the hashes of large files by path, size and mtime)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """kvcal's cache folder: $KVCAL_CACHE, else ~/.cache/kvcal."""
    env = os.environ.get("KVCAL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcal"


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """sha256 of a file, streamed."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_cache_path() -> Path:
    """kvcal's one content-hash cache: {absolute path: {size, mtime_ns, sha256}}."""
    return cache_root() / "file_hashes.json"


def cached_sha256(paths: list[Path]) -> list[tuple[str, bool]]:
    """(sha256, was_cached) per file. Large files (weights, GGUFs) are streamed once and remembered by absolute
    path while their size and mtime stay the same, so re-verification and re-resolution are instant."""
    import json

    from kvcal.io import atomic_write_json

    index_path = hash_cache_path()
    try:
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    out: list[tuple[str, bool]] = []
    for path in paths:
        st = path.stat()
        key = str(path.resolve())
        entry = index.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
        ):
            out.append((str(entry["sha256"]), True))
            continue
        digest = sha256_file(path)
        index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        out.append((digest, False))
    if not all(hit for _, hit in out):
        try:
            atomic_write_json(index_path, index, indent=1)
        except OSError:
            pass  # a read-only cache only costs a re-hash next time
    return out
