"""Gates that prove, not only fail to disprove (issue 23, item 5): an unjudged configuration does not pass, the
non-inferiority gate and the sample size it prints, no task in common, and a threshold whose unit follows its
metric (never the baseline's value)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcal.report import stats
from kvcal.report.compare import compare_runs
from kvcal.report.markdown import render_markdown
from kvcal.report.verdicts import NO_COMMON_TASK, NONINFERIORITY

Invoke = Callable[[list[str]], tuple[int, str, str]]


def _run(invoke: Invoke, args: list[str]) -> tuple[int, str, str]:
    """invoke, with stderr's lines (wrapped at the console's width) joined back into one line of words."""
    code, out, err = invoke(args)
    return code, out, " ".join(err.split())


def test_six_samples_with_minimum_ten_fail_the_gate(tmp_path: Path, write_run, gsm8k_records, invoke: Invoke) -> None:  # noqa: ANN001
    """`--limit 6` by mistake: nothing can be judged, so --fail-on-regression exits 1 naming it on stderr;
    --allow-unjudged opts out (exit 0, still listed)."""
    right = np.array([True, True, False, True, False, True])
    write_run(tmp_path, "base", "bf16", {"gsm8k": gsm8k_records(right)})
    write_run(tmp_path, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(right)})
    c = compare_runs([tmp_path], n_boot=100)
    assert c.failures == [] and c.unjudged_configs == ["fp8"] and not c.gate_passed
    assert c.config_gate("fp8") == "insufficient data"
    code, out, err = _run(invoke, ["compare", str(tmp_path), "--fail-on-regression"])
    assert code == 1, out + err
    assert "Regression gate FAILED: not judged" in err and "fp8: insufficient data on gsm8k" in err
    assert "6 paired samples, fewer than the minimum 10" in err
    code, out, err = _run(invoke, ["compare", str(tmp_path), "--fail-on-regression", "--allow-unjudged"])
    assert code == 0, out + err
    assert "passed by --allow-unjudged" in err
    # without --fail-on-regression the exit stays 0 (a report, not a gate)
    assert _run(invoke, ["compare", str(tmp_path)])[0] == 0
    # non-inferiority: the same
    code, _, err = _run(invoke, ["compare", str(tmp_path), "--fail-on-regression", "--gate", "noninferiority"])
    assert code == 1 and "Noninferiority gate FAILED: not judged" in err


def test_no_task_in_common_is_not_a_pass(tmp_path: Path, write_run, gsm8k_records, kl_records, invoke: Invoke) -> None:  # noqa: ANN001
    n = 30
    right = np.arange(n) % 3 > 0
    write_run(tmp_path, "base", "bf16", {"gsm8k": gsm8k_records(right)})
    write_run(tmp_path, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(right)})
    write_run(tmp_path, "klonly", "nvfp4", {"kl": kl_records(np.full(n, 0.05), np.ones(n))})
    c = compare_runs([tmp_path], n_boot=100)
    assert c.config_gate("fp8") == "pass" and c.config_gate("klonly") == NO_COMMON_TASK
    assert c.no_common_task == ["klonly"] and not c.gate_passed
    assert "no task in common" in c.config_verdict("klonly")
    md = render_markdown(c)
    assert "1 configuration(s) had no task in common" in md and "## No task in common" in md
    code, out, err = _run(invoke, ["compare", str(tmp_path), "--fail-on-regression", "--json"])
    assert code == 1 and "klonly: not judged: no task in common" in err
    gate = json.loads(out)["gate"]
    assert gate["passed"] is False and gate["no_common_task"] == ["klonly"]
    assert _run(invoke, ["compare", str(tmp_path), "--fail-on-regression", "--allow-unjudged"])[0] == 0


def test_kl_threshold_is_nats_against_an_fp8_baseline_too(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    """--max-drop 0.02 on kl means 0.02 nats whatever the baseline: against an FP8 baseline (kl ~0.006) a 20%
    rise (0.0012 nats) passes; a 0.024-nat rise fails. Relative units would have failed the first (20% > 2%)."""
    n = 40
    rng = np.random.default_rng(3)
    base = rng.uniform(0.005, 0.007, n)
    ones = np.ones(n)
    write_run(tmp_path, "fp8", "fp8_e4m3", {"kl": kl_records(base, ones)})
    write_run(tmp_path, "small", "int8", {"kl": kl_records(base * 1.2, ones)})
    write_run(tmp_path, "big", "nvfp4", {"kl": kl_records(base + 0.024, ones)})
    c = compare_runs([tmp_path], baseline="fp8", n_boot=300, max_drop=0.02)
    kl = {r.config: r for r in c.results if r.metric == "kl"}
    assert kl["small"].worse and kl["small"].rel_change == pytest.approx(0.2)
    assert kl["small"].threshold_unit == "absolute" and not kl["small"].gate_fail
    assert kl["big"].gate_fail and kl["big"].degradation == pytest.approx(0.024)
    assert "0.02 nats absolute" in render_markdown(c)
    # perplexity stays relative: the unit is the metric's, and it is named
    assert all(r.threshold_unit == "relative" for r in c.results if r.metric == "ppl")


def _table(n: int, p_b: float, p_c: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Paired correctness: base right and other wrong with p_b, the reverse with p_c, else both right/wrong."""
    u = rng.random(n)
    base = np.where(u < p_b, 1.0, np.where(u < p_b + p_c, 0.0, (rng.random(n) < 0.6).astype(float)))
    other = np.where(u < p_b, 0.0, np.where(u < p_b + p_c, 1.0, base))
    return base, other


