"""lm-eval's git probe, quiet: `simple_evaluate` records `git describe --always` of the current directory and
lets git print `fatal: not a git repository` to the terminal outside a checkout. `quiet_git_probe()` runs the
same probe (same command, same fallback, so results.json's `git_hash` is unchanged) with git's stderr discarded;
nothing else is redirected, so kvcal's and lm-eval's own messages still reach the terminal."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


def git_commit_hash() -> str | None:
    """lm_eval.loggers.utils.get_git_commit_hash (lm-eval 0.4.13) with git's stderr discarded."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return (
            subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)
            .strip()
            .decode()
        )  # noqa: S607
    except (subprocess.CalledProcessError, FileNotFoundError):  # not a checkout, or no git installed
        return get_commit_from_path(os.getcwd())


@contextmanager
def quiet_git_probe() -> Iterator[None]:
    """lm-eval's evaluator calls `git_commit_hash` instead of its own probe inside this block."""
    import lm_eval.evaluator as evaluator

    original = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = git_commit_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original
