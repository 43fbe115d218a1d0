"""Long-context views of a comparison, read from the runs' results.json (the contracts of issue 14):

- `kl_by_position`: kvcal's kl task averaged in position buckets (1-512, 513-1024, 1025-2048, ... by the
  1-based position of the predicting token), with per-window bucket means. Per configuration: the curve (KL with
  its t interval over windows) and a paired t test of the last bucket vs the first, the windows being the pairs
  (kvcal.report.stats.paired_t), Holm-adjusted over the configurations when the comparison corrects for
  multiple testing. "Grows" is said only when that test is significant.
- `passkey_by_cell`: passkey / passkey_mc accuracy per (prompt length, key depth) cell.
- The context the runs evaluated (kl windows: config.yaml's kl_seq_len; passkey: the longest prompt length),
  the default context of the capacity column (kvcal.report.compare).

Nothing here reads run directories: it takes loaded runs (kvcal.report.runs.Run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvcal.report import stats
from kvcal.report.runs import Run
from kvcal.tasknames import PASSKEY_TASKS

KL_BY_POSITION = "kl_by_position"
PASSKEY_BY_CELL = "passkey_by_cell"
# The baseline "retrieves" at a length when its accuracy over every depth there is at least this (issue 14).
RETRIEVES = 0.8

GROWS, SHRINKS, FLAT, ONE_WINDOW, ONE_BUCKET = (
    "grows", "shrinks", "no significant change", "needs >= 2 windows", "one bucket",
)  # fmt: skip

Warn = Callable[[str], None]


@dataclass
class Bucket:
    lo: int
    hi: int
    n_tokens: int
    kl: float
    kl_stderr: float | None
    top1_agree: float | None
    nll: float | None
    per_window_kl: list[float]

    @property
    def label(self) -> str:
        return f"{self.lo}–{self.hi}"


@dataclass
class Growth:
    """The paired test of the last position bucket vs the first, windows as the pairs."""

    verdict: str  # GROWS | SHRINKS | FLAT | ONE_WINDOW | ONE_BUCKET
    n_windows: int
    first: str = ""
    last: str = ""
    kl_first: float | None = None
    kl_last: float | None = None
    diff: float | None = None  # mean over windows of (last - first)
    ci_low: float | None = None
    ci_high: float | None = None
    p_value: float | None = None
    p_adjusted: float | None = None  # Holm over the configurations tested

    @property
    def p(self) -> float | None:
        return self.p_adjusted if self.p_adjusted is not None else self.p_value


@dataclass
class PositionCurve:
    config: str
    seq_len: int | None
    prefill_chunk: int | None
    n_windows: int
    buckets: list[Bucket]
    growth: Growth = field(default_factory=lambda: Growth(ONE_BUCKET, 0))
    subsample: int = 1  # kl's --kl-subsample: positions 0, N, 2N, ... scored

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PasskeyGrid:
    """One configuration's accuracy per (length, depth) cell of one passkey variant."""

    config: str
    task: str  # 'passkey' | 'passkey_mc'
    lengths: list[int]
    depths: list[float]
    cells: dict[tuple[int, float], dict[str, float]]  # (length, depth) -> {"acc", "n", "acc_stderr"}

    def acc(self, length: int, depth: float) -> float | None:
        c = self.cells.get((length, depth))
        return None if c is None else c["acc"]

    def length_acc(self, length: int) -> float | None:
        """Accuracy over every depth at one length (weighted by each cell's n)."""
        cs = [c for (ln, _), c in self.cells.items() if ln == length]
        n = sum(c["n"] for c in cs)
        return None if not cs or n <= 0 else sum(c["acc"] * c["n"] for c in cs) / n

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "task": self.task,
            "cells": [{"length": ln, "depth": d, **c} for (ln, d), c in sorted(self.cells.items())],
        }


# --------------------------------------------------------------------------------------------------------------
# Reading the keys


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _bucket(raw: Any) -> Bucket:
    if not isinstance(raw, dict):
        raise ValueError("a bucket is not a mapping")
    lo, hi, kl = _num(raw.get("lo")), _num(raw.get("hi")), _num(raw.get("kl"))
    if lo is None or hi is None or kl is None:
        raise ValueError("a bucket lacks lo, hi or kl")
    per = (raw.get("per_window") or {}).get("kl") or []
    if not isinstance(per, list) or not all(_num(x) is not None for x in per):
        raise ValueError("per_window.kl is not a list of numbers")
    return Bucket(
        lo=int(lo), hi=int(hi), n_tokens=int(_num(raw.get("n_tokens")) or 0), kl=kl,
        kl_stderr=_num(raw.get("kl_stderr")), top1_agree=_num(raw.get("top1_agree")), nll=_num(raw.get("nll")),
        per_window_kl=[float(x) for x in per],
    )  # fmt: skip


