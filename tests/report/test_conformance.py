"""Engine vs emulation (issue 23, item 2): an engine run paired with kvcal's emulation of the configuration it
claims. Known answers on written runs: one that computes something else (its answers flip on many samples) does
not match; a faithful one (the same answers up to a few kernel-rounding flips) matches, with what it could miss.
The real-model study and its commands are in docs/studies/conformance.md."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvcal.report.compare import compare_runs
from kvcal.report.conformance import add_conformance
from kvcal.report.markdown import render_markdown

Invoke = Callable[[list[str]], tuple[int, str, str]]
N = 200


def _runs(tmp_path: Path, write_run, kl_records) -> Path:  # noqa: ANN001
    """bf16, kvcal's calibrated fp8 emulation, a faithful 'engine' (its windows' kl within rounding of the
    emulation's) and one that ignores its scales (kl 30% higher on every window)."""
    rng = np.random.default_rng(7)
    calib = rng.uniform(0.004, 0.009, N)
    ones = np.ones(N)
    write_run(tmp_path, "bf16", "bf16", {"kl": kl_records(np.zeros(N), ones)})
    write_run(tmp_path, "emu", "fp8_e4m3", {"kl": kl_records(calib, ones)}, granularity="tensor")
    faithful = calib.copy()
    faithful[:3] += [1e-6, -1e-6, 2e-6]  # three windows off by rounding, either way
    write_run(tmp_path, "engine_ok", "fp8_e4m3", {"kl": kl_records(faithful, ones)}, granularity="tensor")
    write_run(tmp_path, "engine_bad", "fp8_e4m3", {"kl": kl_records(calib * 1.3 + rng.normal(0, 1e-3, N), ones)},
              granularity="tensor")  # fmt: skip
    return tmp_path


def test_scales_ignored_does_not_match_faithful_does(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    root = _runs(tmp_path, write_run, kl_records)
    c = compare_runs([root], n_boot=500)
    add_conformance(c, ["engine_bad=emu", "engine_ok=emu"])
    bad, ok = c.conformance
    assert bad.conforms is False and bad.verdict.startswith("does not match")
    assert "kl" in bad.verdict and bad.claimed == "fp8_e4m3, scales calib-tensor, skip none"
    assert ok.conforms is True and ok.verdict.startswith("matches at this sample size")
    assert "could miss differences below" in ok.verdict
    assert ok.agreement["kl/kl"] == (N - 3) / N and bad.agreement["kl/kl"] == 0.0
    assert not c.gate_passed  # a run that does not match its claim fails the gate
    md = render_markdown(c)
    assert "## Engine vs emulation" in md and "`engine_bad`" in md
    assert "**Gate (regression):** FAILED (1 engine run(s) not matching their emulation)" in md
    assert [x["conforms"] for x in c.to_dict()["conformance"]] == [False, True]


def test_cli_conformance(tmp_path: Path, write_run, kl_records, invoke: Invoke) -> None:  # noqa: ANN001
    root = _runs(tmp_path, write_run, kl_records)
    code, out, err = invoke(["compare", str(root), "--conformance", "engine_ok=emu", "--json",
                             "--fail-on-regression", "--max-drop", "0.05"])  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["conformance"][0]["conforms"] is True
    code, _, err = invoke(["compare", str(root), "--conformance", "engine_bad=emu", "--fail-on-regression",
                           "--max-drop", "0.05"])  # fmt: skip
    assert code == 1 and "Engine vs emulation: engine_bad: does not match" in " ".join(err.split())
    code, _, err = invoke(["compare", str(root), "--conformance", "nope=emu"])
    assert code == 2 and "write ENGINE=EMULATION" in err


def _rows(html: str) -> dict[tuple[str, str], list[str]]:
    """The conformance table's rows as cells, keyed by (engine, metric)."""
    start = html.index("<h2>Engine vs emulation</h2>")
    table = html[html.index("<table>", start) : html.index("</table>", start)]
    rows = [[cell.split("</td>")[0] for cell in tr.split("<td>")[1:]] for tr in table.split("<tr>")[2:]]
    return {(r[0].removeprefix("<code>").removesuffix("</code>"), r[4]): r[1:] for r in rows}


def test_html_report_has_the_conformance_section(tmp_path: Path, write_run, kl_records, invoke: Invoke) -> None:  # noqa: ANN001
    """`kvcal compare --conformance ... --html`: per pair the agreement, the paired difference with its
    interval, the minimum detectable difference and the verdict, the same numbers as the JSON."""
    root = _runs(tmp_path / "runs", write_run, kl_records)
    page = tmp_path / "r.html"
    code, out, err = invoke(["compare", str(root), "--conformance", "engine_bad=emu", "--conformance", "engine_ok=emu",
                             "--html", str(page), "--json", "--max-drop", "0.05"])  # fmt: skip
    assert code == 0, err
    text = page.read_text()
    assert "<h2>Engine vs emulation</h2>" in text
    assert "FAILED (1 engine run(s) not matching their emulation)" in text
    assert "<b>NO MATCH</b>: does not match: engine_bad" in text and "<b>MATCH</b>: matches at this sample size" in text
    rows = _rows(text)
    pairs = json.loads(out)["conformance"]
    assert len(rows) == sum(len(p["results"]) for p in pairs) == 4  # two pairs x (kl, top1_agree)
    for pair in pairs:
        for r in pair["results"]:
            cells = rows[(pair["engine"], r["metric"])]
            assert cells[:3] == ["<code>emu</code>", "fp8_e4m3, scales calib-tensor, skip none", "kl"]
            agree = pair["agreement"]["kl/" + r["metric"]]
            assert cells[4] == str(N) and cells[5] == f"{agree:.1%}"
            assert cells[6] == f"{r['diff']:+.4g} [{r['ci_low']:.4g}, {r['ci_high']:.4g}]"
            assert cells[8] == ("—" if r["mdd"] is None else f"{r['mdd']:.3g}")
    assert rows[("engine_bad", "kl")][9] == "differs" and rows[("engine_ok", "kl")][9] == "no significant difference"
    # no conformance asked and no engine run: no section
    assert invoke(["compare", str(root), "--html", str(page)])[0] == 0
    assert "Engine vs emulation" not in page.read_text()
