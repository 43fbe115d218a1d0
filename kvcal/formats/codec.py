"""A format family's codec and a format row (`KVFormat`).

A row of the table (`kvcal.formats.table`) names one format; its `element` picks the codec of its family, which
every consumer asks instead of matching names: quantize / dequantize, storage widths and bits, the geometry rule
(head_dim, boundary layers, sliding windows) and the data the C write needs beside the codes (`c_aux`). The
kernel ids (Triton's family, cpu_write.c's format id) are columns of the row. One module per family
(`kvcal.formats.fp8`, `int8`, `fp4`, `int4`, `turboquant`, `plain`) builds its codecs and `register`s them; a new
family is one such module, its rows, its Triton loader and its C id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcal.errors import UsageError

if TYPE_CHECKING:
    from kvcal.formats.e2m1 import E2M1Rounding
    from kvcal.formats.qtensor import QTensor

# (xf float32 [..., D] (`as_f32`), row, the validated scale or None, E2M1 rounding) -> the stored QTensor
QuantizeF32 = Callable[[torch.Tensor, "KVFormat", "torch.Tensor | None", "E2M1Rounding"], "QTensor"]
# (x as given, row, the user's scale or None, scale_checked) -> the stored QTensor
Quantize = Callable[[torch.Tensor, "KVFormat", "float | torch.Tensor | None", bool], "QTensor"]


def _any_head_dim(name: str, f: KVFormat, d: int) -> None:
    """The default geometry rule: any head_dim that is a whole number of the row's blocks."""
    if f.block_size and d % f.block_size:
        raise UsageError(
            f"{name} needs head_dim divisible by its {f.block_size}-element block, but this model's "
            f"head_dim is {d}; choose fp8_e4m3 or int8_per_token_head"
        )


def _no_aux(f: KVFormat, head_dim: int) -> torch.Tensor | None:
    return None


@dataclass(frozen=True, eq=False)
class Codec:
    """One format family: how its rows store K or V, and what its consumers ask of it."""

    family: str  # the rows' `element`
    quantize_f32: QuantizeF32  # quantize's float32 body
    dequantize: Callable[[QTensor, KVFormat, torch.dtype], torch.Tensor]  # -> values [..., D] as dtype
    bits: Callable[[KVFormat, int, int], float]  # (row, head_dim, model_bits) -> storage bits per element
    widths: Callable[[KVFormat, int], tuple[int, int | None]]  # (row, head_dim) -> (codes, block scales) per row
    # quantize from x as given (None: `as_f32`, then the row's static scale, then quantize_f32 — the generic path,
    # which kvcal.kernels.fast may take with its own E2M1 rounding)
    quantize: Quantize | None = None
    static_scale: bool = False  # a static scale multiplies the codes (x ~ codes * s), default 1.0 (fp8_*, int8)
    global_scale: bool = False  # a global scale multiplies the block scales, default dynamic (nvfp4 storage)
    first_batch: bool = False  # takes vLLM's first-batch scales (calculate_kv_scales)
    packed_e2m1: bool = False  # two E2M1 codes per byte
    check_head_dim: Callable[[str, KVFormat, int], None] = _any_head_dim  # UsageError naming `name` unless d fits
    pow2_head_dim: bool = False  # the rule refuses every head_dim that is not a power of two
    boundary_layers: int = 0  # first and last n layers the engine keeps out of this family (vLLM's TurboQuant: 2)
    sliding: bool = True  # whether the engine builds it on sliding-window layers
    # float32 array the C write reads beside the codes (`side_t.aux`) of (row, head_dim); None = none
    c_aux: Callable[[KVFormat, int], torch.Tensor | None] = _no_aux

    @property
    def scale_default(self) -> float | None:
        """The scale quantize uses when none is given: 1.0 for a static scale, None (dynamic or none) else."""
        return 1.0 if not self.global_scale else None


CODECS: dict[str, Codec] = {}


def register(*codecs: Codec) -> None:
    for c in codecs:
        if c.family in CODECS:
            raise RuntimeError(f"format family {c.family!r} registered twice")
        CODECS[c.family] = c


@dataclass(frozen=True, eq=False)
class KVFormat:
    """One KV-cache format of the docs/formats.md table."""

    name: str  # canonical
    aliases: tuple[str, ...]
    element: str  # its family's codec (`CODECS`): 'auto' | 'bf16' | 'fp16' | 'e4m3' | 'e5m2' | 'int8' | ...
    block_size: int  # elements per block scale along head_dim; 0 = none
    calibratable: bool  # takes a static `scale` (fp8_*: the scale; nvfp4: the global scale)
    max_value: float | None  # largest code magnitude (element units)
    engine_names: dict[str, str | None] = field(default_factory=dict)  # vllm / sglang / trtllm
    description: str = ""
    # the format whose QTensor storage layout this one shares (what dequantize and the kernels read); "" = its own
    # name. nvfp4_4over6 stores exactly nvfp4's codes + E4M3 block scales + global scale: only the choice of the
    # block scale differs, so every reader of nvfp4 reads it.
    layout: str = ""
    codes_dtype: torch.dtype | None = None  # QTensor.codes (None: x itself, 'auto')
    scales_dtype: torch.dtype | None = None  # QTensor.block_scales (None: none)
    triton_kernel: int | None = None  # kvcal.kernels.triton_attention's tile-loader family of this layout
    c_kernel: int | None = None  # kvcal/kernels/cpu_write.c's format id; None = not written by it
    bits: int = 0  # a TurboQuant side's code width (3 or 4; 8 for its FP8 keys); 0 = not a TurboQuant side

    def __post_init__(self) -> None:
        if not self.layout:
            object.__setattr__(self, "layout", self.name)

    @property
    def codec(self) -> Codec:
        return CODECS[self.element]

    def bits_per_element(self, head_dim: int, model_bits: int = 16) -> float:
        """Storage bits per K or V element including scale bytes (per-tensor/per-head scales are negligible).

        `model_bits` is what `auto` stores (16 for a bf16/fp16 model, 32 for float32)."""
        return self.codec.bits(self, head_dim, model_bits)

    @property
    def is_fp4(self) -> bool:
        return self.codec.packed_e2m1

    def storage_widths(self, head_dim: int) -> tuple[int, int | None]:
        """(codes, block scales) elements per token and KV head of the stored QTensor for head_dim (None: no block
        scales)."""
        return self.codec.widths(self, head_dim)

    def check_head_dim(self, head_dim: int, name: str | None = None) -> None:
        """UsageError (naming `name`, default the row's) unless the engine builds this format for head_dim."""
        self.codec.check_head_dim(name or self.name, self, head_dim)