def position_curve(label: str, runs: Iterable[Run], warn: Warn) -> PositionCurve | None:
    """The `kl_by_position` of the first of `runs` that has one (None when none has); a malformed one is left out
    with a warning."""
    for run in runs:
        raw = run.results.get(KL_BY_POSITION)
        if raw is None:
            continue
        try:
            if not isinstance(raw, dict) or not isinstance(raw.get("buckets"), list) or not raw["buckets"]:
                raise ValueError("no buckets")
            buckets = sorted((_bucket(b) for b in raw["buckets"]), key=lambda b: b.lo)
            n = _num(raw.get("n_windows"))
            n_windows = int(n) if n is not None else len(buckets[0].per_window_kl)
            if any(len(b.per_window_kl) != n_windows for b in buckets):
                raise ValueError(f"per_window.kl does not hold one value for each of the {n_windows} windows")
        except (ValueError, AttributeError) as exc:
            warn(
                f"{KL_BY_POSITION} of {run.path} is malformed ({exc}); KL by position is left out for {label}"
            )
            return None
        seq, chunk = _num(raw.get("seq_len")), _num(raw.get("prefill_chunk"))
        return PositionCurve(
            label,
            None if seq is None else int(seq),
            None if chunk is None else int(chunk),
            n_windows,
            buckets,
            subsample=int(_num(raw.get("subsample")) or 1),
        )
    return None


def _growth(curve: PositionCurve, alpha: float) -> Growth:
    first, last = curve.buckets[0], curve.buckets[-1]
    if len(curve.buckets) < 2:
        return Growth(ONE_BUCKET, curve.n_windows, first.label, first.label, first.kl, first.kl)
    g = Growth(FLAT, curve.n_windows, first.label, last.label, first.kl, last.kl)
    a, b = np.asarray(first.per_window_kl), np.asarray(last.per_window_kl)
    if curve.n_windows < 2:
        g.verdict, g.diff = ONE_WINDOW, last.kl - first.kl
        return g
    test = stats.paired_t(a, b, alpha)
    g.diff, g.ci_low, g.ci_high, g.p_value = float(np.mean(b - a)), test.ci_low, test.ci_high, test.p_value
    return g


def judge_growth(curves: Sequence[PositionCurve], alpha: float, holm: bool) -> None:
    """Test every curve's last bucket vs its first; Holm over the curves tested when `holm`; set the verdicts."""
    for c in curves:
        c.growth = _growth(c, alpha)
    tested = [c.growth for c in curves if c.growth.p_value is not None]
    if holm and len(tested) > 1:
        for g, p in zip(tested, stats.holm([g.p_value for g in tested], alpha), strict=True):  # type: ignore[misc]
            g.p_adjusted = p
    for g in tested:
        assert g.p is not None and g.diff is not None
        if g.p < alpha:
            g.verdict = GROWS if g.diff > 0 else SHRINKS


def growth_sentence(g: Growth, alpha: float) -> str:
    """One sentence: does the damage (KL) grow with position?"""
    if g.verdict == ONE_BUCKET:
        return f"one position bucket only ({g.first}): nothing to compare; evaluate longer windows (--kl-seq-len)"
    change = f"KL {stats_num(g.kl_first)} at positions {g.first} vs {stats_num(g.kl_last)} at {g.last}"
    if g.verdict == ONE_WINDOW:
        return f"{change}; the paired test needs >= 2 windows (this run has {g.n_windows}): raise --limit"
    p = _p_words(g)
    ci = f"[{g.ci_low:+.3g}, {g.ci_high:+.3g}]" if g.ci_low is not None and g.ci_high is not None else ""
    level = f"{1 - alpha:.0%}"
    what = {
        GROWS: "the damage grows with position",
        SHRINKS: "the damage shrinks with position",
        FLAT: "no significant change with position",
    }[g.verdict]
    return f"{what}: {change}, difference {g.diff:+.3g} {level} CI {ci} (paired t over {g.n_windows} windows, {p})"


def _p_words(g: Growth) -> str:
    p = "p < 0.001" if (g.p_value or 0) < 0.001 else f"p = {g.p_value:.3f}"
    if g.p_adjusted is not None:
        p += f", Holm-adjusted {'< 0.001' if g.p_adjusted < 0.001 else f'{g.p_adjusted:.3f}'}"
    return p


def stats_num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def bucket_interval(b: Bucket, n_windows: int, alpha: float) -> tuple[float, float] | None:
    """The t interval of a bucket's KL over windows (None with one window)."""
    return stats.t_interval(b.kl, b.kl_stderr, n_windows, alpha)


