"""Replaying the reference forward's untouched layers (kvcal.pipeline.replay): plan's damage and sensitivity's
numbers are bit-identical to full forwards, on every tiny architecture kvcal supports and batched, and the layers
before a config's first quantized layer really do not run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kvcal.pipeline.replay as replay_module
from kvcal.models.geometry import kv_spec
from kvcal.models.loading import load_model
from kvcal.pipeline.plan import measure_damage, per_sample_kl, plan_quant
from kvcal.pipeline.replay import LayerReplay, decoder_layers, first_quantized
from kvcal.pipeline.sensitivity import layer_sensitivity

pytestmark = pytest.mark.usefixtures("one_thread")
CANDIDATES = ["bf16", "fp4_e2m1", "int8_per_token_head", "k=fp8_e4m3,v=nvfp4"]


def _samples(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length - 2 * i,), generator=g) for i in range(n)]


def _without_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay_module, "decoder_layers", lambda model, n: None)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_damage_with_replay_is_bit_identical_to_full_forwards(
    arch: str, batch_size: int, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    lm = load_model(str(tiny_model_dir(arch)))
    kv = kv_spec(lm.model.config)
    samples = _samples(3, 20)  # longer than the tiny sliding window (8): the window really slides
    assert decoder_layers(lm.model, kv.num_layers) is not None
    fast = measure_damage(lm.model, samples, kv, CANDIDATES, {}, batch_size)
    # a joint plan too: its first quantized layer is 1, so layer 0 is replayed
    plans = [["bf16"] + ["fp4_e2m1"] * (kv.num_layers - 1), ["fp4_e2m1"] * kv.num_layers]
    joint_fast = per_sample_kl(lm.model, samples, [plan_quant(p, {}) for p in plans], batch_size)
    sens_fast = layer_sensitivity(lm.model, samples, kv, _fmt("fp4_e2m1"), [None] * 99, [None] * 99, batch_size=2)
    _without_replay(monkeypatch)
    slow = measure_damage(lm.model, samples, kv, CANDIDATES, {}, batch_size)
    joint_slow = per_sample_kl(lm.model, samples, [plan_quant(p, {}) for p in plans], batch_size)
    sens_slow = layer_sensitivity(lm.model, samples, kv, _fmt("fp4_e2m1"), [None] * 99, [None] * 99, batch_size=2)
    assert torch.equal(fast.per_sample, slow.per_sample)
    # every quantized candidate moved something (not every single value: a tiny KL can round to 0 or below)
    assert bool((fast.per_sample[:, :, 1:].abs().amax(dim=(0, 1)) > 0).all())
    assert torch.equal(joint_fast, joint_slow)
    assert sens_fast == sens_slow


def _fmt(name: str) -> Any:
    from kvcal.formats import get_format

    return get_format(name)


def test_layers_before_the_first_quantized_one_do_not_run(tiny_llama_dir: Path) -> None:
    """Per batch: the reference runs L layers, a one-layer forward at layer i runs L - i (the cost claim in
    docs/commands.md); the model's forward itself still runs once per config."""
    lm = load_model(str(tiny_llama_dir))
    kv = kv_spec(lm.model.config)
    n = kv.num_layers
    runs = [0] * n
    layers = decoder_layers(lm.model, n)
    assert layers is not None
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        for i, layer in enumerate(layers)
    ]
    try:
        measure_damage(lm.model, _samples(4, 10), kv, ["bf16", "fp4_e2m1", "int8_per_token_head"], {}, 2)
    finally:
        for h in handles:
            h.remove()
    batches, quantized = 2, 2
    # layer j runs in the reference and in every one-layer forward at layers 0..j
    assert runs == [batches * (1 + quantized * (j + 1)) for j in range(n)]
    assert all("forward" not in layer.__dict__ for layer in layers)  # the model is left as it was


def test_first_quantized_and_an_empty_capture() -> None:
    assert first_quantized([None, None, 1, None]) == 2
    assert first_quantized([None, None]) == 2
    replay = LayerReplay(torch.nn.Linear(2, 2), 3)  # no decoder layers: nothing captured, nothing skipped
    with replay.capture():
        pass
    with replay.skip(2):
        assert replay.outputs == []
