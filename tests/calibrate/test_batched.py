"""Batched observation (`--batch-size N`): several samples of different lengths per forward, right-padded, give the
statistics and scales of one sample per forward — padding never reaches an observer, and the K/V of the real tokens
are bit for bit those of a batch-1 forward (attention runs row by row on each row's own length)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.calibrate.data import build_samples, load_texts
from kvcal.calibrate.hooks import batches, observe, pad_batch, unpad
from kvcal.calibrate.run import StatsCollector, calibrate
from kvcal.errors import UsageError
from kvcal.models.geometry import kv_spec
from kvcal.models.loading import load_model
from kvcal.pipeline.sensitivity import sensitivity

Invoke = Callable[[list[str]], tuple[int, str, str]]

pytestmark = pytest.mark.usefixtures("one_thread")

N, L = 7, 40


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset whose texts tokenize to very different lengths (2 to > L tokens): every batch holds padding."""
    from kvcal.calibrate.default_corpus import generate_corpus

    words = " ".join(generate_corpus(4, seed=3)).split()
    rows = [
        {"text": " ".join(words[i * 7 : i * 7 + n])} for i, n in enumerate([1, 30, 4, 12, 60, 2, 25, 8, 45])
    ]
    path = tmp_path_factory.mktemp("ragged") / "ragged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _stats(model: object, samples: list[torch.Tensor], layers: int, batch_size: int) -> StatsCollector:
    collector = StatsCollector()
    observe(model, samples, collector, layers, batch_size=batch_size)
    return collector


def test_pad_and_unpad_round_trip() -> None:
    samples = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([1, 2])]
    ids, lengths = pad_batch(samples)
    assert ids.tolist() == [[5, 6, 7], [9, 0, 0], [1, 2, 0]] and lengths == [3, 1, 2]
    x = torch.arange(3 * 2 * 3 * 4, dtype=torch.float32).reshape(3, 2, 3, 4)  # [B, H, T, D]
    packed = unpad(x, lengths)  # [1, H, 6, D]: row 0's 3 tokens, row 1's 1, row 2's 2
    assert packed.shape == (1, 2, 6, 4)
    assert torch.equal(packed[0, :, 3], x[1, :, 0]) and torch.equal(packed[0, :, 4:], x[2, :, :2])
    assert unpad(x, [3, 3, 3]) is x
    # longest first for batches > 1 (little padding); batch 1 keeps the order
    assert batches(samples, 2) == [[0, 2], [1]] and batches(samples, 1) == [[0], [1], [2]]
    with pytest.raises(UsageError, match="--batch-size must be at least 1"):
        batches(samples, 0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_batched_statistics_equal_batch_one(
    arch: str, tiny_model_dir: Callable[[str], Path], ragged: Path
) -> None:
    lm = load_model(tiny_model_dir(arch))
    kv = kv_spec(lm.model.config)
    data = build_samples(load_texts(str(ragged)), lm.tokenizer, N, L, seed=0)
    lengths = [s.numel() for s in data.samples]
    assert len(set(lengths)) >= 5 and max(lengths) == L  # ragged: every batch of 3 is padded
    one = _stats(lm.model, data.samples, kv.num_layers, 1)
    many = _stats(lm.model, data.samples, kv.num_layers, 3)
    assert lm.model.config._attn_implementation == "sdpa"  # restored after the row-wise forwards
    assert one.stats.keys() == many.stats.keys()
    for key, a in one.stats.items():
        b = many.stats[key]
        heads, d = a.heads, kv.layers[key[0]].head_dim
        # padding never counted: exactly the real tokens' elements, per head
        assert b.count.sum(1).tolist() == [float(data.num_tokens * d)] * heads
        assert torch.equal(a.amax, b.amax), key  # bit-exact: the real tokens' K/V are batch-1's
        assert torch.equal(a.count, b.count), key  # every element lands in the same histogram bin
        # float64 sums of the same values in another order
        torch.testing.assert_close(b.sum1, a.sum1, rtol=1e-12, atol=0)
        torch.testing.assert_close(b.sum2, a.sum2, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("fmt", "observer", "granularity"),
    [("fp8_e4m3", "minmax", "head"), ("fp8_e4m3", "percentile", "tensor"), ("fp8_e4m3", "mse", "head"),
     ("nvfp4", "mse", "tensor")],
)  # fmt: skip
def test_calibrated_scales_equal_batch_one(
    fmt: str, observer: str, granularity: str, tiny_llama_dir: Path, ragged: Path
) -> None:
    lm = load_model(tiny_llama_dir)
    runs = [
        calibrate(
            lm, fmt, granularity=granularity, observer=observer, dataset=str(ragged), num_samples=N, seq_len=L,
            batch_size=bs,
        ).scale_set
        for bs in (1, 4)
    ]  # fmt: skip
    one, many = runs
    for a, b in zip(one.k_scales + one.v_scales, many.k_scales + many.v_scales, strict=True):
        assert torch.equal(a, b)  # minmax, percentile (counts only) exactly; mse's argmin lands alike
    assert many.manifest["calibration"]["batch_size"] == 4
    assert "batch_size" not in one.manifest["calibration"]
    for ra, rb in zip(one.layer_stats, many.layer_stats, strict=True):
        for k in ("k_sqnr_db", "v_sqnr_db", "k_clipped_fraction", "v_clipped_fraction"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-9, abs=1e-12)


def test_batched_sensitivity_equals_batch_one(tiny_llama_dir: Path, ragged: Path) -> None:
    lm = load_model(tiny_llama_dir)
    reports = [
        sensitivity(lm, "fp8_e4m3", dataset=str(ragged), num_samples=5, seq_len=L, batch_size=bs)
        for bs in (1, 3)
    ]
    one, many = reports
    assert [r["kl"] for r in many["layers"]] == [r["kl"] for r in one["layers"]]
    assert [r["top1_agree"] for r in many["layers"]] == [r["top1_agree"] for r in one["layers"]]
    assert many["all_layers"] == one["all_layers"] and one["all_layers"]["kl"] > 0


def test_batch_size_zero_is_one_error_line(invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path) -> None:
    code, out, err = invoke(
        [
            "calibrate",
            str(tiny_llama_dir),
            "-f",
            "fp8",
            "-o",
            str(tmp_path / "s.safetensors"),
            "--batch-size",
            "0",
        ]
    )
    assert code == 2 and "Error: --batch-size must be at least 1, got 0" in err
    assert not (tmp_path / "s.safetensors").exists()
