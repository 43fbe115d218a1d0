"""Render a Comparison: a Markdown report (tables a release engineer acts on) and one self-contained HTML file
with the plots embedded as base64 PNG (matplotlib, Agg backend; no network, no external assets)."""

from __future__ import annotations

import base64
import html
import io
import math
from datetime import UTC, datetime

from kvcal import __version__
from kvcal.report.compare import Comparison, MetricResult


def _f(x: float | None, digits: int = 3) -> str:
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


def _sig(x: float | None, digits: int = 4) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:+.2%}"


def _p(x: float | None) -> str:
    if x is None:
        return "—"
    return "<0.001" if x < 0.001 else f"{x:.3f}"


def _mult(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _digits(r: MetricResult) -> int:
    return 3 if r.higher_is_better or abs(r.base) < 100 else 2


def _score(r: MetricResult, base: bool = False) -> str:
    v, se = (r.base, r.base_se) if base else (r.score, r.score_se)
    if r.higher_is_better and abs(v) <= 1:
        return f"{v:.3f} ± {se:.3f}"
    return f"{_sig(v)} ± {_sig(se, 2)}"


def _diff(r: MetricResult) -> str:
    if r.higher_is_better and abs(r.base) <= 1:
        return f"{r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
    return f"{r.diff:+.4g} [{r.ci_low:+.4g}, {r.ci_high:+.4g}]"


def _rel(r: MetricResult) -> str:
    if r.rel_change is None:
        return "n/a"
    if r.rel_ci_low is None or r.rel_ci_high is None:
        return _pct(r.rel_change)
    return f"{_pct(r.rel_change)} [{_pct(r.rel_ci_low)}, {_pct(r.rel_ci_high)}]"


def _mdd(r: MetricResult) -> str:
    if not r.higher_is_better and r.mdd_rel is not None:
        return f"{r.mdd_rel:.2%}"
    return _f(r.mdd) if (r.higher_is_better and abs(r.base) <= 1) else _sig(r.mdd)


def _status(r: MetricResult) -> str:
    if r.gate_fail:
        return "**FAIL**"
    if r.identical:
        return "identical"
    if r.worse:
        return "worse"
    if r.better:
        return "better"
    return "n.s."


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def _by_metric(task_results: list[MetricResult]) -> list[tuple[str, list[MetricResult]]]:
    """One task's results grouped by metric label, in first-seen order (the order compare produced)."""
    groups: dict[str, list[MetricResult]] = {}
    for r in task_results:
        groups.setdefault(r.label, []).append(r)
    return list(groups.items())


def render_markdown(cmp: Comparison) -> str:
    """The report as Markdown."""
    gate = "PASSED" if not cmp.failures else f"FAILED ({len(cmp.failures)} regression(s))"
    lines: list[str] = []
    add = lines.append
    add("# kvcal KV-cache comparison report")
    add("")
    add(f"- **Model:** `{cmp.model}`")
    add(f"- **Baseline:** `{cmp.baseline}`")
    add(f"- **Tasks:** {', '.join(cmp.tasks)}")
    add(
        f"- **Gate:** {gate} — a configuration fails when a key metric degrades significantly (p < {cmp.alpha}) "
        f"by more than {cmp.max_drop:g} (absolute for accuracy-like metrics, relative for perplexity/KL)"
    )
    add(f"- **Generated:** {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} by kvcal {__version__}")
    add("")

    if cmp.failures:
        add("## Regressions over the gate threshold")
        add("")
        for r in cmp.failures:
            add(f"- `{r.config}`: {r.verdict} (difference {_diff(r)}, relative {_rel(r)})")
        add("")

    add("## Summary")
    add("")
    add(
        "| configuration | kv format | scales | skip layers | tokens vs BF16 | throughput vs baseline | gate | verdict |"
    )
    add("|---|---|---|---|---|---|---|---|")
    for c in cmp.configs:
        if c.label == cmp.baseline:
            gate_c, verdict = "baseline", "baseline"
        else:
            gate_c = "FAIL" if any(r.gate_fail for r in cmp.by_config(c.label)) else "pass"
            verdict = cmp.config_verdict(c.label)
        add(
            f"| `{c.label}` | {c.kv_format} | {c.scales} | {c.skip} | {_mult(c.capacity)} | "
            f"{_mult(c.throughput_ratio)} | {gate_c} | {_md_escape(verdict)} |"
        )
    add("")

    for task in cmp.tasks:
        task_results = [r for r in cmp.results if r.task == task]
        if not task_results:
            continue
        add(f"## {task}")
        add("")
        for metric_label, rows in _by_metric(task_results):
            r0 = rows[0]
            direction = "higher is better" if r0.higher_is_better else "lower is better"
            key = "key metric" if r0.key else "secondary"
            add(f"### {task} · `{metric_label}` ({direction}; {key})")
            add("")
            add(f"Baseline `{cmp.baseline}`: {_score(r0, base=True)} (n = {r0.n_base_total})")
            add("")
            test_col = "McNemar p" if any(r.binary for r in rows) else "significant"
            add(
                f"| configuration | score ± SE | difference [95% CI] | relative change | {test_col} | "
                "min. detectable | n paired | status |"
            )
            add("|---|---|---|---|---|---|---|---|")
            for r in rows:
                test = _p(r.p_value) if r.binary else ("yes" if r.significant else "no")
                add(
                    f"| `{r.config}` | {_score(r)} | {_diff(r)} | {_rel(r)} | {test} | {_mdd(r)} | "
                    f"{r.n} | {_status(r)} |"
                )
            add("")

    if cmp.warnings or cmp.skipped_runs:
        add("## Warnings")
        add("")
        for w in cmp.warnings:
            add(f"- {w}")
        add("")

    add("## How to read this report")
    add("")
    add(
        "- **difference [95% CI]**: configuration minus baseline over the samples both runs scored, with a paired "
        f"bootstrap percentile interval ({cmp.n_boot} resamples, seed {cmp.seed})."
    )
    add(
        "- **McNemar p**: exact two-sided binomial test on the discordant pairs (one run right, the other wrong); "
        "used for significance of exact-match/accuracy metrics. Other metrics are significant when the interval "
        "excludes 0."
    )
    add(
        "- **relative change** (lower-is-better metrics): configuration / baseline - 1; the gate threshold is relative "
        "for these, except where the baseline is ~0 (kvcal's `kl` of a BF16 run, measured against a BF16 cache): "
        "there the threshold applies to the absolute difference (nats)."
    )
    add(
        "- **min. detectable**: the smallest change this many samples would detect with 80% power at "
        f"alpha {cmp.alpha} (relative for lower-is-better metrics). *No significant change* is not *no change*: a "
        "drop smaller than this can go unnoticed."
    )
    add(
        "- **tokens vs BF16**: KV-cache tokens that fit in the same memory as a BF16 cache (skipped layers stay at "
        "16 bits). **throughput**: measured tokens/s relative to the baseline run (same machine assumed)."
    )
    add("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg) and HTML


def _png(fig: object) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plot_values(r: MetricResult) -> tuple[float, float, float, str]:
    """(y, y_low, y_high, unit): accuracy-like metrics as absolute differences, lower-is-better as relative %."""
    if not r.higher_is_better and r.rel_change is not None:
        lo = r.rel_ci_low if r.rel_ci_low is not None else r.rel_change
        hi = r.rel_ci_high if r.rel_ci_high is not None else r.rel_change
        return 100 * r.rel_change, 100 * lo, 100 * hi, "relative change (%)"
    return r.diff, r.ci_low, r.ci_high, "difference"


def _threshold(cmp: Comparison, r: MetricResult) -> float:
    """Where the gate line goes in the units `_plot_values` uses for this metric (signed: the bad side)."""
    if r.higher_is_better:
        return -cmp.max_drop
    return 100 * cmp.max_drop if r.rel_change is not None else cmp.max_drop


def _key_panels(cmp: Comparison) -> list[tuple[str, str]]:
    panels: list[tuple[str, str]] = []
    for r in cmp.results:
        if r.key and (r.task, r.label) not in panels:
            panels.append((r.task, r.label))
    return panels


def _find(cmp: Comparison, config: str, task: str, label: str) -> MetricResult | None:
    return next((x for x in cmp.results if x.config == config and x.task == task and x.label == label), None)


def pareto_png(cmp: Comparison) -> str | None:
    """Capacity multiplier (x) vs the change in each key metric (y), one panel per (task, key metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _key_panels(cmp)
    if not panels:
        return None
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.4 * ncol, 4.2 * nrow), squeeze=False)
    cmap = plt.get_cmap("tab20")
    others = cmp.configs[1:]
    for k, (task, label) in enumerate(panels):
        ax = axes[k // ncol][k % ncol]
        unit, thr, better = "difference", None, ""
        for i, c in enumerate(others):
            r = _find(cmp, c.label, task, label)
            if r is None or c.capacity is None:
                continue
            y, lo, hi, unit = _plot_values(r)
            thr = _threshold(cmp, r)
            better = "higher is better" if r.higher_is_better else "lower is better"
            marker = "X" if r.gate_fail else ("o" if c.skip == "none" else "s")
            ax.errorbar(
                c.capacity, y, yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt=marker, color=cmap(i % 20),
                capsize=3, markersize=7, label=c.label,
            )  # fmt: skip
        ax.scatter([cmp.configs[0].capacity or 1.0], [0.0], marker="*", s=160, color="black", zorder=5,
                   label=f"{cmp.baseline} (baseline)")  # fmt: skip
        ax.axhline(0, color="grey", lw=0.8)
        if thr is not None:
            ax.axhline(thr, color="red", ls="--", lw=0.8, label="gate threshold")
        ax.set_xlabel("KV tokens that fit vs BF16 (x)")
        ax.set_ylabel(f"{label} {unit}")
        ax.set_title(f"{task} · {label} ({better})", fontsize=10)
        ax.grid(alpha=0.3)
    for k in range(len(panels), nrow * ncol):
        axes[k // ncol][k % ncol].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(handles, labels, loc="upper center", ncol=min(3, len(labels)), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))  # fmt: skip
    fig.suptitle(
        "Capacity vs quality (Pareto view): right = more tokens; circles keep every layer quantized, squares skip "
        "layers, X fails the gate"
    )
    return _png(fig)


def forest_png(cmp: Comparison) -> str | None:
    """Per-task differences with their 95% intervals (a forest plot), one panel per key metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _key_panels(cmp)
    if not panels:
        return None
    others = [c.label for c in cmp.configs[1:]]
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(5.8 * ncol, 0.42 * len(others) * nrow + 1.6 * nrow), squeeze=False
    )
    for k, (task, label) in enumerate(panels):
        ax = axes[k // ncol][k % ncol]
        unit, thr = "difference", None
        for i, cfg in enumerate(others):
            r = _find(cmp, cfg, task, label)
            if r is None:
                continue
            y, lo, hi, unit = _plot_values(r)
            thr = _threshold(cmp, r)
            color = (
                "#c0392b"
                if r.gate_fail
                else ("#e67e22" if r.worse else ("#27ae60" if r.better else "#34495e"))
            )
            ax.errorbar(y, i, xerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt="o", color=color, capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        if thr is not None:
            ax.axvline(thr, color="red", ls="--", lw=0.8)
        ax.set_yticks(range(len(others)))
        ax.set_yticklabels(others if k % ncol == 0 else [""] * len(others), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{task} · {label}", fontsize=9)
        ax.set_xlabel(f"{unit} vs baseline", fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    for k in range(len(panels), nrow * ncol):
        axes[k // ncol][k % ncol].axis("off")
    fig.suptitle(
        "Differences from the baseline with 95% paired-bootstrap intervals "
        "(red: over the gate, orange: significant, dashed: gate threshold)"
    )
    fig.tight_layout()
    return _png(fig)


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:0.6em 0 1.4em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3} code{background:#f6f6f6;padding:0 3px}
.fail{background:#fde2e0;font-weight:bold}.worse{background:#fdf0dc}.better{background:#e3f6e8}
.gate-pass{color:#1e7e34;font-weight:bold}.gate-fail{color:#b52a1c;font-weight:bold}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
.note{color:#555;font-size:13px}
"""


def render_html(cmp: Comparison) -> str:
    """One self-contained HTML page: summary, plots (embedded PNG data URIs), per-task tables, warnings."""
    e = html.escape
    gate_ok = not cmp.failures
    out: list[str] = []
    add = out.append
    add("<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvcal comparison report</title>")
    add(f"<style>{_CSS}</style></head><body>")
    add("<h1>kvcal KV-cache comparison report</h1>")
    add(f"<p><b>Model:</b> <code>{e(cmp.model)}</code> &nbsp; <b>Baseline:</b> <code>{e(cmp.baseline)}</code> "
        f"&nbsp; <b>Tasks:</b> {e(', '.join(cmp.tasks))}</p>")  # fmt: skip
    gate_txt = "PASSED" if gate_ok else f"FAILED ({len(cmp.failures)} regression(s))"
    add(
        f"<p><b>Gate:</b> <span class='{'gate-pass' if gate_ok else 'gate-fail'}'>{gate_txt}</span> "
        f"<span class='note'>(significant at p &lt; {cmp.alpha} and larger than {cmp.max_drop:g}: absolute for "
        "accuracy, relative for perplexity/KL)</span></p>"
    )
    if cmp.failures:
        add("<ul>")
        for r in cmp.failures:
            add(f"<li class='fail'><code>{e(r.config)}</code>: {e(r.verdict)} ({e(_diff(r))})</li>")
        add("</ul>")
    add("<h2>Summary</h2><table><tr><th>configuration</th><th>kv format</th><th>scales</th><th>skip layers</th>"
        "<th>tokens vs BF16</th><th>throughput vs baseline</th><th>gate</th><th>verdict</th></tr>")  # fmt: skip
    for c in cmp.configs:
        if c.label == cmp.baseline:
            gate_c, verdict, cls = "baseline", "baseline", ""
        else:
            fail = any(r.gate_fail for r in cmp.by_config(c.label))
            worse = any(r.worse and r.key for r in cmp.by_config(c.label))
            gate_c = "FAIL" if fail else "pass"
            verdict = cmp.config_verdict(c.label)
            cls = "fail" if fail else ("worse" if worse else "")
        add(
            f"<tr class='{cls}'><td><code>{e(c.label)}</code></td><td>{e(c.kv_format)}</td><td>{e(c.scales)}</td>"
            f"<td>{e(c.skip)}</td><td>{_mult(c.capacity)}</td><td>{_mult(c.throughput_ratio)}</td>"
            f"<td>{gate_c}</td><td>{e(verdict)}</td></tr>"
        )
    add("</table>")
    for title, png in (
        ("Capacity vs accuracy (Pareto view)", pareto_png(cmp)),
        ("Differences with 95% intervals", forest_png(cmp)),
    ):
        if png:
            add(f"<h2>{e(title)}</h2><img alt='{e(title)}' src='data:image/png;base64,{png}'/>")
    for task in cmp.tasks:
        task_results = [r for r in cmp.results if r.task == task]
        if not task_results:
            continue
        add(f"<h2>{e(task)}</h2>")
        for metric_label, rows in _by_metric(task_results):
            r0 = rows[0]
            direction = "higher is better" if r0.higher_is_better else "lower is better"
            add(f"<h3>{e(task)} · <code>{e(metric_label)}</code> <span class='note'>({direction}; "
                f"{'key metric' if r0.key else 'secondary'}; baseline {e(_score(r0, base=True))}, "
                f"n = {r0.n_base_total})</span></h3>")  # fmt: skip
            add("<table><tr><th>configuration</th><th>score ± SE</th><th>difference [95% CI]</th>"
                "<th>relative change</th><th>McNemar p / significant</th><th>min. detectable</th>"
                "<th>n paired</th><th>status</th></tr>")  # fmt: skip
            for r in rows:
                cls = "fail" if r.gate_fail else ("worse" if r.worse else ("better" if r.better else ""))
                test = _p(r.p_value) if r.binary else ("yes" if r.significant else "no")
                add(
                    f"<tr class='{cls}'><td><code>{e(r.config)}</code></td><td>{e(_score(r))}</td>"
                    f"<td>{e(_diff(r))}</td><td>{e(_rel(r))}</td><td>{e(test)}</td><td>{e(_mdd(r))}</td>"
                    f"<td>{r.n}</td><td>{e(_status(r).strip('*'))}</td></tr>"
                )
            add("</table>")
    if cmp.warnings:
        add("<h2>Warnings</h2><ul>")
        for w in cmp.warnings:
            add(f"<li>{e(w)}</li>")
        add("</ul>")
    add(
        "<p class='note'>Differences are configuration minus baseline over the samples both runs scored, with "
        f"paired bootstrap percentile intervals ({cmp.n_boot} resamples, seed {cmp.seed}). Exact-match and "
        "accuracy metrics are tested with McNemar's exact test; the minimum detectable change is for 80% power "
        f"at alpha {cmp.alpha}. Generated {e(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))} by kvcal "
        f"{e(__version__)}.</p>"
    )
    add("</body></html>")
    return "\n".join(out)
