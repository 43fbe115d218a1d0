"""The fused CPU cache write (`cpu_write.c`): a decode step's quantize + dequantize in one C call per layer.

A decode step writes one token per layer into the cache. On the torch path that is a quantize (`formats.quantize`)
plus a dequantize of the new token into the attention's workspace: 10-60 eager torch ops per layer for K and V,
at ~10 µs each on CPU, which made int8 and the FP4 formats decode at 0.7-0.8x `auto`'s speed at 512 tokens
(bench/RESULTS.md). `cpu_write.c` does the same work in one C call per layer, as an engine's fused
`reshape_and_cache` kernel does: codes and block scales written straight into the cache's storage, float32
values straight into the workspace.

Semantics: exactly the cache's torch write (K/V rounded to the input dtype, padding zeroed, `fast.quantize_kv`: `formats.quantize`'s bits)
and the torch path's dequantization (`kvcal.kernels.fast`), bit for bit; the torch reference of `decode_write` is
`decode_write_ref` in kvcal/kernels/testing.py. Formats: those with a `c_kernel` id in formats' table.
fp4_e2m1's block exponent comes from torch's log2, whose last bit depends on where an element sits in a vectorised
loop, so no scalar C loop can promise the same exponent: for it the kernel computes each block's max / 6 (floored
at 1e-10), torch the log2 of those (one op per side, on a tensor of the shape `formats.fp4_e2m1_exponent` computes
it on), and the kernel the rest. int4_per_token_head's Hadamard rotation is `formats.hadamard`'s butterfly (the
same float additions in the same order) with `formats.rht_signs` handed in as the side's `aux`.

Build. The library is compiled once per source by `kvcal.clib` (`cc -O2 -ffp-contract=off`: no fused
multiply-add, so every float32 operation rounds as torch's does) into kvcal's cache folder, and loaded with ctypes.
Before its first use the library's ABI is checked: it reports sizeof and the field offsets of its `side_t` and its
format ids, which must equal ctypes' `_Side` and formats' `c_kernel` column. `library()` is None — and the cache
writes with torch ops, same results, slower — with KVCAL_CPU_WRITE=0 (or KVCAL_C=0), without a C compiler (CC, cc
or gcc on PATH), or when the build, the load or the ABI check fails; the last three warn once (RuntimeWarning with
the compiler's message and how to silence it). `status()` says which, in one line (the kernel tests print it).
"""

from __future__ import annotations

import ctypes
import os
import warnings
from functools import cache
from pathlib import Path

import torch

from kvcal import clib, formats
from kvcal.errors import UsageError
from kvcal.formats import KVFormat, QTensor
from kvcal.kernels.buffer import TokenBuffer

SOURCE = Path(__file__).with_name("cpu_write.c")
# format name -> the C kernel's format id: formats' `c_kernel` column (the ABI check compares cpu_write.c's enum)
# (every single format, and TurboQuant's key and value sides)
FORMATS: dict[str, int] = {
    f.name: f.c_kernel
    for f in (*formats.FORMATS.values(), *formats.TQ_SIDES.values())
    if f.c_kernel is not None
}
_IN_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 1024  # cpu_write.c's row buffer
SILENCE = "set KVCAL_CPU_WRITE=0 to write with torch ops without trying to build it"


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
        ("aux", ctypes.c_void_p),
    ]


def abi_mismatch(lib: ctypes.CDLL, side: type[ctypes.Structure] | None = None) -> str | None:
    """None when the library's side_t and format ids are what this module passes, else what differs. `side`: the
    ctypes struct to compare with (default `_Side`)."""
    side = side or _Side
    try:
        layout, ids = lib.kvcal_side_layout, lib.kvcal_format_id
    except AttributeError as exc:
        return f"the library exports no ABI report ({exc})"
    layout.restype, layout.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    ids.restype, ids.argtypes = ctypes.c_int, [ctypes.c_char_p]
    buf = (ctypes.c_int64 * 64)()
    n = layout(buf, 64)
    theirs = list(buf[:n]) if n > 0 else []
    ours = [ctypes.sizeof(side), *(getattr(side, name).offset for name, _ in side._fields_)]
    if theirs != ours:
        return f"side_t is (sizeof, offsets) {theirs} in C but {ours} in ctypes"
    want = {**FORMATS, **{f"in:{str(d).removeprefix('torch.')}": i for d, i in _IN_DTYPES.items()}}
    got = {name: ids(name.encode()) for name in want}
    if got != want:
        return f"format ids differ: C {got}, kvcal.formats {want}"
    return None


