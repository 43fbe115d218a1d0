"""kvcal compare on long-context runs (issue 14): KL by position (curve, table, growth test), passkey heatmaps and
tables, and the context the capacity column assumes.

Run directories are written by tests/report/conftest.py's `write_run`, then given the results.json keys and
config.yaml fields of the contracts in the issue's schemas (`kl_by_position`, `passkey_by_cell`, kl_seq_len,
skip_layer_indices), as `kvcal eval` writes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

from kvcal.errors import UsageError
from kvcal.report import compare as cmpmod
from kvcal.report import html as html_report
from kvcal.report import longcontext as lc
from kvcal.report.html import render_html
from kvcal.report.markdown import render_markdown
from kvcal.report.plots import capacity_axis_label, kl_position_png
from kvcal.rundir import CONFIG, RESULTS

Invoke = Callable[[list[str]], tuple[int, str, str]]
SPANS = [(1, 512), (513, 1024), (1025, 2048), (2049, 4095)]
N_BOOT = 200


def _patch(run_dir: Path, results: dict[str, Any] | None = None, **config: Any) -> None:
    """Add top-level results.json keys and config.yaml fields to a run directory."""
    if results:
        res = json.loads((run_dir / RESULTS).read_text())
        res.update(results)
        (run_dir / RESULTS).write_text(json.dumps(res))
    if config:
        cfg = yaml.safe_load((run_dir / CONFIG).read_text())
        cfg.update(config)
        (run_dir / CONFIG).write_text(yaml.safe_dump(cfg))


def _kl_by_position(per_window: list[list[float]], seq_len: int = 4096) -> dict[str, Any]:
    """The `kl_by_position` key from per-bucket per-window KL means (buckets of SPANS[:len(per_window)]), every
    window holding the same tokens per bucket, so the bucket KL is the mean over windows."""
    n = len(per_window[0])
    buckets = []
    for (lo, hi), vals in zip(SPANS, per_window, strict=False):
        arr = np.asarray(vals, dtype=np.float64)
        buckets.append({
            "lo": lo, "hi": hi, "n_tokens": n * (hi - lo + 1), "kl": float(arr.mean()),
            "kl_stderr": float(arr.std(ddof=1) / np.sqrt(n)) if n > 1 else None,
            "top1_agree": 0.95, "top1_agree_stderr": None, "nll": 3.0, "nll_stderr": None,
            "per_window": {"kl": [float(v) for v in vals], "top1_agree": [0.95] * n, "nll": [3.0] * n},
        })  # fmt: skip
    return {"seq_len": seq_len, "prefill_chunk": 2048, "n_windows": n, "buckets": buckets}


def _kl_run(write_run, kl_records, root: Path, name: str, fmt: str, per_window, **kw: Any) -> Path:  # noqa: ANN001
    kl = np.full(12, 0.01 if fmt != "bf16" else 0.0)
    d = write_run(root, name, fmt, {"kl": kl_records(kl, np.ones(12))}, **kw)
    _patch(d, {"kl_by_position": _kl_by_position(per_window)}, kl_seq_len=4096)
    return d


# ---- KL by position -------------------------------------------------------------------------------------------

FLAT = [[0.005, 0.006, 0.004, 0.005], [0.005, 0.005, 0.005, 0.005], [0.005, 0.005, 0.006, 0.005],
        [0.006, 0.004, 0.005, 0.005]]  # fmt: skip
GROWING = [[0.010, 0.012, 0.011, 0.013], [0.015, 0.016, 0.015, 0.017], [0.020, 0.022, 0.021, 0.022],
           [0.031, 0.035, 0.030, 0.036]]  # fmt: skip


@pytest.fixture()
def position_runs(tmp_path: Path, write_run, kl_records) -> Path:  # noqa: ANN001
    _kl_run(write_run, kl_records, tmp_path, "m__bf16", "bf16", [[0.0] * 4] * 4)
    _kl_run(write_run, kl_records, tmp_path, "m__fp8", "fp8_e4m3", FLAT)
    _kl_run(write_run, kl_records, tmp_path, "m__nvfp4", "nvfp4", GROWING)
    return tmp_path


def test_kl_by_position_paired_test_of_last_vs_first_bucket(position_runs: Path) -> None:
    c = cmpmod.compare_runs([position_runs], n_boot=N_BOOT)
    curves = {p.config: p for p in c.positions}
    assert list(curves) == ["m__bf16", "m__fp8", "m__nvfp4"]
    grow = curves["m__nvfp4"].growth
    # the windows are the pairs: scipy's paired t test on the last vs the first bucket's per-window KL
    ref = sps.ttest_rel(GROWING[-1], GROWING[0])
    diffs = np.subtract(GROWING[-1], GROWING[0])
    assert grow.p_value == pytest.approx(ref.pvalue, rel=1e-12)
    assert grow.diff == pytest.approx(diffs.mean(), rel=1e-12)
    half = sps.t.ppf(0.975, 3) * diffs.std(ddof=1) / 2
    assert (grow.ci_low, grow.ci_high) == pytest.approx((diffs.mean() - half, diffs.mean() + half), rel=1e-9)
    # Holm over the three configurations tested (bf16's differences are all 0: p = 1)
    flat_p = sps.ttest_rel(FLAT[-1], FLAT[0]).pvalue
    holm = multipletests([1.0, flat_p, ref.pvalue], method="holm")[1]
    assert [curves[k].growth.p_adjusted for k in curves] == pytest.approx(list(holm), rel=1e-12)
    assert grow.verdict == lc.GROWS and grow.first == "1–512" and grow.last == "2049–4095"
    assert curves["m__fp8"].growth.verdict == lc.FLAT and curves["m__bf16"].growth.verdict == lc.FLAT
    # the same curves without multiple-testing correction: no adjusted p
    raw = cmpmod.compare_runs([position_runs], n_boot=N_BOOT, multiple_testing="none")
    assert all(p.growth.p_adjusted is None for p in raw.positions)


def test_kl_by_position_in_markdown_html_and_json(position_runs: Path) -> None:
    c = cmpmod.compare_runs([position_runs], n_boot=N_BOOT)
    md = render_markdown(c)
    assert "## KL by position" in md
    assert "| configuration | 1–512 | 513–1024 | 1025–2048 | 2049–4095 |" in md
    last = np.asarray(GROWING[-1])
    half = sps.t.ppf(0.975, 3) * last.std(ddof=1) / 2
    cell = f"{last.mean():.4g} [{last.mean() - half:.4g}, {last.mean() + half:.4g}]"
    section = md.split("## KL by position")[1]
    row = next(line for line in section.splitlines() if line.startswith("| `m__nvfp4` |"))
    assert row.rstrip(" |").endswith(cell)
    lines = {line.split("`")[1]: line for line in md.splitlines() if line.startswith("- `m__")}
    assert "the damage grows with position" in lines["m__nvfp4"]
    assert "paired t over 4 windows" in lines["m__nvfp4"]
    assert "no significant change with position" in lines["m__fp8"]
    assert "grows" not in lines["m__fp8"]
    html = render_html(c)
    assert (
        "<h2>KL by position</h2>" in html and "<img alt='KL by position' src='data:image/png;base64," in html
    )
    d = c.to_dict()
    assert [p["config"] for p in d["kl_by_position"]] == ["m__bf16", "m__fp8", "m__nvfp4"]
    assert d["kl_by_position"][2]["growth"]["verdict"] == "grows"
    # the windows' length is the evaluated context: the capacity column assumes it
    assert c.context == 4096 and "kl windows of 4096 tokens" in c.context_source
    assert "tokens vs BF16 @ 4k context" in md


def test_one_window_says_the_test_needs_two(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    _kl_run(write_run, kl_records, tmp_path, "m__bf16", "bf16", [[0.0]] * 4)
    _kl_run(write_run, kl_records, tmp_path, "m__fp8", "fp8_e4m3", [[0.01], [0.02], [0.03], [0.05]])
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    g = c.positions[1].growth
    assert g.verdict == lc.ONE_WINDOW and g.p_value is None
    md = render_markdown(c)
    assert "the paired test needs >= 2 windows (this run has 1)" in md
    assert "grows with position" not in md
    row = next(line for line in md.splitlines() if line.startswith("| `m__fp8` |"))
    assert "[" not in row  # no interval from one window


def test_subsampled_runs_say_which_positions_were_scored(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    for name, fmt, pw in (("m__bf16", "bf16", [[0.0, 0.0]] * 4), ("m__fp8", "fp8_e4m3", [[0.01, 0.02]] * 4)):
        d = _kl_run(write_run, kl_records, tmp_path, name, fmt, pw)
        res = json.loads((d / RESULTS).read_text())
        res["kl_by_position"]["subsample"] = 8
        (d / RESULTS).write_text(json.dumps(res))
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert {p.subsample for p in c.positions} == {8}
    assert "2 windows, every 8th position scored (--kl-subsample 8)" in render_markdown(c)


def test_runs_without_long_context_keys_keep_their_report(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    recs = kl_records(np.full(12, 0.01), np.ones(12))
    write_run(tmp_path, "m__bf16", "bf16", {"kl": recs})
    write_run(tmp_path, "m__fp8", "fp8_e4m3", {"kl": recs}, capacity=2.0)
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert c.positions == [] and c.passkey == [] and c.context is None
    md = render_markdown(c)
    assert "KL by position" not in md and "passkey" not in md and "@" not in md
    assert "| tokens vs BF16 | gate | verdict |" in md
    d = c.to_dict()
    assert not {"kl_by_position", "passkey_by_cell", "capacity_context"} & set(d)


def test_one_bucket_everywhere_skips_the_by_position_section(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    # windows of <= 512 tokens: one bucket per run, nothing to compare along positions
    _kl_run(write_run, kl_records, tmp_path, "m__bf16", "bf16", [[0.0] * 4])
    _kl_run(write_run, kl_records, tmp_path, "m__fp8", "fp8_e4m3", [FLAT[0]])
    _kl_run(write_run, kl_records, tmp_path, "m__nvfp4", "nvfp4", [GROWING[0]])
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert [len(p.buckets) for p in c.positions] == [1, 1, 1] and c.by_position == []
    md, page = render_markdown(c), render_html(c)
    assert "KL by position" not in md and "nothing to compare" not in md
    assert "KL by position" not in page and "nothing to compare" not in page
    assert kl_position_png(c) is None
    assert [p["config"] for p in c.to_dict()["kl_by_position"]] == [
        "m__bf16",
        "m__fp8",
        "m__nvfp4",
    ]  # JSON keeps them
    # one configuration with two buckets brings the section back, with every curve
    _kl_run(write_run, kl_records, tmp_path, "m__nvfp4", "nvfp4", GROWING[:2])
    c2 = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert len(c2.by_position) == 3 and "## KL by position" in render_markdown(c2)


def test_malformed_kl_by_position_is_left_out_with_a_warning(tmp_path: Path, write_run, kl_records) -> None:  # noqa: ANN001
    _kl_run(write_run, kl_records, tmp_path, "m__bf16", "bf16", [[0.0] * 3] * 2)
    d = _kl_run(write_run, kl_records, tmp_path, "m__fp8", "fp8_e4m3", [[0.01] * 3] * 2)
    bad = _kl_by_position([[0.01] * 3] * 2)
    bad["buckets"][1]["per_window"]["kl"] = [0.01]  # one value where 3 windows were measured
    _patch(d, {"kl_by_position": bad})
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert [p.config for p in c.positions] == ["m__bf16"]
    assert any("kl_by_position" in w and "malformed" in w for w in c.warnings)


# ---- passkey ----------------------------------------------------------------------------------------------------

LENGTHS = [1024, 2048, 8192]
DEPTHS = [0.0, 0.5, 1.0]


def _passkey_cells(acc: dict[int, list[float]]) -> list[dict[str, Any]]:
    return [{"length": ln, "depth": d, "n": 4, "acc": a, "acc_stderr": 0.1}
            for ln in LENGTHS for d, a in zip(DEPTHS, acc[ln], strict=True)]  # fmt: skip


def _passkey_run(write_run, root: Path, name: str, fmt: str, acc: dict[int, list[float]]) -> Path:  # noqa: ANN001
    recs = [{"doc_id": i, "filter": "none", "metrics": ["acc"], "acc": float(i % 2)} for i in range(36)]
    d = write_run(root, name, fmt, {"passkey_mc": recs})
    _patch(d, {"passkey_by_cell": {"passkey_mc": _passkey_cells(acc)}})
    return d


def test_passkey_by_cell_table_heatmap_and_context(tmp_path: Path, write_run) -> None:  # noqa: ANN001
    base = {1024: [1.0, 1.0, 1.0], 2048: [1.0, 0.75, 1.0], 8192: [0.5, 0.25, 0.75]}
    fp4 = {1024: [1.0, 0.75, 1.0], 2048: [0.5, 0.5, 0.75], 8192: [0.25, 0.0, 0.5]}
    _passkey_run(write_run, tmp_path, "m__bf16", "bf16", base)
    _passkey_run(write_run, tmp_path, "m__nvfp4", "nvfp4", fp4)
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert [(g.config, g.task) for g in c.passkey] == [("m__bf16", "passkey_mc"), ("m__nvfp4", "passkey_mc")]
    assert c.passkey[1].acc(2048, 0.5) == 0.5 and c.passkey[0].length_acc(2048) == pytest.approx(2.75 / 3)
    md = render_markdown(c)
    assert "## passkey_mc by length and depth" in md
    assert "| configuration | length | 0% | 50% | 100% | all |" in md
    assert "| `m__nvfp4` | 2k | 0.50 | 0.50 | 0.75 | 0.58 |" in md
    assert "| `m__bf16` | 8k | 0.50 | 0.25 | 0.75 | 0.50 |" in md
    # the baseline retrieves at 1k and 2k (>= 0.8 over all depths), not at 8k
    assert "Baseline `m__bf16` retrieves (>= 0.8 over every depth) at 1k, 2k; not at 8k." in md
    html = render_html(c)
    assert "<h2>passkey_mc by length and depth</h2>" in html
    assert "<img alt='passkey_mc heatmaps' src='data:image/png;base64," in html
    # the longest prompt is the evaluated context
    assert c.context == 8192 and "passkey prompts of 8192 tokens" in c.context_source
    assert c.to_dict()["passkey_by_cell"][1]["cells"][0] == {
        "length": 1024, "depth": 0.0, "acc": 1.0, "n": 4.0, "acc_stderr": 0.1,
    }  # fmt: skip


# ---- context-aware capacity -------------------------------------------------------------------------------------


SLIDING_IDX = [i for i in range(18) if i % 6 != 5]


@pytest.fixture()
def gemma_runs(tmp_path: Path, gemma_like: Path, write_run, kl_records) -> Path:  # noqa: ANN001
    model = str(gemma_like)
    runs = tmp_path / "runs"
    recs = kl_records(np.full(12, 0.01), np.ones(12))
    for name, fmt, skip in (("m__bf16", "bf16", ""), ("m__fp8__skip-sliding", "fp8_e4m3", "sliding_window"),
                            ("m__nvfp4__skip-sliding", "nvfp4", "sliding_window"), ("m__fp8", "fp8_e4m3", "")):  # fmt: skip
        d = write_run(runs, name, fmt, {"kl": recs}, model=model, skip=skip)
        _patch(d, skip_layer_indices=SLIDING_IDX if skip else [])
    return runs


def _caps(c: cmpmod.Comparison) -> dict[str, float | None]:
    return {k.label: k.capacity for k in c.configs}


def test_sliding_layers_count_at_min_context_window(gemma_runs: Path) -> None:
    # per layer and token: BF16 2 x 256 x 2 = 1024 bytes, FP8 512, NVFP4 2 x 256 x 4.5 / 8 = 288
    at512 = _caps(cmpmod.compare_runs([gemma_runs], n_boot=N_BOOT, context=512))
    # context 512 <= window: every layer holds every token: 18 x 1024 vs 15 x 1024 + 3 x 512 (or 3 x 288)
    assert at512["m__fp8__skip-sliding"] == pytest.approx(18 * 1024 / (15 * 1024 + 3 * 512), rel=1e-12)
    assert at512["m__nvfp4__skip-sliding"] == pytest.approx(18 * 1024 / (15 * 1024 + 3 * 288), rel=1e-12)
    assert at512["m__fp8"] == pytest.approx(2.0, rel=1e-12)
    c = cmpmod.compare_runs([gemma_runs], n_boot=N_BOOT, context=32768)
    at32k = _caps(c)
    # context 32768: a sliding layer holds 512 of every 32768 tokens (1/64): 240 bytes/token for the 15 of them
    sliding = 15 * 1024 * 512 / 32768
    assert at32k["m__fp8__skip-sliding"] == pytest.approx(
        (3 * 1024 + sliding) / (3 * 512 + sliding), rel=1e-12
    )
    assert at32k["m__nvfp4__skip-sliding"] == pytest.approx(
        (3 * 1024 + sliding) / (3 * 288 + sliding), rel=1e-12
    )
    assert at32k["m__nvfp4__skip-sliding"] == pytest.approx(3.0, rel=1e-12)
    assert at32k["m__fp8"] == pytest.approx(2.0, rel=1e-12)  # no skipped layer: the same at any context
    md = render_markdown(c)
    assert "| tokens vs BF16 @ 32k context |" in md and "| 1.86x |" in md
    assert "at 32768 tokens of context (--context)" in md
    assert capacity_axis_label(c) == "KV tokens that fit vs BF16 (x) @ 32k context"
    assert c.to_dict()["capacity_context"] == {"tokens": 32768, "source": "--context"}
    assert "<th>tokens vs BF16 @ 32k context</th>" in "".join(html_report._summary(c))


def test_default_context_is_the_longest_evaluated(gemma_runs: Path) -> None:
    # no context given, none evaluated: sliding layers in full (today's figures), and the report says so
    c = cmpmod.compare_runs([gemma_runs], n_boot=N_BOOT)
    assert c.context is None and c.sliding_layers is True
    assert _caps(c)["m__fp8__skip-sliding"] == pytest.approx(18 / 16.5, rel=1e-12)
    md = render_markdown(c)
    assert "no context given or evaluated: sliding-window layers are counted in full" in md
    assert "sliding layers in full" in capacity_axis_label(c)
    # the kl runs' windows (kl_seq_len) are the default context; the longest over the runs wins
    for d, n in zip(sorted(gemma_runs.iterdir()), (8192, 16384, 4096, 2048), strict=True):
        _patch(d, kl_seq_len=n)
    c = cmpmod.compare_runs([gemma_runs], n_boot=N_BOOT)
    assert (
        c.context == 16384
        and c.context_source == "the longest the runs evaluated: kl windows of 16384 tokens"
    )
    assert _caps(c) == _caps(cmpmod.compare_runs([gemma_runs], n_boot=N_BOOT, context=16384))


def test_context_must_be_positive(gemma_runs: Path) -> None:
    with pytest.raises(UsageError, match="--context must be a positive number of tokens"):
        cmpmod.compare_runs([gemma_runs], n_boot=N_BOOT, context=0)


def test_compare_cli_context(gemma_runs: Path, invoke: Invoke) -> None:
    code, out, err = invoke(
        ["compare", str(gemma_runs), "--context", "32768", "--json", "--bootstrap", "200"]
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["capacity_context"] == {"tokens": 32768, "source": "--context"}
    caps = {c["label"]: c["capacity_vs_bf16"] for c in d["configurations"]}
    assert caps["m__nvfp4__skip-sliding"] == pytest.approx(3.0, rel=1e-12)
    code, _, err = invoke(["compare", str(gemma_runs), "--context", "-5"])
    assert code == 2 and "Error: --context must be a positive number of tokens" in err
