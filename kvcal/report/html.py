"""The comparison as one self-contained HTML page: summary, plots (embedded PNG data URIs), per-task tables,
warnings, and how to read them. No scripts, no external assets."""

from __future__ import annotations

import html
from datetime import UTC, datetime

from kvcal import __version__
from kvcal.report import longcontext as lc
from kvcal.report import numbers as fmt
from kvcal.report.compare import Comparison
from kvcal.report.markdown import (
    CONFORMANCE_INTRO,
    agreement_table,
    by_task,
    conformance_table,
    conformance_verdict,
    gate_summary,
    gated_list,
    how_to_read,
    length_intro,
    length_table,
    passkey_intro,
    passkey_table,
    passkey_tasks,
    position_intro,
    position_table,
    speed_table,
    text_agreement_table,
)
from kvcal.report.plots import forest_png, kl_position_png, pareto_png, passkey_png, survival_png
from kvcal.report.speed import speed_heading, speed_intro
from kvcal.report.verdicts import MetricResult

e = html.escape

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:0.6em 0 1.4em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3} code{background:#f6f6f6;padding:0 3px}
.fail{background:#fde2e0;font-weight:bold}.worse{background:#fdf0dc}.better{background:#e3f6e8}
.insufficient{background:#eef0f4;color:#555}
.gate-pass{color:#1e7e34;font-weight:bold}.gate-fail{color:#b52a1c;font-weight:bold}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
.note{color:#555;font-size:13px}
"""

_ROW_CLASS = {"FAIL": "fail", "worse": "worse", "better": "better", "insufficient data": "insufficient"}


def _md_to_html(line: str) -> str:
    """The few Markdown marks how_to_read uses (**bold**, *italic*, `code`), escaped, as HTML."""
    out, marks = e(line.removeprefix("- ")), (("**", "b"), ("*", "i"), ("`", "code"))
    for mark, tag in marks:
        parts = out.split(mark)
        out = "".join(p if i % 2 == 0 else f"<{tag}>{p}</{tag}>" for i, p in enumerate(parts))
    return out


def _head(cmp: Comparison) -> list[str]:
    gate_ok = cmp.gate_passed
    gate_txt = gate_summary(cmp)
    out = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvcal comparison report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>kvcal KV-cache comparison report</h1>",
        f"<p><b>Model:</b> <code>{e(cmp.model)}</code> &nbsp; <b>Baseline:</b> <code>{e(cmp.baseline)}</code> "
        f"&nbsp; <b>Tasks:</b> {e(', '.join(cmp.tasks))}</p>",
        f"<p><b>Gate:</b> <span class='{'gate-pass' if gate_ok else 'gate-fail'}'>{e(gate_txt)}</span> "
        f"<span class='note'>(significant at p &lt; {cmp.alpha:g} and larger than the metric's threshold — "
        f"{e(cmp.policy.describe())}: absolute for accuracy, relative for perplexity, nats for kl; gated: "
        f"{e(gated_list(cmp))}; multiple testing: "
        f"{e(fmt.correction_words(cmp.multiple_testing, cmp.alpha))}; at least {cmp.min_samples} paired "
        "samples)</span></p>",
    ]
    items = [f"<li class='fail'><code>{e(r.config)}</code>: {e(r.verdict)} ({e(fmt.diff(r))})</li>"
             for r in cmp.failures]  # fmt: skip
    items += [
        f"<li class='insufficient'><code>{e(r.config)}</code>: {e(r.verdict)}</li>" for r in cmp.insufficient
    ]
    return out + (["<ul>", *items, "</ul>"] if items else [])


def _summary(cmp: Comparison) -> list[str]:
    out = ["<h2>Summary</h2><table><tr><th>configuration</th><th>kv format</th><th>scales</th><th>skip layers</th>"
           f"<th>{e(fmt.capacity_heading(cmp.context))}</th><th>gate</th>"
           "<th>verdict</th></tr>"]  # fmt: skip
    for c in cmp.configs:
        gate = cmp.config_gate(c.label)
        verdict = "baseline" if c.label == cmp.baseline else cmp.config_verdict(c.label)
        worse = any(r.worse and r.gated for r in cmp.by_config(c.label))
        cls = "fail" if gate == "FAIL" else ("worse" if worse else _ROW_CLASS.get(gate, ""))
        out.append(
            f"<tr class='{cls}'><td><code>{e(c.label)}</code></td><td>{e(c.format_shown)}</td><td>{e(c.scales)}</td>"
            f"<td>{e(c.skip)}</td><td>{fmt.mult(c.capacity)}</td>"
            f"<td>{e(gate)}</td><td>{e(verdict)}</td></tr>"
        )
    return out + ["</table>"]


def _plots(cmp: Comparison) -> list[str]:
    out = []
    for title, png in (
        ("Capacity vs accuracy (Pareto view)", pareto_png(cmp)),
        (f"Differences with {1 - cmp.alpha:.0%} intervals", forest_png(cmp)),
    ):
        if png:
            out.append(f"<h2>{e(title)}</h2><img alt='{e(title)}' src='data:image/png;base64,{png}'/>")
    return out


def _metric_table(cmp: Comparison, task: str, label: str, rows: list[MetricResult]) -> list[str]:
    r0 = rows[0]
    direction = "higher is better" if r0.higher_is_better else "lower is better"
    kinds = (
        ", ".join(sorted({fmt.INTERVAL_NAMES[r.interval] for r in rows if r.interval != "none"})) or "none"
    )
    out = [
        f"<h3>{e(task)} · <code>{e(label)}</code> <span class='note'>({direction}; "
        f"{e(fmt.role(r0))}; baseline {e(fmt.score(r0, base=True))}, "
        f"n = {r0.n_base_total}; interval: {e(kinds)})</span></h3>",
        f"<table><tr><th>configuration</th><th>score ± SE</th><th>difference [{1 - cmp.alpha:.0%} CI]</th>"
        "<th>relative change [Fieller]</th><th>p (Holm-adjusted)</th><th>min. detectable</th>"
        "<th>n paired</th><th>status</th></tr>",
    ]
    for r in rows:
        out.append(
            f"<tr class='{_ROW_CLASS.get(r.status, '')}'><td><code>{e(r.config)}</code></td><td>{e(fmt.score(r))}</td>"
            f"<td>{e(fmt.diff(r))}</td><td>{e(fmt.rel(r))}</td><td>{e(fmt.p_column(r))}</td><td>{e(fmt.mdd(r))}</td>"
            f"<td>{r.n}</td><td>{e(r.status)}</td></tr>"
        )
    return out + ["</table>"]


def _tasks(cmp: Comparison) -> list[str]:
    out: list[str] = []
    for task, groups in by_task(cmp):
        out.append(f"<h2>{e(task)}</h2>")
        for label, rows in groups:
            out += _metric_table(cmp, task, label, rows)
    return out


def _img(title: str, png: str | None) -> list[str]:
    return [f"<img alt='{e(title)}' src='data:image/png;base64,{png}'/>"] if png else []


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A table of markdown.position_table / passkey_table cells (`code` marks become <code>)."""

    def cell(text: str) -> str:
        return f"<code>{e(text[1:-1])}</code>" if text.startswith("`") and text.endswith("`") else e(text)

    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows]
    return out + ["</table>"]


def _long_context(cmp: Comparison) -> list[str]:
    out: list[str] = []
    if cmp.by_position:
        out += ["<h2>KL by position</h2>", f"<p class='note'>{e(position_intro(cmp))}</p>"]
        out += _img("KL by position", kl_position_png(cmp)) + _table(*position_table(cmp))
        out += ["<p><b>Does the damage grow with position?</b></p><ul>"]
        out += [
            f"<li class='{'worse' if c.growth.verdict == lc.GROWS else ''}'><code>{e(c.config)}</code>: "
            f"{e(lc.growth_sentence(c.growth, cmp.alpha))}</li>"
            for c in cmp.by_position
        ]
        out.append("</ul>")
    for task in passkey_tasks(cmp):
        out += [
            f"<h2>{e(task)} by length and depth</h2>",
            f"<p class='note'>{e(passkey_intro(cmp, task))}</p>",
        ]
        out += _img(f"{task} heatmaps", passkey_png(cmp, task)) + _table(*passkey_table(cmp, task))
    return out


def _agreement(cmp: Comparison) -> list[str]:
    out: list[str] = []
    if cmp.text_agreement_rows:
        out += ["<h2>Output agreement with the baseline run (generative tasks)</h2>"]
        out += _table(*text_agreement_table(cmp))
    if not cmp.agreement_rows:
        return out
    out += ["<h2>Output agreement with the BF16 trajectory</h2>"]
    for task in dict.fromkeys(r["task"] for r in cmp.agreement_rows):
        out += _img(f"{task} survival", survival_png(cmp, task))
    return out + _table(*agreement_table(cmp))


def _length(cmp: Comparison) -> list[str]:
    if not cmp.length_rows:
        return []
    out = ["<h2>Output length</h2>", f"<p class='note'>{e(length_intro(cmp))}</p>"]
    return out + _table(*length_table(cmp))


def _conformance(cmp: Comparison) -> list[str]:
    """Engine vs emulation: per pair and key metric the agreement, the paired difference with its interval, the
    minimum detectable difference; then each pair's verdict."""
    if not cmp.conformance:
        return []
    out = ["<h2>Engine vs emulation</h2>", f"<p class='note'>{e(CONFORMANCE_INTRO)}</p>"]
    out += _table(*conformance_table(cmp)) + ["<ul>"]
    for c in cmp.conformance:
        cls = {True: "better", False: "fail", None: "insufficient"}[c.conforms]
        out.append(
            f"<li class='{cls}'><code>{e(c.engine)}</code> <b>{e(conformance_verdict(c.conforms))}</b>: "
            f"{e(c.verdict)}</li>"
        )
    return out + ["</ul>"]


def _speed(cmp: Comparison) -> list[str]:
    if cmp.speed is None:
        return []
    out = [f"<h2>{e(speed_heading(cmp.speed))}</h2>", f"<p class='note'>{e(speed_intro())}</p>"]
    out += _table(*speed_table(cmp))
    if cmp.speed.left_out:
        out += ["<p class='note'>Not shown:</p><ul class='note'>"]
        out += [f"<li>{e(w)}</li>" for w in cmp.speed.left_out] + ["</ul>"]
    return out


def render_html(cmp: Comparison) -> str:
    """One self-contained HTML page: engine vs emulation (when checked), summary, plots (embedded PNG data URIs),
    per-task tables, long-context curves and heatmaps, warnings."""
    out = _head(cmp) + _conformance(cmp) + _summary(cmp) + _plots(cmp) + _tasks(cmp) + _agreement(cmp)
    out += _length(cmp) + _long_context(cmp) + _speed(cmp)
    if cmp.warnings:
        out += ["<h2>Warnings</h2><ul>", *(f"<li>{e(w)}</li>" for w in cmp.warnings), "</ul>"]
    out += ["<h2>How to read this report</h2><ul class='note'>"]
    out += [f"<li>{_md_to_html(line)}</li>" for line in how_to_read(cmp)]
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    out += ["</ul>", f"<p class='note'>Generated {e(stamp)} by kvcal {e(__version__)}.</p>", "</body></html>"]
    return "\n".join(out)
