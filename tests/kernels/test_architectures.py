"""kvcal's cache + attention against transformers' own attention on tiny random models of every supported family.

How parity is judged (the choice, and why):
- Machinery check, exact: the cache storing the model's own K/V (format 'auto' plans through kvcal's attention)
  must reproduce transformers' reference attention to float32 rounding — logits and greedy generate() tokens.
  This isolates cache bookkeeping, positions, masks, windows, GQA, softcap and sinks from quantization.
- bf16 check: a float32 model with kvcal's `bf16` cache stores K/V rounded to bfloat16, so it cannot equal plain
  sdpa (which reads float32 K/V), and a bf16 model would compare two different bf16 roundings of the attention
  math. So the reference is transformers' attention reading a BF16 KV cache: a DynamicCache that rounds what it
  stores to bfloat16 — what a BF16 server holds. Logits agree to float32 tolerance, tokens are identical.
The reference attention is `sdpa`, except Gemma 2 (sdpa ignores its logit softcap) and gpt-oss (no sdpa: its
sinks need eager), where transformers' `eager` is the reference.
Left-padded batches of 2 with prompts longer than the window exercise padding and sliding windows in prefill and decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kvcal import formats
from kvcal.kernels.cache import QuantizedKVCache
from kvcal.kernels.runtime import KVRuntime, install_plans

# The families of tests/kernels/conftest.py (`kv_model`), each with its reference attention.
ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt_oss")
DECODE = 8  # new tokens: decoding runs past the kernels models' sliding window (6)

KvModel = Callable[..., torch.nn.Module]  # the `kv_model` fixture
Batch = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the `batch` fixture

pytestmark = pytest.mark.usefixtures("one_thread")


class BF16DynamicCache(DynamicCache):
    """transformers' DynamicCache holding K/V rounded to bfloat16 (a BF16 server's cache)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        r = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
        return super().update(r(key_states), r(value_states), layer_idx, *args, **kwargs)


def _real(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]  # [N_real, V]: padding positions carry no meaning


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    assert err <= 2e-5 * max(1.0, b.abs().max().item()), err


def _gen(model, ids, mask, cache, new_tokens: int = DECODE) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            past_key_values=cache,
            pad_token_id=0,
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_plans_reproduce_transformers_exactly(arch: str, kv_model: KvModel, batch: Batch) -> None:
    model = kv_model(arch)
    ids, mask = batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    ref_tokens = _gen(model, ids, mask, None)

    rt = KVRuntime(model, "bf16", impl="torch")
    auto = formats.get_format("auto")
    plans = [replace(p, fmt=auto) for p in rt.plans]
    install_plans(model, plans, "torch")
    assert model.config._attn_implementation == "kvcal"
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=QuantizedKVCache(plans)).logits
    _assert_close(_real(out, mask), _real(ref, mask))
    assert _gen(model, ids, mask, QuantizedKVCache(plans)).tolist() == ref_tokens.tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_cache_reproduces_transformers_with_bf16_kv(arch: str, kv_model: KvModel, batch: Batch) -> None:
    model = kv_model(arch)
    ids, mask = batch(seed=2)
    with torch.no_grad():
        ref = model(
            input_ids=ids, attention_mask=mask, past_key_values=BF16DynamicCache(config=model.config)
        ).logits
    ref_tokens = _gen(model, ids, mask, BF16DynamicCache(config=model.config))

    rt = KVRuntime(model, "bf16", impl="torch")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=rt.new_cache()).logits
    _assert_close(_real(out, mask), _real(ref, mask))
    assert _gen(model, ids, mask, rt.new_cache()).tolist() == ref_tokens.tolist()
    # The bf16 cache is really not the float32 one (so the comparison above is not vacuous).
    KVRuntime(model, "auto")
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    assert (_real(plain, mask) - _real(out, mask)).abs().max() > 0


