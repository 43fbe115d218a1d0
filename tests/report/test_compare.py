"""kvcal compare: loading run directories, pairing, verdicts, the gate, reports, and bad input.

The fixtures WRITE synthetic run directories in the run-directory contract (config.yaml, results.json,
samples_<task>.jsonl in lm-eval's --log_samples record shape, metrics.json, COMPLETE) so the comparison logic is
tested on known answers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvcal.cli import app
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate import compare as cmpmod
from kvcal.report.render import render_markdown

MODEL = "/models/gemma3-270m"


class CliResult:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr
        self.output = stdout + stderr


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> CliResult:
    """Run the real console entry point (the app's error rendering and exit codes included)."""
    capsys.readouterr()
    code = 0
    try:
        app(args, prog_name="kvcal")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return CliResult(code, out.out, out.err)


def write_run(
    root: Path,
    name: str,
    kv_format: str,
    tasks: dict[str, list[dict]],
    *,
    model: str = MODEL,
    complete: bool = True,
    tokens_per_s: float = 100.0,
    capacity: float = 1.0,
    limit: int | None = None,
    scales: str | None = None,
    skip: str | None = None,
) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model": model,
        "model_dir": model,
        "kv_format": kv_format,
        "scales": {"path": scales, "granularity": "tensor"} if scales else None,
        "skip_layers": {"spec": skip, "indices": []},
        "tasks": list(tasks),
        "limit": limit,
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    results: dict = {"results": {}, "configs": {}, "n-shot": {}, "versions": {}, "n-samples": {}}
    for task, recs in tasks.items():
        with (d / f"samples_{task}.jsonl").open("w") as fh:
            for r in recs:
                fh.write(json.dumps(r) + "\n")
        results["results"][task] = {"alias": task}
    (d / "results.json").write_text(json.dumps(results))
    (d / "metrics.json").write_text(json.dumps({"tokens_per_s": tokens_per_s, "capacity_vs_bf16": capacity}))
    if complete:
        (d / "COMPLETE").write_text(json.dumps({"finished": "now"}))
    return d


def gsm8k_records(correct: np.ndarray) -> list[dict]:
    """lm-eval gsm8k records: one per (doc, filter)."""
    recs = []
    for i, c in enumerate(correct):
        for flt in ("strict-match", "flexible-extract"):
            recs.append(
                {"doc_id": i, "filter": flt, "metrics": ["exact_match"], "exact_match": float(c),
                 "doc_hash": f"h{i}", "target": "1", "filtered_resps": ["1"]}
            )  # fmt: skip
    return recs


def wikitext_records(ll: np.ndarray, words: np.ndarray) -> list[dict]:
    return [
        {"doc_id": i, "filter": "none", "metrics": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
         "word_perplexity": [float(a), int(w)], "byte_perplexity": [float(a), int(w) * 5],
         "bits_per_byte": [float(a), int(w) * 5]}
        for i, (a, w) in enumerate(zip(ll, words, strict=True))
    ]  # fmt: skip


def kl_records(kl: np.ndarray, agree: np.ndarray) -> list[dict]:
    return [
        {"doc_id": i, "kl": float(k), "top1_agree": float(a), "nll": 3.0, "n_tokens": 64}
        for i, (k, a) in enumerate(zip(kl, agree, strict=True))
    ]


@pytest.fixture()
def data() -> dict:
    rng = np.random.default_rng(0)
    n = 200
    correct = rng.random(n) < 0.6
    ll = -rng.uniform(200, 400, size=50)
    words = rng.integers(60, 120, size=50)
    kl = rng.uniform(0.001, 0.002, size=60)
    agree = rng.uniform(0.97, 1.0, size=60)
    return {"correct": correct, "ll": ll, "words": words, "kl": kl, "agree": agree, "rng": rng}


def _tasks(correct, ll, words, kl, agree) -> dict[str, list[dict]]:
    return {
        "gsm8k": gsm8k_records(correct),
        "wikitext": wikitext_records(ll, words),
        "kl": kl_records(kl, agree),
    }


def test_identical_runs_zero_difference_and_gate_passes(tmp_path: Path, data: dict) -> None:
    t = _tasks(data["correct"], data["ll"], data["words"], data["kl"], data["agree"])
    write_run(tmp_path, "m__bf16__none__skip-none", "bf16", t)
    write_run(tmp_path, "m__fp8_e4m3__uncal__skip-none", "fp8_e4m3", t, capacity=2.0, tokens_per_s=150)
    c = cmpmod.compare_runs([tmp_path], baseline="bf16", n_boot=500)
    assert c.baseline == "m__bf16__none__skip-none"
    assert c.failures == []
    keys = [r for r in c.results if r.key]
    assert {(r.task, r.label) for r in keys} == {
        ("gsm8k", "exact_match,strict-match"),
        ("gsm8k", "exact_match,flexible-extract"),
        ("wikitext", "word_perplexity"),
        ("kl", "kl"),
        ("kl", "top1_agree"),
    }
    for r in c.results:
        assert r.diff == 0.0 and r.ci_low == 0.0 and r.ci_high == 0.0
        assert r.identical and not r.significant
    gsm = next(r for r in c.results if r.task == "gsm8k")
    assert gsm.binary and gsm.p_value == 1.0 and gsm.discordant == (0, 0)
    # MDD with no observed discordance: ~ (1.96 + 0.84)^2 / n
    assert gsm.mdd == pytest.approx(7.85 / 200, rel=0.05)
    cfg = c.config("m__fp8_e4m3__uncal__skip-none")
    assert cfg.capacity == 2.0 and cfg.throughput_ratio == pytest.approx(1.5)
    verdict = c.config_verdict(cfg.label)
    assert verdict.startswith("no significant change on any task (identical per-sample results")
    assert "could miss changes below 0.0388 on gsm8k" in verdict
    md = render_markdown(c)
    assert "PASSED" in md and "| `m__fp8_e4m3__uncal__skip-none` |" in md and "## wikitext" in md


def test_perplexity_statistic_matches_lm_eval(tmp_path: Path, data: dict) -> None:
    t = _tasks(data["correct"], data["ll"], data["words"], data["kl"], data["agree"])
    write_run(tmp_path, "base", "bf16", t)
    t2 = _tasks(data["correct"], data["ll"] * 1.05, data["words"], data["kl"] * 3, data["agree"])
    write_run(tmp_path, "worse", "nvfp4", t2)
    c = cmpmod.compare_runs([tmp_path / "base", tmp_path / "worse"], n_boot=500)
    wp = next(r for r in c.results if r.task == "wikitext" and r.metric == "word_perplexity")
    # lm-eval's weighted_perplexity: exp(-sum(ll) / sum(words))
    expect = float(np.exp(-data["ll"].sum() / data["words"].sum()))
    assert wp.base == pytest.approx(expect)
    assert wp.score == pytest.approx(float(np.exp(-(data["ll"] * 1.05).sum() / data["words"].sum())))
    assert wp.rel_change == pytest.approx(wp.score / wp.base - 1)
    assert wp.worse and wp.gate_fail and not wp.higher_is_better
    bpb = next(r for r in c.results if r.metric == "bits_per_byte")
    assert bpb.base == pytest.approx(-data["ll"].sum() / (data["words"].sum() * 5) / np.log(2))
    kl = next(r for r in c.results if r.task == "kl" and r.metric == "kl")
    assert kl.base == pytest.approx(data["kl"].mean())  # equal token weights
    assert kl.rel_change == pytest.approx(2.0) and kl.gate_fail
    ppl = next(
        r for r in c.results if r.task == "kl" and r.metric == "ppl"
    )  # kvcal kl: exp(sum nll / tokens)
    assert (
        ppl.base == pytest.approx(np.exp(3.0 * 60 / (64 * 60))) and not ppl.key and not ppl.higher_is_better
    )


def test_planted_regression_fails_gate(
    tmp_path: Path, data: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    correct = data["correct"]
    worse = correct.copy()
    flip = np.flatnonzero(correct)[:40]  # 40 of 200 right answers become wrong: -0.20
    worse[flip] = False
    back = np.flatnonzero(~correct)[:4]  # a little noise the other way
    worse[back] = True
    t = _tasks(correct, data["ll"], data["words"], data["kl"], data["agree"])
    write_run(tmp_path, "base", "bf16", t)
    write_run(
        tmp_path, "fp4", "fp4_e2m1", _tasks(worse, data["ll"], data["words"], data["kl"], data["agree"])
    )
    # the same but with a tiny (non-significant) change
    small = correct.copy()
    small[np.flatnonzero(correct)[:2]] = False
    small[np.flatnonzero(~correct)[:1]] = True
    write_run(
        tmp_path, "fp8", "fp8_e4m3", _tasks(small, data["ll"], data["words"], data["kl"], data["agree"])
    )
    c = cmpmod.compare_runs([tmp_path], n_boot=1000)
    r = next(x for x in c.results if x.config == "fp4" and x.label == "exact_match,strict-match")
    assert r.diff == pytest.approx(-36 / 200)
    assert r.discordant == (40, 4)
    assert r.p_value < 1e-6 and r.worse and r.gate_fail
    assert r.ci_high < 0 < -r.ci_low
    assert "significant drop of 0.180 on gsm8k" in c.config_verdict("fp4")
    s = next(x for x in c.results if x.config == "fp8" and x.label == "exact_match,strict-match")
    assert not s.significant and not s.gate_fail
    assert "no significant change" in c.config_verdict("fp8") and "could miss" in c.config_verdict("fp8")
    assert {f.config for f in c.failures} == {"fp4"}
    # a threshold above the drop: significant but tolerated
    c2 = cmpmod.compare_runs([tmp_path], n_boot=200, max_drop=0.25)
    assert not c2.failures
    assert "within the gate threshold" in c2.config_verdict("fp4")

    out = tmp_path / "r.md"
    res = run_cli(["compare", str(tmp_path), "-o", str(out), "--fail-on-regression"], capsys)
    assert res.exit_code == 1, res.output
    assert "fp4" in res.output and "gsm8k" in res.output
    assert out.exists() and "FAILED" in out.read_text()
    res = run_cli(["compare", str(tmp_path), "-o", str(out), "--fail-on-regression", "--json"], capsys)
    assert res.exit_code == 1
    payload = json.loads(res.stdout)
    assert payload["gate"]["passed"] is False
    assert {f["config"] for f in payload["gate"]["failures"]} == {"fp4"}
    # without --fail-on-regression the report is written and the exit code is 0
    res = run_cli(["compare", str(tmp_path), "-o", str(out)], capsys)
    assert res.exit_code == 0, res.output


def test_gate_cli_identical_exit_0_and_html(
    tmp_path: Path, data: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    t = _tasks(data["correct"], data["ll"], data["words"], data["kl"], data["agree"])
    write_run(tmp_path / "runs", "base", "bf16", t)
    write_run(tmp_path / "runs", "fp8", "fp8_e4m3", t, capacity=2.0)
    write_run(tmp_path / "runs", "nvfp4", "nvfp4", t, capacity=3.56)
    md, html_path = tmp_path / "r.md", tmp_path / "r.html"
    res = run_cli(
        ["compare", str(tmp_path / "runs"), "-o", str(md), "--html", str(html_path), "--fail-on-regression"],
        capsys,
    )
    assert res.exit_code == 0, res.output
    text = html_path.read_text()
    assert text.count("data:image/png;base64,") == 2
    assert "<script" not in text and "http://" not in text and "https://" not in text
    assert "3.56x" in md.read_text()


def test_different_limits_pair_on_common_samples(tmp_path: Path, data: dict) -> None:
    t = _tasks(data["correct"], data["ll"], data["words"], data["kl"], data["agree"])
    write_run(tmp_path, "base", "bf16", t, limit=200)
    short = {"gsm8k": gsm8k_records(data["correct"][:50])}
    write_run(tmp_path, "fp8", "fp8_e4m3", short, limit=50)
    warnings: list[str] = []
    c = cmpmod.compare_runs([tmp_path], n_boot=200, warn=warnings.append)
    r = next(x for x in c.results if x.label == "exact_match,strict-match")
    assert r.n == 50 and r.n_base_total == 200
    assert any("50 in common" in w and "200" in w for w in warnings)
    assert any("no wikitext run" in w for w in warnings)


def test_bad_inputs(tmp_path: Path, data: dict, capsys: pytest.CaptureFixture[str]) -> None:
    t = {"gsm8k": gsm8k_records(data["correct"])}
    base = write_run(tmp_path / "a", "base", "bf16", t)
    other = write_run(tmp_path / "a", "fp8", "fp8_e4m3", t)
    # different models
    stranger = write_run(tmp_path / "b", "other", "fp8_e4m3", t, model="/models/smollm2")
    with pytest.raises(UsageError, match="different models"):
        cmpmod.compare_runs([base, stranger])
    # missing baseline
    with pytest.raises(UsageError, match="no baseline run matches 'bf16'"):
        cmpmod.compare_runs([other])
    with pytest.raises(UsageError, match="no baseline run matches 'int8'"):
        cmpmod.compare_runs([base, other], baseline="int8")
    # baseline by directory name
    assert cmpmod.compare_runs([base, other], baseline="fp8", n_boot=100).baseline == "fp8"
    # no common samples
    shifted = [dict(r, doc_id=r["doc_id"] + 10_000) for r in t["gsm8k"]]
    disjoint = write_run(tmp_path / "c", "disjoint", "fp8_e4m3", {"gsm8k": shifted})
    with pytest.raises(KvcalError, match="no samples in common"):
        cmpmod.compare_runs([base, disjoint])
    # incomplete run: fail names it; skip leaves it out with a warning
    inc = write_run(tmp_path / "d", "interrupted", "nvfp4", t, complete=False)
    with pytest.raises(KvcalError, match=r"interrupted is incomplete"):
        cmpmod.compare_runs([base, other, inc])
    c = cmpmod.compare_runs([base, other, inc], on_bad_run="skip", n_boot=100)
    assert c.skipped_runs == [str(inc)] and any("interrupted" in w for w in c.warnings)
    # corrupt samples / results
    bad = write_run(tmp_path / "e", "corrupt", "nvfp4", t)
    (bad / "samples_gsm8k.jsonl").write_text('{"doc_id": 0, "exact_match": 1.0}\n{not json\n')
    with pytest.raises(KvcalError, match=r"corrupt.*samples_gsm8k.jsonl line 2"):
        cmpmod.compare_runs([base, bad])
    bad2 = write_run(tmp_path / "f", "corrupt2", "nvfp4", t)
    (bad2 / "results.json").write_text("{")
    with pytest.raises(KvcalError, match=r"corrupt2 is corrupt: results.json"):
        cmpmod.compare_runs([base, bad2])
    # CLI: one clear line, right exit codes
    res = run_cli(["compare", str(base), str(stranger), "-o", str(tmp_path / "x.md")], capsys)
    assert res.exit_code == 2 and "different models" in res.output
    res = run_cli(["compare", str(base), str(inc), "-o", str(tmp_path / "x.md")], capsys)
    assert res.exit_code == 1 and "incomplete" in res.output and "Traceback" not in res.output
    res = run_cli(
        ["compare", str(base), str(other), str(inc), "-o", str(tmp_path / "x.md"), "--on-bad-run", "skip"],
        capsys,
    )
    assert res.exit_code == 0, res.output
    res = run_cli(["compare", str(tmp_path / "nope"), "-o", str(tmp_path / "x.md")], capsys)
    assert res.exit_code == 2 and "does not exist" in res.output


def test_doc_hash_mismatch_is_left_out(tmp_path: Path, data: dict) -> None:
    t = {"gsm8k": gsm8k_records(data["correct"])}
    base = write_run(tmp_path, "base", "bf16", t)
    recs = [dict(r, doc_hash="zz") if r["doc_id"] < 10 else r for r in t["gsm8k"]]
    other = write_run(tmp_path, "fp8", "fp8_e4m3", {"gsm8k": recs})
    c = cmpmod.compare_runs([base, other], n_boot=100)
    assert next(r for r in c.results if r.key).n == 190
    assert any("hold different documents" in w for w in c.warnings)


def test_gpqa_and_aime_key_metrics(tmp_path: Path, data: dict) -> None:
    c = data["correct"][:30]
    aime = [
        {"doc_id": i, "filter": "none", "metrics": ["exact_match"], "exact_match": float(x)}
        for i, x in enumerate(c)
    ]
    gpqa = [
        {
            "doc_id": i,
            "filter": "none",
            "metrics": ["acc", "acc_norm"],
            "acc": float(x),
            "acc_norm": float(not x),
        }
        for i, x in enumerate(data["correct"][:198])
    ]
    t = {"aime25": aime, "gpqa_diamond_zeroshot": gpqa}
    write_run(tmp_path, "base", "bf16", t)
    write_run(tmp_path, "fp8", "fp8_e4m3", t)
    res = cmpmod.compare_runs([tmp_path], n_boot=100)
    keys = {(r.task, r.label) for r in res.results if r.key}
    assert keys == {("aime25", "exact_match"), ("gpqa_diamond_zeroshot", "acc")}
    assert any(r.label == "acc_norm" and not r.key for r in res.results)
    # 30 aime problems cannot detect small drops: the MDD says so
    a = next(r for r in res.results if r.task == "aime25")
    assert a.mdd > 0.2
    assert re.search(r"could miss drops below 0\.2\d\d", a.verdict)


def test_kl_against_bf16_cache_uses_absolute_threshold(tmp_path: Path) -> None:
    """kvcal's kl of the BF16 run is measured against a BF16 cache: 0. No relative change then; the gate
    compares the absolute KL (nats) with --max-drop."""
    n = 40
    zeros, ones = np.zeros(n), np.ones(n)
    rng = np.random.default_rng(5)
    write_run(tmp_path, "base", "bf16", {"kl": kl_records(zeros, ones)})
    write_run(tmp_path, "fp8", "fp8_e4m3", {"kl": kl_records(rng.uniform(0.002, 0.004, n), ones)})
    write_run(tmp_path, "fp4", "fp4_e2m1", {"kl": kl_records(rng.uniform(0.03, 0.05, n), ones - 0.01)})
    c = cmpmod.compare_runs([tmp_path], n_boot=300)
    kl = {r.config: r for r in c.results if r.metric == "kl"}
    assert kl["fp8"].rel_change is None and kl["fp8"].worse and not kl["fp8"].gate_fail
    assert kl["fp4"].rel_change is None and kl["fp4"].gate_fail
    assert kl["fp4"].diff == pytest.approx(kl["fp4"].score)
    assert {f.config for f in c.failures} == {"fp4"}
    assert "within the gate threshold" in c.config_verdict("fp8")


def test_same_model_folder_under_another_name_is_one_model(tmp_path: Path, data: dict) -> None:
    t = {"gsm8k": gsm8k_records(data["correct"])}
    base = write_run(tmp_path, "base", "bf16", t)
    other = write_run(tmp_path, "fp8", "fp8_e4m3", t)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["model"] = "gemma3-270m"  # the short name of the same converted folder
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cmpmod.compare_runs([base, other], n_boot=100).model == MODEL


def test_small_sample_warning(tmp_path: Path, data: dict) -> None:
    t = {"gsm8k": gsm8k_records(data["correct"][:5])}
    write_run(tmp_path, "base", "bf16", t)
    write_run(tmp_path, "fp8", "fp8_e4m3", t)
    c = cmpmod.compare_runs([tmp_path], n_boot=100)
    assert any("only 5 paired samples" in w for w in c.warnings)
    assert "## Warnings" in render_markdown(c)
