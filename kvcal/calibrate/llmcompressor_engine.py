"""`--engine llmcompressor`: llm-compressor's `oneshot` with a `kv_cache_scheme`, on kvcal's token sequences.

llm-compressor (0.14) / compressed-tensors (0.19) wrap each attention module's cache in a `QuantizedKVCache`
whose pre-hooks feed `k_observer` / `v_observer` with the post-RoPE K/V, then store `k_scale` / `v_scale`
(amax / 448 for FP8) on the attention module. kvcal runs it with the basic pipeline (full forwards, quantization
disabled while calibrating, as llm-compressor does), batch size 1, no shuffling, on the SAME samples the native
engine uses, and reads the scales back into a ScaleSet.

THE TRAP: the observer of a QuantizationArgs defaults to `minmax`, which in 0.14 is a MOVING AVERAGE of per-batch
min/max (averaging constant 0.01) — over shuffled samples that estimate stays close to the first batches' amax:
on SmolLM2-135M its scales came out at 0.50-0.98x of the true amax, so larger K/V values saturate. kvcal
therefore asks for `static_minmax` (the running max, = kvcal's `minmax`, agreement to 1e-6 relative), and still
computes the clipped fraction / SQNR of whatever scales come back, from its own histograms of the same forward
passes (a hook on the QuantizedKVCache), so `kvcal show` exposes an under-estimating observer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcal.calibrate.hooks import KVSink
from kvcal.errors import KvcalError, UsageError

LLMC_OBSERVERS = ("static_minmax", "minmax", "memoryless_minmax", "mse")


def _attention_modules(model: Any) -> list[tuple[int, Any]]:
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module

    mods = []
    for module in model.modules():
        if is_cached_attention_module(module) and hasattr(module, "layer_idx"):
            mods.append((int(module.layer_idx), module))
    return sorted(mods, key=lambda t: t[0])


def llmcompressor_scales(
    model: Any,
    samples: Sequence[torch.Tensor],
    granularity: str,
    observer: str = "static_minmax",
    sink: KVSink | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FP8-E4M3 k/v scales from llm-compressor's oneshot ((1,) per tensor or (H_kv,) per head, one per layer).

    `sink(layer_idx, k, v)` sees the same post-RoPE K/V llm-compressor's observers see (for kvcal's statistics).
    The model is modified in place (llm-compressor attaches its quantization state); load a fresh one after.
    """
    if observer not in LLMC_OBSERVERS:
        raise UsageError(
            f"unknown llm-compressor observer '{observer}'; choose one of {', '.join(LLMC_OBSERVERS)}"
        )
    try:  # everything _hook_sink and _oneshot import
        import compressed_tensors.modeling.kvcache  # noqa: F401
        import datasets  # noqa: F401
        import llmcompressor.modifiers.quantization  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--engine llmcompressor needs llmcompressor==0.14.0.1 installed ({exc})") from exc
    attn = _attention_modules(model)
    if not attn:
        raise KvcalError("llm-compressor finds no cached attention modules in this model")
    handles = _hook_sink(model, attn, sink) if sink is not None else []
    try:
        _oneshot(model, samples, granularity, observer)
    finally:
        for h in handles:
            h.remove()
    return _read_scales(attn)


def _hook_sink(model: Any, attn: list[tuple[int, Any]], sink: KVSink) -> list[Any]:
    """Our hook on the same QuantizedKVCache llm-compressor hooks: identical tensors, one set of forwards.
    Returns the hook handles."""
    from compressed_tensors.modeling.kvcache import KV_CACHE_ATTR, initialize_hooked_kv_cache

    def make_hook(layer_idx: int) -> Any:
        def hook(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            k = args[0] if len(args) > 0 else kwargs["key_states"]
            v = args[1] if len(args) > 1 else kwargs["value_states"]
            sink(layer_idx, k, v)  # k, v: [B, H_kv, T, D]

        return hook

    handles = []
    for idx, module in attn:
        initialize_hooked_kv_cache(model, module)
        kv_cache = getattr(module, KV_CACHE_ATTR)
        handles.append(kv_cache.register_forward_pre_hook(make_hook(idx), with_kwargs=True))
    return handles


def _oneshot(model: Any, samples: Sequence[torch.Tensor], granularity: str, observer: str) -> None:
    """llm-compressor's oneshot with an FP8 `kv_cache_scheme` on exactly these samples (batch 1, in order)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from loguru import logger

    rows = {"input_ids": [s.tolist() for s in samples], "attention_mask": [[1] * s.numel() for s in samples]}
    scheme = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": "tensor" if granularity == "tensor" else "attn_head",
        "observer": observer,
    }
    # llm-compressor logs INFO lines through loguru; kvcal reports progress itself (stderr stays readable)
    for name in ("llmcompressor", "compressed_tensors"):
        logger.disable(name)
    try:
        oneshot(
            model=model,
            dataset=Dataset.from_dict(rows),
            recipe=QuantizationModifier(kv_cache_scheme=scheme),
            num_calibration_samples=len(samples),
            max_seq_length=max(int(s.numel()) for s in samples),
            shuffle_calibration_samples=False,
            batch_size=1,
            pipeline="basic",
        )
    finally:
        for name in ("llmcompressor", "compressed_tensors"):
            logger.enable(name)


def _read_scales(attn: list[tuple[int, Any]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The k_scale / v_scale llm-compressor stored on each attention module, as float32 [G] on the CPU."""
    k_scales, v_scales = [], []
    for idx, module in attn:
        k = getattr(module, "k_scale", None)
        v = getattr(module, "v_scale", None)
        if k is None or v is None:
            raise KvcalError(f"llm-compressor produced no k_scale/v_scale for layer {idx}")
        k_scales.append(k.detach().float().cpu().reshape(-1).clone())
        v_scales.append(v.detach().float().cpu().reshape(-1).clone())
    return k_scales, v_scales
