"""The fused CPU cache write (`cpu_write.c`) and its torch reference.

A decode step writes one token per layer into the cache. On the torch path that is a quantize (`formats.quantize`)
plus a dequantize of the new token into the attention's workspace: 10-60 eager torch ops per layer for K and V,
at ~10 µs each on CPU, which made int8 and the FP4 formats decode at 0.7-0.8x `auto`'s speed at 512 tokens
(bench/RESULTS.md). `cpu_write.c` does the same work in one C call per layer, as an engine's fused
`reshape_and_cache` kernel does: codes and block scales written straight into the cache's storage, float32
values straight into the workspace.

`decode_write_ref` (torch: `formats.quantize_kv` + the torch path's dequantization) is the semantics;
`decode_write` (C) takes the same arguments and returns the same tensors, bit for bit
(tests/kernels/test_cpu_write.py). Formats: every quantized one (`FORMATS`). fp4_e2m1's block exponent comes
from torch's log2, whose last bit depends on where an element sits in a vectorised loop, so no scalar C loop can
promise the same exponent: for it the kernel computes each block's max / 6 (floored at 1e-10), torch the log2 of
those (one op per side, on a tensor of the shape `formats.fp4_e2m1_exponent` computes it on), and the kernel
the rest.

The library is compiled once per source (`cc -O2 -ffp-contract=off`: no fused multiply-add, so every float32
operation rounds as torch's does) into kvcal's cache folder, and loaded with ctypes. Without a C compiler, or with
KVCAL_CPU_WRITE=0, `library()` is None and the cache writes with torch ops (same results, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from kvcal import formats
from kvcal.formats import KVFormat, QTensor
from kvcal.kernels.buffer import TokenBuffer
from kvcal.kernels.fast import _dequantize

SOURCE = Path(__file__).with_name("cpu_write.c")
FLAGS = ("-O2", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
# format name -> the C kernel's format id (cpu_write.c enum)
FORMATS: dict[str, int] = {
    "bf16": 0,
    "fp8_e4m3": 1,
    "fp8_e5m2": 2,
    "int8_per_token_head": 3,
    "nvfp4": 4,
    "nvfp4_4over6": 5,
    "mxfp4": 6,
    "fp4_e2m1": 7,
}
_IN_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 1024  # cpu_write.c's row buffer


class _Side(ctypes.Structure):
    """cpu_write.c's side_t: one of K / V — input, codes, block scales, values (pointers + b/h/t strides in
    elements) and the static / global scale."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("xb", ctypes.c_int64),
        ("xh", ctypes.c_int64),
        ("xt", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("cb", ctypes.c_int64),
        ("ch", ctypes.c_int64),
        ("ct", ctypes.c_int64),
        ("scales", ctypes.c_void_p),
        ("sb", ctypes.c_int64),
        ("sh", ctypes.c_int64),
        ("st", ctypes.c_int64),
        ("vals", ctypes.c_void_p),
        ("vb", ctypes.c_int64),
        ("vh", ctypes.c_int64),
        ("vt", ctypes.c_int64),
        ("scale", ctypes.c_void_p),
        ("gb", ctypes.c_int64),
        ("gh", ctypes.c_int64),
        ("exps", ctypes.c_void_p),
    ]


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, then reused from kvcal's cache folder), or None: KVCAL_CPU_WRITE=0,
    no C compiler, or a failed build (the cache then writes with torch ops)."""
    if os.environ.get("KVCAL_CPU_WRITE", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    from kvcal.models import cache_root

    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    out = cache_root() / "cpu_write" / f"cpu_write-{tag}.so"
    try:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            try:
                subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True)
                os.replace(tmp, out)  # atomic: a concurrent build replaces it with the same bytes
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError):
        return None
    fn = lib.kvcal_write
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int,  # fmt
        ctypes.c_int,  # input dtype
        ctypes.c_int,  # round to bf16 first
        ctypes.c_int64,  # B
        ctypes.c_int64,  # H
        ctypes.c_int64,  # T
        ctypes.c_int,  # D
        ctypes.c_void_p,  # valid [B, T] bytes or NULL
        ctypes.c_int64,  # valid's stride along B
        ctypes.POINTER(_Side),
        ctypes.POINTER(_Side),
        ctypes.POINTER(ctypes.c_int64),  # non-finite counts [2]
    ]
    ratio = lib.kvcal_block_ratio
    ratio.restype = ctypes.c_int
    ratio.argtypes = [*fn.argtypes[1:11], ctypes.c_void_p, ctypes.c_void_p]
    return lib


def supports(
    fmt: KVFormat, x: torch.Tensor, kv_input_dtype: torch.dtype | None, scale: torch.Tensor | None
) -> bool:
    """Whether the C kernel can write new tokens x [B, H_kv, T, D] of `fmt` with this input dtype and scale."""
    return (
        fmt.name in FORMATS
        and x.device.type == "cpu"
        and x.dtype in _IN_DTYPES
        and kv_input_dtype in (None, torch.bfloat16, x.dtype)
        and x.dim() == 4
        and x.stride(-1) == 1
        and x.shape[-1] <= MAX_HEAD_DIM
        and x.shape[-1] % max(fmt.block_size, 2 if fmt.is_fp4 else 1) == 0
        and (
            scale is None
            or (
                scale.dtype == torch.float32
                and scale.device.type == "cpu"
                and _scale_strides(scale, x) is not None
            )
        )
    )


def _scale_strides(s: torch.Tensor, x: torch.Tensor) -> tuple[int, int] | None:
    """(stride along B, along H) of a validated scale (0-d, [H_kv], [B, 1, 1, 1]) read per (b, h) of x."""
    if s.numel() == 1:
        return 0, 0
    if s.dim() == 1 and s.is_contiguous():
        return 0, 1
    if s.dim() == 4 and s.shape[0] == x.shape[0] and s.is_contiguous():
        return 1, 0
    return None


def storage_widths(fmt: KVFormat, d: int) -> tuple[int, int | None]:
    """(code elements, block-scale elements) per token and head of `fmt` for head_dim d."""
    if fmt.is_fp4:
        return d // 2, d // fmt.block_size
    if fmt.element == "int8":
        return d, 1
    return d, None


def storage_dtypes(fmt: KVFormat) -> tuple[torch.dtype, torch.dtype | None]:
    """(codes dtype, block-scale dtype) of `fmt`'s storage, as formats.quantize returns them."""
    if fmt.element == "bf16":
        return torch.bfloat16, None
    if fmt.element in ("e4m3", "e5m2"):
        return (torch.float8_e4m3fn if fmt.element == "e4m3" else torch.float8_e5m2), None
    if fmt.element == "int8":
        return torch.int8, torch.float32
    return torch.uint8, (torch.float8_e4m3fn if fmt.layout == "nvfp4" else torch.uint8)


