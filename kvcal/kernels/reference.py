"""Torch reference for attention over a quantized KV cache: the semantics every kernel must reproduce.

What it is: the plain specification in code of `kvcal.kernels`' attention, and a path the library itself runs (the
torch path's `attention_on_values`, `attention_dense` for unquantized layers, the visibility mask). Its own
references, used only by tests, are in `kvcal.kernels.testing` (a float64 loop from this docstring; the torch
reference of the fused C write).

`quantized_attention_ref` dequantizes the stored K/V (`kvcal.formats.dequantize`) and computes exact attention in
float32 (or float64 with `compute_dtype`, used to measure the reference's own rounding error). It is plain on
purpose: no lookup tables, no memos, nothing kept between calls. The Triton kernels
(`kvcal.kernels.triton_attention.quantized_attention_triton`) take the SAME arguments and must match it within a
small multiple of the reference's float32-vs-float64 error; the torch path the runtime runs on CPU
(`kvcal.kernels.fast.quantized_attention_fast`) takes them too and returns the same bits (it dequantizes through
tables and a per-cache-side workspace, then calls `attention_on_values` here).

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

K/V pairs. `fmt` is K's format; `v_fmt` (default: fmt) is V's: each side is dequantized with its own format.

FP8 attention (`q_scale` given; vLLM's FlashAttention-3 path with an fp8 KV cache, `--attention fp8`). The query is
cast to e4m3 first (`quantize_query`: e4m3(q / q_scale), saturating) and the logits use those codes with the
scaling multiplied by q_scale. P.V uses FP8 probabilities: keys are visited in tiles (`p_tile` keys in the reference,
BLOCK_N in the kernel) with an online softmax; each tile's P = exp(s - running row max) is rounded to
e4m3(P * 2**8) / 2**8 (`round_p_e4m3`, FA3's Max_offset = 8) for the product with V, while the row sum takes the
unrounded P. Sinks, softcap, masks and empty rows as above.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcal.errors import UsageError

# Logit elements per chunk in the explicit (softcap / sinks) path: query rows are processed in chunks so the
# [B, H, rows, Tk] float buffer stays near 2**25 elements (128 MiB in float32) whatever the batch and context.
_LOGITS_BUDGET = 1 << 25
# Mask elements per block of query rows in the masked SDPA path (a chunked prefill's queries against the whole
# cache): the boolean mask and the float copy SDPA makes of it stay near 2**22 elements (16 MiB in float32) whatever
# the context. Each query row's attention is its own either way: the same bits as one call over all rows in every
# case measured (bench/RESULTS.md); tests/kernels/test_reference.py holds the blocks to the float64 truth.
_MASK_BUDGET = 1 << 22


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

    def visible(s0: int, s1: int) -> torch.Tensor:  # query rows s0..s1 -> [1|B, 1, s1 - s0, Tk]
        return visibility_mask(
            s1 - s0,
            tk,
            q_start=q_start + s0,
            k_start=k_start,
            causal=causal,
            sliding_window=sliding_window,
            key_padding=key_padding,
            device=q.device,
        )

    if softcap is None and sinks is None:
        # Fast path: torch SDPA (math or flash backend on fp32/fp64) with a boolean mask, in blocks of query rows
        # (_MASK_BUDGET). Empty rows get an all-True mask (so SDPA never sees a fully masked row) and are zeroed.
        out = q.new_empty(b, hq, tq, d)
        rows = _MASK_BUDGET // (tk * (1 if key_padding is None else b))
        # whole multiples of 256 rows (torch's CPU flash kernel splits queries in blocks of 256 from 768 rows on;
        # blocks of whole splits give each row the bits one call over all rows gives it)
        rows = min(tq, rows // 256 * 256 if rows >= 256 else max(1, rows))
        for s0 in range(0, tq, rows):
            s1 = min(tq, s0 + rows)
            mask = visible(s0, s1)
            has_key = mask.any(dim=-1, keepdim=True)  # [1|B, 1, rows, 1]
            part = F.scaled_dot_product_attention(
                q[:, :, s0:s1], k, v, attn_mask=mask | ~has_key, scale=scaling, enable_gqa=group > 1
            )
            out[:, :, s0:s1] = part.masked_fill(~has_key, 0.0)
        return out

    mask = visible(0, tq)  # [1|B, 1, Tq, Tk]
    has_key = mask.any(dim=-1, keepdim=True)  # [1|B, 1, Tq, 1]

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


# FP8 attention (vLLM's FlashAttention-3 path with an fp8 KV cache; see `quantize_query` and `attention_p_fp8`).
FP8_E4M3_MAX = 448.0
# FA3 computes P = exp2(s * scale_log2 - (m * scale_log2 - Max_offset)) with Max_offset = 8 for FP8, i.e. the
# unnormalized probabilities times 2**8 (in [0, 256]), and casts that to e4m3 for the P.V GEMM
# (Dao-AILab/flash-attention hopper/flash_fwd_kernel_sm90.h: `flash::Softmax<..., /*Max_offset=*/!Is_FP8 ? 0 : 8>`);
# the row sum is accumulated from the unrounded fp32 P, so the 2**8 cancels in the normalization.
FA3_P_OFFSET = 256.0
# Key tile over which the reference keeps its running row max when it quantizes P (FA3 tiles keys in blocks of
# 128-176 for head_dim <= 128 in FP8, hopper/tile_size.h); the Triton kernel uses its own BLOCK_N.
P_TILE = 128


def quantize_query(q: torch.Tensor, q_scale: float) -> torch.Tensor:
    """q [B, H_q, Tq, D] -> the e4m3 codes of `q / q_scale` (saturating at +-448, round-to-nearest-even), as
    q.dtype (e4m3 values are exact in bf16, fp16 and float32). The caller multiplies the softmax scaling by
    q_scale, as FA3 folds q_descale into softmax_scale_log2. vLLM quantizes the query this way before its
    attention backend (vllm/model_executor/layers/attention/attention.py: `query, _ = self.query_quant(query,
    self._q_scale)`, a static per-tensor QuantFP8 that multiplies by 1 / q_scale in float32)."""
    inv = torch.tensor(1.0 / float(q_scale), dtype=torch.float32, device=q.device)
    codes = (q.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.to(q.dtype)


def round_p_e4m3(p: torch.Tensor) -> torch.Tensor:
    """Unnormalized probabilities p in [0, 1] (float32/64) -> e4m3(p * 2**8) / 2**8, FA3's FP8 P."""
    return (p.float() * FA3_P_OFFSET).to(torch.float8_e4m3fn).to(p.dtype) / FA3_P_OFFSET


