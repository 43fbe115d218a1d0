"""The torch path's fast quantization, dequantization and attention: what the cache and `kvcal.kernels.attention`
run on CPU. Every function here returns the bits of its plain counterpart in `kvcal.formats` /
`kvcal.kernels.reference` (tests/kernels/test_fast_path.py, tests/test_formats_fast.py).

Quantize (`quantize`, `quantize_kv`: `formats.quantize`'s arguments). A decode step quantizes one token per K/V per
layer, where each torch op's fixed overhead, not the arithmetic, is the cost: tensors up to `SMALL` elements round
to E2M1 by one `torch.bucketize` over the signed midpoints instead of ~20 elementwise compares, and K and V of the
formats with the most ops are stacked and quantized in one pass (every step of every format is per element, per
row or per block, so nothing mixes K with V).

`quantized_attention_fast` takes the arguments of `kvcal.kernels.reference.quantized_attention_ref` (plus the
cache sides' `Workspace`s) and returns the same bits: it differs only in how it dequantizes (`dequantize_fast`),
and dequantization is elementwise and exact, so the float32 values it attends over are `formats.dequantize`'s
(tests/kernels/test_fast_path.py holds it to the reference, bit for bit).

Why it is faster. The torch path reads the whole cache at every attention call, so dequantization is its main cost:
- FP8 and FP4 are decoded through 256-entry tables (FP8's scale and saturation folded into a [H, 256] table);
- the saturating clamp is skipped where the scales bound every product below float32's max;
- a cache side's `Workspace` keeps the float32 values of the tokens it has already dequantized (stored codes never
  change), so a decode step dequantizes only the new tokens. Only reads of few queries (`WORKSPACE_MAX_QUERIES`: a
  decode step, a short continuation) fill it: a prefill chunk's read dequantizes its context into a temporary that
  is freed once its layer is done, so a chunked prefill holds one layer's float32 K/V at a time, not every layer's
  (4 bytes per element beside codes of 0.5-2: at 8k tokens of SmolLM2, 30 layers x 2 x 8192 x 3 x 64 x 4 B = 377
  MB per cache, twice that in `kl`, which runs a BF16 baseline cache beside the quantized one). The chunk's
  attention (Tq x Tk) dwarfs re-dequantizing the context (Tk), and the next decode step fills the workspace once.

State. Everything remembered lives in explicit objects owned by the cache: a `Workspace` per cache side (K or V of
one layer) holds the values and a `ScaleMemo` (the FP8 table and the scale's bound, computed from the side's
static scale once). Nothing is attached to tensors. The per-device 256-entry decode tables are constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvcal import formats
from kvcal.formats import KVFormat, QTensor
from kvcal.formats import fp4 as fmt_fp4
from kvcal.formats import fp8 as fmt_fp8
from kvcal.formats import int8 as fmt_int8
from kvcal.formats import plain as fmt_plain
from kvcal.kernels.buffer import TokenBuffer
from kvcal.kernels.reference import P_TILE, attention_on_values

T = TypeVar("T")

# Tensors up to this many elements take the small-tensor paths (fewest torch ops); larger ones formats' own, which
# are the fastest per element.
SMALL = 1 << 16

# 256-entry decode tables per (name, device): constants (they depend on nothing but the format).
_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}
_F32 = torch.finfo(torch.float32)
_F32_HALF = _F32.max / 2
# Elements below which FP8 codes are cast (`.float()`, exact) rather than looked up: the table wins on a large
# tensor (CPU torch converts FP8 element by element), the cast on a decode step's token (fewer ops).
_FEW = 1 << 12
_ONE = torch.ones(())
# Reads of at most this many queries (per sequence) keep what they dequantize in the cache side's `Workspace` (a
# decode step reads the same tokens again at the next step); longer reads (prefill chunks) dequantize into a
# temporary and keep nothing (module docstring). 64: a decode step, a batch's continuation rests, a speculative
# draft; a prefill chunk is hundreds to thousands.
WORKSPACE_MAX_QUERIES = 64


class ScaleMemo:
    """Values computed from one cache side's static / global scale tensor (its FP8 decode table, the bound of its
    products), remembered while that tensor is the one passed and unchanged (its version counter moves with any
    in-place change). A cache side's scale is the same tensor at every read, so a decode step computes none of
    them again. Inference tensors have no version counter: computed every time."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        # what -> (scale, its version, key, value)
        self._kept: dict[str, tuple[torch.Tensor, int, object, Any]] = {}

    def get(self, scale: torch.Tensor, what: str, key: object, compute: Callable[[], T]) -> T:
        kept = self._kept.get(what)
        if kept is not None and kept[0] is scale and kept[1] == scale._version and kept[2] == key:
            return kept[3]
        value = compute()
        if not scale.is_inference():
            self._kept[what] = (scale, scale._version, key, value)
        return value


