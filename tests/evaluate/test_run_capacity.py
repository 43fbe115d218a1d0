"""A run's metrics.json counts its cache exactly as `kvcal capacity --json` does (one owner: kvcal.capacity),
including `auto` on a float32 checkpoint (16 bits: the dtype an engine serves it in) and skipped layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

CORPUS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight"]


@pytest.mark.parametrize(("kv_format", "skip"), [("auto", None), ("fp8_e4m3", "sliding_window")])
def test_metrics_json_equals_kvcal_capacity(
    tiny_lm_dir: Callable[..., Path],
    invoke: Callable[[list[str]], tuple[int, str, str]],
    tmp_path: Path,
    kv_format: str,
    skip: str | None,
) -> None:
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    model = tiny_lm_dir("gemma3", CORPUS)  # float32 weights; 2 sliding + 1 full layer
    run = run_eval(eval_spec(
        EvalConfig(
            model=str(model),
            kv_format=kv_format,
            skip_layers=skip,
            tasks=["kl"],
            limit=1,
            kl_seq_len=8,
            output=str(tmp_path / "run"),
        )
    ))
    metrics = json.loads((run / "metrics.json").read_text())
    args = ["capacity", str(model), "--kv-format", kv_format, "--json"] + (
        ["--skip-layers", skip] if skip else []
    )
    code, out, err = invoke(args)
    assert code == 0, err
    (row,) = json.loads(out)["formats"]
    assert metrics["bytes_per_token"] == row["bytes_per_token"]
    assert metrics["capacity_multiplier_vs_bf16"] == row["multiplier_vs_bf16"]
    assert metrics["bits_per_element"] == row["bits_per_element"]
    # 3 layers x K and V x 1 KV head x head_dim 16
    bf16 = 3 * 2 * 1 * 16 * 2
    assert metrics["bf16_bytes_per_token"] == bf16
    expected = bf16 if kv_format == "auto" else (2 * bf16 + bf16 / 2) / 3  # sliding layers stay 16-bit
    assert metrics["bytes_per_token"] == expected
