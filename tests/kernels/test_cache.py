"""QuantizedKVCache and KVRuntime: stored codes, windows, skip layers, scales, bytes, quantized reads, bad input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import BertConfig, BertModel, DeepseekV3Config, DynamicCache

from kvcal import formats
from kvcal.capacity import kv_bytes_per_token
from kvcal.errors import UsageError
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache, QuantizedLayer
from kvcal.kernels.runtime import KVRuntime
from kvcal.models.geometry import kv_spec
from kvcal.scales import ScaleSet

QUANT_FORMATS = [
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4",
    "fp4_e2m1",
    "mxfp4",
]
ALL_FORMATS = ["bf16", "float16", *QUANT_FORMATS]


Model = Callable[..., torch.nn.Module]
Batch = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the `batch` fixture of tests/kernels/conftest.py

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def gemma3(kv_model: Model) -> Model:
    """(head_dim=32, seed=0) -> a new tiny Gemma 3 (sliding, full, sliding; window 6; sdpa); head_dim 32 so every
    block size fits."""
    return lambda head_dim=32, seed=0: kv_model("gemma3", seed=seed, head_dim=head_dim)


class FakeQuantDynamicCache(DynamicCache):
    """transformers' DynamicCache storing fake-quantized K/V, each write quantized on its own — the independent
    reference for what kvcal's cache must hold. nvfp4 uses global scale 1.0 (the runtime's default, vLLM's)."""

    def __init__(self, fmt: str, **kwargs):
        super().__init__(**kwargs)
        self.fmt = fmt

    def _fq(self, x: torch.Tensor, layer_idx: int, which: str) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return formats.fake_quantize(x, "nvfp4", scale=1.0)
        return formats.fake_quantize(x, self.fmt)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k = self._fq(key_states, layer_idx, "k")
        v = self._fq(value_states, layer_idx, "v")
        return super().update(k, v, layer_idx, *args, **kwargs)


def _chunks(seed: int = 0) -> list[torch.Tensor]:
    """A 7-token prefill then three 1-token decode writes of [B=2, H_kv=2, T, D=32]; the last decode token is
    larger than anything in the prefill (fp8 at scale 1.0 saturates; nvfp4's fixed global clips)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(2, 2, 7, 32, generator=g) * 3, torch.randn(2, 2, 1, 32, generator=g)]
    out.append(torch.randn(2, 2, 1, 32, generator=g) * 0.01)
    out.append(torch.randn(2, 2, 1, 32, generator=g) * 1000)
    return out


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_stored_codes_dequantize_to_fake_quantize_of_each_write(fmt: str) -> None:
    f = formats.get_format(fmt)
    layer = QuantizedLayer(LayerPlan(index=0, fmt=f))
    ks = _chunks(1)
    vs = _chunks(2)
    for t, (k, v) in enumerate(zip(ks, vs, strict=True)):
        kph, vph = layer.update(k, v)
        read = kph.kvcal_read
        assert kph.shape == (2, 2, layer.kept, 32) and kph.stride() == (0, 0, 0, 0)  # placeholder, no memory
        assert read.q_start == sum(c.shape[2] for c in ks[:t]) and read.k_start == 0
        assert read.k.codes.shape[-2] == layer.kept
    # nvfp4: the default global 1.0 (tests/kernels/test_batch_invariance.py covers "per_sequence")
    gk = gv = 1.0 if fmt == "nvfp4" else None
    want_k = torch.cat([formats.fake_quantize(k, f, scale=gk) for k in ks], dim=2)
    want_v = torch.cat([formats.fake_quantize(v, f, scale=gv) for v in vs], dim=2)
    assert torch.equal(formats.dequantize(layer.k, f), want_k)
    assert torch.equal(formats.dequantize(layer.v, f), want_v)
    # storage is codes + scales only: no float32/float16 copy of K or V
    for q in (layer.k, layer.v):
        assert q.codes.dtype not in (torch.float32, torch.float64)
        assert q.codes.dtype != torch.float16 or fmt == "float16"  # a float16 cache stores float16, nothing wider
        assert q.block_scales is None or q.block_scales.shape[-2] == q.codes.shape[-2]
    assert layer.get_seq_length() == 10


def test_static_scales_per_head_and_per_tensor() -> None:
    f = formats.get_format("fp8_e4m3")
    x = _chunks(3)[0]
    for scale in (torch.tensor([0.01]), torch.tensor([0.02, 0.005])):
        layer = QuantizedLayer(LayerPlan(index=0, fmt=f, k_scale=scale, v_scale=scale))
        layer.update(x, x)
        assert torch.equal(formats.dequantize(layer.k, f), formats.fake_quantize(x, f, scale=scale))
        assert not torch.equal(
            formats.dequantize(layer.k, f), formats.fake_quantize(x, f)
        )  # 1.0 would differ


def test_sliding_layer_keeps_window_but_prefill_reads_the_whole_chunk() -> None:
    f = formats.get_format("int8_per_token_head")
    layer = QuantizedLayer(LayerPlan(index=0, fmt=f, window=4))
    x = torch.randn(1, 2, 10, 32)
    assert layer.get_mask_sizes(10) == (10, 0)
    kph, _ = layer.update(x, x)
    assert kph.shape[2] == 10 and kph.kvcal_read.k_start == 0 and kph.kvcal_read.q_start == 0
    assert layer.kept == 4 and layer.get_seq_length() == 10
    assert layer.get_mask_sizes(1) == (5, 6)
    y = torch.randn(1, 2, 1, 32)
    kph, _ = layer.update(y, y)
    read = kph.kvcal_read
    assert (read.q_start, read.k_start, read.k.codes.shape[2]) == (10, 6, 5)
    assert layer.kept == 4
    want = formats.fake_quantize(torch.cat([x, y], dim=2), f)[:, :, -4:]
    assert torch.equal(formats.dequantize(layer.k, f), want)


def _reads(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: Callable[[], object]
) -> tuple:
    """(prefill logits [B, T, V], greedy generate() output with its scores, 8 new tokens) over fresh caches."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache()).logits
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
            past_key_values=cache(), output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    return logits, gen


