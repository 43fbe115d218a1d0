"""kvcal's attention function for transformers' `AttentionInterface` (name "kvcal") and its mask function.

Every attention read goes through the quantized cache, prefill included: `QuantizedKVCache.update` hands the
attention the layer's K/V storage (codes + scales, `cache.KVRead` on placeholder tensors) and this function runs
the torch path (`kvcal.kernels.fast`: dequantize, exact float32 attention, the reference's bits) or the Triton kernel (dequantization inside the kernel)
on it. When a model running kvcal attention is called WITHOUT a kvcal cache (lm-eval's plain `model(input_ids)`
makes transformers create its own DynamicCache), the K/V tensors it is given are quantized on the fly with the
layer's format and scales: identical to a fresh kvcal cache for a single forward (loglikelihood scoring).
`generate()` without `past_key_values` gets a kvcal cache from the runtime (`runtime.install_generate_cache`); only
a hand-written decode loop over a transformers cache would re-quantize its past each step. In that path the key
padding comes from the mask below, as it does for the cache from `KVRuntime`'s forward hook.

Masks: transformers builds no mask for an attention implementation its `AttentionMaskInterface` does not know,
so "kvcal" registers `kvcal_mask` there too. It returns the compact form the kernels take — the 2-D key padding
`[B, kv_length]` (True = real token) aligned with the keys the layer reads, or None when nothing is padded —
and the attention applies causality and the sliding window from positions (see `reference.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvcal.errors import KvcalError, UsageError
from kvcal.kernels.cache import KVRead, LayerPlan, NonFiniteCount, QuantizedLayer
from kvcal.kernels.fast import quantized_attention_fast

ATTN_NAME = "kvcal"

# What the attention computes in (`--attention`): name -> what it is.
ATTENTION_MODES: dict[str, str] = {
    "kv": "K/V stored quantized, attention in the model's dtype (vLLM's Triton / FlashInfer / FA2 paths, SGLang)",
    "fp8": (
        "vLLM's FlashAttention-3 FP8 path: Q cast to e4m3 with q_scale (1.0 without a calibrated one), "
        "softmax P cast to e4m3 (times 2**8) for P.V; needs fp8_e4m3 K and V"
    ),
}


def check_attention_mode(mode: str, k_format: str, v_format: str | None = None) -> str:
    """UsageError unless `mode` is an ATTENTION_MODES key that the K/V formats allow (FP8 attention multiplies
    e4m3 codes: FA3 takes an fp8_e4m3 cache only)."""
    if mode not in ATTENTION_MODES:
        raise UsageError(f"unknown --attention '{mode}'; use one of {', '.join(ATTENTION_MODES)}")
    formats = {k_format, v_format or k_format}
    if mode == "fp8" and formats != {"fp8_e4m3"}:
        raise UsageError(
            f"--attention fp8 runs FlashAttention-3's FP8 kernel, which reads an fp8_e4m3 K/V cache; "
            f"got --kv-format {k_format if v_format in (None, k_format) else f'k={k_format},v={v_format}'}: "
            "use --kv-format fp8_e4m3 or drop --attention"
        )
    return mode


@dataclass(frozen=True)
class ModuleConfig:
    """Set by `KVRuntime` on each attention module as `module.kvcal_config`."""

    plan: LayerPlan
    impl: str  # 'torch' | 'triton'
    nonfinite: NonFiniteCount | None = None  # the runtime's count of non-finite K/V


def kvcal_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """AttentionMaskInterface entry: key padding [B, kv_length] bool (True = real token) or None.

    attention_mask: transformers' 2-D padding mask over all tokens seen so far plus the new ones; the layer reads
    keys kv_offset .. kv_offset + kv_length - 1."""
    if attention_mask is None:
        return None
    am = attention_mask.to(torch.bool)
    need = int(kv_offset) + int(kv_length)
    if am.shape[-1] < need:  # tokens the 2-D mask does not cover are real tokens
        am = torch.nn.functional.pad(am, (0, need - am.shape[-1]), value=True)
    pad = am[:, int(kv_offset) : need]  # [B, kv_length]
    if bool(pad.all()):
        return None
    return pad


def _key_padding(attention_mask: torch.Tensor | None, batch: int, tk: int) -> torch.Tensor | None:
    """[B, Tk] bool or None from what transformers passed as attention_mask."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 2:
        if m.shape[-1] != tk:
            raise KvcalError(
                f"kvcal attention got a key-padding mask for {m.shape[-1]} keys but reads {tk}; "
                "was the model's cache replaced between mask creation and attention?"
            )
        return m.to(torch.bool)
    if m.dim() == 4:
        # A 4-D mask prepared by the caller: [B|1, 1|H, Tq, Tk] bool (True = visible) or additive float (0 = visible).
        # kvcal applies causality and the window itself; a key visible to no query of this forward is padding
        # (exact for causal / sliding / padding masks; other custom patterns are not supported).
        visible = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        pad = visible.any(dim=-2).any(dim=1)  # [B|1, Tk]
        pad = pad.expand(batch, -1)
        return None if bool(pad.all()) else pad
    raise KvcalError(f"kvcal attention cannot use an attention mask of shape {tuple(m.shape)}")


