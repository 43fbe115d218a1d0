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

QUANT_FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "nvfp4", "fp4_e2m1", "mxfp4"]
ALL_FORMATS = ["bf16", *QUANT_FORMATS]


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
        assert q.codes.dtype not in (torch.float32, torch.float16, torch.float64)
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
    out, ref = {}, {}
    for name, f, kin in (
        ("auto", "auto", None),
        ("bf16", "bf16", None),
        ("fmt_bf16_input", fmt, "bfloat16"),
        ("fmt", fmt, None),
    ):
        sdpa = gemma3()  # the reference: transformers' own attention over fake-quantized writes
        ref[name] = _reads(sdpa, ids, mask, lambda f=f, c=sdpa.config: FakeQuantDynamicCache(f, config=c))
        model = gemma3()  # the same weights; KVRuntime switches it to kvcal attention
        rt = KVRuntime(model, f, impl="torch", kv_input_dtype=kin)
        rec = kv_recorder(rt) if name == "fmt" else None
        out[name] = _reads(model, ids, mask, rt.new_cache)
    global_scale = 1.0 if fmt == "nvfp4" else None  # the runtime's default nvfp4 global, vLLM's
    # layers x (the forward's prefill, generate()'s prefill and its 7 decode writes)
    writes = rec.check_stored_as(lambda x, _: formats.fake_quantize(x, fmt, scale=global_scale))
    assert writes == 3 * (1 + 1 + 7)
    bound = batch_bound(
        _gap(out["fmt"], out["fmt_bf16_input"], mask),
        max(_gap(out["auto"], ref["auto"], mask), _gap(out["bf16"], ref["bf16"], mask)),
        _gap(out["bf16"], out["auto"], mask),
    )
    assert _gap(out["fmt"], ref["fmt"], mask) <= bound, (fmt, bound)
    seqs, want = out["fmt"][1].sequences, ref["fmt"][1]
    assert greedy_agree(seqs, want.sequences, want.scores, ids.shape[1], bound) >= 2
    real = mask.bool()  # quantization is visible in the prefill logits, beyond the bound
    assert float((out["fmt"][0][real] - out["auto"][0][real]).abs().max()) > bound


def test_chunked_prefill_past_the_window(gemma3: Model, batch: Batch) -> None:
    """A second multi-token chunk after the window is full reads the kept window plus the whole chunk."""
    model = gemma3()
    ids, mask = batch(seed=9, length=16)
    rt = KVRuntime(model, "mxfp4", impl="torch")
    outs = []
    for cache in (FakeQuantDynamicCache("mxfp4", config=model.config), rt.new_cache()):
        with torch.no_grad():
            model(input_ids=ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache)
            outs.append(model(input_ids=ids[:, 9:], attention_mask=mask, past_key_values=cache).logits)
    assert torch.allclose(outs[1], outs[0], atol=2e-5, rtol=0)


def test_without_a_kvcal_cache_the_forward_still_reads_quantized_kv(gemma3: Model, batch: Batch) -> None:
    model = gemma3()
    ids, mask = batch(seed=6)
    rt = KVRuntime(model, "fp4_e2m1", impl="torch")
    with torch.no_grad():
        with_cache = model(input_ids=ids, attention_mask=mask, past_key_values=rt.new_cache()).logits
        own_cache = model(input_ids=ids, attention_mask=mask).logits  # transformers makes a DynamicCache
        no_cache = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert torch.allclose(own_cache[real], with_cache[real], atol=1e-5, rtol=0)
    assert torch.allclose(no_cache[real], with_cache[real], atol=1e-5, rtol=0)


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


def test_beam_search_reorders_the_quantized_cache(gemma3: Model, batch: Batch) -> None:
    model = gemma3()
    ids, mask = batch(seed=7)
    kw = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, num_beams=2, pad_token_id=0
    )
    with torch.no_grad():
        ref = model.generate(past_key_values=FakeQuantDynamicCache("fp8_e4m3", config=model.config), **kw)
        rt = KVRuntime(model, "fp8_e4m3", impl="torch")
        got = model.generate(past_key_values=rt.new_cache(), **kw)
    assert got.tolist() == ref.tolist()


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
