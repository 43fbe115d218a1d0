"""MODEL argument -> a local Hugging Face folder with loadable (.safetensors) weights: the folder itself, a hub
snapshot, or the cached conversion of a .gguf file."""

from __future__ import annotations

import os
from pathlib import Path

from kvcal.errors import UsageError
from kvcal.models.config import check_remote_code
from kvcal.models.gguf import convert_gguf, gguf_cache_dir, is_gguf
from kvcal.models.real import resolve_real_name


def resolve_model(model: str | os.PathLike[str], trust_remote_code: bool = False) -> Path:
    """A local HF folder for MODEL with loadable weights: the folder itself, a hub snapshot (honours
    HF_HUB_OFFLINE), or the cached safetensors conversion of a .gguf file (converted once, keyed by the file's
    sha256). UsageError for checkpoints kvcal will not load: pickled weights only, or code of their own without
    `trust_remote_code`."""
    model_s = resolve_real_name(model)
    path = Path(model_s).expanduser()
    if is_gguf(model_s):
        if not path.is_file():
            raise UsageError(f"GGUF file '{model_s}' does not exist; pass an existing .gguf path")
        out = gguf_cache_dir(path)
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
        return out
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"'{model_s}' has no config.json; pass a Hugging Face model folder, a hub id or a .gguf file"
            )
        folder = path
    elif model_s.startswith((".", "/", "~")) or model_s.count("/") > 1:
        raise UsageError(f"model path '{model_s}' does not exist")
    else:
        folder = _hub_snapshot(model_s, trust_remote_code)
    check_remote_code(folder / "config.json", model_s, trust_remote_code)
    check_weights(folder, model_s)
    return folder


def _hub_snapshot(model_id: str, trust_remote_code: bool) -> Path:
    """The hub snapshot of MODEL_ID: configs, tokenizer and .safetensors weights only (never pickled weights);
    the repository's .py files too when its code is trusted."""
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    if trust_remote_code:
        patterns.append("*.py")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, allow_patterns=patterns))
    except Exception as exc:  # hub errors come in many classes (offline, 404, gated, connection)
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local hub cache)" if offline else ""
        raise UsageError(
            f"model '{model_id}' is not a local folder or .gguf file and cannot be fetched from the hub{hint}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc


_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def check_weights(folder: Path, model: str) -> None:
    """UsageError unless `folder` holds .safetensors weights: kvcal never unpickles .bin / .pt checkpoints
    (unpickling can run arbitrary code), so a checkpoint that ships only those is refused with the fix."""
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for pattern in _PICKLED_WEIGHTS for p in folder.glob(pattern))
    fix = (
        "kvcal loads .safetensors weights only and never unpickles a checkpoint; use a repository that ships "
        "model.safetensors, or convert it once where you trust the file (transformers: "
        "AutoModelForCausalLM.from_pretrained(...).save_pretrained(DIR) writes safetensors) and pass DIR"
    )
    if pickled:
        raise UsageError(f"'{model}' has only pickled PyTorch weights ({', '.join(pickled[:3])}); {fix}")
    raise UsageError(f"'{model}' has no .safetensors weights; {fix}")
