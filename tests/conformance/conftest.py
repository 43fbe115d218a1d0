"""Fixtures of the conformance suite: the installed engine release's own store kernels, loaded from its files.

`vllm_kernel(relpath, name)` executes the `@triton.jit` function `name` of the installed release's file
(`kvcal.releases.engine_package`: <repo>/.venv-vllm, or $KVCAL_VLLM_VENV) with kvcal's real `triton` in place of
`vllm.triton_utils`, under the Triton interpreter (TRITON_INTERPRET=1, set per test). Only the named functions are
executed (compiled from the file itself, so their source and line numbers are the release's), not the file's
imports: a launcher that imports vLLM's platform layer, which needs the engine's environment, is replaced by the
launcher's own arguments (read from the file where it computes them); one whose names a test can supply runs
itself (TurboQuant's `triton_turboquant_store`, and methods of its backend named 'Class.method'). Nothing is
copied.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal import releases


@pytest.fixture(scope="session")
def vllm_pkg() -> Path:
    pkg = releases.engine_package("vllm")
    if pkg is None:
        pytest.skip(
            f"no engine environment: <repo>/.venv-vllm (`make engine`) or ${releases.VENV_ENV} holds no vllm package"
        )
    return pkg


@pytest.fixture(scope="session")
def engine_python(vllm_pkg: Path) -> Path:
    """The engine environment's interpreter (<venv>/bin/python beside its vllm package): the engine's own code
    runs there, tensors exchanged as safetensors files."""
    for cand in (vllm_pkg.parents[3] / "bin" / "python", vllm_pkg.parents[3] / "bin" / "python3"):
        if cand.exists():
            return cand
    pytest.skip(f"no engine interpreter beside {vllm_pkg} (a venv's bin/python)")


@pytest.fixture(scope="session")
def run_engine(engine_python: Path) -> Callable[..., tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """run_engine(script, folder, tensors, cfg): run `script` (the engine's own ops) in the engine's interpreter on
    `tensors` (folder/in.safetensors) with `cfg` (JSON) -> (the JSON its last stdout line prints, the tensors it
    wrote to folder/out.safetensors). A script printing {"skip": reason} (a CPU the engine's path refuses) skips
    the test with that reason."""
    import json
    import subprocess

    from safetensors.torch import load_file, save_file

    def run(script: str, folder: Path, tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> tuple[Any, Any]:
        save_file(tensors, str(folder / "in.safetensors"))
        out = subprocess.run(
            [str(engine_python), "-c", script, str(folder / "in.safetensors"), str(folder / "out.safetensors"),
             json.dumps(cfg)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        info = json.loads(out.stdout.strip().splitlines()[-1])
        if "skip" in info:
            pytest.skip(info["skip"])
        return info, load_file(str(folder / "out.safetensors"))

    return run


@pytest.fixture(scope="session")
def vllm_version(vllm_pkg: Path) -> str:
    v = releases.installed_version(vllm_pkg)
    if v not in releases.RELEASES["vllm"]:
        pytest.skip(f"installed vLLM {v} has no kvcal table (known: {', '.join(releases.RELEASES['vllm'])})")
    return v


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TRITON_INTERPRET=1 for the test, and triton.language's own jit helpers (tl.max, tl.sum, ...) re-created
    under it: triton decorates them at its import, and when something imported triton before (transformers does)
    they are compiled-mode functions the interpreter cannot call ("Cannot call @triton.jit'd outside of the scope
    of a kernel"). The release's kernels call them."""
    import triton
    import triton.language as tl
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in (tl, std, tl.math):
        for name, attr in list(vars(mod).items()):
            if isinstance(attr, JITFunction) and not isinstance(attr, InterpretedFunction):
                monkeypatch.setattr(mod, name, triton.jit(attr.fn))
    yield


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """The module-level functions of a file by name, and each class's methods as 'Class.method'."""
    out: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update({f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)})
    return out


def _load(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """Execute the named functions of the release's file (a method as 'Class.method', defined under its own name:
    call it with an object standing for `self`) in a namespace holding triton, tl, torch, math and functools."""
    import functools
    import math

    import triton
    import triton.language as tl

    tree = ast.parse(path.read_text(), filename=str(path))
    found = _functions(tree)
    missing = set(names) - set(found)
    if missing:
        raise AssertionError(f"{path} has no function {sorted(missing)}: the release's kernel moved")
    wanted = [found[n] for n in names]
    ns: dict[str, Any] = {
        "triton": triton, "tl": tl, "torch": torch, "math": math, "functools": functools,
        "__name__": f"vllm_release_{path.stem}",
    }  # fmt: skip
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102 - the release's own source
    return ns


@pytest.fixture
def vllm_kernel(vllm_pkg: Path, interpret: None) -> Callable[..., Any]:
    """(relpath under the package's parent, *names) -> {name: the release's function} (jit ones interpreted)."""

    def load(relpath: str, *names: str) -> dict[str, Any]:
        return _load(vllm_pkg.parent / relpath, names)

    return load


@pytest.fixture
def vllm_constant(vllm_pkg: Path) -> Callable[[str, str], Any]:
    """(relpath, name) -> the literal value of a module-level assignment in the release's file."""

    def read(relpath: str, name: str) -> Any:
        tree = ast.parse((vllm_pkg.parent / relpath).read_text())
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(getattr(t, "id", None) == name for t in targets):
                return node.value
        raise AssertionError(f"{relpath} has no module constant {name}")

    return read


_KV_CACHE: dict[str, Any] = {}


@pytest.fixture(scope="session")
def real_kv(
    real_model_path: Callable[[str], str],
) -> Callable[[str], list[tuple[torch.Tensor, torch.Tensor]]]:
    """name -> per layer (K, V) [T, H_kv, D] in the model's bf16 of one real text's prefill (kvcal's calibration
    hooks: post-RoPE, what a cache stores), 37 tokens (odd), layers 0, 1 and the last."""

    def get(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if name in _KV_CACHE:
            return _KV_CACHE[name]
        path = real_model_path(name)
        from kvcal.calibrate.hooks import forward_observed
        from kvcal.models.loading import load_model

        lm = load_model(path, dtype="bfloat16")
        text = "The quick brown fox jumps over the lazy dog near the river bank, while the engine stores its cache."
        ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, :37]
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # [1, H_kv, T, D]
            got[layer] = (k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous())

        with torch.no_grad():
            forward_observed(lm.model, ids, sink)
        last = max(got)
        _KV_CACHE[name] = [got[i] for i in (0, 1, last)]
        return _KV_CACHE[name]

    return get


@pytest.fixture(scope="session")
def tally() -> Iterator[Callable[[str, str, int], None]]:
    """record(format, case, elements compared); the session prints the totals (run with -s to see them)."""
    rows: list[tuple[str, str, int]] = []

    def record(fmt: str, case: str, n: int) -> None:
        rows.append((fmt, case, n))

    yield record
    if rows:
        fmts = sorted({r[0] for r in rows})
        print(
            f"\nconformance: {len(fmts)} formats ({', '.join(fmts)}), {len(rows)} cases, "
            f"{sum(r[2] for r in rows)} stored elements (codes + scales) compared bit for bit"
        )
