"""`kvcal eval`'s closing line: prefill speed always, decode speed and TPOT only where the run generated, labelled
as the emulator's speed on the device that ran it (metrics.json's timing, kvcal.evaluate.timing)."""

from __future__ import annotations

from kvcal.commands.evaluate import _metrics_line

BASE = {"peak_rss_bytes": 2**30, "bytes_per_token": 6480, "capacity_multiplier_vs_bf16": 3.56}


def test_scoring_run_shows_prefill_only() -> None:
    line = _metrics_line(
        {**BASE, "prefill_tokens_per_s": 812.5, "decode_tokens": 0, "decode_tokens_per_s": None, "tpot_s": None},
        {"device": "cpu", "processor": "x86_64", "gpu": None},
    )
    assert line.startswith("emulation on cpu x86_64: prefill 812.5 tokens/s · peak RSS 1.00 GiB")
    assert "decode" not in line and "TPOT" not in line and "wall" not in line


def test_generating_run_shows_decode_and_tpot() -> None:
    line = _metrics_line(
        {**BASE, "prefill_tokens_per_s": 900.0, "decode_tokens": 40, "decode_tokens_per_s": 12.5, "tpot_s": 0.08},
        {"device": "cuda:0", "gpu": "NVIDIA H200"},
    )
    assert line.startswith("emulation on NVIDIA H200: prefill 900 tokens/s · decode 12.5 tokens/s · TPOT 80.0 ms")
