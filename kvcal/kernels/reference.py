"""Torch reference for attention over a quantized KV cache: the semantics every kernel must reproduce.

`quantized_attention_ref` dequantizes the stored K/V (`kvcal.formats.dequantize`) and computes exact attention in
float32 (or float64 with `compute_dtype`, used to measure the reference's own rounding error). The Triton kernels
(`kvcal.kernels.triton_attention.quantized_attention_triton`) take the SAME arguments and must match it within a
small multiple of the reference's float32-vs-float64 error.

Semantics (fixed here; the kernels follow this docstring, not transformers' eager code):

Shapes. q: [B, H_q, Tq, D] (any float dtype). k, v: `QTensor`s whose logical tensor is [B, H_kv, Tk, D] (the cache
layout; codes/scales as `kvcal.formats` defines them). H_q % H_kv == 0. The result is [B, H_q, Tq, D] in q.dtype.

GQA / MQA. Query head h reads KV head h // (H_q // H_kv) (transformers' `repeat_kv` order).

Positions. Query i (0 <= i < Tq) sits at absolute position q_start + i; key j (0 <= j < Tk) at k_start + j. Positions
are cache positions (the index in the padded sequence, shared by every batch row), as in transformers' masks; left
padding is expressed by `key_padding`, not by shifting positions. A sliding layer's cache keeps only its last
tokens, so its k_start > 0 once the window is full. In a forward over new tokens, usually
q_start + Tq == k_start + Tk (the new keys are the last Tk - (q_start - k_start) keys).

Mask. Key j is visible to query i iff all of:
  - causal:          key_pos <= q_pos                     (only when causal=True)
  - sliding window:  q_pos - key_pos < sliding_window     (only when sliding_window is not None; transformers'
                                                            `sliding_window_overlay`: kv_idx > q_idx - window)
  - padding:         key_padding[b, j] is True           (only when key_padding is not None; [B, Tk] bool,
                                                            True = a real token)

Logits. s = (q · k) * scaling (fp32 dot of dequantized values). With softcap (Gemma 2): s = softcap * tanh(s / softcap),
applied BEFORE masking. Masked logits are -inf.

Sinks (gpt-oss `s_aux`). sinks: [H_q] raw logits (not scaled, not softcapped). Each query row's softmax gets one extra
logit sinks[h] in its denominator only: p_j = exp(s_j - m) / (sum_visible exp(s_j - m) + exp(sinks[h] - m)),
m = max(max_visible s_j, sinks[h]); the sink has no value vector, so rows sum to less than 1.

Empty rows. A query row with no visible key (e.g. a left-padding query) outputs exactly 0 (with or without sinks),
never NaN.

Output. o[b, h, i] = sum_j p_ij * v[b, h // G, j], computed in compute_dtype and cast to q.dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcal.errors import UsageError

# Lookup tables for fast FP4 dequantization, per device: byte -> (low-nibble value, high-nibble value), and
# E8M0 byte -> 2**(byte - 127).
_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}

# Logit elements per chunk in the explicit (softcap / sinks) path: query rows are processed in chunks so the
# [B, H, rows, Tk] float buffer stays near 2**25 elements (128 MiB in float32) whatever the batch and context.
_LOGITS_BUDGET = 1 << 25


def visibility_mask(
    tq: int,
    tk: int,
    *,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    key_padding: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean visibility per the module docstring: [1 or B, 1, Tq, Tk] (True = key visible to the query)."""
    q_pos = torch.arange(q_start, q_start + tq, device=device)[:, None]  # [Tq, 1]
    k_pos = torch.arange(k_start, k_start + tk, device=device)[None, :]  # [1, Tk]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if causal:
        mask &= k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    mask = mask[None, None]  # [1, 1, Tq, Tk]
    if key_padding is not None:
        mask = mask & key_padding.to(device=device, dtype=torch.bool)[:, None, None, :]  # [B, 1, Tq, Tk]
    return mask


