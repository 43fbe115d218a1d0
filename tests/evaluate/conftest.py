"""Fixtures shared by the spec and bind tests (test modules never import each other)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

SPEC_CORPUS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today"] * 4


@pytest.fixture(scope="module")
def llama(tiny_lm_dir: Callable[..., Path]) -> Path:
    return tiny_lm_dir("llama", SPEC_CORPUS)


@pytest.fixture(scope="module")
def scale_file(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-tensor fp8 scale file bound to the tiny Llama."""
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec
    from kvcal.scales import compute_binding, make_scale_set, save_scale_file

    kv = kv_spec(load_config(llama))
    n = kv.num_layers
    path = tmp_path_factory.mktemp("scales") / "fp8.safetensors"
    binding = compute_binding(str(llama), llama, kv)
    save_scale_file(path, make_scale_set("fp8_e4m3", "tensor", [0.02] * n, [0.03] * n, observer="minmax", binding=binding))
    return path
