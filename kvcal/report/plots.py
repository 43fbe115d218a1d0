"""The report's plots as base64 PNG (matplotlib, Agg backend; no network, no external assets): capacity vs quality
(Pareto view) and a forest plot of the differences with their intervals, one panel per (task, key metric); for
long-context runs KL by position (a curve per configuration) and passkey heatmaps (a panel per configuration)."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from kvcal.report import longcontext as lc
from kvcal.report import numbers as fmt
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
    ax.set_xlabel(capacity_axis_label(cmp))
    ax.set_ylabel(f"{label} {unit}")
    ax.set_title(f"{task} · {label} ({better})", fontsize=10)
    ax.grid(alpha=0.3)


def capacity_axis_label(cmp: Comparison) -> str:
    """The Pareto view's x label, with the context the capacity assumes."""
    if cmp.context is not None:
        return f"KV tokens that fit vs BF16 (x) @ {fmt.tokens(cmp.context)} context"
    if cmp.sliding_layers:
        return "KV tokens that fit vs BF16 (x), sliding layers in full (context <= window)"
    return "KV tokens that fit vs BF16 (x)"


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


# ---- long context ------------------------------------------------------------------------------------------------


def kl_position_png(cmp: Comparison) -> str | None:
    """KL vs position (log x: each bucket at its last position), one curve per configuration with its t
    interval over windows as error bars. A configuration whose KL is 0 everywhere (the BF16 baseline measured
    against a BF16 cache) is left out so that the y axis can be logarithmic."""
    curves = [c for c in cmp.by_position if any(b.kl > 0 for b in c.buckets)]
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    cmap = plt.get_cmap("tab10")
    positive = all(b.kl > 0 for c in curves for b in c.buckets)
    for i, c in enumerate(curves):
        xs = [b.hi for b in c.buckets]
        ys = [b.kl for b in c.buckets]
        cis = [lc.bucket_interval(b, c.n_windows, cmp.alpha) for b in c.buckets]
        lo = [y - ci[0] if ci else 0.0 for y, ci in zip(ys, cis, strict=True)]
        hi = [ci[1] - y if ci else 0.0 for y, ci in zip(ys, cis, strict=True)]
        if positive:  # a log axis cannot draw a bar below 0
            lo = [min(d, 0.95 * y) for d, y in zip(lo, ys, strict=True)]
        mark = {lc.GROWS: " (grows)", lc.SHRINKS: " (shrinks)"}.get(c.growth.verdict, "")
        ax.errorbar(
            xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=cmap(i % 10), label=f"{c.config}{mark}"
        )
    ax.set_xscale("log", base=2)
    spans = sorted({(b.lo, b.hi) for c in curves for b in c.buckets})
    ax.set_xticks([hi for _, hi in spans], [f"{lo}–{hi}" for lo, hi in spans], fontsize=7)
    ax.minorticks_off()
    if positive:
        ax.set_yscale("log")
    ax.set_xlabel("position of the predicting token (bucket, log scale)")
    ax.set_ylabel("KL vs BF16 cache (nats per token)")
    ax.set_title(f"KL by position with {1 - cmp.alpha:.0%} t intervals over windows", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def passkey_png(cmp: Comparison, task: str) -> str | None:
    """Heatmaps of one passkey variant: a panel per configuration, length (rows) x depth (columns), accuracy."""
    grids = [g for g in cmp.passkey if g.task == task]
    if not grids:
        return None
    fig, axes = _grid(len(grids), 4.2, 0.45 * max(len(g.lengths) for g in grids) + 1.8)
    image = None
    for ax, g in zip(axes, grids, strict=True):
        acc = [[g.acc(ln, d) for d in g.depths] for ln in g.lengths]
        grid = [[math.nan if a is None else a for a in row] for row in acc]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        for r, row in enumerate(acc):
            for k, a in enumerate(row):
                if a is not None:
                    dark = a > 0.8 or a < 0.15  # the ends of RdYlGn: white text reads better there
                    ax.text(
                        k,
                        r,
                        f"{a:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
        ax.set_xticks(range(len(g.depths)), [fmt.depth(d) for d in g.depths], fontsize=7)
        ax.set_yticks(range(len(g.lengths)), [fmt.tokens(ln) for ln in g.lengths], fontsize=7)
        ax.set_xlabel("key depth", fontsize=8)
        ax.set_ylabel("prompt length (tokens)", fontsize=8)
        ax.set_title(g.config, fontsize=8)
    fig.suptitle(f"{task}: accuracy by prompt length and key depth", fontsize=10)
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    return _png(fig)


# ---- output agreement --------------------------------------------------------------------------------------------


def survival_png(cmp: Comparison, task: str) -> str | None:
    """P(no divergence by generated token t): the Kaplan-Meier step curve of each configuration of divergence task
    `task` (kvcal.report.agreement) with its Hall-Wellner 95% band where statsmodels forms one."""
    rows = [r for r in cmp.agreement_rows if r["task"] == task]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    cmap = plt.get_cmap("tab10")
    end = max((r.get("gen_len") or 1) for r in rows)
    for i, r in enumerate(rows):
        km = r["km"]
        xs, ys = [0, *km["times"], end], [1.0, *km["surv"], km["surv"][-1] if km["surv"] else 1.0]
        ax.step(xs, ys, where="post", color=cmap(i % 10), label=r["config"])
        if km["times"] and all(v is not None for v in km["lo"] + km["hi"]):
            ax.fill_between(km["times"], km["lo"], km["hi"], step="post", color=cmap(i % 10), alpha=0.15)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("generated token")
    ax.set_ylabel("P(identical to the BF16 output so far)")
    ax.set_title(f"{task}: survival of greedy outputs (Kaplan-Meier, 95% band)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)
