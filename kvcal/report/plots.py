"""The report's plots as base64 PNG (matplotlib, Agg backend; no network, no external assets): capacity vs quality
(Pareto view) and a forest plot of the differences with their intervals, one panel per (task, key metric)."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from kvcal.report.compare import Comparison
from kvcal.report.verdicts import MetricResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plot_values(r: MetricResult) -> tuple[float, float, float, str]:
    """(y, y_low, y_high, unit): accuracy-like metrics as absolute differences, lower-is-better as relative %.
    No interval (insufficient data, an unbounded ratio) -> a bare point."""
    if not r.higher_is_better and r.rel_change is not None:
        lo = r.rel_ci_low if r.rel_ci_low is not None else r.rel_change
        hi = r.rel_ci_high if r.rel_ci_high is not None else r.rel_change
        return 100 * r.rel_change, 100 * lo, 100 * hi, "relative change (%)"
    lo = r.ci_low if r.ci_low is not None else r.diff
    hi = r.ci_high if r.ci_high is not None else r.diff
    return r.diff, lo, hi, "difference"


def _threshold(cmp: Comparison, r: MetricResult) -> float | None:
    """Where the gate line goes in the units `_plot_values` uses for this metric (signed: the bad side); None
    for a metric that does not gate."""
    t = r.gate_threshold
    if t is None:
        return None
    if r.higher_is_better:
        return -t
    return 100 * t if r.rel_change is not None else t


def _key_panels(cmp: Comparison) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r.task, r.label) for r in cmp.results if r.key))


def _find(cmp: Comparison, config: str, task: str, label: str) -> MetricResult | None:
    return next((x for x in cmp.results if x.config == config and x.task == task and x.label == label), None)


def _grid(n_panels: int, width: float, height: float) -> tuple[Any, list[Any]]:
    """A figure with n_panels axes, 3 to a row; the unused ones switched off."""
    ncol = min(3, n_panels)
    nrow = math.ceil(n_panels / ncol)
    fig, axes = _pyplot().subplots(nrow, ncol, figsize=(width * ncol, height * nrow), squeeze=False)
    flat = [axes[k // ncol][k % ncol] for k in range(nrow * ncol)]
    for ax in flat[n_panels:]:
        ax.axis("off")
    return fig, flat[:n_panels]


def _pareto_panel(ax: Any, cmp: Comparison, task: str, label: str) -> None:
    cmap = _pyplot().get_cmap("tab20")
    unit, thr, better = "difference", None, ""
    for i, c in enumerate(cmp.configs[1:]):
        r = _find(cmp, c.label, task, label)
        if r is None or c.capacity is None:
            continue
        y, lo, hi, unit = _plot_values(r)
        thr = _threshold(cmp, r)
        better = "higher is better" if r.higher_is_better else "lower is better"
        marker = "X" if r.gate_fail else ("o" if c.skip == "none" else "s")
        ax.errorbar(c.capacity, y, yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt=marker, color=cmap(i % 20),
                    capsize=3, markersize=7, label=c.label)  # fmt: skip
    ax.scatter([cmp.configs[0].capacity or 1.0], [0.0], marker="*", s=160, color="black", zorder=5,
               label=f"{cmp.baseline} (baseline)")  # fmt: skip
    ax.axhline(0, color="grey", lw=0.8)
    if thr is not None:
        ax.axhline(thr, color="red", ls="--", lw=0.8, label="gate threshold")
    ax.set_xlabel("KV tokens that fit vs BF16 (x)")
    ax.set_ylabel(f"{label} {unit}")
    ax.set_title(f"{task} · {label} ({better})", fontsize=10)
    ax.grid(alpha=0.3)


def pareto_png(cmp: Comparison) -> str | None:
    """Capacity multiplier (x) vs the change in each key metric (y), one panel per (task, key metric)."""
    panels = _key_panels(cmp)
    if not panels:
        return None
    fig, axes = _grid(len(panels), 5.4, 4.2)
    for ax, (task, label) in zip(axes, panels, strict=True):
        _pareto_panel(ax, cmp, task, label)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(
        handles, labels, loc="upper center", ncol=min(3, len(labels)), fontsize=8, bbox_to_anchor=(0.5, 0.0)
    )
    fig.suptitle(
        "Capacity vs quality (Pareto view): right = more tokens; circles keep every layer quantized, squares skip "
        "layers, X fails the gate"
    )
    return _png(fig)


def _forest_panel(ax: Any, cmp: Comparison, task: str, label: str, first_column: bool) -> None:
    others = [c.label for c in cmp.configs[1:]]
    unit, thr = "difference", None
    for i, cfg in enumerate(others):
        r = _find(cmp, cfg, task, label)
        if r is None:
            continue
        y, lo, hi, unit = _plot_values(r)
        thr = _threshold(cmp, r)
        color = (
            "#c0392b" if r.gate_fail else ("#e67e22" if r.worse else ("#27ae60" if r.better else "#34495e"))
        )
        marker = "x" if r.insufficient else "o"
        ax.errorbar(y, i, xerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt=marker, color=color, capsize=3)
    ax.axvline(0, color="grey", lw=0.8)
    if thr is not None:
        ax.axvline(thr, color="red", ls="--", lw=0.8)
    ax.set_yticks(range(len(others)))
    ax.set_yticklabels(others if first_column else [""] * len(others), fontsize=7)
    ax.invert_yaxis()
    ax.set_title(f"{task} · {label}", fontsize=9)
    ax.set_xlabel(f"{unit} vs baseline", fontsize=8)
    ax.grid(alpha=0.3, axis="x")


def forest_png(cmp: Comparison) -> str | None:
    """Per-task differences with their intervals (a forest plot), one panel per key metric."""
    panels = _key_panels(cmp)
    if not panels:
        return None
    n_others = len(cmp.configs) - 1
    fig, axes = _grid(len(panels), 5.8, 0.42 * n_others + 1.6)
    for k, (ax, (task, label)) in enumerate(zip(axes, panels, strict=True)):
        _forest_panel(ax, cmp, task, label, first_column=k % 3 == 0)
    fig.suptitle(
        f"Differences from the baseline with {1 - cmp.alpha:.0%} intervals (accuracy: Newcombe; others: BCa "
        "bootstrap; relative: Fieller). Red: over the gate, orange: significant, x: insufficient data, dashed: "
        "gate threshold",
        fontsize=9,
    )
    fig.tight_layout()
    return _png(fig)
