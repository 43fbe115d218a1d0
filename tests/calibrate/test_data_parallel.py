"""`kvcal calibrate --num-processes 2` (torchrun, gloo on CPU, for real): each rank observes its share of the
samples, the observers' statistics are merged across the ranks (max of amax, sum of the histograms), and rank 0
writes a scale file whose scales equal one process's bit for bit (mse, per head: the observer that reads the
histograms' sums; minmax and percentile read amax and counts, tests/test_parallel.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal import parallel

ARGS = [
    "-f",
    "fp8_e4m3",
    "--granularity",
    "head",
    "--observer",
    "mse",
    "--num-samples",
    "5",
    "--seq-len",
    "24",
]


@pytest.mark.slow
def test_two_processes_write_the_one_process_scale_file(
    tiny_llama_dir: Path,
    tmp_path: Path,
    invoke: Callable[[list[str]], tuple[int, str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcal.scales import load_scale_file

    monkeypatch.setenv(parallel.TIMEOUT_ENV, "120")
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    code, _, err = invoke(["calibrate", str(tiny_llama_dir), *ARGS, "-o", str(one)])
    assert code == 0, err
    code, _, err = invoke(["calibrate", str(tiny_llama_dir), *ARGS, "-o", str(two), "--num-processes", "2"])
    assert code == 0, err
    a, b = load_scale_file(one), load_scale_file(two)
    assert len(a.k_scales) == 3 and a.k_scales[0].shape == (2,)  # 3 layers, 2 KV heads
    for x, y in zip(a.k_scales + a.v_scales, b.k_scales + b.v_scales, strict=True):
        assert torch.equal(x, y)
    assert len(a.layer_stats) == len(b.layer_stats)
    for ra, rb in zip(a.layer_stats, b.layer_stats, strict=True):
        assert ra.keys() == rb.keys()
        for key, value in ra.items():  # amax exact; SQNR / clipped fraction: sums in another order
            assert value == (pytest.approx(rb[key], rel=1e-9) if isinstance(value, float) else rb[key]), key
    ca, cb = a.manifest["calibration"], b.manifest["calibration"]
    assert ca["token_ids_sha256"] == cb["token_ids_sha256"] and ca["num_tokens"] == cb["num_tokens"]


def test_more_processes_than_samples_is_one_error_line(
    tmp_path: Path, invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    out = tmp_path / "s.safetensors"
    code, _, err = invoke(
        [
            "calibrate",
            "some-model",
            "-f",
            "fp8_e4m3",
            "--num-samples",
            "2",
            "-o",
            str(out),
            "--num-processes",
            "4",
        ]
    )
    assert code == 2 and err.strip().splitlines() == [
        "Error: 2 calibration samples (--num-samples) cannot be split over 4 processes; use --num-processes 2 "
        "or fewer, or more calibration samples (--num-samples)"
    ]
    assert not out.exists()


def test_engines_that_do_not_merge_refuse_several_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a rank (what torchrun sets), before any model loads."""
    from kvcal.calibrate.run import calibrate
    from kvcal.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(UsageError, match="--engine llmcompressor runs in one process"):
        calibrate("some-model", "fp8_e4m3", engine="llmcompressor", num_samples=4)
    with pytest.raises(UsageError, match="cannot be split over 2 processes"):
        calibrate("some-model", "fp8_e4m3", num_samples=1)
