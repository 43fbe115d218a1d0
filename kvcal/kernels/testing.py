"""Plain references that hold kvcal's kernels to their semantics in tests (as FlagAttention's `flag_attn.testing`):
slow on purpose, never on a user's path.

- `naive_attention`: a float64 loop written straight from `kvcal.kernels.reference`'s docstring (the reference of
  the reference: tests/kernels/test_reference.py).
- `decode_write_ref`: the torch reference of the fused C write `kvcal.kernels.cpu_write.decode_write` (same
  arguments and results: tests/kernels/test_cpu_write.py holds the C kernel to it bit for bit).
"""

from __future__ import annotations

import math

import torch

from kvcal import formats
from kvcal.formats import KVFormat, QTensor
from kvcal.kernels.cache import without_padding


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float, q_start: int, k_start: int, causal: bool,
    window: int | None, softcap: float | None, sinks: torch.Tensor | None, key_padding: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Attention of q [B, H_q, Tq, D] over plain k, v [B, H_kv, Tk, D] one query row at a time, in float64 Python
    scalars: `kvcal.kernels.reference`'s docstring semantics (positions, mask, softcap, sinks, empty rows = 0),
    nothing clever. float64 [B, H_q, Tq, D]."""
    b_, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    out = torch.zeros(b_, hq, tq, d, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            for i in range(tq):
                qp = q_start + i
                logits, vals = [], []
                for j in range(tk):
                    kp = k_start + j
                    if causal and kp > qp:
                        continue
                    if window is not None and qp - kp >= window:
                        continue
                    if key_padding is not None and not bool(key_padding[b, j]):
                        continue
                    s = float(q[b, h, i].double() @ k[b, h // group, j].double()) * scaling
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s)
                    vals.append(v[b, h // group, j].double())
                if not logits:
                    continue
                sink = [float(sinks[h])] if sinks is not None else []
                m = max(logits + sink)
                e = [math.exp(s - m) for s in logits]
                den = sum(e) + sum(math.exp(s - m) for s in sink)
                out[b, h, i] = sum(w * x for w, x in zip(e, vals, strict=True)) / den
    return out


def decode_write_ref(
    k: torch.Tensor, v: torch.Tensor, fmt: str | KVFormat, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, valid: torch.Tensor | None = None, kv_input_dtype: torch.dtype | None = None,
    v_fmt: str | KVFormat | None = None,
) -> tuple[QTensor, QTensor, torch.Tensor, torch.Tensor, tuple[int, int]]:  # fmt: skip
    """Torch reference of `cpu_write.decode_write` (same arguments and results): what the cache's torch write
    stores (K/V [B, H_kv, T, D] rounded to `kv_input_dtype`, padding positions of `valid` [B, T] zeroed,
    `formats.quantize` of each side), the float32 values of the plain `formats.dequantize` (what the torch path's attention
    reads: tests/kernels/test_fast_path.py), and the NaN/Inf count of the real tokens."""
    fk = formats.get_format(fmt)
    fv = fk if v_fmt is None else formats.get_format(v_fmt)
    counts = []
    prepared = []
    for x in (k, v):
        if kv_input_dtype is not None and x.dtype != kv_input_dtype:
            x = x.to(kv_input_dtype)
        bad = ~torch.isfinite(x)
        if valid is not None:
            bad = bad & valid[:, None, :, None]
        counts.append(int(bad.sum()))
        prepared.append(without_padding(x, valid))
    qk, qv = (formats.quantize(x, f, s) for x, f, s in zip(prepared, (fk, fv), (k_scale, v_scale), strict=True))
    return qk, qv, formats.dequantize(qk, fk), formats.dequantize(qv, fv), (counts[0], counts[1])
