"""OUT/release.md: the release decision a person reads (the record of OUT/release.json, then kvcal compare's report
of the evaluations)."""

from __future__ import annotations

from typing import Any


def _md(s: Any) -> str:
    return str(s).replace("|", "\\|")


def _header(r: dict[str, Any]) -> list[str]:
    decision = "SHIP" if r["decision"] == "ship" else "DO NOT SHIP"
    lines = [
        f"# kvcal release: {decision}",
        "",
        f"- **Model:** `{r['model']}` (checkpoint sha256 `{r['model_sha256'][:16]}…`)",
        f"- **Ships:** {r['kv_format']} per-{r['granularity']} scales, skip layers {r['skip_layers']}",
        f"- **Scale file:** `{r['scales_path']}` (sha256 `{r['scales_sha256'][:16]}…`)",
        f"- **Recalibrated:** {'yes' if r['recalibrated'] else 'no'} — {r['reason']}",
    ]
    d = r.get("drift")
    if d is None:
        lines.append("- **Drift:** not checked (no drift: section)")
    else:
        why = f": {'; '.join(d['reasons'][:3])}" if d.get("reasons") else ""
        lines.append(f"- **Drift** on `{d['traffic']}`: {d['verdict']}{why} (on_drift: {d['on_drift']})")
    lines.append(f"- **Gate:** {r['gate']}")
    if r.get("failed_because"):
        lines.append(f"- **Failed because:** {r['failed_because']}")
    w = r.get("work", {})
    lines.append(
        f"- **Work:** {w.get('calibrations_run', 0)} calibration(s), {w.get('drift_checks_run', 0)} drift check(s), "
        f"{w.get('evaluations_run', 0)} evaluation(s) run; {w.get('evaluations_reused', 0)} evaluation(s), "
        f"{w.get('calibrations_reused', 0)} scale file(s), {w.get('drift_checks_reused', 0)} drift check(s), "
        f"{w.get('exports_reused', 0)} export(s) reused"
        + (f"; {w.get('plans_solved', 0)} plan(s) solved, {w.get('plans_reused', 0)} reused" if r.get("plans") else "")
    )
    return lines + [""]


def _plans(r: dict[str, Any]) -> list[str]:
    """Each plan candidate: its file, layers and capacity (kvcal plan's numbers; the gate's are below)."""
    if not r.get("plans"):
        return []
    lines = ["## Plans", "", "| plan | file | layers | xBF16 | estimated KL | solved now |", "|---|---|---|---|---|---|"]
    for p in r["plans"]:
        skipped = [str(i) for i, f in enumerate(p["layers"]) if f == "bf16"]
        layers = f"{p['kv_format']}, 16-bit: {','.join(skipped) or 'none'}"
        cap = (p.get("capacity") or {}).get("multiplier_vs_bf16")
        est = p.get("estimated_kl")
        lines.append(
            f"| {_md(p['label'])} | `{p['plan_file']}` | {_md(layers)} | {'n/a' if cap is None else f'{cap:.3f}'} | "
            f"{'n/a' if est is None else f'{est:.4g}'} | {'yes' if p['solved'] else 'no'} |"
        )
    return lines + [""]


def _configurations(r: dict[str, Any]) -> list[str]:
    if not r.get("configurations"):
        return []
    lines = ["## Configurations", "", "| configuration | role | gate | verdict |", "|---|---|---|---|"]
    for c in r["configurations"]:
        lines.append(f"| {_md(c['label'])} | {c['role']} | {c['gate']} | {_md(c['verdict'])} |")
    return lines + [""]


def _serve(r: dict[str, Any]) -> list[str]:
    if not r.get("serve_commands"):
        return []
    lines = ["## Serve", ""]
    for engine, cmd in r["serve_commands"].items():
        lines += [f"{engine} ({r['exports'][engine]['kind']} `{r['exports'][engine]['path']}`):", "",
                  "```", cmd, "```", ""]  # fmt: skip
    return lines


def _engines(r: dict[str, Any]) -> list[str]:
    """Every evaluated configuration's engine commands (kvcal.engines), or why an engine cannot run it."""
    if not r.get("engine_commands"):
        return []
    from kvcal.engines import markdown_from_dicts

    return markdown_from_dicts(r["engine_commands"]).splitlines() + [""]


def render_release(record: dict[str, Any], cmp: Any) -> str:
    """The Markdown of a release record; `cmp` (a kvcal.report.compare.Comparison, or None when nothing was
    evaluated) adds kvcal compare's full report below."""
    lines = _header(record) + _plans(record) + _configurations(record) + _serve(record) + _engines(record)
    if cmp is not None:
        from kvcal.report.markdown import render_markdown

        body = render_markdown(cmp).splitlines()
        lines += ["## Evaluation report", ""] + ["#" + ln if ln.startswith("#") else ln for ln in body]
    return "\n".join(lines) + "\n"
