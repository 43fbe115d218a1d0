"""The report's speed section (kvcal.report.speed): kvcal's emulation speed, prefill and decode apart, shown only
for runs timed on the baseline's device and host, labelled as emulation, never as serving throughput.

Run directories come from tests/report/conftest.py's `write_run`, then get the metrics.json timing fields and the
env.json that `kvcal eval` writes (docs/run-directory.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcal.report import compare as cmpmod
from kvcal.report.html import render_html
from kvcal.report.markdown import render_markdown
from kvcal.rundir import ENV, METRICS

N_BOOT = 200
HEADING = "Emulation speed on cpu on host-a (not serving throughput)"


def _timing(prefill: float, decode: float, ttft: float, tpot: float) -> dict[str, Any]:
    return {
        "prefill_tokens_per_s": prefill,
        "ttft_s_median": ttft,
        "decode_tokens_per_s": decode,
        "tpot_s": tpot,
    }


def _timed(
    d: Path, per_task: dict[str, dict[str, Any]], host: str | None = "host-a", device: str = "cpu"
) -> Path:
    """Give a run directory metrics.json's per-task timing and an env.json (host None: an older kvcal's)."""
    metrics = json.loads((d / METRICS).read_text())
    metrics["tokens_per_s"] = 1000.0  # a whole run's emulation wall-time rate: never shown
    metrics["per_task"] = per_task
    (d / METRICS).write_text(json.dumps(metrics))
    env = {"device": device, "gpu": None, "platform": "Linux"}
    if host is not None:
        env["host"] = host
    (d / ENV).write_text(json.dumps(env))
    return d


@pytest.fixture()
def records(gsm8k_records, kl_records) -> dict[str, list[dict]]:  # noqa: ANN001
    return {"gsm8k": gsm8k_records(np.ones(20)), "kl": kl_records(np.full(20, 0.01), np.ones(20))}


def test_side_by_side_runs_show_prefill_and_decode_apart(tmp_path: Path, write_run, records) -> None:  # noqa: ANN001
    base = write_run(tmp_path, "m__bf16", "bf16", records)
    fp8 = write_run(tmp_path, "m__fp8", "fp8_e4m3", records, capacity=2.0)
    kl = _timing(5000.0, 0.0, 0.0, 0.0)
    _timed(base, {"gsm8k": _timing(400.0, 20.0, 0.125, 0.05), "kl": kl})
    _timed(fp8, {"gsm8k": _timing(300.0, 25.0, 22.283, 0.04), "kl": kl})
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert c.speed is not None and c.speed.device == "cpu on host-a"
    rows = {(r.task, r.config): r for r in c.speed.rows}
    assert set(rows) == {
        ("gsm8k", "m__bf16"),
        ("gsm8k", "m__fp8"),
    }  # kl left out: its BF16 reference runs too
    r = rows[("gsm8k", "m__fp8")]
    assert (r.prefill_vs_baseline, r.decode_vs_baseline) == (0.75, 1.25)
    assert rows[("gsm8k", "m__bf16")].prefill_vs_baseline == 1.0
    assert any(w.startswith("kl:") for w in c.speed.left_out)
    md = render_markdown(c)
    assert f"## {HEADING}" in md and "not controlled" in md
    row = next(line for line in md.splitlines() if line.startswith("| gsm8k | `m__fp8` |"))
    assert row == "| gsm8k | `m__fp8` | 300 | 0.75x | 22.28 s | 25 | 1.25x | 40 ms |"
    summary = md.split("## Summary")[1].split("\n## ")[0]
    assert "throughput" not in summary and "speed" not in summary
    assert "| configuration | kv format | scales | skip layers | tokens vs BF16 | gate | verdict |" in summary
    page = render_html(c)
    assert f"<h2>{HEADING}</h2>" in page and "<td>0.75x</td>" in page and "throughput vs baseline" not in page
    d = c.to_dict()
    assert d["emulation_speed"]["what"].startswith(
        "emulation speed on cpu on host-a (not serving throughput)"
    )
    assert not {"tokens_per_s", "throughput_vs_baseline"} & set(d["configurations"][1])


def test_runs_from_another_host_or_device_are_not_compared(tmp_path: Path, write_run, records) -> None:  # noqa: ANN001
    base = write_run(tmp_path, "m__bf16", "bf16", records)
    fp8 = write_run(tmp_path, "m__fp8", "fp8_e4m3", records)
    nv = write_run(tmp_path, "m__nvfp4", "nvfp4", records)
    t = {"gsm8k": _timing(400.0, 20.0, 0.125, 0.05)}
    _timed(base, t)
    _timed(fp8, t, host="host-b")
    _timed(nv, t, device="cuda:0")
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert c.speed is None  # nothing beside the baseline was timed where it was
    md = render_markdown(c)
    assert "Emulation speed" not in md and "throughput" not in md and "emulation_speed" not in c.to_dict()
    # one comparable configuration: shown, and the others are named with the reason
    _timed(nv, t)
    c2 = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert c2.speed is not None and [r.config for r in c2.speed.rows] == ["m__bf16", "m__nvfp4"]
    assert [w for w in c2.speed.left_out if not w.startswith("kl:")] == [
        "gsm8k · m__fp8: timed on cpu on host-b, the baseline on cpu on host-a"
    ]
    assert "- gsm8k · m__fp8: timed on cpu on host-b, the baseline on cpu on host-a" in render_markdown(c2)


def test_runs_without_timing_or_host_show_no_speed(tmp_path: Path, write_run, records) -> None:  # noqa: ANN001
    write_run(tmp_path, "m__bf16", "bf16", records)  # metrics.json with tokens_per_s only, no env.json
    fp8 = write_run(tmp_path, "m__fp8", "fp8_e4m3", records)
    _timed(fp8, {"gsm8k": _timing(300.0, 25.0, 0.25, 0.04)}, host=None)
    c = cmpmod.compare_runs([tmp_path], n_boot=N_BOOT)
    assert c.speed is None
    md = render_markdown(c)
    assert "Emulation speed" not in md and "emulation speed" not in md and "throughput" not in md
