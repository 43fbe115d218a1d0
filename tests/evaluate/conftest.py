"""Fixtures shared by the spec and bind tests (test modules never import each other)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# Continuation-only scoring (kvcal.evaluate.scoring) computes the same float32 rows as lm-eval's HFLM in forwards of
# other shapes (a shared prefix, a batch of choices): a sum moves by float32 rounding only, far below 2**-16 relative
# (~500 ulps of float32).
LL_RTOL = 2.0**-16


def _pair(resp: Any) -> tuple[float, bool | None]:
    """An lm-eval response: (log-likelihood, is_greedy) of a loglikelihood request, a float of a rolling one."""
    return (float(resp), None) if isinstance(resp, (int, float)) else (float(resp[0]), bool(resp[1]))


@pytest.fixture(scope="session")
def same_loglikelihoods() -> Callable[[list[dict[str, Any]], list[dict[str, Any]]], None]:
    """(samples, samples) of one task from lm-eval's log_samples -> asserts per sample, per request: log-likelihood
    within float32 rounding (LL_RTOL), is_greedy identical."""

    def check(ref: list[dict[str, Any]], ours: list[dict[str, Any]]) -> None:
        assert len(ref) == len(ours) > 0
        for a, b in zip(ref, ours, strict=True):
            assert a["doc_id"] == b["doc_id"]
            assert len(a["resps"]) == len(b["resps"])
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                (x, gx), (y, gy) = _pair(ra[0]), _pair(rb[0])
                assert abs(x - y) <= LL_RTOL * (1.0 + abs(x)), (a["doc_id"], x, y)
                assert gx == gy, (a["doc_id"], gx, gy)

    return check