def test_auto_leaves_model_untouched_and_restores(kv_model: KvModel) -> None:
    model = kv_model("llama")
    original = model.config._attn_implementation
    rt = KVRuntime(model, "auto")
    assert model.config._attn_implementation == original
    assert isinstance(rt.new_cache(), DynamicCache)
    assert rt.describe()["impl"] == "transformers"
    KVRuntime(model, "fp8_e4m3", impl="torch")
    assert model.config._attn_implementation == "kvcal"
    KVRuntime(model, "auto")
    assert model.config._attn_implementation == original
    assert not any(hasattr(m, "kvcal_config") for m in model.modules())


def _scored(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rt: KVRuntime) -> tuple:
    """(logits of the real positions [N_real, V], greedy generate() output with its scores, 3 new tokens)."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=rt.new_cache()).logits
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
            past_key_values=rt.new_cache(), output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    return _real(logits, mask), gen


def _scored_gap(a: tuple, b: tuple, prompt: int) -> float:
    """max |a - b| over the real positions' logits and each row's generate() scores up to and including the first
    step where the two runs' greedy tokens differ."""
    worst = float((a[0] - b[0]).abs().max())
    for i in range(a[1].sequences.shape[0]):
        for t, (x, y) in enumerate(zip(a[1].scores, b[1].scores, strict=True)):
            worst = max(worst, float((x[i] - y[i]).abs().max()))
            if a[1].sequences[i, prompt + t] != b[1].sequences[i, prompt + t]:
                break
    return worst


@pytest.mark.slow  # Triton's CPU interpreter: ~40 s
def test_triton_impl_through_the_model_matches_torch(
    monkeypatch: pytest.MonkeyPatch,
    kv_model: KvModel,
    batch: Batch,
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
    greedy_agree: Callable[..., int],
) -> None:
    """impl='triton' (the kernels in Triton's CPU interpreter) on gpt-oss (sinks, sliding window, left padding)
    with an FP4 cache against the torch reference: both store, bit for bit, nvfp4 of the K/V each write is given
    (exact, what kvcal owns); the logits and scores differ by the two attention kernels' float32 rounding, which
    the later layers' FP4 codes may amplify — held to `batch_bound`, derived here from the same comparison
    through a BF16 cache and nvfp4's response to BF16 rounding of its input; the greedy tokens agree unless the
    best two scores lie within it."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = kv_model("gpt_oss")
    ids, mask = batch(seed=3)
    out = {}
    for impl, fmt, kin in (
        ("torch", "auto", None),
        ("torch", "bf16", None),
        ("triton", "bf16", None),
        ("torch", "nvfp4", "bfloat16"),
        ("torch", "nvfp4", None),
        ("triton", "nvfp4", None),
    ):
        rt = KVRuntime(model, fmt, impl=impl, kv_input_dtype=kin)
        assert rt.describe()["impl"] == ("transformers" if fmt == "auto" else impl)
        rec = kv_recorder(rt) if fmt == "nvfp4" and kin is None else None
        out[impl, fmt, kin] = _scored(model, ids, mask, rt)
        if rec is not None:  # layers x (forward, generate()'s prefill and 2 decode writes); global 1.0
            assert rec.check_stored_as(lambda x, _: formats.fake_quantize(x, "nvfp4", scale=1.0)) == 3 * 4
    p = ids.shape[1]
    gap = lambda a, b: _scored_gap(out[a], out[b], p)  # noqa: E731
    bound = batch_bound(
        gap(("torch", "nvfp4", None), ("torch", "nvfp4", "bfloat16")),
        gap(("triton", "bf16", None), ("torch", "bf16", None)),
        gap(("torch", "bf16", None), ("torch", "auto", None)),
    )
    triton, torch_ = out["triton", "nvfp4", None], out["torch", "nvfp4", None]
    assert gap(("triton", "nvfp4", None), ("torch", "nvfp4", None)) <= bound, bound
    assert greedy_agree(triton[1].sequences, torch_[1].sequences, torch_[1].scores, p, bound) >= 2
    assert float((torch_[0] - out["torch", "auto", None][0]).abs().max()) > bound  # nvfp4 is visible
