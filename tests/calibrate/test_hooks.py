"""The observing cache sees K/V exactly as transformers' DynamicCache stores them, for every architecture."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import DynamicCache

from kvcal.calibrate.hooks import ObservingCache, _backbone, observe
from kvcal.errors import KvcalError
from kvcal.models.geometry import kv_spec

ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt_oss")  # tests/conftest.py's tiny models
WINDOW = 8  # their sliding window
T = 3 * WINDOW + 5  # longer than the sliding window: sliding layers keep only their tail

TinyModel = Callable[[str], torch.nn.Module]  # the `tiny_model` fixture of tests/conftest.py

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ARCHS)
def test_observed_kv_equals_dynamic_cache(arch: str, tiny_model: TinyModel) -> None:
    model = tiny_model(arch)
    kv = kv_spec(model.config)
    ids = torch.randint(3, 320, (2, T), generator=torch.Generator().manual_seed(1))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sink(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        seen[i] = (k.clone(), v.clone())

    backbone = _backbone(model)
    assert backbone is not model  # the LM head is skipped
    with torch.no_grad():
        observed_out = backbone(
            input_ids=ids, past_key_values=ObservingCache(model.config, sink), use_cache=True
        )
        ref_cache = DynamicCache(config=model.config)
        ref_out = backbone(input_ids=ids, past_key_values=ref_cache, use_cache=True)
    # not storing changes nothing in the forward
    torch.testing.assert_close(observed_out.last_hidden_state, ref_out.last_hidden_state, rtol=0, atol=0)
    assert sorted(seen) == list(range(kv.num_layers))
    sliding_seen = 0
    for layer in kv.layers:
        k, v = seen[layer.index]
        assert k.shape == (2, layer.kv_heads, T, layer.head_dim)  # [B, H_kv, T, D]
        stored_k, stored_v = ref_cache.layers[layer.index].keys, ref_cache.layers[layer.index].values
        n = stored_k.shape[-2]
        if layer.type == "sliding_attention":
            assert n < T  # the cache slid: it stores the tail of what was written
            sliding_seen += 1
        else:
            assert n == T
        torch.testing.assert_close(k[..., T - n :, :], stored_k, rtol=0, atol=0)
        torch.testing.assert_close(v[..., T - n :, :], stored_v, rtol=0, atol=0)
    if arch in ("qwen2", "mistral", "gemma2", "gemma3", "gpt_oss"):
        assert sliding_seen > 0
    # the streamed path (ends each forward right after the last layer's K/V write) sees the same tensors
    streamed: dict[int, list[torch.Tensor]] = {}
    observe(
        model, [ids[0], ids[1]], lambda i, k, v: streamed.setdefault(i, []).append(k.clone()), kv.num_layers
    )
    for i, (k, _v) in seen.items():
        torch.testing.assert_close(torch.cat(streamed[i], 0), k, rtol=1e-6, atol=1e-6)


def test_observe_streams_and_reports_progress(tiny_model: TinyModel) -> None:
    model = tiny_model("llama")
    calls: list[tuple[int, int, str]] = []
    shapes: list[tuple[int, ...]] = []
    samples = [torch.arange(3, 3 + n) for n in (5, 9, 7)]
    observe(
        model, samples, lambda i, k, v: shapes.append(tuple(k.shape)), 3, progress=lambda *a: calls.append(a)
    )
    assert calls[0] == (0, 3, "observe") and calls[-1] == (3, 3, "observe")
    assert [s[2] for s in shapes[::3]] == [5, 9, 7]  # each sample its own batch, all layers


def test_model_that_writes_no_cache_is_refused(tiny_model: TinyModel) -> None:
    model = tiny_model("llama")
    with pytest.raises(KvcalError, match="did not write K/V|wrote nothing"):
        observe(model, [torch.arange(3, 9)], lambda i, k, v: None, expected_layers=5)


@pytest.mark.parametrize("arch", ARCHS)
def test_early_stop_sees_the_full_forwards_kv_bit_for_bit(arch: str, tiny_model: TinyModel) -> None:
    """Calibration's forward ends right after the last layer's K/V write (no last-layer attention output, MLP,
    final norm or LM head): every layer's K/V equal those of the whole model's forward bit for bit, so the scale
    file is the one the full forward would give; and the work after the last K/V write is really skipped."""
    from kvcal.calibrate.hooks import forward_observed

    model = tiny_model(arch)
    n = kv_spec(model.config).num_layers
    ids = torch.randint(3, 320, (1, T), generator=torch.Generator().manual_seed(2))
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    early: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():  # the whole model, LM head included, with the same observing cache and no stop
        model(
            input_ids=ids,
            past_key_values=ObservingCache(
                model.config, lambda i, k, v: full.setdefault(i, (k.clone(), v.clone()))
            ),
            use_cache=True,
        )
    ran: list[str] = []
    last = _backbone(model).layers[-1]
    tails = {
        "last mlp": last.mlp,
        "final norm": _backbone(model).norm,
        "lm head": model.get_output_embeddings(),
    }
    handles = [m.register_forward_hook(lambda *_a, name=name: ran.append(name)) for name, m in tails.items()]
    try:
        with torch.no_grad():
            seen = forward_observed(
                model, ids, lambda i, k, v: early.setdefault(i, (k.clone(), v.clone())), stop_after=n - 1
            )
    finally:
        for h in handles:
            h.remove()
    assert seen == set(range(n)) and sorted(full) == sorted(early) == list(range(n))
    for i in range(n):
        assert torch.equal(full[i][0], early[i][0]) and torch.equal(full[i][1], early[i][1])
    assert ran == []
