"""The comparison as a Markdown report: the tables a release engineer acts on."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvcal import __version__
from kvcal.report import longcontext as lc
from kvcal.report import numbers as fmt
from kvcal.report import text_tokens
from kvcal.report.compare import Comparison
from kvcal.report.speed import speed_heading, speed_intro
from kvcal.report.verdicts import MetricResult

if TYPE_CHECKING:
    from kvcal.report.conformance import DamageResult


def _esc(s: str) -> str:
    return s.replace("|", "\\|")


def by_metric(task_results: list[MetricResult]) -> list[tuple[str, list[MetricResult]]]:
    """One task's results grouped by metric label, in first-seen order (the order compare produced)."""
    groups: dict[str, list[MetricResult]] = {}
    for r in task_results:
        groups.setdefault(r.label, []).append(r)
    return list(groups.items())


def by_task(cmp: Comparison) -> list[tuple[str, list[tuple[str, list[MetricResult]]]]]:
    """Each task that has results (in cmp.tasks order) with its results grouped by metric (`by_metric`):
    the sections of the per-task tables, in every report format."""
    out = []
    for task in cmp.tasks:
        task_results = [r for r in cmp.results if r.task == task]
        if task_results:
            out.append((task, by_metric(task_results)))
    return out


def gate_summary(cmp: Comparison) -> str:
    """The gate's one line for the report (numbers.gate_line of this comparison)."""
    return fmt.gate_line(
        len(cmp.failures), len(cmp.insufficient), len(cmp.no_common_task), cmp.settings.allow_unjudged,
        cmp.settings.gate, sum(c.conforms is False for c in cmp.conformance), len(cmp.conformance_unjudged),
    )  # fmt: skip


def _header(cmp: Comparison) -> list[str]:
    gate = gate_summary(cmp)
    return [
        "# kvcal KV-cache comparison report",
        "",
        f"- **Model:** `{cmp.model}`",
        f"- **Baseline:** `{cmp.baseline}`",
        f"- **Tasks:** {', '.join(cmp.tasks)}",
        f"- **Gate ({cmp.settings.gate}):** {gate} — {gate_rule(cmp)}",
        f"- **Gate policy (--max-drop):** {cmp.policy.describe()}; gated: {_esc(gated_list(cmp))}",
        f"- **Multiple testing:** {fmt.correction_words(cmp.multiple_testing, cmp.alpha)}",
        f"- **Minimum paired samples:** {cmp.min_samples} (fewer: insufficient data, not judged)",
        f"- **Generated:** {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} by kvcal {__version__}",
        "",
    ]


def gate_rule(cmp: Comparison) -> str:
    """What the gate asks of a configuration, in words."""
    units = "(thresholds: absolute for accuracy-like metrics and kl's nats, relative for perplexity)"
    unjudged = (
        "; one it could not judge (too few samples, no task in common) "
        + ("passes (--allow-unjudged)" if cmp.settings.allow_unjudged else "fails")
    )
    if cmp.settings.gate == "noninferiority":
        return (
            f"a configuration passes only when, for every gated metric, the one-sided {1 - cmp.alpha:.0%} upper "
            f"confidence bound of its degradation is under its threshold {units}{unjudged}"
        )
    holm = ", Holm-adjusted" if cmp.multiple_testing == "holm" else ""
    return (
        f"a configuration fails when a gated metric degrades significantly (p < {cmp.alpha:g}{holm}) by more "
        f"than its threshold {units}{unjudged}"
    )


def _gate_lists(cmp: Comparison) -> list[str]:
    lines: list[str] = []
    if cmp.failures and cmp.settings.gate == "noninferiority":
        lines += ["## Not shown non-inferior", ""]
        lines += [f"- `{r.config}`: {r.verdict}" for r in cmp.failures]
        lines.append("")
    elif cmp.failures:
        lines += ["## Regressions over the gate threshold", ""]
        lines += [
            f"- `{r.config}`: {r.verdict} (difference {fmt.diff(r)}, relative {fmt.rel(r)})"
            for r in cmp.failures
        ]
        lines.append("")
    if cmp.insufficient:
        lines += ["## Insufficient data (not judged by the gate)", ""]
        lines += [f"- `{r.config}`: {r.verdict}" for r in cmp.insufficient]
        lines.append("")
    if cmp.no_common_task:
        lines += ["## No task in common with the baseline (not judged by the gate)", ""]
        lines += [f"- `{label}`: {cmp.config_verdict(label)}" for label in cmp.no_common_task]
        lines.append("")
    return lines


