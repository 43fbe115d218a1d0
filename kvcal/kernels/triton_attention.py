"""Fused-dequantization attention over a quantized KV cache, in Triton (decode and prefill).

Public entry: `quantized_attention_triton`, with exactly the arguments and semantics of
`kvcal.kernels.reference.quantized_attention_ref` (read that docstring: positions, mask, softcap, sinks, empty rows).

What the kernel reads: the codes and scales of `kvcal.formats.QTensor` (layouts in the formats docstring) and q.
No dequantized copy of K or V is ever written; each K/V tile is dequantized in registers:
  - fp8_e4m3 / fp8_e5m2: codes * scale, with the per-tensor / per-KV-head scale folded into the logits
    (s = (q . codes) * scaling * k_scale) and into the output (o = (P . codes) * v_scale) — one multiply per
    logit / output element instead of one per K/V element.
  - int8_per_token_head: the per-(token, head) scale multiplies the logit columns (K) and the probabilities (V).
  - nvfp4 / fp4_e2m1 / mxfp4: two E2M1 codes per byte; the low nibbles (even elements) and the high nibbles (odd
    elements) are used as two half-width tiles, so QK^T = q_even . k_even + q_odd . k_odd and P.V fills the
    even and odd output columns — no interleave. A code becomes an fp16 number by moving its bits (no lookup, no
    branches); the block scale (E4M3, or E8M0 = 2**(e-127)) multiplies the tile; nvfp4's global scale is folded
    like an fp8 scale. fp8 / nvfp4 scales may be per tensor, per KV head or per sequence ([B, 1, 1, 1]).
  - TurboQuant (vLLM's turboquant_* presets, a K/V pair of side formats): FP8 keys (`tq_fp8`) are fp8_e4m3
    codes at scale 1 (the fp8 family). MSE keys (`tq_mse4_nc` / `tq_mse3_nc`) are read in the rotated domain,
    as vLLM's decode kernel does: the query is rotated once before the kernel (q_rot = q @ PiT,
    `formats.tq_rotate`; PiT = H / sqrt(D) is orthonormal, so q_rot . k_rot = q . k and the logit scale is
    unchanged), each packed 3/4-bit code becomes its Lloyd-Max centroid by a gather from the [2**bits] table,
    and the fp16 norm times the norm correction 1 / sqrt(sum(c * c) + 1e-16) (summed over the tile's row)
    multiplies the logit column. Uniform values (`tq_uniform4` / `tq_uniform3`) dequantize in registers to
    code * scale16 + min16 (the product is exact, so one rounding, as the engine's FMA) and enter P.V like any
    float tile; the output needs no rotation.
  - NaN markers of `kvcal.formats` (int8 code -128, E2M1 code 8, a TurboQuant NaN norm / scale) decode to NaN, as in
    the torch reference.
  - bf16 / auto: plain loads.

Kernel shape. `_attn_fwd_impl` is one main loop (online softmax over key tiles) that asks K's family loader for
the logits of a tile (`_k_scores_impl`: q . k and the logit-column factor) and V's for the P.V update
(`_v_accumulate_impl`), each keyed by its format row's `triton_kernel` id, compared with the named constexprs
`FAM_*` (no bare family numbers in the kernel). A new storage layout is a branch in those two loaders and its id in
the format table; a format that shares a layout (nvfp4_4over6: nvfp4's) declares that id and adds nothing here.
Triton's import and the interpreter flag come from `kvcal.kernels.triton_env`.

One kernel serves decode and prefill. The query rows of one program are the (query token, query head) pairs of
ONE KV head: row r of the flattened [Tq * G] rows is token r // G, head h_kv * G + r % G (G = H_q // H_kv), so all
query heads of a KV group share each K/V tile load (GQA/MQA). Decode (few rows, long context) additionally splits
the key range over a third grid axis (split-K, flash-decoding); the partial (max, sum, acc) triples are merged by
a small reduction kernel, which also adds the attention sink. Prefill tiles the rows and skips key tiles that the
causal / sliding-window mask hides entirely.

Configs: `decode_configs()` / `prefill_configs()` list the autotune candidates (on CUDA). `KVCAL_TRITON_CONFIG`
(e.g. "BLOCK_M=16,BLOCK_N=32,num_warps=4,num_stages=1") pins one config and skips autotuning; under the
interpreter (`TRITON_INTERPRET=1`, how the tests run on CPU) a fixed small config is used unless pinned.
`KVCAL_TRITON_SPLITS` pins the number of key splits of the decode path (tests use it to exercise the reduction).

Dots (`_dot_kind`): bf16 or fp16 operands with fp32 accumulation where q and every dequantized tile value are
exact in that type — dequantized FP8 / INT8 / FP4-with-block-scale values have at most 6 significant bits and
per-tensor scales are applied outside the dot — so a 16-bit dot rounds only the probabilities P. Otherwise (float32
q, fp16 q over FP4 or BF16 codes, bf16 q over fp16 codes) float32 dots: 3xTF32 on CUDA (plain float32 dots spill
registers there), exact ("ieee") under the interpreter, which always uses float32 (its bf16 dot is broken).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvcal.errors import UsageError
from kvcal.formats import FORMATS, TQ_SIDES, tq_centroids
from kvcal.kernels.triton_env import interpreting as _interpreting
from kvcal.kernels.triton_env import load as _load_triton
from kvcal.kernels.triton_env import triton_available  # noqa: F401  (re-exported: the one definition)

# triton is a Linux-only dependency; the module imports without it and says so when called
triton, tl, _TRITON_ERROR = _load_triton()

__all__ = [
    "FMT_CODES",
    "decode_configs",
    "prefill_configs",
    "quantized_attention_triton",
    "triton_available",
]

# Format family codes (constexpr FMT in the kernel).
FMT_PLAIN = 0  # auto / bf16: floating-point codes, no scale
FMT_FP8 = 1  # fp8_e4m3 / fp8_e5m2: float8 codes, fp32 scale 0-d, [H_kv] or [B, 1, 1, 1]
FMT_INT8 = 2  # int8_per_token_head: int8 codes, fp32 scale per (token, head)
FMT_NVFP4 = 3  # packed E2M1, E4M3 block scales, fp32 global scale 0-d, [H_kv] or [B, 1, 1, 1]
FMT_MXFP4 = 4  # packed E2M1, E8M0 block scales (fp4_e2m1: 16, mxfp4: 32)
FMT_FP8_TOKEN = 5  # fp8_per_token_head: float8 e4m3 codes, fp32 scale per (token, head)
FMT_INT4_RHT = 6  # int4_per_token_head: packed 4-bit codes, fp32 scale word per (token, head) with the zero point
# in its low 4 bits, values in the rotated basis (q rotated before the kernel, the output rotated back after it)
# TurboQuant MSE keys: packed 3/4-bit Lloyd-Max codes of the rotated unit vector, uint8 [B, H_kv, Tk, D*b/8], fp16
# norm [B, H_kv, Tk, 1], the centroid table float32 [2**b]; q rotated before the kernel (the output is not)
FMT_TQ_MSE = 7
# TurboQuant values: packed 3/4-bit codes, uint8 [B, H_kv, Tk, D*b/8], fp16 (scale, min) [B, H_kv, Tk, 2]
FMT_TQ_UNIFORM = 8
FMT_HALF = (FMT_NVFP4, FMT_MXFP4, FMT_INT4_RHT)  # two codes per byte: half-width even / odd tiles
FMT_TOKEN = (FMT_INT8, FMT_FP8_TOKEN, FMT_INT4_RHT)  # per-(token, head) scale on the logits / probabilities
FMT_TQ = (FMT_TQ_MSE, FMT_TQ_UNIFORM)  # packed b-bit codes (`BITS` / `BITS_V`), full-width tiles
# storage layout -> family: formats' `triton_kernel` column (a format sharing another's layout reads as that one);
# TurboQuant's side formats (reachable only through their presets) have their own rows
FMT_CODES: dict[str, int] = {
    f.name: f.triton_kernel  # type: ignore[misc]
    for f in (*FORMATS.values(), *TQ_SIDES.values())
    if f.layout == f.name
}

# Rows (Tq * G) up to which the decode path (small BLOCK_M, split-K) is used.
_DECODE_MAX_ROWS = 64
# the jit helpers `_kernels()` installs (each from its `<name>_impl`): the tile loaders by family and their parts
_JIT_HELPERS = (
    "_e8m0", "_tanh", "_load_fp4_tile", "_to_dot", "_round_e4m3", "_load_tq_codes", "_is_half", "_is_token",
    "_has_column", "_fold_scale", "_token_scale", "_load_q", "_load_full_tile", "_k_scores", "_v_accumulate",
    "_store_rows", "_finish", "_key_range", "_mask", "_softmax_step",
)  # fmt: skip
_LOG2E = 1.4426950408889634
_CONFIG_ENV = "KVCAL_TRITON_CONFIG"
_SPLITS_ENV = "KVCAL_TRITON_SPLITS"


# ---------------------------------------------------------------------------------------------------------------
# Configs


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def meta(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}


def decode_configs(block_m: int) -> list[KernelConfig]:
    """Autotune candidates for the decode path (rows = Tq * G <= 64, padded to block_m >= 16): memory-bound, so
    the choice is the key tile (bytes in flight per program) and the pipeline depth."""
    return [KernelConfig(block_m, 32, 4, 2)] + [
        KernelConfig(block_m, bn, w, s) for bn in (64, 128) for w in (4, 8) for s in (2, 3)
    ]


def prefill_configs() -> list[KernelConfig]:
    """Autotune candidates for the prefill path (many rows; causal/sliding tiles skipped). The small first config
    is the fallback of float32 dots (float32 q on CUDA), which spill registers at the larger tiles; configs that
    exceed shared memory (head_dim 256 at 128 x 64) fail to launch and are skipped by the autotuner."""
    return [KernelConfig(32, 32, 4, 2)] + [
        KernelConfig(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for s in (2, 3)
    ]


def _interpreter_config(block_m: int) -> KernelConfig:
    # Few, larger tiles keep the (per-op) interpreter fast; BLOCK_N 32 still gives multi-tile loops in tests.
    return KernelConfig(block_m, 32, 4, 1)


def parse_config(spec: str) -> dict[str, int]:
    """'BLOCK_M=16,BLOCK_N=32,num_warps=4,num_stages=1' -> dict (UsageError on a malformed spec)."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"):
            raise UsageError(
                f"{_CONFIG_ENV}={spec!r} is malformed; use e.g. 'BLOCK_M=16,BLOCK_N=32,num_warps=4,num_stages=1'"
            )
        try:
            out[key] = int(val)
        except ValueError as exc:
            raise UsageError(f"{_CONFIG_ENV}: {key} must be an integer, got {val!r}") from exc
    for key in ("BLOCK_M", "BLOCK_N"):
        v = out.get(key)
        if v is not None and (v < 16 or v & (v - 1)):
            raise UsageError(f"{_CONFIG_ENV}: {key} must be a power of two >= 16, got {v}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Kernels. The jit functions are created by `_kernels()` on first use, so the interpreter mode is read when a kernel
# is needed, not when this module (or triton) happened to be imported. For the same reason the kernels call no
# jit-decorated helpers of triton.language.standard (tl.max, tl.sum, tl.cdiv, tl.zeros): triton decorates those at
# its own import, and a run where something imported triton before TRITON_INTERPRET=1 was set (transformers does)
# would fail inside them. tl.reduce with the standard combine functions is used instead (the interpreter maps those
# to numpy; on GPU it is exactly what tl.max / tl.sum do).


# Jit helpers, installed by `_kernels()`; the kernels look them up by name from this module's globals when traced.
_e8m0: Any = None
_tanh: Any = None
_load_fp4_tile: Any = None
_to_dot: Any = None
_round_e4m3: Any = None
_load_tq_codes: Any = None
_is_half: Any = None
_is_token: Any = None
_has_column: Any = None
_fold_scale: Any = None
_token_scale: Any = None
_load_q: Any = None
_load_full_tile: Any = None
_k_scores: Any = None
_v_accumulate: Any = None
_store_rows: Any = None
_finish: Any = None
_key_range: Any = None
_mask: Any = None
_softmax_step: Any = None

# Dot operand dtypes (constexpr DOT_KIND): the narrowest type in which q and the dequantized tile values are exact.
DOT_F32, DOT_BF16, DOT_F16 = 0, 1, 2


def _to_dot_impl(x, DOT_KIND: tl.constexpr):
    if DOT_KIND == 1:
        y = x.to(tl.bfloat16)
    elif DOT_KIND == 2:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.float32)
    return y


