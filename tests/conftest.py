"""Suite-wide settings: no network, deterministic, small thread pools (CI has 2 cores)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# ../shared/data beside the checkout (read-only); tests that need it skip when it is absent.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent")
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # kvcal's caches (hashes, converted models) go to a per-session folder unless the caller chose one,
    # so tests never depend on what a developer's machine has cached.
    if "KVCAL_CACHE" not in os.environ:
        os.environ["KVCAL_CACHE"] = str(tmp_path_factory.mktemp("kvcal-cache"))
