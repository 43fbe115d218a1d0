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

Batches (`observe(batch_size=N)`): samples of similar length are right-padded into one forward; the sink sees
only the real tokens (`unpad`), and attention runs row by row on each row's own length (`per_row_attention`), so
the K/V a sink sees are bit for bit those of one sample per forward (tests/calibrate/test_batched.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcal.errors import KvcalError, UsageError
from kvcal.models.loading import input_device

# sink(layer_idx, k, v) with k, v: [B, H_kv, T, D] as written to the cache
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# progress(done, total, phase)
ProgressFn = Callable[[int, int, str], None]
# the attention implementation batched observation installs for the duration of its forwards
ROWWISE_ATTN = "kvcal_rowwise"


class _StopForward(Exception):
    """Raised after the last layer's K/V write: the rest of the forward (its attention, MLP, norm) is not needed."""


class ObservingCache(DynamicCache):
    """A DynamicCache that shows every K/V write to `sink`; with store=False it keeps nothing (prefill only).
    `stop_after`: raise _StopForward once that layer's K/V has been observed (the caller catches it)."""

    def __init__(
        self,
        config: Any,
        sink: KVSink,
        store: bool = False,
        stop_after: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config=config)
        self._sink = sink
        self._store = store
        self._stop_after = stop_after
        self._lengths = list(lengths) if lengths is not None else None  # real tokens per row (right padding)
        self.seen_layers: set[int] = set()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, T, D] (post-RoPE, post-k-norm); the sink sees real tokens only
        self._sink(layer_idx, unpad(key_states, self._lengths), unpad(value_states, self._lengths))
        self.seen_layers.add(layer_idx)
        if layer_idx == self._stop_after:
            raise _StopForward
        if self._store:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return key_states, value_states


def unpad(x: torch.Tensor, lengths: Sequence[int] | None) -> torch.Tensor:
    """The real tokens of a right-padded batch x: [B, H_kv, T, D] -> [1, H_kv, sum(lengths), D] (x itself when no
    row is padded). Padded positions never reach an observer: min/max, histograms and candidate errors see only
    what batch-1 forwards would have shown them."""
    if lengths is None or all(n == x.shape[2] for n in lengths):
        return x
    return torch.cat([x[b, :, :n] for b, n in enumerate(lengths)], dim=1).unsqueeze(0)


def pad_batch(samples: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, list[int]]:
    """1-D token id samples -> right-padded input_ids [B, T_max] and each row's length.

    Right padding needs no attention mask: under causal attention a real token at position t reads positions <= t
    only, all real, with the position ids (0..t) it has alone; the pad tokens after it change nothing it computes
    and `unpad` hides their K/V from the sinks."""
    lengths = [int(s.numel()) for s in samples]
    ids = torch.full((len(samples), max(lengths)), pad_id, dtype=torch.int64)
    for b, s in enumerate(samples):
        ids[b, : lengths[b]] = s.reshape(-1)
    return ids, lengths


def batches(samples: Sequence[torch.Tensor], batch_size: int) -> list[list[int]]:
    """Sample indices grouped `batch_size` at a time. Batch 1 keeps the given order; larger batches group samples
    of similar length (longest first) so little compute goes to padding — statistics do not depend on order."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
    order = list(range(len(samples)))
    if batch_size > 1:
        order.sort(key=lambda i: -int(samples[i].numel()))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def attention_fn(module: torch.nn.Module, impl: str, purpose: str) -> Callable[..., Any]:
    """The attention function a module runs under implementation `impl`: a registered one (sdpa, ...) or the
    modeling file's own `eager_attention_forward`. `purpose` completes the error ("cannot {purpose} of ...")."""
    if impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise KvcalError(
            f"cannot {purpose} of {type(module).__name__}: its attention implementation '{impl}' is neither "
            "registered with transformers nor the modeling file's eager_attention_forward"
        )
    return fn