def shows_position(curves: Sequence[PositionCurve]) -> bool:
    """Whether KL by position says anything: some configuration has more than one position bucket."""
    return any(len(c.buckets) > 1 for c in curves)


def position_curves(
    configs: Sequence[tuple[str, list[Run]]], alpha: float, holm: bool, warn: Warn
) -> list[PositionCurve]:
    """The KL-by-position curve of every configuration whose runs carry one, judged (judge_growth)."""
    curves = [c for c in (position_curve(label, runs, warn) for label, runs in configs) if c is not None]
    seqs = sorted({c.seq_len for c in curves if c.seq_len is not None})
    if len(seqs) > 1:
        warn(f"KL by position: the configurations evaluated different window lengths ({', '.join(map(str, seqs))} "
             "tokens); their curves are comparable only over the buckets they share")  # fmt: skip
    judge_growth(curves, alpha, holm)
    return curves


# --------------------------------------------------------------------------------------------------------------
# Passkey


def _passkey_cells(raw: Any) -> dict[tuple[int, float], dict[str, float]]:
    if not isinstance(raw, list):
        raise ValueError("not a list of cells")
    cells: dict[tuple[int, float], dict[str, float]] = {}
    for c in raw:
        if not isinstance(c, dict):
            raise ValueError("a cell is not a mapping")
        length, depth, acc = _num(c.get("length")), _num(c.get("depth")), _num(c.get("acc"))
        if length is None or depth is None or acc is None:
            raise ValueError("a cell lacks length, depth or acc")
        n = _num(c.get("n"))
        cells[(int(length), float(depth))] = {
            "acc": acc, "n": 1.0 if n is None else n, "acc_stderr": _num(c.get("acc_stderr")) or 0.0,
        }  # fmt: skip
    if not cells:
        raise ValueError("no cells")
    return cells


def passkey_grids(label: str, runs: Iterable[Run], warn: Warn) -> list[PasskeyGrid]:
    """One grid per passkey variant found in the runs' `passkey_by_cell` (the first run holding a variant wins)."""
    grids: dict[str, PasskeyGrid] = {}
    for run in runs:
        raw = run.results.get(PASSKEY_BY_CELL)
        if not isinstance(raw, dict):
            if raw is not None:
                warn(f"{PASSKEY_BY_CELL} of {run.path} is not a mapping; left out")
            continue
        for task, cells_raw in raw.items():
            if task in grids:
                continue
            try:
                cells = _passkey_cells(cells_raw)
            except ValueError as exc:
                warn(f"{PASSKEY_BY_CELL}.{task} of {run.path} is malformed ({exc}); left out for {label}")
                continue
            lengths = sorted({ln for ln, _ in cells})
            depths = sorted({d for _, d in cells})
            grids[task] = PasskeyGrid(label, str(task), lengths, depths, cells)
    order = {t: i for i, t in enumerate(PASSKEY_TASKS)}
    return sorted(grids.values(), key=lambda g: (order.get(g.task, len(order)), g.task))


def baseline_retrieval(grids: Sequence[PasskeyGrid], baseline: str, task: str) -> tuple[list[int], list[int]]:
    """(lengths where the baseline's accuracy over every depth is >= RETRIEVES, lengths where it is not)."""
    g = next((x for x in grids if x.config == baseline and x.task == task), None)
    if g is None:
        return [], []
    good = [ln for ln in g.lengths if (g.length_acc(ln) or 0.0) >= RETRIEVES]
    return good, [ln for ln in g.lengths if ln not in good]


# --------------------------------------------------------------------------------------------------------------
# The context the runs evaluated


def evaluated_context(run: Run) -> tuple[int, str] | None:
    """(tokens, what) of the longest context one run evaluated: its kl windows (kl_seq_len), its passkey prompts
    (the longest length in passkey_by_cell); None when neither is known (other tasks do not say)."""
    found: list[tuple[int, str]] = []
    if "kl" in run.config.tasks and run.config.kl_seq_len:
        found.append((int(run.config.kl_seq_len), f"kl windows of {run.config.kl_seq_len} tokens"))
    raw = run.results.get(PASSKEY_BY_CELL)
    if isinstance(raw, dict):
        lengths = [
            int(c["length"]) for cells in raw.values() if isinstance(cells, list)
            for c in cells if isinstance(c, dict) and _num(c.get("length")) is not None
        ]  # fmt: skip
        if lengths:
            found.append((max(lengths), f"passkey prompts of {max(lengths)} tokens"))
    return max(found) if found else None


def longest_context(runs: Iterable[Run]) -> tuple[int, str] | None:
    """The longest context any of `runs` evaluated, with what evaluated it."""
    found = [c for c in map(evaluated_context, runs) if c is not None]
    return max(found) if found else None