def attention_p_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float,
    mask: torch.Tensor,
    softcap: float | None,
    sinks: torch.Tensor | None,
    p_tile: int | None,
) -> torch.Tensor:
    """Attention whose P.V product uses FP8 probabilities the way a flash kernel forms them: key tiles of `p_tile`
    keys (None = all at once) are visited in order with an online softmax; each tile's P = exp(s - running max)
    is rounded to e4m3 (`round_p_e4m3`) for P.V, while the row sum takes the unrounded P.
    q: [B, H_q, Tq, D], k/v: [B, H_kv, Tk, D] dequantized; mask [1|B, 1, Tq, Tk] bool -> [B, H_q, Tq, D]."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    qg = q.view(b, hkv, group, tq, d)
    m = torch.full((b, hkv, group, tq, 1), -math.inf, dtype=q.dtype, device=q.device)
    l_sum = torch.zeros_like(m)
    acc = q.new_zeros(b, hkv, group, tq, d)
    step = tk if p_tile is None else int(p_tile)
    for s0 in range(0, tk, step):
        s1 = min(tk, s0 + step)
        s = torch.matmul(qg, k[:, :, None, s0:s1].transpose(-1, -2)) * scaling  # [B, H_kv, G, Tq, n]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask[:, :, None, :, s0:s1], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe)  # masked -> 0
        alpha = torch.exp(m - m_safe)  # first tile: exp(-inf) = 0
        l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(round_p_e4m3(p), v[:, :, None, s0:s1])
        m = m_new
    if sinks is not None:
        sink = sinks.to(q.dtype).view(1, hkv, group, 1, 1)
        m_f = torch.maximum(m, sink)
        corr = torch.exp(m - m_f)
        l_sum = l_sum * corr + torch.exp(sink - m_f)
        acc = acc * corr
    out = acc / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum))
    has_key = mask.any(dim=-1, keepdim=True)  # [1|B, 1, Tq, 1]
    return out.reshape(b, hq, tq, d).masked_fill(~has_key, 0.0)


def quantized_attention_ref(
    q: torch.Tensor,
    k,  # kvcal.formats.QTensor of a [B, H_kv, Tk, D] tensor
    v,  # kvcal.formats.QTensor of a [B, H_kv, Tk, D] tensor
    fmt,  # kvcal.formats.KVFormat (or its name): K's format, and V's unless v_fmt is given
    *,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    v_fmt=None,  # V's format when it differs from K's (a K/V format pair)
    q_scale: float | None = None,
    p_tile: int | None = P_TILE,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of q over quantized K/V storage; semantics in the module docstring.

    q: [B, H_q, Tq, D]; k, v: QTensor storage of [B, H_kv, Tk, D]; sinks: [H_q] or None; key_padding: [B, Tk] bool
    or None. Returns [B, H_q, Tq, D] in q.dtype. `compute_dtype` (reference only; kernels have no such argument)
    selects float32 (default) or float64 for dequantization and the whole computation.

    FP8 attention (`q_scale` given, vLLM's FlashAttention-3 path): q is replaced by `quantize_query(q, q_scale)`
    and the scaling multiplied by q_scale (QK^T of e4m3 codes, descaled once per logit), and P is rounded to e4m3
    for P.V (`attention_p_fp8`, running max over key tiles of `p_tile`).
    """
    from kvcal import formats  # lazy: the formats floor is imported only when attention runs

    f = formats.get_format(fmt)
    fv = f if v_fmt is None else formats.get_format(v_fmt)
    kd = formats.dequantize(k, f)  # [B, H_kv, Tk, D] float32, the spec's values
    vd = formats.dequantize(v, fv)
    return attention_on_values(
        q, kd, vd, scaling=scaling, q_start=q_start, k_start=k_start, causal=causal,
        sliding_window=sliding_window, softcap=softcap, sinks=sinks, key_padding=key_padding, q_scale=q_scale,
        p_tile=p_tile, compute_dtype=compute_dtype,
    )  # fmt: skip