def _check_shapes(
    q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, key_padding: torch.Tensor | None
) -> None:
    if q.dim() != 4 or kd.dim() != 4 or vd.dim() != 4:
        raise UsageError("attention expects q [B, H_q, Tq, D] and k/v [B, H_kv, Tk, D]; got other ranks")
    b, hq, _, d = q.shape
    bk, hkv, tk, dk = kd.shape
    if kd.shape != vd.shape or bk != b or dk != d:
        raise UsageError(
            f"q {tuple(q.shape)} and k {tuple(kd.shape)} / v {tuple(vd.shape)} do not fit together"
        )
    if hq % hkv:
        raise UsageError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if key_padding is not None and tuple(key_padding.shape) != (b, tk):
        raise UsageError(f"key_padding must be [B, Tk] = [{b}, {tk}], got {tuple(key_padding.shape)}")


def attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention on already-dequantized tensors, in the dtype of q (float32 or float64); same semantics
    as `quantized_attention_ref`. q: [B, H_q, Tq, D], k/v: [B, H_kv, Tk, D] -> [B, H_q, Tq, D]."""
    _check_shapes(q, k, v, key_padding)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    if tk == 0 or tq == 0:
        return q.new_zeros(b, hq, tq, d)
    plain = softcap is None and sinks is None and key_padding is None
    if plain and causal and sliding_window is None and q_start == k_start and tq == tk:
        # Prefill from an empty cache: torch's causal kernel, no mask tensor (2x faster on CPU).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=group > 1)
    last_q, first_k = q_start + tq - 1, k_start
    if (
        plain
        and (not causal or k_start + tk - 1 <= q_start)
        and (sliding_window is None or last_q - first_k < sliding_window)
    ):
        # Every query sees every key (e.g. a decode step): no mask at all.
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=group > 1)
    mask = visibility_mask(
        tq,
        tk,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        sliding_window=sliding_window,
        key_padding=key_padding,
        device=q.device,
    )  # [1|B, 1, Tq, Tk]
    has_key = mask.any(dim=-1, keepdim=True)  # [1|B, 1, Tq, 1]

    if softcap is None and sinks is None:
        # Fast path: torch SDPA (math or flash backend on fp32/fp64) with a boolean mask. Empty rows get an all-True
        # mask (so SDPA never sees a fully masked row) and are zeroed afterwards.
        safe = mask | ~has_key
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scaling, enable_gqa=group > 1)
        return out.masked_fill(~has_key, 0.0)

    # Explicit path (softcap and/or sinks), chunked over query rows. k/v are viewed per KV group instead of
    # repeated: q [B, H_kv, G, Tq, D] against k [B, H_kv, 1, Tk, D].
    qg = q.view(b, hkv, group, tq, d)
    kg = k[:, :, None]  # [B, H_kv, 1, Tk, D]
    vg = v[:, :, None]
    sink = None if sinks is None else sinks.to(q.dtype).view(1, hkv, group, 1, 1)
    out = q.new_empty(b, hkv, group, tq, d)
    rows = max(1, min(tq, _LOGITS_BUDGET // max(1, b * hq * tk)))
    for s0 in range(0, tq, rows):
        s1 = min(tq, s0 + rows)
        logits = torch.matmul(qg[:, :, :, s0:s1], kg.transpose(-1, -2)) * scaling  # [B, H_kv, G, tq', Tk]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        m = mask[:, :, None, s0:s1]  # [1|B, 1, 1, tq', Tk]
        logits = logits.masked_fill(~m, -math.inf)
        row_max = logits.amax(dim=-1, keepdim=True)  # -inf on empty rows
        if sink is not None:
            row_max = torch.maximum(row_max, sink.expand_as(row_max))
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(logits - row_max)  # masked -> 0
        denom = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - row_max)
        p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, :, :, s0:s1] = torch.matmul(p, vg)
    out = out.view(b, hq, tq, d)
    return out.masked_fill(~has_key, 0.0)


def _lut(name: str, device: torch.device) -> torch.Tensor:
    from kvcal import formats

    key = (name, device)
    if key not in _LUTS:
        b = torch.arange(256)
        if name == "fp4":
            e = formats.E2M1_VALUES
            _LUTS[key] = torch.stack([e[b & 0x0F], e[b >> 4]], dim=-1).to(device)  # [256, 2]
        else:
            _LUTS[key] = formats.e8m0_to_float(b.to(torch.uint8)).to(device)  # [256]
    return _LUTS[key]


def _bcast_scale(s: torch.Tensor, ndim: int) -> torch.Tensor:
    """0-d, [H_kv] or [B, 1, 1, 1] scale -> broadcastable against codes [B, H_kv, T, D']."""
    return s if s.dim() in (0, ndim) else s.reshape((1, -1) + (1,) * (ndim - 2))


def dequantize_fast(q, fmt) -> torch.Tensor:
    """float32 values of a QTensor, bit-identical to `kvcal.formats.dequantize(q, fmt)` (a test checks it), but
    cheaper: FP4 decoded through 256-entry lookup tables (one gather per byte instead of unpack + decode), the
    saturating clamp done in place, and none where it cannot change anything (bf16 -> float32 is exact). The
    torch path dequantizes the whole cache for every attention read, so this is its main cost."""
    from kvcal import formats

    f = formats.get_format(fmt)
    c = q.codes
    if f.element in ("auto", "bf16"):
        return c if c.dtype == torch.float32 else c.float()  # exact: no overflow possible
    if f.element in ("e4m3", "e5m2"):
        s = q.scale.float() if q.scale is not None else torch.tensor(1.0, device=c.device)
        y = c.float() * _bcast_scale(s, c.dim())
    elif f.element == "int8":
        y = c.float() * q.block_scales
        y = y.masked_fill_(c == formats.INT8_NAN, math.nan)
    else:
        vals = _lut("fp4", c.device).index_select(0, c.reshape(-1).int())  # [N, 2] (code 8 -> NaN)
        vals = vals.view(*c.shape[:-1], -1, f.block_size)  # [..., D/bs, bs]
        bs = q.block_scales
        if f.name == "nvfp4":
            eff = bs.float() * _bcast_scale(q.scale.float(), c.dim())
        else:
            eff = _lut("e8m0", c.device).index_select(0, bs.reshape(-1).int()).view(bs.shape)
        y = (vals * eff.unsqueeze(-1)).flatten(-2)
    fi = torch.finfo(torch.float32)
    return y.clamp_(fi.min, fi.max)  # formats' saturating cast (a product may round past float32's max)


def quantized_attention_ref(
    q: torch.Tensor,
    k,  # kvcal.formats.QTensor of a [B, H_kv, Tk, D] tensor
    v,  # kvcal.formats.QTensor of a [B, H_kv, Tk, D] tensor
    fmt,  # kvcal.formats.KVFormat (or its name)
    *,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of q over quantized K/V storage; semantics in the module docstring.

    q: [B, H_q, Tq, D]; k, v: QTensor storage of [B, H_kv, Tk, D]; sinks: [H_q] or None; key_padding: [B, Tk] bool
    or None. Returns [B, H_q, Tq, D] in q.dtype. `compute_dtype` (reference only; kernels have no such argument)
    selects float32 (default) or float64 for dequantization and the whole computation.
    """
    from kvcal import formats  # lazy: the formats floor is imported only when attention runs

    f = formats.get_format(fmt) if isinstance(fmt, str) else fmt
    kd = dequantize_fast(k, f).to(compute_dtype)  # [B, H_kv, Tk, D]
    vd = dequantize_fast(v, f).to(compute_dtype)
    out = attention_dense(
        q.to(compute_dtype),
        kd,
        vd,
        scaling=scaling,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=None if sinks is None else sinks.to(compute_dtype),
        key_padding=key_padding,
    )
    return out.to(q.dtype)