def _round_e4m3_impl(x):
    # x >= 0 (at most 448, NaN kept) -> the nearest e4m3 value, ties to even, by arithmetic: under the interpreter
    # an fp32 -> fp8 cast inside a kernel gives wrong bytes. Normal range (x >= 2**-6): round the float32 mantissa
    # to 3 bits (add 0x7FFFF plus the kept lsb, clear the low 20 bits); subnormals: multiples of 2**-9, which
    # float32 addition of 2**14 (ulp 2**-9) rounds to, ties to even.
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    sub = (x + 16384.0) - 16384.0
    return tl.where(x < 0.015625, sub, normal)


def _e8m0_impl(b):
    # b: uint8 biased exponents -> fp32 2**(b - 127) (b = 0 is the subnormal 2**-127).
    bi = b.to(tl.int32)
    v = (bi << 23).to(tl.float32, bitcast=True)
    return tl.where(bi == 0, 5.877471754111438e-39, v)


def _tanh_impl(x):
    # Accurate fp32 tanh without libdevice (the interpreter has none): odd Taylor series near 0 (|x| < 0.25,
    # truncation < 1e-10 relative), (1 - t) / (1 + t) with t = exp(-2|x|) elsewhere.
    a = tl.abs(x)
    x2 = x * x
    poly = x * (
        1.0
        + x2
        * (
            -0.3333333333333333
            + x2
            * (
                0.13333333333333333
                + x2 * (-0.05396825396825397 + x2 * (0.021869488536155203 + x2 * -0.008863235529902197))
            )
        )
    )
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    big = tl.where(x < 0, -big, big)
    return tl.where(a < 0.25, poly, big)