def attention_on_values(
    q: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    *,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    q_scale: float | None = None,
    p_tile: int | None = P_TILE,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """quantized_attention_ref after dequantization: q [B, H_q, Tq, D] over the float32 values kd, vd
    [B, H_kv, Tk, D] of the stored K/V (the fast path, `kvcal.kernels.fast`, dequantizes its own way and calls
    this too). Returns [B, H_q, Tq, D] in q.dtype."""
    kd, vd = kd.to(compute_dtype), vd.to(compute_dtype)
    if q_scale is not None:
        return _fp8_attention_ref(
            q, kd, vd, q_scale=q_scale, p_tile=p_tile, scaling=scaling, q_start=q_start, k_start=k_start,
            causal=causal, sliding_window=sliding_window, softcap=softcap, sinks=sinks, key_padding=key_padding,
            compute_dtype=compute_dtype,
        )  # fmt: skip
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


def _fp8_attention_ref(
    q: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    *,
    q_scale: float,
    p_tile: int | None,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    key_padding: torch.Tensor | None,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """quantized_attention_ref's FP8-attention branch on dequantized kd/vd [B, H_kv, Tk, D]."""
    _check_shapes(q, kd, vd, key_padding)
    b, hq, tq, d = q.shape
    if kd.shape[2] == 0 or tq == 0:
        return q.new_zeros(b, hq, tq, d)
    mask = visibility_mask(
        tq, kd.shape[2], q_start=q_start, k_start=k_start, causal=causal, sliding_window=sliding_window,
        key_padding=key_padding, device=q.device,
    )  # fmt: skip
    out = attention_p_fp8(
        quantize_query(q, q_scale).to(compute_dtype),
        kd,
        vd,
        scaling=float(scaling) * float(q_scale),
        mask=mask,
        softcap=softcap,
        sinks=None if sinks is None else sinks.to(compute_dtype),
        p_tile=p_tile,
    )
    return out.to(q.dtype)
