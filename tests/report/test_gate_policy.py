"""The gate policy per metric: `--max-drop METRIC=VALUE` / `TASK/METRIC=VALUE` (and the YAML mapping), which
metrics gate by default (top1_agree reported, not gated unless named), precedence, and bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcal.errors import UsageError
from kvcal.report.compare import compare_runs
from kvcal.report.markdown import render_markdown
from kvcal.report.verdicts import DEFAULT_MAX_DROP, DEFAULT_METRIC_DROPS, GatePolicy, parse_gate_policy

N = 40


def _demo_like_runs(root: Path, write_run, kl_records) -> None:  # noqa: ANN001
    """What `make demo` measures: calibrated FP8 with a small KL (~0.005 nats) but ~3 points of top-1 agreement
    lost to argmax flips at near-ties; NVFP4 with ~0.07 nats."""
    rng = np.random.default_rng(11)
    zeros, ones = np.zeros(N), np.ones(N)
    write_run(root, "bf16", "bf16", {"kl": kl_records(zeros, ones)})
    write_run(root, "fp8", "fp8_e4m3", {"kl": kl_records(rng.uniform(0.003, 0.007, N), rng.uniform(0.95, 0.99, N))},
              granularity="tensor")  # fmt: skip
    write_run(
        root, "nvfp4", "nvfp4", {"kl": kl_records(rng.uniform(0.05, 0.09, N), rng.uniform(0.85, 0.9, N))}
    )


def test_top1_agree_is_reported_but_gates_only_when_named(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    _demo_like_runs(tmp_path, write_run, kl_records)
    c = compare_runs([tmp_path], n_boot=500)
    top1 = {r.config: r for r in c.results if r.metric == "top1_agree"}
    kl = {r.config: r for r in c.results if r.metric == "kl"}
    # the FP8 top-1 drop is real (significant) and larger than 2 points, but top1_agree does not gate by default
    assert top1["fp8"].worse and -top1["fp8"].diff > 0.02
    assert top1["fp8"].key and not top1["fp8"].gated and not top1["fp8"].gate_fail
    assert top1["fp8"].p_adjusted is None  # outside the gate's Holm family
    assert "reported, not gated" in c.config_verdict("fp8")
    assert c.config_gate("fp8") == "pass" and kl["fp8"].gate_threshold == DEFAULT_MAX_DROP
    assert c.config_gate("nvfp4") == "FAIL" and kl["nvfp4"].gate_fail
    assert {f.config for f in c.failures} == {"nvfp4"}
    md = render_markdown(c)
    assert "reported (not gated)" in md and "gated at 0.02 nats absolute" in md
    # named, it gates: FP8 now fails on it
    named = compare_runs([tmp_path], n_boot=500, max_drop=["top1_agree=0.02"])
    assert named.config_gate("fp8") == "FAIL"
    assert {(f.config, f.metric) for f in named.failures} >= {("fp8", "top1_agree"), ("nvfp4", "kl")}


def test_per_metric_and_per_task_thresholds(tmp_path: Path, write_run, kl_records, gsm8k_records) -> None:  # noqa: ANN001
    rng = np.random.default_rng(3)
    correct = rng.random(200) < 0.6
    worse = correct.copy()
    worse[np.flatnonzero(correct)[:20]] = False  # 20 of 200 flipped: a drop of 0.10, significant
    zeros, ones = np.zeros(N), np.ones(N)
    write_run(tmp_path, "bf16", "bf16", {"kl": kl_records(zeros, ones), "gsm8k": gsm8k_records(correct)})
    write_run(tmp_path, "q", "fp8_e4m3", {"kl": kl_records(rng.uniform(0.02, 0.04, N), ones),
                                          "gsm8k": gsm8k_records(worse)})  # fmt: skip
    base = compare_runs([tmp_path], n_boot=500)
    assert {(f.task, f.metric) for f in base.failures} == {("kl", "kl"), ("gsm8k", "exact_match")}
    # kl=0.05 covers kl, gsm8k/exact_match=0.15 covers both of gsm8k's filters: nothing fails
    loose = compare_runs([tmp_path], n_boot=500, max_drop=["kl=0.05", "gsm8k/exact_match=0.15"])
    assert loose.failures == [] and loose.config_gate("q") == "pass"
    th = {(r.task, r.label): r.gate_threshold for r in loose.results if r.gated}
    assert th == {("kl", "kl"): 0.05, ("gsm8k", "exact_match,strict-match"): 0.15,
                  ("gsm8k", "exact_match,flexible-extract"): 0.15}  # fmt: skip
    # the most specific entry wins: one filter of gsm8k tightened again
    one = compare_runs(
        [tmp_path], n_boot=500, max_drop={"default": 0.5, "gsm8k/exact_match,strict-match": 0.02}
    )
    assert {(f.task, f.label) for f in one.failures} == {("gsm8k", "exact_match,strict-match")}
    # a bare number is the default for every gated metric (the old --max-drop)
    assert compare_runs([tmp_path], n_boot=500, max_drop=0.5).failures == []


def test_cli_max_drop_is_repeatable_and_reported(tmp_path: Path, write_run, kl_records, invoke) -> None:  # noqa: ANN001
    _demo_like_runs(tmp_path, write_run, kl_records)
    code, out, err = invoke(["compare", str(tmp_path), "--json", "--fail-on-regression"])
    assert code == 1 and "Regression gate FAILED" in err
    payload = json.loads(out)
    assert payload["gate"]["policy"] == {"default": DEFAULT_MAX_DROP, **DEFAULT_METRIC_DROPS}
    assert {f["config"] for f in payload["gate"]["failures"]} == {"nvfp4"}
    assert "kl/top1_agree" not in payload["gate"]["gated"] and "kl/kl" in payload["gate"]["gated"]
    argv = [
        "compare",
        str(tmp_path),
        "--json",
        "--fail-on-regression",
        "--max-drop",
        "0.01",
        "--max-drop",
        "kl=0.1",
    ]
    code, out, _ = invoke(argv)
    assert code == 0
    payload = json.loads(out)
    assert payload["gate"]["policy"] == {"default": 0.01, "kl": 0.1} and payload["gate"]["passed"]
    assert all(r["gate_threshold"] is None for r in payload["results"] if r["metric"] != "kl")
    # a name that matches nothing is said out loud
    code, _, err = invoke(["compare", str(tmp_path), "--max-drop", "KL=0.1"])
    assert code == 0 and "--max-drop names KL, which no compared result has" in err


def test_parse_gate_policy_forms_and_precedence() -> None:
    assert parse_gate_policy(None) == GatePolicy()
    assert parse_gate_policy(0.05) == GatePolicy(0.05, ()) == parse_gate_policy("0.05")
    listed = parse_gate_policy(["0.03", "kl=0.05", "gsm8k/exact_match=0.04"])
    mapped = parse_gate_policy({"default": 0.03, "kl": 0.05, "gsm8k/exact_match": 0.04})
    assert listed == mapped and parse_gate_policy(listed.to_dict()) == listed
    # named only: the default and the built-in per-metric defaults stay
    assert parse_gate_policy(["kl=0.05"]).default == DEFAULT_MAX_DROP
    p = parse_gate_policy({"default": 0.01, "exact_match": 0.02, "exact_match,flexible-extract": 0.03,
                           "gsm8k/exact_match": 0.04, "gsm8k/exact_match,strict-match": 0.05})  # fmt: skip
    assert p.threshold("gsm8k", "exact_match", "strict-match", True) == 0.05
    assert p.threshold("gsm8k", "exact_match", "flexible-extract", True) == 0.04
    assert p.threshold("aime25", "exact_match", "flexible-extract", True) == 0.03
    assert p.threshold("aime25", "exact_match", "none", True) == 0.02
    assert p.threshold("wikitext", "word_perplexity", "none", True) == 0.01
    assert p.threshold("kl", "top1_agree", "none", True) is None  # key, reported only
    assert p.threshold("gpqa", "acc_norm", "none", False) is None  # secondary
    assert parse_gate_policy(["acc_norm=0.1"]).threshold("gpqa", "acc_norm", "none", False) == 0.1


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["kl=abc"], "--max-drop kl: expected a number"),
        (["=0.1"], "is not a metric"),
        (["kl=-0.1"], "must be a finite number >= 0"),
        (["0.1", "0.2"], "2 default thresholds given"),
        (["kl=0.1", "kl=0.2"], "kl is given twice"),
        (["a/b/c=0.1"], "is not a metric"),
        (["abc"], "expected a number"),
        ({"kl": True}, "expected a number"),
        ({"default": "nan"}, "must be a finite number"),
        ({"kl"}, "must be a number, a list"),
    ],
)
def test_bad_policies_are_one_usage_error(values: object, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse_gate_policy(values)  # type: ignore[arg-type]


def test_cli_bad_max_drop_is_one_error_line(tmp_path: Path, write_run, kl_records, invoke: Callable) -> None:  # noqa: ANN001
    _demo_like_runs(tmp_path, write_run, kl_records)
    code, out, err = invoke(["compare", str(tmp_path), "--max-drop", "kl=lots"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "Error: --max-drop kl: expected a number >= 0 (e.g. 0.02), got 'lots'"
    ]
