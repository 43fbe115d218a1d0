"""TurboQuant (vLLM `--kv-cache-dtype turboquant_*`): each preset is a K/V pair of side formats (docs/formats.md:
turboquant_*). The side rows and presets live here; the numbers (rotation, centroids, packing) in
`kvcal.formats.tq_numbers`. Transcribed from vllm-project/vllm:
  vllm/model_executor/layers/quantization/turboquant/config.py @ 1471680b24719d9d3b2fe1235878196142af89cc, the
    same in the 0.32.0 / 0.33.0 wheels (TQ_PRESETS, key_packed_size / value_packed_size / slot_size_aligned,
    get_boundary_skip_layers)
and the files named in tq_numbers; tests/conformance/test_vllm_turboquant.py runs the release's own store path."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcal.errors import UsageError
from kvcal.formats.codec import Codec, KVFormat, register
from kvcal.formats.constants import (
    FP8_E4M3_MAX,
    TQ_BOUNDARY_LAYERS,
    TQ_NC_EPS,
    TQ_SCALE_MIN,
)
from kvcal.formats.qtensor import QTensor, _to, _to_keep_inf, as_f32
from kvcal.formats.tq_numbers import (
    tq_centroids,
    tq_hadamard_entry,
    tq_midpoints,
    tq_pack,
    tq_rotate,
    tq_unit_rotate,
    tq_unpack,
)

_U8, _E4M3 = torch.uint8, torch.float8_e4m3fn

# TurboQuant (vLLM `--kv-cache-dtype turboquant_*`, see the module docstring): K and V are stored in two different
# ways, so each preset is a named K/V pair of the side formats below. A side is no engine's cache dtype on its own:
# it is reachable only through its preset (`kv_pair`), never by name in -f or in `k=...,v=...`.
# name, element, bits, description (vLLM vllm/model_executor/layers/quantization/turboquant/config.py TQ_PRESETS)
# fmt: off
_TQ_SIDE_ROWS: tuple[tuple[str, str, int, str], ...] = (
    ("tq_fp8", "tq_fp8", 8, "TurboQuant FP8 keys: E4M3FN of K itself, no scale, no rotation"),
    ("tq_mse4_nc", "tq_mse", 4, "TurboQuant keys: Hadamard rotation of K / |K|, 4-bit Lloyd-Max codes, fp16 norm, "
     "unit-norm corrected centroids"),
    ("tq_mse3_nc", "tq_mse", 3, "TurboQuant keys: Hadamard rotation of K / |K|, 3-bit Lloyd-Max codes, fp16 norm, "
     "unit-norm corrected centroids"),
    ("tq_uniform4", "tq_uniform", 4, "TurboQuant values: asymmetric 4-bit [min, max] per (token, head), fp16 "
     "scale and zero"),
    ("tq_uniform3", "tq_uniform", 3, "TurboQuant values: asymmetric 3-bit [min, max] per (token, head), fp16 "
     "scale and zero"),
)
# fmt: on
# element -> (codes dtype, block-scales dtype, Triton FMT family of kvcal.kernels.triton_attention): FP8 keys are
# fp8_e4m3's storage at scale 1 (the FP8 family, 1); MSE keys (7) and uniform values (8) are TurboQuant's own
# families. cpu_write.c's format id per side: _TQ_C_KERNEL.
_TQ_STORAGE = {
    "tq_fp8": (_E4M3, None, 1),
    "tq_mse": (_U8, torch.float16, 7),
    "tq_uniform": (_U8, torch.float16, 8),
}
_TQ_C_KERNEL = {"tq_fp8": 12, "tq_mse4_nc": 13, "tq_mse3_nc": 14, "tq_uniform4": 15, "tq_uniform3": 16}
TQ_SIDES: dict[str, KVFormat] = {
    name: KVFormat(
        name, (), element, 0, False, None, {}, desc, "", *_TQ_STORAGE[element], _TQ_C_KERNEL[name], bits
    )
    for name, element, bits, desc in _TQ_SIDE_ROWS
}
# preset -> (K side, V side): key_quant_bits 8 = FP8 keys, else MSE keys with norm_correction (the _nc presets)
TQ_PRESETS: dict[str, tuple[KVFormat, KVFormat]] = {
    "turboquant_k8v4": (TQ_SIDES["tq_fp8"], TQ_SIDES["tq_uniform4"]),
    "turboquant_4bit_nc": (TQ_SIDES["tq_mse4_nc"], TQ_SIDES["tq_uniform4"]),
    "turboquant_k3v4_nc": (TQ_SIDES["tq_mse3_nc"], TQ_SIDES["tq_uniform4"]),
    "turboquant_3bit_nc": (TQ_SIDES["tq_mse3_nc"], TQ_SIDES["tq_uniform3"]),
}
TQ_PRESET_DESCRIPTIONS: dict[str, str] = {
    "turboquant_k8v4": "FP8 E4M3 keys (no scale) + 4-bit uniform values (fp16 scale/zero)",
    "turboquant_4bit_nc": "Hadamard-rotated 4-bit Lloyd-Max keys (fp16 norm, norm-corrected) + 4-bit uniform values",
    "turboquant_k3v4_nc": "Hadamard-rotated 3-bit Lloyd-Max keys (fp16 norm, norm-corrected) + 4-bit uniform values",
    "turboquant_3bit_nc": "Hadamard-rotated 3-bit Lloyd-Max keys (fp16 norm, norm-corrected) + 3-bit uniform values",
}


def is_tq_preset(name: object) -> bool:
    return isinstance(name, str) and name.strip().lower() in TQ_PRESETS


def is_tq_mse(f: KVFormat) -> bool:
    """A TurboQuant side of Hadamard-rotated Lloyd-Max codes (the MSE keys), as opposed to its FP8 keys or uniform
    values."""
    return f.element == "tq_mse"


def tq_side_extra_bytes(f: KVFormat) -> int:
    """Bytes a TurboQuant side stores per (token, head) beside its codes: the fp16 norm of a key (2), the fp16 scale
    and zero of a value (4), nothing for FP8 keys."""
    return {"tq_mse": 2, "tq_uniform": 4}.get(f.element, 0)


def tq_slot_bytes(preset: str, head_dim: int) -> int:
    """vLLM's TurboQuantConfig.slot_size_aligned: bytes per (token, KV head) of a TurboQuant layer, K and V together
    ([key_packed | value_packed], rounded up to an even count)."""
    k, v = TQ_PRESETS[preset]
    kps = head_dim if k.element == "tq_fp8" else math.ceil(head_dim * k.bits / 8) + 2
    vps = math.ceil(head_dim * v.bits / 8) + 4
    s = kps + vps
    return s + s % 2


def tq_boundary_layers(num_layers: int, n: int = TQ_BOUNDARY_LAYERS) -> frozenset[int]:
    """vLLM's get_boundary_skip_layers for a dense model: the first n and last n layers, n capped at half."""
    if n <= 0 or num_layers <= 0:
        return frozenset()
    n = min(n, num_layers // 2)
    return frozenset(range(n)) | frozenset(range(num_layers - n, num_layers))


def check_tq_sliding(name: str, sliding: list[int]) -> None:
    """UsageError when a TurboQuant preset would hold sliding-window layers (their indices, the skipped ones left
    out): vLLM's TurboQuantAttentionImpl takes no sliding window (its decode kernel and prefill attend every cached
    token) and a sliding layer's KV spec is no TurboQuant page, so what vLLM computes there is not established."""
    if sliding:
        raise UsageError(
            f"{name} on sliding-window layers ({', '.join(map(str, sliding[:6]))}{'...' if len(sliding) > 6 else ''}) "
            "is not emulated: vLLM's TurboQuant attention takes no sliding window; keep them in BF16 with "
            "--skip-layers sliding_window (vLLM: --kv-cache-dtype-skip-layers sliding_window)"
        )


def check_tq_head_dim(name: str, d: int) -> None:
    """UsageError unless vLLM builds this preset's cache for head_dim d."""
    if d < 2 or d & (d - 1):
        raise UsageError(
            f"{name} needs a power-of-two head_dim (vLLM builds a head_dim-point Sylvester Hadamard matrix for every "
            f"TurboQuant layer, turboquant_k8v4 included), got {d}"
        )
    k, v = TQ_PRESETS[name] if name in TQ_PRESETS else (TQ_SIDES[name], TQ_SIDES[name])
    if d < 8 and 3 in (k.bits, v.bits):
        raise UsageError(f"{name} packs 3-bit codes in groups of 8 elements: head_dim must be at least 8, got {d}")


def _nan_rows(bad: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """fill (float16 [..., n]) with NaN in the rows where bad ([..., 1])."""
    return torch.where(bad, torch.tensor(float("nan"), dtype=fill.dtype, device=fill.device), fill)


def _quantize_tq_fp8(xf: torch.Tensor) -> QTensor:
    # _tq_fused_store_fp8: k.to(float8e4nv) in the kernel (Hopper's cvt.rn.satfinite): RNE, +-448 saturated, no scale
    return QTensor(codes=xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))


def tq_quantize_mse(xf: torch.Tensor, f: KVFormat, signs: torch.Tensor | None = None) -> QTensor:
    """Keys xf float32 [..., D] of a tq_mse side: codes of the rotated unit vector, fp16 norm (the releases'
    triton_turboquant_store: no signs). signs [D]: LMCache's serde rotates by diag(signs) H / sqrt(D) instead."""
    d = xf.shape[-1]
    bad = ~torch.isfinite(xf).all(dim=-1, keepdim=True)  # [..., 1]
    norm, y = tq_unit_rotate(torch.where(bad, 0.0, xf), signs)  # [..., 1], x_hat @ PiT [..., D]
    # the kernel's binary search: code = number of midpoints <= y
    idx = torch.bucketize(y, tq_midpoints(d, f.bits, xf.device), right=True).to(torch.uint8)
    idx = torch.where(bad, 0, idx)
    # NaN marker: a non-finite row is stored with a NaN norm (vLLM's NaN / Inf norm makes the row NaN / +-Inf too)
    norm16 = _nan_rows(bad, norm.to(torch.float16))  # beyond 65504 the fp16 norm is Inf, as the engine's
    return QTensor(codes=tq_pack(idx, f.bits), block_scales=norm16)


def _quantize_tq_uniform(xf: torch.Tensor, f: KVFormat) -> QTensor:
    """Values xf float32 [..., D]: _store_quantized_value (scale in float32 for the codes, stored as fp16)."""
    levels = float(2**f.bits - 1)
    bad = ~torch.isfinite(xf).all(dim=-1, keepdim=True)  # [..., 1]
    xz = torch.where(bad, 0.0, xf)
    vmin, vmax = xz.amin(dim=-1, keepdim=True), xz.amax(dim=-1, keepdim=True)
    s = (vmax - vmin) / levels
    s = torch.where(s > TQ_SCALE_MIN, s, TQ_SCALE_MIN)
    # ((v - min) / scale + 0.5).to(int32): truncation, of a value >= 0.5 (v >= min)
    q = torch.trunc((xz - vmin) / s + 0.5).clamp_(0.0, levels).to(torch.uint8)
    q = torch.where(bad, 0, q)
    words = _nan_rows(bad, torch.cat([s.to(torch.float16), vmin.to(torch.float16)], dim=-1))  # [..., 2]
    return QTensor(codes=tq_pack(q, f.bits), block_scales=words)


def tq_mse_rotated(q: QTensor, f: KVFormat, d: int) -> torch.Tensor:
    """Keys of a tq_mse side in the ROTATED basis, float32 [..., D]: float32(norm16) * centroid[code], the centroid
    vector norm-corrected (what the decode kernels compute before any rotation; LMCache's _tq_full_dequant_kv stores
    it as float16)."""
    c = tq_centroids(d, f.bits, q.codes.device)[tq_unpack(q.codes, f.bits, d)]  # [..., D]
    # NORM_CORRECTION: c * (1 / sqrt(sum(c * c) + 1e-16)); the kernel's tl.sum / tl.sqrt / 1.0 / x are the
    # GPU's (approximate) ones, kvcal's the float64 sum rounded once, correctly rounded sqrt and division
    # (torch's float32 CPU sqrt is not always correctly rounded: sqrt and 1 / x are taken in float64 and rounded
    # to float32, which is the correctly rounded float32 result for float32 operands)
    nsq = c.double().square().sum(dim=-1, keepdim=True).float() + TQ_NC_EPS  # [..., 1] float32
    root = nsq.double().sqrt().float()
    c = c * (1.0 / root.double()).float()
    return q.block_scales.float() * c  # vec_norm (fp16 -> fp32) * centroid


def _dequantize_tq_mse(q: QTensor, f: KVFormat, d: int) -> torch.Tensor:
    """Unrotated float32 keys: norm * centroid (unit-norm corrected) rotated back by Pi = H / sqrt(D) (= PiT).
    vLLM's decode instead rotates the query (q @ PiT) and scores norm * (q_rot . c): the same logits to float32
    rounding."""
    return tq_rotate(tq_mse_rotated(q, f, d))


def _dequantize_tq_uniform(q: QTensor, f: KVFormat, d: int) -> torch.Tensor:
    idx = tq_unpack(q.codes, f.bits, d).float()
    w = q.block_scales.float()  # [..., 2]: fp16 scale, fp16 zero
    # idx * scale + zero: the product is exact (4 + 11 bits), so this rounds once, as the kernel's FMA
    return idx * w[..., :1] + w[..., 1:]


def _tq_head_dim(q: QTensor, f: KVFormat) -> int:
    """head_dim of a TurboQuant side's storage (codes are packed bytes)."""
    n = q.codes.shape[-1]
    return n if f.element == "tq_fp8" else n * 8 // f.bits


def _quantize_tq(x: torch.Tensor, f: KVFormat, scale: torch.Tensor | float | None, checked: bool = False) -> QTensor:
    """A TurboQuant side; `scale` is ignored (TurboQuant applies no k_scale / v_scale)."""
    check_tq_head_dim(f.name, x.shape[-1])
    xf = as_f32(x)
    if f.element == "tq_fp8":
        return _quantize_tq_fp8(xf)
    if f.element == "tq_uniform":
        return _quantize_tq_uniform(xf, f)
    return tq_quantize_mse(xf, f)


def _check_side_head_dim(name: str, f: KVFormat, d: int) -> None:
    check_tq_head_dim(name if name in TQ_PRESETS else f.name, d)


def _mse_c_aux(f: KVFormat, d: int) -> torch.Tensor:
    """cpu_write.c's aux of an MSE key side: the centroids [2**bits] ascending, then the Hadamard entry."""
    return torch.cat([tq_centroids(d, f.bits), torch.tensor([tq_hadamard_entry(d)])])


def _side_bits(f: KVFormat, d: int, model_bits: int) -> float:
    # packed codes + fp16 norm (K) or fp16 scale and zero (V)
    return 8.0 * (math.ceil(d * f.bits / 8) + tq_side_extra_bytes(f)) / d


def _side_widths(f: KVFormat, d: int) -> tuple[int, int | None]:
    return math.ceil(d * f.bits / 8), tq_side_extra_bytes(f) // 2


def _side_codec(family: str, dequantize: Callable[..., torch.Tensor], **kw: object) -> Codec:
    """A TurboQuant side's codec: its quantize (the side picks its store), no scale, vLLM's geometry (a power-of-two
    head_dim, the boundary layers, no sliding window)."""
    return Codec(
        family,
        lambda xf, f, s, e2m1: _quantize_tq(xf, f, s),
        dequantize,
        kw.pop("bits", _side_bits),  # type: ignore[arg-type]
        kw.pop("widths", _side_widths),  # type: ignore[arg-type]
        quantize=_quantize_tq,
        check_head_dim=_check_side_head_dim,
        pow2_head_dim=True,
        boundary_layers=TQ_BOUNDARY_LAYERS,
        sliding=False,
        **kw,  # type: ignore[arg-type]
    )


TQ_FP8 = _side_codec(
    "tq_fp8", lambda q, f, dtype: _to(q.codes.float(), dtype), bits=lambda f, d, mb: 8.0, widths=lambda f, d: (d, None)
)
# an fp16 norm / scale beyond 65504 is Inf: the engine reads +-Inf, so does kvcal (`_to_keep_inf`)
TQ_MSE = _side_codec(
    "tq_mse",
    lambda q, f, dtype: _to_keep_inf(_dequantize_tq_mse(q, f, _tq_head_dim(q, f)), dtype),
    c_aux=_mse_c_aux,
)
TQ_UNIFORM = _side_codec(
    "tq_uniform", lambda q, f, dtype: _to_keep_inf(_dequantize_tq_uniform(q, f, _tq_head_dim(q, f)), dtype)
)
register(TQ_FP8, TQ_MSE, TQ_UNIFORM)