def _buffer_side(
    x: torch.Tensor, buf: TokenBuffer, dtype: torch.dtype, width: int, n: int
) -> tuple[int, int, int, int]:
    """Make room for n tokens after buf's live ones ([B, H, capacity, width] of dtype); (pointer to the first new
    slot, strides along b, h, t in elements)."""
    b, h = x.shape[0], x.shape[1]
    buf.reserve(n, (b, h), width, dtype, x.device)
    d = buf.data
    cap = d.shape[-2]  # type: ignore[union-attr]
    return d.data_ptr() + buf.end * width * d.element_size(), h * cap * width, cap * width, width  # type: ignore[union-attr]


def write_into(
    fmt: KVFormat,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    valid: torch.Tensor | None,
    kv_input_dtype: torch.dtype | None,
    buffers: tuple[
        tuple[TokenBuffer, TokenBuffer, TokenBuffer], tuple[TokenBuffer, TokenBuffer, TokenBuffer]
    ],
) -> tuple[int, int]:
    """Quantize new K and V [B, H_kv, T, D] (`supports` holds for both) and append their codes, block scales and
    float32 values to the (codes, block scales, values) TokenBuffers of K and of V; returns the non-finite counts
    of K's and V's real tokens. valid: [B, T] bool or None (all real); kv_input_dtype: the dtype K/V are rounded
    to first (bf16, or None / their own: as they are)."""
    lib = library()
    assert lib is not None
    round_bf16 = kv_input_dtype == torch.bfloat16 and k.dtype != torch.bfloat16
    if valid is not None:
        valid = valid.to(torch.bool)
        if valid.stride(-1) != 1:
            valid = valid.contiguous()
    b, h, t, d = k.shape
    cdt, sdt = storage_dtypes(fmt)
    cw, sw = storage_widths(fmt, d)
    sides = []
    for x, s, (cbuf, sbuf, vbuf) in ((k, k_scale, buffers[0]), (v, v_scale, buffers[1])):
        xs = x.stride()
        c = _buffer_side(x, cbuf, cdt, cw, t)
        sc = (0, 0, 0, 0) if sdt is None else _buffer_side(x, sbuf, sdt, sw, t)  # type: ignore[arg-type]
        vl = _buffer_side(x, vbuf, torch.float32, d, t)
        g = (0, 0, 0) if s is None else (s.data_ptr(), *_scale_strides(s, x))  # type: ignore[misc]
        sides.append(_Side(x.data_ptr(), xs[0], xs[1], xs[2], *c, *sc, *vl, *g))
    vp, vb = (None, 0) if valid is None else (valid.data_ptr(), valid.stride(0))
    if fmt.name == "fp4_e2m1":
        # its block exponent by torch's log2 on a tensor of the shape formats._quantize_fp4_e2m1 computes it on
        # (contiguous [B, H, T, D/16]: the same bits), from the ratios the kernel computes
        ratio = torch.empty(2, b, h, t, d // 16)  # K's, V's: each contiguous [B, H, T, D/16]
        lib.kvcal_block_ratio(
            _IN_DTYPES[k.dtype],
            int(round_bf16),
            b,
            h,
            t,
            d,
            vp,
            vb,
            sides[0],
            sides[1],
            *(r.data_ptr() for r in ratio),
        )
        for side, r in zip(sides, ratio, strict=True):
            side.exps = r.log2_().data_ptr()  # the kernel takes the ceiling (exact anywhere)
    bad = (ctypes.c_int64 * 2)()
    rc = lib.kvcal_write(
        FORMATS[fmt.name], _IN_DTYPES[k.dtype], int(round_bf16), b, h, t, d, vp, vb, sides[0], sides[1], bad
    )
    if rc != 0:
        raise RuntimeError(f"cpu_write.c refused head_dim {d}")
    for cbuf, sbuf, vbuf in buffers:  # the new tokens are written: make them live
        cbuf.end += t
        vbuf.end += t
        if sdt is not None:
            sbuf.end += t
    return bad[0], bad[1]


def decode_write(
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str | KVFormat,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    kv_input_dtype: torch.dtype | None = None,
) -> tuple[QTensor, QTensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The C kernel on fresh storage: (K's QTensor, V's, K's float32 values, V's, non-finite counts of K / V).
    Same arguments and results as `decode_write_ref`. Scales: already validated (formats._static_scale)."""
    f = formats.get_format(fmt)
    bufs = tuple((TokenBuffer(), TokenBuffer(), TokenBuffer()) for _ in range(2))
    bad = write_into(f, k, v, k_scale, v_scale, valid, kv_input_dtype, bufs)  # type: ignore[arg-type]
    out = []
    for (cb, sb, vb), s in zip(bufs, (k_scale, v_scale), strict=True):
        out.append((QTensor(codes=cb.view(), block_scales=sb.view(), scale=s), vb.view()))
    return out[0][0], out[1][0], out[0][1], out[1][1], bad


def decode_write_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str | KVFormat,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    kv_input_dtype: torch.dtype | None = None,
) -> tuple[QTensor, QTensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Torch reference of `decode_write`: what the cache's eager write stores (K/V rounded to `kv_input_dtype`,
    padding positions of `valid` [B, T] zeroed, `formats.quantize_kv`) and the float32 values the torch path's
    attention reads (`reference._dequantize`), with the NaN/Inf count of the real tokens."""
    from kvcal.kernels.cache import without_padding  # cache imports this module

    f = formats.get_format(fmt)
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
    qk, qv = formats.quantize_kv(prepared[0], prepared[1], f, k_scale, v_scale)
    return qk, qv, _dequantize(qk, f), _dequantize(qv, f), (counts[0], counts[1])
