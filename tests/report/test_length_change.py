"""Output length as a reported effect (issue 41, item 4): the paired change in generated tokens per (configuration,
generative task), its intervals, the report's section and the `--max-length-change` gate, on planted data."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcal.errors import UsageError
from kvcal.report import stats
from kvcal.report.length import FAIL, PASS, REPORTED, UNJUDGED, judge_length, paired_length_change

N = 120


def _planted(rel: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per document a baseline length (30..400 tokens, as gsm8k answers vary) and the configuration's: the same
    document's length times (1 + rel), with per-document noise of mean 0 (SD 10 tokens)."""
    g = np.random.default_rng(seed)
    base = g.integers(30, 400, N).astype(float)
    other = np.maximum(1.0, np.round(base * (1 + rel) + g.normal(0, 10, N)))
    return base, other


def test_a_planted_lengthening_is_found_with_intervals_that_cover_it() -> None:
    base, other = _planted(0.30)
    row = paired_length_change(base, other, config="nvfp4", task="gsm8k", baseline="bf16")
    assert row.n == N and row.base_mean == pytest.approx(base.mean()) and row.mean == pytest.approx(other.mean())
    # the difference of means and its interval: kvcal.report.stats' paired BCa, exactly
    t = stats.bca_difference(base, other)
    assert (row.diff, row.ci_low, row.ci_high, row.p_value) == (other.mean() - base.mean(), t.ci_low, t.ci_high,
                                                                t.p_value)  # fmt: skip
    assert row.ci_low is not None and row.ci_high is not None and row.ci_low > 0
    assert row.ci_low <= 0.30 * base.mean() <= row.ci_high  # the planted change in tokens
    assert row.rel_change == pytest.approx(other.mean() / base.mean() - 1)
    assert row.rel_ci_low is not None and row.rel_ci_high is not None
    assert row.rel_ci_low < 0.30 < row.rel_ci_high and row.rel_ci_high - row.rel_ci_low < 0.05
    assert row.significant


def test_no_planted_change_is_not_significant_and_its_interval_holds_zero() -> None:
    base, other = _planted(0.0, seed=3)
    row = paired_length_change(base, other, config="fp8", task="gsm8k", baseline="bf16")
    assert row.ci_low is not None and row.ci_high is not None and row.ci_low < 0 < row.ci_high
    assert row.p_value is not None and row.p_value > 0.05 and not row.significant
    assert row.rel_ci_low is not None and row.rel_ci_high is not None and row.rel_ci_low < 0 < row.rel_ci_high


def test_the_interval_covers_the_planted_change_at_about_its_level() -> None:
    """Coverage of the BCa interval of the mean difference over 200 planted data sets (n = 120 each): a 95%
    interval covers the true difference in 95% of them; 200 draws put the observed share within about +-3.1
    points (binomial SD), so 0.90 is 1.6 SD of the nominal 0.95 below it, 0.99 above."""
    covered = 0
    for seed in range(200):
        g = np.random.default_rng(100 + seed)
        base = g.integers(30, 400, N).astype(float)
        other = base + 20.0 + g.normal(0, 25, N)  # true mean difference: 20 tokens
        row = paired_length_change(base, other, config="x", task="t", baseline="b", n_boot=1000, seed=seed)
        assert row.ci_low is not None and row.ci_high is not None
        covered += row.ci_low <= 20.0 <= row.ci_high
    assert 0.90 <= covered / 200 <= 0.99


def test_the_gate_fails_a_significant_change_beyond_its_threshold_either_way() -> None:
    longer = paired_length_change(*_planted(0.30), config="a", task="t", baseline="b")
    shorter = paired_length_change(*_planted(-0.30), config="a", task="t", baseline="b")
    null = paired_length_change(*_planted(0.0, seed=3), config="a", task="t", baseline="b")
    for row, threshold, want in (
        (longer, 0.2, FAIL), (longer, 0.5, PASS), (shorter, 0.2, FAIL), (null, 0.01, PASS),
    ):  # fmt: skip
        judge_length(row, threshold, "regression")
        assert row.status == want, (row.rel_change, threshold)
    # non-inferiority (equivalence): pass only an interval inside (-threshold, +threshold)
    for row, threshold, want in ((longer, 0.5, PASS), (longer, 0.30, FAIL), (null, 0.05, PASS), (null, 0.001, FAIL)):
        judge_length(row, threshold, "noninferiority")
        assert row.status == want, (row.rel_ci_low, row.rel_ci_high, threshold)
    judge_length(null, None, "regression")
    assert null.status == REPORTED


def test_too_few_documents_are_not_judged() -> None:
    row = paired_length_change([10, 12, 11], [30, 33, 31], config="a", task="t", baseline="b")
    assert row.ci_low is None and "fewer than the minimum 10" in row.reason
    judge_length(row, 0.1, "regression")
    assert row.status == UNJUDGED