class Workspace:
    """The float32 values of one cache side's tokens first .. first + len(values) - 1, dequantized as `fmt` with
    `scale`: the torch path's, not cache storage (4 bytes per element of what it has read at decode steps: reads of
    more than `WORKSPACE_MAX_QUERIES` queries keep nothing here; Triton reads codes and never fills it). The cache
    gives a side a new one when its stored tokens change other than by appending (crop, batch re-index, reset)."""

    __slots__ = ("first", "fmt", "memo", "scale", "values")

    def __init__(self) -> None:
        self.values = TokenBuffer()  # float32 [B, H_kv, capacity, D]
        self.first = 0
        self.fmt: str | None = None
        self.scale: torch.Tensor | None = None
        self.memo = ScaleMemo()

    def drop_before(self, first: int) -> None:
        """Forget the values of positions before `first` (a sliding layer's window moved on)."""
        if first > self.first:
            self.values.keep_last(len(self.values) - (first - self.first))
            self.first = first


def same_scale(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def _lut(name: str, device: torch.device) -> torch.Tensor:
    """'fp4' byte -> (low-nibble, high-nibble) E2M1 values [256, 2]; 'e8m0' byte -> 2**(byte - 127) [256]; an FP8
    dtype's name ('float8_e4m3fn', 'float8_e5m2') -> the float32 value of every byte [256] (FP8 -> float32 is
    exact)."""
    key = (name, device)
    if key not in _LUTS:
        b = torch.arange(256)
        if name == "fp4":
            e = formats.E2M1_VALUES
            _LUTS[key] = torch.stack([e[b & 0x0F], e[b >> 4]], dim=-1).to(device)  # [256, 2]
        elif name == "e8m0":
            _LUTS[key] = formats.e8m0_to_float(b.to(torch.uint8)).to(device)  # [256]
        else:
            _LUTS[key] = b.to(torch.uint8).view(getattr(torch, name)).float().to(device)  # [256]
    return _LUTS[key]


def _bcast_scale(s: torch.Tensor, ndim: int) -> torch.Tensor:
    """0-d, [H_kv] or [B, 1, 1, 1] scale -> broadcastable against codes [B, H_kv, T, D']."""
    return s if s.dim() in (0, ndim) else s.reshape((1, -1) + (1,) * (ndim - 2))


def _fp8_values(c: torch.Tensor) -> torch.Tensor:
    """float32 values of FP8 codes (any shape), by table lookup (several times faster than CPU torch's cast)."""
    lut = _lut(str(c.dtype).removeprefix("torch."), c.device)
    # int first: c may be a strided slice of the cache, which reshape would copy
    return lut.index_select(0, c.view(torch.uint8).int().reshape(-1)).view(c.shape)


def _fp8_table(c: torch.Tensor, scale: torch.Tensor | None, memo: ScaleMemo | None) -> torch.Tensor:
    """[H * 256] float32: the value of every code of c's FP8 dtype times each of the H scales, saturated (the same
    float32 product per element as c.float() * scale). Per device for the default scale 1.0 (scale None)."""
    name = str(c.dtype).removeprefix("torch.")
    if scale is None:
        key = (f"{name}*1", c.device)
        if key not in _LUTS:
            one = torch.ones((), device=c.device)
            _LUTS[key] = (
                (_lut(name, c.device)[None, :] * one.reshape(-1, 1)).clamp_(_F32.min, _F32.max).reshape(-1)
            )
        return _LUTS[key]

    def compute() -> torch.Tensor:
        return (
            (_lut(name, c.device)[None, :] * scale.float().reshape(-1, 1))
            .clamp_(_F32.min, _F32.max)
            .reshape(-1)
        )

    return compute() if memo is None else memo.get(scale, "fp8_table", (name, c.device), compute)


def _fp8_scaled(c: torch.Tensor, scale: torch.Tensor | None, memo: ScaleMemo | None) -> torch.Tensor | None:
    """FP8 codes [B, H_kv, T, D] times a 0-d / [1] / [H_kv] scale, saturated, as ONE gather from the [H, 256]
    table; None for other scale shapes ([B, 1, 1, 1])."""
    heads = 1 if scale is None else scale.numel()
    if scale is not None and (scale.dim() > 1 or (heads > 1 and (c.dim() != 4 or c.shape[1] != heads))):
        return None
    table = _fp8_table(c, scale, memo)  # [H * 256]
    idx = c.view(torch.uint8).int()
    if heads > 1:
        idx = idx + torch.arange(0, 256 * heads, 256, dtype=torch.int32, device=c.device)[:, None, None]
    return table.index_select(0, idx.reshape(-1)).view(c.shape)


def _scale_bound(scale: torch.Tensor, factor: float, memo: ScaleMemo | None) -> float:
    """max |scale| * factor as a Python float (remembered in `memo`, so a decode step reads no data for it)."""

    def compute() -> float:
        return float(scale.float().abs().amax()) * factor if scale.numel() else 0.0

    return compute() if memo is None else memo.get(scale, "bound", factor, compute)


def _saturate(y: torch.Tensor, bound: torch.Tensor | float) -> torch.Tensor:
    """formats' saturating cast of y to float32's range; skipped when `bound`, an upper bound of |y| computed from
    the scales, shows no element can be out of range."""
    b = float(bound)
    if math.isfinite(b) and b < _F32_HALF:
        return y
    return y.clamp_(_F32.min, _F32.max)


def _dequantize_float(q: QTensor, f: KVFormat, memo: ScaleMemo | None) -> torch.Tensor:
    c = q.codes
    return c if c.dtype == torch.float32 else c.float()  # exact: no overflow possible


def _dequantize_fp8(q: QTensor, f: KVFormat, memo: ScaleMemo | None) -> torch.Tensor:
    c = q.codes
    if c.numel() <= _FEW and (q.scale is None or _scale_bound(q.scale, f.max_value, memo) < _F32_HALF):
        # a decode step's new token: the cast is exact and the product the table's, and the scale shows no
        # product can overflow (so no clamp): two ops instead of the table's five
        s = _ONE if q.scale is None else _bcast_scale(q.scale.float(), c.dim())
        return c.float() * s
    y = _fp8_scaled(c, q.scale, memo)
    if y is not None:
        return y
    return (_fp8_values(c) * _bcast_scale(q.scale.float(), c.dim())).clamp_(_F32.min, _F32.max)


def _dequantize_int8(q: QTensor, f: KVFormat, memo: ScaleMemo | None) -> torch.Tensor:
    c = q.codes
    y = c.float() * q.block_scales
    y = y.masked_fill_(c == formats.INT8_NAN, math.nan)
    return y.clamp_(_F32.min, _F32.max)


def _dequantize_fp4(q: QTensor, f: KVFormat, memo: ScaleMemo | None) -> torch.Tensor:
    c = q.codes
    # .int() before flattening: codes read from the cache are a strided slice, and reshape would copy them first
    vals = _lut("fp4", c.device).index_select(0, c.int().reshape(-1))  # [N, 2] (code 8 -> NaN)
    vals = vals.view(*c.shape[:-1], -1, f.block_size)  # [..., D/bs, bs]
    bs = q.block_scales
    if f.codec.global_scale:  # nvfp4, nvfp4_4over6: E4M3 block scales x the global scale
        fp8_bs = bs.element_size() == 1 and bs.is_floating_point()
        bsf = _fp8_values(bs) if fp8_bs and bs.numel() > _FEW else bs.float()  # exact either way
        eff = bsf * _bcast_scale(q.scale.float(), c.dim())
        # |E4M3| <= 448 bounds |eff| by 448 |g| without reading eff
        bound: torch.Tensor | float | None = _scale_bound(q.scale, 448.0 * 6.0, memo)
    else:
        eff = _lut("e8m0", c.device).index_select(0, bs.int().reshape(-1)).view(bs.shape)
        bound = None
    y = vals.mul_(eff.unsqueeze(-1)).flatten(-2)  # in place: the gathered table values are this call's own
    if bound is None or not bound < _F32_HALF:
        bound = eff.abs().amax() * 6.0 if eff.numel() else torch.zeros(())  # |E2M1| <= 6
    return _saturate(y, bound)


# codec -> its fast dequantization; a codec not listed dequantizes by formats' own (few ops already: fp16, the
# per-token-head scales, int4's inverse rotation, TurboQuant's sides)
_FAST_DEQUANTIZE: dict[formats.Codec, Callable[[QTensor, KVFormat, ScaleMemo | None], torch.Tensor]] = {
    fmt_plain.AUTO: _dequantize_float,
    fmt_plain.BF16: _dequantize_float,
    fmt_fp8.E4M3: _dequantize_fp8,
    fmt_fp8.E5M2: _dequantize_fp8,
    fmt_fp8.E4M3_CPU: _dequantize_fp8,  # vLLM's CPU build's stores: the same codes x scale, only written otherwise
    fmt_fp8.E5M2_CPU: _dequantize_fp8,
    fmt_int8.INT8_TOKEN: _dequantize_int8,
    fmt_fp4.NVFP4: _dequantize_fp4,
    fmt_fp4.E8M0_FP4: _dequantize_fp4,
}


def _dequantize(q: QTensor, f: KVFormat, memo: ScaleMemo | None = None) -> torch.Tensor:
    """float32 values of every token of q, bit-identical to formats.dequantize(q, f)."""
    fast = _FAST_DEQUANTIZE.get(f.codec)
    return formats.dequantize(q, f) if fast is None else fast(q, f, memo)


def _tail(q: QTensor, n: int) -> QTensor:
    """The QTensor of q's tokens n.. (dim -2 of codes and block scales)."""
    bs = None if q.block_scales is None else q.block_scales[..., n:, :]
    return QTensor(codes=q.codes[..., n:, :], block_scales=bs, scale=q.scale)


def dequantize_fast(
    q: QTensor, fmt: str | KVFormat, ws: Workspace | None = None, first: int = 0, *, keep: bool = True
) -> torch.Tensor:
    """float32 values of q [B, H_kv, T, D], bit-identical to `formats.dequantize(q, fmt)`.

    With a workspace `ws` (q = a cache side's tokens first .. first + T - 1 at absolute positions): only the tokens
    ws does not hold yet are dequantized and appended, and the result is a view of ws. Do not modify it.
    `keep=False` (a prefill chunk's read, `WORKSPACE_MAX_QUERIES`): ws grows by nothing; a view of it where it holds
    every token of q already, else all of q dequantized into a new tensor (ws, if it holds values that are not
    q's, forgets them)."""
    f = formats.get_format(fmt)
    if ws is None:
        return _dequantize(q, f)
    a1 = first + q.codes.shape[-2]
    vals = ws.values
    held = vals.data is not None and vals.data.shape[:-2] == q.codes.shape[:-2] and ws.fmt == f.name
    valid = held and ws.first <= first <= ws.first + len(vals) and same_scale(ws.scale, q.scale)
    if not keep:
        if valid and ws.first + len(vals) >= a1:  # everything read is held (a decode step's values): a view
            o = vals.start + (first - ws.first)
            return vals.data[..., o : o + (a1 - first), :]  # type: ignore[index]
        if not valid:
            ws.values = TokenBuffer()  # values of other tokens: free them now, not at the next decode step
        return _dequantize(q, f, ws.memo)  # [B, H_kv, T, D], freed after this layer's attention
    if not valid:
        ws.values, ws.first, ws.fmt = TokenBuffer(), first, f.name  # start over: nothing held is valid for q
        vals = ws.values
    ws.scale = q.scale  # equal values; the newest tensor makes the next `is` check succeed
    ws.drop_before(first)
    have = ws.first + len(vals)
    if have < a1:
        return vals.append(_dequantize(_tail(q, have - first), f, ws.memo))
    return vals.data[..., vals.start : vals.start + (a1 - first), :]  # a read of fewer tokens than held


def quantized_attention_fast(
    q: torch.Tensor,
    k: QTensor,
    v: QTensor,
    fmt: str | KVFormat,
    *,
    scaling: float,
    q_start: int,
    k_start: int,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    v_fmt: str | KVFormat | None = None,
    q_scale: float | None = None,
    p_tile: int | None = P_TILE,
    workspaces: tuple[Workspace, Workspace] | None = None,
) -> torch.Tensor:
    """`reference.quantized_attention_ref` (same arguments, same result bits, float32) with fast dequantization.

    workspaces: (K's, V's) of the cache sides k and v are read from, whose first token sits at k_start; None for
    K/V that are no cache's storage (everything dequantized). A read of more than `WORKSPACE_MAX_QUERIES` queries
    (a prefill chunk) adds nothing to them."""
    f = formats.get_format(fmt)
    fv = f if v_fmt is None else formats.get_format(v_fmt)
    kws, vws = (None, None) if workspaces is None else workspaces
    keep = q.shape[-2] <= WORKSPACE_MAX_QUERIES  # a decode step keeps the values; a prefill chunk does not
    kd = dequantize_fast(k, f, kws, k_start, keep=keep)  # [B, H_kv, Tk, D] float32
    vd = dequantize_fast(v, fv, vws, k_start, keep=keep)
    return attention_on_values(
        q, kd, vd, scaling=scaling, q_start=q_start, k_start=k_start, causal=causal,
        sliding_window=sliding_window, softcap=softcap, sinks=sinks, key_padding=key_padding, q_scale=q_scale,
        p_tile=p_tile, compute_dtype=torch.float32,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# quantize


def _e2m1_tables() -> dict[str, torch.Tensor]:
    """The constants of the small-tensor E2M1 path (`_e2m1_bucket`): boundaries per tie rule and the code of every
    bucket."""
    mids = torch.tensor(formats.E2M1_MIDPOINTS, dtype=torch.float32)
    down = torch.nextafter(mids, torch.tensor(-float("inf")))  # one ulp below: a tie at this midpoint goes up
    tables = {}
    for ties in ("even", "away"):
        up = torch.tensor([ties == "away" or i % 2 == 1 for i in range(len(mids))])  # tie goes to larger |y|
        pos = torch.where(up, down, mids)  # y > b counts: at a tie y == mids[i], up needs b < y
        # negative side, ascending: -mids[i] reversed; a tie going to larger |y| (more negative) must NOT count
        neg = torch.where(up, -mids, torch.nextafter(-mids, torch.tensor(-float("inf")))).flip(0)
        tables[f"bounds_{ties}"] = torch.cat([neg, pos])  # [14]
        # bucket -> code: 0..6 are -6..-0.5 (sign bit | magnitude 7..1), 7 zero (+0), 8..14 0.5..6, 15 NaN
        tables[f"codes_{ties}"] = torch.tensor(
            [8 | (7 - k) for k in range(7)] + [0] + list(range(1, 8)) + [formats.E2M1_NAN], dtype=torch.uint8
        )
    tables["bucket_values"] = formats.E2M1_VALUES[tables["codes_even"].long()]  # bucket -> value (+0, NaN)
    return tables


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (f"e2m1:{name}", device)
    if key not in _LUTS:
        _LUTS[key] = _e2m1_tables()[name].to(device)
    return _LUTS[key]


def _e2m1_bucket(y: torch.Tensor, ties: str) -> torch.Tensor:
    """int64 bucket of each element of y (any shape) on the signed E2M1 grid: 0 = -6, ..., 6 = -0.5, 7 = zero,
    8 = 0.5, ..., 14 = 6, 15 = NaN — one torch.bucketize (count of boundaries strictly below y) over the 14
    signed midpoints, each moved one float32 ulp down where a tie there goes to the larger value (so `b < y`
    holds at the tie), and one where for NaN. Same codes as formats.e2m1_encode's compares."""
    idx = torch.bucketize(y.float().contiguous(), _table(f"bounds_{ties}", y.device))
    return torch.where(torch.isnan(y), 15, idx)


def e2m1_encode(y: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """formats.e2m1_encode (same codes), by one bucketize for a small tensor."""
    if y.numel() > SMALL or ties not in ("even", "away"):
        return formats.e2m1_encode(y, ties)
    return _table(f"codes_{ties}", y.device).take(_e2m1_bucket(y, ties))


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """formats.PLAIN_E2M1.round (the E2M1 value y rounds to, ties to even; NaN for NaN): one lookup by bucket."""
    if y.numel() > SMALL:
        return formats.PLAIN_E2M1.round(y)
    return _table("bucket_values", y.device).take(_e2m1_bucket(y, "even"))


SMALL_E2M1 = formats.E2M1Rounding(e2m1_encode, _e2m1_round)


def quantize(
    x: torch.Tensor,
    fmt: str | KVFormat,
    scale: float | torch.Tensor | None = None,
    *,
    scale_checked: bool = False,
) -> QTensor:
    """formats.quantize (same arguments, same bits), with the small-tensor E2M1 rounding."""
    e2m1 = SMALL_E2M1 if x.numel() <= SMALL else formats.PLAIN_E2M1  # a large tensor: formats' own, the fastest
    return formats.quantize(x, fmt, scale, scale_checked=scale_checked, e2m1=e2m1)


# Formats whose quantize_kv stacks K and V: those with the most torch ops per call (fp8 and bf16 have ~4, which
# stacking would not reduce). Not fp4_e2m1: its log2 is vectorised on CPU, and an element in a vector's scalar tail
# can get a log2 one ulp off the vectorised one, so its codes may depend on where the element sits in the tensor.
_STACKED = frozenset({"int8_per_token_head", "nvfp4", "nvfp4_4over6", "mxfp4"})


def quantize_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str | KVFormat,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    *,
    scale_checked: bool = False,
) -> tuple[QTensor, QTensor]:
    """(formats.quantize(k, fmt, k_scale), formats.quantize(v, fmt, v_scale)) (`scale_checked` as there), bit for
    bit, with half the torch ops where that pays: small K and V [B, H_kv, T, D] (a decode step's token) of the same
    shape are stacked and quantized in one pass. nvfp4's dynamic global (a scale of None) is per tensor, so it
    quantizes K and V apart."""
    f = formats.get_format(fmt)
    if (
        f.name not in _STACKED
        or k.shape != v.shape
        or k.dtype != v.dtype
        or k.dim() != 4
        or 2 * k.numel() > SMALL
        or (f.calibratable and (k_scale is None or v_scale is None))
    ):
        return (
            quantize(k, f, k_scale, scale_checked=scale_checked),
            quantize(v, f, v_scale, scale_checked=scale_checked),
        )
    ks = formats.static_scale(k_scale, k, None, scale_checked) if f.calibratable else None
    vs = formats.static_scale(v_scale, v, None, scale_checked) if f.calibratable else None
    s = None if ks is None else _stack_scales(ks, vs)  # type: ignore[arg-type]
    q = formats.quantize_f32(formats.as_f32(torch.stack([k, v])), f, s, SMALL_E2M1)  # [2, B, H_kv, T, D]
    return tuple(  # type: ignore[return-value]
        QTensor(
            codes=q.codes[i], block_scales=None if q.block_scales is None else q.block_scales[i], scale=sc
        )
        for i, sc in ((0, ks), (1, vs))
    )


def _stack_scales(ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """Validated 0-d / [H_kv] / [B, 1, 1, 1] scales of K and V -> [2, 1|B, 1|H_kv, 1, 1], against [2, B, H, T, D]."""
    k4 = ks if ks.dim() == 4 else ks.reshape(1, -1, 1, 1)
    v4 = vs if vs.dim() == 4 else vs.reshape(1, -1, 1, 1)
    if ks is vs:
        return k4.unsqueeze(0).expand(2, *k4.shape)
    return torch.stack(torch.broadcast_tensors(k4, v4))