@contextmanager
def per_row_attention(model: Any, lengths: list[int]) -> Iterator[None]:
    """While active, the model's attention runs row by row on each row's real tokens, with the very shapes and
    mask a batch-1 forward has: attention kernels block the key axis by its length (PyTorch's CPU flash attention
    picks its split sizes from T), so a row padded to T_max would round differently. Everything else in a decoder
    works token by token, so a right-padded batch then gives bit-identical K/V to batch-1 forwards.
    `lengths` (mutable, set per batch) holds each row's real token count."""
    original = model.config._attn_implementation

    def rows(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # query: [B, H_q, T, D]; key, value: [B, H_kv, T, D]; mask: [B, 1, T, T] or None (causal)
        fn = attention_fn(module, original, "batch calibration (use --batch-size 1)")
        t = query.shape[2]
        outs = []
        for b, n in enumerate(lengths):
            mask = None if attention_mask is None else attention_mask[b : b + 1, :, :n, :n]
            sl = (slice(b, b + 1), slice(None), slice(0, n))
            out = fn(module, query[sl], key[sl], value[sl], mask, *args, **kwargs)[0]  # [1, n, H_q, D]
            outs.append(torch.nn.functional.pad(out, (0, 0, 0, 0, 0, t - n)))
        return torch.cat(outs), None

    ALL_ATTENTION_FUNCTIONS.register(ROWWISE_ATTN, rows)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ROWWISE_ATTN, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(ROWWISE_ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


def _backbone(model: Any) -> Any:
    """The decoder without its LM head: calibration needs K/V only, and the head (vocab x hidden per token) is a
    large share of a small model's FLOPs (Gemma 3 270M: 262k-token vocabulary)."""
    base = getattr(model, "base_model", None)
    return base if base is not None and base is not model else model


def forward_observed(
    model: Any,
    input_ids: torch.Tensor,
    sink: KVSink,
    stop_after: int | None = None,
    lengths: Sequence[int] | None = None,
) -> set[int]:
    """One prefill of `input_ids` [B, T] through the model's backbone; returns the layer indices that wrote K/V.
    `stop_after`: the last layer index to observe; the forward ends right after its K/V write. `lengths`: real
    tokens per row of a right-padded batch (see `pad_batch`); the sink never sees the padding."""
    cache = ObservingCache(model.config, sink, store=False, stop_after=stop_after, lengths=lengths)
    try:
        _backbone(model)(input_ids=input_ids.to(input_device(model)), past_key_values=cache, use_cache=True)
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
    batch_size: int = 1,
) -> None:
    """Run every sample (1-D token ids) through the model, `batch_size` per forward (right-padded, padding hidden
    from the sink), K/V to `sink`.

    Raises KvcalError when the model never writes some layers' K/V (no KV cache, or a layout kvcal does not see).
    """
    samples = list(samples)
    total = len(samples)
    groups = batches(samples, batch_size)
    if progress:
        progress(0, total, phase)
    done = 0
    row_lengths: list[int] = []
    rowwise = per_row_attention(model, row_lengths) if batch_size > 1 else nullcontext()
    with torch.no_grad(), rowwise:
        for i, group in enumerate(groups):
            ids, lengths = pad_batch([samples[j] for j in group])
            row_lengths[:] = lengths
            seen = forward_observed(model, ids, sink, stop_after=expected_layers - 1, lengths=lengths)
            done += len(group)
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
                progress(done, total, phase)


def check_finite(layer_idx: int, name: str, amax: torch.Tensor) -> None:
    """KvcalError naming the layer when K or V holds NaN/Inf (amax propagates both)."""
    if not bool(torch.isfinite(amax).all()):
        bad = amax.flatten().tolist()
        kind = "NaN" if any(math.isnan(a) for a in bad) else "Inf"
        raise KvcalError(
            f"non-finite activations ({kind}) in {name} of layer {layer_idx}; the model overflows in this dtype "
            "or its weights are broken — try --dtype float32 or check the checkpoint"
        )
