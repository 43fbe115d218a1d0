"""GGUF checkpoints: converted once (dequantized, float32) to a safetensors Hugging Face folder in kvcal's cache,
keyed by the file's sha256 and the conversion's version."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import cache_root, cached_sha256
from kvcal.gguf_tokenizer import repair_tokenizer_json


def is_gguf(model: str | os.PathLike[str]) -> bool:
    return str(model).lower().endswith(".gguf")


def _cached_sha256(path: Path) -> str:
    return cached_sha256([path])[0][0]


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a safetensors HF folder at `out_dir`, atomically (temp folder, then rename)."""
    import importlib.util
    import json
    import shutil

    from kvcal.io import temp_dir_beside

    if importlib.util.find_spec("gguf") is None:
        raise UsageError("reading a .gguf file needs the `gguf` package: pip install gguf==0.19.0")
    try:
        tmp = temp_dir_beside(out_dir)
    except OSError as exc:
        raise UsageError(
            f"cannot write the converted model under '{out_dir.parent}' ({exc.strerror or exc}); "
            "set KVCAL_CACHE to a writable folder"
        ) from exc
    try:
        _write_dequantized(gguf, tmp)
        (tmp / "kvcal_source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": _cached_sha256(gguf)}, indent=2) + "\n"
        )
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # lost a race to nobody: a real failure
                raise
    except KvcalError:
        raise
    except Exception as exc:  # the GGUF reader raises ValueError, struct errors, KeyError, OSError ...
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvcalError(f"cannot convert '{gguf}' to a safetensors folder: {msg}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_dequantized(gguf: Path, folder: Path) -> None:
    """Save the GGUF's model (dequantized, float32) and tokenizer into `folder` with save_pretrained.

    transformers loads a GGUF (dequantized to float32) but refuses to save_pretrained it; the fix is to drop
    `quantization_config`, rebuild a plain model from the config and load the dequantized state dict into it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may show up as a missing lm_head; anything else means the conversion lost weights.
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise KvcalError(
            f"converting '{gguf}' lost weights (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "this GGUF architecture is not supported by transformers' GGUF loader"
        )
    del loaded
    fresh.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    _offline_tokenizer_config(folder / "tokenizer_config.json")
    # transformers' GGUF SentencePiece conversion splits Gemma 3 text into characters; rebuild it as
    # score-ranked BPE, the way llama.cpp tokenizes it (kvcal/gguf_tokenizer.py).
    if (folder / "tokenizer.json").is_file():
        repair_tokenizer_json(folder / "tokenizer.json", bos_token=getattr(tokenizer, "bos_token", None))


def _offline_tokenizer_config(path: Path) -> None:
    """tokenizer.save_pretrained records `local_files_only` as the environment had it (True under HF_HUB_OFFLINE=1,
    as `make` runs, else False), and a scale file binds tokenizer_config.json's hash: the same GGUF converted in two
    shells would make a scale file calibrated in one 'stale' in the other. The conversion reads a local file, so
    it always writes True (what an offline conversion, and every conversion before this fix made under `make`,
    wrote)."""
    if not path.is_file():
        return
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.get("local_files_only") is False:
        cfg["local_files_only"] = True
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# Bumped whenever the conversion changes, so an older cached folder is never reused.
_CONVERSION_VERSION = 2


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the safetensors conversion of a GGUF lives: keyed by the file's sha256."""
    return cache_root() / "models" / f"{gguf.stem}-{_cached_sha256(gguf)[:16]}-c{_CONVERSION_VERSION}"
