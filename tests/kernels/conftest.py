"""The kernels tests' tiny models and inputs: every supported family with its reference attention, and a
left-padded batch. Their geometry (vocab 96, head_dim 16, max_pos 128, sliding window 6, layers sliding / full /
sliding) is the kernels tests' own, distinct from the calibration models in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

WINDOW = 6
COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
SWA3 = ["sliding_attention", "full_attention", "sliding_attention"]


def _arch(arch: str, common: dict[str, Any]) -> tuple[Any, type, str]:
    """(config, model class, reference attention implementation) of `arch`. The reference is `sdpa`, except
    Gemma 2 (sdpa ignores its logit softcap) and gpt-oss (its sinks need eager)."""
    if arch == "llama":
        return LlamaConfig(**common), LlamaForCausalLM, "sdpa"
    if arch == "qwen2":
        return Qwen2Config(**common), Qwen2ForCausalLM, "sdpa"
    if arch == "mistral":
        return MistralConfig(sliding_window=WINDOW, **common), MistralForCausalLM, "sdpa"
    if arch == "gemma2":
        cfg = Gemma2Config(
            sliding_window=WINDOW,
            layer_types=SWA3,
            attn_logit_softcapping=0.5,  # small enough to bite on a random model
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
            **common,
        )
        return cfg, Gemma2ForCausalLM, "eager"
    if arch == "gemma3":
        cfg = Gemma3TextConfig(sliding_window=WINDOW, layer_types=SWA3, query_pre_attn_scalar=24, **common)
        return cfg, Gemma3ForCausalLM, "sdpa"
    if arch == "gpt_oss":
        cfg = GptOssConfig(
            sliding_window=WINDOW, layer_types=SWA3, num_local_experts=4, num_experts_per_tok=2, **common
        )
        return cfg, GptOssForCausalLM, "eager"
    raise ValueError(f"no kernels test model for {arch!r}")


def _build(arch: str, seed: int = 0, head_dim: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    config, cls, ref_attn = _arch(arch, {**COMMON, "head_dim": head_dim})
    config._attn_implementation = ref_attn
    model = cls(config).eval()
    with torch.no_grad():
        for mod in model.modules():  # gpt-oss: sinks of order 1 so they matter
            if hasattr(mod, "sinks"):
                mod.sinks.normal_(0.0, 1.0)
    return model


def _batch(seed: int = 1, length: int = 13, pad: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


@pytest.fixture(scope="session")
def kv_model() -> Callable[..., torch.nn.Module]:
    """(arch, seed=0, head_dim=16) -> a NEW tiny random float32 model of `arch` (llama, qwen2, mistral, gemma2,
    gemma3, gpt_oss) in eval mode with its reference attention implementation; tests may modify it."""
    return _build


@pytest.fixture(scope="session")
def batch() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """(seed=1, length=13, pad=4) -> two prompts, the second left-padded by `pad` tokens:
    input_ids, attention_mask [2, length]."""
    return _batch


@pytest.fixture(scope="session", autouse=True)
def _fused_cpu_write_status(request: pytest.FixtureRequest) -> None:
    """Say once per run whether the fused CPU write (kvcal/kernels/cpu_write.c) is built and used here, or why not
    (its tests then skip with that reason, shown by -ra): "fused CPU write: compiled: PATH" / "skipped: REASON"."""
    from kvcal.kernels import cpu_write

    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nfused CPU write: {cpu_write.status()}")