CONFORMANCE_INTRO = (
    "Each engine run against kvcal's emulation of the configuration it claims, by the quantization's damage: per "
    "paired sample (engine quantized - engine BF16) - (emulation quantized - emulation BF16), in the key metric's "
    "per-sample unit (damage: positive is worse). Equivalence test (TOST, statsmodels) of the mean gap against the "
    "margin: the mean |engine BF16 - emulation BF16| per sample (the two implementations' own disagreement without "
    "quantization); with --conformance-noise, the mean |perturbed emulation's damage - emulation's damage| per "
    "sample (how far the damage moves between two correct implementations: kvcal eval --perturb-weights); or "
    "--margin. Interval: 1 - 2 alpha (TOST's). Agreement: the share of the quantized runs' paired samples whose "
    "score is the same."
)


def conformance_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of engine vs emulation (kvcal.report.conformance): a row per pair and key metric."""
    header = ["engine", "emulation", "BF16 runs", "configuration claimed", "task", "metric", "n paired", "agreement",
              "damage: engine / emulation", "gap [CI]", "margin", "TOST p", "status"]  # fmt: skip
    rows = []
    for c in cmp.conformance:
        refs = f"`{c.engine_bf16}` / `{c.emulation_bf16}`" if c.engine_bf16 and c.emulation_bf16 else "missing"
        if not c.results:
            rows.append([f"`{c.engine}`", f"`{c.emulation}`", refs, c.claimed, *["—"] * 8, "not judged"])
        for r in c.results:
            agree = c.agreement.get(f"{r.task}/{r.metric}")
            need = f" (about {r.n_needed} samples needed)" if r.verdict.startswith("not shown") and r.n_needed else ""
            rows.append(
                [f"`{c.engine}`", f"`{c.emulation}`", refs, c.claimed, r.task, r.metric, str(r.n),
                 "—" if agree is None else f"{agree:.1%}",
                 f"{r.engine_damage:+.4g} / {r.emulation_damage:+.4g} {r.unit}",
                 f"{r.gap:+.4g} [{r.ci_low:.4g}, {r.ci_high:.4g}]",
                 margin_cell(r),
                 "—" if r.p_equivalence is None else f"{r.p_equivalence:.2g}", r.verdict + need]
            )  # fmt: skip
    return header, rows


def margin_cell(r: DamageResult) -> str:
    """A DamageResult's margin and its source; a perturbed emulation's with the engine's own per-sample gap (mean
    |d|, the scatter the margin stands for) and the BF16 disagreement the perturbation caused beside the engine's
    (is the perturbation of the engine's size?)."""
    if r.margin_source == "perturbed emulation" and r.noise_bf16_spread is not None:
        return (f"±{r.margin:.4g} (perturbed emulation; the engine's mean |gap| {r.gap_spread:.2g}; BF16 mean |diff|: "
                f"perturbed {r.noise_bf16_spread:.2g}, engine {r.bf16_spread:.2g})")  # fmt: skip
    return f"±{r.margin:.4g} ({'BF16 pair' if r.margin_source == 'bf16 pair' else '--margin'})"


def conformance_verdict(conforms: bool | None) -> str:
    """A pair's verdict in a word or two: EQUIVALENT, NOT EQUIVALENT, or not judged."""
    return {True: "EQUIVALENT", False: "NOT EQUIVALENT", None: "not judged"}[conforms]


DECODE_INTRO = (
    "Generated outputs (lm-eval generative tasks), each side's quantized run against its own BF16 run over the "
    "documents all four runs generated: the share of extracted answers kept, tokens to the first divergence "
    "(Kaplan-Meier median; an output that stopped where the other went on diverged at the next token, outputs "
    "the cap ended are censored) and the output length change; then engine minus "
    "emulation, paired by document (answers kept: Newcombe's interval and McNemar's exact p; length change: "
    "paired BCa bootstrap) and the log-rank p of the two divergence-time distributions. 95% intervals. Text tokens: "
    "a run kept text only (an engine's lm-eval folder), so both sides' outputs are re-encoded with the checkpoint's "
    "tokenizer. Shown, not gated."
)


def _median(x: dict[str, float | None]) -> str:
    return "not reached" if x["value"] is None else _iv(x, 0)


def _change(row: dict[str, Any]) -> str:
    """A LengthChange dict's change in tokens [CI]."""
    if row["ci_low"] is None:
        return "n/a"
    return _iv({"value": row["diff"], "lo": row["ci_low"], "hi": row["ci_high"]}, 1)


def decode_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per conformance pair and generative task, the engine's decode against the emulation's."""
    header = ["engine", "emulation", "task", "documents", "tokens", "answers kept: engine / emulation",
              "gap [CI], p", "median tokens to divergence: engine / emulation", "log-rank p",
              "length change (tokens): engine / emulation", "gap [CI], p"]  # fmt: skip
    rows = []
    for c in cmp.conformance:
        for d in c.decode:
            e, m = d.engine, d.emulation
            rows.append(
                [f"`{c.engine}`", f"`{c.emulation}`", d.task, str(d.n), d.unit,
                 f"{_iv(e.answer_kept)} / {_iv(m.answer_kept)}",
                 f"{_iv(d.answer_kept_gap)}, p {fmt.p(d.answer_kept_gap['p'])}",
                 f"{_median(e.median_tokens)} / {_median(m.median_tokens)}", fmt.p(d.logrank_p),
                 f"{_change(e.length)} / {_change(m.length)}",
                 f"{_iv(d.length_gap, 1)}, p {fmt.p(d.length_gap['p'])}"]
            )  # fmt: skip
    return header, rows


def _conformance(cmp: Comparison) -> list[str]:
    """Engine vs emulation (kvcal.report.conformance): the table, then one verdict line per pair, then the
    generated outputs' comparison where a pair has a generative task."""
    if not cmp.conformance:
        return []
    lines = ["## Engine vs emulation", "", CONFORMANCE_INTRO, "", *_table(*conformance_table(cmp)), ""]
    lines += [f"- `{c.engine}` ({conformance_verdict(c.conforms)}): {_esc(c.verdict)}" for c in cmp.conformance]
    if any(c.decode for c in cmp.conformance):
        lines += ["", "### Engine vs emulation: generated outputs", "", DECODE_INTRO, "", *_table(*decode_table(cmp))]
    return [*lines, ""]


def _summary(cmp: Comparison) -> list[str]:
    lines = [
        "## Summary",
        "",
        f"| configuration | kv format | scales | skip layers | {fmt.capacity_heading(cmp.context)} | "
        "gate | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cmp.configs:
        verdict = "baseline" if c.label == cmp.baseline else cmp.config_verdict(c.label)
        lines.append(
            f"| `{c.label}` | {c.format_shown} | {c.scales} | {c.skip} | {fmt.mult(c.capacity)} | "
            f"{cmp.config_gate(c.label)} | {_esc(verdict)} |"
        )
    return lines + [""]


def gated_list(cmp: Comparison) -> str:
    """'kl/kl, gsm8k/exact_match,strict-match, ...' — the task/metric pairs the gate judged."""
    names = list(dict.fromkeys(f"{r.task}/{r.label}" for r in cmp.results if r.gated))
    return ", ".join(names) or "nothing (no compared result matches the policy)"


def _metric_table(cmp: Comparison, task: str, label: str, rows: list[MetricResult]) -> list[str]:
    r0 = rows[0]
    direction = "higher is better" if r0.higher_is_better else "lower is better"
    key = fmt.role(r0)
    kinds = sorted({fmt.INTERVAL_NAMES[r.interval] for r in rows if r.interval != "none"})
    tests = sorted({"McNemar exact" if r.binary else "BCa bootstrap" for r in rows if r.interval != "none"})
    p_col = "p (Holm-adjusted)" if any(r.p_adjusted is not None for r in rows) else "p"
    lines = [
        f"### {task} · `{label}` ({direction}; {key})",
        "",
        f"Baseline `{cmp.baseline}`: {fmt.score(r0, base=True)} (n = {r0.n_base_total}). "
        f"Interval: {', '.join(kinds) or 'none'}; test: {', '.join(tests) or 'none'}.",
        "",
        f"| configuration | score ± SE | difference [{1 - cmp.alpha:.0%} CI] | relative change [Fieller] | {p_col} | "
        "min. detectable | n paired | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = "**FAIL**" if r.status == "FAIL" else r.status
        lines.append(
            f"| `{r.config}` | {fmt.score(r)} | {fmt.diff(r)} | {fmt.rel(r)} | {fmt.p_column(r)} | {fmt.mdd(r)} | "
            f"{r.n} | {status} |"
        )
    return lines + [""]


def _tasks(cmp: Comparison) -> list[str]:
    lines: list[str] = []
    for task, groups in by_task(cmp):
        lines += [f"## {task}", ""]
        for label, rows in groups:
            lines += _metric_table(cmp, task, label, rows)
    return lines


def how_to_read(cmp: Comparison) -> list[str]:
    """The notes under the tables: which interval is shown for which metric type, and what the tests are."""
    level = f"{1 - cmp.alpha:.0%}"
    return [
        f"- **difference [{level} CI]**: configuration minus baseline over the samples both runs scored. "
        "*Exact-match/accuracy (binary) metrics*: Newcombe's square-and-add interval for paired proportions, "
        "widened to reach 0 where McNemar's exact test does not reject, so the interval excludes 0 exactly when "
        f"the test is significant. *Other metrics* (perplexity, KL, agreement rates): paired BCa bootstrap "
        f"({cmp.n_boot} resamples, seed {cmp.seed}); its p-value is the interval's dual.",
        "- **p**: McNemar's exact two-sided test on the discordant pairs for binary metrics; the bootstrap's p for "
        "the others. In parentheses: the Holm-adjusted p-value over the gate's family (every gated metric "
        "tested, configurations x tasks x filters); gated metrics are significant when the adjusted p < alpha, "
        "the others (secondary metrics, top1_agree unless the policy names it) on their own p.",
        "- **relative change [Fieller]**: configuration / baseline - 1 with Fieller's interval for a ratio (delta-"
        "method covariance); *unbounded* when the baseline is not clearly above 0. A threshold's unit is fixed by "
        "its metric, never by the baseline's value: relative for perplexities, absolute for accuracy-like "
        "metrics and for `kl` (nats, against an FP8 baseline as against a BF16 one). Each metric's threshold is "
        "in its table's heading (--max-drop METRIC=VALUE or TASK/METRIC=VALUE sets one).",
        f"- **min. detectable**: the smallest change this many samples would detect with 80% power at the level a "
        f"result must clear (alpha {cmp.alpha:g}, divided by the family size for Holm-corrected gated metrics; "
        "relative for lower-is-better metrics). *No significant change* is not *no change*.",
        f"- **insufficient data**: fewer than {cmp.min_samples} paired samples (--min-samples): no test, no "
        "interval; the gate fails on it unless --allow-unjudged (then it lists it).",
        "- **tokens vs BF16**: KV-cache tokens that fit in the same memory as a BF16 cache (skipped layers stay at "
        f"16 bits){context_words(cmp)}.",
        *_long_context_notes(cmp),
        *_speed_notes(cmp),
    ]


def context_words(cmp: Comparison) -> str:
    """What the capacity column assumes about the context (empty where it does not matter or is not known)."""
    if cmp.context is not None:
        why = cmp.context_source or "given"
        return (
            f", at {cmp.context} tokens of context ({why}): sliding-window layers hold min(context, window) "
            "tokens, here and on the Pareto axis (--context N sets it)"
        )
    if cmp.sliding_layers:
        return (
            "; no context given or evaluated: sliding-window layers are counted in full, as at contexts up to "
            "their window (--context N counts them at min(N, window))"
        )
    return ""


def _long_context_notes(cmp: Comparison) -> list[str]:
    out = []
    if cmp.by_position:
        out.append(
            "- **KL by position**: kvcal's `kl` averaged over the tokens whose 1-based position (of the "
            f"predicting token) falls in each bucket; [{1 - cmp.alpha:.0%} t interval] over windows. *Grows* "
            "only when a paired t test of the last bucket vs the first (windows as the pairs"
            f"{', Holm-adjusted over the configurations' if cmp.multiple_testing == 'holm' else ''}) is "
            f"significant at {cmp.alpha:g}; with one window there is no test."
        )
    if cmp.passkey:
        out.append(
            "- **passkey**: accuracy of retrieving a key stated once inside filler text, per prompt length and "
            f"key depth; *all* pools every depth. A length where the baseline scores below {lc.RETRIEVES:g} says "
            "little about the formats."
        )
    return out


# ---- long context (issue 14): tables shared with the HTML report ------------------------------------------------


def position_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of KL by position: a row per configuration, a column per position bucket, each cell
    'KL [t interval]' ('—' where a configuration has no such bucket)."""
    spans = sorted({(b.lo, b.hi) for c in cmp.positions for b in c.buckets})
    header = ["configuration", *(f"{lo}–{hi}" for lo, hi in spans)]
    rows = []
    for c in cmp.positions:
        have = {(b.lo, b.hi): b for b in c.buckets}
        cells = []
        for span in spans:
            b = have.get(span)
            if b is None:
                cells.append("—")
                continue
            ci = lc.bucket_interval(b, c.n_windows, cmp.alpha)
            cells.append(f"{b.kl:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""))
        rows.append([f"`{c.config}`", *cells])
    return header, rows


def position_intro(cmp: Comparison) -> str:
    windows = sorted({(c.seq_len, c.prefill_chunk, c.n_windows, c.subsample) for c in cmp.positions}, key=str)
    what = "; ".join(
        f"Windows of {seq if seq is not None else '?'} tokens"
        + (f" (prefill chunk {chunk})" if chunk is not None and chunk != seq else "")
        + f", {n} window{'s' if n != 1 else ''}"
        + (f", every {sub}th position scored (--kl-subsample {sub})" if sub > 1 else "")
        for seq, chunk, n, sub in windows
    )
    return (
        f"{what}. KL (nats) of each position bucket, mean over its tokens [{1 - cmp.alpha:.0%} t interval over "
        "windows]."
    )


def passkey_table(cmp: Comparison, task: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of one passkey variant: a row per (configuration, length), a column per depth, then 'all'."""
    grids = [g for g in cmp.passkey if g.task == task]
    depths = sorted({d for g in grids for d in g.depths})
    header = ["configuration", "length", *(fmt.depth(d) for d in depths), "all"]
    rows = []
    for g in grids:
        for length in g.lengths:
            accs = [g.acc(length, d) for d in depths]
            rows.append(
                [
                    f"`{g.config}`",
                    fmt.tokens(length),
                    *(fmt.f(a, 2) for a in accs),
                    fmt.f(g.length_acc(length), 2),
                ]
            )
    return header, rows


def passkey_intro(cmp: Comparison, task: str) -> str:
    ns = sorted({int(c["n"]) for g in cmp.passkey if g.task == task for c in g.cells.values()})
    n = f"{ns[0]} prompts per cell" if len(ns) == 1 else f"{ns[0]}–{ns[-1]} prompts per cell"
    kind = "the right key's log-likelihood highest of 4" if task == "passkey_mc" else "exact match of the key"
    good, bad = lc.baseline_retrieval(cmp.passkey, cmp.baseline, task)
    base = ""
    if good or bad:
        base = (
            f" Baseline `{cmp.baseline}` retrieves (>= {lc.RETRIEVES:g} over every depth) at "
            f"{', '.join(map(fmt.tokens, good)) or 'no length'}"
            + (f"; not at {', '.join(map(fmt.tokens, bad))}" if bad else "")
            + "."
        )
    return f"Accuracy ({kind}) by prompt length (tokens) and key depth; {n}.{base}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(_esc(c) for c in row) + " |" for row in rows),
    ]


def passkey_tasks(cmp: Comparison) -> list[str]:
    return list(dict.fromkeys(g.task for g in cmp.passkey))


def _long_context(cmp: Comparison) -> list[str]:
    lines: list[str] = []
    if cmp.by_position:
        lines += ["## KL by position", "", position_intro(cmp), "", *_table(*position_table(cmp)), ""]
        lines += ["Does the damage grow with position?", ""]
        lines += [f"- `{c.config}`: {lc.growth_sentence(c.growth, cmp.alpha)}" for c in cmp.by_position]
        lines.append("")
    for task in passkey_tasks(cmp):
        lines += [f"## {task} by length and depth", "", passkey_intro(cmp, task), ""]
        lines += [*_table(*passkey_table(cmp, task)), ""]
    return lines


# ---- output agreement (kvcal.report.agreement): a table shared with the HTML report ---------------------------


def _iv(x: dict[str, float | None], digits: int = 3) -> str:
    """value [lo, hi]"""
    if x.get("value") is None:
        return "n/a"
    if x.get("lo") is None or x.get("hi") is None:
        return fmt.f(x["value"], digits)
    return f"{fmt.f(x['value'], digits)} [{fmt.f(x['lo'], digits)}, {fmt.f(x['hi'], digits)}]"


def agreement_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per (configuration, divergence task) agreement with the BF16 trajectory, 95% intervals."""
    lengths = [k for k in (cmp.agreement_rows[0]["projection"] if cmp.agreement_rows else {})]
    header = ["task", "configuration", "answer agreement", "identical", "logprobs close (top-5)",
              "median tokens to divergence", "divergences / 1k tokens", "constant hazard p",
              "identical at own lengths", *(f"identical at {int(L) // 1024}k" for L in lengths),
              "decode KL", "prefill KL"]  # fmt: skip
    rows = []
    for r in cmp.agreement_rows:
        med = r["km"]["median"]
        median = "not reached" if med["value"] is None else _iv(med, 0)
        rows.append(
            [r["task"], f"`{r['config']}`", _iv(r["answer_agree"]), _iv(r["identical"]),
             _iv(r["logprobs_close"]), median, _iv(r["hazard_per_1k"], 2), fmt.p(r["constant_hazard"]["p_value"]),
             _iv(r.get("projection_task_lengths") or {}), *(_iv(r["projection"][L]) for L in lengths),
             fmt.sig(r["decode_kl"]), fmt.sig(r["prefill_kl"])]
        )  # fmt: skip
    return header, rows


def text_agreement_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per (configuration, lm-eval generative task) agreement with the baseline run's outputs."""
    header = ["task", "configuration", "documents", "same extracted answer", "identical output text",
              "median tokens to divergence", "divergences / 1k tokens"]  # fmt: skip
    rows = []
    for r in cmp.text_agreement_rows:
        tok = r.get("tokens")
        med = tok["km"]["median"] if tok else None
        median = "n/a" if med is None else "not reached" if med["value"] is None else _iv(med, 0)
        if tok and tok.get("unit") == text_tokens.TEXT:
            median += " (text tokens)"
        rows.append(
            [r["task"], f"`{r['config']}`", str(r["n"]), _iv(r["answer_agree"]), _iv(r["identical"]), median,
             _iv(tok["hazard_per_1k"], 2) if tok else "n/a"]
        )  # fmt: skip
    return header, rows


def _agreement(cmp: Comparison) -> list[str]:
    lines: list[str] = []
    if cmp.text_agreement_rows:
        lines += [
            "## Output agreement with the baseline run (generative tasks)",
            "",
            f"Per document, against `{cmp.baseline}`'s output: the answer lm-eval's first filter extracts, and the "
            "output text itself (n/a where the run keeps no text, e.g. GPQA). 95% Wilson intervals. Tokens to "
            "divergence (Kaplan-Meier median over each document's first repeat; an output that stopped where the "
            "other went on diverged at the next token, outputs the cap ended are censored) "
            "and the divergence hazard in the generated token ids kvcal runs record; where a run kept text only "
            "(an engine's lm-eval folder), in text tokens: both outputs re-encoded with the checkpoint's tokenizer "
            "(n/a when it is not on this machine).",
            "",
            *_table(*text_agreement_table(cmp)),
            "",
        ]
    if not cmp.agreement_rows:
        return lines
    return lines + [
        "## Output agreement with the BF16 trajectory",
        "",
        "Greedy outputs of each configuration against the BF16 cache's, prompt by prompt (divergence tasks). "
        "Median tokens to divergence: Kaplan-Meier, outputs that end without differing censored; divergences "
        "per 1,000 generated tokens with the exact Poisson interval; `constant hazard p`: early vs late hazard "
        "(a small p: the projections below, which assume a constant hazard, are not to be trusted); `identical "
        "at N`: exp(-hazard x N), at the BF16 outputs' own lengths and at N tokens. 95% intervals.",
        "",
        *_table(*agreement_table(cmp)),
        "",
    ]


# ---- output length (kvcal.report.length): a table shared with the HTML report -------------------------------

LENGTH_INTRO = (
    "Mean generated tokens per document, paired: each configuration's output against the baseline run's for "
    "lm-eval generative tasks (kvcal runs record the generated token ids; the mean over a document's repeats; "
    "\"(text tokens)\": a run kept text only, both outputs re-encoded with the checkpoint's tokenizer), "
    "and for divergence tasks against the BF16 trajectory of the same prompt in the same run. Change in tokens "
    "with its paired BCa bootstrap 95% interval and p-value; relative change with Fieller's interval. A longer "
    "output costs decode time and cache whatever the accuracy does."
)


def length_intro(cmp: Comparison) -> str:
    gate = (
        f" Gate (--max-length-change): {cmp.max_length_change:g} of the baseline's length either way "
        f"({cmp.settings.gate})."
        if cmp.max_length_change is not None
        else " Reported, not gated (--max-length-change gates it)."
    )
    return LENGTH_INTRO + gate


def _rel_iv(lo: float | None, hi: float | None) -> str:
    return "unbounded" if lo is None or hi is None else f"[{fmt.pct(lo)}, {fmt.pct(hi)}]"


def length_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per (configuration, generative task) the paired change in generated length."""
    header = ["task", "configuration", "against", "documents", "baseline tokens", "tokens", "change (tokens)",
              "p", "relative change", "gate"]  # fmt: skip
    rows = []
    for r in cmp.length_rows:
        change = "n/a" if r.ci_low is None else _iv({"value": r.diff, "lo": r.ci_low, "hi": r.ci_high}, 1)
        rel = fmt.pct(r.rel_change) + ("" if r.rel_change is None else f" {_rel_iv(r.rel_ci_low, r.rel_ci_high)}")
        gate = r.status + (f": {r.reason}" if r.reason and r.status != "pass" else "")
        rows.append(
            [r.task, f"`{r.config}`", f"`{r.baseline}`", str(r.n), fmt.f(r.base_mean, 1),
             fmt.f(r.mean, 1) + (" (text tokens)" if r.unit == text_tokens.TEXT else ""), change,
             fmt.p(r.p_value), rel, gate]
        )  # fmt: skip
    return header, rows


def _length(cmp: Comparison) -> list[str]:
    if not cmp.length_rows:
        return []
    return ["## Output length", "", length_intro(cmp), "", *_table(*length_table(cmp)), ""]


# ---- emulation speed (kvcal.report.speed): a table shared with the HTML report ---------------------------------


def speed_table(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the emulation speed: a row per (task, configuration) timed beside the baseline."""
    header = ["task", "configuration", "prefill tokens/s", "vs baseline", "TTFT (median)", "decode tokens/s",
              "vs baseline", "TPOT"]  # fmt: skip
    rows = [
        [r.task, f"`{r.config}`", fmt.sig(r.prefill_tokens_per_s), fmt.mult(r.prefill_vs_baseline),
         fmt.duration(r.ttft_s_median), fmt.sig(r.decode_tokens_per_s), fmt.mult(r.decode_vs_baseline), fmt.duration(r.tpot_s)]
        for r in (cmp.speed.rows if cmp.speed else [])
    ]  # fmt: skip
    return header, rows


def _speed(cmp: Comparison) -> list[str]:
    if cmp.speed is None:
        return []
    lines = [f"## {speed_heading(cmp.speed)}", "", speed_intro(), "", *_table(*speed_table(cmp)), ""]
    if cmp.speed.left_out:
        lines += ["Not shown:", "", *(f"- {_esc(w)}" for w in cmp.speed.left_out), ""]
    return lines


def _speed_notes(cmp: Comparison) -> list[str]:
    if cmp.speed is None:
        return []
    return [
        "- **emulation speed**: kvcal's own quantized-cache emulation timed per forward (metrics.json's prefill "
        "and decode fields), shown only for runs of one task on the baseline's device and host; not the speed "
        "of a serving engine, and not controlled for other load on the machine."
    ]


def render_markdown(cmp: Comparison) -> str:
    """The report as Markdown."""
    lines = _header(cmp) + _gate_lists(cmp) + _conformance(cmp) + _summary(cmp) + _tasks(cmp) + _agreement(cmp)
    lines += _length(cmp) + _long_context(cmp) + _speed(cmp)
    if cmp.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in cmp.warnings] + [""]
    lines += ["## How to read this report", ""] + how_to_read(cmp) + [""]
    return "\n".join(lines)
