"""Fixtures shared by the calibration tests (test modules never import each other)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvcal.calibrate.data import build_samples, load_texts
from kvcal.models.loading import load_model

PlainKV = Callable[[Path, int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]]


@pytest.fixture(scope="session")
def plain_kv() -> PlainKV:
    """(model_dir, n, seq_len) -> layer -> (K, V) [1, H_kv, sum T, D] over kvcal's corpus samples, from a plain
    DynamicCache (no kvcal hook): the independent reference for what calibrate and drift observe."""

    def get(model_dir: Path, n: int, seq_len: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        lm = load_model(model_dir)
        data = build_samples(load_texts(None), lm.tokenizer, n, seq_len, seed=0)
        ks: dict[int, list[torch.Tensor]] = {}
        vs: dict[int, list[torch.Tensor]] = {}
        with torch.no_grad():
            for ids in data.samples:
                cache = DynamicCache()
                lm.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
                for i, layer in enumerate(cache.layers):
                    ks.setdefault(i, []).append(layer.keys)
                    vs.setdefault(i, []).append(layer.values)
        return {i: (torch.cat(ks[i], 2), torch.cat(vs[i], 2)) for i in ks}

    return get
