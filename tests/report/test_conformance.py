"""Engine vs emulation by the quantization's damage (issue 38, item 3): four runs — the engine's quantized and
BF16 runs, kvcal's emulation and kvcal's BF16 run — and per document d = (engine_q - engine_bf16) -
(emu_q - emu_bf16) in nats per word, tested for equivalence (TOST) against the margin the BF16 pair sets.

Planted per-document values (written run directories, wikitext's (loglikelihood, words) records): the engine's
BF16 run differs from kvcal's by ~0.002 nats per word per document (two correct implementations); an engine whose
FP8 damage is the emulation's is equivalent; one whose damage is 2.5x (0.032 vs 0.013 nats per word, issue 38's
numbers) is not; twelve noisy documents are not enough to show either, with the samples that would. Unlike
configurations are refused naming each difference and its flag; without BF16 runs there is no verdict. The real
lm-eval folders: tests/report/test_lmeval_conformance.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from statsmodels.stats.weightstats import ttost_paired

from kvcal.errors import UsageError
from kvcal.report.compare import compare_runs
from kvcal.report.conformance import EQUIVALENT, NOT_EQUIVALENT, NOT_SHOWN, add_conformance, before_pairing
from kvcal.report.markdown import render_markdown

Invoke = Callable[[list[str]], tuple[int, str, str]]
ROLLING = {"wikitext": {"output_type": "loglikelihood_rolling"}}


def _docs(n: int, seed: int) -> dict[str, np.ndarray]:
    """Per-document NLL per word of each planted run (higher is worse)."""
    rng = np.random.default_rng(seed)
    words = rng.integers(200, 900, n)
    base = rng.uniform(2.5, 4.0, n)  # kvcal's BF16
    r = rng.normal(0.0005, 0.002, n)  # the engine's BF16 minus kvcal's: two implementations
    damage = 0.013 + rng.normal(0.0, 0.004, n)  # kvcal's FP8 damage per document
    return {
        "words": words, "emu_bf16": base, "emu_fp8": base + damage, "eng_bf16": base + r,
        "eng_ok": base + r + damage + rng.normal(0.0, 0.0005, n),  # the same damage, kernel rounding on top
        "eng_bad": base + r + 2.5 * damage,  # 0.032 vs 0.013 nats per word
        "eng_noisy": base + r + damage + _centred(rng.normal(0.0, 0.006, n)),  # gap 0, too noisy at n = 12
    }  # fmt: skip


def _centred(x: np.ndarray) -> np.ndarray:
    return x - x.mean()


def _write(root: Path, write_run, wikitext_records, n: int = 200, seed: int = 3, nan_docs: tuple[int, ...] = (),
           **over) -> dict[str, np.ndarray]:  # noqa: ANN001  # fmt: skip
    docs = _docs(n, seed)
    docs["eng_ok"][list(nan_docs)] = np.nan  # an engine that returned NaN log-likelihoods for these documents
    for name in ("emu_bf16", "emu_fp8", "eng_bf16", "eng_ok", "eng_bad", "eng_noisy"):
        fmt = "bf16" if name.endswith("bf16") else "fp8_e4m3"
        kw = {"dtype": "bfloat16", "max_length": 8192, "task_configs": ROLLING, **over.get(name, {})}
        recs = wikitext_records(-docs[name] * docs["words"], docs["words"])
        write_run(root, name, fmt, {"wikitext": recs}, granularity=None if fmt == "bf16" else "tensor", **kw)
    return docs


def _conformance(root: Path, pairs: list[str], refs: list[str], margin: float | None = None):  # noqa: ANN202
    c = compare_runs([root], baseline="emu_bf16", n_boot=200, before_pairing=before_pairing(pairs, refs, margin))
    add_conformance(c, pairs, references=refs, margin=margin)
    return c


def test_equivalent_and_not_equivalent_damage(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    docs = _write(tmp_path, write_run, wikitext_records)
    c = _conformance(tmp_path, ["eng_bad=emu_fp8", "eng_ok=emu_fp8"], ["eng_bf16=emu_bf16"])
    bad, ok = c.conformance
    (rb,), (ro,) = bad.results, ok.results
    # the margin: the BF16 pair's mean per-document disagreement, stated
    r = docs["eng_bf16"] - docs["emu_bf16"]
    assert ro.margin == pytest.approx(np.mean(np.abs(r)), rel=1e-9) and ro.margin_source == "bf16 pair"
    assert ro.unit == "nats per word" and ro.n == 200
    # the damages as planted (positive: worse), the gap engine minus emulation
    assert ro.emulation_damage == pytest.approx(np.mean(docs["emu_fp8"] - docs["emu_bf16"]), rel=1e-9)
    assert rb.engine_damage == pytest.approx(np.mean(docs["eng_bad"] - docs["eng_bf16"]), rel=1e-9)
    assert rb.gap == pytest.approx(rb.engine_damage - rb.emulation_damage, rel=1e-9) and rb.gap > 0.015
    # TOST is statsmodels' on the per-document damages
    e_dmg, m_dmg = docs["eng_ok"] - docs["eng_bf16"], docs["emu_fp8"] - docs["emu_bf16"]
    assert ro.p_equivalence == pytest.approx(ttost_paired(e_dmg, m_dmg, -ro.margin, ro.margin)[0], rel=1e-9)
    assert ro.verdict == EQUIVALENT and ok.conforms is True and ok.verdict.startswith("equivalent:")
    assert rb.verdict == NOT_EQUIVALENT and bad.conforms is False and bad.verdict.startswith("not equivalent:")
    assert "nats per word" in bad.verdict and "margin ±" in bad.verdict
    assert not c.gate_passed
    md = render_markdown(c)
    assert "## Engine vs emulation" in md and "1 engine run(s) not equivalent to their emulation" in md
    assert "`eng_bf16` / `emu_bf16`" in md
    assert [x["conforms"] for x in c.to_dict()["conformance"]] == [False, True]


def test_non_finite_engine_scores_are_not_judged(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    """vLLM's CPU build returned NaN log-likelihoods for 2 of 20 wikitext documents with kv_cache_dtype_skip_layers
    (docs/studies/engine-conformance-smollm2.md): the damage test neither averages them (a NaN mean) nor drops them
    silently: the pair is not judged, naming the run and the documents, with the test on the finite samples."""
    _write(tmp_path, write_run, wikitext_records, nan_docs=(4, 15))
    c = _conformance(tmp_path, ["eng_ok=emu_fp8"], ["eng_bf16=emu_bf16"])
    (res,) = c.conformance
    (r,) = res.results
    assert res.conforms is None and res.verdict.startswith("not judged: wikitext")
    assert "eng_ok scored 2 of 200 samples non-finite (doc ids 4, 15)" in res.verdict
    assert r.n == 198 and np.isfinite(r.gap) and r.verdict == "not judged: non-finite samples"
    assert res.to_dict()["nonfinite"] and not c.gate_passed
    # compare's own gate row of that run says why it is not judged (not "the baseline is ~0")
    (row,) = [r for r in c.results if r.config == "eng_ok" and r.gated]
    assert "scored samples non-finite" in row.unjudged_reason and "~0" not in row.unjudged_reason


def test_underpowered_says_how_many_samples(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    _write(tmp_path, write_run, wikitext_records, n=12, seed=5)
    c = _conformance(tmp_path, ["eng_noisy=emu_fp8"], ["eng_bf16=emu_bf16"])
    (res,) = c.conformance
    (r,) = res.results
    assert r.verdict == NOT_SHOWN and res.conforms is None
    assert abs(r.gap) < 1e-12 and (r.ci_low < -r.margin or r.ci_high > r.margin)  # the interval is too wide
    assert r.n_needed is not None and r.n_needed > r.n
    assert f"about {r.n_needed} paired samples would show equivalence" in res.verdict
    assert not c.gate_passed  # not shown is not passed


def test_margin_option_decides(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    """--margin replaces the BF16 pair's margin: 0.05 nats per word takes in even the 2.5x damage."""
    _write(tmp_path, write_run, wikitext_records)
    c = _conformance(tmp_path, ["eng_bad=emu_fp8"], ["eng_bf16=emu_bf16"], margin=0.05)
    (r,) = c.conformance[0].results
    assert r.margin == 0.05 and r.margin_source == "--margin" and r.verdict == EQUIVALENT
    with pytest.raises(UsageError, match="--margin must be a positive number"):
        _conformance(tmp_path, ["eng_bad=emu_fp8"], ["eng_bf16=emu_bf16"], margin=-1.0)


