"""The kernels tests' tiny models and inputs: every supported family with its reference attention, and a
left-padded batch. Their geometry (vocab 96, head_dim 16, max_pos 128, sliding window 6, layers sliding / full /
sliding) is the kernels tests' own, distinct from the calibration models in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    DynamicCache,
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

from kvcal import formats
from kvcal.formats import QTensor
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache, new_token_padding

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


# ------------------------------------------------------- what a padded batch stores, row by row (issue 21)


class RecordingKVCache(QuantizedKVCache):
    """kvcal's own QuantizedKVCache that also keeps, for every write, the K/V it was given, which of the new
    tokens were real, and what it stored for them (cloned: later writes reuse the buffers). Nothing is replaced:
    the forward runs through the real cache, the recording only lets a test replay each row alone."""

    def __init__(self, plans: list[LayerPlan], nonfinite: Any = None) -> None:
        super().__init__(plans, nonfinite)
        # (layer, K [B, H_kv, T_new, D], V, valid [B, T_new] bool or None, stored K, stored V of the T_new tokens)
        self.writes: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None, QTensor, QTensor]] = []
        # (number of writes before it, beam_idx [B]) of every beam-search reorder
        self.reorders: list[tuple[int, torch.Tensor]] = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t_new = key_states.shape[-2]
        valid = new_token_padding(self.attention_mask, self.layers[layer_idx].cumulative_length, t_new)
        k, v = key_states.clone(), value_states.clone()
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        read = out[0].kvcal_read  # type: ignore[attr-defined]
        new = slice(read.k.codes.shape[-2] - t_new, None)  # the tokens of this write: the last t_new read
        self.writes.append(
            (layer_idx, k, v, valid, _tokens(read.k, new, clone=True), _tokens(read.v, new, True))
        )
        return out

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.reorders.append((len(self.writes), beam_idx.clone()))
        super().reorder_cache(beam_idx)


def _tokens(q: QTensor, pos: slice | torch.Tensor, clone: bool = False, row: int | None = None) -> QTensor:
    """Token positions `pos` (of dim -2) of q, optionally one batch row; a per-sequence scale [B, 1, 1, 1]
    follows the row, a per-tensor scale is kept."""
    rows = slice(None) if row is None else slice(row, row + 1)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t[rows][:, :, pos]
        return t.clone() if clone else t

    s = q.scale
    if s is not None and s.dim() == 4:
        s = s[rows]
    if clone and s is not None:
        s = s.clone()
    return QTensor(codes=take(q.codes), block_scales=take(q.block_scales), scale=s)  # type: ignore[arg-type]


def _bytes(t: torch.Tensor | None) -> bytes | None:
    return (
        None if t is None else t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )


def _same_bytes(a: QTensor, b: QTensor) -> bool:
    return all(
        _bytes(x) == _bytes(y)
        for x, y in ((a.codes, b.codes), (a.block_scales, b.block_scales), (a.scale, b.scale))
    )


def _check_rows_stored_alone(cache: RecordingKVCache) -> int:
    """Every row of every recorded batch write stored exactly (byte for byte: codes, block scales, scale) what a
    fresh cache stores when that row's real tokens are written alone, write after write; its padding is stored as
    zeros. Returns the number of (layer, row, write) checked (so a caller can see the check was not vacuous)."""
    checked = 0
    for layer_idx, plan in enumerate(cache.plans):
        writes = [w for w in cache.writes if w[0] == layer_idx]
        if not writes:
            continue
        for row in range(writes[0][1].shape[0]):
            alone = QuantizedKVCache([plan])
            for _, k, v, valid, got_k, got_v in writes:
                real = torch.ones(k.shape[-2], dtype=torch.bool) if valid is None else valid[row].cpu()
                if not bool(real.any()):
                    continue
                idx = real.nonzero().flatten()
                ak, av = alone.update(k[row : row + 1][:, :, idx], v[row : row + 1][:, :, idx], 0)
                read = ak.kvcal_read  # type: ignore[attr-defined]
                mine = slice(read.k.codes.shape[-2] - len(idx), None)
                for got, want, fmt in (
                    (got_k, read.k, plan.side_format("k")),
                    (got_v, read.v, plan.side_format("v")),
                ):
                    assert _same_bytes(_tokens(got, idx, row=row), _tokens(want, mine)), (
                        layer_idx,
                        row,
                        fmt.name,
                    )
                    pad = (~real).nonzero().flatten()
                    if len(pad):
                        stored = formats.dequantize(_tokens(got, pad, row=row), fmt)
                        assert torch.equal(stored, torch.zeros_like(stored)), (layer_idx, row, fmt.name)
                checked += 1
    return checked


class KVRecorder:
    """Makes a KVRuntime hand out RecordingKVCaches (its `new_cache`, for this test only) and checks them."""

    def __init__(self, runtime: Any) -> None:
        self.caches: list[RecordingKVCache] = []
        self.runtime = runtime
        runtime.new_cache = (
            self.new_cache
        )  # the adapter's _model_call asks the runtime for each forward's cache

    def new_cache(self) -> RecordingKVCache:
        cache = RecordingKVCache(self.runtime.plans, self.runtime.nonfinite)
        self.caches.append(cache)
        return cache

    def check_rows_stored_alone(self) -> int:
        """`_check_rows_stored_alone` over every cache handed out; the number of checks."""
        return sum(_check_rows_stored_alone(c) for c in self.caches)

    def check_stored_as(self, reference: Callable[[torch.Tensor, str], torch.Tensor]) -> int:
        """Every write of every cache handed out stored, for its real tokens, values that dequantize bit for bit
        to reference(the K or V it was given [B, H_kv, T_new, D], "k" | "v"), and zeros for its padding. Exact
        on any CPU: both sides quantize the same K/V, whatever rounding the CPU's matmuls did upstream. Returns
        the number of writes checked."""
        checked = 0
        for cache in self.caches:
            for layer_idx, k, v, valid, got_k, got_v in cache.writes:
                plan = cache.plans[layer_idx]
                for x, got, side in ((k, got_k, "k"), (v, got_v, "v")):
                    stored = formats.dequantize(got, plan.side_format(side))  # [B, H_kv, T_new, D] float32
                    want = reference(x, side).float()
                    real = torch.ones(x.shape[0], x.shape[-2], dtype=torch.bool) if valid is None else valid
                    real = real.cpu()[:, None, :, None].expand_as(stored)
                    assert torch.equal(stored[real].view(torch.int32), want[real].view(torch.int32)), (
                        layer_idx,
                        side,
                    )
                    assert not bool(stored[~real].any()), (layer_idx, side)  # padding stored as zeros
                checked += 1
        return checked

    def check_replayed_as(self, reference: Callable[[torch.Tensor, str], torch.Tensor], config: Any) -> int:
        """Every cache handed out holds at the end, layer by layer, exactly what transformers' DynamicCache (its
        sliding windows from `config`) holds after the same writes — reference(the K or V given, "k" | "v"), zeros
        for padding — and the same beam reorders (`reorder_cache`), in the same order; the tokens both keep are
        compared (a sliding DynamicCache keeps window - 1). Exact on any CPU: both sides are given the same K/V and
        index the same rows. Returns the number of reorders replayed."""
        replayed = 0
        for cache in self.caches:
            ref = DynamicCache(config=config)
            done = 0  # reorders replayed so far; cache.reorders[i][0] = the writes made before it
            for n, write in enumerate([*cache.writes, None]):
                while done < len(cache.reorders) and cache.reorders[done][0] <= n:
                    ref.reorder_cache(cache.reorders[done][1])
                    done += 1
                if write is None:
                    break
                layer_idx, k, v, valid, _, _ = write
                real = torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool) if valid is None else valid.cpu()
                real = real[:, None, :, None]
                ref.update(
                    *(torch.where(real, reference(x, s), 0.0) for x, s in ((k, "k"), (v, "v"))), layer_idx
                )
            replayed += done
            for layer_idx, layer in enumerate(cache.layers):
                if layer.k is None:
                    continue
                plan = cache.plans[layer_idx]
                for got, want, side in (
                    (layer.k, ref.layers[layer_idx].keys, "k"),
                    (layer.v, ref.layers[layer_idx].values, "v"),
                ):
                    stored = formats.dequantize(got, plan.side_format(side))  # [B, H_kv, kept, D] float32
                    m = min(stored.shape[-2], want.shape[-2])
                    assert m > 0 and torch.equal(stored[..., -m:, :], want[..., -m:, :].float()), (
                        layer_idx,
                        side,
                    )
        return replayed


@pytest.fixture(scope="session")
def kv_recorder() -> Callable[[Any], KVRecorder]:
    """(runtime) -> a KVRecorder: the runtime's caches record every write; `.check_rows_stored_alone()` asserts
    each row of a padded batch stored, byte for byte, what the same row's real K/V store when written alone;
    `.check_stored_as(reference)` that every write stored bit for bit what an independent reference makes of
    the K/V it was given; `.check_replayed_as(reference, config)` that each cache ends as transformers'
    DynamicCache does after the same writes and beam reorders."""
    return KVRecorder