def _generative_run(write_run: Callable[..., Path], root: Path, name: str, fmt: str, lengths: np.ndarray) -> Path:
    recs = [
        {"doc_id": i, "filter": flt, "metrics": ["exact_match"], "exact_match": 1.0, "resps": [["x"]],
         "filtered_resps": ["1"], "gen_token_ids": [list(range(int(n)))]}
        for i, n in enumerate(lengths)
        for flt in ("strict-match", "flexible-extract")
    ]  # fmt: skip
    d = write_run(root, name, fmt, {"gsm8k": recs})
    res = json.loads((d / "results.json").read_text())
    res["configs"] = {"gsm8k": {"output_type": "generate_until"}}
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_compare_reports_the_length_change_and_gates_it(write_run: Callable[..., Path], tmp_path: Path) -> None:
    from kvcal.report.compare import compare_runs
    from kvcal.report.html import render_html
    from kvcal.report.markdown import render_markdown

    base, other = _planted(0.30)
    dirs = [
        _generative_run(write_run, tmp_path, "bf16", "bf16", base),
        _generative_run(write_run, tmp_path, "nvfp4", "nvfp4", other),
    ]
    cmp = compare_runs(dirs)
    (row,) = cmp.length_rows
    assert (row.config, row.task, row.baseline, row.n) == ("nvfp4", "gsm8k", "bf16", N)  # one record per document
    assert row.mean == pytest.approx(other.mean()) and row.status == REPORTED
    assert cmp.gate_passed  # reported, not gated
    md = render_markdown(cmp)
    assert "## Output length" in md and "Reported, not gated" in md and f"{row.mean:.1f}" in md
    assert "Output length" in render_html(cmp)
    assert cmp.to_dict()["length_change"]["rows"][0]["rel_change"] == pytest.approx(row.rel_change)

    gated = compare_runs(dirs, max_length_change=0.2)
    assert gated.length_rows[0].status == FAIL and not gated.gate_passed
    assert gated.config_gate("nvfp4") == "FAIL" and gated.to_dict()["gate"]["length_failures"]
    assert compare_runs(dirs, max_length_change=0.5).gate_passed
    # a gate never passes what it could not judge: 5 documents are too few
    few = [_generative_run(write_run, tmp_path / "few", n, n, x[:5]) for n, x in (("bf16", base), ("nvfp4", other))]
    unjudged = compare_runs(few, max_length_change=0.5, min_samples=10)
    assert unjudged.length_rows[0].status == UNJUDGED and not unjudged.gate_passed
    assert compare_runs(few, max_length_change=0.5, min_samples=10, allow_unjudged=True).gate_passed
    with pytest.raises(UsageError, match="--max-length-change"):
        compare_runs(dirs, max_length_change=0.0)


def test_divergence_rows_compare_against_the_runs_own_bf16_trajectory(
    write_run: Callable[..., Path], tmp_path: Path
) -> None:
    from kvcal.report.length import length_rows
    from kvcal.report.runs import load_run

    base, other = _planted(0.5, seed=5)
    recs = [
        {"doc_id": i, "filter": "none", "metrics": ["identical"], "identical": 0.0, "base_len": int(a),
         "quant_len": int(b)}
        for i, (a, b) in enumerate(zip(base, other, strict=True))
    ]  # fmt: skip
    d = write_run(tmp_path, "int8", "int8_per_tensor", {"divergence": recs})
    res = json.loads((d / "results.json").read_text())
    res["configs"] = {"divergence": {"output_type": "kvcal_divergence"}}
    (d / "results.json").write_text(json.dumps(res))
    (row,) = length_rows([("int8", [load_run(d)])], threshold=0.2)
    assert row.baseline == "BF16 trajectory" and row.n == N and row.status == FAIL
    assert row.rel_ci_low is not None and row.rel_ci_high is not None and row.rel_ci_low < 0.5 < row.rel_ci_high


def test_a_bad_max_length_change_is_one_error_line(
    write_run: Callable[..., Path], tmp_path: Path, invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    base, other = _planted(0.30)
    dirs = [str(_generative_run(write_run, tmp_path, n, n, x)) for n, x in (("bf16", base), ("nvfp4", other))]
    for bad in ("0", "-0.1", "nan"):
        code, _, err = invoke(["compare", *dirs, "--max-length-change", bad])
        assert code == 2 and err.startswith("Error: ") and err.count("\n") == 1 and "--max-length-change" in err
    code, _, err = invoke(["compare", *dirs, "--max-length-change", "0.2", "--fail-on-regression"])
    assert code == 1 and "Length change FAIL: nvfp4 on gsm8k" in err


def test_a_release_gates_length_with_its_yaml_key(write_run: Callable[..., Path], tmp_path: Path) -> None:
    """`gate.max_length_change` in a release YAML reaches the release's gate (kvcal compare's statistics over its
    runs): a 30% lengthening fails at 0.2, with release.json's reason naming the key, and passes at 0.5."""
    from types import SimpleNamespace

    import yaml

    from kvcal.pipeline import release
    from kvcal.pipeline.release_config import load_release_config

    base, other = _planted(0.30)
    cells = [SimpleNamespace(path=_generative_run(write_run, tmp_path, n, n, x)) for n, x in
             (("bf16", base), ("nvfp4", other))]  # fmt: skip
    for limit, passed in ((0.2, False), (0.5, True), (None, True)):
        path = tmp_path / f"release-{limit}.yaml"
        gate = {"mode": "regression", "bootstrap": 400} | ({"max_length_change": limit} if limit is not None else {})
        path.write_text(yaml.safe_dump({"ship": {"kv_format": "fp8_e4m3"}, "gate": gate}))
        cfg = load_release_config(path)
        assert cfg.gate.max_length_change == limit
        cmp = release.gate(SimpleNamespace(cfg=cfg, warn=lambda _m: None), cells)
        assert cmp.gate_passed is passed, limit
        if not passed:
            assert release._gate_failure(cmp) == "gate: generated length changed beyond gate.max_length_change (nvfp4)"


@pytest.mark.parametrize(("value", "needle"), [(0, "must be a fraction of the baseline's length > 0"),
                                               (".nan", "must be a fraction"), ("lots", "must be a number")])  # fmt: skip
def test_a_bad_release_length_gate_names_its_key(tmp_path: Path, value: object, needle: str) -> None:
    from kvcal.pipeline.release_config import load_release_config

    path = tmp_path / "release.yaml"
    path.write_text(f"ship: {{kv_format: fp8_e4m3}}\ngate: {{max_length_change: {value}}}\n")
    with pytest.raises(UsageError, match="'gate.max_length_change' " + needle):
        load_release_config(path)