def test_without_bf16_runs_no_verdict(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    _write(tmp_path, write_run, wikitext_records)
    c = _conformance(tmp_path, ["eng_ok=emu_fp8"], [])  # both sides kvcal run directories: not found
    (res,) = c.conformance
    assert res.conforms is None and res.results == [] and res.verdict.startswith("not judged: no verdict")
    assert "a BF16 run of the engine" in res.verdict and "a BF16 run of the emulation" in res.verdict
    assert not c.gate_passed
    with pytest.raises(UsageError, match="is a BF16 run"):
        _conformance(tmp_path, ["eng_bf16=emu_bf16"], [])


def test_unlike_configurations_are_refused_naming_each_difference(
    tmp_path: Path, write_run, wikitext_records, invoke: Invoke
) -> None:  # noqa: ANN001
    """The engine served bfloat16 with 2048-token windows, the emulation ran float32 with 8192 (issue 38's
    case): one Error naming the dtype, the log-prob dtype and the max length, each with its flag."""
    over = {"eng_ok": {"dtype": "bfloat16", "max_length": 2048}, "emu_fp8": {"dtype": "float32"}}
    _write(tmp_path, write_run, wikitext_records, **over)
    with pytest.raises(UsageError) as exc:
        _conformance(tmp_path, ["eng_ok=emu_fp8"], ["eng_bf16=emu_bf16"])
    msg = str(exc.value)
    runs = "eng_ok {}, emu_fp8 {}, eng_bf16 {}, emu_bf16 {}"
    assert msg.startswith("conformance compares like with like, and these runs differ in 3 setting(s): ")
    assert ("wikitext model dtype: " + runs.format("bfloat16", "float32", "bfloat16", "bfloat16")
            + " (serve and emulate one dtype: kvcal eval --dtype D") in msg  # fmt: skip
    assert ("wikitext log-prob dtype: " + runs.format("bfloat16", "float32", "bfloat16", "bfloat16")
            + " (kvcal eval --logprob-dtype float32") in msg  # fmt: skip
    assert "wikitext max length: " + runs.format(2048, 8192, 8192, 8192) + " (kvcal eval --max-length N" in msg
    assert "vLLM: max_model_len=N" in msg
    code, _, err = invoke(["compare", str(tmp_path), "--baseline", "emu_bf16", "--conformance", "eng_ok=emu_fp8",
                           "--conformance-bf16", "eng_bf16=emu_bf16"])  # fmt: skip
    assert code == 2 and err.count("Error:") == 1 and "max length" in err and "model dtype" in err


def test_cli_conformance(tmp_path: Path, write_run, wikitext_records, invoke: Invoke) -> None:  # noqa: ANN001
    _write(tmp_path, write_run, wikitext_records)
    base = ["compare", str(tmp_path), "--baseline", "emu_bf16", "--conformance-bf16", "eng_bf16=emu_bf16",
            "--max-drop", "0.05", "--fail-on-regression"]  # fmt: skip
    code, out, err = invoke([*base, "--conformance", "eng_ok=emu_fp8", "--json"])
    assert code == 0, err
    got = json.loads(out)["conformance"][0]
    assert got["conforms"] is True and got["results"][0]["verdict"] == EQUIVALENT
    code, _, err = invoke([*base, "--conformance", "eng_bad=emu_fp8"])
    assert code == 1 and "Engine vs emulation: eng_bad: not equivalent" in " ".join(err.split())
    code, _, err = invoke([*base, "--conformance", "nope=emu_fp8"])
    assert code == 2 and "write ENGINE=EMULATION" in err


def test_html_report_has_the_conformance_section(tmp_path: Path, write_run, wikitext_records, invoke: Invoke) -> None:  # noqa: ANN001
    _write(tmp_path / "runs", write_run, wikitext_records)
    page = tmp_path / "r.html"
    code, out, err = invoke(["compare", str(tmp_path / "runs"), "--baseline", "emu_bf16", "--conformance",
                             "eng_bad=emu_fp8", "--conformance", "eng_ok=emu_fp8", "--conformance-bf16",
                             "eng_bf16=emu_bf16", "--html", str(page), "--json", "--max-drop", "0.05"])  # fmt: skip
    assert code == 0, err
    text = page.read_text()
    assert "<h2>Engine vs emulation</h2>" in text
    assert "<b>NOT EQUIVALENT</b>: not equivalent: eng_bad" in text and "<b>EQUIVALENT</b>: equivalent:" in text
    pairs = json.loads(out)["conformance"]
    for pair in pairs:
        (r,) = pair["results"]
        assert f"{r['gap']:+.4g} [{r['ci_low']:.4g}, {r['ci_high']:.4g}]" in text
        assert f"±{r['margin']:.4g} (BF16 pair)" in text
    assert invoke(["compare", str(tmp_path / "runs"), "--baseline", "emu_bf16", "--html", str(page)])[0] == 0
    assert "Engine vs emulation" not in page.read_text()
