"""See K and V exactly as the model writes them into its KV cache.

Every decoder that transformers (5.x) routes through its cache calls, inside each attention layer,

    key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

after RoPE and after any k-norm (Llama, Qwen2, Mistral, Gemma 2, Gemma 3, gpt-oss ...). `ObservingCache`
is a `DynamicCache` whose `update` hands `(layer_idx, key_states, value_states)` to a sink first, so the
observed tensors are bit for bit what the cache stores (and what an engine would quantize) — no per-architecture
module patching, no re-computation of RoPE.

Streaming: calibration runs one prefill per batch, and in a prefill the attention reads exactly the
`key_states`/`value_states` of this forward (the cache is empty before it). With `store=False` the cache
therefore returns them without keeping anything, so peak memory is the model plus one batch's activations and
only the sink's statistics survive between batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from kvcal.errors import KvcalError

# sink(layer_idx, k, v) with k, v: [B, H_kv, T, D] as written to the cache
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# progress(done, total, phase)
ProgressFn = Callable[[int, int, str], None]


class _StopForward(Exception):
    """Raised after the last layer's K/V write: the rest of the forward (its attention, MLP, norm) is not needed."""


class ObservingCache(DynamicCache):
    """A DynamicCache that shows every K/V write to `sink`; with store=False it keeps nothing (prefill only).
    `stop_after`: raise _StopForward once that layer's K/V has been observed (the caller catches it)."""

    def __init__(self, config: Any, sink: KVSink, store: bool = False, stop_after: int | None = None) -> None:
        super().__init__(config=config)
        self._sink = sink
        self._store = store
        self._stop_after = stop_after
        self.seen_layers: set[int] = set()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, T, D] (post-RoPE, post-k-norm)
        self._sink(layer_idx, key_states, value_states)
        self.seen_layers.add(layer_idx)
        if layer_idx == self._stop_after:
            raise _StopForward
        if self._store:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return key_states, value_states


def _backbone(model: Any) -> Any:
    """The decoder without its LM head: calibration needs K/V only, and the head (vocab x hidden per token) is a
    large share of a small model's FLOPs (Gemma 3 270M: 262k-token vocabulary)."""
    base = getattr(model, "base_model", None)
    return base if base is not None and base is not model else model


def forward_observed(
    model: Any, input_ids: torch.Tensor, sink: KVSink, stop_after: int | None = None
) -> set[int]:
    """One prefill of `input_ids` [B, T] through the model's backbone; returns the layer indices that wrote K/V.
    `stop_after`: the last layer index to observe; the forward ends right after its K/V write."""
    cache = ObservingCache(model.config, sink, store=False, stop_after=stop_after)
    device = next(model.parameters()).device
    try:
        _backbone(model)(input_ids=input_ids.to(device), past_key_values=cache, use_cache=True)
    except _StopForward:
        pass
    except TypeError as exc:
        if "past_key_values" in str(exc) or "use_cache" in str(exc):
            raise KvcalError(
                f"model type '{model.config.model_type}' does not take a KV cache (past_key_values); "
                "kvcal calibrates decoder-only models with a per-head K/V cache"
            ) from exc
        raise
    return cache.seen_layers


def observe(
    model: Any,
    samples: Sequence[torch.Tensor] | Iterable[torch.Tensor],
    sink: KVSink,
    expected_layers: int,
    progress: ProgressFn | None = None,
    phase: str = "observe",
) -> None:
    """Run every sample (1-D token ids, each its own batch of one) through the model, K/V to `sink`.

    Raises KvcalError when the model never writes some layers' K/V (no KV cache, or a layout kvcal does not see).
    """
    samples = list(samples)
    total = len(samples)
    if progress:
        progress(0, total, phase)
    with torch.no_grad():
        for i, ids in enumerate(samples):
            seen = forward_observed(model, ids.reshape(1, -1), sink, stop_after=expected_layers - 1)
            if i == 0 and len(seen) < expected_layers:
                missing = sorted(set(range(expected_layers)) - seen)
                if not seen:
                    raise KvcalError(
                        f"model type '{model.config.model_type}' wrote nothing to its KV cache during a forward "
                        "pass; kvcal calibrates decoder-only models that cache per-head K/V"
                    )
                raise KvcalError(
                    f"layers {missing[:8]} of model type '{model.config.model_type}' did not write K/V to the "
                    "cache (shared or absent KV); kvcal cannot calibrate this architecture"
                )
            if progress:
                progress(i + 1, total, phase)


def check_finite(layer_idx: int, name: str, amax: torch.Tensor) -> None:
    """KvcalError naming the layer when K or V holds NaN/Inf (amax propagates both)."""
    if not bool(torch.isfinite(amax).all()):
        bad = amax.flatten().tolist()
        kind = "NaN" if any(math.isnan(a) for a in bad) else "Inf"
        raise KvcalError(
            f"non-finite activations ({kind}) in {name} of layer {layer_idx}; the model overflows in this dtype "
            "or its weights are broken — try --dtype float32 or check the checkpoint"
        )
