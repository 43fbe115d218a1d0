"""`kvcal models list|install|path`: the two real models of kvcal's demos (pip packages holding GGUF files)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal.commands.options import JsonOpt
from kvcal.commands.output import console, err_console, print_json
from kvcal.errors import KvcalError, UsageError


def _real_models() -> dict[str, dict[str, str]]:
    from kvcal.models.real import REAL_MODELS

    return REAL_MODELS


def _converted(gguf: str | None) -> str | None:
    """The cached safetensors conversion of `gguf`, if one exists."""
    from kvcal.filecache import cache_root

    if not gguf:
        return None
    root = cache_root() / "models"
    hits = sorted(root.glob(f"{Path(gguf).stem}-*/config.json")) if root.is_dir() else []
    return str(hits[0].parent) if hits else None


def _model_state(name: str) -> dict[str, Any]:
    from kvcal.models.real import real_model_if_present

    spec = _real_models()[name]
    gguf = real_model_if_present(name)
    return {
        "name": name,
        "package": spec["package"],
        "install": spec["pip"],
        "installed": importlib.util.find_spec(spec["package"]) is not None,
        "gguf": gguf,
        "converted": _converted(gguf),
    }


def models_list(json_out: JsonOpt = False) -> None:
    """Which real models are installed, assembled and converted."""
    rows = [_model_state(n) for n in _real_models()]
    if json_out:
        print_json(rows)
        return
    table = Table(title="kvcal real models")
    for col in ("name", "installed", "gguf", "converted (safetensors)"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"],
            "yes" if r["installed"] else f"no: {r['install']}",
            r["gguf"] or "-",
            r["converted"] or "-",
        )
    console.print(table)


def _pip_install(name: str) -> None:
    spec = _real_models().get(name)
    if spec is None:
        raise UsageError(f"unknown real model '{name}'; choose one of {', '.join(_real_models())} or all")
    args = spec["pip"].split()[2:]  # "pip install <args...>"
    err_console.print(f"[dim]{sys.executable} -m pip install {' '.join(args)}[/dim]", highlight=False)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["pip failed"]
        raise KvcalError(f"installing {name} failed: {tail[0]}; run `{spec['pip']}` yourself to see why")


def models_install(
    name: Annotated[str, typer.Argument(help="smollm2, gemma3-270m or all.")] = "all",
    json_out: JsonOpt = False,
) -> None:
    """pip-install a real model package into this environment (no hub needed)."""
    names = list(_real_models()) if name == "all" else [name]
    for n in names:
        _pip_install(n)
    if json_out:
        print_json([{"name": n, "installed": True} for n in names])
        return
    for n in names:
        console.print(f"{n}: installed; `kvcal models path {n}` converts it once")


def models_path(
    name: Annotated[str, typer.Argument(help="smollm2 or gemma3-270m.", show_default=False)],
    gguf: Annotated[
        bool, typer.Option("--gguf", help="Print the GGUF file instead (no conversion).")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """The local safetensors folder of a real model (converted once from its GGUF)."""
    from kvcal.models.real import real_model
    from kvcal.models.resolve import resolve_model

    gguf_path = real_model(name)
    result = {"name": name, "gguf": gguf_path}
    if not gguf:
        err_console.print(
            f"[dim]resolving {gguf_path} (first time: converts to safetensors)[/dim]", highlight=False
        )
        result["path"] = str(resolve_model(gguf_path))
    if json_out:
        print_json(result)
    else:
        console.print(result.get("path", result["gguf"]), highlight=False)
