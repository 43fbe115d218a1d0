"""LMCache's storage tier in the quantized cache (`--prefix-serde` / `--prefix-tokens`): the K/V of each sequence's
own first N tokens round-trip through the serde before the live format stores them, every other token is stored as
without a serde; padding does not count; a decode step inside the prefix is round-tripped too."""

from __future__ import annotations

import pytest
import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels import cpu_write, fast
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache, QuantizedLayer, own_positions
from kvcal.kernels.plan import parse_cache_plan

pytestmark = pytest.mark.usefixtures("one_thread")

N = 4


def _x(seed: int, t: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, t, 16, generator=g) * 40  # [B, H_kv, T, D]: many values off the e4m3 grid


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def _plan(fmt: str, serde: str | None = "fp8") -> LayerPlan:
    return LayerPlan(
        index=0, fmt=formats.get_format(fmt), kv_input_dtype=torch.bfloat16, prefix_serde=serde,
        prefix_tokens=N if serde else 0,
    )  # fmt: skip


def _stored(layer: QuantizedLayer, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    f = formats.get_format(fmt)
    return formats.dequantize(layer.k, f), formats.dequantize(layer.v, f)


def test_own_positions_count_real_tokens_only() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert own_positions(mask, 0, 5, torch.device("cpu")).tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert own_positions(mask, 3, 2, torch.device("cpu")).tolist() == [[1, 2], [3, 4]]
    assert own_positions(None, 3, 2, torch.device("cpu")).tolist() == [[3, 4]]


def test_bf16_cache_stores_the_fp8_round_trip_of_the_first_n_tokens() -> None:
    k, v = _x(0), _x(1)
    layer = QuantizedLayer(_plan("bf16"))
    layer.update(k, v)
    sk, sv = _stored(layer, "bf16")
    kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    # positions < N: LMCache's fp8 serde of the bf16 K/V (a plain cast, no scale); the rest: bf16 as without it
    assert torch.equal(sk[:, :, :N], _fp8(k.to(torch.bfloat16))[:, :, :N].float())
    assert torch.equal(sv[:, :, :N], _fp8(v.to(torch.bfloat16))[:, :, :N].float())
    assert torch.equal(sk[:, :, N:], kb[:, :, N:]) and torch.equal(sv[:, :, N:], vb[:, :, N:])
    assert not torch.equal(sk[:, :, :N], kb[:, :, :N])  # the round trip did change them


def test_left_padding_does_not_count_toward_the_prefix() -> None:
    k, v = _x(2, 7), _x(3, 7)
    cache = QuantizedKVCache([_plan("bf16")])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    cache.set_attention_mask(mask)
    cache.update(k, v, 0)
    sk, _ = _stored(cache.layers[0], "bf16")
    kb = k.to(torch.bfloat16)
    # row 0: real tokens at positions 2..6, its own tokens 0..3 = positions 2..5; padding stored as zeros
    assert torch.equal(sk[0, :, 2:6], _fp8(kb[0, :, 2:6]).float())
    assert torch.equal(sk[0, :, 6:], kb[0, :, 6:].float()) and not bool(sk[0, :, :2].any())
    assert torch.equal(sk[1, :, :N], _fp8(kb[1, :, :N]).float())
    assert torch.equal(sk[1, :, N:], kb[1, :, N:].float())


def _update_and_read(layer: QuantizedLayer, k: torch.Tensor, v: torch.Tensor) -> None:
    """One forward's write, then the torch attention's read (which fills the workspaces the fused write needs)."""
    kp, _ = layer.update(k, v)
    r = kp.kvcal_read
    fast.dequantize_fast(r.k, r.fmt, r.workspaces[0], r.k_start)
    fast.dequantize_fast(r.v, r.v_fmt or r.fmt, r.workspaces[1], r.k_start)


@pytest.mark.parametrize("fmt", ["bf16", "int8_per_token_head"])
def test_decode_steps_inside_the_prefix_round_trip_too(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a prefill of 2 tokens, then one token per forward, read by the torch attention after each: past the prefix
    # the fused C decode write takes over (it knows no serde), inside it the torch path must; the storage equals
    # one write of every token
    if cpu_write.library() is None:
        pytest.skip("the fused CPU write is not built here")
    fused_at: list[int] = []
    real = cpu_write.write_into

    def spy(*args: object, **kw: object) -> object:
        fused_at.append(steps.cumulative_length)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_write, "write_into", spy)
    k, v = _x(4), _x(5)
    whole = QuantizedLayer(_plan(fmt))
    whole.update(k, v)
    steps = QuantizedLayer(_plan(fmt))
    _update_and_read(steps, k[:, :, :2], v[:, :, :2])
    for t in range(2, k.shape[2]):
        _update_and_read(steps, k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert fused_at == list(range(N, k.shape[2]))  # the fused write ran, but only past the prefix
    for a, b in zip(_stored(whole, fmt), _stored(steps, fmt), strict=True):
        assert torch.equal(a, b)
    plain = QuantizedLayer(_plan(fmt, serde=None))
    plain.update(k, v)
    pk, _ = _stored(plain, fmt)
    sk, _ = _stored(steps, fmt)
    assert torch.equal(sk[:, :, N:], pk[:, :, N:]) and not torch.equal(sk[:, :, :N], pk[:, :, :N])


def test_fp8_live_cache_at_scale_one_is_unchanged_by_the_fp8_serde() -> None:
    # e4m3 values are e4m3 values: the live fp8_e4m3 cache (scale 1.0, the same saturation at 448) stores the
    # serde's output as the K/V themselves, so the storage tier costs nothing more on top of it
    k, v = _x(6) * 5, _x(7) * 5  # some |x| beyond 448
    with_serde, plain = QuantizedLayer(_plan("fp8_e4m3")), QuantizedLayer(_plan("fp8_e4m3", serde=None))
    with_serde.update(k, v)
    plain.update(k, v)
    assert torch.equal(with_serde.k.codes.view(torch.uint8), plain.k.codes.view(torch.uint8))
    assert torch.equal(with_serde.v.codes.view(torch.uint8), plain.v.codes.view(torch.uint8))


def test_aesgcm_is_an_identity_round_trip() -> None:
    k, v = _x(8), _x(9)
    a, b = QuantizedLayer(_plan("int8_per_token_head", "aesgcm")), QuantizedLayer(_plan("int8_per_token_head", None))
    a.update(k, v)
    b.update(k, v)
    assert torch.equal(a.k.codes, b.k.codes) and torch.equal(a.v.block_scales, b.v.block_scales)


def test_plan_refuses_auto_and_keeps_serde() -> None:
    with pytest.raises(UsageError, match="--kv-format auto runs transformers' own"):
        parse_cache_plan("auto", prefix_serde="fp8", prefix_tokens=4)
    plan = parse_cache_plan("bf16", prefix_serde="fp8", prefix_tokens=4)
    assert (plan.prefix_serde, plan.prefix_tokens) == ("fp8", 4)
    assert parse_cache_plan("bf16").prefix_serde is None


def test_runtime_gives_every_layer_the_serde(kv_model: object) -> None:
    import dataclasses

    from kvcal.kernels.runtime import KVRuntime

    model = kv_model("llama")  # type: ignore[operator]
    plan = parse_cache_plan("fp8_e4m3", prefix_serde="fp8", prefix_tokens=4)
    rt = KVRuntime.from_plan(model, dataclasses.replace(plan, skip_layers=frozenset({0})))
    assert [(p.prefix_serde, p.prefix_tokens) for p in rt.plans] == [("fp8", 4)] * len(rt.plans)
    assert rt.plans[0].skipped  # a BF16 (skipped) layer is still reloaded from the storage tier
    # the keyword form parses the same options
    kw = KVRuntime(model, "fp8_e4m3", prefix_serde="fp8", prefix_tokens=4)
    assert [(p.prefix_serde, p.prefix_tokens) for p in kw.plans] == [("fp8", 4)] * len(kw.plans)


def test_turboquant_serde_in_the_cache_uses_the_layers_seed() -> None:
    from kvcal import serde

    k, v = _x(10, 6), _x(11, 6)
    plan = LayerPlan(
        index=3, fmt=formats.get_format("bf16"), kv_input_dtype=torch.bfloat16,
        prefix_serde="turboquant_4bit_nc", prefix_tokens=N,
    )  # fmt: skip
    layer = QuantizedLayer(plan)
    layer.update(k, v)
    sk, sv = _stored(layer, "bf16")
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    assert torch.equal(sk[:, :, :N], serde.round_trip("turboquant_4bit_nc", kb, "k", 3)[:, :, :N].float())
    assert torch.equal(sv[:, :, :N], serde.round_trip("turboquant_4bit_nc", vb, "v", 3)[:, :, :N].float())
    assert torch.equal(sk[:, :, N:], kb[:, :, N:].float())
    assert not torch.equal(sk[:, :, :N], serde.round_trip("turboquant_4bit_nc", kb, "k", 2)[:, :, :N].float())


def test_runtime_leaves_turboquants_raw_layers_alone() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcal.kernels.runtime import KVRuntime

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    rt = KVRuntime.from_plan(model, parse_cache_plan("bf16", prefix_serde="turboquant_k8v4", prefix_tokens=4))
    # LMCache stores layers 0, 1, 4, 5 raw (skip_first_layers / skip_last_layers = 2): no round trip there
    assert [p.prefix_serde for p in rt.plans] == [None, None, "turboquant_k8v4", "turboquant_k8v4", None, None]
    ids = torch.arange(1, 9)[None, :]
    with torch.no_grad():  # and it runs: layers 2-3 reload their first 4 tokens through the serde
        assert torch.isfinite(model(ids, past_key_values=rt.new_cache()).logits).all()