def _ni_upper(base: np.ndarray, other: np.ndarray, alpha: float = 0.05) -> float:
    a, b, c, d = stats.discordant_pairs(base, other)
    lo, _ = stats.newcombe_paired(a, b, c, d, 2 * alpha)
    return -lo


def test_noninferiority_sample_size_has_its_power() -> None:
    """A true drop of 4 points, threshold 8: at the planned n the one-sided bound falls under 8 points in ~80%
    of repeated experiments (the power asked for), at a quarter of it far less often."""
    p_b, p_c, thr = 0.06, 0.02, 0.08
    d = p_b - p_c
    sd = math.sqrt(p_b + p_c - d * d)  # SD of the per-pair differences
    n = stats.noninferiority_sample_size(thr - d, sd, alpha=0.05, power=0.8)
    z = stats.sps.norm.ppf
    assert n == pytest.approx(((z(0.95) + z(0.8)) * sd / (thr - d)) ** 2, rel=0.02)  # the normal formula
    rng = np.random.default_rng(0)
    reps = 400
    passed = sum(_ni_upper(*_table(n, p_b, p_c, rng)) < thr for _ in range(reps)) / reps
    small = sum(_ni_upper(*_table(n // 4, p_b, p_c, rng)) < thr for _ in range(reps)) / reps
    # 400 replicates: the share's SD is ~0.02 at 0.8
    assert 0.72 <= passed <= 0.90, passed
    assert small < 0.5, small


def test_noninferiority_gate_prints_the_sample_size_that_then_passes(
    tmp_path: Path, write_run, gsm8k_records, invoke: Invoke
) -> None:  # noqa: ANN001
    """A synthetic 4-point drop: at 150 questions the bound is over 8 points (not shown; the CLI prints the n
    that would show it); run at that n, the same effect passes; a 12-point drop never passes (no n printed)."""
    rng = np.random.default_rng(11)
    base, other = _table(150, 0.06, 0.02, rng)
    small = tmp_path / "small"
    write_run(small, "base", "bf16", {"gsm8k": gsm8k_records(base)})
    write_run(small, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(other)})
    args = ["--gate", "noninferiority", "--max-drop", "0.08", "--fail-on-regression"]
    c = compare_runs([small], n_boot=100, max_drop=0.08, gate=NONINFERIORITY)
    r = next(x for x in c.results if x.gated)
    assert r.ni_upper is not None and r.ni_upper >= 0.08 and r.gate_fail and r.ni_n_needed is not None
    assert r.ni_n_needed > 150
    code, out, err = _run(invoke, ["compare", str(small), *args])
    assert code == 1 and "Non-inferiority gate FAILED" in err
    assert f"about {r.ni_n_needed} paired samples (now 150)" in err
    # the printed n, run: the same effect, drawn again at that size
    big = tmp_path / "big"
    base, other = _table(r.ni_n_needed, 0.06, 0.02, np.random.default_rng(12))
    write_run(big, "base", "bf16", {"gsm8k": gsm8k_records(base)})
    write_run(big, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(other)})
    code, out, err = _run(invoke, ["compare", str(big), *args, "--json"])
    assert code == 0, err
    payload = json.loads(out)
    assert payload["gate"]["mode"] == "noninferiority" and payload["gate"]["passed"] is True
    assert all(x["ni_passed"] for x in payload["results"] if x["gate_threshold"] is not None)
    # a drop larger than the threshold: no sample size would show it
    worse = tmp_path / "worse"
    base, other = _table(300, 0.14, 0.02, np.random.default_rng(13))
    write_run(worse, "base", "bf16", {"gsm8k": gsm8k_records(base)})
    write_run(worse, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(other)})
    code, _, err = _run(invoke, ["compare", str(worse), *args])
    assert code == 1 and "no sample size would" in err
    # the regression gate on the small run: the drop is not significant beyond 8 points -> pass
    assert _run(invoke, ["compare", str(small), "--max-drop", "0.08", "--fail-on-regression"])[0] == 0


def test_bad_gate_name_is_one_error_line(tmp_path: Path, write_run, gsm8k_records, invoke: Invoke) -> None:  # noqa: ANN001
    right = np.arange(20) % 2 == 0
    write_run(tmp_path, "base", "bf16", {"gsm8k": gsm8k_records(right)})
    write_run(tmp_path, "fp8", "fp8_e4m3", {"gsm8k": gsm8k_records(right)})
    code, out, err = _run(invoke, ["compare", str(tmp_path), "--gate", "nonferiority"])
    assert code == 2 and err.strip().count("\n") == 0
    assert "Error: --gate must be one of regression, noninferiority" in err