def _read_plain_kv(
    cfg: ModuleConfig, key: torch.Tensor, value: torch.Tensor, tq: int, key_padding: torch.Tensor | None
) -> KVRead:
    """Plain K/V [B, H_kv, Tk, D] from a transformers cache (or none): quantized here as a fresh kvcal layer
    would store them in one write (padding zeroed, nvfp4's global per the plan), so the read still sees quantized
    values. Non-finite values are counted for the new keys only (the last Tq), as a cache would count them."""
    plan = cfg.plan
    layer = QuantizedLayer(replace(plan, window=None))  # one write: kvcal's scales and padding rule, no trim
    if cfg.nonfinite is not None:
        pad_new = None if key_padding is None else key_padding[:, -tq:]
        cfg.nonfinite.add(plan.index, 0, key[:, :, -tq:], pad_new)
        cfg.nonfinite.add(plan.index, 1, value[:, :, -tq:], pad_new)
    kph, _ = layer.update(key, value, valid=key_padding)
    read: KVRead = kph.kvcal_read
    read.q_start, read.window = key.shape[2] - tq, plan.window
    return read


def kvcal_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function. query: [B, H_q, Tq, D]; key/value: kvcal placeholders
    [B, H_kv, Tk, D] (or plain tensors, quantized here); returns ([B, Tq, H_q, D], None)."""
    cfg: ModuleConfig | None = getattr(module, "kvcal_config", None)
    read: KVRead | None = getattr(key, "kvcal_read", None)
    tq, tk = query.shape[2], key.shape[2]
    key_padding = _key_padding(attention_mask, query.shape[0], tk)
    if read is None:
        if cfg is None:
            raise KvcalError(
                "kvcal attention ran on a module that no KVRuntime configured; build the model's runtime with "
                "kvcal.kernels.runtime.KVRuntime(model, kv_format)"
            )
        read = _read_plain_kv(cfg, key, value, tq, key_padding)
    impl = cfg.impl if cfg is not None else "torch"
    window = sliding_window if sliding_window is not None else read.window
    kwargs_attn = dict(
        scaling=float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
        q_start=read.q_start,
        k_start=read.k_start,
        causal=True,
        sliding_window=window,
        softcap=softcap,
        sinks=s_aux,
        key_padding=key_padding,
        v_fmt=read.v_fmt,
        q_scale=cfg.plan.q_scale if cfg is not None else None,  # FP8 attention: Q (and P) quantized
    )
    if impl == "triton":
        from kvcal.kernels.triton_attention import quantized_attention_triton  # lazy: Triton is optional

        out = quantized_attention_triton(query, read.k, read.v, read.fmt, **kwargs_attn)
    else:
        out = quantized_attention_fast(
            query, read.k, read.v, read.fmt, workspaces=read.workspaces, **kwargs_attn
        )
    # out: [B, H_q, Tq, D] -> transformers' layout [B, Tq, H_q, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "kvcal" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvcal_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, kvcal_mask)