def _load_fp4_tile_impl(
    codes_base,
    bs_base,
    offs_n,
    offs_i,
    n_mask,
    i_mask,
    stride_n,
    stride_c,
    bs_stride_n,
    bs_stride_c,
    FMT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Packed bytes [BLOCK_N, D/2] -> (even-element values, odd-element values), each [BLOCK_N, D/2] fp32, with the
    # block scale applied (element 2i and 2i+1 both lie in block (2i) // BLOCK_SIZE = i // (BLOCK_SIZE // 2)).
    # E2M1 -> fp16 by moving bits: sign to bit 15, the 3 exponent/mantissa bits to bits 9-11; the fp16 number is
    # e2m1 * 2**-14 exactly (code 1 = 0.5 becomes the fp16 subnormal 2**-15). The 2**14 is folded into the
    # per-program logit and output scales (FP4_UNIT), so decoding costs a few integer ops and one conversion.
    mask = n_mask[:, None] & i_mask[None, :]
    byte = tl.load(codes_base + offs_n[:, None] * stride_n + offs_i[None, :] * stride_c, mask=mask, other=0)
    byte = byte.to(tl.int32)
    if FMT == FAM_INT4_RHT:
        # int4_per_token_head: code - zero point (small integers, exact); the scale is applied per token outside
        word = tl.load(bs_base + offs_n * bs_stride_n, mask=n_mask, other=0.0).to(tl.int32, bitcast=True)
        zp = (word & 0xF).to(tl.float32)[:, None]
        return (
            tl.where(mask, (byte & 0xF).to(tl.float32) - zp, 0.0),
            tl.where(mask, ((byte >> 4) & 0xF).to(tl.float32) - zp, 0.0),
        )
    lo = (((byte & 7) << 9) | ((byte & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (
        (((byte & 0x70) << 5) | ((byte & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    )
    # code 8 (the -0 pattern) is kvcal's NaN marker (kvcal.formats)
    lo = tl.where((byte & 0x0F) == 8, float("nan"), lo)
    hi = tl.where((byte & 0xF0) == 0x80, float("nan"), hi)
    blk = offs_i // (BLOCK_SIZE // 2)
    # no `other`: a float8 block scale cannot take an integer fill value; masked lanes are zeroed after decoding
    bsv = tl.load(bs_base + offs_n[:, None] * bs_stride_n + blk[None, :] * bs_stride_c, mask=mask)
    if FMT == FAM_NVFP4:
        s = bsv.to(tl.float32)
    else:
        s = _e8m0(bsv)
    s = tl.where(mask, s, 0.0)
    return lo * s, hi * s


def _load_tq_codes_impl(base, offs_n, offs_d, mask, stride_n, stride_c, BITS: tl.constexpr):
    # TurboQuant packed codes -> int32 codes [BLOCK_N, D_PAD] (0 where masked), vLLM's packing (formats.tq_pack):
    # 4 bits: element d in byte d // 2, low nibble for even d; 3 bits: each 8 elements a 24-bit little-endian word
    # of 3 bytes, element j of the group at bit 3j, so element d starts in byte 3 (d // 8) + 3j // 8 at bit 3j % 8
    # and reaches into the next byte when that bit is 6 or 7 (j = 2 and 5; the next byte lies in the same group).
    row = base + offs_n[:, None] * stride_n
    if BITS == 4:
        byte = tl.load(row + (offs_d // 2)[None, :] * stride_c, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offs_d % 2) * 4)[None, :]) & 0xF
    else:
        bit = (offs_d % 8) * 3  # [D_PAD]
        idx = (offs_d // 8) * 3 + bit // 8
        sh = bit % 8
        b0 = tl.load(row + idx[None, :] * stride_c, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(row + (idx + 1)[None, :] * stride_c, mask=mask & (sh > 5)[None, :], other=0).to(tl.int32)
        code = ((b0 | (b1 << 8)) >> sh[None, :]) & 0x7
    return code


# Tile-loader families: the named constexpr ids the kernel compares FMT / FMT_V with (a format row's
# `triton_kernel` column, formats' table; FMT_CODES below). Triton kernels read only constexpr globals.
if tl is not None:
    FAM_PLAIN = tl.constexpr(FMT_PLAIN)
    FAM_FP8 = tl.constexpr(FMT_FP8)
    FAM_INT8 = tl.constexpr(FMT_INT8)
    FAM_NVFP4 = tl.constexpr(FMT_NVFP4)
    FAM_MXFP4 = tl.constexpr(FMT_MXFP4)
    FAM_FP8_TOKEN = tl.constexpr(FMT_FP8_TOKEN)
    FAM_INT4_RHT = tl.constexpr(FMT_INT4_RHT)
    FAM_TQ_MSE = tl.constexpr(FMT_TQ_MSE)
    FAM_TQ_UNIFORM = tl.constexpr(FMT_TQ_UNIFORM)


def _is_half_impl(F: tl.constexpr):
    # two codes per byte, read as half-width even / odd tiles (the E2M1 families and int4)
    return (F == FAM_NVFP4) or (F == FAM_MXFP4) or (F == FAM_INT4_RHT)


def _is_token_impl(F: tl.constexpr):
    # a scale per (token, head) multiplies the logit columns (K) / the probabilities (V)
    return (F == FAM_INT8) or (F == FAM_FP8_TOKEN) or (F == FAM_INT4_RHT)


def _has_column_impl(F: tl.constexpr):
    # K's family puts a factor on each logit column (`_k_scores_impl`)
    return _is_token(F) or (F == FAM_TQ_MSE)


def _fold_scale_impl(x, SC, b, h, stride_b, stride_h, F: tl.constexpr):
    # x times the side's scale folded into the logits / the output: fp8's static scale, nvfp4's global, then the
    # 2**14 of E2M1 tiles (see _load_fp4_tile_impl); x itself for the other families
    if (F == FAM_FP8) or (F == FAM_NVFP4):
        x = x * tl.load(SC + b * stride_b + h * stride_h).to(tl.float32)
    if (F == FAM_NVFP4) or (F == FAM_MXFP4):
        x = x * 16384.0
    return x


def _token_scale_impl(bs_base, offs_n, n_ok, stride_t, F: tl.constexpr):
    # the per-(token, head) scale [BLOCK_N]; int4's word without its zero-point bits
    s = tl.load(bs_base + offs_n * stride_t, mask=n_ok, other=0.0).to(tl.float32)
    if F == FAM_INT4_RHT:
        s = (s.to(tl.int32, bitcast=True) & -16).to(tl.float32, bitcast=True)
    return s


def _load_q_impl(q_row, offs_i, offs_d, row_ok, i_ok, d_ok, stride_qd, F: tl.constexpr, DOT_KIND: tl.constexpr):
    # the query operands of K's family: (even columns, odd columns) [BLOCK_M, D_PAD/2] for half-width tiles, else
    # (q, q) [BLOCK_M, D_PAD] (the second unused)
    if _is_half(F):
        qm = row_ok[:, None] & i_ok[None, :]
        qa = _to_dot(tl.load(q_row[:, None] + (2 * offs_i)[None, :] * stride_qd, mask=qm, other=0.0), DOT_KIND)
        qb = _to_dot(tl.load(q_row[:, None] + (2 * offs_i + 1)[None, :] * stride_qd, mask=qm, other=0.0), DOT_KIND)
    else:
        qm = row_ok[:, None] & d_ok[None, :]
        qa = _to_dot(tl.load(q_row[:, None] + offs_d[None, :] * stride_qd, mask=qm, other=0.0), DOT_KIND)
        qb = qa
    return qa, qb


def _load_full_tile_impl(base, offs_n, offs_d, n_ok, d_ok, stride_n, stride_c, F: tl.constexpr):
    # one code per element [BLOCK_N, D_PAD]: plain floats, fp8 codes (scale folded outside), int8 codes
    t = tl.load(
        base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_c, mask=n_ok[:, None] & d_ok[None, :], other=0.0
    )
    if F == FAM_INT8:  # int8 code -128 is kvcal's NaN marker
        t = tl.where(t == -128, float("nan"), t.to(tl.float32))
    return t


def _k_scores_impl(
    qa, qb, k_base, kbs_base, CENT, offs_n, offs_i, offs_d, n_ok, i_ok, d_ok,
    stride_kt, stride_kd, stride_kbst, stride_kbsd,
    F: tl.constexpr, BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, DOT_KIND: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    # K's tile loader by family: (q . k [BLOCK_M, BLOCK_N], the logit column factor [BLOCK_N]: the per-(token, head)
    # scale, TurboQuant's norm x norm correction; 1 where the family has none)
    col = offs_n  # a placeholder where the family has no column factor (`_has_column(F)` is False)
    if _is_half(F):
        k_e, k_o = _load_fp4_tile(
            k_base, kbs_base, offs_n, offs_i, n_ok, i_ok, stride_kt, stride_kd, stride_kbst, stride_kbsd, F, BLOCK_SIZE
        )  # fmt: skip
        s = tl.dot(qa, tl.trans(_to_dot(k_e, DOT_KIND)), input_precision=DOT_PREC)
        s += tl.dot(qb, tl.trans(_to_dot(k_o, DOT_KIND)), input_precision=DOT_PREC)
    elif F == FAM_TQ_MSE:
        # codes -> centroids [BLOCK_N, D_PAD] by a gather from the small table (0 in masked lanes); the logit column
        # takes norm / sqrt(sum(c * c) + 1e-16) (vLLM's NORM_CORRECTION) and the fp16 norm
        km = n_ok[:, None] & d_ok[None, :]
        kc = _load_tq_codes(k_base, offs_n, offs_d, km, stride_kt, stride_kd, BITS)
        kt = tl.load(CENT + kc, mask=km, other=0.0)
        c_sq = tl.reduce(kt * kt, 1, tl.standard._sum_combine)  # [BLOCK_N]
        s = tl.dot(qa, tl.trans(_to_dot(kt, DOT_KIND)), input_precision=DOT_PREC)
        ks = tl.load(kbs_base + offs_n * stride_kbst, mask=n_ok, other=0.0).to(tl.float32)
        col = ks * (1.0 / tl.sqrt(c_sq + 1e-16))
    else:
        kt = _load_full_tile(k_base, offs_n, offs_d, n_ok, d_ok, stride_kt, stride_kd, F)
        s = tl.dot(qa, tl.trans(_to_dot(kt, DOT_KIND)), input_precision=DOT_PREC)
    if _is_token(F):
        col = _token_scale(kbs_base, offs_n, n_ok, stride_kbst, F)
    return s, col


def _v_accumulate_impl(
    acc_a, acc_b, p, alpha, v_base, vbs_base, offs_n, offs_i, offs_d, n_ok, i_ok, d_ok,
    stride_vt, stride_vd, stride_vbst, stride_vbsd,
    F: tl.constexpr, BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, DOT_KIND: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    # V's tile loader by family: acc * alpha + P V. Half-width families fill (even, odd) output columns (acc_a,
    # acc_b [BLOCK_M, D_PAD/2]); the others acc_a [BLOCK_M, D_PAD] (acc_b untouched)
    if _is_token(F):
        p = p * _token_scale(vbs_base, offs_n, n_ok, stride_vbst, F)[None, :]
    pd = _to_dot(p, DOT_KIND)
    if _is_half(F):
        v_e, v_o = _load_fp4_tile(
            v_base, vbs_base, offs_n, offs_i, n_ok, i_ok, stride_vt, stride_vd, stride_vbst, stride_vbsd, F, BLOCK_SIZE
        )  # fmt: skip
        acc_a = acc_a * alpha[:, None] + tl.dot(pd, _to_dot(v_e, DOT_KIND), input_precision=DOT_PREC)
        acc_b = acc_b * alpha[:, None] + tl.dot(pd, _to_dot(v_o, DOT_KIND), input_precision=DOT_PREC)
    elif F == FAM_TQ_UNIFORM:
        # TurboQuant values: code * scale16 + min16 per (token, head) [BLOCK_N, D_PAD]; exact product, one
        # rounding (the engine's FMA); masked lanes (keys past hi, padded columns) 0
        vm = n_ok[:, None] & d_ok[None, :]
        vc = _load_tq_codes(v_base, offs_n, offs_d, vm, stride_vt, stride_vd, BITS).to(tl.float32)
        v_sc = tl.load(vbs_base + offs_n * stride_vbst, mask=n_ok, other=0.0).to(tl.float32)
        v_mn = tl.load(vbs_base + offs_n * stride_vbst + stride_vbsd, mask=n_ok, other=0.0).to(tl.float32)
        vt = tl.where(vm, vc * v_sc[:, None] + v_mn[:, None], 0.0)
        acc_a = acc_a * alpha[:, None] + tl.dot(pd, _to_dot(vt, DOT_KIND), input_precision=DOT_PREC)
    else:
        vt = _load_full_tile(v_base, offs_n, offs_d, n_ok, d_ok, stride_vt, stride_vd, F)
        acc_a = acc_a * alpha[:, None] + tl.dot(pd, _to_dot(vt, DOT_KIND), input_precision=DOT_PREC)
    return acc_a, acc_b


def _store_rows_impl(base, acc_a, acc_b, mult, offs_i, offs_d, row_ok, i_ok, d_ok, stride_d, F: tl.constexpr):
    # (acc * mult) of V's family into rows base [BLOCK_M] pointers: even / odd columns for half-width tiles
    if _is_half(F):
        sm = row_ok[:, None] & i_ok[None, :]
        tl.store(base[:, None] + (2 * offs_i)[None, :] * stride_d, (acc_a * mult).to(base.dtype.element_ty), mask=sm)
        tl.store(base[:, None] + (2 * offs_i + 1)[None, :] * stride_d, (acc_b * mult).to(base.dtype.element_ty), mask=sm)
    else:
        sm = row_ok[:, None] & d_ok[None, :]
        tl.store(base[:, None] + offs_d[None, :] * stride_d, (acc_a * mult).to(base.dtype.element_ty), mask=sm)


def _key_range_impl(
    pid_m, pid_s, n_splits, n_rows, TK, G, q_start, k_start, window,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # the keys [lo, hi) a program visits: its split's chunk, cut by the causal / window bounds of its rows
    r_first = pid_m * BLOCK_M
    t_lo = r_first // G
    t_hi = (tl.minimum(r_first + BLOCK_M, n_rows) - 1) // G
    per_split = (TK + n_splits - 1) // n_splits
    chunk = ((per_split + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, TK)
    if CAUSAL:
        hi = tl.minimum(hi, q_start + t_hi - k_start + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, ((q_start + t_lo - window + 1 - k_start) // BLOCK_N) * BLOCK_N)
    return lo, hi


def _mask_impl(
    s, offs_n, n_ok, row_ok, q_pos, k_start, window, KPAD, b, stride_kpb, stride_kpt,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPAD: tl.constexpr,
):  # fmt: skip
    # scores [BLOCK_M, BLOCK_N] with the keys a row does not see at -inf: past the tile's end, in its future
    # (causal), out of its window, or padding (KPAD [B, Tk], 0 = padding)
    k_pos = k_start + offs_n
    vis = n_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        vis = vis & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        vis = vis & ((q_pos[:, None] - k_pos[None, :]) < window)
    if HAS_KPAD:
        kp = tl.load(KPAD + b * stride_kpb + offs_n * stride_kpt, mask=n_ok, other=0)
        vis = vis & (kp != 0)[None, :]
    return tl.where(vis, s, float("-inf"))


def _softmax_step_impl(s, m_i, l_i):
    # one tile of the online softmax in the exp2 domain: P [BLOCK_M, BLOCK_N], the rescale alpha [BLOCK_M] of what
    # was accumulated, the new running max and sum (a row that saw nothing yet keeps m = -inf, P = 0)
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    return p, alpha, m_new, l_i


def _attn_fwd_impl(
    Q, K, V, KBS, VBS, KSC, VSC,
    CENT,  # TurboQuant MSE keys: the centroid table float32 [2**BITS] (a dummy otherwise)
    SINKS, KPAD, OUT, PART_ML, PART_ACC,
    stride_qb, stride_qh, stride_qt, stride_qd,  # q [B, H_q, Tq, D]
    # k/v codes [B, H_kv, Tk, Dc] (Dc = D, D/2, or D*b/8 for TurboQuant's packed b-bit codes)
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    # block scales [B, H_kv, Tk, NB] (int8: NB = 1; TurboQuant: fp16 norm NB = 1, fp16 (scale, min) NB = 2)
    stride_kbsb, stride_kbsh, stride_kbst, stride_kbsd,
    stride_vbsb, stride_vbsh, stride_vbst, stride_vbsd,
    stride_kscb, stride_ksc, stride_vscb, stride_vsc,  # scale strides over (batch, KV head): 0 where shared
    stride_kpb, stride_kpt,
    stride_ob, stride_oh, stride_ot, stride_od,  # out [B, H_q, Tq, D]
    H_KV, TQ, TK, G, q_start, k_start, window, sm_scale, softcap,
    tk_bucket,  # autotune key only
    # K's tile-loader family (FAM_*), block size, TurboQuant code width (3 or 4; 0 for other families); V's
    FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMT_V: tl.constexpr, BLOCK_SIZE_V: tl.constexpr,
    BITS: tl.constexpr, BITS_V: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_KPAD: tl.constexpr, P_FP8: tl.constexpr,
    SPLIT: tl.constexpr, DOT_KIND: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    LOG2E: tl.constexpr = 1.4426950408889634
    DH: tl.constexpr = HEAD_DIM // 2
    DH_PAD: tl.constexpr = D_PAD // 2
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    n_splits = tl.num_programs(2)
    # int64: batch offsets of a multi-GB cache overflow int32 (e.g. 32 x 8 heads x 128k tokens x 128)
    b = (pid_bh // H_KV).to(tl.int64)
    h = (pid_bh % H_KV).to(tl.int64)
    # rows of this program: (token t, group head g) pairs of KV head h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = TQ * G
    row_ok = offs_m < n_rows
    t = (offs_m // G).to(tl.int64)
    hq = h * G + offs_m % G
    q_pos = q_start + t  # [BLOCK_M]
    lo, hi = _key_range(pid_m, pid_s, n_splits, n_rows, TK, G, q_start, k_start, window, CAUSAL, HAS_WINDOW, BLOCK_M,
                        BLOCK_N)  # fmt: skip
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    kbs_base = KBS + b * stride_kbsb + h * stride_kbsh
    vbs_base = VBS + b * stride_vbsb + h * stride_vbsh
    # the sides' scales folded into the logits / the output (fp8, nvfp4; E2M1 tiles' 2**14)
    qk_scale = _fold_scale(sm_scale, KSC, b, h, stride_kscb, stride_ksc, FMT)
    v_scale = _fold_scale(1.0, VSC, b, h, stride_vscb, stride_vsc, FMT_V)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * LOG2E  # work in the exp2 domain
    offs_i = tl.arange(0, DH_PAD)  # half-width columns (FP4 tiles)
    i_ok = offs_i < DH
    offs_d = tl.arange(0, D_PAD)  # full-width columns
    d_ok = offs_d < HEAD_DIM
    q_row = Q + b * stride_qb + hq * stride_qh + t * stride_qt  # [BLOCK_M] pointers
    qa, qb = _load_q(q_row, offs_i, offs_d, row_ok, i_ok, d_ok, stride_qd, FMT, DOT_KIND)
    acc_a = tl.full([BLOCK_M, DH_PAD if _is_half(FMT_V) else D_PAD], 0.0, dtype=tl.float32)
    acc_b = tl.full([BLOCK_M, DH_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)

    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        # ---- S = Q K^T (dequantized in registers by K's family loader) ----
        s, col = _k_scores(
            qa, qb, k_base, kbs_base, CENT, offs_n, offs_i, offs_d, n_ok, i_ok, d_ok,
            stride_kt, stride_kd, stride_kbst, stride_kbsd, FMT, BLOCK_SIZE, BITS, DOT_KIND, DOT_PREC,
        )  # fmt: skip
        s = s * qk_scale
        if _has_column(FMT):
            s = s * col[None, :]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
            s = s * LOG2E
        s = _mask(s, offs_n, n_ok, row_ok, q_pos, k_start, window, KPAD, b, stride_kpb, stride_kpt, CAUSAL,
                  HAS_WINDOW, HAS_KPAD)  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        if P_FP8:
            # FA3's FP8 P: e4m3(P * 2**8) for the P.V product; the row sum above took the unrounded P
            # (kvcal.kernels.reference.FA3_P_OFFSET); 2**-8 is exact
            p = _round_e4m3(p * 256.0) * 0.00390625
        # ---- O = O * alpha + P V (V's family loader) ----
        acc_a, acc_b = _v_accumulate(
            acc_a, acc_b, p, alpha, v_base, vbs_base, offs_n, offs_i, offs_d, n_ok, i_ok, d_ok,
            stride_vt, stride_vd, stride_vbst, stride_vbsd, FMT_V, BLOCK_SIZE_V, BITS_V, DOT_KIND, DOT_PREC,
        )  # fmt: skip

    _finish(
        OUT, PART_ML, PART_ACC, SINKS, acc_a, acc_b, m_i, l_i, v_scale, b, hq, t, pid_s, n_splits, H_KV, TQ, G,
        stride_ob, stride_oh, stride_ot, stride_od, offs_i, offs_d, row_ok, i_ok, d_ok,
        FMT_V, HAS_SINKS, SPLIT, D_PAD, BLOCK_M,
    )  # fmt: skip


def _finish_impl(
    OUT, PART_ML, PART_ACC, SINKS, acc_a, acc_b, m_i, l_i, v_scale, b, hq, t, pid_s, n_splits, H_KV, TQ, G,
    stride_ob, stride_oh, stride_ot, stride_od, offs_i, offs_d, row_ok, i_ok, d_ok,
    FMT_V: tl.constexpr, HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # the program's rows done: a split's partials (m in the exp2 domain, l, acc * v_scale) for the reduction
    # kernel, or the output rows (the sink added, divided by l; empty rows, acc = 0, output exactly 0)
    LOG2E: tl.constexpr = 1.4426950408889634
    if SPLIT:
        ml_row = PART_ML + ((b * H_KV * G + hq) * TQ + t) * (n_splits * 2) + pid_s * 2
        tl.store(ml_row, m_i, mask=row_ok)
        tl.store(ml_row + 1, l_i, mask=row_ok)
        acc_row = PART_ACC + (((b * H_KV * G + hq) * TQ + t) * n_splits + pid_s) * D_PAD
        _store_rows(acc_row, acc_a, acc_b, v_scale, offs_i, offs_d, row_ok, i_ok, d_ok, 1, FMT_V)
    else:
        if HAS_SINKS:
            sink = tl.load(SINKS + hq, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_f = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_f)
            l_i = l_i * corr + tl.exp2(sink - m_f)
        else:
            corr = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        inv = tl.where(l_i > 0, v_scale * corr / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o_row = OUT + b * stride_ob + hq * stride_oh + t * stride_ot
        _store_rows(o_row, acc_a, acc_b, inv[:, None], offs_i, offs_d, row_ok, i_ok, d_ok, stride_od, FMT_V)


def _combine_impl(
    PART_ML,
    PART_ACC,
    SINKS,
    OUT,
    H_Q,
    TQ,
    n_splits,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # one program per (b, h_q, t) row: merge the n_splits partial softmaxes (+ the sink) into the output
    row = tl.program_id(0).to(tl.int64)
    t = row % TQ
    hq = (row // TQ) % H_Q
    b = row // (TQ * H_Q)
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < n_splits
    m = tl.load(PART_ML + row * n_splits * 2 + offs_s * 2, mask=s_ok, other=float("-inf"))
    l_part = tl.load(PART_ML + row * n_splits * 2 + offs_s * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    if HAS_SINKS:
        sink = tl.load(SINKS + hq).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # empty splits: exp2(-inf) = 0
    l_tot = tl.reduce(w * l_part, 0, tl.standard._sum_combine)
    if HAS_SINKS:
        l_tot += tl.exp2(sink - m_safe)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    acc = tl.load(
        PART_ACC + (row * n_splits + offs_s)[:, None] * D_PAD + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine)
    inv = tl.where(l_tot > 0, 1.0 / tl.where(l_tot > 0, l_tot, 1.0), 0.0)
    tl.store(
        OUT + b * stride_ob + hq * stride_oh + t * stride_ot + offs_d * stride_od,
        (o * inv).to(OUT.dtype.element_ty),
        mask=d_ok,
    )


@dataclass
class _Kernels:
    interpret: bool
    attn: Any
    combine: Any
    tuned: dict[tuple[str, int], Any]


_KERNELS: _Kernels | None = None


def _kernels() -> _Kernels:
    """The jit kernels for the current interpreter mode (re-created if TRITON_INTERPRET changed)."""
    global _KERNELS
    if triton is None:
        raise UsageError(f"the Triton kernels need the `triton` package ({_TRITON_ERROR}); use --impl torch")
    interp = _interpreting()
    if _KERNELS is None or _KERNELS.interpret != interp:
        g = globals()
        # helpers are looked up by name from this module's globals when a kernel is traced
        for name in _JIT_HELPERS:
            g[name] = triton.jit(g[f"{name}_impl"])
        _KERNELS = _Kernels(interp, triton.jit(_attn_fwd_impl), triton.jit(_combine_impl), {})
    return _KERNELS


# what a tuned config is kept for: the formats (and TurboQuant code widths), shape and kernel variant
_AUTOTUNE_KEY = ["FMT", "FMT_V", "BITS", "BITS_V", "HEAD_DIM", "G", "tk_bucket", "SPLIT", "DOT_KIND", "HAS_SOFTCAP"]  # fmt: skip


def _tuned(kern: _Kernels, kind: str, block_m: int) -> Any:
    key = (kind, block_m)
    if key not in kern.tuned:
        cfgs = decode_configs(block_m) if kind == "decode" else prefill_configs()
        kern.tuned[key] = triton.autotune(
            configs=[triton.Config(c.meta(), num_warps=c.num_warps, num_stages=c.num_stages) for c in cfgs],
            key=_AUTOTUNE_KEY,
        )(kern.attn)
    return kern.tuned[key]


# ---------------------------------------------------------------------------------------------------------------
# Host side


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _choose_splits(programs: int, tk: int, block_n: int, device: torch.device) -> int:
    """Key splits for decode: enough programs to fill the device (2 waves), each split >= 4 key tiles."""
    pinned = os.environ.get(_SPLITS_ENV)
    if pinned:
        try:
            n = int(pinned)
        except ValueError as exc:
            raise UsageError(f"{_SPLITS_ENV} must be a positive integer, got {pinned!r}") from exc
        return max(1, min(n, max(1, math.ceil(tk / block_n))))
    if _interpreting():
        return 1
    want = math.ceil(2 * _num_sms(device) / max(1, programs))
    most = max(1, tk // (4 * block_n))
    return int(max(1, min(want, most, 128)))


def _scale_arg(
    s: torch.Tensor | None, b: int, h_kv: int, device: torch.device, what: str
) -> tuple[torch.Tensor, tuple[int, int]]:
    """A 0-d / (1,) / [H_kv] / [B, 1, 1, 1] fp32 scale -> (tensor, strides over (batch, KV head))."""
    if s is None:
        return torch.ones(1, dtype=torch.float32, device=device), (0, 0)
    s = s.to(device=device, dtype=torch.float32)
    if s.dim() == 4 and tuple(s.shape) == (b, 1, 1, 1):
        return s.reshape(b).contiguous(), (1, 0)
    s = s.reshape(-1)
    if s.numel() == 1:
        return s, (0, 0)
    if s.numel() != h_kv:
        raise UsageError(
            f"{what} has {s.numel()} entries; expected 1 (per tensor), {h_kv} (per KV head) or [{b}, 1, 1, 1] "
            "(per sequence)"
        )
    return s.contiguous(), (0, 1)


def _block_scale_strides(
    bs: torch.Tensor | None, dummy: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...]]:
    if bs is None:
        return dummy, (0, 0, 0, 0)
    return bs, tuple(bs.stride())  # type: ignore[return-value]


def _dot_kind(interpret: bool, q_dtype: torch.dtype, code_dtype: torch.dtype, fmt_id: int) -> int:
    """Dot operand dtype: bf16 / fp16 only where q and every dequantized tile value are exact in it (FP8 and int8
    codes fit both; FP4 times a block scale, and BF16 codes, need bf16's exponent range; fp16 codes need fp16's
    mantissa); float32 otherwise (TurboQuant's Lloyd-Max centroids and uniform values are float32 numbers), and
    always under the interpreter (its bf16 dot is broken)."""
    if interpret or fmt_id in FMT_TQ:  # TurboQuant centroids and code * scale + min: float32 values
        return DOT_F32
    if q_dtype == torch.bfloat16 and (fmt_id != FMT_PLAIN or code_dtype == torch.bfloat16):
        return DOT_BF16
    if q_dtype == torch.float16 and (fmt_id in (FMT_FP8, FMT_INT8, FMT_FP8_TOKEN, FMT_INT4_RHT) or code_dtype == torch.float16):
        return DOT_F16
    return DOT_F32


def _pair_dot_kind(
    interpret: bool,
    q_dtype: torch.dtype,
    code_dtypes: tuple[torch.dtype, torch.dtype],
    fmt_ids: tuple[int, int],
) -> int:
    """One dot type for both products: K's and V's when they agree, float32 otherwise (a K/V format pair)."""
    kinds = {_dot_kind(interpret, q_dtype, c, f) for c, f in zip(code_dtypes, fmt_ids, strict=True)}
    return kinds.pop() if len(kinds) == 1 else DOT_F32


def _check_inputs(q: torch.Tensor, k: Any, v: Any, fk: Any, fv: Any) -> tuple[int, int, int, int, int, int]:
    """fk / fv: K's and V's formats (the same unless a K/V format pair)."""
    if q.dim() != 4:
        raise UsageError(f"q must be [B, H_q, Tq, D], got shape {tuple(q.shape)}")
    b, hq, tq, d = q.shape
    kc, vc = k.codes, v.codes
    if kc.dim() != 4 or vc.dim() != 4 or kc.shape[:3] != vc.shape[:3]:
        raise UsageError(
            f"k/v codes must both be [B, H_kv, Tk, D'], got {tuple(kc.shape)} and {tuple(vc.shape)}"
        )
    bk, hkv, tk, _ = kc.shape
    for f, codes in ((fk, kc), (fv, vc)):
        # codes per (token, head): D, D/2 (two per byte) or ceil(D * b / 8) (TurboQuant's packed b-bit codes)
        dc, fid = codes.shape[-1], f.triton_kernel
        want = f.storage_widths(d)[0] if fid in FMT_TQ else d
        if bk != b or (dc * 2 if fid in FMT_HALF else dc) != want:
            raise UsageError(
                f"q {tuple(q.shape)} and k/v codes {tuple(codes.shape)} do not fit together ({f.name})"
            )
        if f.block_size and d % f.block_size:
            raise UsageError(f"head_dim {d} is not a multiple of {f.name}'s block size {f.block_size}")
    if hq % hkv:
        raise UsageError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if q.device.type != "cuda" and not _interpreting():
        raise UsageError(
            "the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to run them slowly on CPU); use --impl torch"
        )
    for name, t in (("k", kc), ("v", vc)):
        if t.device != q.device:
            raise UsageError(f"{name} codes are on {t.device} but q is on {q.device}")
    return b, hq, tq, d, hkv, tk


def quantized_attention_triton(
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
    v_fmt=None,  # V's format when it differs from K's (a K/V format pair)
    q_scale: float | None = None,
) -> torch.Tensor:
    """Attention of q over quantized K/V storage with dequantization fused into the kernel.

    Same arguments and semantics as `kvcal.kernels.reference.quantized_attention_ref` (without its reference-only
    `compute_dtype` and `p_tile`: with `q_scale` (FP8 attention) P is rounded to e4m3 per key tile of the
    kernel's BLOCK_N, relative to the running row max). q: [B, H_q, Tq, D]; k, v: QTensor storage of
    [B, H_kv, Tk, D]; returns [B, H_q, Tq, D] in q.dtype. Runs on CUDA, or on CPU under TRITON_INTERPRET=1.
    """
    return attention(
        q,
        k,
        v,
        fmt,
        scaling=scaling,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        key_padding=key_padding,
        v_fmt=v_fmt,
        q_scale=q_scale,
    )


def attention(
    q: torch.Tensor,
    k,
    v,
    fmt,
    *,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    v_fmt=None,
    q_scale: float | None = None,
    config: KernelConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`quantized_attention_triton` plus two knobs for tests and benchmarks: `config` pins the tile config
    (no autotuning) and `num_splits` pins the decode key splits."""
    from kvcal import formats  # lazy, as in the reference

    f = formats.get_format(fmt)
    fv = f if v_fmt is None else formats.get_format(v_fmt)
    d = q.shape[-1]
    for side in (f, fv):  # TurboQuant: a power-of-two head_dim (>= 8 with 3-bit codes), as vLLM builds it
        if side.bits:
            side.check_head_dim(d)
    rot_k, rot_v = f.triton_kernel == FMT_INT4_RHT, fv.triton_kernel == FMT_INT4_RHT
    tq_k = f.triton_kernel == FMT_TQ_MSE
    if not (rot_k or rot_v or tq_k):
        return _attention(q, k, v, f, fv, scaling, q_start, k_start, causal, sliding_window, softcap, sinks,
                          key_padding, q_scale, config, num_splits)  # fmt: skip
    if q_scale is not None:
        raise UsageError(
            f"--attention fp8 (an FP8 query) is not emulated with {f.name if rot_k or tq_k else fv.name}"
        )
    if rot_k or rot_v:
        formats.check_int4_head_dim(d)
    qk, sc = q, scaling
    if rot_k:
        # int4_per_token_head stores K/V rotated (H D1 x, norm sqrt(D) |x|): as vLLM's unified_attention_int4, the
        # query is rotated the same way (then q_r . k_r = D q . k, so the logit scale is divided by D) and the
        # output, a mix of rotated V rows, is rotated back and divided by D. Here q and the output stay float32.
        qk, sc = formats.rht(q.float()), float(scaling) / d
    elif tq_k:
        # TurboQuant MSE keys are codes of the rotated unit vector k_rot = k @ PiT: as vLLM's TurboQuant decode, the
        # query is rotated by the same PiT = H / sqrt(D), every layer's. PiT is orthonormal, so q_rot . k_rot =
        # q . k: the logit scale stays; the values are not rotated, so neither is the output. q_rot [B, H_q, Tq, D]
        # float32.
        qk = formats.tq_rotate(q.float())
    out = _attention(qk, k, v, f, fv, sc, q_start, k_start, causal, sliding_window, softcap, sinks, key_padding,
                     None, config, num_splits)  # fmt: skip
    if rot_v:
        out = formats.rht(out.float(), inverse=True) / float(d)
    return out.to(q.dtype)


def _attention(
    q: torch.Tensor,
    k,
    v,
    f,
    fv,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    key_padding: torch.Tensor | None,
    q_scale: float | None,
    config: KernelConfig | None,
    num_splits: int | None,
) -> torch.Tensor:
    from kvcal.kernels.reference import quantize_query

    if q_scale is not None:  # FP8 attention: e4m3 query codes, q_scale folded into the logit scale (as FA3)
        q, scaling = quantize_query(q, q_scale), float(scaling) * float(q_scale)
    # a format sharing another's storage (nvfp4_4over6 -> nvfp4) reads as that one
    fmt_id, fmt_v = f.triton_kernel, fv.triton_kernel
    b, hq, tq, d, hkv, tk = _check_inputs(q, k, v, f, fv)
    out = torch.empty((b, hq, tq, d), dtype=q.dtype, device=q.device)
    if tq == 0:
        return out
    if tk == 0:
        return out.zero_()
    _check_options(sliding_window, softcap)
    kern = _kernels()
    ops = _operands(q, k, v, (f, fv), (fmt_id, fmt_v), b, hq, hkv, tk, sinks, key_padding)
    plan = _plan_launch(
        kern,
        q,
        (k.codes.dtype, v.codes.dtype),
        (fmt_id, fmt_v),
        b,
        hkv,
        tq,
        tk,
        hq // hkv,
        d,
        config,
        num_splits,
    )
    args = (
        q, k.codes, v.codes, ops.kbs, ops.vbs, ops.ksc, ops.vsc, ops.cent, ops.sinks, ops.kp, out, plan.part_ml,
        plan.part_acc, *q.stride(), *k.codes.stride(), *v.codes.stride(), *ops.kbs_st, *ops.vbs_st, *ops.ksc_st,
        *ops.vsc_st, *ops.kp_st, *out.stride(), hkv, tq, tk, hq // hkv, int(q_start), int(k_start),
        int(sliding_window or 0), float(scaling), float(softcap or 0.0), _next_pow2(tk),
    )  # fmt: skip
    consts = dict(
        FMT=fmt_id,
        BLOCK_SIZE=max(2, f.block_size),
        FMT_V=fmt_v,
        BLOCK_SIZE_V=max(2, fv.block_size),
        BITS=f.bits if fmt_id in FMT_TQ else 0,
        BITS_V=fv.bits if fmt_v in FMT_TQ else 0,
        HEAD_DIM=d,
        D_PAD=plan.d_pad,
        CAUSAL=bool(causal),
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        HAS_KPAD=key_padding is not None,
        P_FP8=q_scale is not None,
        SPLIT=plan.split,
        DOT_KIND=plan.dot_kind,
        # float32 dots: exact under the interpreter; on CUDA 3xTF32 (tensor cores, about float32 accuracy) — plain
        # "ieee" float32 dots spill hundreds of registers at every tile size
        DOT_PREC="ieee" if kern.interpret else "tf32x3",
    )
    guard = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _launch(kern, args, consts, plan, b * hkv)
        if plan.split:
            kern.combine[(b * hq * tq,)](
                plan.part_ml, plan.part_acc, ops.sinks, out, hq, tq, plan.num_splits, *out.stride(),
                HEAD_DIM=d, D_PAD=plan.d_pad, S_PAD=max(2, _next_pow2(plan.num_splits)), HAS_SINKS=sinks is not None,
            )  # fmt: skip
    return out


def _check_options(sliding_window: int | None, softcap: float | None) -> None:
    if sliding_window is not None and sliding_window <= 0:
        raise UsageError(f"sliding_window must be positive, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise UsageError(f"softcap must be positive, got {softcap}")


@dataclass
class _Operands:
    """Kernel operands besides q/k/v codes and out: block scales, scales, sinks, key padding, with strides."""

    kbs: torch.Tensor
    kbs_st: tuple[int, ...]
    vbs: torch.Tensor
    vbs_st: tuple[int, ...]
    ksc: torch.Tensor
    ksc_st: tuple[int, int]
    vsc: torch.Tensor
    vsc_st: tuple[int, int]
    cent: torch.Tensor  # TurboQuant MSE keys: the centroid table float32 [2**bits]; a dummy otherwise
    sinks: torch.Tensor
    kp: torch.Tensor
    kp_st: tuple[int, ...]


def _operands(
    q: torch.Tensor,
    k: Any,
    v: Any,
    fs: tuple[Any, Any],
    ids: tuple[int, int],
    b: int,
    hq: int,
    hkv: int,
    tk: int,
    sinks: torch.Tensor | None,
    key_padding: torch.Tensor | None,
) -> _Operands:
    """Checked kernel operands (dummies where the format or call has none). fs / ids: (K, V) formats and codes."""
    dev = q.device
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    for f, fid, x, name in ((fs[0], ids[0], k, "K"), (fs[1], ids[1], v, "V")):
        if fid in FMT_TOKEN and x.block_scales is None:
            raise UsageError(f"{f.name} {name} needs its per-token scales (block_scales)")
        if fid >= FMT_NVFP4 and x.block_scales is None:
            raise UsageError(f"{f.name} {name} needs its block scales")
    kbs, kbs_st = _block_scale_strides(k.block_scales, dummy)
    vbs, vbs_st = _block_scale_strides(v.block_scales, dummy)
    # the scale of the fp8 / nvfp4 families; TurboQuant's FP8 keys (`tq_fp8`, read as the fp8 family) apply none,
    # whatever QTensor.scale holds, as formats.dequantize
    k_s, v_s = (
        x.scale if fid in (FMT_FP8, FMT_NVFP4) and f.calibratable else None
        for x, fid, f in zip((k, v), ids, fs, strict=True)
    )
    ksc, ksc_st = _scale_arg(k_s, b, hkv, dev, "k scale")
    vsc, vsc_st = _scale_arg(v_s, b, hkv, dev, "v scale")
    # the Lloyd-Max centroids of N(0, 1/D) the codes index (formats.tq_centroids, cached per device)
    cent = tq_centroids(q.shape[-1], fs[0].bits, dev) if ids[0] == FMT_TQ_MSE else dummy
    sinks_t = dummy
    if sinks is not None:
        if sinks.numel() != hq:
            raise UsageError(
                f"sinks must have one logit per query head ({hq}), got shape {tuple(sinks.shape)}"
            )
        sinks_t = sinks.to(device=dev).reshape(-1).contiguous()
    kp, kp_st = torch.zeros(1, dtype=torch.uint8, device=dev), (0, 0)
    if key_padding is not None:
        if tuple(key_padding.shape) != (b, tk):
            raise UsageError(f"key_padding must be [B, Tk] = [{b}, {tk}], got {tuple(key_padding.shape)}")
        kp = key_padding.to(device=dev, dtype=torch.bool).view(torch.uint8)
        kp_st = tuple(kp.stride())
    return _Operands(kbs, kbs_st, vbs, vbs_st, ksc, ksc_st, vsc, vsc_st, cent, sinks_t, kp, kp_st)


@dataclass
class _LaunchPlan:
    """Tile sizes, key splits and dot type of one call (`_plan_launch`)."""

    d_pad: int
    dot_kind: int
    decode: bool
    block_m: int
    rows: int
    pinned: dict[str, int]
    m_tiles: int | None
    num_splits: int
    part_ml: torch.Tensor
    part_acc: torch.Tensor

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def _pinned_config(kern: _Kernels, config: KernelConfig | None, block_m: int) -> dict[str, int]:
    """The tile config fixed by the caller, KVCAL_TRITON_CONFIG or the interpreter; {} = autotune."""
    c = config if config is not None else (_interpreter_config(block_m) if kern.interpret else None)
    if config is None and os.environ.get(_CONFIG_ENV):
        return parse_config(os.environ[_CONFIG_ENV])
    if c is None:
        return {}
    return {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "num_warps": c.num_warps, "num_stages": c.num_stages}


def _plan_launch(
    kern: _Kernels,
    q: torch.Tensor,
    code_dtypes: tuple[torch.dtype, torch.dtype],
    fmt_ids: tuple[int, int],
    b: int,
    hkv: int,
    tq: int,
    tk: int,
    group: int,
    d: int,
    config: KernelConfig | None,
    num_splits: int | None,
) -> _LaunchPlan:
    dev = q.device
    d_pad = max(32, _next_pow2(d))  # FP4 half tiles need D_PAD/2 >= 16 for tl.dot
    rows = tq * group
    decode = rows <= _DECODE_MAX_ROWS
    block_m = max(16, _next_pow2(rows)) if decode else 64
    pinned = _pinned_config(kern, config, block_m)
    block_m = pinned.get("BLOCK_M", block_m)
    if decode:
        if num_splits is None:
            progs = b * hkv * triton.cdiv(rows, block_m)
            num_splits = _choose_splits(progs, tk, pinned.get("BLOCK_N", 32) if pinned else 64, dev)
        num_splits = max(1, int(num_splits))
    else:
        num_splits = 1 if num_splits is None else max(1, int(num_splits))
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    part_ml = part_acc = dummy
    if num_splits > 1:
        part_ml = torch.empty((b * hkv * group * tq * num_splits * 2,), dtype=torch.float32, device=dev)
        part_acc = torch.empty((b * hkv * group * tq * num_splits * d_pad,), dtype=torch.float32, device=dev)
    return _LaunchPlan(
        d_pad=d_pad,
        dot_kind=_pair_dot_kind(kern.interpret, q.dtype, code_dtypes, fmt_ids),
        decode=decode,
        block_m=block_m,
        rows=rows,
        pinned=pinned,
        m_tiles=triton.cdiv(rows, block_m) if pinned else None,
        num_splits=num_splits,
        part_ml=part_ml,
        part_acc=part_acc,
    )


def _launch(kern: _Kernels, args: tuple, consts: dict[str, Any], plan: _LaunchPlan, bh: int) -> None:
    pinned = plan.pinned
    if pinned:
        grid = (plan.m_tiles, bh, plan.num_splits)
        kern.attn[grid](
            *args, **consts, BLOCK_M=plan.block_m, BLOCK_N=pinned.get("BLOCK_N", 32),
            num_warps=pinned.get("num_warps", 4), num_stages=pinned.get("num_stages", 2),
        )  # fmt: skip
    else:
        tuned = _tuned(kern, "decode" if plan.decode else "prefill", plan.block_m)
        rows, splits = plan.rows, plan.num_splits
        tuned[lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), bh, splits)](*args, **consts)
