"""`kvcal-lm-eval`: lm-eval's own command line with the `kvcal` model registered, and kvcal's offline task data.

lm-eval 0.4.13 has no model plugin discovery, so `lm_eval --model kvcal` cannot find kvcal's model; this entry
point imports kvcal.evaluate.adapter (which registers it) and runs lm-eval's CLI unchanged. Two options are
kvcal's and are taken out of argv before lm-eval parses it:

    --data-dir DIR        the tasks' data from DIR (laid out like ../shared/data), exactly as `kvcal eval
                          --data-dir`: lm-eval's own task configs with the dataset pointed at the local copy
    --gpqa-password PW    the GPQA archive's password (or $KVCAL_GPQA_PASSWORD), with --data-dir

Without them, lm-eval loads each dataset from the hub or the `datasets` cache, as `lm_eval` does.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvcal.errors import KvcalError, UsageError


@dataclass(frozen=True)
class OfflineData:
    """kvcal's own options of the lm-eval command line."""

    data_dir: str | None = None
    gpqa_password: str | None = None


def split_argv(argv: Sequence[str]) -> tuple[OfflineData, list[str]]:
    """(kvcal's options, the rest of argv for lm-eval, in order). `--data-dir X` and `--data-dir=X` both work."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--data-dir", "--data_dir", dest="data_dir")
    parser.add_argument("--gpqa-password", "--gpqa_password", dest="gpqa_password")
    ours, rest = parser.parse_known_args(list(argv))
    if ours.gpqa_password is not None and ours.data_dir is None:
        raise UsageError("--gpqa-password reads GPQA from --data-dir; pass --data-dir DIR as well")
    return OfflineData(ours.data_dir, ours.gpqa_password), rest


@contextmanager
def offline_tasks(data: OfflineData) -> Iterator[None]:
    """While lm-eval's CLI runs: its task list (names, after lm-eval matched them) replaced by kvcal's offline
    configs of the same tasks (kvcal.evaluate.tasks.resolve_tasks, the path `kvcal eval --data-dir` takes).

    lm-eval's `run` has no hook for task configs between parsing and simple_evaluate, so this wraps
    EvaluatorConfig.process_tasks for the duration (restored after); lm-eval itself puts loaded YAML dicts
    into the same list for `--tasks file.yaml`, so simple_evaluate sees what it already handles."""
    if data.data_dir is None:
        yield
        return
    from lm_eval.config.evaluate_config import EvaluatorConfig

    original = EvaluatorConfig.process_tasks

    def process_tasks(self: EvaluatorConfig, metadata: dict[str, Any] | None = None) -> Any:
        from kvcal.evaluate import tasks

        names = tasks.parse_task_list(self.tasks or "")
        kvcal_only = [name for name in names if name in tasks.OWN_TASKS]
        if kvcal_only:
            raise UsageError(
                f"task(s) {', '.join(kvcal_only)} are kvcal's own, not lm-eval tasks; run them with "
                f"`kvcal eval MODEL --tasks {','.join(kvcal_only)} --data-dir {data.data_dir} -o DIR`"
            )
        plan = tasks.resolve_tasks(
            names, include_path=self.include_path, data_dir=data.data_dir, gpqa_password=data.gpqa_password
        )
        task_manager = original(self, metadata)
        self.tasks = list(plan.lm_eval_specs.values())
        return task_manager

    EvaluatorConfig.process_tasks = process_tasks  # type: ignore[method-assign]
    try:
        yield
    finally:
        EvaluatorConfig.process_tasks = original  # type: ignore[method-assign]


# What kvcal sets for the engine's process unless the user did: a step of the CPU build may take longer than
# vLLM's 300 s RPC timeout on a small loaded CPU (vllm/envs.py VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS @ v0.32.0).
ENGINE_ENV_DEFAULTS = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600"}


def engine_of(argv: Sequence[str]) -> str | None:
    """The serving engine `--model` names (lm-eval's `vllm` backend), or None for an in-process model."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", "-m", dest="model")
    ours, _ = parser.parse_known_args(list(argv))
    return "vllm" if ours.model == "vllm" else None


def run_in_engine(engine: str, argv: Sequence[str]) -> int:
    """`kvcal-lm-eval --model vllm ...` in the engine's own environment (kvcal.engine_env): its interpreter runs
    kvcal.evaluate.engine_lm_eval with kvcal's source folder on PYTHONPATH. An argument list, no shell. Where the
    engine imports in this interpreter, it runs here instead."""
    from importlib.util import find_spec

    module = "kvcal.evaluate.engine_lm_eval"
    if find_spec(engine) is not None:
        import runpy

        sys.argv = [module, *argv]
        runpy.run_module(module, run_name="__main__")
        return 0
    import subprocess
    from pathlib import Path

    from kvcal.engine_env import find_engine

    env = find_engine(engine)
    source = str(Path(__file__).resolve().parents[2])  # the folder holding the kvcal package
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    child_env.update({k: v for k, v in ENGINE_ENV_DEFAULTS.items() if k not in os.environ})
    return subprocess.run([env.python, "-m", module, *argv], env=child_env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> None:
    """The `kvcal-lm-eval` console script. kvcal's anticipated errors are one `Error:` line with their exit
    code (KVCAL_DEBUG=1 adds the traceback); lm-eval's own errors are lm-eval's. `--model vllm` runs lm-eval in
    the engine's environment (run_in_engine)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    engine = engine_of(args_in)
    if engine is not None:
        try:
            split_argv(args_in)  # kvcal's own options checked here, before the engine starts
            sys.exit(run_in_engine(engine, args_in))
        except KvcalError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)
    import kvcal.evaluate.adapter  # noqa: F401  (registers the `kvcal` model with lm-eval)

    run_harness(args_in)


def run_harness(argv: Sequence[str], prepare: Callable[[], object] | None = None) -> None:
    """lm-eval's CLI on `argv` with kvcal's own options split off and its offline task data; `prepare` runs after
    kvcal's options are checked and before lm-eval is imported (the engine's launcher resolves its distribution
    there). kvcal's anticipated errors are one `Error:` line with their exit code (KVCAL_DEBUG=1: the traceback)."""
    try:
        data, rest = split_argv(argv)
        if prepare is not None:
            prepare()
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging

        setup_logging()
        parser = HarnessCLI()
        sys.argv = [sys.argv[0], *rest]  # HarnessCLI reads sys.argv (it inserts `run` for the legacy form)
        args = parser.parse_args()
        with offline_tasks(data):
            parser.execute(args)
    except KvcalError as exc:
        if os.environ.get("KVCAL_DEBUG"):
            import traceback

            traceback.print_exc()
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)

if __name__ == "__main__":
    main()
