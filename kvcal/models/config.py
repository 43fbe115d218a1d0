"""A model's transformers config from a local folder, a hub id or a .gguf file (metadata only, no weights), and
the check that refuses a checkpoint's own Python code unless asked (`--trust-remote-code`)."""

from __future__ import annotations

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

    check_remote_code(Path(folder) / "config.json", model or str(folder), trust_remote_code)
    return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)


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