def open_library(source: Path = SOURCE) -> tuple[ctypes.CDLL | None, str]:
    """(the kernel built from `source` and checked, or None; one line saying which: "compiled: PATH" or "skipped:
    REASON"). Warns (RuntimeWarning) when a build, the load or the ABI check fails — not when switched off or
    without a compiler."""
    if os.environ.get("KVCAL_CPU_WRITE", "1") == "0":
        return None, "skipped: KVCAL_CPU_WRITE=0"
    lib, why, out = clib.load(source, "cpu_write")
    if lib is None and why is None:  # switched off or no compiler: not a failure
        return None, f"skipped: {out}"
    if lib is not None:
        bad = abi_mismatch(lib)
        if bad is not None:
            why, lib = f"{out} refused, its ABI differs from cpu_write.py's: {bad}", None
    if why is not None:
        warnings.warn(
            f"kvcal: the fused CPU cache write is off, the cache writes with torch ops (same results, slower): "
            f"{why}\n({SILENCE})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, f"skipped: {why.splitlines()[0]}"
    _declare(lib)  # type: ignore[arg-type]
    return lib, f"compiled: {out}"


@cache
def _opened() -> tuple[ctypes.CDLL | None, str]:
    return open_library()


def library() -> ctypes.CDLL | None:
    """The compiled, ABI-checked kernel (built on first use, then reused from kvcal's cache folder), or None (the
    cache then writes with torch ops; see the module docstring). Built, checked and warned about once."""
    return _opened()[0]


def status() -> str:
    """One line: "compiled: PATH" or "skipped: REASON" (what `library()` found)."""
    return _opened()[1]


def reload() -> None:
    """Forget what `library()` found: the next call looks again (KVCAL_CPU_WRITE, the compiler, the build)."""
    _opened.cache_clear()


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvcal_write
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int,  # K's format
        ctypes.c_int,  # V's format
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
    ratio.argtypes = [*fn.argtypes[2:12], ctypes.c_void_p, ctypes.c_void_p]


@cache
def _ascending_centroids(d: int, bits: int) -> bool:
    """Whether formats.tq_centroids(d, bits) ascend (the kernel takes its midpoints between neighbours, as formats
    does after sorting them)."""
    return bool(formats.tq_centroids(d, bits).diff().gt(0).all())


def supports_layer(fmt: KVFormat, x: torch.Tensor, kv_input_dtype: torch.dtype | None) -> bool:
    """Whether the C kernel can write a layer side of `fmt` whose new tokens look like x [B, H_kv, T, D] (its dtype,
    device, head_dim) with this input dtype: what a layer decides once (the scale of each write: `scale_fits`)."""
    if not (
        fmt.name in FORMATS
        and x.device.type == "cpu"
        and x.dtype in _IN_DTYPES
        and kv_input_dtype in (None, torch.bfloat16, x.dtype)
        and x.dim() == 4
        and x.shape[-1] <= MAX_HEAD_DIM
    ):
        return False
    d = x.shape[-1]
    try:
        fmt.check_head_dim(d)  # the family's geometry rule (blocks; a power of two for a rotation)
    except UsageError:
        return False
    if fmt.bits:  # a TurboQuant side: the kernel's 3-bit groups need d >= 8; MSE keys' midpoints from neighbours
        return d >= 8 and (fmt.element != "tq_mse" or _ascending_centroids(d, fmt.bits))
    return d % (2 if fmt.is_fp4 else 1) == 0


def scale_fits(fmt: KVFormat, scale: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Whether the kernel reads this write's scale of a `fmt` side (fp32 on the CPU, 0-d, [H_kv] or [B, 1, 1, 1]);
    a TurboQuant side takes none (whatever is passed is not read)."""
    return bool(fmt.bits) or scale is None or (
        scale.dtype == torch.float32 and scale.device.type == "cpu" and _scale_strides(scale, x) is not None
    )


def supports(
    fmt: KVFormat, x: torch.Tensor, kv_input_dtype: torch.dtype | None, scale: torch.Tensor | None
) -> bool:
    """Whether the C kernel can write new tokens x [B, H_kv, T, D] of `fmt` with this input dtype and scale:
    `supports_layer` and `scale_fits`, x unit-strided along D."""
    return x.stride(-1) == 1 and supports_layer(fmt, x, kv_input_dtype) and scale_fits(fmt, scale, x)


def _scale_strides(s: torch.Tensor, x: torch.Tensor) -> tuple[int, int] | None:
    """(stride along B, along H) of a validated scale (0-d, [H_kv], [B, 1, 1, 1]) read per (b, h) of x."""
    if s.numel() == 1:
        return 0, 0
    if s.dim() == 1 and s.is_contiguous():
        return 0, 1
    if s.dim() == 4 and s.shape[0] == x.shape[0] and s.is_contiguous():
        return 1, 0
    return None


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
    v_fmt: KVFormat | None = None,
) -> tuple[int, int]:
    """Quantize new K and V [B, H_kv, T, D] (`supports` holds for both) and append their codes, block scales and
    float32 values to the (codes, block scales, values) TokenBuffers of K and of V; returns the non-finite counts
    of K's and V's real tokens. valid: [B, T] bool or None (all real); kv_input_dtype: the dtype K/V are rounded
    to first (bf16, or None / their own: as they are); v_fmt: V's format when a K/V pair differs (TurboQuant)."""
    lib = library()
    assert lib is not None
    round_bf16 = kv_input_dtype == torch.bfloat16 and k.dtype != torch.bfloat16
    if valid is not None:
        valid = valid.to(torch.bool)
        if valid.stride(-1) != 1:
            valid = valid.contiguous()
    b, h, t, d = k.shape
    fmts = (fmt, v_fmt or fmt)
    keep = []  # tensors the kernel reads through `aux`: alive until it returns
    sides = []
    for f, x, s, (cbuf, sbuf, vbuf) in zip(fmts, (k, v), (k_scale, v_scale), buffers, strict=True):
        cdt, sdt = f.codes_dtype, f.scales_dtype  # formats' table
        cw, sw = f.storage_widths(d)
        xs = x.stride()
        c = _buffer_side(x, cbuf, cdt, cw, t)  # type: ignore[arg-type]
        sc = (0, 0, 0, 0) if sdt is None else _buffer_side(x, sbuf, sdt, sw, t)  # type: ignore[arg-type]
        vl = _buffer_side(x, vbuf, torch.float32, d, t)
        # a static / global scale
        g = (0, 0, 0) if s is None or not f.calibratable else (s.data_ptr(), *_scale_strides(s, x))  # type: ignore[misc]
        sides.append(_Side(x.data_ptr(), xs[0], xs[1], xs[2], *c, *sc, *vl, *g))
        aux = f.codec.c_aux(f, d)  # float32 array (int4: its signs; TQ keys: centroids, Hadamard entry)
        if aux is not None:
            keep.append(aux)
            sides[-1].aux = aux.data_ptr()
    vp, vb = (None, 0) if valid is None else (valid.data_ptr(), valid.stride(0))
    # input dtype, round to bf16, B, H, T, D, valid, its stride, K's side, V's side: both entry points take them
    common = (_IN_DTYPES[k.dtype], int(round_bf16), b, h, t, d, vp, vb, sides[0], sides[1])
    if "fp4_e2m1" in (fmts[0].name, fmts[1].name):
        # its block exponent by torch's log2 on a tensor of the shape formats._quantize_fp4_e2m1 computes it on
        # (contiguous [B, H, T, D/16]: the same bits), from the ratios the kernel computes
        ratio = torch.empty(2, b, h, t, d // 16)  # K's, V's: each contiguous [B, H, T, D/16]
        lib.kvcal_block_ratio(*common, *(r.data_ptr() for r in ratio))
        for f, side, r in zip(fmts, sides, ratio, strict=True):
            if f.name == "fp4_e2m1":
                side.aux = r.log2_().data_ptr()  # the kernel takes the ceiling (exact anywhere)
    bad = (ctypes.c_int64 * 2)()
    rc = lib.kvcal_write(FORMATS[fmts[0].name], FORMATS[fmts[1].name], *common, bad)
    if rc != 0:
        raise RuntimeError(f"cpu_write.c refused head_dim {d}")
    for f, (cbuf, sbuf, vbuf) in zip(fmts, buffers, strict=True):  # the new tokens are written: make them live
        cbuf.end += t
        vbuf.end += t
        if f.scales_dtype is not None:
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
    v_fmt: str | KVFormat | None = None,
) -> tuple[QTensor, QTensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The C kernel on fresh storage: (K's QTensor, V's, K's float32 values, V's, non-finite counts of K / V).
    Same arguments and results as the torch reference, `decode_write_ref` in kvcal/kernels/testing.py.
    Scales: already validated (formats.check_scale / static_scale); TurboQuant sides take none.
    v_fmt: V's format when it differs from K's (`fmt`)."""
    f = formats.get_format(fmt)
    fv = None if v_fmt is None else formats.get_format(v_fmt)
    bufs = tuple((TokenBuffer(), TokenBuffer(), TokenBuffer()) for _ in range(2))
    bad = write_into(f, k, v, k_scale, v_scale, valid, kv_input_dtype, bufs, fv)  # type: ignore[arg-type]
    out = []
    for (cb, sb, vb), s in zip(bufs, (k_scale, v_scale), strict=True):
        out.append((QTensor(codes=cb.view(), block_scales=sb.view(), scale=s), vb.view()))
    return out[0][0], out[1][0], out[0][1], out[1][1], bad
