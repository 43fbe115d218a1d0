"""Long kl windows: chunked prefill through the quantized cache, the baseline in lockstep, and `kl_by_position`.

A window longer than --prefill-chunk runs chunk by chunk, each chunk one forward that attends to the (quantized)
K/V of every earlier chunk; the result must not depend on the chunk size beyond float rounding, and with one chunk
it is the single-pass result. The position buckets of results.json must add up to the window totals.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvcal.evaluate.kl import (
    cached_stats,
    lm_sides,
    lockstep_stats,
    make_windows,
    position_buckets,
    run_kl,
)

pytestmark = pytest.mark.usefixtures("one_thread")

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "a quick brown fox jumps over the lazy dog near the river bank",
]


def _lm(model_dir: Path, kv_format: str, kv_input_dtype: str | None = "float32") -> Any:
    from kvcal.evaluate.adapter import KvcalLM

    return KvcalLM(
        pretrained=str(model_dir),
        kv_format=kv_format,
        dtype="float32",
        device="cpu",
        kv_input_dtype=kv_input_dtype,
    )


def _run(
    lm: Any, cache: Path, *, seq_len: int, chunk: int, limit: int, subsample: int = 1
) -> tuple[dict[str, Any], list[dict]]:
    quant_session, baseline = lm_sides(lm, "auto")
    return run_kl(
        lm.model,
        lm.tokenizer,
        quant_session=quant_session,
        baseline=baseline,
        baseline_desc={"kv_format": "bf16", "attention": "kvcal", "test": "kl_long"},
        evaluated_desc={"kv_format": lm.kv_format},
        model_dir=lm.model_dir,
        data_dir=None,
        limit=limit,
        seq_len=seq_len,
        prefill_chunk=chunk,
        subsample=subsample,
        cache_dir=cache,
    )


@pytest.fixture(scope="module")
def gemma(tiny_lm_dir: Callable[..., Path]) -> Path:
    # sliding layers of window 6: chunks cross the window, so trimming happens between chunks too
    return tiny_lm_dir("gemma3", CORPUS, k_gain=8.0)


@pytest.fixture(scope="module")
def long_llama(tiny_lm_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 1200 positions (RoPE has no learned positions): windows that reach a third bucket."""
    path = tmp_path_factory.mktemp("long-llama") / "llama"
    shutil.copytree(tiny_lm_dir("llama", CORPUS, k_gain=8.0), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 1200
    (path / "config.json").write_text(json.dumps(cfg))
    return path


STATS = ("kl", "top1_agree", "nll")  # the per-position statistics of cached_stats / lockstep_stats, in order


def _max_gap(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """metric -> max |a - b| over the positions of two runs' per-position statistics."""
    return {m: float((x - y).abs().max()) for m, x, y in zip(STATS, a, b, strict=True)}


def _flips(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> int:
    """Positions whose top-1 agreement differs between two runs."""
    return int((a[1] != b[1]).sum())


def test_one_chunk_is_the_single_pass(
    gemma: Path, tmp_path: Path, batch_bound: Callable[[float, float, float], float]
) -> None:
    """Lockstep with one chunk covering the window == the disk-cached single pass, per position, up to float
    rounding: the single pass runs all 48 tokens, the chunk the 47 that predict one (other matmul shapes), which
    fp8 codes of the later layers may amplify on another CPU. So per-position KL and NLL are held to
    `batch_bound`, derived here from the same comparison through BF16 and auto caches and fp8_e4m3's response to
    BF16 rounding of its K/V input; top-1 agreement may flip at one position (a near-tie of two float16
    log-probs), or at as many as that response flips."""
    from kvcal.evaluate.kl import EMBEDDED_TEXT

    single, one_chunk = {}, {}
    for name, fmt, kin in (
        ("fmt", "fp8_e4m3", None),
        ("fmt_bf16_input", "fp8_e4m3", "bfloat16"),
        ("bf16", "bf16", None),
        ("auto", "auto", None),
    ):
        lm = _lm(gemma, fmt, kin)
        quant_session, baseline = lm_sides(lm, "auto")
        windows, _ = make_windows(lm.tokenizer, EMBEDDED_TEXT, 48, 1, None)
        ids = torch.tensor(windows[:1])
        single[name] = cached_stats(quant_session, baseline, ids, name.ljust(64, "k"), tmp_path)
        one_chunk[name] = lockstep_stats(quant_session, baseline, ids, 48)
    response = _max_gap(single["fmt"], single["fmt_bf16_input"])
    bf16_error = _max_gap(single["bf16"], single["auto"])
    base = {m: max(_max_gap(single[n], one_chunk[n])[m] for n in ("bf16", "auto")) for m in ("kl", "nll")}
    gaps = _max_gap(single["fmt"], one_chunk["fmt"])
    for m in ("kl", "nll"):
        assert gaps[m] <= batch_bound(response[m], base[m], bf16_error[m]), (m, gaps[m])
    # top-1: one near-tie, or as many as the response itself flips
    flips = max(1, _flips(single["fmt"], single["fmt_bf16_input"]))
    assert _flips(single["fmt"], one_chunk["fmt"]) <= flips
    assert all(a.shape == (47,) for a in single["fmt"] + one_chunk["fmt"])
    assert float(single["fmt"][0].mean()) > 0  # not vacuous: the fp8 cache moves the distributions


CHUNKS = (72, 1, 7, 64)  # the whole window (the single pass) first, then chunks of 1, 7, 64 tokens


def _by_chunk(lm: Any, cache: Path) -> dict[int, tuple[dict[str, Any], dict]]:
    """chunk -> (results, the one window's sample record) of a 72-token kl window run chunk by chunk."""
    out = {}
    for chunk in CHUNKS:
        res, (sample,) = _run(lm, cache, seq_len=CHUNKS[0], chunk=chunk, limit=1)
        out[chunk] = (res, sample)
    return out


@pytest.mark.parametrize(
    ("arch", "kv_format"), [("gemma", "fp8_e4m3"), ("gemma", "nvfp4"), ("llama", "auto")]
)
def test_chunk_size_does_not_change_kl(
    arch: str,
    kv_format: str,
    gemma: Path,
    long_llama: Path,
    tmp_path: Path,
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """Chunks of 1, 7, 64 tokens and the whole window: the same KL, top-1 and NLL up to float rounding. 'auto'
    swaps the attention implementation for the baseline at every chunk (its cache survives the swaps).

    Another chunking is another set of matmul shapes: float32 rounding that FP4/FP8 codes of the later layers may
    amplify on another CPU. So a quantized format's KL and NLL are held to `batch_bound`, derived here from the
    same chunk comparison through BF16 and float32 caches and the format's response to BF16 rounding of its K/V
    input; 'auto' (float32 all through) to a relative 1e-5 of its NLL; top-1 agreement to one token's flip."""
    model_dir = gemma if arch == "gemma" else long_llama
    seq = CHUNKS[0]
    runs = {"fmt": _by_chunk(_lm(model_dir, kv_format), tmp_path / "c")}
    single = runs["fmt"][seq][0]
    assert single["kl_by_position"]["prefill_chunk"] == seq and "prefill_chunk" not in single["configs"]["kl"]
    for chunk, (res, sample) in runs["fmt"].items():
        assert sample["n_tokens"] == seq - 1
        assert res["kl_by_position"]["prefill_chunk"] == chunk
        if chunk != seq:
            assert (
                res["configs"]["kl"]["prefill_chunk"] == chunk
                and res["configs"]["kl"]["baseline_cache_hits"] == 0
            )
    if kv_format == "auto":
        bounds = {"kl": max(1e-3 * runs["fmt"][seq][1]["kl"], 1e-7), "nll": 1e-5 * runs["fmt"][seq][1]["nll"]}
    else:
        res, (sample,) = _run(
            _lm(model_dir, kv_format, "bfloat16"), tmp_path / "c", seq_len=seq, chunk=seq, limit=1
        )
        runs["fmt_bf16_input"] = {seq: (res, sample)}  # the single pass only: its response to BF16 rounding
        runs["bf16"] = _by_chunk(_lm(model_dir, "bf16"), tmp_path / "c")
        runs["auto"] = _by_chunk(_lm(model_dir, "auto"), tmp_path / "c")

        def chunk_gap(name: str, metric: str) -> float:  # the most a chunking moves `metric` of run `name`
            return max(abs(s[metric] - runs[name][seq][1][metric]) for _, s in runs[name].values())

        def gap(a: str, b: str, metric: str) -> float:  # two runs' single passes
            return abs(runs[a][seq][1][metric] - runs[b][seq][1][metric])

        bounds = {
            m: batch_bound(
                gap("fmt", "fmt_bf16_input", m),
                max(chunk_gap("bf16", m), chunk_gap("auto", m)),
                gap("bf16", "auto", m),
            )
            for m in ("kl", "nll")
        }
    want = runs["fmt"][seq][1]
    for chunk, (_, sample) in runs["fmt"].items():
        for metric, bound in bounds.items():
            assert abs(sample[metric] - want[metric]) <= bound, (chunk, metric, bound)
        assert sample["top1_agree"] == pytest.approx(want["top1_agree"], abs=1.5 / (seq - 1))
    if kv_format != "auto":  # quantization moved something (auto's KL is the attention implementations')
        assert single["results"]["kl"]["kl,none"] > max(1e-5, bounds["kl"])


def test_buckets_add_up_to_the_window_totals(long_llama: Path, tmp_path: Path) -> None:
    lm = _lm(long_llama, "fp8_e4m3")
    res, samples = _run(lm, tmp_path / "c", seq_len=1100, chunk=400, limit=2)
    byp = res["kl_by_position"]
    assert (byp["seq_len"], byp["prefill_chunk"], byp["n_windows"]) == (1100, 400, 2)
    assert [(b["lo"], b["hi"]) for b in byp["buckets"]] == [(1, 512), (513, 1024), (1025, 1099)]
    assert [b["n_tokens"] for b in byp["buckets"]] == [1024, 1024, 150]
    tokens = sum(s["n_tokens"] for s in samples)
    assert tokens == sum(b["n_tokens"] for b in byp["buckets"])
    totals = res["results"]["kl"]
    for metric, total in (
        ("kl", totals["kl,none"]),
        ("top1_agree", totals["top1_agree,none"]),
        ("nll", math.log(totals["ppl,none"])),
    ):
        assert sum(b[metric] * b["n_tokens"] for b in byp["buckets"]) == pytest.approx(
            total * tokens, rel=1e-5
        )
        for b in byp["buckets"]:
            per_window = b["per_window"][metric]
            assert len(per_window) == 2 and b[metric] == pytest.approx(sum(per_window) / 2)
            assert b[f"{metric}_stderr"] == pytest.approx(abs(per_window[0] - per_window[1]) / 2)
    # per window too: the bucket means weighted by their sizes are the window's sample record
    for w, s in enumerate(samples):
        kl_sum = sum(b["per_window"]["kl"][w] * b["n_tokens"] / 2 for b in byp["buckets"])
        assert kl_sum == pytest.approx(s["kl"] * s["n_tokens"], rel=1e-5)
    # one window: no spread to measure
    one, _ = _run(lm, tmp_path / "c", seq_len=1100, chunk=400, limit=1)
    assert all(b["kl_stderr"] is None for b in one["kl_by_position"]["buckets"])


def test_position_buckets() -> None:
    assert position_buckets(1) == [(1, 1)]
    assert position_buckets(511) == [(1, 511)]
    assert position_buckets(512) == [(1, 512)]
    assert position_buckets(513) == [(1, 512), (513, 513)]
    assert position_buckets(32767) == [
        (1, 512), (513, 1024), (1025, 2048), (2049, 4096), (4097, 8192), (8193, 16384), (16385, 32767),
    ]  # fmt: skip


# ---- through kvcal eval --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCAL_CACHE", str(tmp_path_factory.mktemp("kvcal_cache")))
        yield


@pytest.mark.usefixtures("fresh_cache")
def test_eval_records_chunk_only_when_windows_are_chunked(gemma: Path, tmp_path: Path) -> None:
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    def run(name: str, **kw: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        out = run_eval(eval_spec(EvalConfig(model=str(gemma), kv_format="fp8_e4m3", tasks=["kl"], limit=2,
                                  output=str(tmp_path / name), **kw)))  # fmt: skip
        results = json.loads((out / "results.json").read_text())
        part = json.loads((out / "tasks" / "kl.json").read_text())
        return yaml.safe_load((out / "config.yaml").read_text()), results, part

    cfg, results, part = run("short", kl_seq_len=32)
    assert "prefill_chunk" not in cfg  # a window that fits one chunk: the run's identity is today's
    assert results["kl_by_position"] == part["kl_by_position"]
    assert results["kl_by_position"]["prefill_chunk"] == 32 and results["kl_by_position"]["n_windows"] == 2
    cfg, results, _ = run("chunked", kl_seq_len=32, prefill_chunk=8)
    assert cfg["prefill_chunk"] == 8 and results["kl_by_position"]["prefill_chunk"] == 8
    assert results["configs"]["kl"]["prefill_chunk"] == 8


def test_bad_chunk_and_windows_the_text_cannot_fill(invoke: Invoke, gemma: Path, tmp_path: Path) -> None:
    def refused(*extra: str) -> str:
        code, _out, err = invoke(["eval", str(gemma), "--kv-format", "fp8_e4m3", "--tasks", "kl",
                                  "-o", str(tmp_path / "run"), *extra])  # fmt: skip
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), err
        return lines[0]

    assert "--prefill-chunk" in refused("--prefill-chunk", "0") and not (tmp_path / "run").exists()
    assert "at least 1" in refused("--prefill-chunk", "-5")
    assert "256 positions" in refused("--kl-seq-len", "257", "--prefill-chunk", "64")


@pytest.fixture(scope="module")
def long_gemma(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 (sliding layers of window 6) with 1200 positions: chunks longer than a decode step."""
    path = tmp_path_factory.mktemp("long-gemma") / "gemma3"
    shutil.copytree(gemma, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 1200
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_prefill_chunks_keep_no_workspace_and_the_statistics_stay(
    long_gemma: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of more than `fast.WORKSPACE_MAX_QUERIES` tokens read their context through a temporary of one layer
    instead of keeping every layer's float32 K/V in the caches' workspaces (at 8k tokens of SmolLM2, 377 MB per
    cache, two caches in kl). Dequantization is elementwise and exact, so the per-position statistics are those of
    a run whose every read keeps its values (the behaviour before), bit for bit, on both sides: the nvfp4 cache and
    the BF16 baseline's cache, sliding and full layers; and afterwards no workspace of either holds a value."""
    from kvcal.evaluate.kl import EMBEDDED_TEXT
    from kvcal.kernels import fast
    from kvcal.kernels.cache import QuantizedKVCache

    made: list[QuantizedKVCache] = []
    init = QuantizedKVCache.__init__

    def recorded(self: QuantizedKVCache, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(QuantizedKVCache, "__init__", recorded)

    chunk = fast.WORKSPACE_MAX_QUERIES + 9  # longer than a decode-sized read

    def run() -> tuple[tuple[torch.Tensor, ...], int]:
        """(statistics of a window of 3 long chunks, bytes the workspaces of its caches hold afterwards)"""
        made.clear()
        lm = _lm(long_gemma, "nvfp4")
        quant_session, baseline = lm_sides(lm, "auto")
        ids = torch.tensor(make_windows(lm.tokenizer, EMBEDDED_TEXT, 3 * chunk + 1, 1, None)[0][:1])
        stats = lockstep_stats(quant_session, baseline, ids, chunk)
        held = sum(
            side.workspace.values.data.nbytes
            for cache in made
            for layer in cache.layers
            for side in layer._sides.values()
            if side.workspace.values.data is not None
        )
        assert len(made) == 2  # the evaluated cache and the baseline's
        return stats, held

    stats, held = run()
    assert held == 0
    monkeypatch.setattr(fast, "WORKSPACE_MAX_QUERIES", 1 << 30)  # every read keeps its values
    kept_stats, kept = run()
    assert kept > 0
    for a, b in zip(stats, kept_stats, strict=True):
        assert torch.equal(a, b)
    assert float(stats[0].mean()) > 0


def test_bf16_evaluates_the_baseline_in_one_pass(gemma: Path) -> None:
    """`-f bf16` is the baseline itself: chunked windows run its forwards once, and the statistics equal the
    two-sided lockstep bit for bit (KL ~0 from the fp16-stored baseline only; top-1 agreement exactly 1)."""
    from kvcal.evaluate.kl import EMBEDDED_TEXT

    lm = _lm(gemma, "bf16")
    quant_session, baseline = lm_sides(lm, "auto")
    assert getattr(baseline, "same_as_evaluated", False)
    ids = torch.tensor(make_windows(lm.tokenizer, EMBEDDED_TEXT, 40, 1, None)[0][:1])
    calls = {"n": 0}

    def counted() -> object:
        forward = quant_session()

        def run(piece: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            return forward(piece)

        return run

    once = lockstep_stats(counted, baseline, ids, 8)
    assert calls["n"] == 5  # 39 predicting tokens in chunks of 8, evaluated side only
    baseline.same_as_evaluated = False  # the general path: a second cache of BF16 plans beside it
    twice = lockstep_stats(quant_session, baseline, ids, 8)
    for a, b in zip(once, twice, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(once[1], torch.ones(39))
    assert not getattr(lm_sides(_lm(gemma, "fp8_e4m3"), "auto")[1], "same_as_evaluated", False)


def test_statistics_do_not_depend_on_the_row_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """token_stats works a block of rows at a time (_STATS_BUDGET elements) to keep its temporaries small; every
    statistic is row-wise, so the block size changes nothing, bit for bit (inf logits and a tied argmax too)."""
    import kvcal.evaluate.kl as kl

    g = torch.Generator().manual_seed(0)
    n, vocab = 37, 1000
    base = torch.randn(n, vocab, generator=g) * 4
    quant = base + 0.3 * torch.randn(n, vocab, generator=g)
    base[3, 7] = -math.inf
    quant[5, :] = 1.0  # a tie: argmax picks the first
    targets = torch.randint(0, vocab, (n,), generator=g)
    results = []
    for budget in (1, vocab * 5, 1 << 24):
        monkeypatch.setattr(kl, "_STATS_BUDGET", budget)
        base_lp16 = kl._fp16_logprobs_blocked(base)
        results.append((base_lp16, *kl.token_stats(base_lp16, quant, targets)))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    assert results[0][0].dtype == torch.float16 and results[0][1].shape == (n,)


def _stored_bytes(cache: Any) -> list[bytes]:
    """Every layer's stored K and V (codes, block scales, scale) as bytes."""
    out = []
    for layer in cache.layers:
        for q in (layer.k, layer.v):
            for t in (q.codes, q.block_scales, q.scale):
                if t is not None:
                    out.append(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize(("seq", "chunk"), [(72, 72), (72, 7), (72, 5)])
def test_subsample_scores_every_nth_position_of_the_full_run(
    gemma: Path, tmp_path: Path, seq: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kl-subsample N: the statistics at positions 0, N, 2N, ... equal the full run's there, single pass and
    chunked (chunks of 7 and 5 start off the grid of N = 4); buckets count the scored positions; the task config
    records N.

    Exact: every token still goes through the cache, so the nvfp4 cache ends holding the same bytes (codes, block
    scales, globals) with and without subsampling: the body runs the same shapes, only the LM head sees fewer
    rows. That LM head's float32 rounding, with the float16 log-probs the statistics are made of, moves KL and NLL
    by less than a perturbation of the whole K/V does: they are held to nvfp4's response to BF16 rounding of its
    K/V input, measured here on the same window and chunks (a perturbation that moves the logits by float16 steps
    and more, where the LM head's rounding moves each float16 log-prob to its neighbour at most); top-1 agreement
    may flip at one position (a near-tie of two float16 log-probs), or at as many as that response flips."""
    from kvcal.evaluate.kl import EMBEDDED_TEXT, scored_positions

    def stats(kv_input_dtype: str | None, subsample: int) -> tuple[tuple[torch.Tensor, ...], list[Any]]:
        """The per-position statistics of one run and the quantized caches it used."""
        lm = _lm(gemma, "nvfp4", kv_input_dtype)
        caches: list[Any] = []
        new_cache = lm.runtime.new_cache
        monkeypatch.setattr(lm.runtime, "new_cache", lambda: caches.append(new_cache()) or caches[-1])
        quant_session, baseline = lm_sides(lm, "auto")
        windows, _ = make_windows(lm.tokenizer, EMBEDDED_TEXT, seq, 1, None)
        ids = torch.tensor(windows[:1])
        if chunk == seq:
            key = (kv_input_dtype or "s").ljust(64, "s")
            return cached_stats(quant_session, baseline, ids, key, tmp_path, subsample=subsample), caches
        return lockstep_stats(quant_session, baseline, ids, chunk, subsample=subsample), caches

    (full, full_caches), (sub, sub_caches) = stats(None, 1), stats(None, 4)
    bf16_input, _ = stats("bfloat16", 1)
    pos = scored_positions(seq - 1, 4)
    assert pos.tolist() == list(range(0, seq - 1, 4))
    assert len(full_caches) == len(sub_caches) == 1
    assert _stored_bytes(full_caches[0]) == _stored_bytes(sub_caches[0])
    at_pos = tuple(a[pos] for a in full)
    assert all(b.shape == (len(pos),) for b in sub)
    response = _max_gap(tuple(a[pos] for a in bf16_input), at_pos)
    gaps = _max_gap(at_pos, sub)
    for m in ("kl", "nll"):
        assert gaps[m] <= response[m], (m, gaps[m], response[m])
    assert _flips(at_pos, sub) <= max(1, _flips(tuple(a[pos] for a in bf16_input), at_pos))
    assert float(sub[0].mean()) > 0

    lm = _lm(gemma, "nvfp4")
    res, samples = _run(lm, tmp_path / "c", seq_len=seq, chunk=chunk, limit=1, subsample=4)
    assert res["configs"]["kl"]["subsample"] == 4 and res["kl_by_position"]["subsample"] == 4
    assert samples[0]["n_tokens"] == len(pos) == sum(b["n_tokens"] for b in res["kl_by_position"]["buckets"])


def test_subsample_buckets_match_positions() -> None:
    from kvcal.evaluate.kl import bucket_tokens, position_buckets, scored_positions, window_buckets

    n_pred = 1100
    edges = position_buckets(n_pred)
    pos = scored_positions(n_pred, 8)  # 0-based; bucket [lo, hi] is 1-based
    kl = pos.double() + 0.5
    stats = (kl, torch.zeros_like(kl), torch.zeros_like(kl))
    means = window_buckets(stats, edges, 8)["kl"]
    for (lo, hi), n, m in zip(edges, bucket_tokens(edges, 8), means, strict=True):
        inside = kl[(pos + 1 >= lo) & (pos + 1 <= hi)]
        assert n == inside.numel() > 0 and m == pytest.approx(float(inside.mean()))
    assert bucket_tokens(edges, 1) == [hi - lo + 1 for lo, hi in edges]


@pytest.mark.parametrize("bad", [0, 3, 1024])
def test_bad_subsample(invoke: Invoke, gemma: Path, tmp_path: Path, bad: int) -> None:
    code, _, err = invoke(
        [
            "eval",
            str(gemma),
            "-f",
            "fp8_e4m3",
            "--tasks",
            "kl",
            "--kl-subsample",
            str(bad),
            "-o",
            str(tmp_path / "r"),
        ]
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--kl-subsample must be a power of two from 1 to 512" in lines[0]
    assert lines[0].startswith("Error: ") and not (tmp_path / "r").exists()