# The runs of each end-to-end comparison: name -> (KV format, None = the tested one; kv_input_dtype).
SIDES: dict[str, tuple[str | None, str | None]] = {
    "auto": ("auto", None),
    "bf16": ("bf16", None),
    "fmt_bf16_input": (None, "bfloat16"),  # the format's response to BF16 rounding of its K/V input
    "fmt": (None, None),
}


def _sides(
    fmt: str, gemma3: Model, run: Callable[[torch.nn.Module, Callable[[], object]], Any], recorder: Callable
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(kvcal, reference, the 'fmt' side's KVRecorder): name -> run(model, cache factory) for every SIDES name,
    kvcal's through KVRuntime (torch attention, its caches), the reference's through transformers' sdpa over a
    FakeQuantDynamicCache of the same format (none for fmt_bf16_input: only kvcal's response is used). Each run
    gets a new model of the same weights."""
    out, ref, rec = {}, {}, None
    for name, (f, kin) in SIDES.items():
        f = f or fmt
        if kin is None:
            sdpa = gemma3()
            ref[name] = run(sdpa, lambda f=f, c=sdpa.config: FakeQuantDynamicCache(f, config=c))
        model = gemma3()  # the same weights; KVRuntime switches it to kvcal attention
        rt = KVRuntime(model, f, impl="torch", kv_input_dtype=kin)
        if name == "fmt":
            rec = recorder(rt)
        out[name] = run(model, rt.new_cache)
    return out, ref, rec


def _bound(
    out: dict[str, Any], ref: dict[str, Any], gap: Callable[[Any, Any], float], bound: Callable
) -> float:
    """`batch_bound` of the kvcal-vs-reference difference of the tested format, from the `_sides` runs: the same
    comparison through the auto and BF16 caches (base), BF16 storage's own effect (bf16 vs auto) and the format's
    response to BF16 rounding of its K/V input."""
    return bound(
        gap(out["fmt"], out["fmt_bf16_input"]),
        max(gap(out["auto"], ref["auto"]), gap(out["bf16"], ref["bf16"])),
        gap(out["bf16"], out["auto"]),
    )


def _gap(a: tuple, b: tuple, mask: torch.Tensor) -> float:
    """max |a - b| over the prefill logits of the real positions and the generate() scores of each row up to and
    including the first step where the two runs' greedy tokens differ (after it they continue different texts)."""
    real = mask.bool()
    worst = float((a[0][real] - b[0][real]).abs().max())
    prompt = mask.shape[1]
    for i in range(mask.shape[0]):
        for t, (x, y) in enumerate(zip(a[1].scores, b[1].scores, strict=True)):
            worst = max(worst, float((x[i] - y[i]).abs().max()))
            if a[1].sequences[i, prompt + t] != b[1].sequences[i, prompt + t]:
                break
    return worst


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_model_reads_quantized_kv_in_prefill_and_decode(
    fmt: str,
    gemma3: Model,
    batch: Batch,
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
    greedy_agree: Callable[..., int],
) -> None:
    """kvcal (cache + attention) against transformers sdpa over a cache of fake-quantized writes, on a left-padded
    batch through a sliding-window model, prefill and 8 greedy decode steps: every read, prefill included, sees
    the quantized values.

    What kvcal owns is exact: every write, prefill and decode, stores bit for bit fake_quantize of the K/V it was
    given (zeros for padding). The logits and scores then differ by the two attention implementations' float32
    rounding, which another CPU's kernels may turn into FP4/FP8 code flips in the layers after: they are held to
    `batch_bound`, derived here from the same comparison through BF16 (and float32) caches and the format's
    response to BF16 rounding of its K/V input; the greedy tokens agree unless the best two scores lie within it."""
    ids, mask = batch(seed=5)
    out, ref, rec = _sides(fmt, gemma3, lambda m, cache: _reads(m, ids, mask, cache), kv_recorder)
    global_scale = 1.0 if fmt == "nvfp4" else None  # the runtime's default nvfp4 global, vLLM's
    # layers x (the forward's prefill, generate()'s prefill and its 7 decode writes)
    writes = rec.check_stored_as(lambda x, _: formats.fake_quantize(x, fmt, scale=global_scale))
    assert writes == 3 * (1 + 1 + 7)
    bound = _bound(out, ref, lambda a, b: _gap(a, b, mask), batch_bound)
    assert _gap(out["fmt"], ref["fmt"], mask) <= bound, (fmt, bound)
    seqs, want = out["fmt"][1].sequences, ref["fmt"][1]
    assert greedy_agree(seqs, want.sequences, want.scores, ids.shape[1], bound) >= 2
    real = mask.bool()  # quantization is visible in the prefill logits, beyond the bound
    assert float((out["fmt"][0][real] - out["auto"][0][real]).abs().max()) > bound


def _chunked(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: Callable[[], object]
) -> Any:
    """Logits [B, 16, V] of a 9-token prefill (the window of 6 is full) then a 7-token chunk, over one cache."""
    c = cache()
    with torch.no_grad():
        first = model(input_ids=ids[:, :9], attention_mask=mask[:, :9], past_key_values=c).logits
        second = model(input_ids=ids[:, 9:], attention_mask=mask, past_key_values=c).logits
    return torch.cat([first, second], dim=1)


def test_chunked_prefill_past_the_window(
    gemma3: Model,
    batch: Batch,
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """A second multi-token chunk after the window is full reads the kept window plus the whole chunk: kvcal
    (cache + attention) against transformers' sdpa over a DynamicCache of fake-quantized mxfp4 writes (its sliding
    layers keep their own window), on a left-padded batch.

    Exact: both chunks' writes store bit for bit fake_quantize of the K/V they were given (zeros for padding).
    The logits of both chunks then differ by the two attention implementations' float32 rounding, which FP4 codes
    of the later layers may amplify on another CPU: held to `batch_bound`, derived here from the same chunked
    comparison through auto and BF16 caches and mxfp4's response to BF16 rounding of its K/V input."""
    ids, mask = batch(seed=9, length=16)
    real = mask.bool()

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a[real] - b[real]).abs().max())

    out, ref, rec = _sides("mxfp4", gemma3, lambda m, cache: _chunked(m, ids, mask, cache), kv_recorder)
    assert rec.check_stored_as(lambda x, _: formats.fake_quantize(x, "mxfp4")) == 3 * 2  # layers x chunks
    bound = _bound(out, ref, gap, batch_bound)
    assert gap(out["fmt"], ref["fmt"]) <= bound, bound
    assert gap(out["fmt"], out["auto"]) > bound  # quantization is visible beyond the bound


def test_without_a_kvcal_cache_the_forward_still_reads_quantized_kv(
    gemma3: Model,
    batch: Batch,
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lm-eval's plain model(input_ids) makes transformers create its own DynamicCache (or none: use_cache=False);
    kvcal's attention then quantizes the K/V it is given on the fly, as a fresh kvcal cache stores one write.

    Exact: every such read holds bit for bit fake_quantize of the K/V it was given (zeros for padding), as every
    write of the kvcal cache does. The three forwards' logits then differ by float32 rounding only (the cache's
    read goes through its own workspaces), which FP4 codes of the later layers may amplify on another CPU: held to
    `batch_bound`, derived here from the same three forwards with auto and BF16 caches and fp4_e2m1's response to
    BF16 rounding of its K/V input."""
    import kvcal.kernels.attention as attention

    ids, mask = batch(seed=6)
    real = mask.bool()
    fmt = formats.get_format("fp4_e2m1")
    plain_reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]] = []
    read_plain_kv = attention._read_plain_kv

    def recorded(cfg: Any, key: torch.Tensor, value: torch.Tensor, tq: int, key_padding: Any) -> Any:
        read = read_plain_kv(cfg, key, value, tq, key_padding)  # the real on-the-fly quantization, recorded
        plain_reads.append((key.clone(), value.clone(), key_padding, read))
        return read

    monkeypatch.setattr(attention, "_read_plain_kv", recorded)
    logits: dict[str, dict[str, torch.Tensor]] = {}
    for name, (f, kin) in SIDES.items():
        model = gemma3()
        rt = KVRuntime(model, f or fmt.name, impl="torch", kv_input_dtype=kin)
        rec = kv_recorder(rt) if name == "fmt" else None
        plain_reads.clear()
        with torch.no_grad():
            logits[name] = {
                "kvcal_cache": model(
                    input_ids=ids, attention_mask=mask, past_key_values=rt.new_cache()
                ).logits,
                "own_cache": model(input_ids=ids, attention_mask=mask).logits,  # transformers' DynamicCache
                "no_cache": model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
            }
        if name == "fmt":
            assert rec.check_stored_as(lambda x, _: formats.fake_quantize(x, fmt)) == 3
            assert len(plain_reads) == 2 * 3  # the own-cache and no-cache forwards, every layer
            for key, value, pad, read in plain_reads:
                keep = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool) if pad is None else pad
                keep = keep[:, None, :, None].expand_as(key)
                for x, got in ((key, read.k), (value, read.v)):
                    stored = formats.dequantize(got, fmt)
                    want = formats.fake_quantize(x, fmt)
                    assert torch.equal(stored[keep].view(torch.int32), want[keep].view(torch.int32))
                    assert not bool(stored[~keep].any())  # padding read as zeros

    def gap(name: str) -> float:  # the most a forward without kvcal's cache moves the logits
        runs = logits[name]
        return max(
            float((runs[o][real] - runs["kvcal_cache"][real]).abs().max()) for o in ("own_cache", "no_cache")
        )

    def diff(a: str, b: str) -> float:
        return float((logits[a]["kvcal_cache"][real] - logits[b]["kvcal_cache"][real]).abs().max())

    bound = batch_bound(diff("fmt", "fmt_bf16_input"), max(gap("auto"), gap("bf16")), diff("bf16", "auto"))
    assert gap("fmt") <= bound, bound
    # not vacuous: reading unquantized K/V would move the logits by this much, beyond the bound
    assert diff("fmt", "auto") > bound


def test_generate_without_a_cache_uses_a_kvcal_cache(gemma3: Model, batch: Batch) -> None:
    """lm-eval calls generate() without past_key_values: the runtime supplies its own cache (nvfp4's per-sequence
    global fixed at prefill would differ if every step re-quantized a transformers cache)."""
    model = gemma3()
    ids, mask = batch(seed=8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    rt = KVRuntime(model, "nvfp4", impl="torch", nvfp4_global="per_sequence")
    with torch.no_grad():
        want = model.generate(
            past_key_values=rt.new_cache(), **kw, output_scores=True, return_dict_in_generate=True
        )
        got = model.generate(**kw, output_scores=True, return_dict_in_generate=True)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    KVRuntime(model, "auto")
    assert "_prepare_cache_for_generation" not in vars(model)


def _beams(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: Callable[[], object]) -> Any:
    """Beam search (2 beams, 5 new tokens) over cache(), with every step's logits and the beam indices."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, num_beams=2, pad_token_id=0,
            past_key_values=cache(), output_logits=True, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip


def _forced(
    model: torch.nn.Module, seqs: torch.Tensor, mask: torch.Tensor, cache: Callable[[], object]
) -> Any:
    """Teacher-forced logits [B, L, V] of sequences [B, L] (the prompt's padding, generated tokens real), one
    forward over cache(), at the positions generate() gives them (counted from each row's first real token, as
    transformers' prepare_inputs_for_generation does: stored K carry RoPE of their absolute position)."""
    full = torch.cat([mask, torch.ones(seqs.shape[0], seqs.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    pos = (full.long().cumsum(-1) - 1).masked_fill(full == 0, 1)
    with torch.no_grad():
        return model(input_ids=seqs, attention_mask=full, position_ids=pos, past_key_values=cache()).logits


def _beam_gap(gen: Any, forced: torch.Tensor, prompt: int) -> float:
    """max |a returned beam's logits at a step it ran - the teacher-forced logits of the same prefix|: at step t,
    beam_indices picks the running beam whose logits chose the beam's token t (-1 once the beam has ended)."""
    worst = 0.0
    for i in range(gen.sequences.shape[0]):
        for t, step in enumerate(gen.logits):
            b = int(gen.beam_indices[i, t])
            if b < 0:
                break
            worst = max(worst, float((step[b] - forced[i, prompt + t - 1]).abs().max()))
    return worst


def test_beam_search_reorders_the_quantized_cache(
    gemma3: Model,
    batch: Batch,
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """Beam search (2 beams, a left-padded batch) reorders kvcal's fp8_e4m3 cache between decode steps
    (transformers' Cache.reorder_cache).

    Exact: every write stores fake_quantize of the K/V it was given, and after the search the cache holds exactly
    what transformers' DynamicCache holds after the same writes and the same reorders (beams really swapped: not
    every reorder is the identity). End to end: every returned beam's logits at every step match transformers'
    sdpa over a fake-quantized DynamicCache teacher-forcing the same beam (fp8_e4m3 at scale 1.0 quantizes
    element by element, so one forced write stores what the decode writes stored), within `batch_bound`, derived
    here from the same comparison of the auto and BF16 beam searches, BF16 storage's own effect and fp8_e4m3's
    response to BF16 rounding of its K/V input (teacher-forced, on the fp8 beams). The chosen tokens themselves
    are not compared with a reference beam search: a near-tie of two beams' scores may swap on another CPU."""
    ids, mask = batch(seed=7)
    prompt, fmt = ids.shape[1], "fp8_e4m3"
    runs, gens, gaps = {}, {}, {}
    for name, (f, kin) in SIDES.items():
        f = f or fmt
        model = gemma3()
        rt = KVRuntime(model, f, impl="torch", kv_input_dtype=kin)
        rec = kv_recorder(rt) if name == "fmt" else None
        gens[name] = _beams(model, ids, mask, rt.new_cache)
        runs[name] = (model, rt)
        if rec is not None:
            fq = lambda x, _: formats.fake_quantize(x, fmt)  # noqa: E731
            assert rec.check_stored_as(fq) == 3 * 5  # layers x (prefill + 4 decode writes)
            assert rec.check_replayed_as(fq, model.config) >= 4
            (cache,) = rec.caches
            assert any(not torch.equal(idx, torch.arange(len(idx))) for _, idx in cache.reorders)
        if kin is None:
            sdpa = gemma3()
            forced = _forced(
                sdpa,
                gens[name].sequences,
                mask,
                lambda f=f, c=sdpa.config: FakeQuantDynamicCache(f, config=c),
            )
            gaps[name] = _beam_gap(gens[name], forced, prompt)
    seqs = gens["fmt"].sequences
    real = torch.cat([mask, torch.ones(seqs.shape[0], seqs.shape[1] - prompt, dtype=mask.dtype)], 1).bool()
    logits = {name: _forced(model, seqs, mask, rt.new_cache)[real] for name, (model, rt) in runs.items()}

    def diff(a: str, b: str) -> float:  # kvcal's teacher-forced logits of the fp8 beams, two configurations
        return float((logits[a] - logits[b]).abs().max())

    bound = batch_bound(diff("fmt", "fmt_bf16_input"), max(gaps["auto"], gaps["bf16"]), diff("bf16", "auto"))
    assert gaps["fmt"] <= bound, bound
    assert diff("fmt", "auto") > bound  # quantization is visible beyond the bound


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("sliding_window", [0, 2]),
        ("sliding_attention", [0, 2]),
        ("full_attention", [1]),
        ("0,1", [0, 1]),
        (frozenset({2}), [2]),
        ("", []),
    ],
)
def test_skip_layers_keep_bf16(spec, want, gemma3: Model, batch: Batch) -> None:
    model = gemma3()
    rt = KVRuntime(model, "fp8_e4m3", skip_layers=spec, impl="torch")
    d = rt.describe()
    assert d["skip_layers"] == want
    assert d["layer_formats"] == ["bf16" if i in want else "fp8_e4m3" for i in range(3)]
    cache = rt.new_cache()
    ids, mask = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    for i, layer in enumerate(cache.layers):
        assert layer.k.codes.dtype == (torch.bfloat16 if i in want else torch.float8_e4m3fn)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("skip", ["", "full_attention"])
def test_cache_bytes_equal_capacity_formula(fmt: str, skip: str, gemma3: Model, batch: Batch) -> None:
    model = gemma3()
    kv = kv_spec(model.config)
    rt = KVRuntime(model, fmt, skip_layers=skip, impl="torch")
    cache: QuantizedKVCache = rt.new_cache()
    ids, mask = batch(length=5)  # shorter than the window, then past it
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        n_tokens = 5
        assert cache.nbytes() == round(
            2 * kv_bytes_per_token(kv, fmt, rt.skip_layers, context=n_tokens) * n_tokens
        )
        for _ in range(4):
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            n_tokens += 1
    assert n_tokens > model.config.sliding_window
    per_token = kv_bytes_per_token(kv, fmt, rt.skip_layers, context=n_tokens)
    assert cache.nbytes() == round(2 * per_token * n_tokens)  # batch of 2
    # and from first principles (docs/formats.md): codes + scales of min(context, window) tokens per layer
    expect = 0
    for layer in kv.layers:
        bits = 16 if layer.index in rt.skip_layers else formats.bits_per_element(fmt, layer.head_dim)
        kept = min(n_tokens, layer.window) if layer.window else n_tokens
        expect += 2 * 2 * layer.kv_heads * layer.head_dim * bits / 8 * kept
    assert cache.nbytes() == round(expect)


def _scale_set(fmt: str, n_layers: int, per_layer: int, value: float = 0.05) -> ScaleSet:
    return ScaleSet(
        kv_format=fmt,
        granularity="tensor" if per_layer == 1 else "head",
        k_scales=[torch.full((per_layer,), value) for _ in range(n_layers)],
        v_scales=[torch.full((per_layer,), value) for _ in range(n_layers)],
        manifest={},
    )


def test_describe_scale_source_and_calibrated_reads(gemma3: Model, batch: Batch) -> None:
    model = gemma3()
    d = KVRuntime(model, "fp8", impl="torch").describe()
    assert d["kv_format"] == "fp8_e4m3" and d["uncalibrated"] and "1.0" in d["scale_source"]
    assert d["impl"] == "torch" and d["attn_implementation"] == "kvcal"
    assert KVRuntime(model, "nvfp4", impl="torch").describe()["uncalibrated"]
    assert not KVRuntime(model, "mxfp4", impl="torch").describe()["uncalibrated"]
    rt = KVRuntime(model, "fp8_e4m3", scales=_scale_set("fp8_e4m3", 3, 2, 0.004), impl="torch")
    d = rt.describe()
    assert not d["uncalibrated"] and d["scale_source"] == "scale file (head)" and d["granularity"] == "head"
    cache = rt.new_cache()
    ids, mask = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert torch.equal(cache.layers[1].k.scale, torch.full((2,), 0.004))


def test_cpu_fp8_reads_fp8_e4m3_scales(gemma3: Model) -> None:
    """fp8_e4m3_cpu (vLLM's CPU build's store) takes an fp8_e4m3 scale file as the engine does (kvcal.scales
    SAME_SCALES); a scale file of another format is still refused."""
    model = gemma3(head_dim=16)
    rt = KVRuntime(model, "fp8_e4m3_cpu", scales=_scale_set("fp8_e4m3", 3, 1, 0.004), impl="torch")
    assert not rt.describe()["uncalibrated"]
    rt = KVRuntime(model, "fp8_e5m2_cpu", scales=_scale_set("fp8_e5m2", 3, 1, 0.004), impl="torch")
    assert not rt.describe()["uncalibrated"]
    with pytest.raises(UsageError, match="calibrated for fp8_e5m2, not fp8_e4m3_cpu"):
        KVRuntime(model, "fp8_e4m3_cpu", scales=_scale_set("fp8_e5m2", 3, 1))


def test_bad_input_errors(monkeypatch: pytest.MonkeyPatch, gemma3: Model, kv_model: Model) -> None:
    model = gemma3(head_dim=16)
    with pytest.raises(UsageError, match="mxfp4 needs head_dim divisible by its 32-element block"):
        KVRuntime(model, "mxfp4")
    with pytest.raises(UsageError, match="block"):
        KVRuntime(kv_model("llama", head_dim=24), "nvfp4")
    with pytest.raises(UsageError, match="unknown KV format"):
        KVRuntime(model, "fp3")
    with pytest.raises(UsageError, match="has 2 layers of k_scale but the model has 3"):
        KVRuntime(model, "fp8_e4m3", scales=_scale_set("fp8_e4m3", 2, 1))
    with pytest.raises(UsageError, match="3 values but the model has 2 KV heads"):
        KVRuntime(model, "fp8_e4m3", scales=_scale_set("fp8_e4m3", 3, 3))
    with pytest.raises(UsageError, match="calibrated for nvfp4"):
        KVRuntime(model, "fp8_e4m3", scales=_scale_set("nvfp4", 3, 1))
    with pytest.raises(UsageError, match="takes no static scales"):
        KVRuntime(model, "int8_per_token_head", scales=_scale_set("int8_per_token_head", 3, 1))
    with pytest.raises(UsageError, match="unknown skip-layer name"):
        KVRuntime(model, "fp8", skip_layers="local_attention")
    with pytest.raises(UsageError, match="out of range"):
        KVRuntime(model, "fp8", skip_layers="0,7")
    with pytest.raises(UsageError, match="out of range"):
        KVRuntime(model, "fp8", skip_layers=frozenset({-1}))
    with pytest.raises(UsageError, match="--impl must be one of"):
        KVRuntime(model, "fp8", impl="cuda")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(UsageError, match="--impl triton needs a CUDA GPU"):
            KVRuntime(model, "fp8", impl="triton")
        assert KVRuntime(model, "fp8", impl="auto").impl == "torch"


def test_unsupported_architectures_name_their_type() -> None:
    mla = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
    )  # fmt: skip

    class _Stub(torch.nn.Module):  # kv_spec refuses MLA from the config alone, before any module is touched
        config = mla

    with pytest.raises(UsageError, match="deepseek_v3"):
        KVRuntime(_Stub(), "fp8")
    bert = BertModel(
        BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    with pytest.raises(UsageError, match="'bert'"):
        KVRuntime(bert, "fp8")


def test_mask_function_and_4d_masks_reduce_to_key_padding() -> None:
    from kvcal.kernels.attention import _key_padding, kvcal_mask
    from kvcal.kernels.reference import visibility_mask

    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    # a sliding layer that keeps 3 tokens, reading them plus 2 new ones: keys 1..5 of a 6-token 2-D mask
    assert kvcal_mask(2, 2, kv_length=5, kv_offset=1, attention_mask=am).tolist() == [
        [False, True, True, True, True],
        [True] * 5,
    ]
    assert kvcal_mask(2, 2, kv_length=5, kv_offset=1, attention_mask=torch.ones(2, 6)) is None
    # a 2-D mask shorter than the keys: tokens it does not cover are real
    assert kvcal_mask(2, 1, kv_length=7, kv_offset=0, attention_mask=am).shape == (2, 7)
    pad = am.bool()
    full = visibility_mask(6, 6, q_start=0, k_start=0, sliding_window=3, key_padding=pad)  # [2, 1, 6, 6]
    assert torch.equal(_key_padding(full, 2, 6), pad)
    additive = torch.zeros(full.shape).masked_fill(~full, torch.finfo(torch.float32).min)
    assert torch.equal(_key_padding(additive, 2, 6), pad)
